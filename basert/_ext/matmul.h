/* Matmul kernels over .base weights: out[M, N] = x[M, K] @ W^T, with W dense (f32/f16/bf16) or
 * group-quantized (base_q4/base_q8), de-quantized in registers (small M, streaming the packed
 * bytes) or into a small per-thread tile reused by every activation row (larger M).
 *
 * Batch invariance: every out[m, n] is computed by one 8-lane accumulator walking K in steps of 8
 * (acc = fma(x, w, acc), lane j sums the k = j mod 8 terms in K order), then the fixed-order
 * horizontal sum ((0+4)+(2+6))+((1+5)+(3+7)) of simd.h, then the K % 8 tail in order with scalar
 * FMAs. The streaming and tiled kernels, every block shape and every thread split perform exactly
 * this sequence on exactly the reference de-quantized weights, so a row's result never depends on
 * the batch. The scalar build (no BASERT_SIMD) runs the same sequence on 8-float structs with fmaf. */
#ifndef BASERT_MATMUL_H
#define BASERT_MATMUL_H

#include <stdint.h>
#include <string.h>

#include "simd.h"

#ifdef _OPENMP
#include <omp.h>
#endif

enum { BASERT_F32 = 0, BASERT_F16 = 1, BASERT_BF16 = 2, BASERT_Q4 = 3, BASERT_Q8 = 4 };

/* One [n, k] weight matrix as raw pointers into arrays the Python Weight keeps alive. */
typedef struct {
    int kind;
    int bf16_scales;           /* scales/biases are bf16 bits (else f16) */
    ptrdiff_t n, k, group_size; /* group_size 0 for dense kinds */
    ptrdiff_t row_bytes;       /* bytes of packed values per row */
    const uint8_t *data;
    const uint16_t *scales;    /* k / group_size per row; NULL for dense */
    const uint16_t *biases;    /* NULL: symmetric codes (u - 2^(bits-1)) * scale */
} basert_weight;

static inline int basert_omp_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static inline void basert_omp_set_threads(int n) {
#ifdef _OPENMP
    omp_set_num_threads(n);
#else
    (void)n;
#endif
}

/* ---- scalar conversions (exact) ---- */

static inline float bm_bits_f32(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float bm_bf16_f32(uint16_t h) { return bm_bits_f32((uint32_t)h << 16); }

static inline float bm_f16_f32(uint16_t h) {
#if defined(BASERT_SIMD)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    /* Infinity, or a NaN made quiet with its payload kept: what F16C's conversion does. */
    if (exp == 0x1f) return bm_bits_f32(sign | 0x7f800000u | (man ? 0x400000u : 0) | (man << 13));
    if (exp != 0) return bm_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
    /* Zero or subnormal: man * 2^-24 is exact in float32. */
    float mag = (float)man * 5.9604644775390625e-8f;
    return sign ? -mag : mag;
#endif
}

static inline float bm_scale_f32(uint16_t bits, int bf16) { return bf16 ? bm_bf16_f32(bits) : bm_f16_f32(bits); }

static inline uint16_t bm_load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* One dense weight value (used for the K % 8 tail only). */
BASERT_ALWAYS_INLINE float bm_dense1(const int kind, const uint8_t *row, ptrdiff_t e) {
    if (kind == BASERT_F32) {
        float v;
        memcpy(&v, row + 4 * e, sizeof v);
        return v;
    }
    if (kind == BASERT_F16) return bm_f16_f32(bm_load_u16(row + 2 * e));
    return bm_bf16_f32(bm_load_u16(row + 2 * e));
}

/* ---- 8-lane vector type: __m256 with AVX2/FMA/F16C, an 8-float struct with fmaf otherwise ---- */

#if defined(BASERT_SIMD)
typedef __m256 bm_v8;

static inline bm_v8 bm_zero(void) { return _mm256_setzero_ps(); }
static inline bm_v8 bm_set1(float v) { return _mm256_set1_ps(v); }
static inline bm_v8 bm_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void bm_store(float *p, bm_v8 v) { _mm256_storeu_ps(p, v); }
static inline bm_v8 bm_fma(bm_v8 a, bm_v8 b, bm_v8 c) { return _mm256_fmadd_ps(a, b, c); }
static inline bm_v8 bm_mul(bm_v8 a, bm_v8 b) { return _mm256_mul_ps(a, b); }
static inline float bm_hsum(bm_v8 v) { return basert_hsum8(v); }

/* The horizontal sums of a, b, c, d into out[0..3], each in basert_hsum8's order: halves
 * added lane-wise (i + i+4), then (0+2) and (1+3), then their sum; float addition commutes exactly. */
static inline void bm_hsum4(bm_v8 a, bm_v8 b, bm_v8 c, bm_v8 d, float *out) {
    __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
    __m256 t = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));
    __m256 h = _mm256_hadd_ps(t, t); /* lanes 0, 1, 4, 5 = a, c, b, d */
    _mm_storeu_ps(out, _mm_unpacklo_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

static inline bm_v8 bm_f16x8(const uint8_t *row, ptrdiff_t e) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * e)));
}

static inline bm_v8 bm_bf16x8(const uint8_t *row, ptrdiff_t e) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * e)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* float(code - offset) of q4 elements e..e+7: their 4 bytes, read as a little-endian word, hold
 * element j in bits 4j..4j+3 (low nibble first), so one variable shift splits all 8. */
static inline bm_v8 bm_q4x8(const uint8_t *row, ptrdiff_t e, int offset) {
    uint32_t word;
    memcpy(&word, row + (e >> 1), sizeof word);
    __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)word), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                     _mm256_set1_epi32(15));
    if (offset) codes = _mm256_sub_epi32(codes, _mm256_set1_epi32(offset));
    return _mm256_cvtepi32_ps(codes);
}

static inline bm_v8 bm_q8x8(const uint8_t *row, ptrdiff_t e, int offset) {
    __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + e)));
    if (offset) codes = _mm256_sub_epi32(codes, _mm256_set1_epi32(offset));
    return _mm256_cvtepi32_ps(codes);
}

/* 8 consecutive scale bits to floats. */
static inline void bm_scales8(const uint16_t *bits, int bf16, float *out) {
    __m128i raw = _mm_loadu_si128((const __m128i *)bits);
    if (bf16)
        _mm256_storeu_ps(out, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
    else
        _mm256_storeu_ps(out, _mm256_cvtph_ps(raw));
}

#else
typedef struct {
    float v[8];
} bm_v8;

static inline bm_v8 bm_zero(void) {
    bm_v8 r;
    for (int j = 0; j < 8; j++) r.v[j] = 0.0f;
    return r;
}
static inline bm_v8 bm_set1(float s) {
    bm_v8 r;
    for (int j = 0; j < 8; j++) r.v[j] = s;
    return r;
}
static inline bm_v8 bm_load(const float *p) {
    bm_v8 r;
    memcpy(r.v, p, sizeof r.v);
    return r;
}
static inline void bm_store(float *p, bm_v8 v) { memcpy(p, v.v, sizeof v.v); }
static inline bm_v8 bm_fma(bm_v8 a, bm_v8 b, bm_v8 c) {
    bm_v8 r;
    for (int j = 0; j < 8; j++) r.v[j] = fmaf(a.v[j], b.v[j], c.v[j]);
    return r;
}
static inline bm_v8 bm_mul(bm_v8 a, bm_v8 b) {
    bm_v8 r;
    for (int j = 0; j < 8; j++) r.v[j] = a.v[j] * b.v[j];
    return r;
}
static inline float bm_hsum(bm_v8 a) {
    const float *v = a.v;
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}
static inline void bm_hsum4(bm_v8 a, bm_v8 b, bm_v8 c, bm_v8 d, float *out) {
    out[0] = bm_hsum(a);
    out[1] = bm_hsum(b);
    out[2] = bm_hsum(c);
    out[3] = bm_hsum(d);
}
static inline bm_v8 bm_f16x8(const uint8_t *row, ptrdiff_t e) {
    bm_v8 r;
    for (int j = 0; j < 8; j++) r.v[j] = bm_f16_f32(bm_load_u16(row + 2 * (e + j)));
    return r;
}
static inline bm_v8 bm_bf16x8(const uint8_t *row, ptrdiff_t e) {
    bm_v8 r;
    for (int j = 0; j < 8; j++) r.v[j] = bm_bf16_f32(bm_load_u16(row + 2 * (e + j)));
    return r;
}
static inline bm_v8 bm_q4x8(const uint8_t *row, ptrdiff_t e, int offset) {
    bm_v8 r;
    const uint8_t *p = row + (e >> 1);
    for (int j = 0; j < 4; j++) {
        r.v[2 * j] = (float)((int)(p[j] & 15) - offset);
        r.v[2 * j + 1] = (float)((int)(p[j] >> 4) - offset);
    }
    return r;
}
static inline bm_v8 bm_q8x8(const uint8_t *row, ptrdiff_t e, int offset) {
    bm_v8 r;
    for (int j = 0; j < 8; j++) r.v[j] = (float)((int)row[e + j] - offset);
    return r;
}
static inline void bm_scales8(const uint16_t *bits, int bf16, float *out) {
    for (int j = 0; j < 8; j++) out[j] = bm_scale_f32(bits[j], bf16);
}
#endif

/* ---- weight decoding, 8 values at a time ---- */

BASERT_ALWAYS_INLINE int bm_is_dense(const int kind) { return kind == BASERT_F32 || kind == BASERT_F16 || kind == BASERT_BF16; }

BASERT_ALWAYS_INLINE bm_v8 bm_dense8(const int kind, const uint8_t *row, ptrdiff_t e) {
    if (kind == BASERT_F32) return bm_load((const float *)(const void *)row + e);
    if (kind == BASERT_F16) return bm_f16x8(row, e);
    return bm_bf16x8(row, e);
}

/* Weights e..e+7 of a quantized row: code * scale + bias (exact with one FMA, as code * scale is
 * exact for f16/bf16 scales), or (code - 2^(bits-1)) * scale when symmetric: the reference values. */
BASERT_ALWAYS_INLINE bm_v8 bm_quant8(const int kind, const int sym, const uint8_t *row, ptrdiff_t e, bm_v8 scale, bm_v8 bias) {
    bm_v8 codes = kind == BASERT_Q4 ? bm_q4x8(row, e, sym ? 8 : 0) : bm_q8x8(row, e, sym ? 128 : 0);
    return sym ? bm_mul(codes, scale) : bm_fma(codes, scale, bias);
}

/* n (<= 8) scale bits to floats. */
static inline void bm_scales(const uint16_t *bits, ptrdiff_t n, int bf16, float *out) {
    if (n == 8) {
        bm_scales8(bits, bf16, out);
        return;
    }
    for (ptrdiff_t j = 0; j < n; j++) out[j] = bm_scale_f32(bits[j], bf16);
}

/* ---- de-quantize one row ---- */

BASERT_ALWAYS_INLINE void bm_dequant_row_kind(const int kind, const int sym, const basert_weight *w, ptrdiff_t row, float *dst) {
    const ptrdiff_t k = w->k;
    const uint8_t *p = w->data + row * w->row_bytes;
    if (kind == BASERT_F32) {
        memcpy(dst, p, (size_t)k * sizeof(float));
    } else if (bm_is_dense(kind)) {
        ptrdiff_t e = 0;
        for (; e + 8 <= k; e += 8) bm_store(dst + e, bm_dense8(kind, p, e));
        for (; e < k; e++) dst[e] = bm_dense1(kind, p, e);
    } else {
        const ptrdiff_t gs = w->group_size, groups = k / gs;
        const uint16_t *sp = w->scales + row * groups, *bp = sym ? NULL : w->biases + row * groups;
        float sf[8], bf[8];
        for (ptrdiff_t g0 = 0; g0 < groups; g0 += 8) {
            const ptrdiff_t gn = groups - g0 < 8 ? groups - g0 : 8;
            bm_scales(sp + g0, gn, w->bf16_scales, sf);
            if (!sym) bm_scales(bp + g0, gn, w->bf16_scales, bf);
            for (ptrdiff_t g = 0; g < gn; g++) {
                bm_v8 scale = bm_set1(sf[g]), bias = sym ? scale : bm_set1(bf[g]);
                for (ptrdiff_t e = (g0 + g) * gs; e < (g0 + g + 1) * gs; e += 8)
                    bm_store(dst + e, bm_quant8(kind, sym, p, e, scale, bias));
            }
        }
    }
}

/* dst[0..k) = row `row` of w as float32, exactly the reference de-quantization. */
static void basert_dequant_row(const basert_weight *w, ptrdiff_t row, float *dst) {
    const int sym = w->biases == NULL;
    switch (w->kind) {
    case BASERT_F32: bm_dequant_row_kind(BASERT_F32, 0, w, row, dst); break;
    case BASERT_F16: bm_dequant_row_kind(BASERT_F16, 0, w, row, dst); break;
    case BASERT_BF16: bm_dequant_row_kind(BASERT_BF16, 0, w, row, dst); break;
    case BASERT_Q4:
        if (sym) bm_dequant_row_kind(BASERT_Q4, 1, w, row, dst);
        else bm_dequant_row_kind(BASERT_Q4, 0, w, row, dst);
        break;
    default:
        if (sym) bm_dequant_row_kind(BASERT_Q8, 1, w, row, dst);
        else bm_dequant_row_kind(BASERT_Q8, 0, w, row, dst);
        break;
    }
}

/* ---- small M: stream the packed rows, de-quantizing in registers ---- */

/* Software prefetch distance in bytes along each weight row: a single core cannot keep enough
 * misses in flight from the hardware prefetcher alone (measured on one core: 5 -> 7 GB/s from
 * DRAM, about the kernel's cache-resident speed); 2 to 8 KiB measured the same. */
#define BASERT_PREFETCH_BYTES 2048

/* Batches of up to this many activation rows stream (decoding lanes together); larger ones go
 * through de-quantized tiles. Streaming de-quantizes each weight once per 4 activation rows. */
#define BASERT_STREAM_MAX_M 16

/* y[c * ldy + row + r] for R (1..4) consecutive weight rows and C (1..4, R * C <= 8) activation
 * rows x + c * ldx: each de-quantized weight vector feeds C accumulators.
 * The R * C accumulators are independent, which hides the FMA latency. GS: the group size as a
 * constant (0: read it from w), so that size gets a fully unrolled group loop. */
BASERT_ALWAYS_INLINE void bm_stream_block(const int R, const int C, const int kind, const int sym, const ptrdiff_t GS,
                                          const basert_weight *w, ptrdiff_t row, const float *x, ptrdiff_t ldx, float *y,
                                          ptrdiff_t ldy) {
    const ptrdiff_t k = w->k, k8 = k & ~(ptrdiff_t)7;
    const uint8_t *p[4];
    bm_v8 acc[4][4];
    for (int r = 0; r < R; r++) {
        p[r] = w->data + (row + r) * w->row_bytes;
        for (int c = 0; c < C; c++) acc[r][c] = bm_zero();
    }
    if (bm_is_dense(kind)) {
        const ptrdiff_t esize = kind == BASERT_F32 ? 4 : 2;
        for (ptrdiff_t e = 0; e < k8; e += 8) {
            for (int r = 0; r < R; r++) {
                __builtin_prefetch(p[r] + e * esize + BASERT_PREFETCH_BYTES);
                bm_v8 wv = bm_dense8(kind, p[r], e);
                for (int c = 0; c < C; c++) acc[r][c] = bm_fma(bm_load(x + c * ldx + e), wv, acc[r][c]);
            }
        }
    } else {
        const ptrdiff_t gs = GS ? GS : w->group_size, groups = k / gs, gbytes = kind == BASERT_Q4 ? gs / 2 : gs;
        /* Scales and biases are prefetched as many groups ahead as the codes. */
        const ptrdiff_t scale_ahead = 2 * BASERT_PREFETCH_BYTES / gbytes;
        const uint16_t *sp[4], *bp[4];
        /* Scales of 8 groups at a time converted with one instruction, then broadcast per group. */
        float sf[4][8], bf[4][8];
        for (int r = 0; r < R; r++) {
            sp[r] = w->scales + (row + r) * groups;
            bp[r] = sym ? NULL : w->biases + (row + r) * groups;
        }
        for (ptrdiff_t g0 = 0; g0 < groups; g0 += 8) {
            const ptrdiff_t gn = groups - g0 < 8 ? groups - g0 : 8;
            for (int r = 0; r < R; r++) {
                const uint8_t *ahead = p[r] + g0 * gbytes + BASERT_PREFETCH_BYTES;
                for (ptrdiff_t off = 0; off < 8 * gbytes; off += 64) __builtin_prefetch(ahead + off);
                __builtin_prefetch((const uint8_t *)(sp[r] + g0) + scale_ahead);
                if (!sym) __builtin_prefetch((const uint8_t *)(bp[r] + g0) + scale_ahead);
                bm_scales(sp[r] + g0, gn, w->bf16_scales, sf[r]);
                if (!sym) bm_scales(bp[r] + g0, gn, w->bf16_scales, bf[r]);
            }
            for (ptrdiff_t g = 0; g < gn; g++) {
                bm_v8 scale[4], bias[4];
                for (int r = 0; r < R; r++) {
                    scale[r] = bm_set1(sf[r][g]);
                    bias[r] = sym ? scale[r] : bm_set1(bf[r][g]);
                }
                const ptrdiff_t e0 = (g0 + g) * gs;
                for (ptrdiff_t e = e0; e < e0 + gs; e += 8) {
                    for (int r = 0; r < R; r++) {
                        bm_v8 wv = bm_quant8(kind, sym, p[r], e, scale[r], bias[r]);
                        for (int c = 0; c < C; c++) acc[r][c] = bm_fma(bm_load(x + c * ldx + e), wv, acc[r][c]);
                    }
                }
            }
        }
    }
    for (int c = 0; c < C; c++) {
        float total[4];
        if (R == 4) bm_hsum4(acc[0][c], acc[1][c], acc[2][c], acc[3][c], total);
        else
            for (int r = 0; r < R; r++) total[r] = bm_hsum(acc[r][c]);
        for (int r = 0; r < R; r++) {
            if (bm_is_dense(kind)) /* the K % 8 tail */
                for (ptrdiff_t e = k8; e < k; e++) total[r] = fmaf(x[c * ldx + e], bm_dense1(kind, p[r], e), total[r]);
            y[c * ldy + row + r] = total[r];
        }
    }
}

/* All m (<= 3) activation rows against R weight rows. */
BASERT_ALWAYS_INLINE void bm_stream_rows(const int R, const int kind, const int sym, const ptrdiff_t GS, const basert_weight *w,
                                         ptrdiff_t row, const float *x, ptrdiff_t ldx, ptrdiff_t m, float *y, ptrdiff_t ldy) {
    if (m == 3) bm_stream_block(R, 3, kind, sym, GS, w, row, x, ldx, y, ldy);
    else if (m == 2) bm_stream_block(R, 2, kind, sym, GS, w, row, x, ldx, y, ldy);
    else bm_stream_block(R, 1, kind, sym, GS, w, row, x, ldx, y, ldy);
}

/* All m activation rows against R weight rows, four at a time (then the last 1..3). */
BASERT_ALWAYS_INLINE void bm_stream_quads(const int R, const int kind, const int sym, const ptrdiff_t GS,
                                          const basert_weight *w, ptrdiff_t row, const float *x, ptrdiff_t ldx,
                                          ptrdiff_t m, float *y, ptrdiff_t ldy) {
    ptrdiff_t c0 = 0;
    for (; c0 + 4 <= m; c0 += 4) bm_stream_block(R, 4, kind, sym, GS, w, row, x + c0 * ldx, ldx, y + c0 * ldy, ldy);
    if (c0 < m) bm_stream_rows(R, kind, sym, GS, w, row, x + c0 * ldx, ldx, m - c0, y + c0 * ldy, ldy);
}

BASERT_ALWAYS_INLINE void bm_stream_group(const int kind, const int sym, const ptrdiff_t GS, const basert_weight *w, const float *x,
                                          ptrdiff_t ldx, ptrdiff_t m, ptrdiff_t r0, ptrdiff_t r1, float *y, ptrdiff_t ldy) {
    ptrdiff_t row = r0;
    /* Four weight rows for one activation row, two for several (four rows by three activation rows
     * spill registers and measured no faster). */
    if (m > 3) {
        for (; row + 2 <= r1; row += 2) bm_stream_quads(2, kind, sym, GS, w, row, x, ldx, m, y, ldy);
        for (; row < r1; row++) bm_stream_quads(1, kind, sym, GS, w, row, x, ldx, m, y, ldy);
        return;
    }
    if (m == 1)
        for (; row + 4 <= r1; row += 4) bm_stream_block(4, 1, kind, sym, GS, w, row, x, ldx, y, ldy);
    else
        for (; row + 2 <= r1; row += 2) bm_stream_rows(2, kind, sym, GS, w, row, x, ldx, m, y, ldy);
    for (; row < r1; row++) bm_stream_rows(1, kind, sym, GS, w, row, x, ldx, m, y, ldy);
}

BASERT_ALWAYS_INLINE void bm_stream_kind(const int kind, const int sym, const basert_weight *w, const float *x, ptrdiff_t ldx,
                                         ptrdiff_t m, ptrdiff_t r0, ptrdiff_t r1, float *y, ptrdiff_t ldy) {
    /* Group 32, what GGUF's Q4_0/Q4_1/Q8_0 map to, gets its own unrolled copy. */
    if (bm_is_dense(kind)) bm_stream_group(kind, sym, 0, w, x, ldx, m, r0, r1, y, ldy);
    else if (w->group_size == 32) bm_stream_group(kind, sym, 32, w, x, ldx, m, r0, r1, y, ldy);
    else bm_stream_group(kind, sym, 0, w, x, ldx, m, r0, r1, y, ldy);
}

/* Columns r0..r1 of out[m, ldy] = x[m, ldx] @ W^T, m <= BASERT_STREAM_MAX_M, weights read once. */
static void basert_stream(const basert_weight *w, const float *x, ptrdiff_t ldx, ptrdiff_t m, ptrdiff_t r0, ptrdiff_t r1,
                          float *y, ptrdiff_t ldy) {
    const int sym = w->biases == NULL;
    switch (w->kind) {
    case BASERT_F32: bm_stream_kind(BASERT_F32, 0, w, x, ldx, m, r0, r1, y, ldy); break;
    case BASERT_F16: bm_stream_kind(BASERT_F16, 0, w, x, ldx, m, r0, r1, y, ldy); break;
    case BASERT_BF16: bm_stream_kind(BASERT_BF16, 0, w, x, ldx, m, r0, r1, y, ldy); break;
    case BASERT_Q4:
        if (sym) bm_stream_kind(BASERT_Q4, 1, w, x, ldx, m, r0, r1, y, ldy);
        else bm_stream_kind(BASERT_Q4, 0, w, x, ldx, m, r0, r1, y, ldy);
        break;
    default:
        if (sym) bm_stream_kind(BASERT_Q8, 1, w, x, ldx, m, r0, r1, y, ldy);
        else bm_stream_kind(BASERT_Q8, 0, w, x, ldx, m, r0, r1, y, ldy);
        break;
    }
}

/* ---- larger M: de-quantize a tile of rows once, reuse it for every activation row ---- */

/* Microkernel: out[c * ldo + r] for R (1..4) float weight rows x C (1..3) activation rows; each
 * weight load serves C accumulators and each activation load R. */
BASERT_ALWAYS_INLINE void bm_block(const int R, const int C, const float *w, ptrdiff_t ldw, const float *x, ptrdiff_t ldx,
                                   ptrdiff_t k, float *out, ptrdiff_t ldo) {
    bm_v8 acc[4][3];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = bm_zero();
    const ptrdiff_t k8 = k & ~(ptrdiff_t)7;
    for (ptrdiff_t e = 0; e < k8; e += 8) {
        bm_v8 xv[3];
        for (int c = 0; c < C; c++) xv[c] = bm_load(x + c * ldx + e);
        for (int r = 0; r < R; r++) {
            bm_v8 wv = bm_load(w + r * ldw + e);
            for (int c = 0; c < C; c++) acc[r][c] = bm_fma(xv[c], wv, acc[r][c]);
        }
    }
    for (int c = 0; c < C; c++) {
        float total[4];
        if (R == 4) bm_hsum4(acc[0][c], acc[1][c], acc[2][c], acc[3][c], total);
        else
            for (int r = 0; r < R; r++) total[r] = bm_hsum(acc[r][c]);
        for (int r = 0; r < R; r++) {
            for (ptrdiff_t e = k8; e < k; e++) total[r] = fmaf(x[c * ldx + e], w[r * ldw + e], total[r]);
            out[c * ldo + r] = total[r];
        }
    }
}

#define BM_BLOCK(R, C)                                                                                                   \
    static void bm_block_##R##x##C(const float *w, ptrdiff_t ldw, const float *x, ptrdiff_t ldx, ptrdiff_t k, float *out, \
                                   ptrdiff_t ldo) {                                                                      \
        bm_block(R, C, w, ldw, x, ldx, k, out, ldo);                                                                     \
    }
BM_BLOCK(4, 3)
BM_BLOCK(4, 2)
BM_BLOCK(4, 1)
BM_BLOCK(1, 3)
BM_BLOCK(1, 2)
BM_BLOCK(1, 1)
#undef BM_BLOCK

/* Floats per row of a de-quantized tile or of the aligned copy of x: K rounded up to a cache line
 * so every row starts 64-byte aligned (split loads cost the microkernel about a fifth of its speed). */
static inline ptrdiff_t basert_tile_stride(ptrdiff_t k) { return (k + 15) & ~(ptrdiff_t)15; }

/* Weight rows per tile: about 64 KiB of floats (L2-resident), a multiple of 4, at least 4. */
static inline ptrdiff_t basert_tile_rows(ptrdiff_t k) {
    ptrdiff_t rows = (16384 / basert_tile_stride(k)) & ~(ptrdiff_t)3;
    return rows < 4 ? 4 : rows > 64 ? 64 : rows;
}

/* Activation rows per block: about 96 KiB, so a block stays in L2 while the tile's rows sweep it. */
static inline ptrdiff_t basert_x_block_rows(ptrdiff_t k) {
    ptrdiff_t rows = 24576 / k / 3 * 3;
    return rows < 3 ? 3 : rows;
}

/* out[0..m)[r0..r1) for m activation rows x (row stride ldx); r1 - r0 <= basert_tile_rows(k). buf
 * holds basert_tile_rows(k) * basert_tile_stride(k) floats (unused for f32 weights, read in place). */
static void basert_gemm_tile(const basert_weight *w, const float *x, ptrdiff_t ldx, ptrdiff_t m, ptrdiff_t r0, ptrdiff_t r1,
                             float *buf, float *out) {
    const ptrdiff_t k = w->k, n = w->n, rows = r1 - r0, mb = basert_x_block_rows(k);
    const float *tile;
    ptrdiff_t ldw;
    if (w->kind == BASERT_F32) {
        tile = (const float *)(const void *)w->data + r0 * k;
        ldw = k;
    } else {
        ldw = basert_tile_stride(k);
        for (ptrdiff_t r = 0; r < rows; r++) basert_dequant_row(w, r0 + r, buf + r * ldw);
        tile = buf;
    }
    for (ptrdiff_t m0 = 0; m0 < m; m0 += mb) {
        const ptrdiff_t m1 = m0 + mb < m ? m0 + mb : m;
        ptrdiff_t r = 0;
        for (; r + 4 <= rows; r += 4) {
            const float *wr = tile + r * ldw;
            float *o = out + r0 + r;
            ptrdiff_t i = m0;
            for (; i + 3 <= m1; i += 3) bm_block_4x3(wr, ldw, x + i * ldx, ldx, k, o + i * n, n);
            if (m1 - i == 2) bm_block_4x2(wr, ldw, x + i * ldx, ldx, k, o + i * n, n);
            else if (m1 - i == 1) bm_block_4x1(wr, ldw, x + i * ldx, ldx, k, o + i * n, n);
        }
        for (; r < rows; r++) {
            const float *wr = tile + r * ldw;
            float *o = out + r0 + r;
            ptrdiff_t i = m0;
            for (; i + 3 <= m1; i += 3) bm_block_1x3(wr, ldw, x + i * ldx, ldx, k, o + i * n, n);
            if (m1 - i == 2) bm_block_1x2(wr, ldw, x + i * ldx, ldx, k, o + i * n, n);
            else if (m1 - i == 1) bm_block_1x1(wr, ldw, x + i * ldx, ldx, k, o + i * n, n);
        }
    }
}

#endif
