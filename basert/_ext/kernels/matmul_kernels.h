/* The matmul kernels' building blocks (matmul.h declares what they build), included by the units in this folder
 * only: every function here is inlined where it is used, and each unit instantiates the ones its weight family
 * needs, once per CPU variant. */
#ifndef BASERT_MATMUL_KERNELS_H
#define BASERT_MATMUL_KERNELS_H

#include <string.h>

#include "matmul.h"

/* ---- scalar conversions (exact) ---- */

BASERT_ALWAYS_INLINE float bm_bits_f32(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

BASERT_ALWAYS_INLINE float bm_bf16_f32(uint16_t h) { return bm_bits_f32((uint32_t)h << 16); }

BASERT_ALWAYS_INLINE float bm_f16_f32(uint16_t h) {
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

BASERT_ALWAYS_INLINE float bm_scale_f32(uint16_t bits, int bf16) { return bf16 ? bm_bf16_f32(bits) : bm_f16_f32(bits); }

BASERT_ALWAYS_INLINE uint16_t bm_load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* One dense weight value (used for the K % 16 tail only). */
BASERT_ALWAYS_INLINE float bm_dense1(const int kind, const uint8_t *row, ptrdiff_t e) {
    if (kind == BASERT_F32) {
        float v;
        memcpy(&v, row + 4 * e, sizeof v);
        return v;
    }
    if (kind == BASERT_F16) return bm_f16_f32(bm_load_u16(row + 2 * e));
    return bm_bf16_f32(bm_load_u16(row + 2 * e));
}

/* One quantized weight value (for K tails and group sizes that are not multiples of 16): the same
 * float operations as the vector code, so the same value. */
BASERT_ALWAYS_INLINE float bm_quant1(const int kind, const int sym, const uint8_t *row, ptrdiff_t e, float scale, float bias) {
    const int code = kind == BASERT_Q4 ? (row[e >> 1] >> (4 * (e & 1))) & 15 : row[e];
    if (sym) return (float)(code - (kind == BASERT_Q4 ? 8 : 128)) * scale;
    return fmaf((float)code, scale, bias);
}

/* ---- 16-lane vector type: __m512 (avx512), a pair of __m256 (avx2), 16 floats with fmaf (portable) ---- */

#if defined(BASERT_AVX512)
typedef __m512 bm_v;

BASERT_ALWAYS_INLINE bm_v bm_zero(void) { return _mm512_setzero_ps(); }
BASERT_ALWAYS_INLINE bm_v bm_set1(float v) { return _mm512_set1_ps(v); }
/* Lanes 0-7 = a, lanes 8-15 = b. */
BASERT_ALWAYS_INLINE bm_v bm_set2(float a, float b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(a)), _mm256_castps_pd(_mm256_set1_ps(b)), 1));
}
BASERT_ALWAYS_INLINE bm_v bm_load(const float *p) { return _mm512_loadu_ps(p); }
BASERT_ALWAYS_INLINE void bm_store(float *p, bm_v v) { _mm512_storeu_ps(p, v); }
BASERT_ALWAYS_INLINE bm_v bm_fma(bm_v a, bm_v b, bm_v c) { return _mm512_fmadd_ps(a, b, c); }
BASERT_ALWAYS_INLINE bm_v bm_mul(bm_v a, bm_v b) { return _mm512_mul_ps(a, b); }
BASERT_ALWAYS_INLINE bm_v bm_add(bm_v a, bm_v b) { return _mm512_add_ps(a, b); }
BASERT_ALWAYS_INLINE bm_v bm_sub(bm_v a, bm_v b) { return _mm512_sub_ps(a, b); }
/* Lane i + lane i+8, i = 0..7: the first step of the horizontal sum. */
BASERT_ALWAYS_INLINE __m256 bm_fold(bm_v v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
BASERT_ALWAYS_INLINE bm_v bm_f16x16(const uint8_t *row, ptrdiff_t e) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(row + 2 * e)));
}
BASERT_ALWAYS_INLINE bm_v bm_bf16x16(const uint8_t *row, ptrdiff_t e) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)(row + 2 * e)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
/* 16 code bytes (signed when sgn) to floats. */
BASERT_ALWAYS_INLINE bm_v bm_bytes16(__m128i b, const int sgn) {
    return _mm512_cvtepi32_ps(sgn ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
}

#elif defined(BASERT_SIMD)
typedef struct {
    __m256 lo, hi; /* lanes 0-7, lanes 8-15 */
} bm_v;

BASERT_ALWAYS_INLINE bm_v bm_zero(void) { return (bm_v){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
BASERT_ALWAYS_INLINE bm_v bm_set1(float v) { return (bm_v){_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
BASERT_ALWAYS_INLINE bm_v bm_set2(float a, float b) { return (bm_v){_mm256_set1_ps(a), _mm256_set1_ps(b)}; }
BASERT_ALWAYS_INLINE bm_v bm_load(const float *p) { return (bm_v){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
BASERT_ALWAYS_INLINE void bm_store(float *p, bm_v v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
BASERT_ALWAYS_INLINE bm_v bm_fma(bm_v a, bm_v b, bm_v c) {
    return (bm_v){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
BASERT_ALWAYS_INLINE bm_v bm_mul(bm_v a, bm_v b) { return (bm_v){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
BASERT_ALWAYS_INLINE bm_v bm_add(bm_v a, bm_v b) { return (bm_v){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
BASERT_ALWAYS_INLINE bm_v bm_sub(bm_v a, bm_v b) { return (bm_v){_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
BASERT_ALWAYS_INLINE __m256 bm_fold(bm_v v) { return _mm256_add_ps(v.lo, v.hi); }
BASERT_ALWAYS_INLINE bm_v bm_f16x16(const uint8_t *row, ptrdiff_t e) {
    return (bm_v){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(row + 2 * e))),
                  _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(row + 2 * e + 16)))};
}
BASERT_ALWAYS_INLINE __m256 bm_bf16x8(const uint8_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
BASERT_ALWAYS_INLINE bm_v bm_bf16x16(const uint8_t *row, ptrdiff_t e) {
    return (bm_v){bm_bf16x8(row + 2 * e), bm_bf16x8(row + 2 * e + 16)};
}
BASERT_ALWAYS_INLINE bm_v bm_bytes16(__m128i b, const int sgn) {
    __m128i h = _mm_unpackhi_epi64(b, b);
    if (sgn) return (bm_v){_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h))};
    return (bm_v){_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h))};
}
#endif

#if defined(BASERT_SIMD)
BASERT_ALWAYS_INLINE float bm_hsum(bm_v v) { return basert_hsum8(bm_fold(v)); }

/* The horizontal sums of a, b, c, d into out[0..3], each in bm_hsum's order: folded, then the 8-lane
 * tree with the halves added lane-wise (i + i+4), then (0+2) and (1+3), then their sum; float addition
 * commutes exactly. */
BASERT_ALWAYS_INLINE void bm_hsum4(bm_v va, bm_v vb, bm_v vc, bm_v vd, float *out) {
    __m256 a = bm_fold(va), b = bm_fold(vb), c = bm_fold(vc), d = bm_fold(vd);
    __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
    __m256 t = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));
    __m256 h = _mm256_hadd_ps(t, t); /* lanes 0, 1, 4, 5 = a, c, b, d */
    _mm_storeu_ps(out, _mm_unpacklo_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

/* The 16 codes of 8 packed q4 bytes as bytes in element order: byte b holds element 2b in its low
 * nibble and 2b+1 in its high one, so masking, shifting and interleaving the two halves orders them. */
BASERT_ALWAYS_INLINE __m128i bm_q4_bytes16(const uint8_t *p) {
    const __m128i mask = _mm_set1_epi8(15);
    __m128i raw = _mm_loadl_epi64((const __m128i *)(const void *)p);
    return _mm_unpacklo_epi8(_mm_and_si128(raw, mask), _mm_and_si128(_mm_srli_epi16(raw, 4), mask));
}

/* The 32 codes of 16 packed q4 bytes (one group of 32): elements 0-15 in *a, 16-31 in *b. */
BASERT_ALWAYS_INLINE void bm_q4_bytes32(const uint8_t *p, __m128i *a, __m128i *b) {
    const __m128i mask = _mm_set1_epi8(15);
    __m128i raw = _mm_loadu_si128((const __m128i *)(const void *)p);
    __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    *a = _mm_unpacklo_epi8(lo, hi);
    *b = _mm_unpackhi_epi8(lo, hi);
}

/* Code bytes minus the symmetric offset, exact in int8: q4 codes - 8; q8 codes - 128 = code ^ 0x80 read signed. */
BASERT_ALWAYS_INLINE __m128i bm_unsign(const int kind, __m128i b) {
    return kind == BASERT_Q4 ? _mm_sub_epi8(b, _mm_set1_epi8(8)) : _mm_xor_si128(b, _mm_set1_epi8((char)0x80));
}

/* float(code) of elements e..e+15, or float(code - 2^(bits-1)) when symmetric. */
BASERT_ALWAYS_INLINE bm_v bm_codes16(const int kind, const int sym, const uint8_t *row, ptrdiff_t e) {
    __m128i b = kind == BASERT_Q4 ? bm_q4_bytes16(row + (e >> 1)) : _mm_loadu_si128((const __m128i *)(const void *)(row + e));
    return bm_bytes16(sym ? bm_unsign(kind, b) : b, sym);
}

/* The same for elements e..e+31, in *a and *b: one load and one unpacking for a whole q4 group of 32. */
BASERT_ALWAYS_INLINE void bm_codes32(const int kind, const int sym, const uint8_t *row, ptrdiff_t e, bm_v *a, bm_v *b) {
    if (kind == BASERT_Q4) {
        __m128i lo, hi;
        bm_q4_bytes32(row + (e >> 1), &lo, &hi);
        *a = bm_bytes16(sym ? bm_unsign(kind, lo) : lo, sym);
        *b = bm_bytes16(sym ? bm_unsign(kind, hi) : hi, sym);
    } else {
        *a = bm_codes16(kind, sym, row, e);
        *b = bm_codes16(kind, sym, row, e + 16);
    }
}

/* 8 consecutive scale bits to floats. */
BASERT_ALWAYS_INLINE void bm_scales8(const uint16_t *bits, int bf16, float *out) {
    __m128i raw = _mm_loadu_si128((const __m128i *)(const void *)bits);
    if (bf16)
        _mm256_storeu_ps(out, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
    else
        _mm256_storeu_ps(out, _mm256_cvtph_ps(raw));
}

#else
typedef struct {
    float v[16];
} bm_v;

BASERT_ALWAYS_INLINE bm_v bm_zero(void) {
    bm_v r;
    for (int j = 0; j < 16; j++) r.v[j] = 0.0f;
    return r;
}
BASERT_ALWAYS_INLINE bm_v bm_set1(float s) {
    bm_v r;
    for (int j = 0; j < 16; j++) r.v[j] = s;
    return r;
}
BASERT_ALWAYS_INLINE bm_v bm_set2(float a, float b) {
    bm_v r;
    for (int j = 0; j < 8; j++) {
        r.v[j] = a;
        r.v[j + 8] = b;
    }
    return r;
}
BASERT_ALWAYS_INLINE bm_v bm_load(const float *p) {
    bm_v r;
    memcpy(r.v, p, sizeof r.v);
    return r;
}
BASERT_ALWAYS_INLINE void bm_store(float *p, bm_v v) { memcpy(p, v.v, sizeof v.v); }
BASERT_ALWAYS_INLINE bm_v bm_fma(bm_v a, bm_v b, bm_v c) {
    bm_v r;
    for (int j = 0; j < 16; j++) r.v[j] = fmaf(a.v[j], b.v[j], c.v[j]);
    return r;
}
BASERT_ALWAYS_INLINE bm_v bm_mul(bm_v a, bm_v b) {
    bm_v r;
    for (int j = 0; j < 16; j++) r.v[j] = a.v[j] * b.v[j];
    return r;
}
BASERT_ALWAYS_INLINE float bm_hsum(bm_v a) {
    float s[8];
    for (int j = 0; j < 8; j++) s[j] = a.v[j] + a.v[j + 8];
    return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}
BASERT_ALWAYS_INLINE void bm_hsum4(bm_v a, bm_v b, bm_v c, bm_v d, float *out) {
    out[0] = bm_hsum(a);
    out[1] = bm_hsum(b);
    out[2] = bm_hsum(c);
    out[3] = bm_hsum(d);
}
BASERT_ALWAYS_INLINE bm_v bm_f16x16(const uint8_t *row, ptrdiff_t e) {
    bm_v r;
    for (int j = 0; j < 16; j++) r.v[j] = bm_f16_f32(bm_load_u16(row + 2 * (e + j)));
    return r;
}
BASERT_ALWAYS_INLINE bm_v bm_bf16x16(const uint8_t *row, ptrdiff_t e) {
    bm_v r;
    for (int j = 0; j < 16; j++) r.v[j] = bm_bf16_f32(bm_load_u16(row + 2 * (e + j)));
    return r;
}
BASERT_ALWAYS_INLINE bm_v bm_codes16(const int kind, const int sym, const uint8_t *row, ptrdiff_t e) {
    bm_v r;
    const int offset = sym ? (kind == BASERT_Q4 ? 8 : 128) : 0;
    if (kind == BASERT_Q4) {
        const uint8_t *p = row + (e >> 1);
        for (int j = 0; j < 8; j++) {
            r.v[2 * j] = (float)((int)(p[j] & 15) - offset);
            r.v[2 * j + 1] = (float)((int)(p[j] >> 4) - offset);
        }
    } else {
        for (int j = 0; j < 16; j++) r.v[j] = (float)((int)row[e + j] - offset);
    }
    return r;
}
BASERT_ALWAYS_INLINE void bm_codes32(const int kind, const int sym, const uint8_t *row, ptrdiff_t e, bm_v *a, bm_v *b) {
    *a = bm_codes16(kind, sym, row, e);
    *b = bm_codes16(kind, sym, row, e + 16);
}
BASERT_ALWAYS_INLINE void bm_scales8(const uint16_t *bits, int bf16, float *out) {
    for (int j = 0; j < 8; j++) out[j] = bm_scale_f32(bits[j], bf16);
}
#endif

#if defined(BASERT_AVX512)
/* q4 on avx512, one group at a time: a group has only 16 possible weights, bm_dequant of the codes 0..15
 * (fma(code, scale, bias), or (code - 8) * scale when symmetric), so they are computed once into one
 * register and every weight is looked up in it by its code (vpermps): the same values as bm_dequant's,
 * with no integer-to-float conversion or de-quantizing FMA per weight. */
BASERT_ALWAYS_INLINE __m512 bm_q4_table(const int sym, __m512 scale, __m512 bias) {
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if (sym) return _mm512_mul_ps(_mm512_sub_ps(codes, _mm512_set1_ps(8.0f)), scale);
    return _mm512_fmadd_ps(codes, scale, bias);
}

/* The 32 weights of 16 packed q4 bytes (one group; byte b holds element 2b in its low nibble, 2b+1 in its
 * high one): elements 0-15 in *w0, 16-31 in *w1. vpermps reads only the low 4 bits of each index lane, so
 * lane j's index is a dword whose byte 0 is byte j/2 and byte 2 is byte 8 + j/2 (one byte shuffle of the 16
 * bytes broadcast to every 128-bit lane), shifted right by 4 (j odd) and by 16 more for the second half. */
BASERT_ALWAYS_INLINE void bm_q4_lookup32(const uint8_t *p, __m512 table, __m512 *w0, __m512 *w1) {
    const __m512i spread = _mm512_set_epi32(
        (int)0x800F8007, (int)0x800F8007, (int)0x800E8006, (int)0x800E8006, (int)0x800D8005, (int)0x800D8005,
        (int)0x800C8004, (int)0x800C8004, (int)0x800B8003, (int)0x800B8003, (int)0x800A8002, (int)0x800A8002,
        (int)0x80098001, (int)0x80098001, (int)0x80088000, (int)0x80088000);
    const __m512i shift0 = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
    const __m512i shift1 = _mm512_add_epi32(shift0, _mm512_set1_epi32(16));
    const __m512i raw = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(const void *)p));
    const __m512i bytes = _mm512_shuffle_epi8(raw, spread);
    *w0 = _mm512_permutexvar_ps(_mm512_srlv_epi32(bytes, shift0), table);
    *w1 = _mm512_permutexvar_ps(_mm512_srlv_epi32(bytes, shift1), table);
}
#endif

/* ---- weight decoding, 16 values at a time ---- */

BASERT_ALWAYS_INLINE int bm_is_dense(const int kind) { return kind == BASERT_F32 || kind == BASERT_F16 || kind == BASERT_BF16; }

BASERT_ALWAYS_INLINE bm_v bm_dense16(const int kind, const uint8_t *row, ptrdiff_t e) {
    if (kind == BASERT_F32) return bm_load((const float *)(const void *)row + e);
    if (kind == BASERT_F16) return bm_f16x16(row, e);
    return bm_bf16x16(row, e);
}

/* Quantized weights from their codes: code * scale + bias (exact with one FMA, as code * scale is exact
 * for f16/bf16 scales), or (code - 2^(bits-1)) * scale when symmetric: the reference values. */
BASERT_ALWAYS_INLINE bm_v bm_dequant(const int sym, bm_v codes, bm_v scale, bm_v bias) {
    return sym ? bm_mul(codes, scale) : bm_fma(codes, scale, bias);
}

/* What bm_weights32 looks a group's weights up in: for q4 on avx512 its 16 possible weights (bm_q4_table);
 * unused otherwise. */
BASERT_ALWAYS_INLINE bm_v bm_group_table(const int kind, const int sym, bm_v scale, bm_v bias) {
#if defined(BASERT_AVX512)
    if (kind == BASERT_Q4) return bm_q4_table(sym, scale, bias);
#endif
    (void)kind, (void)sym, (void)scale, (void)bias;
    return bm_zero();
}

/* Weights e..e+31 of a row (group sizes that are multiples of 32): looked up in the group's table for q4 on
 * avx512, the codes de-quantized with the group's scale and bias otherwise; the same values either way. */
BASERT_ALWAYS_INLINE void bm_weights32(const int kind, const int sym, const uint8_t *row, ptrdiff_t e, bm_v scale, bm_v bias,
                                       bm_v table, bm_v *w0, bm_v *w1) {
#if defined(BASERT_AVX512)
    if (kind == BASERT_Q4) {
        bm_q4_lookup32(row + (e >> 1), table, w0, w1);
        return;
    }
#endif
    (void)table;
    bm_v c0, c1;
    bm_codes32(kind, sym, row, e, &c0, &c1);
    *w0 = bm_dequant(sym, c0, scale, bias);
    *w1 = bm_dequant(sym, c1, scale, bias);
}

/* GGUF blocks in registers, 16 values at a time: bm_block_open reads a block's scales into a bm_gguf_block,
 * bm_block_values16(type, blk, j) gives its values 16j .. 16j+15 (the same products and differences as
 * basert_dequant_block, so the same values). The streaming kernel sums them without storing them;
 * bm_dequant_block stores them. The portable variant runs basert_dequant_block as it is. */
#if defined(BASERT_SIMD)
typedef struct {
    const uint8_t *b;
    float d, m;          /* Q5_0 / Q5_1: d and m */
    __m128i high[2];     /* Q5_0 / Q5_1: per element byte, the fifth bit as 0x10 (Q5_1), or what turns the low
                            nibble into q - 16 (Q5_0: 0 where the fifth bit is set, else 0xF0, which is -16) */
    float ds[16], dm[16]; /* Q4_K / Q5_K: d * scale, dmin * min per sub-block of 32; Q2_K: the same per 16;
                             Q3_K, Q6_K: d * scale per 16 */
} bm_gguf_block;

BASERT_ALWAYS_INLINE float bm_f16_at(const uint8_t *p) { return bm_f16_f32(bm_load_u16(p)); }

BASERT_ALWAYS_INLINE void bm_block_open(const int type, const uint8_t *b, bm_gguf_block *blk) {
    blk->b = b;
    if (type == BASERT_GGML_Q4_K || type == BASERT_GGML_Q5_K) {
        /* The eight 6-bit scales and mins of basert_k_scale_min, unpacked four at a time in 32-bit words. */
        uint32_t sc[3], packed[4];
        memcpy(sc, b + 4, sizeof sc);
        packed[0] = sc[0] & 0x3f3f3f3fu;                                            /* scales 0-3 */
        packed[1] = (sc[2] & 0x0f0f0f0fu) | (((sc[0] >> 6) & 0x03030303u) << 4);   /* scales 4-7 */
        packed[2] = sc[1] & 0x3f3f3f3fu;                                            /* mins 0-3 */
        packed[3] = ((sc[2] >> 4) & 0x0f0f0f0fu) | (((sc[1] >> 6) & 0x03030303u) << 4); /* mins 4-7 */
        const __m128i v = _mm_loadu_si128((const __m128i *)(const void *)packed);
        const __m256 scales = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
        const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(v, v)));
        _mm256_storeu_ps(blk->ds, _mm256_mul_ps(_mm256_set1_ps(bm_f16_at(b)), scales));
        _mm256_storeu_ps(blk->dm, _mm256_mul_ps(_mm256_set1_ps(bm_f16_at(b + 2)), mins));
    } else if (type == BASERT_GGML_Q2_K) {
        const float d = bm_f16_at(b + 80), dmin = bm_f16_at(b + 82);
        for (int j = 0; j < 16; j++) {
            blk->ds[j] = d * (float)(b[j] & 15);
            blk->dm[j] = dmin * (float)(b[j] >> 4);
        }
    } else if (type == BASERT_GGML_Q3_K) {
        const float d = bm_f16_at(b + 108);
        for (int j = 0; j < 16; j++) blk->ds[j] = d * (float)basert_q3_k_scale(b + 96, j);
    } else if (type == BASERT_GGML_Q6_K) {
        const int8_t *scales = (const int8_t *)(const void *)(b + 192);
        const float d = bm_f16_at(b + 208);
        for (int j = 0; j < 16; j++) blk->ds[j] = d * (float)scales[j];
    } else {
        const int with_min = type == BASERT_GGML_Q5_1;
        const uint8_t *qh = b + (with_min ? 4 : 2);
        blk->d = bm_f16_at(b);
        blk->m = with_min ? bm_f16_at(b + 2) : 0.0f;
        uint32_t bits;
        memcpy(&bits, qh, sizeof bits);
        /* Byte e of the 32 gets qh's byte e / 8, then its bit e % 8. */
        const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
            _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
        const __m256i mask = _mm256_set1_epi64x((long long)0x8040201008040201ull);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask);
        const __m256i high = with_min ? _mm256_and_si256(set, _mm256_set1_epi8(16)) : _mm256_andnot_si256(set, _mm256_set1_epi8((char)0xF0));
        blk->high[0] = _mm256_castsi256_si128(high);
        blk->high[1] = _mm256_extracti128_si256(high, 1);
    }
}

/* Bytes p[0..16) shifted right by `shift` bits, masked to `mask`. */
BASERT_ALWAYS_INLINE __m128i bm_bits16(const uint8_t *p, int shift, int mask) {
    const __m128i v = _mm_loadu_si128((const __m128i *)(const void *)p);
    return _mm_and_si128(_mm_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm_set1_epi8((char)mask));
}

BASERT_ALWAYS_INLINE bm_v bm_block_values16(const int type, const bm_gguf_block *blk, const int j) {
    const uint8_t *b = blk->b;
#if !defined(BASERT_AVX512)
    if (type == BASERT_GGML_Q4_K) {
        /* Sub-block s = j / 2, half h: eight nibbles per lane group, widened straight from memory. */
        const int s = j >> 1, h = j & 1;
        const uint8_t *q = b + 16 + 32 * (s >> 1) + 16 * h;
        __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)q));
        __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(q + 8)));
        if (s & 1) {
            lo = _mm256_srli_epi32(lo, 4);
            hi = _mm256_srli_epi32(hi, 4);
        } else {
            lo = _mm256_and_si256(lo, _mm256_set1_epi32(15));
            hi = _mm256_and_si256(hi, _mm256_set1_epi32(15));
        }
        const __m256 ds = _mm256_set1_ps(blk->ds[s]), dm = _mm256_set1_ps(blk->dm[s]);
        return (bm_v){_mm256_sub_ps(_mm256_mul_ps(ds, _mm256_cvtepi32_ps(lo)), dm),
                      _mm256_sub_ps(_mm256_mul_ps(ds, _mm256_cvtepi32_ps(hi)), dm)};
    }
#endif
    if (type == BASERT_GGML_Q4_K || type == BASERT_GGML_Q5_K) {
        /* Sub-block s = j / 2, half h: codes from the nibbles (and the qh bit) of 16 bytes. */
        const int five = type == BASERT_GGML_Q5_K, s = j >> 1, h = j & 1;
        __m128i q = bm_bits16(b + (five ? 48 : 16) + 32 * (s >> 1) + 16 * h, 4 * (s & 1), 15);
        if (five) q = _mm_or_si128(q, _mm_slli_epi16(bm_bits16(b + 16 + 16 * h, s, 1), 4));
        return bm_sub(bm_mul(bm_set1(blk->ds[s]), bm_bytes16(q, 0)), bm_set1(blk->dm[s]));
    }
    if (type == BASERT_GGML_Q2_K || type == BASERT_GGML_Q3_K) {
        /* Element 128h + 32t + i: two low bits from qs byte 32h + i; Q3_K subtracts 4 unless bit 2h + t of
         * hmask byte i is set. */
        const int h = j >> 3, t = (j >> 1) & 3, i = 16 * (j & 1);
        const __m128i low = bm_bits16(b + (type == BASERT_GGML_Q2_K ? 16 : 32) + 32 * h + i, 2 * t, 3);
        if (type == BASERT_GGML_Q2_K) return bm_sub(bm_mul(bm_set1(blk->ds[j]), bm_bytes16(low, 0)), bm_set1(blk->dm[j]));
        const __m128i set = _mm_slli_epi16(bm_bits16(b + i, j >> 1, 1), 2);
        const __m128i q = _mm_sub_epi8(_mm_or_si128(low, set), _mm_set1_epi8(4));
        return bm_mul(bm_set1(blk->ds[j]), bm_bytes16(q, 1));
    }
    if (type == BASERT_GGML_Q6_K) {
        const int e = 16 * j, h = e >> 7, u = (e >> 5) & 3, i = e & 31;
        const __m128i low = bm_bits16(b + 64 * h + 32 * (u & 1) + i, 4 * (u >> 1), 15);
        const __m128i high = _mm_slli_epi16(bm_bits16(b + 128 + 32 * h + i, 2 * u, 3), 4);
        const __m128i q = _mm_sub_epi8(_mm_or_si128(low, high), _mm_set1_epi8(32));
        return bm_mul(bm_set1(blk->ds[j]), bm_bytes16(q, 1));
    }
    const int with_min = type == BASERT_GGML_Q5_1;
    const __m128i q = _mm_or_si128(bm_bits16(b + (with_min ? 8 : 6), 4 * j, 15), blk->high[j]);
    if (with_min) return bm_add(bm_mul(bm_set1(blk->d), bm_bytes16(q, 0)), bm_set1(blk->m));
    return bm_mul(bm_set1(blk->d), bm_bytes16(q, 1));
}

BASERT_ALWAYS_INLINE void bm_dequant_block_as(const int type, const uint8_t *block, float *dst) {
    bm_gguf_block blk;
    bm_block_open(type, block, &blk);
    for (int j = 0; j < basert_block_values(type) / 16; j++) bm_store(dst + 16 * j, bm_block_values16(type, &blk, j));
}
#endif

BASERT_ALWAYS_INLINE void bm_dequant_block(int type, const uint8_t *block, float *dst) {
#if defined(BASERT_SIMD)
    switch (type) {
    case BASERT_GGML_Q2_K: bm_dequant_block_as(BASERT_GGML_Q2_K, block, dst); return;
    case BASERT_GGML_Q3_K: bm_dequant_block_as(BASERT_GGML_Q3_K, block, dst); return;
    case BASERT_GGML_Q4_K: bm_dequant_block_as(BASERT_GGML_Q4_K, block, dst); return;
    case BASERT_GGML_Q5_K: bm_dequant_block_as(BASERT_GGML_Q5_K, block, dst); return;
    case BASERT_GGML_Q6_K: bm_dequant_block_as(BASERT_GGML_Q6_K, block, dst); return;
    case BASERT_GGML_Q5_0: bm_dequant_block_as(BASERT_GGML_Q5_0, block, dst); return;
    case BASERT_GGML_Q5_1: bm_dequant_block_as(BASERT_GGML_Q5_1, block, dst); return;
    default: break;
    }
#endif
    basert_dequant_block(type, block, dst);
}

/* n scale bits to floats (exact conversions: the same values however many are converted at once). On avx512
 * out has room for n rounded up to 16: whole vectors are stored (a masked store would not forward to the
 * loads that soon read it). */
BASERT_ALWAYS_INLINE void bm_scales(const uint16_t *bits, ptrdiff_t n, int bf16, float *out) {
    ptrdiff_t j = 0;
#if defined(BASERT_AVX512)
    for (; j < n; j += 16) {
        const __mmask16 mask = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        const __m256i raw = _mm256_maskz_loadu_epi16(mask, bits + j);
        _mm512_storeu_ps(out + j, bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)) : _mm512_cvtph_ps(raw));
    }
#else
    for (; j + 8 <= n; j += 8) bm_scales8(bits + j, bf16, out + j);
    for (; j < n; j++) out[j] = bm_scale_f32(bits[j], bf16);
#endif
}

/* Scale and bias vectors of elements e..e+15 when a group may end in their middle (group sizes that are
 * not multiples of 16): lanes 0-7 take element e's group, lanes 8-15 element e+8's. */
BASERT_ALWAYS_INLINE void bm_scales_at(const int sym, const basert_weight *w, const uint16_t *sp, const uint16_t *bp, ptrdiff_t e,
                                       bm_v *scale, bm_v *bias) {
    const ptrdiff_t g0 = e / w->group_size, g1 = (e + 8) / w->group_size;
    const int bf16 = w->bf16_scales;
    *scale = bm_set2(bm_scale_f32(sp[g0], bf16), bm_scale_f32(sp[g1], bf16));
    *bias = sym ? *scale : bm_set2(bm_scale_f32(bp[g0], bf16), bm_scale_f32(bp[g1], bf16));
}

/* ---- de-quantize one row ---- */

/* A row of a packed base_q4 weight (matmul.h): each block's 16 bytes copied out of its group (the last rows read in
 * place), then bm_quant1's operations. */
static inline void bm_dequant_packed_row(const int sym, const basert_weight *w, ptrdiff_t row, float *dst) {
    const ptrdiff_t gs = w->group_size, groups = w->k / gs;
    const uint16_t *sp = w->scales + row * groups, *bp = sym ? NULL : w->biases + row * groups;
    for (ptrdiff_t b = 0; b < w->k / 32; b++) {
        uint8_t buf[16];
        const uint8_t *codes = basert_weight_bytes(w, row, 16 * b, 16, buf);
        const float s = bm_scale_f32(sp[32 * b / gs], w->bf16_scales);
        const float bias = sym ? s : bm_scale_f32(bp[32 * b / gs], w->bf16_scales);
        for (int j = 0; j < 32; j++) dst[32 * b + j] = bm_quant1(BASERT_Q4, sym, codes, j, s, bias);
    }
}

BASERT_ALWAYS_INLINE void bm_dequant_row_kind(const int kind, const int sym, const basert_weight *w, ptrdiff_t row, float *dst) {
    if (w->packed) {
        bm_dequant_packed_row(sym, w, row, dst);
        return;
    }
    const ptrdiff_t k = w->k;
    const uint8_t *p = w->data + row * w->row_bytes;
    if (kind == BASERT_F32) {
        memcpy(dst, p, (size_t)k * sizeof(float));
    } else if (bm_is_dense(kind)) {
        ptrdiff_t e = 0;
        for (; e + 16 <= k; e += 16) bm_store(dst + e, bm_dense16(kind, p, e));
        for (; e < k; e++) dst[e] = bm_dense1(kind, p, e);
    } else {
        const ptrdiff_t gs = w->group_size, groups = k / gs;
        const uint16_t *sp = w->scales + row * groups, *bp = sym ? NULL : w->biases + row * groups;
        if (gs % 16 == 0) {
            float sf[16], bf[16]; /* room for bm_scales' whole vectors */
            for (ptrdiff_t g0 = 0; g0 < groups; g0 += 8) {
                const ptrdiff_t gn = groups - g0 < 8 ? groups - g0 : 8;
                bm_scales(sp + g0, gn, w->bf16_scales, sf);
                if (!sym) bm_scales(bp + g0, gn, w->bf16_scales, bf);
                for (ptrdiff_t g = 0; g < gn; g++) {
                    bm_v scale = bm_set1(sf[g]), bias = sym ? scale : bm_set1(bf[g]);
                    for (ptrdiff_t e = (g0 + g) * gs; e < (g0 + g + 1) * gs; e += 16)
                        bm_store(dst + e, bm_dequant(sym, bm_codes16(kind, sym, p, e), scale, bias));
                }
            }
        } else {
            ptrdiff_t e = 0;
            for (; e + 16 <= k; e += 16) {
                bm_v scale, bias;
                bm_scales_at(sym, w, sp, bp, e, &scale, &bias);
                bm_store(dst + e, bm_dequant(sym, bm_codes16(kind, sym, p, e), scale, bias));
            }
            for (; e < k; e++) {
                const float s = bm_scale_f32(sp[e / gs], w->bf16_scales);
                dst[e] = bm_quant1(kind, sym, p, e, s, sym ? s : bm_scale_f32(bp[e / gs], w->bf16_scales));
            }
        }
    }
}

/* ---- small M: stream the packed rows, de-quantizing in registers ---- */

/* Software prefetch distance in bytes along each weight row: a single core cannot keep enough
 * misses in flight from the hardware prefetcher alone (measured on one core: 5 -> 7 GB/s from
 * DRAM, about the kernel's cache-resident speed); 2 to 8 KiB measured the same. */
#define BASERT_PREFETCH_BYTES 2048

/* Groups whose scales the streaming kernel converts to floats at once (a stack buffer per row). */
#define BM_SCALE_RUN 64

/* Weight rows per streaming block when several activation rows share it: avx512 has 32 vector
 * registers for 2 x 4 accumulators; a pair of __m256 per accumulator leaves avx2 room for 1 x 4. */
#if defined(BASERT_AVX512)
#define BM_STREAM_ROWS 2
#else
#define BM_STREAM_ROWS 1
#endif

/* Weight rows per streaming block for a single activation row of q4/q8 weights: four, but two on avx2, whose 16
 * registers cannot hold four rows' accumulator pairs and scales beside the codes being converted (measured on a
 * 1536 x 576 weight, one thread, Zen 3: q8 221 -> 127 us, q4 188 -> 134 us). The outputs are the same bits: a
 * row's sum never depends on the rows streamed with it. */
#if defined(BASERT_SIMD) && !defined(BASERT_AVX512)
#define BM_STREAM_ROWS_M1_QUANT 2
#else
#define BM_STREAM_ROWS_M1_QUANT 4
#endif

/* The same for GGUF blocks: two on avx2 for the K-quants (512 x 1024, one thread, Zen 3, hot: Q4_K 62.6 -> 53.9
 * us, Q6_K 93.0 -> 83.3), four for Q5_0/Q5_1, whose small blocks keep fewer values live (84.3 -> 72.9 us). */
static inline int bm_blocks_m1_rows(int type) {
#if defined(BASERT_SIMD) && !defined(BASERT_AVX512)
    return type == BASERT_GGML_Q5_0 || type == BASERT_GGML_Q5_1 ? 4 : 2;
#else
    (void)type;
    return 4;
#endif
}

#if defined(BASERT_AVX512)
/* Q4_K rows streamed on avx512 with the q4 lookup: a sub-block of 32 has 16 possible values, (d * scale) * q -
 * dmin * min for q = 0..15 (the same products and differences as basert_dequant_block), computed once into a
 * register; each weight is looked up by its code (vpermps reads the low 4 bits of a zero-extended byte, so the
 * high nibble needs one shift). */
BASERT_ALWAYS_INLINE void bm_stream_q4_k(const int R, const int C, const uint8_t *const *p, ptrdiff_t k, const float *x,
                                         ptrdiff_t ldx, bm_v acc[4][8]) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (ptrdiff_t b = 0; b < k / 256; b++) {
        float ds[4][8], dm[4][8];
        for (int r = 0; r < R; r++) {
            const uint8_t *block = p[r] + b * 144;
            __builtin_prefetch(block + 8 * 144);
            __builtin_prefetch(block + 8 * 144 + 64);
            __builtin_prefetch(block + 8 * 144 + 128);
            const float d = basert_block_f16(block), dmin = basert_block_f16(block + 2);
            for (int s = 0; s < 8; s++) {
                int scale, min;
                basert_k_scale_min(block + 4, s, &scale, &min);
                ds[r][s] = d * (float)scale;
                dm[r][s] = dmin * (float)min;
            }
        }
        for (int s = 0; s < 8; s++) {
            __m512 table[4];
            for (int r = 0; r < R; r++)
                table[r] = _mm512_sub_ps(_mm512_mul_ps(iota, _mm512_set1_ps(ds[r][s])), _mm512_set1_ps(dm[r][s]));
            for (int h = 0; h < 2; h++) {
                const ptrdiff_t e = b * 256 + 32 * s + 16 * h;
                for (int r = 0; r < R; r++) {
                    const uint8_t *codes = p[r] + b * 144 + 16 + 32 * (s >> 1) + 16 * h;
                    __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)codes));
                    if (s & 1) index = _mm512_srli_epi32(index, 4);
                    const __m512 wv = _mm512_permutexvar_ps(index, table[r]);
                    for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(_mm512_loadu_ps(x + c * ldx + e), wv, acc[r][c]);
                }
            }
        }
    }
}
#endif

#if defined(BASERT_AVX512)
/* Q5_0 / Q5_1 rows streamed on avx512 with a 32-entry lookup: a block's 32 possible values, d * (q - 16) or
 * d * q + m for q = 0..31 (the products and sums of basert_dequant_block), in two registers; vpermt2ps looks
 * each weight up by its 5-bit code, whose fifth bit comes from qh through a mask register. */
BASERT_ALWAYS_INLINE void bm_stream_q5(const int R, const int C, const int with_min, const uint8_t *const *p, ptrdiff_t k,
                                       const float *x, ptrdiff_t ldx, bm_v acc[4][8]) {
    const __m512 low = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 high = _mm512_add_ps(low, _mm512_set1_ps(16.0f));
    const __m512 code_lo = with_min ? low : _mm512_sub_ps(low, _mm512_set1_ps(16.0f)), code_hi = with_min ? high : low;
    const ptrdiff_t bytes = with_min ? 24 : 22;
    for (ptrdiff_t b = 0; b < k / 32; b++) {
        for (int r = 0; r < R; r++) {
            const uint8_t *block = p[r] + b * bytes;
            __builtin_prefetch(block + 16 * bytes);
            const __m512 d = _mm512_set1_ps(basert_block_f16(block));
            __m512 t_lo = _mm512_mul_ps(d, code_lo), t_hi = _mm512_mul_ps(d, code_hi);
            if (with_min) {
                const __m512 m = _mm512_set1_ps(basert_block_f16(block + 2));
                t_lo = _mm512_add_ps(t_lo, m);
                t_hi = _mm512_add_ps(t_hi, m);
            }
            const uint8_t *qh = block + (with_min ? 4 : 2);
            const uint32_t fifth = (uint32_t)qh[0] | ((uint32_t)qh[1] << 8) | ((uint32_t)qh[2] << 16) | ((uint32_t)qh[3] << 24);
            const __m512i nibbles = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(qh + 4)));
            for (int h = 0; h < 2; h++) {
                const __m512i q = h ? _mm512_srli_epi32(nibbles, 4) : _mm512_and_si512(nibbles, _mm512_set1_epi32(15));
                const __m512i index = _mm512_mask_or_epi32(q, (__mmask16)(fifth >> (16 * h)), q, _mm512_set1_epi32(16));
                const __m512 wv = _mm512_permutex2var_ps(t_lo, index, t_hi);
                const ptrdiff_t e = b * 32 + 16 * h;
                for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(_mm512_loadu_ps(x + c * ldx + e), wv, acc[r][c]);
            }
        }
    }
}
#endif

#if defined(BASERT_SIMD)
/* R rows of GGUF blocks of a type bm_block_values16 takes, summed in registers: per block, each row's scales
 * are read once, then 16 values at a time feed the C accumulators of that row. */
BASERT_ALWAYS_INLINE void bm_stream_blocks(const int R, const int C, const int type, const uint8_t *const *p, ptrdiff_t k,
                                           const float *x, ptrdiff_t ldx, bm_v acc[4][8]) {
    const ptrdiff_t values = basert_block_values(type), bytes = basert_block_bytes(type);
    for (ptrdiff_t b = 0; b < k / values; b++) {
        bm_gguf_block blk[4];
        for (int r = 0; r < R; r++) {
            const uint8_t *block = p[r] + b * bytes;
            for (ptrdiff_t line = 0; line < bytes; line += 64) __builtin_prefetch(block + BASERT_PREFETCH_BYTES + line);
            bm_block_open(type, block, &blk[r]);
        }
#pragma GCC unroll 16
        for (int j = 0; j < values / 16; j++)
            for (int r = 0; r < R; r++) {
                const bm_v wv = bm_block_values16(type, &blk[r], j);
                for (int c = 0; c < C; c++) acc[r][c] = bm_fma(bm_load(x + c * ldx + b * values + 16 * j), wv, acc[r][c]);
            }
    }
}
#endif

/* y[c * ldy + row + r] for R (1..4) consecutive weight rows and C (1..8; R * C <= 8, 16 on avx512)
 * activation rows x + c * ldx: each de-quantized weight vector feeds C accumulators.
 * The R * C accumulators are independent, which hides the FMA latency. GS: the group size as a
 * constant (0: read it from w), so that size gets a fully unrolled group loop. type: for BASERT_BLOCKS, the GGUF
 * type as a constant (SIMD variants; the portable one de-quantizes a block through basert_dequant_block, which
 * reads w->ggml_type). */
BASERT_ALWAYS_INLINE void bm_stream_block(const int R, const int C, const int kind, const int sym, const ptrdiff_t GS,
                                          const int type, const basert_weight *w, ptrdiff_t row, const float *x, ptrdiff_t ldx,
                                          float *y, ptrdiff_t ldy) {
    const ptrdiff_t k = w->k, k16 = k & ~(ptrdiff_t)15;
    const uint8_t *p[4];
    bm_v acc[4][8];
    for (int r = 0; r < R; r++) {
        p[r] = w->data + (row + r) * w->row_bytes;
        for (int c = 0; c < C; c++) acc[r][c] = bm_zero();
    }
    const ptrdiff_t gs = bm_is_dense(kind) || kind == BASERT_BLOCKS ? 0 : GS ? GS : w->group_size, groups = gs ? k / gs : 0;
    const uint16_t *sp[4], *bp[4];
    for (int r = 0; r < R; r++) {
        sp[r] = gs ? w->scales + (row + r) * groups : NULL;
        bp[r] = gs && !sym ? w->biases + (row + r) * groups : NULL;
    }
#if defined(BASERT_AVX512)
    if (kind == BASERT_BLOCKS && type == BASERT_GGML_Q4_K) {
        bm_stream_q4_k(R, C, p, k, x, ldx, acc);
    } else if (kind == BASERT_BLOCKS && (type == BASERT_GGML_Q5_0 || type == BASERT_GGML_Q5_1)) {
        bm_stream_q5(R, C, type == BASERT_GGML_Q5_1, p, k, x, ldx, acc);
    } else
#endif
#if defined(BASERT_SIMD)
    if (kind == BASERT_BLOCKS) {
        bm_stream_blocks(R, C, type, p, k, x, ldx, acc);
    } else
#else
    if (kind == BASERT_BLOCKS) {
        /* GGUF blocks without SIMD: a block of each of the R rows de-quantized into a buffer (the exact values
         * of basert_dequant_row), then summed as dense weights. */
        (void)type;
        const ptrdiff_t values = w->group_size, bytes = basert_block_bytes(w->ggml_type);
        float buf[4][256] __attribute__((aligned(64)));
        for (ptrdiff_t b = 0; b < k / values; b++) {
            for (int r = 0; r < R; r++) {
                __builtin_prefetch(p[r] + (b + 8) * bytes);
                bm_dequant_block(w->ggml_type, p[r] + b * bytes, buf[r]);
            }
            for (ptrdiff_t e = 0; e < values; e += 16)
                for (int r = 0; r < R; r++) {
                    const bm_v wv = bm_load(buf[r] + e);
                    for (int c = 0; c < C; c++) acc[r][c] = bm_fma(bm_load(x + c * ldx + b * values + e), wv, acc[r][c]);
                }
        }
    } else
#endif
    if (bm_is_dense(kind)) {
        const ptrdiff_t esize = kind == BASERT_F32 ? 4 : 2;
        for (ptrdiff_t e = 0; e < k16; e += 16) {
            for (int r = 0; r < R; r++) {
                __builtin_prefetch(p[r] + e * esize + BASERT_PREFETCH_BYTES);
                if (esize == 4) __builtin_prefetch(p[r] + e * esize + BASERT_PREFETCH_BYTES + 32);
                bm_v wv = bm_dense16(kind, p[r], e);
                for (int c = 0; c < C; c++) acc[r][c] = bm_fma(bm_load(x + c * ldx + e), wv, acc[r][c]);
            }
        }
    } else if (gs % 16 == 0) {
        const ptrdiff_t gbytes = kind == BASERT_Q4 ? gs / 2 : gs;
        /* The next block's scales and biases (R consecutive rows of them) are prefetched while this one runs. */
        for (ptrdiff_t off = 0; off < R * groups; off += 32) {
            __builtin_prefetch(sp[0] + R * groups + off);
            if (!sym) __builtin_prefetch(bp[0] + R * groups + off);
        }
        /* Scales of up to BM_SCALE_RUN groups of every row converted at once, then broadcast per group. */
        float sf[4][BM_SCALE_RUN], bf[4][BM_SCALE_RUN];
        for (ptrdiff_t g0 = 0; g0 < groups; g0 += BM_SCALE_RUN) {
            const ptrdiff_t gn = groups - g0 < BM_SCALE_RUN ? groups - g0 : BM_SCALE_RUN;
            for (int r = 0; r < R; r++) {
                bm_scales(sp[r] + g0, gn, w->bf16_scales, sf[r]);
                if (!sym) bm_scales(bp[r] + g0, gn, w->bf16_scales, bf[r]);
            }
            for (ptrdiff_t g = 0; g < gn; g++) {
                /* One prefetch per cache line of codes, BASERT_PREFETCH_BYTES ahead along each row. */
                if ((((g0 + g) * gbytes) & 63) < gbytes)
                    for (int r = 0; r < R; r++) __builtin_prefetch(p[r] + (g0 + g) * gbytes + BASERT_PREFETCH_BYTES);
                bm_v scale[4], bias[4];
                for (int r = 0; r < R; r++) {
                    scale[r] = bm_set1(sf[r][g]);
                    bias[r] = sym ? scale[r] : bm_set1(bf[r][g]);
                }
                const ptrdiff_t e0 = (g0 + g) * gs;
                if (gs % 32 == 0) {
                    /* Two vectors per step: one load of codes serves 32 weights. */
                    bm_v table[4];
                    for (int r = 0; r < R; r++) table[r] = bm_group_table(kind, sym, scale[r], bias[r]);
                    for (ptrdiff_t e = e0; e < e0 + gs; e += 32) {
                        for (int r = 0; r < R; r++) {
                            bm_v w0, w1;
                            bm_weights32(kind, sym, p[r], e, scale[r], bias[r], table[r], &w0, &w1);
                            for (int c = 0; c < C; c++) {
                                acc[r][c] = bm_fma(bm_load(x + c * ldx + e), w0, acc[r][c]);
                                acc[r][c] = bm_fma(bm_load(x + c * ldx + e + 16), w1, acc[r][c]);
                            }
                        }
                    }
                } else {
                    for (ptrdiff_t e = e0; e < e0 + gs; e += 16) {
                        for (int r = 0; r < R; r++) {
                            bm_v wv = bm_dequant(sym, bm_codes16(kind, sym, p[r], e), scale[r], bias[r]);
                            for (int c = 0; c < C; c++) acc[r][c] = bm_fma(bm_load(x + c * ldx + e), wv, acc[r][c]);
                        }
                    }
                }
            }
        }
    } else {
        /* Groups that are not a multiple of 16: a vector may straddle two of them. */
        for (ptrdiff_t e = 0; e < k16; e += 16) {
            for (int r = 0; r < R; r++) {
                bm_v scale, bias;
                bm_scales_at(sym, w, sp[r], bp[r], e, &scale, &bias);
                bm_v wv = bm_dequant(sym, bm_codes16(kind, sym, p[r], e), scale, bias);
                for (int c = 0; c < C; c++) acc[r][c] = bm_fma(bm_load(x + c * ldx + e), wv, acc[r][c]);
            }
        }
    }
    for (int c = 0; c < C; c++) {
        float total[4];
        if (R == 4) bm_hsum4(acc[0][c], acc[1][c], acc[2][c], acc[3][c], total);
        else
            for (int r = 0; r < R; r++) total[r] = bm_hsum(acc[r][c]);
        for (int r = 0; r < R; r++) {
            /* The K % 16 tail (quantized weights have one only when the group size is not a multiple of 16; GGUF
             * blocks never: a row is a whole number of them). */
            for (ptrdiff_t e = k16; e < k; e++) {
                float wv;
                if (bm_is_dense(kind)) {
                    wv = bm_dense1(kind, p[r], e);
                } else {
                    const float s = bm_scale_f32(sp[r][e / gs], w->bf16_scales);
                    wv = bm_quant1(kind, sym, p[r], e, s, sym ? s : bm_scale_f32(bp[r][e / gs], w->bf16_scales));
                }
                total[r] = fmaf(x[c * ldx + e], wv, total[r]);
            }
            y[c * ldy + row + r] = total[r];
        }
    }
}

/* All m (<= 3) activation rows against R weight rows. */

/* ---- the streaming kernels: one instance per weight kind, its block shapes, and their dispatch ---- */

/* Weight rows r0..r1 (R rows at a time; r1 - r0 a multiple of R) against C activation rows: a weight kind's
 * bm_stream_block for every shape (R, C) basert_stream (matmul_dispatch.c) runs. */
typedef void (*bm_stream_fn)(int R, int C, const basert_weight *w, ptrdiff_t r0, ptrdiff_t r1, const float *x, ptrdiff_t ldx,
                             float *y, ptrdiff_t ldy);

/* A weight kind's streaming kernel, and the weight rows it streams together for a single activation row. */
typedef struct {
    bm_stream_fn run;
    int m1_rows;
} bm_stream_kernel;

/* Weight rows streamed together for a single activation row: BM_STREAM_ROWS_M1_QUANT for q4/q8, bm_blocks_m1_rows for
 * GGUF blocks, four for dense weights; one on the portable variant, where each shape is one more copy of the kernel to
 * compile for a variant whose speed matters less. */
BASERT_ALWAYS_INLINE int bm_m1_rows(const int kind, const int type) {
#if defined(BASERT_SIMD)
    if (kind == BASERT_Q4 || kind == BASERT_Q8) return BM_STREAM_ROWS_M1_QUANT;
    return kind == BASERT_BLOCKS ? bm_blocks_m1_rows(type) : 4;
#else
    (void)kind, (void)type;
    return 1;
#endif
}

#define BM_SHAPE(R, C) ((R) << 4 | (C))

/* The shapes basert_stream runs: (M1, 1) and (1, 1) for one activation row (M1 = bm_m1_rows); for more,
 * (BM_STREAM_ROWS, C) and (1, C) with C = 8 (avx512), 4 and the last 1..3. */
BASERT_ALWAYS_INLINE void bm_stream_shape(const int kind, const int sym, const ptrdiff_t GS, const int type, int R, int C,
                                          const basert_weight *w, ptrdiff_t r0, ptrdiff_t r1, const float *x, ptrdiff_t ldx,
                                          float *y, ptrdiff_t ldy) {
    const int M1 = bm_m1_rows(kind, type);
#define BM_RUN(r, c)                                                                                                     \
    for (ptrdiff_t row = r0; row < r1; row += (r)) bm_stream_block(r, c, kind, sym, GS, type, w, row, x, ldx, y, ldy); \
    return
    if (M1 > 1 && R == M1 && C == 1) {
        BM_RUN(M1, 1);
    }
    switch (BM_SHAPE(R, C)) {
    case BM_SHAPE(1, 1): BM_RUN(1, 1);
    case BM_SHAPE(1, 2): BM_RUN(1, 2);
    case BM_SHAPE(1, 3): BM_RUN(1, 3);
    case BM_SHAPE(1, 4): BM_RUN(1, 4);
#if defined(BASERT_AVX512)
    case BM_SHAPE(1, 8): BM_RUN(1, 8);
    case BM_SHAPE(2, 1): BM_RUN(2, 1);
    case BM_SHAPE(2, 2): BM_RUN(2, 2);
    case BM_SHAPE(2, 3): BM_RUN(2, 3);
    case BM_SHAPE(2, 4): BM_RUN(2, 4);
    case BM_SHAPE(2, 8): BM_RUN(2, 8);
#endif
    default: __builtin_unreachable();
    }
#undef BM_RUN
}

/* Defines `name`, the bm_stream_fn of one weight kind (the bm_stream_block parameters). */
#define BM_STREAM_FN(name, kind, sym, group, type)                                                                       \
    static void name(int R, int C, const basert_weight *w, ptrdiff_t r0, ptrdiff_t r1, const float *x, ptrdiff_t ldx,   \
                     float *y, ptrdiff_t ldy) {                                                                          \
        bm_stream_shape(kind, sym, group, type, R, C, w, r0, r1, x, ldx, y, ldy);                                        \
    }

/* Defines name_kernel and name_dequant_row, the family functions of a group-quantized kind (matmul_q4.c, matmul_q8.c):
 * its kernels symmetric or not, for any group size, and on the SIMD variants one more with the group loop unrolled for
 * group 32 (what GGUF's Q4_0, Q4_1 and Q8_0 map to), which pays from four activation rows on (SmolLM2's shapes on a
 * Zen 3: 8-30% at M = 4 and 16). */
#if defined(BASERT_SIMD)
#define BM_QUANT_KERNEL(name, kind)                                                                                      \
    BM_STREAM_FN(name##_sym_g32, kind, 1, 32, 0)                                                                         \
    BM_STREAM_FN(name##_asym_g32, kind, 0, 32, 0)                                                                        \
    bm_stream_kernel name##_kernel(const basert_weight *w) {                                                             \
        const int g32 = w->group_size == 32;                                                                             \
        const bm_stream_fn run = w->biases == NULL ? (g32 ? name##_sym_g32 : name##_sym) : (g32 ? name##_asym_g32 : name##_asym); \
        return (bm_stream_kernel){run, bm_m1_rows(kind, 0)};                                                             \
    }
#else
#define BM_QUANT_KERNEL(name, kind)                                                                                      \
    bm_stream_kernel name##_kernel(const basert_weight *w) {                                                             \
        return (bm_stream_kernel){w->biases == NULL ? name##_sym : name##_asym, bm_m1_rows(kind, 0)};                    \
    }
#endif
#define BM_QUANT_FAMILY(name, kind)                                                                                      \
    BM_STREAM_FN(name##_sym, kind, 1, 0, 0)                                                                              \
    BM_STREAM_FN(name##_asym, kind, 0, 0, 0)                                                                             \
    BM_QUANT_KERNEL(name, kind)                                                                                          \
    void name##_dequant_row(const basert_weight *w, ptrdiff_t row, float *dst) {                                         \
        if (w->biases == NULL) bm_dequant_row_kind(kind, 1, w, row, dst);                                                \
        else bm_dequant_row_kind(kind, 0, w, row, dst);                                                                  \
    }

/* Each weight family's unit: the streaming kernel of a weight, and its row de-quantization. */
bm_stream_kernel bm_dense_kernel(const basert_weight *w);
bm_stream_kernel bm_q4_kernel(const basert_weight *w);
bm_stream_kernel bm_q8_kernel(const basert_weight *w);
bm_stream_kernel bm_blocks_kernel(const basert_weight *w);
void bm_dense_dequant_row(const basert_weight *w, ptrdiff_t row, float *dst);
void bm_q4_dequant_row(const basert_weight *w, ptrdiff_t row, float *dst);
void bm_q8_dequant_row(const basert_weight *w, ptrdiff_t row, float *dst);
void bm_blocks_dequant_row(const basert_weight *w, ptrdiff_t row, float *dst);

#endif
