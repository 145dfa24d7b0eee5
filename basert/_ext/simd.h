/* SIMD helpers shared by the kernels: AVX2/FMA/F16C when built with BASERT_SIMD, scalar otherwise.
 * Every reduction uses 8 partial sums combined in a fixed order, in both builds, so a row's
 * result never depends on how many rows are computed together (batch invariance). */
#ifndef BASERT_SIMD_H
#define BASERT_SIMD_H

#include <math.h>
#include <stddef.h>

#if defined(BASERT_SIMD)
#include <immintrin.h>

/* Sum of the 8 lanes, in the fixed order ((0+4)+(2+6))+((1+5)+(3+7)). */
static inline float basert_hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v);
    __m128 hi = _mm256_extractf128_ps(v, 1);
    __m128 s = _mm_add_ps(lo, hi);
    __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    __m128 u = _mm_add_ss(t, _mm_shuffle_ps(t, t, 0x55));
    return _mm_cvtss_f32(u);
}
#endif

/* Sum of squares of x[0..n), 8 partial sums in a fixed order. */
static inline float basert_sumsq(const float *x, ptrdiff_t n) {
    ptrdiff_t i = 0;
    float total;
#if defined(BASERT_SIMD)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    total = basert_hsum8(acc);
#else
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] = fmaf(x[i + j], x[i + j], acc[j]);
    total = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
#endif
    for (; i < n; i++) total = fmaf(x[i], x[i], total);
    return total;
}

/* out[i] = x[i] * inv * w[i] */
static inline void basert_scale_mul(const float *x, const float *w, float inv, float *out, ptrdiff_t n) {
    ptrdiff_t i = 0;
#if defined(BASERT_SIMD)
    __m256 vinv = _mm256_set1_ps(inv);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv), _mm256_loadu_ps(w + i)));
#endif
    for (; i < n; i++) out[i] = (x[i] * inv) * w[i];
}

/* RMSNorm of one row: out = x / sqrt(mean(x^2) + eps) * w */
static inline void basert_rmsnorm_row(const float *x, const float *w, float eps, float *out, ptrdiff_t n) {
    float inv = 1.0f / sqrtf(basert_sumsq(x, n) / (float)n + eps);
    basert_scale_mul(x, w, inv, out, n);
}

#endif
