/* Row kernels for the element-wise and per-head parts of a layer: gated RMSNorm, SwiGLU, GeGLU, the
 * sigmoid output gate, and rotary embeddings. Each row is computed the same way whatever the number
 * of rows, so results are batch invariant. */
#ifndef BASERT_OPS_H
#define BASERT_OPS_H

#include "simd.h"

static inline float basert_silu(float x) { return x / (1.0f + basert_expf(-x)); }

static inline float basert_sigmoid(float x) { return 1.0f / (1.0f + basert_expf(-x)); }

/* out[i] = silu(gate[i]) * up[i]; out may be gate or up. */
static inline void basert_silu_mul_row(const float *gate, const float *up, float *out, ptrdiff_t n) {
    ptrdiff_t i = 0;
#if defined(BASERT_SIMD)
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 e = basert_exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) out[i] = basert_silu(gate[i]) * up[i];
}

/* GeLU with the tanh approximation, as x * sigmoid(2u) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3):
 * the vector path below performs these float operations in this order. */
#define BASERT_GELU_2C 1.5957691216057308f /* 2 sqrt(2/pi) */
static inline float basert_gelu_tanh(float x) {
    const float z = fmaf(0.044715f, (x * x) * x, x) * BASERT_GELU_2C;
    return x / (1.0f + basert_expf(-z));
}

/* out[i] = gelu_tanh(gate[i]) * up[i] (GeGLU); out may be gate or up. */
static inline void basert_gelu_tanh_mul_row(const float *gate, const float *up, float *out, ptrdiff_t n) {
    ptrdiff_t i = 0;
#if defined(BASERT_SIMD)
    const __m256 one = _mm256_set1_ps(1.0f), a = _mm256_set1_ps(0.044715f), c = _mm256_set1_ps(BASERT_GELU_2C);
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 z = _mm256_mul_ps(_mm256_fmadd_ps(a, _mm256_mul_ps(_mm256_mul_ps(g, g), g), g), c);
        __m256 e = basert_exp8(_mm256_sub_ps(_mm256_setzero_ps(), z));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) out[i] = basert_gelu_tanh(gate[i]) * up[i];
}

/* x[i] = silu(x[i]) */
static inline void basert_silu_row(float *x, ptrdiff_t n) {
    ptrdiff_t i = 0;
#if defined(BASERT_SIMD)
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m256 e = basert_exp8(_mm256_sub_ps(_mm256_setzero_ps(), v));
        _mm256_storeu_ps(x + i, _mm256_div_ps(v, _mm256_add_ps(one, e)));
    }
#endif
    for (; i < n; i++) x[i] = basert_silu(x[i]);
}

/* x[i] *= sigmoid(gate[i]) */
static inline void basert_sigmoid_mul_row(float *x, const float *gate, ptrdiff_t n) {
    ptrdiff_t i = 0;
#if defined(BASERT_SIMD)
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 e = basert_exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_loadu_ps(gate + i)));
        __m256 s = _mm256_div_ps(one, _mm256_add_ps(one, e));
        _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), s));
    }
#endif
    for (; i < n; i++) x[i] *= basert_sigmoid(gate[i]);
}

/* out = ((x / sqrt(mean(x^2) + eps)) * w) * silu(z), the order HF's RMSNormGated rounds in. */
static inline void basert_gated_rmsnorm_row(const float *x, const float *z, const float *w, float eps,
                                            float *out, ptrdiff_t n) {
    float inv = 1.0f / sqrtf(basert_sumsq(x, n) / (float)n + eps);
    ptrdiff_t i = 0;
#if defined(BASERT_SIMD)
    const __m256 one = _mm256_set1_ps(1.0f), vinv = _mm256_set1_ps(inv);
    for (; i + 8 <= n; i += 8) {
        __m256 zv = _mm256_loadu_ps(z + i);
        __m256 e = basert_exp8(_mm256_sub_ps(_mm256_setzero_ps(), zv));
        __m256 y = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv), _mm256_loadu_ps(w + i));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(y, _mm256_div_ps(zv, _mm256_add_ps(one, e))));
    }
#endif
    for (; i < n; i++) out[i] = ((x[i] * inv) * w[i]) * basert_silu(z[i]);
}

/* Rotation of one pair: (a, b) -> (a*c - b*s, b*c + a*s). Written with explicit fmaf so that both
 * pairings and both builds round identically (the compiler would otherwise contract only some). */
static inline void basert_rotate_pair(float *a, float *b, float c, float s) {
    float x = *a, y = *b;
    *a = fmaf(x, c, -(y * s));
    *b = fmaf(y, c, x * s);
}

/* RoPE on one head row: dim i pairs with i + half (split-half, NeoX) or 2i with 2i+1 (interleaved),
 * for i < half; dims from 2*half on are left alone. */
static inline void basert_rope_row(float *x, const float *cos_row, const float *sin_row, ptrdiff_t half,
                                   int interleaved) {
    if (interleaved)
        for (ptrdiff_t i = 0; i < half; i++) basert_rotate_pair(x + 2 * i, x + 2 * i + 1, cos_row[i], sin_row[i]);
    else
        for (ptrdiff_t i = 0; i < half; i++) basert_rotate_pair(x + i, x + i + half, cos_row[i], sin_row[i]);
}

#endif
