/* Quantized activations and the integer dot products of quantized weights (matmul.h states the contract): base_q4 /
 * base_q8, and the GGUF blocks Q3_K, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1.
 *
 * SIMD variants, a few activation rows (decode, a few sequences, short verifications), eight weight rows at a time.
 * base_q4, Q4_K, Q5_K and Q6_K (bt_*, up to eight activation rows): the eight rows' code bytes transposed by four-byte
 * units, so that each maddubs against broadcast activation bytes leaves row r's sums in lane r, with no fold; 16-bit
 * activations as two planes of bytes. The others up to four. These four types are stored so transposed (matmul.h's
 * packed rows, basert_pack_rows): the unpacking GEMM reads base_q4 and Q4_K groups as they are (bg_unpack_packed); the
 * other kernels copy a packed span back to the file's layout first (bq_stored_span). The other weights: each row's 32
 * integers of a block are split into two vectors of 16-bit lanes, the even-numbered values and the odd-numbered ones
 * (the order of the activation records), which meet the activation block in two madds (Q3_K's scales multiplied in
 * first); the eight rows' partial sums are folded into one vector of eight exact block sums (lane r: weight row r), and
 * the float operations run on those eight rows at once; the AVX-512 variant takes two blocks per vector where it can
 * (bz_*). With 8-bit activations, Q5_0 and Q5_1 codes (and base_q4's where the byte kernels cannot have their buffer)
 * meet them as bytes instead (bq_dot8_pair: one maddubs per row and block). Larger batches (nine rows or more for the
 * byte kernels' types, five for the others) take the unpacking kernels further down (bg_*). The portable variant computes the same integers and float operations row by
 * row. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "matmul.h"

/* Weight rows per block of the kernel, and activation rows at most per call of it. */
#define BQ_ROWS 8
#define BQ_COLS 4

/* Activation record fields (matmul.h): codes, then the block scales, then the block sums. */
static inline const int16_t *bq_codes(const uint8_t *rec) { return (const int16_t *)(const void *)rec; }
static inline const float *bq_scales(const uint8_t *rec, ptrdiff_t k) { return (const float *)(const void *)(rec + 2 * k); }
static inline const float *bq_sums(const uint8_t *rec, ptrdiff_t k) {
    return (const float *)(const void *)(rec + 2 * k + k / 8);
}

/* Where value j of a block of 32 sits in its record: the even-numbered values first, then the odd-numbered ones. */
static inline int bq_slot(int j) { return (j >> 1) + 16 * (j & 1); }

/* One scale or bias of a weight's groups as a float (f16 or bf16 bits, exactly). */
static inline float bq_scale_f32(uint16_t bits, int bf16) {
    if (bf16) {
        const uint32_t wide = (uint32_t)bits << 16;
        float f;
        memcpy(&f, &wide, sizeof f);
        return f;
    }
    const uint8_t b[2] = {(uint8_t)bits, (uint8_t)(bits >> 8)};
    return basert_block_f16(b);
}

/* ---- quantizing activations ---- */

void basert_quantize_rows(const float *x, ptrdiff_t ldx, ptrdiff_t m, ptrdiff_t k, int qmax, uint8_t *dst) {
    const ptrdiff_t rb = basert_qrow_bytes(k);
    const float BQ_QMAX = (float)qmax;
    for (ptrdiff_t i = 0; i < m; i++) {
        const float *row = x + i * ldx;
        uint8_t *rec = dst + i * rb;
        int16_t *q = (int16_t *)(void *)rec;
        float *d = (float *)(void *)(rec + 2 * k);
        float *sums = (float *)(void *)(rec + 2 * k + k / 8);
        for (ptrdiff_t b = 0; b < k / 32; b++) {
            const float *v = row + 32 * b;
#if defined(BASERT_SIMD)
            const __m256 sign = _mm256_set1_ps(-0.0f);
            __m256 top = _mm256_setzero_ps();
            /* max(|x|, top): a NaN is never taken, as in the portable loop. */
            for (int j = 0; j < 32; j += 8) top = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)), top);
            __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
            t4 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
            t4 = _mm_max_ss(t4, _mm_shuffle_ps(t4, t4, 0x55));
            const float amax = _mm_cvtss_f32(t4);
#else
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) {
                const float a = fabsf(v[j]);
                amax = a > amax ? a : amax;
            }
#endif
            const float scale = amax / BQ_QMAX, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
            d[b] = scale;
#if defined(BASERT_SIMD)
            const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-BQ_QMAX), hi = _mm256_set1_ps(BQ_QMAX);
            /* Each eight values' even-numbered ones into the low half, odd-numbered into the high half. */
            const __m256i split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
            __m256i r[4], total = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                /* max(v, lo) takes lo for a NaN (its second operand), like the portable comparison. */
                const __m256 s = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * j), vinv), lo), hi);
                r[j] = _mm256_cvtps_epi32(s);
                total = _mm256_add_epi32(total, r[j]);
                r[j] = _mm256_permutevar8x32_epi32(r[j], split);
            }
            /* packs works within 128-bit lanes: the 64-bit permute puts the 16 codes back in order. */
            const __m256i even = _mm256_packs_epi32(_mm256_permute2x128_si256(r[0], r[1], 0x20),
                                                    _mm256_permute2x128_si256(r[2], r[3], 0x20));
            const __m256i odd = _mm256_packs_epi32(_mm256_permute2x128_si256(r[0], r[1], 0x31),
                                                   _mm256_permute2x128_si256(r[2], r[3], 0x31));
            _mm256_storeu_si256((__m256i *)(void *)(q + 32 * b), _mm256_permute4x64_epi64(even, 0xD8));
            _mm256_storeu_si256((__m256i *)(void *)(q + 32 * b + 16), _mm256_permute4x64_epi64(odd, 0xD8));
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
            t = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
            sums[b] = (float)(_mm_cvtsi128_si32(t) + _mm_extract_epi32(t, 1));
#else
            int32_t total = 0;
            for (int j = 0; j < 32; j++) {
                float s = v[j] * inv;
                if (!(s >= -BQ_QMAX)) s = -BQ_QMAX; /* NaN too */
                if (s > BQ_QMAX) s = BQ_QMAX;
                const int code = (int)lrintf(s);
                q[32 * b + bq_slot(j)] = (int16_t)code;
                total += code;
            }
            sums[b] = (float)total;
#endif
        }
    }
}

/* ---- packed rows (matmul.h) ---- */

void basert_pack_rows(const basert_weight *w, const uint8_t *src, uint8_t *dst, ptrdiff_t r0, ptrdiff_t r1) {
    const ptrdiff_t bytes = basert_packed_chunk(w), rb = w->row_bytes, grouped = r1 / 8 * 8;
    for (ptrdiff_t g = r0; g < grouped; g += 8) {
        for (ptrdiff_t at = 0; at < rb; at += bytes) {
            const uint8_t *q[8];
            for (int r = 0; r < 8; r++) q[r] = src + (g + r) * rb + at;
            basert_pack_chunk(q, bytes, dst + g * rb + 8 * at);
        }
    }
    memcpy(dst + grouped * rb, src + grouped * rb, (size_t)((r1 - grouped) * rb));
}

/* ---- the kernels ---- */

/* What is taken off the stored code u to give w (matmul.h): 8 for symmetric q4, 128 for symmetric q8, 16 for Q5_0;
 * 0 otherwise (Q6_K's offset goes with its scales). */
static inline int bq_offset(const int kind, const int type, const int sym) {
    if (kind == BASERT_BLOCKS) return type == BASERT_GGML_Q5_0 ? 16 : 0;
    return sym ? (kind == BASERT_Q4 ? 8 : 128) : 0;
}

/* Whether the weight's blocks have a B term (matmul.h): base kinds with biases, Q4_K, Q5_K, Q5_1. */
static inline int bq_has_bias(const int kind, const int type, const int sym) {
    if (kind != BASERT_BLOCKS) return !sym;
    return type == BASERT_GGML_Q4_K || type == BASERT_GGML_Q5_K || type == BASERT_GGML_Q5_1;
}

/* Where 32-value block b of a GGUF row starts, and which 32 of its block (sub, 0..7 for 256-value blocks) it is. */
static inline const uint8_t *bq_gguf_block(const int type, const uint8_t *row, ptrdiff_t b, int *sub) {
    if (basert_block_values(type) == 256) {
        *sub = (int)(b & 7);
        return row + (b >> 3) * basert_block_bytes(type);
    }
    *sub = 0;
    return row + b * basert_block_bytes(type);
}

/* A and B (matmul.h) of 32-value block b of a GGUF row. */
static inline void bq_gguf_scales(const int type, const uint8_t *row, ptrdiff_t b, float *a, float *bias) {
    int sub;
    const uint8_t *blk = bq_gguf_block(type, row, b, &sub);
    switch (type) {
    case BASERT_GGML_Q4_K:
    case BASERT_GGML_Q5_K: {
        int scale, min;
        basert_k_scale_min(blk + 4, sub, &scale, &min);
        *a = basert_block_f16(blk) * (float)scale;
        *bias = -(basert_block_f16(blk + 2) * (float)min);
        break;
    }
    case BASERT_GGML_Q6_K: *a = basert_block_f16(blk + 208); *bias = 0.0f; break;
    case BASERT_GGML_Q3_K: *a = basert_block_f16(blk + 108); *bias = 0.0f; break;
    case BASERT_GGML_Q5_1: *a = basert_block_f16(blk); *bias = basert_block_f16(blk + 2); break;
    default: *a = basert_block_f16(blk); *bias = 0.0f; break;
    }
}

#if !defined(BASERT_SIMD)
/* The integers w of 32-value block b of a GGUF row (matmul.h). */
static inline void bq_gguf_ints(const int type, const uint8_t *row, ptrdiff_t b, int *w) {
    int sub;
    const uint8_t *blk = bq_gguf_block(type, row, b, &sub);
    for (int j = 0; j < 32; j++) {
        if (type == BASERT_GGML_Q4_K || type == BASERT_GGML_Q5_K) {
            const int five = type == BASERT_GGML_Q5_K;
            const uint8_t *qs = blk + (five ? 48 : 16) + 32 * (sub >> 1);
            int u = (qs[j] >> (4 * (sub & 1))) & 15;
            if (five) u |= ((blk[16 + j] >> sub) & 1) << 4;
            w[j] = u;
        } else if (type == BASERT_GGML_Q3_K) {
            const int h = sub >> 2, t = sub & 3;
            const int low = (blk[32 + 32 * h + j] >> (2 * t)) & 3, high = (blk[j] >> sub) & 1;
            w[j] = basert_q3_k_scale(blk + 96, 2 * sub + (j >> 4)) * (low + 4 * high - 4);
        } else if (type == BASERT_GGML_Q6_K) {
            const int h = sub >> 2, t = sub & 3;
            const int low = (blk[64 * h + 32 * (t & 1) + j] >> (4 * (t >> 1))) & 15, high = (blk[128 + 32 * h + j] >> (2 * t)) & 3;
            w[j] = (int)(int8_t)blk[192 + 2 * sub + (j >> 4)] * ((low | (high << 4)) - 32);
        } else {
            const int with_min = type == BASERT_GGML_Q5_1;
            const uint8_t *qh = blk + (with_min ? 4 : 2), *qs = qh + 4;
            const uint32_t high = (uint32_t)qh[0] | ((uint32_t)qh[1] << 8) | ((uint32_t)qh[2] << 16) | ((uint32_t)qh[3] << 24);
            const int u = ((qs[j & 15] >> (4 * (j >> 4))) & 15) | (int)(((high >> j) & 1u) << 4);
            w[j] = with_min ? u : u - 16;
        }
    }
}
#endif

#if defined(BASERT_SIMD)
BASERT_ALWAYS_INLINE __m256i bq_load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)(const void *)p); }

/* Bytes v[0..32) as 16-bit lanes: the even-numbered bytes in *even, the odd-numbered ones in *odd. */
BASERT_ALWAYS_INLINE void bq_halves(__m256i v, __m256i *even, __m256i *odd) {
    *even = _mm256_and_si256(v, _mm256_set1_epi16(255));
    *odd = _mm256_srli_epi16(v, 8);
}

/* Bytes p[0..32) shifted right by `shift` bits (0..7) and masked to `mask`, as bytes. */
BASERT_ALWAYS_INLINE __m256i bq_bytes(const uint8_t *p, int shift, int mask) {
    return _mm256_and_si256(_mm256_srl_epi16(bq_load32(p), _mm_cvtsi32_si128(shift)), _mm256_set1_epi8((char)mask));
}

/* Bytes v[0..32) shifted right by `shift` bits and masked to `mask`, as 16-bit lanes: the even-numbered bytes in
 * *even, the odd-numbered ones in *odd. */
BASERT_ALWAYS_INLINE void bq_split(__m256i v, int shift, int mask, __m256i *even, __m256i *odd) {
    const __m256i m = _mm256_set1_epi16((short)mask);
    *even = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), m);
    *odd = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift + 8)), m);
}

/* Q5_0 / Q5_1: the 5-bit codes of a block (low nibbles of qs: elements 0-15, high nibbles: 16-31; bit j of qh the
 * fifth bit of element j), one byte each. */
BASERT_ALWAYS_INLINE __m256i bq_q5_codes(const uint8_t *qh, const uint8_t *qs) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)(const void *)qs), mask = _mm_set1_epi8(15);
    const __m256i nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
    uint32_t bits;
    memcpy(&bits, qh, sizeof bits);
    /* Byte j gets qh's byte j / 8, then its bit j % 8. */
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
    return _mm256_or_si256(nibbles, _mm256_and_si256(set, _mm256_set1_epi8(16)));
}

/* The integers of 32-value sub-block `sub` (0..7) of the 256-value super-block blk (Q4_K, Q5_K, Q6_K), as bq_weights
 * gives them. */
BASERT_ALWAYS_INLINE void bq_k_weights(const int type, const uint8_t *blk, const int sub, __m256i *even, __m256i *odd) {
    if (type == BASERT_GGML_Q4_K || type == BASERT_GGML_Q5_K) {
        if (type == BASERT_GGML_Q4_K) {
            bq_split(bq_load32(blk + 16 + 32 * (sub >> 1)), 4 * (sub & 1), 15, even, odd);
            return;
        }
        /* Q5_K: the fifth bits joined to the nibbles byte by byte (each at most 16, no carry into the next byte). */
        const __m256i u = _mm256_or_si256(bq_bytes(blk + 48 + 32 * (sub >> 1), 4 * (sub & 1), 15),
                                          _mm256_slli_epi16(bq_bytes(blk + 16, sub, 1), 4));
        bq_halves(u, even, odd);
        return;
    }
    if (type == BASERT_GGML_Q3_K) {
        const int h = sub >> 2, t = sub & 3;
        /* Codes 0..7 byte by byte: the two low bits, and the hmask bit as 4. */
        const __m256i u = _mm256_or_si256(bq_bytes(blk + 32 + 32 * h, 2 * t, 3), _mm256_slli_epi16(bq_bytes(blk, sub, 1), 2));
        __m256i ue, uo;
        bq_halves(u, &ue, &uo);
        /* Lanes 0-7 of each half hold values of the first 16 (scale 2 sub), lanes 8-15 of the second. */
        const __m256i mul = _mm256_set_m128i(_mm_set1_epi16((short)basert_q3_k_scale(blk + 96, 2 * sub + 1)),
                                             _mm_set1_epi16((short)basert_q3_k_scale(blk + 96, 2 * sub)));
        const __m256i off = _mm256_set1_epi16(4);
        *even = _mm256_mullo_epi16(_mm256_sub_epi16(ue, off), mul);
        *odd = _mm256_mullo_epi16(_mm256_sub_epi16(uo, off), mul);
        return;
    }
    /* Q6_K */
    const int h = sub >> 2, t = sub & 3;
    /* The six-bit codes byte by byte (the high two bits at most 0x30, no carry into the next byte), then split. */
    const __m256i u = _mm256_or_si256(bq_bytes(blk + 64 * h + 32 * (t & 1), 4 * (t >> 1), 15),
                                      _mm256_slli_epi16(bq_bytes(blk + 128 + 32 * h, 2 * t, 3), 4));
    __m256i ue, uo;
    bq_halves(u, &ue, &uo);
    /* Lanes 0-7 of each half hold values of the first 16 (scale 0), lanes 8-15 of the second (scale 1). */
    const int8_t *scales = (const int8_t *)(const void *)(blk + 192 + 2 * sub);
    const __m256i mul = _mm256_set_m128i(_mm_set1_epi16(scales[1]), _mm_set1_epi16(scales[0])), off = _mm256_set1_epi16(32);
    *even = _mm256_mullo_epi16(_mm256_sub_epi16(ue, off), mul);
    *odd = _mm256_mullo_epi16(_mm256_sub_epi16(uo, off), mul);
}

/* The integers of block b of a weight row as 16-bit lanes, the even-numbered values in *even and the odd-numbered
 * ones in *odd: codes u as stored, except Q6_K's scale * (u - 32) and Q3_K's scale * (u - 4); the offsets of
 * symmetric base codes and Q5_0 (bq_offset) are the caller's to take off. */
BASERT_ALWAYS_INLINE void bq_weights(const int kind, const int type, const uint8_t *row, ptrdiff_t b, __m256i *even,
                                     __m256i *odd) {
    if (kind == BASERT_Q4) {
        /* Byte i holds values 2i (low nibble) and 2i + 1 (high nibble). */
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(row + 16 * b)));
        *even = _mm256_and_si256(v, _mm256_set1_epi16(15));
        *odd = _mm256_srli_epi16(v, 4);
        return;
    }
    if (kind == BASERT_Q8) {
        bq_halves(bq_load32(row + 32 * b), even, odd);
        return;
    }
    if (basert_block_values(type) == 256) {
        bq_k_weights(type, row + (b >> 3) * basert_block_bytes(type), (int)(b & 7), even, odd);
        return;
    }
    const uint8_t *blk = row + b * basert_block_bytes(type);
    const int with_min = type == BASERT_GGML_Q5_1;
    bq_halves(bq_q5_codes(blk + (with_min ? 4 : 2), blk + (with_min ? 8 : 6)), even, odd);
}

/* 8 x 8 transpose: v[i] lane j becomes v[j] lane i. */
BASERT_ALWAYS_INLINE void bq_transpose8(__m256 *v) {
    const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
    const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
    const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
    const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    v[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    v[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    v[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    v[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    v[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    v[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    v[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    v[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* out[j][r] = the scale (or bias) of group g0 + j of weight row r, j < gn (at most 8), from bits laid out
 * [row][group] (`groups` per row). */
BASERT_ALWAYS_INLINE void bq_group_run(const uint16_t *bits, const ptrdiff_t *rows, ptrdiff_t groups, ptrdiff_t g0, ptrdiff_t gn,
                                       int bf16, __m256 *out) {
    if (gn == 8) {
        for (int r = 0; r < BQ_ROWS; r++) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(const void *)(bits + rows[r] * groups + g0));
            out[r] = bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)) : _mm256_cvtph_ps(raw);
        }
        bq_transpose8(out);
        return;
    }
    float tmp[8][BQ_ROWS];
    for (ptrdiff_t j = 0; j < gn; j++)
        for (int r = 0; r < BQ_ROWS; r++) tmp[j][r] = bq_scale_f32(bits[rows[r] * groups + g0 + j], bf16);
    for (ptrdiff_t j = 0; j < gn; j++) out[j] = _mm256_loadu_ps(tmp[j]);
}

/* F16 bits to float, exactly (F16C). */
BASERT_ALWAYS_INLINE float bq_f16(const uint8_t *p) {
    uint16_t bits;
    memcpy(&bits, p, sizeof bits);
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)));
}

/* Q4_K / Q5_K: the eight 6-bit scales (bytes 0-7 of out) and minimums (bytes 8-15) of a super-block from its 12
 * packed bytes, as basert_k_scale_min reads them one by one. */
BASERT_ALWAYS_INLINE void bq_k_scales_mins(const uint8_t *packed, uint32_t out[4]) {
    uint32_t u[3];
    memcpy(u, packed, sizeof u);
    out[0] = u[0] & 0x3f3f3f3fu;                                                   /* scales 0-3 */
    out[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);            /* scales 4-7 */
    out[2] = u[1] & 0x3f3f3f3fu;                                                   /* mins 0-3 */
    out[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);     /* mins 4-7 */
}

/* The A and B (matmul.h) of blocks b0 .. b0 + gn of eight GGUF rows: a[j][r], bias[j][r]. For the 256-value types b0
 * starts a super-block and gn is 8: its sub-blocks. */
BASERT_ALWAYS_INLINE void bq_gguf_run(const int type, const uint8_t *const *p, ptrdiff_t b0, ptrdiff_t gn, __m256 *a, __m256 *bias) {
    const ptrdiff_t bytes = basert_block_bytes(type);
    if (type == BASERT_GGML_Q6_K || type == BASERT_GGML_Q3_K) { /* one scale d per super-block */
        const ptrdiff_t at = type == BASERT_GGML_Q6_K ? 208 : 108;
        float d[BQ_ROWS];
        for (int r = 0; r < BQ_ROWS; r++) d[r] = bq_f16(p[r] + (b0 >> 3) * bytes + at);
        for (int j = 0; j < 8; j++) {
            a[j] = _mm256_loadu_ps(d);
            bias[j] = _mm256_setzero_ps();
        }
        return;
    }
    if (type == BASERT_GGML_Q4_K || type == BASERT_GGML_Q5_K) {
        for (int r = 0; r < BQ_ROWS; r++) {
            const uint8_t *blk = p[r] + (b0 >> 3) * bytes;
            uint32_t sm[4];
            bq_k_scales_mins(blk + 4, sm);
            const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)sm)));
            const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(sm + 2))));
            a[r] = _mm256_mul_ps(_mm256_set1_ps(bq_f16(blk)), sc);
            /* -(dmin * min): the sign flipped after the product. */
            bias[r] = _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(bq_f16(blk + 2)), mn), _mm256_set1_ps(-0.0f));
        }
    } else { /* Q5_0, Q5_1: a scale (and a minimum) per block of 32 */
        for (int r = 0; r < BQ_ROWS; r++) {
            uint16_t d[8] = {0}, m[8] = {0};
            for (ptrdiff_t j = 0; j < gn; j++) {
                const uint8_t *blk = p[r] + (b0 + j) * bytes;
                memcpy(&d[j], blk, 2);
                if (type == BASERT_GGML_Q5_1) memcpy(&m[j], blk + 2, 2);
            }
            a[r] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)d));
            bias[r] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)m));
        }
    }
    bq_transpose8(a);
    bq_transpose8(bias);
}

/* Weight rows row .. row + 8 of w: their indices and first bytes (beyond R: row again, its sums never stored). */
BASERT_ALWAYS_INLINE void bq_row_pointers(const basert_weight *w, ptrdiff_t row, int R, ptrdiff_t *rows, const uint8_t **p) {
    for (int r = 0; r < BQ_ROWS; r++) {
        rows[r] = row + (r < R ? r : 0);
        p[r] = w->data + rows[r] * w->row_bytes;
    }
}

/* The 4 x 4 transpose of 32-bit units within each 128-bit half: unit u of v[i] becomes unit i of out[u]. It is its
 * own inverse. */
BASERT_ALWAYS_INLINE void bt_transpose4(const __m256i *v, __m256i *out) {
    const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
    out[0] = _mm256_unpacklo_epi64(t0, t2);
    out[1] = _mm256_unpackhi_epi64(t0, t2);
    out[2] = _mm256_unpacklo_epi64(t1, t3);
    out[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* Bytes off .. off + 16 (off a multiple of 16) of the eight rows of a packed super-block g (matmul.h) as four
 * vectors: lane r of out[u] holds bytes off + 4u .. + 4 of row r. */
BASERT_ALWAYS_INLINE void bt_packed_units(const uint8_t *g, ptrdiff_t off, __m256i *out) {
    #pragma GCC unroll 4
    for (int u = 0; u < 4; u++) out[u] = _mm256_loadu_si256((const __m256i *)(const void *)(g + 8 * off + 32 * u));
}

/* Whether weight rows row .. row + 8 are one packed group of w, in place. */
static inline int bq_packed_group(const basert_weight *w, ptrdiff_t row) {
    return w->packed && row % 8 == 0 && row < w->n / 8 * 8;
}

/* Bytes per row of the spans that bq_stored_span copies at most: a GGUF super-block, or eight groups of scales of a
 * base_q4 weight (up to 128 values a group). */
#define BQ_SPAN 512

/* Bytes off .. off + len of weight rows rows[r] (bq_row_pointers) as the file stores them, within one chunk of a packed
 * weight (a GGUF super-block: off and len its own; base_q4: multiples of 16): q[r] in place, or copied out of the
 * weight's packed layout into tmp[r] (a packed group's eight rows at once: bt_transpose4 undoes the packing). */
BASERT_ALWAYS_INLINE void bq_stored_span(const basert_weight *w, const ptrdiff_t *rows, ptrdiff_t off, ptrdiff_t len,
                                         uint8_t (*tmp)[BQ_SPAN], const uint8_t **q) {
    if (!bq_packed_group(w, rows[0])) {
        for (int r = 0; r < BQ_ROWS; r++) q[r] = basert_weight_bytes(w, rows[r], off, len, tmp[r]);
        return;
    }
    const ptrdiff_t chunk = basert_packed_chunk(w), at = off % chunk, units = chunk / 16 * 16, tail = chunk - units;
    const uint8_t *g = w->data + rows[0] * w->row_bytes + 8 * (off - at);
    for (ptrdiff_t o = at; o < at + len && o < units; o += 16) {
        __m256i u[4], v[4];
        bt_packed_units(g, o, u);
        bt_transpose4(u, v);
        for (int r = 0; r < 4; r++) {
            _mm_storeu_si128((__m128i *)(void *)(tmp[r] + o - at), _mm256_castsi256_si128(v[r]));
            _mm_storeu_si128((__m128i *)(void *)(tmp[r + 4] + o - at), _mm256_extracti128_si256(v[r], 1));
        }
    }
    for (int r = 0; r < BQ_ROWS; r++) {
        if (at + len > units) memcpy(tmp[r] + units - at, g + 8 * units + tail * r, (size_t)tail);
        q[r] = tmp[r];
    }
}

/* The A and B of groups g0 .. g0 + gn (at most 8) of eight weight rows: scale[j][r], bias[j][r]. */
BASERT_ALWAYS_INLINE void bq_scale_run(const int kind, const int type, const int has_bias, const basert_weight *w,
                                       const ptrdiff_t *rows, const uint8_t *const *p, ptrdiff_t groups, ptrdiff_t g0,
                                       ptrdiff_t gn, __m256 *scale, __m256 *bias) {
    if (kind == BASERT_BLOCKS) {
        bq_gguf_run(type, p, g0, gn, scale, bias);
        return;
    }
    bq_group_run(w->scales, rows, groups, g0, gn, w->bf16_scales, scale);
    if (has_bias) bq_group_run(w->biases, rows, groups, g0, gn, w->bf16_scales, bias);
    else for (int j = 0; j < 8; j++) bias[j] = _mm256_setzero_ps();
}

/* acc + t for one block (matmul.h): the eight rows' exact block sums (less the offset times the activation sum S), times
 * A * d, plus (B * d) * S with a B. */
BASERT_ALWAYS_INLINE __m256 bq_fold_sums(const int has_bias, const int offset, __m256i total, __m256 sv, __m256 bv, float d,
                                         float sum, __m256 acc) {
    if (offset) total = _mm256_sub_epi32(total, _mm256_set1_epi32(offset * (int32_t)sum));
    const __m256 dv = _mm256_set1_ps(d);
    __m256 t = _mm256_mul_ps(_mm256_mul_ps(sv, dv), _mm256_cvtepi32_ps(total));
    if (has_bias) t = _mm256_add_ps(t, _mm256_mul_ps(_mm256_mul_ps(bv, dv), _mm256_set1_ps(sum)));
    return _mm256_add_ps(acc, t);
}

/* t[c]: weight rows p[0] and p[1] (bq_cols says where their integers are) against the C records' codes ae[c], ao[c],
 * multiplied, added and their lanes added pairwise (hadd). */
BASERT_ALWAYS_INLINE void bq_madd_pair(const int C, const int kind, const int type, const uint8_t *const *p, ptrdiff_t at,
                                       int j, ptrdiff_t b, const __m256i *ae, const __m256i *ao, __m256i *t) {
    __m256i e0, o0, e1, o1;
    if (kind == BASERT_BLOCKS && basert_block_values(type) == 256) {
        bq_k_weights(type, p[0] + at, j, &e0, &o0);
        bq_k_weights(type, p[1] + at, j, &e1, &o1);
    } else {
        bq_weights(kind, type, p[0], b, &e0, &o0);
        bq_weights(kind, type, p[1], b, &e1, &o1);
    }
    for (int c = 0; c < C; c++)
        t[c] = _mm256_hadd_epi32(_mm256_add_epi32(_mm256_madd_epi16(e0, ae[c]), _mm256_madd_epi16(o0, ao[c])),
                                 _mm256_add_epi32(_mm256_madd_epi16(e1, ae[c]), _mm256_madd_epi16(o1, ao[c])));
}

/* ---- 8-bit activations against byte codes: one to four activation rows ----
 *
 * Weights whose codes u are below 32 (base_q4, Q4_K, Q5_K, Q5_0, Q5_1) meeting 8-bit activations: a block's 32 codes
 * as bytes in natural order meet the activation block's 32 codes as signed bytes in one maddubs (pairs of products, at
 * most 2 * 31 * 127 in magnitude, never saturating) and one madd with ones; the eight rows' lanes fold as in bq_cols.
 * The same exact block sums as the 16-bit lanes, in about half the instructions. */
#define BQ8_CAPABLE(kind, type) ((kind) == BASERT_Q4 || ((kind) == BASERT_BLOCKS && ((type) == BASERT_GGML_Q4_K || \
    (type) == BASERT_GGML_Q5_K || (type) == BASERT_GGML_Q5_0 || (type) == BASERT_GGML_Q5_1)))

/* A block's 16 even-numbered and 16 odd-numbered codes (16-bit lanes of at most 127 in magnitude) as 32 signed bytes in
 * natural order: packs puts each 128-bit lane's eight even then eight odd codes side by side, and the shuffle
 * interleaves them. */
BASERT_ALWAYS_INLINE __m256i bq_pack8(__m256i even, __m256i odd) {
    return _mm256_shuffle_epi8(_mm256_packs_epi16(even, odd),
                               _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                                0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15));
}

/* An 8-bit activation block of a record as 32 signed bytes in natural order. */
BASERT_ALWAYS_INLINE __m256i bq_codes8(const int16_t *q) {
    return bq_pack8(bq_load32((const uint8_t *)(const void *)q), bq_load32((const uint8_t *)(const void *)(q + 16)));
}

/* The codes u of a block of a BQ8_CAPABLE weight row as 32 bytes in natural order: base_q4 block b of the row; a
 * 256-value type's sub-block j of its super-block at row + at; Q5_0 / Q5_1 block b. */
BASERT_ALWAYS_INLINE __m256i bq_code_bytes(const int kind, const int type, const uint8_t *row, ptrdiff_t at, int j,
                                           ptrdiff_t b) {
    if (kind == BASERT_Q4) {
        /* Byte i holds values 2i (low nibble) and 2i + 1 (high nibble): each to a byte of its 16-bit lane. */
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(row + 16 * b)));
        return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi16(15)), _mm256_slli_epi16(_mm256_srli_epi16(v, 4), 8));
    }
    if (type == BASERT_GGML_Q4_K) return bq_bytes(row + at + 16 + 32 * (j >> 1), 4 * (j & 1), 15);
    if (type == BASERT_GGML_Q5_K)
        return _mm256_or_si256(bq_bytes(row + at + 48 + 32 * (j >> 1), 4 * (j & 1), 15),
                               _mm256_slli_epi16(bq_bytes(row + at + 16, j, 1), 4));
    const uint8_t *blk = row + b * basert_block_bytes(type);
    const int with_min = type == BASERT_GGML_Q5_1;
    return bq_q5_codes(blk + (with_min ? 4 : 2), blk + (with_min ? 8 : 6));
}

/* t[c]: weight rows p[0] and p[1] against the C activation blocks a[c] (bq_codes8), their lanes added pairwise. */
BASERT_ALWAYS_INLINE void bq_dot8_pair(const int C, const int kind, const int type, const uint8_t *const *p, ptrdiff_t at,
                                       int j, ptrdiff_t b, const __m256i *a, __m256i *t) {
    const __m256i w0 = bq_code_bytes(kind, type, p[0], at, j, b), w1 = bq_code_bytes(kind, type, p[1], at, j, b);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int c = 0; c < C; c++)
        t[c] = _mm256_hadd_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(w0, a[c]), ones),
                                 _mm256_madd_epi16(_mm256_maddubs_epi16(w1, a[c]), ones));
}

/* acc[c] + t for block b of eight weight rows p[r] against the activation codes q[c] of C records (c < C): the rows'
 * scales and biases sv, bv. A 256-value type's integers come from its super-block at p[r] + at, sub-block j (constants
 * where the caller writes the super-block out); the others' from p[r], block wb (b, or b's index in the span of the
 * rows that p points to, bq_stored_span). Each pair of weight rows meets the C
 * records as soon as it is unpacked, and the rows' lanes are added pairwise as they come (hadd; in the end lane r holds
 * row r's block sum), so that few vectors are live at once. `eight`: 8-bit records against a BQ8_CAPABLE weight, whose
 * codes meet them as bytes (bq_dot8_pair), else 16-bit lanes (bq_madd_pair). */
BASERT_ALWAYS_INLINE void bq_cols(const int C, const int eight, const int kind, const int type, const int has_bias, const int offset,
                                  const uint8_t *const *p, ptrdiff_t at, int j, ptrdiff_t wb, ptrdiff_t b,
                                  const int16_t *const *q, const float *const *d, const float *const *s, __m256 sv,
                                  __m256 bv, __m256 *acc) {
    __m256i ae[BQ_COLS], ao[BQ_COLS], t0[BQ_COLS], t1[BQ_COLS], quad[BQ_COLS][2];
    for (int c = 0; c < C; c++) {
        if (eight) {
            ae[c] = bq_codes8(q[c] + 32 * b);
        } else {
            ae[c] = bq_load32((const uint8_t *)(const void *)(q[c] + 32 * b));
            ao[c] = bq_load32((const uint8_t *)(const void *)(q[c] + 32 * b + 16));
        }
    }
    for (int h = 0; h < 2; h++) {
        if (eight) {
            bq_dot8_pair(C, kind, type, p + 4 * h, at, j, wb, ae, t0);
            bq_dot8_pair(C, kind, type, p + 4 * h + 2, at, j, wb, ae, t1);
        } else {
            bq_madd_pair(C, kind, type, p + 4 * h, at, j, wb, ae, ao, t0);
            bq_madd_pair(C, kind, type, p + 4 * h + 2, at, j, wb, ae, ao, t1);
        }
        for (int c = 0; c < C; c++) quad[c][h] = _mm256_hadd_epi32(t0[c], t1[c]);
    }
    for (int c = 0; c < C; c++) {
        const __m256i lo = quad[c][0], hi = quad[c][1];
        const __m256i total = _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
        acc[c] = bq_fold_sums(has_bias, offset, total, sv, bv, d[c][b], s[c][b], acc[c]);
    }
}

/* The fields of C activation records qx + c * rb of k values, and their running sums zeroed. */
BASERT_ALWAYS_INLINE void bq_records(const int C, const uint8_t *qx, ptrdiff_t rb, ptrdiff_t k, const int16_t **q,
                                     const float **d, const float **s, __m256 *acc) {
    for (int c = 0; c < C; c++) {
        q[c] = bq_codes(qx + c * rb);
        d[c] = bq_scales(qx + c * rb, k);
        s[c] = bq_sums(qx + c * rb, k);
        acc[c] = _mm256_setzero_ps();
    }
}

/* y[c * ldy + r] = lane r of acc[c], r < R. */
BASERT_ALWAYS_INLINE void bq_store(const int C, int R, const __m256 *acc, float *y, ptrdiff_t ldy) {
    for (int c = 0; c < C; c++) {
        if (R == BQ_ROWS) {
            _mm256_storeu_ps(y + c * ldy, acc[c]);
        } else {
            float out[BQ_ROWS];
            _mm256_storeu_ps(out, acc[c]);
            for (int r = 0; r < R; r++) y[c * ldy + r] = out[r];
        }
    }
}

/* y[c * ldy + row + r] for weight rows row + r (r < R <= 8) against C activation records qx + c * rb (c < C <=
 * BQ_COLS). kind, type (GGUF blocks) and sym are constants of each instance; `eight`: as bq_cols's. */
BASERT_ALWAYS_INLINE void bq_block(const int C, const int kind, const int type, const int sym, const int eight,
                                   const basert_weight *w, ptrdiff_t row, int R, const uint8_t *qx, ptrdiff_t rb, float *y,
                                   ptrdiff_t ldy) {
    const int gguf = kind == BASERT_BLOCKS, has_bias = bq_has_bias(kind, type, sym), offset = bq_offset(kind, type, sym);
    const ptrdiff_t k = w->k, blocks = k / 32, per_group = gguf ? 1 : w->group_size / 32, groups = blocks / per_group;
    const ptrdiff_t block_bytes = gguf ? basert_block_bytes(type) / (basert_block_values(type) / 32) : kind == BASERT_Q4 ? 16 : 32;
    const ptrdiff_t prefetch_every = kind == BASERT_Q4 ? 4 : 2, ahead = BQ_ROWS * w->row_bytes; /* blocks; bytes */
    const uint8_t *p[BQ_ROWS];
    ptrdiff_t rows[BQ_ROWS];
    bq_row_pointers(w, row, R, rows, p);
    const int16_t *q[BQ_COLS];
    const float *d[BQ_COLS], *s[BQ_COLS];
    __m256 acc[BQ_COLS];
    bq_records(C, qx, rb, k, q, d, s, acc);
    __m256 scale[8], bias[8];
    /* Eight groups' scales at a time (a super-block's sub-blocks for the 256-value types), then their blocks. */
    for (ptrdiff_t g0 = 0; g0 < groups; g0 += 8) {
        const ptrdiff_t gn = groups - g0 < 8 ? groups - g0 : 8;
        if (gguf && basert_block_values(type) == 256) {
            /* A super-block's eight sub-blocks written out: their offsets and shifts are constants. Its bytes of the
             * next eight rows prefetched a cache line at a time. */
            const ptrdiff_t bytes = basert_block_bytes(type), at = (g0 >> 3) * bytes;
            uint8_t tmp[BQ_ROWS][BQ_SPAN];
            const uint8_t *blk[BQ_ROWS];
            bq_stored_span(w, rows, at, bytes, tmp, blk);
            bq_gguf_run(type, blk, 0, 8, scale, bias);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const ptrdiff_t line = j == 7 ? bytes - 1 : 32 * j;
                if ((j & 1) == 0 || j == 7)
                    if (line < bytes)
                        for (int r = 0; r < BQ_ROWS; r++) __builtin_prefetch(p[r] + ahead + at + line);
                bq_cols(C, eight, kind, type, has_bias, offset, blk, 0, j, g0 + j, g0 + j, q, d, s, scale[j], bias[j], acc);
            }
            continue;
        }
        bq_scale_run(kind, type, has_bias, w, rows, p, groups, g0, gn, scale, bias);
        /* A packed base_q4 weight's blocks of these groups as the file stores them: span, whose blocks count from
         * first. */
        const ptrdiff_t first = w->packed ? g0 * per_group : 0;
        uint8_t tmp[BQ_ROWS][BQ_SPAN];
        const uint8_t *span[BQ_ROWS];
        if (w->packed) bq_stored_span(w, rows, first * block_bytes, gn * per_group * block_bytes, tmp, span);
        for (ptrdiff_t j = 0; j < gn; j++) {
            for (ptrdiff_t i = 0; i < per_group; i++) {
                const ptrdiff_t b = (g0 + j) * per_group + i;
                /* The same codes of the next eight rows, about a cache line at a time. */
                if ((b & (prefetch_every - 1)) == 0)
                    for (int r = 0; r < BQ_ROWS; r++) __builtin_prefetch(p[r] + ahead + b * block_bytes);
                bq_cols(C, eight, kind, type, has_bias, offset, w->packed ? span : p, 0, 0, b - first, b, q, d, s,
                        scale[j], bias[j], acc);
            }
        }
    }
    bq_store(C, R, acc, y + row, ldy);
}

/* ---- base_q4 / Q4_K / Q5_K / Q6_K against one to eight activation rows: eight weight rows side by side ----
 *
 * The 16 code bytes at one offset of eight weight rows are transposed by four-byte units (as the weight stores them,
 * packed): lane r of unit vector u holds bytes 4u .. 4u + 4 of row r. One maddubs against four activation codes
 * broadcast to every lane then adds row r's products in lane r, so the eight rows' exact block sums come out lane by lane, with no horizontal fold
 * (bq_block folds eight vectors into one per block), and take bq_fold_sums' float operations: the same bits as
 * bq_block's. Q6_K's signed scales are multiplied in by madd (a row's pair of 16-bit sums in its lane, the scale in
 * both halves) and its offset of 32 taken off through the activation's sums of 16 codes. The activation rows are
 * first turned into bytes in natural order, with those sums (bt_activations): 8-bit codes as they are (one plane),
 * 16-bit ones q as two planes of bytes, lo = q & 127 and hi = q >> 7, which meet the weights as 8-bit codes do; then
 * I = 128 * I_hi + I_lo in wrapping 32-bit arithmetic, exact wherever the contract has I fit in 32 bits. Every sum of
 * products kept in 16 bits is bounded below 32768 for codes of magnitude 128 at most (the comments say how). A group of
 * eight weight rows meets a tile of activation rows at a time (bt_tile): the tile's kernel, one compiled per count of
 * rows and planes, keeps a 16-bit sum per row of bytes in a register, reads the activation bytes of a unit at constant
 * offsets from one pointer, and runs over every chunk of the group. */
#if defined(BASERT_SIMD)
#define BT_CAPABLE(kind, type) ((kind) == BASERT_Q4 || ((kind) == BASERT_BLOCKS && ((type) == BASERT_GGML_Q4_K || \
    (type) == BASERT_GGML_Q5_K || (type) == BASERT_GGML_Q6_K)))
/* Activation rows per call of the byte kernels at most. */
#define BT_COLS 8
/* Rows of activation bytes whose 16-bit sums a pass over a group of eight weight rows keeps in registers at most: the
 * activation rows are met BT_ROWS / P at a time (a tile), the group's chunks read again (from L1 or L2) for the next
 * tile. */
#define BT_ROWS 8
/* Activation rows per tile: Q5_K's sums widen every four units and take twice the registers. */
#define BT_TILE(type, P) (((type) == BASERT_GGML_Q5_K ? BT_ROWS / 2 : BT_ROWS) / (P))

/* Where a tile's activation bytes 4 * unit .. + 4 of its plane row i lie: the tile's `rows` plane rows interleaved by
 * units of four bytes, so that the bytes a unit of weights meets in every row are at constant offsets from one
 * pointer. */
static inline ptrdiff_t bt_tile_at(const int rows, ptrdiff_t unit, int i) { return 4 * (unit * rows + i); }

/* Four activation codes (bytes) in every 32-bit lane. */
BASERT_ALWAYS_INLINE __m256i bt_broadcast(const int8_t *a) {
    return _mm256_castps_si256(_mm256_broadcast_ss((const float *)(const void *)a));
}

/* Bytes of v shifted right (shift > 0) or left (shift < 0) by |shift| bits within their 16-bit lane and masked: no
 * bit of the neighbouring byte survives the masks used here. */
BASERT_ALWAYS_INLINE __m256i bt_bits(__m256i v, int shift, int mask) {
    const __m256i s = shift >= 0 ? _mm256_srli_epi16(v, shift) : _mm256_slli_epi16(v, -shift);
    return _mm256_and_si256(s, _mm256_set1_epi8((char)mask));
}

/* The sums of the first and of the second 16 of 32 signed bytes, as the low and high 16-bit halves (each at most
 * 16 * 128 in magnitude). */
BASERT_ALWAYS_INLINE int32_t bt_sums16(__m256i v) {
    /* Lanes 0-3: sums of four of the first 16 bytes; 4-7: of the second 16. */
    const __m256i quads = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v), _mm256_set1_epi16(1));
    const __m256i pairs = _mm256_hadd_epi32(quads, quads), whole = _mm256_hadd_epi32(pairs, pairs);
    const int32_t lo = _mm256_extract_epi32(whole, 0), hi = _mm256_extract_epi32(whole, 4);
    return (int32_t)(((uint32_t)hi << 16) | ((uint32_t)lo & 0xffffu));
}

/* A block's even- and odd-numbered codes (16-bit lanes) as bytes in natural order or, `natural` 0, in the records'
 * order: the 16 even-numbered values, then the 16 odd-numbered ones. */
BASERT_ALWAYS_INLINE __m256i bt_pack(const int natural, __m256i even, __m256i odd) {
    return natural ? bq_pack8(even, odd) : _mm256_permute4x64_epi64(_mm256_packs_epi16(even, odd), 0xD8);
}

/* The C activation records qx + c * rb of k values as P planes of bytes (bt_pack's order) for the byte kernels: plane
 * rows i = c * P + pl (an activation row's planes side by side), a tile's T activation rows (bt_tile_at) from
 * a8 + c0 * P * k; the 8-bit codes (P = 1), or the 16-bit codes' lo then hi bytes (P = 2); with `sums` (Q6_K), each
 * plane row's sums of 16 codes, s16[i * k / 32 + b] for block b (bt_sums16). */
BASERT_ALWAYS_INLINE void bt_activations(const int P, const int natural, int C, int T, const uint8_t *qx, ptrdiff_t rb,
                                         ptrdiff_t k, const int sums, int8_t *a8, int32_t *s16) {
    const __m256i low7 = _mm256_set1_epi16(127);
    for (int c = 0; c < C; c++) {
        const int16_t *q = bq_codes(qx + c * rb);
        const int c0 = c - c % T, rows = P * (C - c0 < T ? C - c0 : T);
        int8_t *tile = a8 + c0 * P * k;
        for (ptrdiff_t b = 0; b < k / 32; b++) {
            const __m256i even = bq_load32((const uint8_t *)(const void *)(q + 32 * b));
            const __m256i odd = bq_load32((const uint8_t *)(const void *)(q + 32 * b + 16));
            for (int pl = 0; pl < P; pl++) {
                const __m256i v = P == 1    ? bt_pack(natural, even, odd)
                                  : pl == 0 ? bt_pack(natural, _mm256_and_si256(even, low7), _mm256_and_si256(odd, low7))
                                            : bt_pack(natural, _mm256_srai_epi16(even, 7), _mm256_srai_epi16(odd, 7));
                const int i = (c - c0) * P + pl;
                int8_t bytes[32];
                _mm256_storeu_si256((__m256i *)(void *)bytes, v);
                for (int u = 0; u < 8; u++) memcpy(tile + bt_tile_at(rows, 8 * b + u, i), bytes + 4 * u, 4);
                if (sums) s16[(c * P + pl) * (k / 32) + b] = bt_sums16(v);
            }
        }
    }
}

/* The exact block sum of activation row c from its planes' sums t[c * P] (and t[c * P + 1]): 128 * I_hi + I_lo. */
BASERT_ALWAYS_INLINE __m256i bt_join(const int P, const __m256i *t, int c) {
    return P == 1 ? t[c] : _mm256_add_epi32(_mm256_slli_epi32(t[2 * c + 1], 7), t[2 * c]);
}

/* Q4_K / Q5_K: the headers of the eight rows of a packed super-block g (d, dmin and the 12 bytes of six-bit scales and
 * minimums, bq_k_scales_mins' unpacking done lane by lane): d and -dmin as floats, and in lane r of sc[0] / sc[1] the
 * scales of sub-blocks 0-3 / 4-7 of row r as bytes, of mn[] its minimums. */
BASERT_ALWAYS_INLINE void bt_k_headers(const uint8_t *g, __m256 *d, __m256 *neg_dmin, __m256i *sc, __m256i *mn) {
    __m256i u[4];
    bt_packed_units(g, 0, u);
    const __m256i low6 = _mm256_set1_epi32(0x3f3f3f3f), low4 = _mm256_set1_epi32(0x0f0f0f0f), two = _mm256_set1_epi32(0x03030303);
    sc[0] = _mm256_and_si256(u[1], low6);
    sc[1] = _mm256_or_si256(_mm256_and_si256(u[3], low4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u[1], 6), two), 4));
    mn[0] = _mm256_and_si256(u[2], low6);
    mn[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u[3], 4), low4),
                            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u[2], 6), two), 4));
    /* Lane r of u[0]: row r's d (low 16 bits) and dmin (high): packed to d0-3 dmin0-3 | d4-7 dmin4-7, then in order. */
    const __m256i halves = _mm256_packus_epi32(_mm256_and_si256(u[0], _mm256_set1_epi32(0xffff)), _mm256_srli_epi32(u[0], 16));
    const __m256i ordered = _mm256_permute4x64_epi64(halves, 0xD8);
    *d = _mm256_cvtph_ps(_mm256_castsi256_si128(ordered));
    /* (-dmin) * min is -(dmin * min) exactly: rounding is symmetric. */
    *neg_dmin = _mm256_xor_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(ordered, 1)), _mm256_set1_ps(-0.0f));
}

/* Byte j % 4 of each 32-bit lane of v as a float. */
BASERT_ALWAYS_INLINE __m256 bt_byte_f32(__m256i v, int j) {
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8 * (j & 3)), _mm256_set1_epi32(255)));
}

/* Unit vector u of the 16 bytes at offset off of a packed chunk g (bt_packed_units' out[u]). */
BASERT_ALWAYS_INLINE __m256i bt_packed_unit(const uint8_t *g, ptrdiff_t off, int u) {
    return _mm256_loadu_si256((const __m256i *)(const void *)(g + 8 * off + 32 * u));
}

/* Bits s .. s + width of every byte of v at bit `at` (at >= width, s + width <= 8; s a run-time count): shifted
 * within 16-bit lanes, no bit of the neighbouring byte survives the mask. */
BASERT_ALWAYS_INLINE __m256i bt_field(__m256i v, __m128i s, const int at, const int mask) {
    return _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(v, s), at), _mm256_set1_epi8((char)mask));
}

/* A tile of the byte kernels: n activation rows, met by groups of eight weight rows. */
typedef struct {
    const basert_weight *w;
    const int8_t *a;                /* the tile's activation bytes (bt_activations) */
    const int32_t *s16;             /* Q6_K: their sums of 16 codes, k / 32 per plane row */
    const float *const *d;          /* the tile's records' scales ... */
    const float *const *s;          /* ... and sums */
    float *y;                       /* the tile's first row of outputs, */
    ptrdiff_t ldy;                  /* ... and the distance between rows */
    uint8_t *copy;                  /* 16 * row_bytes for groups that are not packed in place (bt_pack_group), or NULL */
} bt_tile;

/* A group of eight weight rows. */
typedef struct {
    const ptrdiff_t *rows;          /* the eight weight rows (bq_row_pointers) */
    const uint8_t *const *p;        /* their bytes where the weight stores them */
    const uint8_t *g;               /* the group's packed chunks, one after the other */
    ptrdiff_t ahead;                /* bytes from a chunk to the next group's (prefetched as the chunk is read); 0 none */
} bt_group;

/* v, kept in a register where it stands (an empty asm): the byte kernels' chains of integer adds stay chains, which
 * the compiler would otherwise re-associate into trees whose many partial sums spill to the stack. */
BASERT_ALWAYS_INLINE __m256i bt_keep(__m256i v) {
    __asm__("" : "+x"(v));
    return v;
}

/* Prefetch the next group's copy of a chunk of `bytes` at g. */
BASERT_ALWAYS_INLINE void bt_prefetch(const bt_group *grp, const uint8_t *g, ptrdiff_t bytes) {
    if (grp->ahead)
        for (ptrdiff_t line = 0; line < bytes; line += 64) __builtin_prefetch(g + grp->ahead + line);
}

/* Q6_K: the eight rows' scales of the packed super-block g (one signed byte per 16 values; lane r of unit vector u
 * holds row r's scales 4u .. 4u + 3), sign-extended into 16-bit halves, a sub-block's pair in each lane: pairs[sub]
 * holds row r's scales of sub-block sub (its first and second 16 values) in lane r. */
BASERT_ALWAYS_INLINE void bt_q6_k_scale_pairs(const uint8_t *g, __m256i *pairs) {
    #pragma GCC unroll 4
    for (int u = 0; u < 4; u++) {
        const __m256i su = bt_packed_unit(g, 192, u);
        const __m256i lo = _mm256_srai_epi16(_mm256_slli_epi16(su, 8), 8), hi = _mm256_srai_epi16(su, 8);
        pairs[2 * u] = _mm256_blend_epi16(lo, _mm256_slli_epi32(hi, 16), 0xAA);
        pairs[2 * u + 1] = _mm256_blend_epi16(_mm256_srli_epi32(lo, 16), hi, 0xAA);
    }
}

/* The scale of a sub-block's first (hc 0) or second 16 values in both 16-bit halves of each row's lane. */
BASERT_ALWAYS_INLINE __m256i bt_q6_k_scale16(__m256i pair, int hc) {
    return hc ? _mm256_blend_epi16(pair, _mm256_srli_epi32(pair, 16), 0x55)
              : _mm256_blend_epi16(pair, _mm256_slli_epi32(pair, 16), 0xAA);
}

/* A sub-block's scaled sums of codes stored with +32 (total) less 32 times its scales times the activation's sums of
 * its two halves of 16 (sums16: bt_sums16's pair). */
BASERT_ALWAYS_INLINE __m256i bt_q6_k_offset(__m256i total, __m256i pair, int32_t sums16) {
    return _mm256_sub_epi32(total, _mm256_slli_epi32(_mm256_madd_epi16(pair, _mm256_set1_epi32(sums16)), 5));
}

/* One or two rows of activation bytes (decode): acc[c] + t for Q4_K / Q5_K super-block sb of eight rows packed at g,
 * written out whole (shifts and offsets constants), the units of 16 values loaded once for both nibbles; as bt_q4_k. */
BASERT_ALWAYS_INLINE void bt_q4_k_few(const int C, const int P, const int type, const uint8_t *g, ptrdiff_t sb,
                                      const bt_tile *t, __m256 *acc) {
    const int five = type == BASERT_GGML_Q5_K, rows = C * P;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 dv, neg_dmin;
    __m256i sc[2], mn[2];
    bt_k_headers(g, &dv, &neg_dmin, sc, mn);
    #pragma GCC unroll 4
    for (int pair = 0; pair < 4; pair++) {
        __m256i total[2][BT_ROWS], part[2][BT_ROWS];
        #pragma GCC unroll 8
        for (int i = 0; i < rows; i++) total[0][i] = total[1][i] = part[0][i] = part[1][i] = _mm256_setzero_si256();
        #pragma GCC unroll 2
        for (int hc = 0; hc < 2; hc++) {
            __m256i units[4], high[4];
            bt_packed_units(g, (five ? 48 : 16) + 32 * pair + 16 * hc, units);
            if (five) bt_packed_units(g, 16 + 16 * hc, high);
            #pragma GCC unroll 2
            for (int half = 0; half < 2; half++) {
                const int j = 2 * pair + half;
                #pragma GCC unroll 4
                for (int u = 0; u < 4; u++) {
                    __m256i v = bt_bits(units[u], 4 * half, 15);
                    /* Q5_K: bit j of the qh byte as 16. */
                    if (five) v = _mm256_or_si256(v, bt_bits(high[u], j - 4, 16));
                    #pragma GCC unroll 8
                    for (int i = 0; i < rows; i++)
                        part[half][i] = _mm256_add_epi16(part[half][i], _mm256_maddubs_epi16(
                            v, bt_broadcast(t->a + bt_tile_at(rows, 64 * sb + 8 * j + 4 * hc + u, i))));
                }
            }
            /* Widened after every 16 values with more than two rows of bytes: fewer registers live. */
            if (five || hc == 1 || rows > 2) {
                #pragma GCC unroll 8
                for (int i = 0; i < rows; i++) {
                    #pragma GCC unroll 2
                    for (int half = 0; half < 2; half++) {
                        total[half][i] = _mm256_add_epi32(total[half][i], _mm256_madd_epi16(part[half][i], ones));
                        part[half][i] = _mm256_setzero_si256();
                    }
                }
            }
        }
        #pragma GCC unroll 2
        for (int half = 0; half < 2; half++) {
            const int j = 2 * pair + half;
            const ptrdiff_t b = 8 * sb + j;
            const __m256 sv = _mm256_mul_ps(dv, bt_byte_f32(sc[j >> 2], j));
            const __m256 bv = _mm256_mul_ps(neg_dmin, bt_byte_f32(mn[j >> 2], j));
            #pragma GCC unroll 4
            for (int c = 0; c < C; c++)
                acc[c] = bq_fold_sums(1, 0, bt_join(P, total[half], c), sv, bv, t->d[c][b], t->s[c][b], acc[c]);
        }
    }
}

/* One or two rows of activation bytes (decode): acc[c] + t for a Q6_K super-block at g written out whole, the four
 * sub-blocks of a half taking their bits from the same ql and qh units (loaded once), their 16-bit sums over two units
 * widened by madd with their scale; as bt_q6_k. */
BASERT_ALWAYS_INLINE void bt_q6_k_few(const int C, const int P, const uint8_t *g, ptrdiff_t sb, const bt_tile *t,
                                      __m256 *acc) {
    const int rows = C * P;
    const ptrdiff_t k = t->w->k;
    /* The eight rows' d follow their 13 units of 16 bytes. */
    const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(g + 8 * 208)));
    __m256i sp[8];
    bt_q6_k_scale_pairs(g, sp);
    for (int h = 0; h < 2; h++) {
        __m256i total[4][BT_ROWS];
        #pragma GCC unroll 8
        for (int i = 0; i < rows; i++) total[0][i] = total[1][i] = total[2][i] = total[3][i] = _mm256_setzero_si256();
        #pragma GCC unroll 2
        for (int hc = 0; hc < 2; hc++) {
            __m256i qh[4];
            bt_packed_units(g, 128 + 32 * h + 16 * hc, qh);
            #pragma GCC unroll 2
            for (int src = 0; src < 2; src++) {
                __m256i ql[4];
                bt_packed_units(g, 64 * h + 32 * src + 16 * hc, ql);
                #pragma GCC unroll 2
                for (int nib = 0; nib < 2; nib++) {
                    const int q = src + 2 * nib, sub = 4 * h + q;
                    const __m256i scale = bt_q6_k_scale16(sp[sub], hc);
                    #pragma GCC unroll 2
                    for (int u0 = 0; u0 < 4; u0 += 2) {
                        __m256i part[BT_ROWS];
                        #pragma GCC unroll 8
                        for (int i = 0; i < rows; i++) part[i] = _mm256_setzero_si256();
                        #pragma GCC unroll 2
                        for (int u = u0; u < u0 + 2; u++) {
                            const __m256i v = _mm256_or_si256(bt_bits(ql[u], 4 * nib, 15), bt_bits(qh[u], 2 * q - 4, 48));
                            #pragma GCC unroll 8
                            for (int i = 0; i < rows; i++)
                                part[i] = _mm256_add_epi16(part[i], _mm256_maddubs_epi16(
                                    v, bt_broadcast(t->a + bt_tile_at(rows, 64 * sb + 8 * sub + 4 * hc + u, i))));
                        }
                        #pragma GCC unroll 8
                        for (int i = 0; i < rows; i++) total[q][i] = _mm256_add_epi32(total[q][i], _mm256_madd_epi16(part[i], scale));
                    }
                }
            }
        }
        #pragma GCC unroll 4
        for (int q = 0; q < 4; q++) {
            const int sub = 4 * h + q;
            const ptrdiff_t b = 8 * sb + sub;
            #pragma GCC unroll 8
            for (int i = 0; i < rows; i++) total[q][i] = bt_q6_k_offset(total[q][i], sp[sub], t->s16[i * (k / 32) + b]);
            #pragma GCC unroll 4
            for (int c = 0; c < C; c++) acc[c] = bq_fold_sums(0, 0, bt_join(P, total[q], c), sv, sv, t->d[c][b], t->s[c][b], acc[c]);
        }
    }
}

/* Q4_K / Q5_K: acc[c] + the eight rows' products for every sub-block of every super-block against n activation
 * rows of P planes, A = d * scale and B = -(dmin * min) of each sub-block as bq_gguf_run gives them. A sub-block's
 * 16-bit sums take its eight units (Q4_K: at most 8 * 2 * 15 * 128) or four (Q5_K: 4 * 2 * 31 * 128) before madd
 * widens them. */
BASERT_ALWAYS_INLINE void bt_q4_k(const int n, const int P, const int type, const bt_tile *t, const bt_group *grp,
                                  __m256 *acc) {
    const int five = type == BASERT_GGML_Q5_K, rows = n * P;
    const ptrdiff_t k = t->w->k, bytes = 8 * basert_block_bytes(type);
    const __m256i ones = _mm256_set1_epi16(1);
    for (ptrdiff_t sb = 0; sb < k / 256; sb++) {
        const uint8_t *g = grp->g + sb * bytes;
        bt_prefetch(grp, g, bytes);
        if (rows <= 2) {
            bt_q4_k_few(n, P, type, g, sb, t, acc);
            continue;
        }
        __m256 dv, neg_dmin, sv[8], bv[8];
        __m256i sc[2], mn[2];
        bt_k_headers(g, &dv, &neg_dmin, sc, mn);
        #pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            sv[j] = _mm256_mul_ps(dv, bt_byte_f32(sc[j >> 2], j));
            bv[j] = _mm256_mul_ps(neg_dmin, bt_byte_f32(mn[j >> 2], j));
        }
        #pragma GCC unroll 1
        for (int pair = 0; pair < 4; pair++) {
            /* Sub-blocks 2 * pair and 2 * pair + 1 are the low and high nibbles of the same bytes. */
            const uint8_t *codes = g + 8 * ((five ? 48 : 16) + 32 * pair);
            #pragma GCC unroll 2
            for (int half = 0; half < 2; half++) {
                const int j = 2 * pair + half;
                /* Q5_K: bit j of the qh byte as 16. */
                const __m128i bit = _mm_cvtsi32_si128(j);
                const int8_t *a = t->a + bt_tile_at(rows, 64 * sb + 8 * j, 0);
                __m256i total[BT_ROWS], part[BT_ROWS];
                #pragma GCC unroll 8
                for (int i = 0; i < rows; i++) part[i] = _mm256_setzero_si256();
                #pragma GCC unroll 2
                for (int hc = 0; hc < 2; hc++) {
                    #pragma GCC unroll 4
                    for (int u = 0; u < 4; u++) {
                        __m256i v = bt_bits(bt_packed_unit(codes, 16 * hc, u), 4 * half, 15);
                        if (five) v = _mm256_or_si256(v, bt_field(bt_packed_unit(g, 16 + 16 * hc, u), bit, 4, 16));
                        #pragma GCC unroll 8
                        for (int i = 0; i < rows; i++)
                            part[i] = bt_keep(_mm256_add_epi16(part[i], _mm256_maddubs_epi16(
                                v, bt_broadcast(a + bt_tile_at(rows, 4 * hc + u, i)))));
                    }
                    if (five || hc == 1) {
                        #pragma GCC unroll 8
                        for (int i = 0; i < rows; i++) {
                            const __m256i wide = _mm256_madd_epi16(part[i], ones);
                            total[i] = five && hc == 1 ? _mm256_add_epi32(total[i], wide) : wide;
                            part[i] = _mm256_setzero_si256();
                        }
                    }
                }
                const ptrdiff_t b = 8 * sb + j;
                #pragma GCC unroll 8
                for (int c = 0; c < n; c++)
                    acc[c] = bq_fold_sums(1, 0, bt_join(P, total, c), sv[j], bv[j], t->d[c][b], t->s[c][b], acc[c]);
            }
        }
    }
}

/* The same for Q6_K (A = d): ql's low nibbles (sub-blocks 0, 1 of each half of the super-block) or high ones (2, 3)
 * joined to qh's two bits 2 * (sub % 4); the 16-bit products of each pair of units widened by madd with the scale of
 * their 16 values (the sign-extended scales of each sub-block in the 16-bit halves of its pair); then 32
 * times the scales times the activation's sums of 16 (s16) taken off. */
BASERT_ALWAYS_INLINE void bt_q6_k(const int n, const int P, const bt_tile *t, const bt_group *grp, __m256 *acc) {
    const int rows = n * P;
    const ptrdiff_t k = t->w->k, bytes = 8 * basert_block_bytes(BASERT_GGML_Q6_K);
    for (ptrdiff_t sb = 0; sb < k / 256; sb++) {
        const uint8_t *g = grp->g + sb * bytes;
        bt_prefetch(grp, g, bytes);
        if (rows <= 2) {
            bt_q6_k_few(n, P, g, sb, t, acc);
            continue;
        }
        /* The eight rows' d follow their 13 units of 16 bytes. */
        const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(g + 8 * 208)));
        __m256i pairs[8];
        bt_q6_k_scale_pairs(g, pairs);
        #pragma GCC unroll 1
        for (int sub = 0; sub < 8; sub++) {
            const int h = sub >> 2, q = sub & 3;
            const __m128i nibble = _mm_cvtsi32_si128(4 * (q >> 1)), high = _mm_cvtsi32_si128(2 * q);
            const uint8_t *ql = g + 8 * (64 * h + 32 * (q & 1)), *qh = g + 8 * (128 + 32 * h);
            const int8_t *a = t->a + bt_tile_at(rows, 64 * sb + 8 * sub, 0);
            const __m256i pair = pairs[sub];
            __m256i total[BT_ROWS];
            #pragma GCC unroll 8
            for (int i = 0; i < rows; i++) total[i] = _mm256_setzero_si256();
            #pragma GCC unroll 2
            for (int hc = 0; hc < 2; hc++) {
                const __m256i scale = bt_q6_k_scale16(pair, hc);
                #pragma GCC unroll 2
                for (int u = 0; u < 4; u += 2) {
                    __m256i v[2];
                    #pragma GCC unroll 2
                    for (int e = 0; e < 2; e++)
                        v[e] = _mm256_or_si256(bt_field(bt_packed_unit(ql, 16 * hc, u + e), nibble, 0, 15),
                                               bt_field(bt_packed_unit(qh, 16 * hc, u + e), high, 4, 48));
                    /* Two units' products in 16 bits (at most 2 * 2 * 63 * 128), then widened with their scale. */
                    #pragma GCC unroll 8
                    for (int i = 0; i < rows; i++)
                        total[i] = bt_keep(_mm256_add_epi32(total[i], _mm256_madd_epi16(_mm256_add_epi16(
                            _mm256_maddubs_epi16(v[0], bt_broadcast(a + bt_tile_at(rows, 4 * hc + u, i))),
                            _mm256_maddubs_epi16(v[1], bt_broadcast(a + bt_tile_at(rows, 4 * hc + u + 1, i)))), scale)));
                }
            }
            const ptrdiff_t b = 8 * sb + sub;
            #pragma GCC unroll 8
            for (int i = 0; i < rows; i++) total[i] = bt_q6_k_offset(total[i], pair, t->s16[i * (k / 32) + b]);
            #pragma GCC unroll 8
            for (int c = 0; c < n; c++) acc[c] = bq_fold_sums(0, 0, bt_join(P, total, c), sv, sv, t->d[c][b], t->s[c][b], acc[c]);
        }
    }
}

/* base_q4 (the weight's offset and bias as sym says): every block against n activation rows of P planes in the
 * records' order. Unit u of a block's 16 bytes holds values 8u .. 8u + 7, the even-numbered ones in its low nibbles
 * (record positions 4u .. 4u + 4), the odd-numbered ones in its high nibbles (16 + 4u ..); a block's 16-bit sums take
 * its eight maddubs (at most 8 * 2 * 15 * 128). */
BASERT_ALWAYS_INLINE void bt_base_q4(const int n, const int P, const int sym, const bt_tile *t, const bt_group *grp,
                                     __m256 *acc) {
    const int has_bias = bq_has_bias(BASERT_Q4, 0, sym), offset = bq_offset(BASERT_Q4, 0, sym), rows = n * P;
    const basert_weight *w = t->w;
    const ptrdiff_t k = w->k, per_group = w->group_size / 32, groups = k / 32 / per_group;
    const __m256i low4 = _mm256_set1_epi8(15);
    __m256 scale[8], bias[8];
    for (ptrdiff_t g0 = 0; g0 < groups; g0 += 8) {
        const ptrdiff_t gn = groups - g0 < 8 ? groups - g0 : 8;
        bq_scale_run(BASERT_Q4, 0, has_bias, w, grp->rows, grp->p, groups, g0, gn, scale, bias);
        for (ptrdiff_t j = 0; j < gn; j++) {
            for (ptrdiff_t i = 0; i < per_group; i++) {
                const ptrdiff_t b = (g0 + j) * per_group + i;
                const uint8_t *units = grp->g + 128 * b;
                bt_prefetch(grp, units, 128);
                const int8_t *a = t->a + bt_tile_at(rows, 8 * b, 0);
                __m256i part[BT_ROWS];
                #pragma GCC unroll 8
                for (int x = 0; x < rows; x++) part[x] = _mm256_setzero_si256();
                #pragma GCC unroll 4
                for (int u = 0; u < 4; u++) {
                    const __m256i unit = bt_packed_unit(units, 0, u);
                    const __m256i even = _mm256_and_si256(unit, low4), odd = _mm256_and_si256(_mm256_srli_epi16(unit, 4), low4);
                    #pragma GCC unroll 8
                    for (int x = 0; x < rows; x++)
                        part[x] = bt_keep(_mm256_add_epi16(part[x], _mm256_add_epi16(
                            _mm256_maddubs_epi16(even, bt_broadcast(a + bt_tile_at(rows, u, x))),
                            _mm256_maddubs_epi16(odd, bt_broadcast(a + bt_tile_at(rows, 4 + u, x))))));
                }
                #pragma GCC unroll 8
                for (int x = 0; x < rows; x++) part[x] = _mm256_madd_epi16(part[x], _mm256_set1_epi16(1));
                #pragma GCC unroll 8
                for (int c = 0; c < n; c++)
                    acc[c] = bq_fold_sums(has_bias, offset, bt_join(P, part, c), scale[j], bias[j], t->d[c][b], t->s[c][b], acc[c]);
            }
        }
    }
}

/* Eight weight rows rows[r] (bq_row_pointers) packed into buf (matmul.h's layout, 8 * row_bytes), whichever way w
 * stores them: the last n % 8 rows of a packed weight, rows of a weight too small to be packed, or eight rows that are
 * not one packed group (copied out of it first, through stage: 8 * row_bytes). */
static void bt_pack_group(const basert_weight *w, const ptrdiff_t *rows, uint8_t *stage, uint8_t *buf) {
    const ptrdiff_t chunk = basert_packed_chunk(w);
    for (ptrdiff_t at = 0; at < w->row_bytes; at += chunk) {
        const uint8_t *q[BQ_ROWS];
        for (int r = 0; r < BQ_ROWS; r++) q[r] = basert_weight_bytes(w, rows[r], at, chunk, stage + r * chunk);
        basert_pack_chunk(q, chunk, buf + 8 * at);
    }
}

/* Weight rows r0..r1 against a tile of n activation rows (a constant of each instance, at most BT_TILE), eight rows at
 * a time: a packed group in place, the next group's chunks prefetched as its own are read (one stream), or a packed
 * copy. */
BASERT_ALWAYS_INLINE void bt_groups(const int n, const int P, const int kind, const int type, const int sym,
                                    const bt_tile *t, ptrdiff_t r0, ptrdiff_t r1) {
    const basert_weight *w = t->w;
    for (ptrdiff_t row = r0; row < r1; row += BQ_ROWS) {
        const int R = r1 - row < BQ_ROWS ? (int)(r1 - row) : BQ_ROWS;
        const uint8_t *p[BQ_ROWS];
        ptrdiff_t rows[BQ_ROWS];
        bq_row_pointers(w, row, R, rows, p);
        bt_group grp = {rows, p, p[0], BQ_ROWS * w->row_bytes};
        if (!bq_packed_group(w, row)) {
            bt_pack_group(w, rows, t->copy + 8 * w->row_bytes, t->copy);
            grp.g = t->copy;
            grp.ahead = 0;
        }
        __m256 acc[BT_ROWS];
        for (int c = 0; c < n; c++) acc[c] = _mm256_setzero_ps();
        if (kind == BASERT_Q4) bt_base_q4(n, P, sym, t, &grp, acc);
        else if (type == BASERT_GGML_Q6_K) bt_q6_k(n, P, t, &grp, acc);
        else bt_q4_k(n, P, type, t, &grp, acc);
        bq_store(n, R, acc, t->y + row, t->ldy);
    }
}

typedef void (*bt_tile_kernel)(const bt_tile *, ptrdiff_t, ptrdiff_t);

/* The tile kernels of a weight kind: name_tiles[P - 1][n] for n activation rows of P planes. */
#define BT_TILE_INSTANCE(name, n, P, kind, type, sym)                                                                    \
    static void name##_##P##_##n(const bt_tile *t, ptrdiff_t r0, ptrdiff_t r1) {                                         \
        bt_groups(n, P, kind, type, sym, t, r0, r1);                                                                     \
    }
#define BT_TILE_KERNELS(name, kind, type, sym)                                                                           \
    BT_TILE_INSTANCE(name, 1, 1, kind, type, sym) BT_TILE_INSTANCE(name, 2, 1, kind, type, sym)                          \
    BT_TILE_INSTANCE(name, 3, 1, kind, type, sym) BT_TILE_INSTANCE(name, 4, 1, kind, type, sym)                          \
    BT_TILE_INSTANCE(name, 5, 1, kind, type, sym) BT_TILE_INSTANCE(name, 6, 1, kind, type, sym)                          \
    BT_TILE_INSTANCE(name, 7, 1, kind, type, sym) BT_TILE_INSTANCE(name, 8, 1, kind, type, sym)                          \
    BT_TILE_INSTANCE(name, 1, 2, kind, type, sym) BT_TILE_INSTANCE(name, 2, 2, kind, type, sym)                          \
    BT_TILE_INSTANCE(name, 3, 2, kind, type, sym) BT_TILE_INSTANCE(name, 4, 2, kind, type, sym)                          \
    static const bt_tile_kernel name##_tiles[2][BT_ROWS + 1] = {                                                         \
        {NULL, name##_1_1, name##_1_2, name##_1_3, name##_1_4, name##_1_5, name##_1_6, name##_1_7, name##_1_8},          \
        {NULL, name##_2_1, name##_2_2, name##_2_3, name##_2_4}};
BT_TILE_KERNELS(bt_tiles_q4_sym, BASERT_Q4, 0, 1)
BT_TILE_KERNELS(bt_tiles_q4_asym, BASERT_Q4, 0, 0)
BT_TILE_KERNELS(bt_tiles_q4_k, BASERT_BLOCKS, BASERT_GGML_Q4_K, 0)
BT_TILE_KERNELS(bt_tiles_q5_k, BASERT_BLOCKS, BASERT_GGML_Q5_K, 0)
BT_TILE_KERNELS(bt_tiles_q6_k, BASERT_BLOCKS, BASERT_GGML_Q6_K, 0)

/* The tile kernels of a weight the byte kernels take. */
static const bt_tile_kernel (*bt_tiles_of(const basert_weight *w))[BT_ROWS + 1] {
    if (w->kind == BASERT_Q4) return w->biases == NULL ? bt_tiles_q4_sym_tiles : bt_tiles_q4_asym_tiles;
    switch (w->ggml_type) {
    case BASERT_GGML_Q4_K: return bt_tiles_q4_k_tiles;
    case BASERT_GGML_Q5_K: return bt_tiles_q5_k_tiles;
    default: return bt_tiles_q6_k_tiles;
    }
}

/* Weight rows r0..r1 against the C (at most BT_COLS) activation rows qx + c * rb of P planes (1: 8-bit codes, 2:
 * 16-bit ones), a tile of at most BT_TILE activation rows at a time: every row for one tile, or each group of eight rows
 * for every tile in turn (its chunks then read again from L1 or L2); 0 where their bytes could not be allocated (the
 * caller takes bq_block then). */
BASERT_ALWAYS_INLINE int bt_rows(const int P, const int kind, const int type, const basert_weight *w, const uint8_t *qx,
                                 ptrdiff_t rb, int C, ptrdiff_t r0, ptrdiff_t r1, float *y, ptrdiff_t ldy) {
    const int T = BT_TILE(type, P);
    const ptrdiff_t k = w->k, a8_bytes = (P * C * k + 63) & ~(ptrdiff_t)63;
    const ptrdiff_t s16_bytes = (P * C * (k / 32) * (ptrdiff_t)sizeof(int32_t) + 63) & ~(ptrdiff_t)63;
    int in_place = 1;
    for (ptrdiff_t row = r0; row < r1; row += BQ_ROWS) in_place &= bq_packed_group(w, row);
    const ptrdiff_t copy_bytes = in_place ? 0 : 16 * w->row_bytes;
    uint8_t *mem = aligned_alloc(64, (size_t)(a8_bytes + s16_bytes + copy_bytes));
    if (mem == NULL) return 0;
    int8_t *a8 = (int8_t *)(void *)mem;
    int32_t *s16 = (int32_t *)(void *)(mem + a8_bytes);
    bt_activations(P, kind != BASERT_Q4, C, T, qx, rb, k, kind == BASERT_BLOCKS && type == BASERT_GGML_Q6_K, a8, s16);
    const float *d[BT_COLS], *s[BT_COLS];
    for (int c = 0; c < C; c++) {
        d[c] = bq_scales(qx + c * rb, k);
        s[c] = bq_sums(qx + c * rb, k);
    }
    const bt_tile_kernel *kernels = bt_tiles_of(w)[P - 1];
    bt_tile tiles[BT_COLS];
    for (int c0 = 0; c0 < C; c0 += T)
        tiles[c0 / T] = (bt_tile){w, a8 + c0 * P * k, s16 + c0 * P * (k / 32), d + c0, s + c0, y + c0 * ldy, ldy,
                                  in_place ? NULL : mem + a8_bytes + s16_bytes};
    if (C <= T) {
        kernels[C](&tiles[0], r0, r1);
    } else {
        for (ptrdiff_t row = r0; row < r1; row += BQ_ROWS)
            for (int c0 = 0; c0 < C; c0 += T)
                kernels[C - c0 < T ? C - c0 : T](&tiles[c0 / T], row, row + BQ_ROWS < r1 ? row + BQ_ROWS : r1);
    }
    free(mem);
    return 1;
}
#endif

#if defined(BASERT_AVX512)
/* ---- AVX-512, one activation row: two blocks per 512-bit vector ----
 *
 * The integers of blocks b and b + 1 (b even) of a weight row in two vectors of 32 16-bit lanes: the even-numbered
 * values of block b then of block b + 1, and the odd-numbered ones alike; the activation codes of the two blocks
 * arranged the same way (once for eight rows). Two madds give 16 lanes per row, 8 per block, and the eight rows' lanes
 * fold into the eight exact sums of each block, which take bq_fold_sums' float operations block by block: the same
 * integers and float operations as bq_block, with half the vector operations per value. Base codes, Q4_K, Q5_K and
 * Q6_K; the other types take bq_block. */

/* Whether a weight takes the paired kernel. */
#define BZ_PAIRS(kind, type) ((kind) != BASERT_BLOCKS || (type) == BASERT_GGML_Q4_K || (type) == BASERT_GGML_Q5_K || \
                              (type) == BASERT_GGML_Q6_K)

/* 32 bytes at p in both halves of a vector. */
BASERT_ALWAYS_INLINE __m512i bz_dup(const uint8_t *p) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(const void *)p));
}

/* 16-bit lanes shifted right by `lo` bits in the low half, by `hi` bits in the high half, and masked to `mask`. */
BASERT_ALWAYS_INLINE __m512i bz_field(__m512i v, int lo, int hi, int mask) {
    const __m512i shift = _mm512_inserti64x4(_mm512_set1_epi16((short)lo), _mm256_set1_epi16((short)hi), 1);
    return _mm512_and_si512(_mm512_srlv_epi16(v, shift), _mm512_set1_epi16((short)mask));
}

/* The integers of blocks b, b + 1 (b even) of a weight row as bq_weights gives them, paired as above. */
BASERT_ALWAYS_INLINE void bz_weights(const int kind, const int type, const uint8_t *row, ptrdiff_t b, __m512i *even,
                                     __m512i *odd) {
    if (kind == BASERT_Q4) {
        /* Byte i of a block holds values 2i (low nibble) and 2i + 1 (high nibble). */
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(const void *)(row + 16 * b)));
        *even = _mm512_and_si512(v, _mm512_set1_epi16(15));
        *odd = _mm512_srli_epi16(v, 4);
        return;
    }
    if (kind == BASERT_Q8) {
        const __m512i v = _mm512_loadu_si512((const void *)(row + 32 * b));
        *even = _mm512_and_si512(v, _mm512_set1_epi16(255));
        *odd = _mm512_srli_epi16(v, 8);
        return;
    }
    const uint8_t *blk = row + (b >> 3) * basert_block_bytes(type);
    const int sub = (int)(b & 7);
    if (type == BASERT_GGML_Q4_K || type == BASERT_GGML_Q5_K) {
        /* Sub-blocks sub and sub + 1: the low and the high nibbles of the same 32 bytes. */
        const int five = type == BASERT_GGML_Q5_K;
        const __m512i v = bz_dup(blk + (five ? 48 : 16) + 16 * sub);
        *even = bz_field(v, 0, 4, 15);
        *odd = bz_field(v, 8, 12, 15);
        if (five) {
            /* Bit sub (sub + 1) of byte j: the fifth bit of value j of sub-block sub (sub + 1). */
            const __m512i h = bz_dup(blk + 16);
            *even = _mm512_or_si512(*even, _mm512_slli_epi16(bz_field(h, sub, sub + 1, 1), 4));
            *odd = _mm512_or_si512(*odd, _mm512_slli_epi16(bz_field(h, 8 + sub, 9 + sub, 1), 4));
        }
        return;
    }
    /* Q6_K: sub-blocks sub and sub + 1 have their low four bits in 64 consecutive bytes, shifted alike, and their high
     * two bits in the same 32 bytes, two bits apart. */
    const int h = sub >> 2, t = sub & 3;
    const __m512i low = _mm512_loadu_si512((const void *)(blk + 64 * h));
    const __m512i high = bz_dup(blk + 128 + 32 * h);
    const __m512i nibble = _mm512_set1_epi16(15);
    const __m512i ue = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low, 4 * (t >> 1)), nibble),
                                       _mm512_slli_epi16(bz_field(high, 2 * t, 2 * t + 2, 3), 4));
    const __m512i uo = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low, 8 + 4 * (t >> 1)), nibble),
                                       _mm512_slli_epi16(bz_field(high, 8 + 2 * t, 10 + 2 * t, 3), 4));
    /* Lanes 0-7 of each block's half hold values of its first 16 values, lanes 8-15 of its second: scales 2 sub .. + 3
     * in lanes 0-7, 8-15, 16-23, 24-31. */
    int32_t four;
    memcpy(&four, blk + 192 + 2 * sub, sizeof four);
    const __m512i spread = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2,
                                            1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i mul = _mm512_permutexvar_epi16(spread, _mm512_castsi128_si512(_mm_cvtepi8_epi16(_mm_cvtsi32_si128(four))));
    const __m512i off = _mm512_set1_epi16(32);
    *even = _mm512_mullo_epi16(_mm512_sub_epi16(ue, off), mul);
    *odd = _mm512_mullo_epi16(_mm512_sub_epi16(uo, off), mul);
}

/* The eight rows' 16 lanes (lanes 0-7: block b, 8-15: block b + 1) folded in three steps, so that few vectors are live:
 * bz_fold2 adds rows 2i and 2i + 1 within each 128-bit chunk (two sums of two lanes each), bz_fold4 two such results
 * into four rows' chunk sums, one per lane (chunks 0-1: block b, 2-3: block b + 1), and bz_fold8 the two halves'
 * chunks of each block: lane r of *first the sum of row r's lanes of block b, of *second of block b + 1. */
BASERT_ALWAYS_INLINE __m512i bz_fold2(__m512i even_row, __m512i odd_row) {
    return _mm512_add_epi32(_mm512_unpacklo_epi32(even_row, odd_row), _mm512_unpackhi_epi32(even_row, odd_row));
}

BASERT_ALWAYS_INLINE __m512i bz_fold4(__m512i t0, __m512i t1) {
    return _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
}

BASERT_ALWAYS_INLINE void bz_fold8(__m512i u0, __m512i u1, __m256i *first, __m256i *second) {
    /* Rows 0-3 of b, of b + 1, rows 4-7 of b, of b + 1, then in row order. */
    const __m512i s = _mm512_add_epi32(_mm512_shuffle_i32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_i32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i ordered = _mm512_shuffle_i32x4(s, s, _MM_SHUFFLE(3, 1, 2, 0));
    *first = _mm512_castsi512_si256(ordered);
    *second = _mm512_extracti64x4_epi64(ordered, 1);
}


/* For the C activation records' codes ae[c], ao[c] of blocks b, b + 1: t[c], the lanes of weight rows 2i (integers e0,
 * o0) and 2i + 1 (e1, o1) multiplied, added and folded pairwise (bz_fold2). */
BASERT_ALWAYS_INLINE void bz_madd_pair(const int C, const __m512i *ae, const __m512i *ao, __m512i e0, __m512i o0, __m512i e1,
                                       __m512i o1, __m512i *t) {
    for (int c = 0; c < C; c++)
        t[c] = bz_fold2(_mm512_add_epi32(_mm512_madd_epi16(e0, ae[c]), _mm512_madd_epi16(o0, ao[c])),
                        _mm512_add_epi32(_mm512_madd_epi16(e1, ae[c]), _mm512_madd_epi16(o1, ao[c])));
}

/* The C records' activation codes of blocks b, b + 1 arranged as the weights' pairs (bz_weights). */
BASERT_ALWAYS_INLINE void bz_codes(const int C, const int16_t *const *q, ptrdiff_t b, __m512i *ae, __m512i *ao) {
    for (int c = 0; c < C; c++) {
        const __m512i a0 = _mm512_loadu_si512((const void *)(q[c] + 32 * b));
        const __m512i a1 = _mm512_loadu_si512((const void *)(q[c] + 32 * b + 32));
        ae[c] = _mm512_shuffle_i64x2(a0, a1, _MM_SHUFFLE(1, 0, 1, 0));
        ao[c] = _mm512_shuffle_i64x2(a0, a1, _MM_SHUFFLE(3, 2, 3, 2));
    }
}

/* acc[c] + t of blocks b and b + 1 (b even) of eight weight rows against the activation codes q[c] of C records
 * (c < C): the rows' blocks wb, wb + 1 of p[r] (wb = b, or b's index in the super-block p[r] points to), their scales
 * and biases sv0, bv0 and sv1, bv1. Each pair of weight rows meets the C records as soon as it is unpacked, and the
 * rows' lanes are folded as they come, so that few vectors are live at once. */
BASERT_ALWAYS_INLINE void bz_pair(const int C, const int kind, const int type, const int has_bias, const int offset,
                                  const uint8_t *const *p, ptrdiff_t wb, const int16_t *const *q, const float *const *d,
                                  const float *const *s, ptrdiff_t b, __m256 sv0, __m256 bv0, __m256 sv1, __m256 bv1,
                                  __m256 *acc) {
    __m512i ae[BQ_COLS], ao[BQ_COLS], half[BQ_COLS][2], t0[BQ_COLS], t1[BQ_COLS];
    bz_codes(C, q, b, ae, ao);
    for (int h = 0; h < 2; h++) {
        __m512i e0, o0, e1, o1;
        bz_weights(kind, type, p[4 * h], wb, &e0, &o0);
        bz_weights(kind, type, p[4 * h + 1], wb, &e1, &o1);
        bz_madd_pair(C, ae, ao, e0, o0, e1, o1, t0);
        bz_weights(kind, type, p[4 * h + 2], wb, &e0, &o0);
        bz_weights(kind, type, p[4 * h + 3], wb, &e1, &o1);
        bz_madd_pair(C, ae, ao, e0, o0, e1, o1, t1);
        for (int c = 0; c < C; c++) half[c][h] = bz_fold4(t0[c], t1[c]);
    }
    for (int c = 0; c < C; c++) {
        __m256i first, second;
        bz_fold8(half[c][0], half[c][1], &first, &second);
        acc[c] = bq_fold_sums(has_bias, offset, first, sv0, bv0, d[c][b], s[c][b], acc[c]);
        acc[c] = bq_fold_sums(has_bias, offset, second, sv1, bv1, d[c][b + 1], s[c][b + 1], acc[c]);
    }
}

/* bq_block for the weights of BZ_PAIRS, two blocks at a time, against C activation records qx + c * rb (c < C <=
 * BQ_COLS): y[c * ldy + row + r]. */
BASERT_ALWAYS_INLINE void bz_block(const int C, const int kind, const int type, const int sym, const basert_weight *w,
                                   ptrdiff_t row, int R, const uint8_t *qx, ptrdiff_t rb, float *y, ptrdiff_t ldy) {
    const int gguf = kind == BASERT_BLOCKS, has_bias = bq_has_bias(kind, type, sym), offset = bq_offset(kind, type, sym);
    const ptrdiff_t k = w->k, blocks = k / 32, per_group = gguf ? 8 : w->group_size / 32;
    const ptrdiff_t groups = gguf ? blocks / 8 : blocks / per_group;
    const ptrdiff_t pair_bytes = gguf ? 0 : kind == BASERT_Q4 ? 32 : 64, ahead = BQ_ROWS * w->row_bytes;
    const uint8_t *p[BQ_ROWS];
    ptrdiff_t rows[BQ_ROWS];
    bq_row_pointers(w, row, R, rows, p);
    const int16_t *q[BQ_COLS];
    const float *d[BQ_COLS], *s[BQ_COLS];
    __m256 acc[BQ_COLS];
    bq_records(C, qx, rb, k, q, d, s, acc);
    __m256 scale[8], bias[8];
    if (gguf) {
        /* A super-block at a time: its eight sub-blocks' A and B, then its four pairs, the next eight rows' bytes of it
         * prefetched a cache line per pair. */
        const ptrdiff_t bytes = basert_block_bytes(type);
        uint8_t tmp[BQ_ROWS][BQ_SPAN];
        const uint8_t *blk[BQ_ROWS];
        for (ptrdiff_t g = 0; g < groups; g++) {
            bq_stored_span(w, rows, g * bytes, bytes, tmp, blk);
            bq_gguf_run(type, blk, 0, 8, scale, bias);
#pragma GCC unroll 4
            for (int j = 0; j < 8; j += 2) {
                for (int r = 0; r < BQ_ROWS; r++) {
                    if (32 * j < bytes) __builtin_prefetch(p[r] + ahead + g * bytes + 32 * j);
                    if (j == 6) __builtin_prefetch(p[r] + ahead + g * bytes + bytes - 1);
                }
                bz_pair(C, kind, type, has_bias, offset, blk, j, q, d, s, 8 * g + j, scale[j], bias[j], scale[j + 1],
                        bias[j + 1], acc);
            }
        }
    } else {
        /* Eight groups' scales at a time, then their blocks in pairs (a group of 32 values: a pair of groups), an odd
         * last block alone. */
        for (ptrdiff_t g0 = 0; g0 < groups; g0 += 8) {
            const ptrdiff_t gn = groups - g0 < 8 ? groups - g0 : 8, end = (g0 + gn) * per_group;
            bq_scale_run(kind, type, has_bias, w, rows, p, groups, g0, gn, scale, bias);
            /* A packed base_q4 weight's blocks of these groups as the file stores them (bq_block's span). */
            const ptrdiff_t first = w->packed ? g0 * per_group : 0;
            uint8_t tmp[BQ_ROWS][BQ_SPAN];
            const uint8_t *span[BQ_ROWS];
            if (w->packed) bq_stored_span(w, rows, first * pair_bytes / 2, (end - first) * pair_bytes / 2, tmp, span);
            const uint8_t *const *src = w->packed ? span : p;
            ptrdiff_t b = g0 * per_group;
            for (; b + 2 <= end; b += 2) {
                if ((b * pair_bytes / 2) % 64 == 0)
                    for (int r = 0; r < BQ_ROWS; r++) __builtin_prefetch(p[r] + ahead + b * pair_bytes / 2);
                const ptrdiff_t j0 = b / per_group - g0, j1 = (b + 1) / per_group - g0;
                bz_pair(C, kind, type, has_bias, offset, src, b - first, q, d, s, b, scale[j0], bias[j0], scale[j1],
                        bias[j1], acc);
            }
            if (b < end)
                bq_cols(C, 0, kind, type, has_bias, offset, src, 0, 0, b - first, b, q, d, s, scale[gn - 1], bias[gn - 1],
                        acc);
        }
    }
    bq_store(C, R, acc, y + row, ldy);
}
#endif

/* ---- larger batches: weights unpacked once into 16-bit pairs, activation pairs broadcast ----
 *
 * For a batch of many activation rows (prefill; the byte kernels' types only in the AVX-512 variant: BT_ANY_BATCH)
 * the integers of eight weight rows are unpacked once per pass into a
 * buffer laid out for the multiplier: per block of 32, sixteen vectors, vector p holding the p-th pair of codes (record
 * slots 2p and 2p + 1) of rows 0..7, one pair per 32-bit lane (offsets already taken off). A madd of such a vector
 * with an activation row's pair p broadcast to every lane gives each row's partial sum in its own lane, so the
 * sixteen madds of a block add up to the eight rows' exact block sums with no horizontal fold; the block's A and B of
 * the eight rows are kept beside them. The float operations per block are those of bq_block. */

/* Activation rows and 8-row groups of weight rows per microkernel call at most. */
#define BG_MR 4
#define BG_NV 2

/* Blocks of K per pass: a multiple of every weight's 8 groups of scales (groups of up to 128 values, 256-value
 * super-blocks), so that the panels of one pass (BG_NV x 36 KiB) stay in L2 beside the activation rows they meet. */
#define BG_KC 64

/* The unpacked integers, A and B of blocks b0 .. b0 + BG_KC (at most) of eight weight rows. */
typedef struct {
    __m256i *ints;   /* 16 vectors per block */
    __m256 *a, *b;   /* a vector per block each */
} bg_panel;

/* Block `at` of a panel: A and B, and the rows' even- and odd-numbered integers (e[r], o[r] as float bits) transposed so
 * that row r's pair p (32-bit lane p of e, p - 8 of o) lands in lane r of vector p. */
BASERT_ALWAYS_INLINE void bg_store(ptrdiff_t at, __m256 scale, __m256 bias, __m256 *e, __m256 *o, bg_panel *out) {
    out->a[at] = scale;
    out->b[at] = bias;
    bq_transpose8(e);
    bq_transpose8(o);
    __m256i *dst = out->ints + 16 * at;
    for (int r = 0; r < BQ_ROWS; r++) {
        _mm256_store_si256(dst + r, _mm256_castps_si256(e[r]));
        _mm256_store_si256(dst + 8 + r, _mm256_castps_si256(o[r]));
    }
}

/* Groups g0 .. g0 + gn of a packed group of base_q4 or Q4_K rows (g: its first byte; rows: bq_row_pointers) into a
 * panel whose first block is b0, straight from the packed bytes: lane r of a unit vector holds four consecutive values
 * v .. v + 3 of row r, so that the panel's vector of the even-numbered pair (v, v + 2) and of the odd-numbered one
 * (v + 1, v + 3) (bg_store's layout) are two masks away, with no transpose. Q4_K's A and B come from its headers as
 * the byte kernels read them (bt_k_headers: the same float operations as bq_gguf_run). */
BASERT_ALWAYS_INLINE void bg_unpack_packed(const int kind, const int has_bias, const int offset, const basert_weight *w,
                                           const ptrdiff_t *rows, const uint8_t *g, ptrdiff_t g0, ptrdiff_t gn,
                                           ptrdiff_t b0, bg_panel *out) {
    const __m256i pairs = _mm256_set1_epi32(0x00ff00ff), off = _mm256_set1_epi16((short)offset);
    if (kind == BASERT_BLOCKS) { /* Q4_K: super-block g0 / 8, its sub-blocks j */
        const uint8_t *sb = g + 8 * (g0 >> 3) * basert_block_bytes(BASERT_GGML_Q4_K);
        __m256 dv, neg_dmin;
        __m256i sc[2], mn[2];
        bt_k_headers(sb, &dv, &neg_dmin, sc, mn);
        for (int j = 0; j < 8; j++) {
            const ptrdiff_t at = g0 + j - b0;
            __m256i *dst = out->ints + 16 * at;
            out->a[at] = _mm256_mul_ps(dv, bt_byte_f32(sc[j >> 2], j));
            out->b[at] = _mm256_mul_ps(neg_dmin, bt_byte_f32(mn[j >> 2], j));
            for (int hc = 0; hc < 2; hc++) {
                __m256i units[4];
                bt_packed_units(sb, 16 + 32 * (j >> 1) + 16 * hc, units);
                for (int u = 0; u < 4; u++) {
                    const __m256i v = bt_bits(units[u], 4 * (j & 1), 15);
                    _mm256_store_si256(dst + 4 * hc + u, _mm256_and_si256(v, pairs));
                    _mm256_store_si256(dst + 8 + 4 * hc + u, _mm256_srli_epi16(v, 8));
                }
            }
        }
        return;
    }
    /* base_q4: byte i of a block holds values 2i (low nibble) and 2i + 1 (high), so that a unit's low nibbles are
     * values v, v + 2, v + 4, v + 6 (the even-numbered pairs (v, v + 2) and (v + 4, v + 6)), its high ones the odd. */
    const ptrdiff_t per_group = w->group_size / 32, groups = w->k / w->group_size;
    __m256 scale[8], bias[8];
    bq_scale_run(BASERT_Q4, 0, has_bias, w, rows, NULL, groups, g0, gn, scale, bias);
    for (ptrdiff_t j = 0; j < gn; j++) {
        for (ptrdiff_t i = 0; i < per_group; i++) {
            const ptrdiff_t b = (g0 + j) * per_group + i, at = b - b0;
            __m256i units[4], *dst = out->ints + 16 * at;
            out->a[at] = scale[j];
            out->b[at] = bias[j];
            bt_packed_units(g, 16 * b, units);
            for (int u = 0; u < 4; u++) {
                for (int half = 0; half < 2; half++) {
                    const __m256i v = bt_bits(units[u], 4 * half, 15);
                    /* Bytes 0, 2 and 1, 3 of each lane as 16-bit halves, then paired. */
                    const __m256i even = _mm256_and_si256(v, pairs), odd = _mm256_srli_epi16(v, 8);
                    __m256i first = _mm256_blend_epi16(even, _mm256_slli_epi32(odd, 16), 0xAA);
                    __m256i second = _mm256_blend_epi16(_mm256_srli_epi32(even, 16), odd, 0xAA);
                    if (offset) {
                        first = _mm256_sub_epi16(first, off);
                        second = _mm256_sub_epi16(second, off);
                    }
                    _mm256_store_si256(dst + 8 * half + 2 * u, first);
                    _mm256_store_si256(dst + 8 * half + 2 * u + 1, second);
                }
            }
        }
    }
}

/* Blocks b0..b1 of weight rows row .. row + 8 (beyond R: row again) into a panel; b0 a multiple of BG_KC. */
BASERT_ALWAYS_INLINE void bg_unpack(const int kind, const int type, const int sym, const basert_weight *w, ptrdiff_t row,
                                    int R, ptrdiff_t b0, ptrdiff_t b1, bg_panel *out) {
    const int gguf = kind == BASERT_BLOCKS, has_bias = bq_has_bias(kind, type, sym), offset = bq_offset(kind, type, sym);
    const ptrdiff_t per_group = gguf ? 1 : w->group_size / 32, groups = w->k / 32 / per_group;
    const ptrdiff_t block_bytes = gguf ? basert_block_bytes(type) / (basert_block_values(type) / 32) : kind == BASERT_Q4 ? 16 : 32;
    const ptrdiff_t prefetch_every = kind == BASERT_Q4 ? 4 : 2, ahead = BQ_ROWS * w->row_bytes;
    const uint8_t *p[BQ_ROWS];
    ptrdiff_t rows[BQ_ROWS];
    bq_row_pointers(w, row, R, rows, p);
    const __m256i off = _mm256_set1_epi16((short)offset);
    const int in_place = bq_packed_group(w, row);
    __m256 scale[8], bias[8];
    uint8_t tmp[BQ_ROWS][BQ_SPAN];
    const uint8_t *span[BQ_ROWS];
    for (ptrdiff_t g0 = b0 / per_group; g0 < b1 / per_group; g0 += 8) {
        const ptrdiff_t gn = groups - g0 < 8 ? groups - g0 : 8, first = g0 * per_group;
        /* A packed weight's blocks first .. first + gn * per_group (a GGUF super-block) as the file stores them: span,
         * whose blocks count from first; a packed group's next group, those bytes at once (one stream). */
        if (w->packed) {
            const ptrdiff_t at = gguf ? first / 8 * basert_block_bytes(type) : first * block_bytes;
            const ptrdiff_t len = gguf ? basert_block_bytes(type) : gn * per_group * block_bytes;
            if (in_place)
                for (ptrdiff_t line = 0; line < 8 * len; line += 64) __builtin_prefetch(p[0] + ahead + 8 * at + line);
            if (in_place && (kind == BASERT_Q4 || type == BASERT_GGML_Q4_K)) {
                bg_unpack_packed(kind, has_bias, offset, w, rows, p[0], g0, gn, b0, out);
                continue;
            }
            bq_stored_span(w, rows, at, len, tmp, span);
        }
        const uint8_t *const *src = w->packed ? span : p;
        const ptrdiff_t from = w->packed ? first : 0;
        bq_scale_run(kind, type, has_bias, w, rows, src, groups, gguf ? g0 - from : g0, gn, scale, bias);
        for (ptrdiff_t j = 0; j < gn; j++) {
            for (ptrdiff_t i = 0; i < per_group; i++) {
                const ptrdiff_t b = (g0 + j) * per_group + i;
                if (!in_place && (b & (prefetch_every - 1)) == 0)
                    for (int r = 0; r < BQ_ROWS; r++) __builtin_prefetch(p[r] + ahead + b * block_bytes);
                __m256 e[BQ_ROWS], o[BQ_ROWS];
                for (int r = 0; r < BQ_ROWS; r++) {
                    __m256i even, odd;
                    bq_weights(kind, type, src[r], b - from, &even, &odd);
                    if (offset) {
                        even = _mm256_sub_epi16(even, off);
                        odd = _mm256_sub_epi16(odd, off);
                    }
                    e[r] = _mm256_castsi256_ps(even);
                    o[r] = _mm256_castsi256_ps(odd);
                }
                bg_store(b - b0, scale[j], bias[j], e, o, out);
            }
        }
    }
}

/* acc + the sums of the products of w's and a's 16-bit pairs, 32-bit lane by lane: what madd then add give, in one
 * vpdpwssd (AVX512-VNNI, not saturating). Only the AVX-512 variant runs it, where the CPU has VNNI (bq_vnni): written
 * as assembly so that the variant compiles for AVX-512 CPUs without it. */
BASERT_ALWAYS_INLINE __m256i bq_dpwssd(__m256i acc, __m256i w, __m256i a) {
#if defined(BASERT_AVX512)
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(a));
    return acc;
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, a));
#endif
}

/* y[c * ldy + 8 v + r] for C (1..BG_MR) activation rows qx + c * rb against NV panels (8-row groups of weight rows;
 * rows[v] of them stored) over blocks b0..b1: the running sums start from y when b0 > 0 (the sums of the blocks
 * before, as the previous pass left them), from 0 otherwise. */
BASERT_ALWAYS_INLINE void bg_micro(const int vnni, const int C, const int NV, const int has_bias, const bg_panel *panel, const int *rows,
                                   ptrdiff_t k, ptrdiff_t b0, ptrdiff_t b1, const uint8_t *qx, ptrdiff_t rb, float *y,
                                   ptrdiff_t ldy) {
    const int32_t *q[BG_MR];
    const float *d[BG_MR];
    const float *s[BG_MR];
    __m256 acc[BG_MR][BG_NV];
    const ptrdiff_t nb = b1 - b0;
    for (int c = 0; c < C; c++) {
        q[c] = (const int32_t *)(const void *)bq_codes(qx + c * rb) + 16 * b0;
        d[c] = bq_scales(qx + c * rb, k) + b0;
        s[c] = bq_sums(qx + c * rb, k) + b0;
        for (int v = 0; v < NV; v++) {
            if (b0 == 0) {
                acc[c][v] = _mm256_setzero_ps();
            } else if (rows[v] == BQ_ROWS) {
                acc[c][v] = _mm256_loadu_ps(y + c * ldy + 8 * v);
            } else {
                float in[BQ_ROWS] = {0};
                for (int r = 0; r < rows[v]; r++) in[r] = y[c * ldy + 8 * v + r];
                acc[c][v] = _mm256_loadu_ps(in);
            }
        }
    }
    for (ptrdiff_t b = 0; b < nb; b++) {
        __m256i tot[BG_MR][BG_NV];
#pragma GCC unroll 16
        for (int pr = 0; pr < 16; pr++) {
            __m256i wv[BG_NV];
            for (int v = 0; v < NV; v++) wv[v] = _mm256_load_si256(panel[v].ints + 16 * b + pr);
            for (int c = 0; c < C; c++) {
                const __m256i av = _mm256_set1_epi32(q[c][16 * b + pr]);
                for (int v = 0; v < NV; v++) {
                    if (pr == 0) {
                        tot[c][v] = _mm256_madd_epi16(wv[v], av);
                    } else if (vnni) {
                        tot[c][v] = bq_dpwssd(tot[c][v], wv[v], av);
                    } else {
                        tot[c][v] = _mm256_add_epi32(tot[c][v], _mm256_madd_epi16(wv[v], av));
                        /* One running sum per accumulator: the compiler's reassociation into a tree of the sixteen
                         * products spills them all. */
                        __asm__("" : "+x"(tot[c][v]));
                    }
                }
            }
        }
        for (int v = 0; v < NV; v++) {
            const __m256 sv = panel[v].a[b], bv = panel[v].b[b];
            for (int c = 0; c < C; c++) {
                const __m256 dv = _mm256_set1_ps(d[c][b]);
                __m256 t = _mm256_mul_ps(_mm256_mul_ps(sv, dv), _mm256_cvtepi32_ps(tot[c][v]));
                if (has_bias) t = _mm256_add_ps(t, _mm256_mul_ps(_mm256_mul_ps(bv, dv), _mm256_set1_ps(s[c][b])));
                acc[c][v] = _mm256_add_ps(acc[c][v], t);
            }
        }
    }
    for (int c = 0; c < C; c++)
        for (int v = 0; v < NV; v++) {
            float *dst = y + c * ldy + 8 * v;
            if (rows[v] == BQ_ROWS) {
                _mm256_storeu_ps(dst, acc[c][v]);
            } else {
                float out[BQ_ROWS];
                _mm256_storeu_ps(out, acc[c][v]);
                for (int r = 0; r < rows[v]; r++) dst[r] = out[r];
            }
        }
}

/* Activation rows c0..c1 against NV panels over blocks b0..b1. */
BASERT_ALWAYS_INLINE void bg_cols(const int vnni, const int NV, const int has_bias, const bg_panel *panel, const int *rows, ptrdiff_t k,
                                  ptrdiff_t b0, ptrdiff_t b1, const uint8_t *qx, ptrdiff_t rb, ptrdiff_t c0, ptrdiff_t c1,
                                  float *y, ptrdiff_t ldy) {
    ptrdiff_t c = c0;
    for (; c + BG_MR <= c1; c += BG_MR) bg_micro(vnni, BG_MR, NV, has_bias, panel, rows, k, b0, b1, qx + c * rb, rb, y + c * ldy, ldy);
    switch (c1 - c) {
    case 3: bg_micro(vnni, 3, NV, has_bias, panel, rows, k, b0, b1, qx + c * rb, rb, y + c * ldy, ldy); break;
    case 2: bg_micro(vnni, 2, NV, has_bias, panel, rows, k, b0, b1, qx + c * rb, rb, y + c * ldy, ldy); break;
    case 1: bg_micro(vnni, 1, NV, has_bias, panel, rows, k, b0, b1, qx + c * rb, rb, y + c * ldy, ldy); break;
    default: break;
    }
}

/* Weight rows r0..r1 against activation rows c0..c1: each BG_NV x 8 weight rows unpacked BG_KC blocks at a time, and
 * every activation row run against those blocks before the next ones. */
BASERT_ALWAYS_INLINE void bg_rows(const int vnni, const int kind, const int type, const int sym, const basert_weight *w, const uint8_t *qx,
                                  ptrdiff_t rb, ptrdiff_t c0, ptrdiff_t c1, ptrdiff_t r0, ptrdiff_t r1, float *y, ptrdiff_t ldy,
                                  bg_panel *panel) {
    const int has_bias = bq_has_bias(kind, type, sym);
    const ptrdiff_t k = w->k, blocks = k / 32;
    for (ptrdiff_t row = r0; row < r1; row += BG_NV * BQ_ROWS) {
        int rows[BG_NV], nv = 0;
        for (int v = 0; v < BG_NV; v++) {
            const ptrdiff_t left = r1 - row - v * BQ_ROWS;
            rows[v] = left >= BQ_ROWS ? BQ_ROWS : left > 0 ? (int)left : 0;
            nv += rows[v] > 0;
        }
        for (ptrdiff_t b0 = 0; b0 < blocks; b0 += BG_KC) {
            const ptrdiff_t b1 = blocks - b0 < BG_KC ? blocks : b0 + BG_KC;
            for (int v = 0; v < nv; v++) bg_unpack(kind, type, sym, w, row + v * BQ_ROWS, rows[v], b0, b1, &panel[v]);
            /* The last rows may fill one panel only. */
            if (nv == BG_NV) bg_cols(vnni, BG_NV, has_bias, panel, rows, k, b0, b1, qx, rb, c0, c1, y + row, ldy);
            else bg_cols(vnni, 1, has_bias, panel, rows, k, b0, b1, qx, rb, c0, c1, y + row, ldy);
        }
    }
}
#else
/* Portable: one weight row against C activation rows, the same integers and float operations. */
static inline void bq_block(const int C, const int kind, const int type, const int sym, const int eight,
                            const basert_weight *w, ptrdiff_t row, int R, const uint8_t *qx, ptrdiff_t rb, float *y,
                            ptrdiff_t ldy) {
    (void)eight;
    const int gguf = kind == BASERT_BLOCKS, has_bias = bq_has_bias(kind, type, sym);
    const ptrdiff_t k = w->k, groups = gguf ? 0 : k / w->group_size, per_group = gguf ? 1 : w->group_size / 32;
    for (int r = 0; r < R; r++) {
        const uint8_t *p = w->data + (row + r) * w->row_bytes;
        const uint16_t *sp = gguf ? NULL : w->scales + (row + r) * groups;
        const uint16_t *bp = gguf || sym ? NULL : w->biases + (row + r) * groups;
        for (int c = 0; c < C; c++) {
            const int16_t *q = bq_codes(qx + c * rb);
            const float *d = bq_scales(qx + c * rb, k);
            const float *s = bq_sums(qx + c * rb, k);
            float acc = 0.0f;
            for (ptrdiff_t b = 0; b < k / 32; b++) {
                int ints[32], total = 0;
                float a, bias;
                if (gguf) {
                    bq_gguf_ints(type, p, b, ints);
                    bq_gguf_scales(type, p, b, &a, &bias);
                } else {
                    for (int j = 0; j < 32; j++) {
                        const ptrdiff_t e = 32 * b + j;
                        const int u = kind == BASERT_Q4 ? (p[e >> 1] >> (4 * (e & 1))) & 15 : p[e];
                        ints[j] = u - bq_offset(kind, type, sym);
                    }
                    a = bq_scale_f32(sp[b / per_group], w->bf16_scales);
                    bias = sym ? 0.0f : bq_scale_f32(bp[b / per_group], w->bf16_scales);
                }
                for (int j = 0; j < 32; j++) total += ints[j] * q[32 * b + bq_slot(j)];
                float t = (a * d[b]) * (float)total;
                if (has_bias) t = t + (bias * d[b]) * s[b];
                acc = acc + t;
            }
            y[c * ldy + row + r] = acc;
        }
    }
}
#endif

/* Weight rows row .. row + R against C activation records: the paired kernel where the AVX-512 variant has one for the
 * weight, else bq_block. */
BASERT_ALWAYS_INLINE void bq_run(const int C, const int kind, const int type, const int sym, const basert_weight *w,
                                 ptrdiff_t row, int R, const uint8_t *qx, ptrdiff_t rb, float *y, ptrdiff_t ldy) {
#if defined(BASERT_AVX512)
    if (BZ_PAIRS(kind, type)) {
        bz_block(C, kind, type, sym, w, row, R, qx, rb, y, ldy);
        return;
    }
#endif
#if defined(BASERT_SIMD)
    if (BQ8_CAPABLE(kind, type) && w->act_max == BASERT_ACT8) {
        bq_block(C, kind, type, sym, 1, w, row, R, qx, rb, y, ldy);
        return;
    }
#endif
    bq_block(C, kind, type, sym, 0, w, row, R, qx, rb, y, ldy);
}

/* Weight rows r0..r1 against activation rows c0..c1, BQ_ROWS weight rows against BQ_COLS activation rows at a time: each
 * weight row's integers are unpacked once for those activation rows (decode, a few sequences, speculative
 * verification; SIMD variants take the unpacking kernels for larger batches). */
BASERT_ALWAYS_INLINE void bq_rows(const int kind, const int type, const int sym, const basert_weight *w, const uint8_t *qx,
                                  ptrdiff_t rb, ptrdiff_t c0, ptrdiff_t c1, ptrdiff_t r0, ptrdiff_t r1, float *y, ptrdiff_t ldy) {
#if defined(BASERT_SIMD)
    if (BT_CAPABLE(kind, type) && c1 - c0 <= BT_COLS &&
        (w->act_max == BASERT_ACT8 ? bt_rows(1, kind, type, w, qx + c0 * rb, rb, (int)(c1 - c0), r0, r1, y + c0 * ldy, ldy)
                                   : bt_rows(2, kind, type, w, qx + c0 * rb, rb, (int)(c1 - c0), r0, r1, y + c0 * ldy, ldy)))
        return;
#endif
    for (ptrdiff_t row = r0; row < r1; row += BQ_ROWS) {
        const int R = r1 - row < BQ_ROWS ? (int)(r1 - row) : BQ_ROWS;
        ptrdiff_t c = c0;
        for (; c + BQ_COLS <= c1; c += BQ_COLS) bq_run(BQ_COLS, kind, type, sym, w, row, R, qx + c * rb, rb, y + c * ldy, ldy);
        switch (c1 - c) {
        case 3: bq_run(3, kind, type, sym, w, row, R, qx + c * rb, rb, y + c * ldy, ldy); break;
        case 2: bq_run(2, kind, type, sym, w, row, R, qx + c * rb, rb, y + c * ldy, ldy); break;
        case 1: bq_run(1, kind, type, sym, w, row, R, qx + c * rb, rb, y + c * ldy, ldy); break;
        default: break;
        }
    }
}

typedef void (*bq_kernel)(const basert_weight *, const uint8_t *, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t,
                          float *, ptrdiff_t);

#if defined(BASERT_SIMD)
typedef void (*bg_kernel)(const basert_weight *, const uint8_t *, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t,
                          float *, ptrdiff_t, bg_panel *);
#define BG_INSTANCE(name, vnni, kind, type, sym)                                                                         \
    static void name(const basert_weight *w, const uint8_t *qx, ptrdiff_t rb, ptrdiff_t c0, ptrdiff_t c1, ptrdiff_t r0,  \
                     ptrdiff_t r1, float *y, ptrdiff_t ldy, bg_panel *panel) {                                          \
        bg_rows(vnni, kind, type, sym, w, qx, rb, c0, c1, r0, r1, y, ldy, panel);                                        \
    }
#if defined(BASERT_AVX512)
#define BG_KERNEL(name, kind, type, sym)                                                                                 \
    BG_INSTANCE(name##_gemm, 0, kind, type, sym)                                                                         \
    BG_INSTANCE(name##_gemm_vnni, 1, kind, type, sym)
#else
#define BG_KERNEL(name, kind, type, sym) BG_INSTANCE(name##_gemm, 0, kind, type, sym)
#endif
#else
#define BG_KERNEL(name, kind, type, sym)
#endif

#define BQ_KERNEL(name, kind, type, sym)                                                                                 \
    static void name(const basert_weight *w, const uint8_t *qx, ptrdiff_t rb, ptrdiff_t c0, ptrdiff_t c1, ptrdiff_t r0,  \
                     ptrdiff_t r1, float *y, ptrdiff_t ldy) {                                                           \
        bq_rows(kind, type, sym, w, qx, rb, c0, c1, r0, r1, y, ldy);                                                     \
    }                                                                                                                    \
    BG_KERNEL(name, kind, type, sym)
BQ_KERNEL(bq_q4_sym, BASERT_Q4, 0, 1)
BQ_KERNEL(bq_q4_asym, BASERT_Q4, 0, 0)
BQ_KERNEL(bq_q8_sym, BASERT_Q8, 0, 1)
BQ_KERNEL(bq_q8_asym, BASERT_Q8, 0, 0)
BQ_KERNEL(bq_q4_k, BASERT_BLOCKS, BASERT_GGML_Q4_K, 0)
BQ_KERNEL(bq_q5_k, BASERT_BLOCKS, BASERT_GGML_Q5_K, 0)
BQ_KERNEL(bq_q6_k, BASERT_BLOCKS, BASERT_GGML_Q6_K, 0)
BQ_KERNEL(bq_q3_k, BASERT_BLOCKS, BASERT_GGML_Q3_K, 0)
BQ_KERNEL(bq_q5_0, BASERT_BLOCKS, BASERT_GGML_Q5_0, 0)
BQ_KERNEL(bq_q5_1, BASERT_BLOCKS, BASERT_GGML_Q5_1, 0)

/* The kernel instance of a weight: its row-streaming one (*gemm NULL) and, in SIMD variants, its unpacking one. */
#if defined(BASERT_AVX512)
/* Whether this CPU has AVX512-VNNI (vpdpwssd): checked once. */
static int bq_vnni(void) {
    static int known = -1;
    if (known < 0) known = __builtin_cpu_supports("avx512vnni") ? 1 : 0;
    return known;
}
#define BQ_PICK(name) do { *gemm = bq_vnni() ? name##_gemm_vnni : name##_gemm; return name; } while (0)
typedef bg_kernel bq_gemm_slot;
#elif defined(BASERT_SIMD)
#define BQ_PICK(name) do { *gemm = name##_gemm; return name; } while (0)
typedef bg_kernel bq_gemm_slot;
#else
#define BQ_PICK(name) do { *gemm = NULL; return name; } while (0)
typedef void *bq_gemm_slot;
#endif

static bq_kernel bq_kernel_of(const basert_weight *w, bq_gemm_slot *gemm) {
    const int sym = w->biases == NULL;
    if (w->kind == BASERT_Q4) { if (sym) BQ_PICK(bq_q4_sym); else BQ_PICK(bq_q4_asym); }
    if (w->kind == BASERT_Q8) { if (sym) BQ_PICK(bq_q8_sym); else BQ_PICK(bq_q8_asym); }
    switch (w->ggml_type) {
    case BASERT_GGML_Q4_K: BQ_PICK(bq_q4_k);
    case BASERT_GGML_Q5_K: BQ_PICK(bq_q5_k);
    case BASERT_GGML_Q6_K: BQ_PICK(bq_q6_k);
    case BASERT_GGML_Q3_K: BQ_PICK(bq_q3_k);
    case BASERT_GGML_Q5_0: BQ_PICK(bq_q5_0);
    default: BQ_PICK(bq_q5_1);
    }
}

/* Activation rows per pass over the weight rows: `budget` bytes of records, so that they stay in L2 while every
 * weight row streams past them once. */
static ptrdiff_t bq_cols_per_pass(ptrdiff_t rb, ptrdiff_t budget) {
    ptrdiff_t cols = budget / rb / BQ_COLS * BQ_COLS;
    return cols < BQ_COLS ? BQ_COLS : cols;
}

#if defined(BASERT_SIMD) && !defined(BASERT_AVX512)
/* Whether the byte kernels take batches of any size, BT_COLS activation rows per pass over the weight rows: on AVX2
 * they beat the unpacking kernels at every size (prefill 7-13% faster on a Zen 3: one Q4_K matrix at M = 256, 1.2-1.4x
 * the rate); the AVX-512 variant keeps its unpacking kernels (vpdpwssd) beyond BT_COLS rows, not measured against
 * them. */
#define BT_ANY_BATCH 1
#else
#define BT_ANY_BATCH 0
#endif

/* Batches of more activation rows than the row-streaming kernels take in one pass (BT_COLS for the byte kernels'
 * types, else BQ_COLS) take the unpacking kernels (SIMD variants), but for the byte kernels' types where BT_ANY_BATCH. */
void basert_qmatmul(const basert_weight *w, const uint8_t *qx, ptrdiff_t m, ptrdiff_t r0, ptrdiff_t r1, float *y, ptrdiff_t ldy) {
    if (m < 1 || r0 >= r1) return;
    bq_gemm_slot gemm;
    const bq_kernel run = bq_kernel_of(w, &gemm);
    const ptrdiff_t rb = basert_qrow_bytes(w->k);
#if defined(BASERT_SIMD)
    const int bytes = BT_CAPABLE(w->kind, w->ggml_type);
    if (bytes ? BT_ANY_BATCH || m <= BT_COLS : m <= BQ_COLS) {
        for (ptrdiff_t c0 = 0; c0 < m; c0 += BT_COLS)
            run(w, qx, rb, c0, c0 + BT_COLS < m ? c0 + BT_COLS : m, r0, r1, y, ldy);
        return;
    }
    /* Each thread's panels: 16 vectors of integers and 2 of floats per block (72 KiB), kept between calls. */
    static _Thread_local __m256i mem[BG_NV][BG_KC * 18];
    bg_panel panel[BG_NV];
    for (int v = 0; v < BG_NV; v++) {
        panel[v].ints = mem[v];
        panel[v].a = (__m256 *)(void *)(mem[v] + 16 * BG_KC);
        panel[v].b = panel[v].a + BG_KC;
    }
    /* Activation rows per pass: about 256 KiB of the blocks that one panel meets. */
    const ptrdiff_t slice = w->k / 32 < BG_KC ? rb : BG_KC * (64 + 8);
    const ptrdiff_t per = bq_cols_per_pass(slice, 262144);
    for (ptrdiff_t c0 = 0; c0 < m; c0 += per) gemm(w, qx, rb, c0, c0 + per < m ? c0 + per : m, r0, r1, y, ldy, panel);
#else
    const ptrdiff_t per = bq_cols_per_pass(rb, 65536);
    for (ptrdiff_t c0 = 0; c0 < m; c0 += per) run(w, qx, rb, c0, c0 + per < m ? c0 + per : m, r0, r1, y, ldy);
#endif
}
