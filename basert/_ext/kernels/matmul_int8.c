/* 8-bit activations and the integer dot products of quantized weights (matmul.h states the contract): base_q4 /
 * base_q8, and the GGUF blocks Q4_K, Q5_K, Q6_K, Q5_0, Q5_1.
 *
 * SIMD variants: eight weight rows at a time; each row's 32 integers of a block meet an activation block in one
 * maddubs + madd (signed weights with their sign moved onto the activations; Q6_K's scales as madd's multipliers), the eight rows' partial sums
 * are folded into one vector of eight exact block sums (lane r: weight row r), and the float operations run on
 * those eight rows at once. The portable variant computes the same integers and float operations row by row. */
#include <math.h>
#include <string.h>

#include "matmul.h"

/* Weight rows per block of the kernel, and activation rows at most per call of it. */
#define BQ_ROWS 8
#define BQ_COLS 4

/* Activation record fields (matmul.h): codes, then the block scales, then the 16-code sums. */
static inline const int8_t *bq_codes(const uint8_t *rec) { return (const int8_t *)(const void *)rec; }
static inline const float *bq_scales(const uint8_t *rec, ptrdiff_t k) { return (const float *)(const void *)(rec + k); }
static inline const int16_t *bq_sums(const uint8_t *rec, ptrdiff_t k) {
    return (const int16_t *)(const void *)(rec + k + k / 8);
}

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

void basert_quantize_rows(const float *x, ptrdiff_t ldx, ptrdiff_t m, ptrdiff_t k, uint8_t *dst) {
    const ptrdiff_t rb = basert_qrow_bytes(k);
    for (ptrdiff_t i = 0; i < m; i++) {
        const float *row = x + i * ldx;
        uint8_t *rec = dst + i * rb;
        int8_t *q = (int8_t *)(void *)rec;
        float *d = (float *)(void *)(rec + k);
        int16_t *sums = (int16_t *)(void *)(rec + k + k / 8);
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
            const float scale = amax / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
            d[b] = scale;
#if defined(BASERT_SIMD)
            const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
            __m256i r[4];
            for (int j = 0; j < 4; j++) {
                /* max(v, -127) takes -127 for a NaN (its second operand), like the portable comparison. */
                const __m256 s = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * j), vinv), lo), hi);
                r[j] = _mm256_cvtps_epi32(s);
            }
            /* packs works within 128-bit lanes: the permute puts the 32 codes back in order. */
            const __m256i w16 = _mm256_packs_epi32(r[0], r[1]), x16 = _mm256_packs_epi32(r[2], r[3]);
            const __m256i w8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16, x16), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(void *)(q + 32 * b), w8);
            const __m256i pairs = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), w8), _mm256_set1_epi16(1));
            /* pairs: lane j the sum of codes 4j..4j+3; the 16-code sums are lanes 0-3 and 4-7. */
            const __m128i s4 = _mm_hadd_epi32(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
            const __m128i s2 = _mm_hadd_epi32(s4, s4);
            sums[2 * b] = (int16_t)_mm_cvtsi128_si32(s2);
            sums[2 * b + 1] = (int16_t)_mm_extract_epi32(s2, 1);
#else
            int total[2] = {0, 0};
            for (int j = 0; j < 32; j++) {
                float s = v[j] * inv;
                if (!(s >= -127.0f)) s = -127.0f; /* NaN too */
                if (s > 127.0f) s = 127.0f;
                const int code = (int)lrintf(s);
                q[32 * b + j] = (int8_t)code;
                total[j >> 4] += code;
            }
            sums[2 * b] = (int16_t)total[0];
            sums[2 * b + 1] = (int16_t)total[1];
#endif
        }
    }
}

/* ---- the kernels ---- */

/* Offset of a symmetric base code: u - 8 (q4) or u - 128 (q8) is the signed value. */
static inline int bq_offset(const int kind) { return kind == BASERT_Q4 ? 8 : 128; }

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
/* The 32 codes of a q4 block (16 bytes: element 2i in the low nibble of byte i, 2i+1 in the high one) as bytes
 * in element order: byte i widened to a 16-bit lane, its low nibble kept in the lane's low byte and its high
 * nibble moved to the lane's high byte. */
BASERT_ALWAYS_INLINE __m256i bq_q4_codes(const uint8_t *p) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(const void *)p));
    return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi16(0x000F)),
                           _mm256_and_si256(_mm256_slli_epi16(v, 4), _mm256_set1_epi16(0x0F00)));
}

BASERT_ALWAYS_INLINE __m256i bq_load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)(const void *)p); }

/* Bytes p[0..32) shifted right by `shift` bits, masked to `mask`. */
BASERT_ALWAYS_INLINE __m256i bq_bits32(const uint8_t *p, int shift, int mask) {
    return _mm256_and_si256(_mm256_srl_epi16(bq_load32(p), _mm_cvtsi32_si128(shift)), _mm256_set1_epi8((char)mask));
}

/* Q5_0 / Q5_1: the 5-bit codes of a block (low nibbles of qs: elements 0-15, high nibbles: 16-31; bit j of qh the
 * fifth bit of element j). */
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

/* A block's weight operand: the bytes w (signed where bq_signed) and the 16-bit multipliers of its pairs of products
 * (ones, or Q6_K's scale of each 16 values). q8 codes become u - 128, Q6_K's u - 32, Q5_0's u - 16. */
BASERT_ALWAYS_INLINE int bq_signed(const int kind, const int type) {
    return kind == BASERT_Q8 || (kind == BASERT_BLOCKS && (type == BASERT_GGML_Q6_K || type == BASERT_GGML_Q5_0));
}

BASERT_ALWAYS_INLINE __m256i bq_weights(const int kind, const int type, const uint8_t *row, ptrdiff_t b, __m256i *mul) {
    *mul = _mm256_set1_epi16(1);
    if (kind == BASERT_Q4) return bq_q4_codes(row + 16 * b);
    if (kind == BASERT_Q8) return _mm256_xor_si256(bq_load32(row + 32 * b), _mm256_set1_epi8((char)0x80));
    int sub;
    const uint8_t *blk = bq_gguf_block(type, row, b, &sub);
    if (type == BASERT_GGML_Q4_K || type == BASERT_GGML_Q5_K) {
        const int five = type == BASERT_GGML_Q5_K;
        __m256i u = bq_bits32(blk + (five ? 48 : 16) + 32 * (sub >> 1), 4 * (sub & 1), 15);
        if (five) u = _mm256_or_si256(u, _mm256_slli_epi16(bq_bits32(blk + 16, sub, 1), 4));
        return u;
    }
    if (type == BASERT_GGML_Q6_K) {
        const int h = sub >> 2, t = sub & 3;
        const __m256i low = bq_bits32(blk + 64 * h + 32 * (t & 1), 4 * (t >> 1), 15);
        const __m256i high = _mm256_slli_epi16(bq_bits32(blk + 128 + 32 * h, 2 * t, 3), 4);
        const int8_t *scales = (const int8_t *)(const void *)(blk + 192 + 2 * sub);
        *mul = _mm256_set_m128i(_mm_set1_epi16(scales[1]), _mm_set1_epi16(scales[0]));
        return _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
    }
    const int with_min = type == BASERT_GGML_Q5_1;
    const __m256i u = bq_q5_codes(blk + (with_min ? 4 : 2), blk + (with_min ? 8 : 6));
    return with_min ? u : _mm256_sub_epi8(u, _mm256_set1_epi8(16));
}

/* Eight partial sums (32-bit lanes) of the block's products w * q, each pair of products times its multiplier.
 * Signed weights go through maddubs as |w| times q with the sign of w (each pair sum at most 2 * 128 * 127 in
 * magnitude, so nothing saturates; unsigned codes are at most 31). */
BASERT_ALWAYS_INLINE __m256i bq_dot(const int sgn, __m256i w, __m256i mul, __m256i a) {
    if (sgn) return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w)), mul);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), mul);
}

/* Lane r = the sum of the eight lanes of p[r]. */
BASERT_ALWAYS_INLINE __m256i bq_sum8(const __m256i *p) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
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

/* The A and B (matmul.h) of blocks b0 .. b0 + gn of eight GGUF rows: a[j][r], bias[j][r]. */
BASERT_ALWAYS_INLINE void bq_gguf_run(const int type, const uint8_t *const *p, ptrdiff_t b0, ptrdiff_t gn, __m256 *a, __m256 *bias) {
    float ta[8][BQ_ROWS], tb[8][BQ_ROWS];
    for (int r = 0; r < BQ_ROWS; r++)
        for (ptrdiff_t j = 0; j < gn; j++) bq_gguf_scales(type, p[r], b0 + j, &ta[j][r], &tb[j][r]);
    for (ptrdiff_t j = 0; j < gn; j++) {
        a[j] = _mm256_loadu_ps(ta[j]);
        bias[j] = _mm256_loadu_ps(tb[j]);
    }
}

/* y[c * ldy + row + r] for weight rows row + r (r < R <= 8) against C (1..4) activation records qx + c * rb. kind,
 * type (GGUF blocks) and sym are constants of each instance. */
BASERT_ALWAYS_INLINE void bq_block(const int C, const int kind, const int type, const int sym, const basert_weight *w,
                                   ptrdiff_t row, int R, const uint8_t *qx, ptrdiff_t rb, float *y, ptrdiff_t ldy) {
    const int gguf = kind == BASERT_BLOCKS, has_bias = bq_has_bias(kind, type, sym), sgn = bq_signed(kind, type);
    const ptrdiff_t k = w->k, blocks = k / 32, per_group = gguf ? 1 : w->group_size / 32, groups = blocks / per_group;
    const ptrdiff_t line_blocks = gguf ? 1 : kind == BASERT_Q4 ? 4 : 2; /* blocks per cache line of codes */
    const ptrdiff_t block_bytes = gguf ? basert_block_bytes(type) / (basert_block_values(type) / 32) : kind == BASERT_Q4 ? 16 : 32;
    const uint8_t *p[BQ_ROWS];
    ptrdiff_t rows[BQ_ROWS];
    for (int r = 0; r < BQ_ROWS; r++) {
        rows[r] = row + (r < R ? r : 0); /* beyond R: row again, its sums never stored */
        p[r] = w->data + rows[r] * w->row_bytes;
    }
    const int8_t *q[BQ_COLS];
    const float *d[BQ_COLS];
    const int16_t *s[BQ_COLS];
    __m256 acc[BQ_COLS];
    for (int c = 0; c < C; c++) {
        q[c] = bq_codes(qx + c * rb);
        d[c] = bq_scales(qx + c * rb, k);
        s[c] = bq_sums(qx + c * rb, k);
        acc[c] = _mm256_setzero_ps();
    }
    __m256 scale[8], bias[8];
    for (ptrdiff_t b = 0; b < blocks; b++) {
        const ptrdiff_t g = b / per_group;
        if (b % (8 * per_group) == 0) {
            const ptrdiff_t gn = groups - g < 8 ? groups - g : 8;
            if (gguf) {
                bq_gguf_run(type, p, g, gn, scale, bias);
            } else {
                bq_group_run(w->scales, rows, groups, g, gn, w->bf16_scales, scale);
                if (has_bias) bq_group_run(w->biases, rows, groups, g, gn, w->bf16_scales, bias);
            }
        }
        if (b % line_blocks == 0)
            for (int r = 0; r < BQ_ROWS; r++) __builtin_prefetch(p[r] + b * block_bytes + 2048);
        __m256i wv[BQ_ROWS], mul[BQ_ROWS];
        for (int r = 0; r < BQ_ROWS; r++) wv[r] = bq_weights(kind, type, p[r], b, &mul[r]);
        const __m256 sv = scale[g % 8];
        for (int c = 0; c < C; c++) {
            const __m256i a = bq_load32((const uint8_t *)(const void *)(q[c] + 32 * b));
            __m256i part[BQ_ROWS];
            for (int r = 0; r < BQ_ROWS; r++) part[r] = bq_dot(sgn, wv[r], mul[r], a);
            __m256i total = bq_sum8(part);
            const int sum = s[c][2 * b] + s[c][2 * b + 1];
            /* base q4 gave sum u * q: symmetric takes 8 * S off. q8 gave sum (u - 128) * q: with biases, 128 * S goes
             * back. */
            if (kind == BASERT_Q4 && sym) total = _mm256_sub_epi32(total, _mm256_set1_epi32(8 * sum));
            if (kind == BASERT_Q8 && !sym) total = _mm256_add_epi32(total, _mm256_set1_epi32(128 * sum));
            const __m256 dv = _mm256_set1_ps(d[c][b]);
            __m256 t = _mm256_mul_ps(_mm256_mul_ps(sv, dv), _mm256_cvtepi32_ps(total));
            if (has_bias) t = _mm256_add_ps(t, _mm256_mul_ps(_mm256_mul_ps(bias[g % 8], dv), _mm256_set1_ps((float)sum)));
            acc[c] = _mm256_add_ps(acc[c], t);
        }
    }
    for (int c = 0; c < C; c++) {
        if (R == BQ_ROWS) {
            _mm256_storeu_ps(y + c * ldy + row, acc[c]);
        } else {
            float out[BQ_ROWS];
            _mm256_storeu_ps(out, acc[c]);
            for (int r = 0; r < R; r++) y[c * ldy + row + r] = out[r];
        }
    }
}
#else
/* Portable: one weight row against C activation rows, the same integers and float operations. */
static inline void bq_block(const int C, const int kind, const int type, const int sym, const basert_weight *w,
                            ptrdiff_t row, int R, const uint8_t *qx, ptrdiff_t rb, float *y, ptrdiff_t ldy) {
    const int gguf = kind == BASERT_BLOCKS, has_bias = bq_has_bias(kind, type, sym);
    const ptrdiff_t k = w->k, groups = gguf ? 0 : k / w->group_size, per_group = gguf ? 1 : w->group_size / 32;
    for (int r = 0; r < R; r++) {
        const uint8_t *p = w->data + (row + r) * w->row_bytes;
        const uint16_t *sp = gguf ? NULL : w->scales + (row + r) * groups;
        const uint16_t *bp = gguf || sym ? NULL : w->biases + (row + r) * groups;
        for (int c = 0; c < C; c++) {
            const int8_t *q = bq_codes(qx + c * rb);
            const float *d = bq_scales(qx + c * rb, k);
            const int16_t *s = bq_sums(qx + c * rb, k);
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
                        ints[j] = sym ? u - bq_offset(kind) : u;
                    }
                    a = bq_scale_f32(sp[b / per_group], w->bf16_scales);
                    bias = sym ? 0.0f : bq_scale_f32(bp[b / per_group], w->bf16_scales);
                }
                for (int j = 0; j < 32; j++) total += ints[j] * q[32 * b + j];
                const int sum = s[2 * b] + s[2 * b + 1];
                float t = (a * d[b]) * (float)total;
                if (has_bias) t = t + (bias * d[b]) * (float)sum;
                acc = acc + t;
            }
            y[c * ldy + row + r] = acc;
        }
    }
}
#endif

/* Weight rows r0..r1 against activation rows c0..c1: blocks of BQ_ROWS rows, each against BQ_COLS activation rows at
 * a time (the codes of the block of rows stay in L1 meanwhile). */
BASERT_ALWAYS_INLINE void bq_rows(const int kind, const int type, const int sym, const basert_weight *w, const uint8_t *qx,
                                  ptrdiff_t rb, ptrdiff_t c0, ptrdiff_t c1, ptrdiff_t r0, ptrdiff_t r1, float *y, ptrdiff_t ldy) {
    for (ptrdiff_t row = r0; row < r1; row += BQ_ROWS) {
        const int R = r1 - row < BQ_ROWS ? (int)(r1 - row) : BQ_ROWS;
        ptrdiff_t c = c0;
        for (; c + BQ_COLS <= c1; c += BQ_COLS) bq_block(BQ_COLS, kind, type, sym, w, row, R, qx + c * rb, rb, y + c * ldy, ldy);
        switch (c1 - c) {
        case 3: bq_block(3, kind, type, sym, w, row, R, qx + c * rb, rb, y + c * ldy, ldy); break;
        case 2: bq_block(2, kind, type, sym, w, row, R, qx + c * rb, rb, y + c * ldy, ldy); break;
        case 1: bq_block(1, kind, type, sym, w, row, R, qx + c * rb, rb, y + c * ldy, ldy); break;
        default: break;
        }
    }
}

typedef void (*bq_kernel)(const basert_weight *, const uint8_t *, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t,
                          float *, ptrdiff_t);

#define BQ_KERNEL(name, kind, type, sym)                                                                                 \
    static void name(const basert_weight *w, const uint8_t *qx, ptrdiff_t rb, ptrdiff_t c0, ptrdiff_t c1, ptrdiff_t r0,  \
                     ptrdiff_t r1, float *y, ptrdiff_t ldy) {                                                           \
        bq_rows(kind, type, sym, w, qx, rb, c0, c1, r0, r1, y, ldy);                                                     \
    }
BQ_KERNEL(bq_q4_sym, BASERT_Q4, 0, 1)
BQ_KERNEL(bq_q4_asym, BASERT_Q4, 0, 0)
BQ_KERNEL(bq_q8_sym, BASERT_Q8, 0, 1)
BQ_KERNEL(bq_q8_asym, BASERT_Q8, 0, 0)
BQ_KERNEL(bq_q4_k, BASERT_BLOCKS, BASERT_GGML_Q4_K, 0)
BQ_KERNEL(bq_q5_k, BASERT_BLOCKS, BASERT_GGML_Q5_K, 0)
BQ_KERNEL(bq_q6_k, BASERT_BLOCKS, BASERT_GGML_Q6_K, 0)
BQ_KERNEL(bq_q5_0, BASERT_BLOCKS, BASERT_GGML_Q5_0, 0)
BQ_KERNEL(bq_q5_1, BASERT_BLOCKS, BASERT_GGML_Q5_1, 0)

static bq_kernel bq_kernel_of(const basert_weight *w) {
    const int sym = w->biases == NULL;
    if (w->kind == BASERT_Q4) return sym ? bq_q4_sym : bq_q4_asym;
    if (w->kind == BASERT_Q8) return sym ? bq_q8_sym : bq_q8_asym;
    switch (w->ggml_type) {
    case BASERT_GGML_Q4_K: return bq_q4_k;
    case BASERT_GGML_Q5_K: return bq_q5_k;
    case BASERT_GGML_Q6_K: return bq_q6_k;
    case BASERT_GGML_Q5_0: return bq_q5_0;
    default: return bq_q5_1;
    }
}

/* Activation rows per pass over the weight rows: about 64 KiB of records, so that they stay in L2 while every
 * weight row streams past them once. */
static ptrdiff_t bq_cols_per_pass(ptrdiff_t rb) {
    ptrdiff_t cols = 65536 / rb / BQ_COLS * BQ_COLS;
    return cols < BQ_COLS ? BQ_COLS : cols;
}

void basert_qmatmul(const basert_weight *w, const uint8_t *qx, ptrdiff_t m, ptrdiff_t r0, ptrdiff_t r1, float *y, ptrdiff_t ldy) {
    if (m < 1 || r0 >= r1) return;
    const bq_kernel run = bq_kernel_of(w);
    const ptrdiff_t rb = basert_qrow_bytes(w->k), per = bq_cols_per_pass(rb);
    for (ptrdiff_t c0 = 0; c0 < m; c0 += per) run(w, qx, rb, c0, c0 + per < m ? c0 + per : m, r0, r1, y, ldy);
}
