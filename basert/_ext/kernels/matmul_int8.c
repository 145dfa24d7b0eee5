/* 8-bit activations and the integer dot products of base_q4 / base_q8 weights (matmul.h states the contract).
 *
 * SIMD variants: eight weight rows at a time; each row's 32 codes of a block meet an activation block in one
 * maddubs + madd (q8 codes as signed bytes, with the sign moved onto the activations), the eight rows' partial sums
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

/* Offset of a symmetric code: u - 8 (q4) or u - 128 (q8) is the signed value. */
static inline int bq_offset(const int kind) { return kind == BASERT_Q4 ? 8 : 128; }

#if defined(BASERT_SIMD)
/* The 32 codes of a q4 block (16 bytes: element 2i in the low nibble of byte i, 2i+1 in the high one) as bytes
 * in element order: byte i widened to a 16-bit lane, its low nibble kept in the lane's low byte and its high
 * nibble moved to the lane's high byte. */
BASERT_ALWAYS_INLINE __m256i bq_q4_codes(const uint8_t *p) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(const void *)p));
    return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi16(0x000F)),
                           _mm256_and_si256(_mm256_slli_epi16(v, 4), _mm256_set1_epi16(0x0F00)));
}

/* A block's weight operand: q4 codes (0..15) as they are; q8 codes as signed bytes u - 128. */
BASERT_ALWAYS_INLINE __m256i bq_weights(const int kind, const uint8_t *row, ptrdiff_t b) {
    if (kind == BASERT_Q4) return bq_q4_codes(row + 16 * b);
    return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(const void *)(row + 32 * b)), _mm256_set1_epi8((char)0x80));
}

/* Eight partial sums (32-bit lanes) of the block's products: sum u * q for q4, sum (u - 128) * q for q8 (maddubs
 * multiplies unsigned by signed bytes: |u - 128| by q with the sign of u - 128, each pair sum at most
 * 2 * 128 * 127 in magnitude, so nothing saturates). */
BASERT_ALWAYS_INLINE __m256i bq_dot(const int kind, __m256i w, __m256i a) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (kind == BASERT_Q4) return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), ones);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w)), ones);
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
 * [row][group] (`groups` per row); rows beyond the weight's last repeat `first`. */
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

/* y[c * ldy + row + r] for weight rows row + r (r < R <= 8) against C (1..4) activation records qx + c * rb. */
BASERT_ALWAYS_INLINE void bq_block(const int C, const int kind, const int sym, const basert_weight *w, ptrdiff_t row, int R,
                                   const uint8_t *qx, ptrdiff_t rb, float *y, ptrdiff_t ldy) {
    const ptrdiff_t k = w->k, blocks = k / 32, groups = k / w->group_size, per_group = w->group_size / 32;
    const ptrdiff_t block_bytes = kind == BASERT_Q4 ? 16 : 32;
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
            bq_group_run(w->scales, rows, groups, g, gn, w->bf16_scales, scale);
            if (!sym) bq_group_run(w->biases, rows, groups, g, gn, w->bf16_scales, bias);
        }
        if (((b * block_bytes) & 63) == 0)
            for (int r = 0; r < BQ_ROWS; r++) __builtin_prefetch(p[r] + b * block_bytes + 2048);
        __m256i wv[BQ_ROWS];
        for (int r = 0; r < BQ_ROWS; r++) wv[r] = bq_weights(kind, p[r], b);
        const __m256 sv = scale[g % 8];
        for (int c = 0; c < C; c++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)(q[c] + 32 * b));
            __m256i part[BQ_ROWS];
            for (int r = 0; r < BQ_ROWS; r++) part[r] = bq_dot(kind, wv[r], a);
            __m256i total = bq_sum8(part);
            const int sum = s[c][2 * b] + s[c][2 * b + 1];
            /* q4 gave sum u * q: symmetric takes 8 * S off. q8 gave sum (u - 128) * q: with biases, 128 * S goes back. */
            if (kind == BASERT_Q4 && sym) total = _mm256_sub_epi32(total, _mm256_set1_epi32(8 * sum));
            if (kind == BASERT_Q8 && !sym) total = _mm256_add_epi32(total, _mm256_set1_epi32(128 * sum));
            const __m256 dv = _mm256_set1_ps(d[c][b]);
            __m256 t = _mm256_mul_ps(_mm256_mul_ps(sv, dv), _mm256_cvtepi32_ps(total));
            if (!sym) t = _mm256_add_ps(t, _mm256_mul_ps(_mm256_mul_ps(bias[g % 8], dv), _mm256_set1_ps((float)sum)));
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
static inline void bq_block(const int C, const int kind, const int sym, const basert_weight *w, ptrdiff_t row, int R,
                            const uint8_t *qx, ptrdiff_t rb, float *y, ptrdiff_t ldy) {
    const ptrdiff_t k = w->k, groups = k / w->group_size, per_group = w->group_size / 32;
    for (int r = 0; r < R; r++) {
        const uint8_t *p = w->data + (row + r) * w->row_bytes;
        const uint16_t *sp = w->scales + (row + r) * groups, *bp = sym ? NULL : w->biases + (row + r) * groups;
        for (int c = 0; c < C; c++) {
            const int8_t *q = bq_codes(qx + c * rb);
            const float *d = bq_scales(qx + c * rb, k);
            const int16_t *s = bq_sums(qx + c * rb, k);
            float acc = 0.0f;
            for (ptrdiff_t b = 0; b < k / 32; b++) {
                int total = 0;
                for (int j = 0; j < 32; j++) {
                    const ptrdiff_t e = 32 * b + j;
                    const int u = kind == BASERT_Q4 ? (p[e >> 1] >> (4 * (e & 1))) & 15 : p[e];
                    total += (sym ? u - bq_offset(kind) : u) * q[e];
                }
                const int sum = s[2 * b] + s[2 * b + 1];
                const ptrdiff_t g = b / per_group;
                float t = (bq_scale_f32(sp[g], w->bf16_scales) * d[b]) * (float)total;
                if (!sym) t = t + (bq_scale_f32(bp[g], w->bf16_scales) * d[b]) * (float)sum;
                acc = acc + t;
            }
            y[c * ldy + row + r] = acc;
        }
    }
}
#endif

/* Weight rows r0..r1 against activation rows c0..c1: blocks of BQ_ROWS rows, each against BQ_COLS activation rows at
 * a time (the codes of the block of rows stay in L1 meanwhile). */
BASERT_ALWAYS_INLINE void bq_rows(const int kind, const int sym, const basert_weight *w, const uint8_t *qx, ptrdiff_t rb,
                                  ptrdiff_t c0, ptrdiff_t c1, ptrdiff_t r0, ptrdiff_t r1, float *y, ptrdiff_t ldy) {
    for (ptrdiff_t row = r0; row < r1; row += BQ_ROWS) {
        const int R = r1 - row < BQ_ROWS ? (int)(r1 - row) : BQ_ROWS;
        ptrdiff_t c = c0;
        for (; c + BQ_COLS <= c1; c += BQ_COLS) bq_block(BQ_COLS, kind, sym, w, row, R, qx + c * rb, rb, y + c * ldy, ldy);
        switch (c1 - c) {
        case 3: bq_block(3, kind, sym, w, row, R, qx + c * rb, rb, y + c * ldy, ldy); break;
        case 2: bq_block(2, kind, sym, w, row, R, qx + c * rb, rb, y + c * ldy, ldy); break;
        case 1: bq_block(1, kind, sym, w, row, R, qx + c * rb, rb, y + c * ldy, ldy); break;
        default: break;
        }
    }
}

#define BQ_KERNEL(name, kind, sym)                                                                                        \
    static void name(const basert_weight *w, const uint8_t *qx, ptrdiff_t rb, ptrdiff_t c0, ptrdiff_t c1, ptrdiff_t r0,   \
                     ptrdiff_t r1, float *y, ptrdiff_t ldy) {                                                            \
        bq_rows(kind, sym, w, qx, rb, c0, c1, r0, r1, y, ldy);                                                            \
    }
BQ_KERNEL(bq_q4_sym, BASERT_Q4, 1)
BQ_KERNEL(bq_q4_asym, BASERT_Q4, 0)
BQ_KERNEL(bq_q8_sym, BASERT_Q8, 1)
BQ_KERNEL(bq_q8_asym, BASERT_Q8, 0)

/* Activation rows per pass over the weight rows: about 64 KiB of records, so that they stay in L2 while every
 * weight row streams past them once. */
static ptrdiff_t bq_cols_per_pass(ptrdiff_t rb) {
    ptrdiff_t cols = 65536 / rb / BQ_COLS * BQ_COLS;
    return cols < BQ_COLS ? BQ_COLS : cols;
}

void basert_qmatmul(const basert_weight *w, const uint8_t *qx, ptrdiff_t m, ptrdiff_t r0, ptrdiff_t r1, float *y, ptrdiff_t ldy) {
    if (m < 1 || r0 >= r1) return;
    const int sym = w->biases == NULL;
    void (*run)(const basert_weight *, const uint8_t *, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t, float *, ptrdiff_t) =
        w->kind == BASERT_Q4 ? (sym ? bq_q4_sym : bq_q4_asym) : (sym ? bq_q8_sym : bq_q8_asym);
    const ptrdiff_t rb = basert_qrow_bytes(w->k), per = bq_cols_per_pass(rb);
    for (ptrdiff_t c0 = 0; c0 < m; c0 += per) run(w, qx, rb, c0, c0 + per < m ? c0 + per : m, r0, r1, y, ldy);
}
