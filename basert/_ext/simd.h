/* SIMD helpers shared by the kernels: AVX2/FMA/F16C when built with BASERT_SIMD, scalar otherwise.
 * Every reduction uses 8 partial sums combined in a fixed order, in both builds, so a row's
 * result never depends on how many rows are computed together (batch invariance). */
#ifndef BASERT_SIMD_H
#define BASERT_SIMD_H

#include <math.h>
#include <stddef.h>

#define BASERT_ALWAYS_INLINE static inline __attribute__((always_inline))

/* Below this many elements a kernel runs on the calling thread: at decode size (one token) starting
 * an OpenMP region costs more than the work itself. */
#define BASERT_SERIAL_BELOW 32768
#if defined(_OPENMP)
#include <omp.h>
static inline int basert_threads_for(ptrdiff_t elements) {
    return elements < BASERT_SERIAL_BELOW ? 1 : omp_get_max_threads();
}
#else
static inline int basert_threads_for(ptrdiff_t elements) { (void)elements; return 1; }
#endif

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

/* exp(x) in float32: Cephes polynomial on r = x - n*ln2 (|r| <= ln2/2), then scaled by 2^n in two
 * exact power-of-two steps so that n may reach 128 or -150 (subnormal results are rounded once).
 * Within about 2 ulp; exactly 0 below ln(2^-150), +inf where the result overflows, NaN stays NaN.
 * The scalar and AVX2 versions perform the same float operations (fmaf <-> vfmadd), so an element's
 * value never depends on which path or which position in a row computed it. */
#define BASERT_EXP_LO (-103.972076f)
#define BASERT_EXP_HI 88.7228394f

static inline float basert_expf(float x) {
    if (x != x) return x;
    if (x < BASERT_EXP_LO) return 0.0f;
    if (x > BASERT_EXP_HI) return INFINITY;
    float n = rintf(x * 1.44269504088896341f);
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r);
    p = p + 1.0f;
    int ni = (int)n;
    int h1 = ni >> 1, h2 = ni - h1;
    union { unsigned int u; float f; } s1, s2;
    s1.u = (unsigned int)(h1 + 127) << 23;
    s2.u = (unsigned int)(h2 + 127) << 23;
    return (p * s1.f) * s2.f;
}

#if defined(BASERT_SIMD)
static inline __m256 basert_exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(BASERT_EXP_LO), hi = _mm256_set1_ps(BASERT_EXP_HI);
    __m256 xc = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), xc);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
    p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
    __m256i ni = _mm256_cvtps_epi32(n);
    __m256i h1 = _mm256_srai_epi32(ni, 1);
    __m256i h2 = _mm256_sub_epi32(ni, h1);
    const __m256i bias = _mm256_set1_epi32(127);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h1, bias), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h2, bias), 23));
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
    y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
    y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
#endif

/* Dot product of a[0..n) and b[0..n), 8 partial sums combined like basert_sumsq. */
static inline float basert_dot(const float *a, const float *b, ptrdiff_t n) {
    ptrdiff_t i = 0;
    float total;
#if defined(BASERT_SIMD)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    total = basert_hsum8(acc);
#else
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] = fmaf(a[i + j], b[i + j], acc[j]);
    total = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
#endif
    for (; i < n; i++) total = fmaf(a[i], b[i], total);
    return total;
}

/* y[i] = fmaf(a, x[i], y[i]) */
static inline void basert_axpy(float a, const float *x, float *y, ptrdiff_t n) {
    ptrdiff_t i = 0;
#if defined(BASERT_SIMD)
    __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] = fmaf(a, x[i], y[i]);
}

/* y[i] = fmaf(a[i], x[i], y[i]) */
static inline void basert_axpy_rows(const float *a, const float *x, float *y, ptrdiff_t n) {
    ptrdiff_t i = 0;
#if defined(BASERT_SIMD)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i,
                         _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] = fmaf(a[i], x[i], y[i]);
}

/* x[i] *= a */
static inline void basert_scale(float a, float *x, ptrdiff_t n) {
    ptrdiff_t i = 0;
#if defined(BASERT_SIMD)
    __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), va));
#endif
    for (; i < n; i++) x[i] *= a;
}

#endif
