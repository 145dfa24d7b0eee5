/* Causal attention of query rows over a paged KV cache (blocks of 16 positions), its K and V rows each
 * stored as one of the KV types below (float32, float16, bfloat16, or 8-bit codes with a scale per 32).
 *
 * Fixed arithmetic. A query row that sees positions 0 .. n-1 is computed as ceil(n / S) segments
 * [jS, min((j+1)S, n)), S = BASERT_ATTN_SEGMENT. Segment j yields a partial: top_j = the max of its
 * scores s_p = scale * q.k_p, sum_j = the sum of exp(s_p - top_j) and acc_j[e] = the sum of
 * exp(s_p - top_j) * v_p[e], each over its positions in order (dot products and the exp sum with the
 * fixed 8-lane reductions of simd.h, the V sum one fmaf per position). The partials are folded in
 * segment order (basert_attend_fold), then out = acc * (1 / sum): with a single segment this is
 * acc_0 * (1 / sum_0) exactly. Whoever computes a segment, on whatever thread, grouped with whatever
 * other rows, a row's partials and hence its output bits are the same: a token's output depends only
 * on its query and the cache contents, never on batching, prompt splits or thread counts.
 *
 * Sliding windows. With a window of W positions (0: none) a row that sees positions 0 .. n-1 attends to
 * positions first .. n-1 only, first = basert_attn_first(n, W) = max(0, n - W). Its segments are those
 * that hold one of these positions, from segment first / S on; in the segment holding `first` the
 * earlier positions take part with score -inf, so their weights are exactly 0 (the same fixed segment
 * boundaries, whatever the window). The segments before it are never read.
 *
 * Building blocks (static, for any module that includes this header; no allocation, no threads):
 *   basert_attend_segment(n_rows, q, n_pos, window, p0, p1, k, v, k_type, v_type, block_table, block_rows, d, scale,
 *                         scores, top, sum, acc)
 *       the partials of segment [p0, p1) (p0 = jS, p1 = min(p0 + S, max n_pos)) for n_rows query rows
 *       of one kv head: q[r] the row's d floats, n_pos[r] the positions it sees (rows with
 *       n_pos[r] <= p0 or whose window starts at or after p1 are skipped and their outputs untouched;
 *       rows with n_pos[r] < p1 stop there).
 *       k, v point at that kv head's rows in cache block 0, rows of basert_kv_row_bytes(k_type / v_type, d)
 *       bytes; block_table[i] is the cache block of positions 16i .. 16i+15, block_rows the rows per cache
 *       block (all kv heads'). Writes top[r], sum[r] and acc[r][0..d); scores is scratch of
 *       n_rows * BASERT_ATTN_SEGMENT floats. Any n_rows; rows of different kv heads need separate calls.
 *   basert_attend_merge(n_segments, top, sum, acc, acc_stride, d, out)
 *       one row's output from the partials of its n_segments = ceil(n / S) - first / S segments: top[j],
 *       sum[j], acc[j * acc_stride .. + d), j counted from the row's first segment.
 *   basert_attend_fold(&top, &sum, acc, top_j, sum_j, acc_j, d)
 *       one step of that merge, for callers that fold as segments complete.
 *   basert_attend_rows(n_rows, q, n_pos, window, k, v, k_type, v_type, block_table, block_rows, d, scale, scratch, out)
 *       whole rows on the calling thread (prefill), same bits as segments + merge; n_rows <=
 *       BASERT_ATTN_MAX_ROWS, scratch of BASERT_ATTN_ROWS_SCRATCH(n_rows, d) floats.
 * Rows of one kv head attended together share every K and V row they both see, read once. */
#ifndef BASERT_ATTENTION_H
#define BASERT_ATTENTION_H

#include <stdint.h>
#include <string.h>
#include "simd.h"

#define BASERT_KV_BLOCK 16

/* Positions per segment: a multiple of the cache block. */
#define BASERT_ATTN_SEGMENT 256

/* The first position a row that sees positions 0 .. n-1 attends to under a sliding window of `window`
 * positions (0: no window). */
static inline ptrdiff_t basert_attn_first(ptrdiff_t n, ptrdiff_t window) {
    return window > 0 && n > window ? n - window : 0;
}

/* Whether a row that sees positions 0 .. n-1 through `window` attends to any position of [p0, p0 + S). */
static inline int basert_attn_takes_part(ptrdiff_t n, ptrdiff_t window, ptrdiff_t p0) {
    return n > p0 && basert_attn_first(n, window) < p0 + BASERT_ATTN_SEGMENT;
}

/* IEEE half -> float, exactly as F16C converts. */
static inline float basert_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (e == 0) {
        v.f = (float)m * 5.9604644775390625e-8f; /* m * 2^-24, exact */
        v.u |= sign;
    } else if (e == 31) { /* inf, or a NaN made quiet as F16C does */
        v.u = sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0u);
    } else {
        v.u = sign | ((e + 112) << 23) | (m << 13);
    }
    return v.f;
}

/* float -> IEEE half, round to nearest even, overflow to inf: what F16C and numpy's astype do. */
static inline uint16_t basert_f32_to_f16(float f) {
    union { float f; uint32_t u; } v = {f};
    uint32_t sign = (v.u >> 16) & 0x8000u, a = v.u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to inf */
    if (a >= 0x38800000u) {                                  /* normal half */
        uint32_t r = a - 0x38000000u;
        r += 0xfffu + ((r >> 13) & 1u);
        return (uint16_t)(sign | (r >> 13));
    }
    if (a < 0x33000000u) return (uint16_t)sign; /* <= 2^-25 rounds to zero */
    uint32_t mant = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - (a >> 23); /* 14..24: the half subnormal is mant * 2^-shift */
    uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1u), halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (q & 1u))) q++;
    return (uint16_t)(sign | q);
}

/* dst[i] = half(x[i]) */
static inline void basert_store_f16(const float *x, uint16_t *dst, ptrdiff_t n) {
    ptrdiff_t i = 0;
#if defined(BASERT_SIMD)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) dst[i] = basert_f32_to_f16(x[i]);
}

/* ---- KV types: how one kv head's row of d values is stored in the cache ----
 *
 * BASERT_KV_F32: d floats. BASERT_KV_F16: d IEEE halves (round to nearest even). BASERT_KV_BF16: d bfloat16, the
 * high half of the float rounded to nearest even. BASERT_KV_Q8_0: per block of 32 values (d a multiple of 32), a
 * half scale s = half(amax / 127) and 32 signed codes c = rint(x * (1 / s)) within +-127 (0 where s is 0),
 * llama.cpp's q8_0 layout (2 + 32 bytes per block), read back as s * c. Reading is exact in every type (a half or
 * bfloat16 widens exactly; s * c has at most 18 significant bits), so attention over a row reads the same floats
 * whoever stores or reads it, and a row's stored bytes depend on that row alone: quantization never reaches across
 * positions, so the same bits come out whatever the batch, split, thread count or CPU variant.
 *
 * BASERT_KV_Q8_0_H, how q8_0 rows are kept (BASERT_KV_Q8_0 reads such rows as stored, turning nothing back): each
 * block of 32 is turned by the Walsh-Hadamard transform H (entries +-1, basert_hadamard32) before it is quantized,
 * which spreads a few large values over the block and so shrinks the rounding of the others (llama.cpp rotates its
 * quantized KV alike). A query meets turned K rows as H q / 32 (exact scaling): (H q / 32) . (H k) = q . k, as
 * H H = 32 I; a segment's weighted sum of turned V rows is turned back, H acc / 32, before it is folded with the
 * others. */
enum { BASERT_KV_F32 = 0, BASERT_KV_F16 = 1, BASERT_KV_BF16 = 2, BASERT_KV_Q8_0 = 3, BASERT_KV_Q8_0_H = 4 };
#define BASERT_KV_Q8_VALUES 32
#define BASERT_KV_Q8_BYTES 34

/* Head dims the attention reads through a row buffer on the stack at most (every model's head dim is below). */
#define BASERT_KV_MAX_DIM 512

static inline ptrdiff_t basert_kv_row_bytes(int type, ptrdiff_t d) {
    switch (type) {
    case BASERT_KV_F32: return 4 * d;
    case BASERT_KV_Q8_0:
    case BASERT_KV_Q8_0_H: return d / BASERT_KV_Q8_VALUES * BASERT_KV_Q8_BYTES;
    default: return 2 * d;
    }
}

/* float -> bfloat16, round to nearest even (a NaN stays a quiet NaN). */
static inline uint16_t basert_f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

static inline float basert_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

/* One block of 32 values as q8_0: 2 bytes of half scale, then 32 codes. */
static inline void basert_store_q8_block(const float *x, uint8_t *dst) {
    float amax = 0.0f;
    for (int j = 0; j < BASERT_KV_Q8_VALUES; j++) {
        const float a = fabsf(x[j]);
        if (a > amax) amax = a;
    }
    const uint16_t h = basert_f32_to_f16(amax / 127.0f);
    const float scale = basert_f16_to_f32(h), inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    memcpy(dst, &h, sizeof h);
    for (int j = 0; j < BASERT_KV_Q8_VALUES; j++) {
        float c = rintf(x[j] * inv);
        c = c > 127.0f ? 127.0f : c < -127.0f ? -127.0f : c;
        dst[2 + j] = (uint8_t)(int8_t)c;
    }
}

/* x[0..32) = H x, the Walsh-Hadamard transform of a block (unnormalized: entries +-1), in a fixed order of float
 * additions. */
static inline void basert_hadamard32(float *x) {
    for (int h = 1; h < 32; h *= 2)
        for (int i = 0; i < 32; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
}

/* dst = each block of 32 of x turned by H and scaled by `scale` (a power of two: exact). */
static inline void basert_hadamard_row(const float *x, float *dst, ptrdiff_t d, float scale) {
    for (ptrdiff_t b = 0; b < d; b += 32) {
        memcpy(dst + b, x + b, 32 * sizeof(float));
        basert_hadamard32(dst + b);
        for (int j = 0; j < 32; j++) dst[b + j] *= scale;
    }
}

/* The row x[0..d) stored as `type` at dst. */
static inline void basert_kv_store(int type, const float *x, void *dst, ptrdiff_t d) {
    switch (type) {
    case BASERT_KV_F32: memcpy(dst, x, (size_t)d * sizeof(float)); return;
    case BASERT_KV_F16: basert_store_f16(x, (uint16_t *)dst, d); return;
    case BASERT_KV_BF16:
        for (ptrdiff_t i = 0; i < d; i++) ((uint16_t *)dst)[i] = basert_f32_to_bf16(x[i]);
        return;
    default:
        for (ptrdiff_t b = 0; b < d / BASERT_KV_Q8_VALUES; b++) {
            float turned[BASERT_KV_Q8_VALUES];
            const float *block = x + b * BASERT_KV_Q8_VALUES;
            if (type == BASERT_KV_Q8_0_H) {
                basert_hadamard_row(block, turned, BASERT_KV_Q8_VALUES, 1.0f);
                block = turned;
            }
            basert_store_q8_block(block, (uint8_t *)dst + b * BASERT_KV_Q8_BYTES);
        }
    }
}

/* Value i of a row stored as `type`, exactly. */
static inline float basert_kv_value(int type, const void *src, ptrdiff_t i) {
    switch (type) {
    case BASERT_KV_F32: return ((const float *)src)[i];
    case BASERT_KV_F16: return basert_f16_to_f32(((const uint16_t *)src)[i]);
    case BASERT_KV_BF16: return basert_bf16_to_f32(((const uint16_t *)src)[i]);
    default: {
        const uint8_t *blk = (const uint8_t *)src + i / BASERT_KV_Q8_VALUES * BASERT_KV_Q8_BYTES;
        uint16_t h;
        memcpy(&h, blk, sizeof h);
        return basert_f16_to_f32(h) * (float)(int8_t)blk[2 + i % BASERT_KV_Q8_VALUES];
    }
    }
}

#if defined(BASERT_SIMD)
/* Values e .. e + 7 of a row stored as `type` (e a multiple of 8), exactly. */
BASERT_ALWAYS_INLINE __m256 basert_kv_load8(int type, const void *src, ptrdiff_t e) {
    switch (type) {
    case BASERT_KV_F32: return _mm256_loadu_ps((const float *)src + e);
    case BASERT_KV_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + e)));
    case BASERT_KV_BF16:
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + e))), 16));
    default: {
        const uint8_t *blk = (const uint8_t *)src + e / BASERT_KV_Q8_VALUES * BASERT_KV_Q8_BYTES;
        uint16_t h;
        memcpy(&h, blk, sizeof h);
        const __m256 codes = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64((const __m128i *)(const void *)(blk + 2 + e % BASERT_KV_Q8_VALUES))));
        return _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(h)), codes);
    }
    }
}
#endif

/* dst[0..d) = the row stored as `type` at src, exactly. */
static inline void basert_kv_load(int type, const void *src, float *dst, ptrdiff_t d) {
    ptrdiff_t i = 0;
#if defined(BASERT_SIMD)
    for (; i + 8 <= d; i += 8) _mm256_storeu_ps(dst + i, basert_kv_load8(type, src, i));
#endif
    for (; i < d; i++) dst[i] = basert_kv_value(type, src, i);
}

/* scores[i] = exp(scores[i] - shift); returns their sum (8 partial sums, fixed order). */
static inline float basert_exp_shifted_sum(float *scores, float shift, ptrdiff_t n) {
    ptrdiff_t i = 0;
    float total;
#if defined(BASERT_SIMD)
    __m256 acc = _mm256_setzero_ps(), vs = _mm256_set1_ps(shift);
    for (; i + 8 <= n; i += 8) {
        __m256 e = basert_exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + i), vs));
        _mm256_storeu_ps(scores + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    total = basert_hsum8(acc);
#else
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) {
            scores[i + j] = basert_expf(scores[i + j] - shift);
            acc[j] += scores[i + j];
        }
    total = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
#endif
    for (; i < n; i++) {
        scores[i] = basert_expf(scores[i] - shift);
        total += scores[i];
    }
    return total;
}

/* Row index of position p for one kv head, whose rows in block 0 start at row 0 (block_rows rows per cache block). */
static inline ptrdiff_t basert_kv_row(const int32_t *block_table, ptrdiff_t block_rows, ptrdiff_t p) {
    return (ptrdiff_t)block_table[p / BASERT_KV_BLOCK] * block_rows + p % BASERT_KV_BLOCK;
}

/* Position p's row for one kv head whose rows of type `type` start at `base`. */
static inline const void *basert_kv_at(const void *base, int type, const int32_t *block_table, ptrdiff_t block_rows,
                                       ptrdiff_t p, ptrdiff_t d) {
    return (const char *)base + basert_kv_row(block_table, block_rows, p) * basert_kv_row_bytes(type, d);
}

/* Up to this many query rows that share a kv head are attended together, so each K and V row is
 * read from memory once for all of them (long prompts would otherwise stream the cache per row). */
#define BASERT_ATTN_MAX_ROWS 16

/* Floats of K or V rows converted once and reused by every row of a group (16 KiB, L1-resident):
 * 8 K rows for 8 dot products at a time, and up to this many floats of V rows per pass of the
 * weighted sum, during which each query row keeps its output in registers. */
#define BASERT_ATTN_BUF_FLOATS 4096

#if defined(BASERT_SIMD)
/* Lane i = basert_hsum8(v[i]): the same additions in the same order, for 8 vectors at once. */
BASERT_ALWAYS_INLINE __m256 basert_hsum8x8(const __m256 *v) {
    __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(v[0], v[1], 0x20), _mm256_permute2f128_ps(v[0], v[1], 0x31));
    __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(v[2], v[3], 0x20), _mm256_permute2f128_ps(v[2], v[3], 0x31));
    __m256 ef = _mm256_add_ps(_mm256_permute2f128_ps(v[4], v[5], 0x20), _mm256_permute2f128_ps(v[4], v[5], 0x31));
    __m256 gh = _mm256_add_ps(_mm256_permute2f128_ps(v[6], v[7], 0x20), _mm256_permute2f128_ps(v[6], v[7], 0x31));
    __m256 t = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));
    __m256 u = _mm256_add_ps(_mm256_shuffle_ps(ef, gh, 0x44), _mm256_shuffle_ps(ef, gh, 0xEE));
    __m256 h = _mm256_hadd_ps(t, u); /* lanes: v0 v2 v4 v6 v1 v3 v5 v7 */
    return _mm256_permutevar8x32_ps(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Scores of one query row against the 8 float rows of k, interleaved as basert_gather8 writes them (d a multiple of
 * 8): each is basert_dot of q and that row (the exact floats its cache row reads as), times scale. */
BASERT_ALWAYS_INLINE __m256 basert_scores8(const float *q, const float *k, ptrdiff_t d, float scale) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (ptrdiff_t e = 0; e < d; e += 8, k += 64) {
        __m256 qv = _mm256_loadu_ps(q + e);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 8 * j), acc[j]);
    }
    return _mm256_mul_ps(basert_hsum8x8(acc), _mm256_set1_ps(scale));
}

/* Positions ahead of the one being gathered whose cache row is fetched meanwhile: the rows of a kv head are contiguous
 * only within a cache block, so the hardware prefetcher loses the stream at every block boundary. */
#define BASERT_ATTN_PREFETCH 16

/* Prefetches position p's row (all its cache lines) when p is before `limit`. */
BASERT_ALWAYS_INLINE void basert_kv_prefetch(const void *src, int type, const int32_t *block_table, ptrdiff_t block_rows,
                                             ptrdiff_t d, ptrdiff_t p, ptrdiff_t limit) {
    if (p >= limit) return;
    const char *ahead = (const char *)basert_kv_at(src, type, block_table, block_rows, p, d);
    const ptrdiff_t row_bytes = basert_kv_row_bytes(type, d);
    for (ptrdiff_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(ahead + b);
    __builtin_prefetch(ahead + row_bytes - 1);
}

/* A row stored as `type` (d a multiple of 8) as floats, exactly, 8 at a time: values 8g .. 8g + 7 at out + g * stride.
 * q8_0 a block at a time: its scale converted once for its 32 codes. */
BASERT_ALWAYS_INLINE void basert_kv_load_groups(int type, const void *row, ptrdiff_t d, float *out, ptrdiff_t stride) {
    if (type == BASERT_KV_Q8_0 || type == BASERT_KV_Q8_0_H) {
        const uint8_t *blk = (const uint8_t *)row;
        for (ptrdiff_t e = 0; e < d; e += BASERT_KV_Q8_VALUES, blk += BASERT_KV_Q8_BYTES, out += 4 * stride) {
            uint16_t h;
            memcpy(&h, blk, sizeof h);
#if defined(BASERT_AVX512)
            /* 16 codes per vector: half the conversions. */
            const __m512 scale = _mm512_set1_ps(_cvtsh_ss(h));
            for (int g = 0; g < 4; g += 2) {
                const __m512 v = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                          _mm_loadu_si128((const __m128i *)(const void *)(blk + 2 + 8 * g)))));
                _mm256_storeu_ps(out + g * stride, _mm512_castps512_ps256(v));
                _mm256_storeu_ps(out + (g + 1) * stride, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
            }
#else
            const __m256 scale = _mm256_set1_ps(_cvtsh_ss(h));
            const __m256i codes = _mm256_loadu_si256((const __m256i *)(const void *)(blk + 2));
            const __m128i halves[2] = {_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1)};
            for (int g = 0; g < 4; g++) {
                const __m128i eight = (g & 1) ? _mm_srli_si128(halves[g >> 1], 8) : halves[g >> 1];
                _mm256_storeu_ps(out + g * stride, _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight))));
            }
#endif
        }
        return;
    }
    for (ptrdiff_t e = 0; e < d; e += 8, out += stride) _mm256_storeu_ps(out, basert_kv_load8(type, row, e));
}

/* Float copies of the cache rows of positions p0 .. p1 (exact), d apart; rows up to BASERT_ATTN_PREFETCH positions
 * further, before `limit`, are prefetched. */
static inline void basert_gather_rows(const void *src, int type, const int32_t *block_table, ptrdiff_t block_rows,
                                      ptrdiff_t d, ptrdiff_t p0, ptrdiff_t p1, ptrdiff_t limit, float *dst) {
    for (ptrdiff_t p = p0; p < p1; p++, dst += d) {
        basert_kv_prefetch(src, type, block_table, block_rows, d, p + BASERT_ATTN_PREFETCH, limit);
        const void *row = basert_kv_at(src, type, block_table, block_rows, p, d);
        if (d & 7) basert_kv_load(type, row, dst, d);
        else basert_kv_load_groups(type, row, d, dst, 8);
    }
}

/* Float copies of the cache rows of positions p .. p + 8 (in one block), interleaved by groups of 8 columns: columns
 * 8g .. 8g + 7 of row j at dst[64g + 8j], so that basert_scores8 reads the eight rows' groups from one pointer. Rows
 * BASERT_ATTN_PREFETCH positions on, before `limit`, are prefetched. */
static inline void basert_gather8(const void *src, int type, const int32_t *block_table, ptrdiff_t block_rows,
                                  ptrdiff_t d, ptrdiff_t p, ptrdiff_t limit, float *dst) {
    for (int j = 0; j < 8; j++) {
        basert_kv_prefetch(src, type, block_table, block_rows, d, p + j + BASERT_ATTN_PREFETCH, limit);
        basert_kv_load_groups(type, basert_kv_at(src, type, block_table, block_rows, p + j, d), d, dst + 8 * j, 64);
    }
}

/* out[0 .. 8 * NV) += weights[i] * rows[i * d ..] for i < n, in order, accumulating in registers:
 * every element gets the same fmaf sequence as basert_axpy(_f16) applied position by position. */
BASERT_ALWAYS_INLINE void basert_weighted_rows(const int NV, const float *weights, ptrdiff_t n, const float *rows, ptrdiff_t d,
                                             float *out) {
    __m256 acc[8];
    for (int j = 0; j < NV; j++) acc[j] = _mm256_loadu_ps(out + 8 * j);
    for (ptrdiff_t i = 0; i < n; i++) {
        const __m256 w = _mm256_set1_ps(weights[i]);
        for (int j = 0; j < NV; j++) acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(rows + i * d + 8 * j), acc[j]);
    }
    for (int j = 0; j < NV; j++) _mm256_storeu_ps(out + 8 * j, acc[j]);
}

/* basert_weighted_rows over all d columns (the d % 8 tail with scalar fmaf, in the same order). */
static void basert_weighted_rows_all(const float *weights, ptrdiff_t n, const float *rows, ptrdiff_t d, float *out) {
    ptrdiff_t c = 0;
    for (; c + 64 <= d; c += 64) basert_weighted_rows(8, weights, n, rows + c, d, out + c);
    switch ((d - c) / 8) {
    case 7: basert_weighted_rows(7, weights, n, rows + c, d, out + c); break;
    case 6: basert_weighted_rows(6, weights, n, rows + c, d, out + c); break;
    case 5: basert_weighted_rows(5, weights, n, rows + c, d, out + c); break;
    case 4: basert_weighted_rows(4, weights, n, rows + c, d, out + c); break;
    case 3: basert_weighted_rows(3, weights, n, rows + c, d, out + c); break;
    case 2: basert_weighted_rows(2, weights, n, rows + c, d, out + c); break;
    case 1: basert_weighted_rows(1, weights, n, rows + c, d, out + c); break;
    default: break;
    }
    for (ptrdiff_t e = d & ~(ptrdiff_t)7; e < d; e++)
        for (ptrdiff_t i = 0; i < n; i++) out[e] = fmaf(weights[i], rows[i * d + e], out[e]);
}
#endif

/* Partial of one segment: for each row r that takes part (n_pos[r] > p0 and its window's first position
 * f_r < p1), over its positions p0 .. e_r - 1 (e_r = min(p1, n_pos[r])): top[r] = max of s_p = scale * q[r].k_p,
 * sum[r] = sum of exp(s_p - top[r]) and acc[r][0..d) = sum of exp(s_p - top[r]) * v_p, each in position
 * order (see the top of this file), where s_p = -inf for p < f_r. Other rows are left untouched. p0 is
 * a multiple of BASERT_ATTN_SEGMENT; scores holds n_rows * BASERT_ATTN_SEGMENT floats; p1 - p0 <=
 * BASERT_ATTN_SEGMENT. */
static void basert_attend_segment(int n_rows, const float *const *q, const ptrdiff_t *n_pos, ptrdiff_t window,
                                  ptrdiff_t p0, ptrdiff_t p1, const void *k, const void *v, int k_type, int v_type,
                                  const int32_t *block_table, ptrdiff_t block_rows, ptrdiff_t d, float scale,
                                  float *scores, float *top, float *sum, float *const *acc) {
    if (k_type == BASERT_KV_Q8_0_H) {
        /* Turned K rows: the queries meet them turned too (H q / 32), up to BASERT_ATTN_MAX_ROWS rows at a time (a
         * row's result never depends on the rows beside it). */
        float turned[BASERT_ATTN_MAX_ROWS * BASERT_KV_MAX_DIM];
        const float *rows[BASERT_ATTN_MAX_ROWS];
        for (int r0 = 0; r0 < n_rows; r0 += BASERT_ATTN_MAX_ROWS) {
            const int n = n_rows - r0 < BASERT_ATTN_MAX_ROWS ? n_rows - r0 : BASERT_ATTN_MAX_ROWS;
            for (int r = 0; r < n; r++) {
                basert_hadamard_row(q[r0 + r], turned + r * d, d, 1.0f / 32.0f);
                rows[r] = turned + r * d;
            }
            basert_attend_segment(n, rows, n_pos + r0, window, p0, p1, k, v, BASERT_KV_Q8_0, v_type, block_table,
                                  block_rows, d, scale, scores, top + r0, sum + r0, acc + r0);
        }
        return;
    }
    const ptrdiff_t S = BASERT_ATTN_SEGMENT;
    ptrdiff_t end = p0; /* the furthest position any row needs in this segment */
    ptrdiff_t start = p1; /* the first position any row attends to in this segment */
    for (int r = 0; r < n_rows; r++) {
        if (!basert_attn_takes_part(n_pos[r], window, p0)) continue;
        top[r] = -INFINITY;
        const ptrdiff_t e = n_pos[r] < p1 ? n_pos[r] : p1, f = basert_attn_first(n_pos[r], window);
        if (e > end) end = e;
        if (f < start) start = f;
    }
    /* Scores of positions before a row's window (only in the segment holding its first position). */
    for (int r = 0; r < n_rows; r++)
        if (basert_attn_takes_part(n_pos[r], window, p0))
            for (ptrdiff_t p = p0; p < basert_attn_first(n_pos[r], window); p++) scores[r * S + (p - p0)] = -INFINITY;
    /* Whole groups of 8 positions before every row's window are not read (their weights would be +0, which
     * leaves every sum as it is). */
    const ptrdiff_t read_from = start > p0 ? p0 + ((start - p0) & ~(ptrdiff_t)7) : p0;
    ptrdiff_t p = read_from;
#if defined(BASERT_SIMD)
    float buf[BASERT_ATTN_BUF_FLOATS];
    const int fast = (d & 7) == 0 && 8 * d <= BASERT_ATTN_BUF_FLOATS;
#endif
    float row[BASERT_KV_MAX_DIM]; /* one position's K or V row, off the fast paths */
    while (p < end) {
#if defined(BASERT_SIMD)
        /* Positions p .. p + 7 lie in one block (8 divides the block size and p is a multiple of 8). */
        if (fast && (p & 7) == 0 && p + 8 <= end) {
            basert_gather8(k, k_type, block_table, block_rows, d, p, end, buf);
            for (int r = 0; r < n_rows; r++) {
                if (p >= n_pos[r] || !basert_attn_takes_part(n_pos[r], window, p0)) continue;
                const ptrdiff_t f = basert_attn_first(n_pos[r], window);
                if (p + 8 <= f) continue; /* scores already -inf */
                float *s = scores + r * S + (p - p0), t = top[r]; /* a local max stays in a register */
                if (p + 8 <= n_pos[r] && p >= f) {
                    /* The common case, all eight in the window: the max of eight is the same whatever its order. */
                    const __m256 x8 = basert_scores8(q[r], buf, d, scale);
                    _mm256_storeu_ps(s, x8);
                    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x8), _mm256_extractf128_ps(x8, 1));
                    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
                    m = _mm_max_ss(m, _mm_movehdup_ps(m));
                    const float x = _mm_cvtss_f32(m);
                    if (x > t) t = x;
                } else {
                    /* Positions before the window, or from the row's end on (scored, not kept), in the group. */
                    const __m256 x8 = basert_scores8(q[r], buf, d, scale);
                    float x[8];
                    _mm256_storeu_ps(x, x8);
                    for (ptrdiff_t j = 0; j < 8 && p + j < n_pos[r]; j++) {
                        if (p + j < f) x[j] = -INFINITY;
                        s[j] = x[j];
                        if (x[j] > t) t = x[j];
                    }
                }
                top[r] = t;
            }
            p += 8;
            continue;
        }
#endif
        basert_kv_load(k_type, basert_kv_at(k, k_type, block_table, block_rows, p, d), row, d);
        for (int r = 0; r < n_rows; r++) {
            if (p >= n_pos[r] || !basert_attn_takes_part(n_pos[r], window, p0) || p < basert_attn_first(n_pos[r], window))
                continue;
            const float s = basert_dot(q[r], row, d) * scale;
            scores[r * S + (p - p0)] = s;
            if (s > top[r]) top[r] = s;
        }
        p++;
    }
    for (int r = 0; r < n_rows; r++) {
        if (!basert_attn_takes_part(n_pos[r], window, p0)) continue;
        sum[r] = basert_exp_shifted_sum(scores + r * S, top[r], (n_pos[r] < p1 ? n_pos[r] : p1) - p0);
        memset(acc[r], 0, (size_t)d * sizeof(float));
    }
#if defined(BASERT_SIMD)
    if (d <= BASERT_ATTN_BUF_FLOATS) {
        const ptrdiff_t chunk = BASERT_ATTN_BUF_FLOATS / d;
        for (ptrdiff_t c0 = read_from; c0 < end; c0 += chunk) {
            const ptrdiff_t c1 = c0 + chunk < end ? c0 + chunk : end;
            basert_gather_rows(v, v_type, block_table, block_rows, d, c0, c1, end, buf);
            for (int r = 0; r < n_rows; r++)
                if (c0 < n_pos[r] && basert_attn_takes_part(n_pos[r], window, p0))
                    basert_weighted_rows_all(scores + r * S + (c0 - p0), (c1 < n_pos[r] ? c1 : n_pos[r]) - c0, buf, d,
                                             acc[r]);
        }
    } else
#endif
    {
        for (ptrdiff_t p = read_from; p < end; p++) {
            basert_kv_load(v_type, basert_kv_at(v, v_type, block_table, block_rows, p, d), row, d);
            for (int r = 0; r < n_rows; r++)
                if (p < n_pos[r] && basert_attn_takes_part(n_pos[r], window, p0))
                    basert_axpy(scores[r * S + (p - p0)], row, acc[r], d);
        }
    }
    /* Turned V rows: the segment's weighted sum turned back (H acc / 32), so that partials fold as plain ones. */
    if (v_type == BASERT_KV_Q8_0_H)
        for (int r = 0; r < n_rows; r++)
            if (basert_attn_takes_part(n_pos[r], window, p0)) {
                basert_hadamard_row(acc[r], row, d, 1.0f / 32.0f);
                memcpy(acc[r], row, (size_t)d * sizeof(float));
            }
}

/* Folds the partial (top_j, sum_j, acc_j) of the next segment into a row's running state (*top, *sum,
 * acc[0..d)), which holds the fold of all earlier segments (segment 0's partial as it is):
 *   m = max(*top, top_j), a = exp(*top - m), b = exp(top_j - m),
 *   *sum = fmaf(sum_j, b, *sum * a), acc[e] = fmaf(acc_j[e], b, acc[e] * a), *top = m. */
static inline void basert_attend_fold(float *top, float *sum, float *acc, float top_j, float sum_j, const float *acc_j,
                                      ptrdiff_t d) {
    const float m = top_j > *top ? top_j : *top;
    const float a = basert_expf(*top - m), b = basert_expf(top_j - m);
    ptrdiff_t e = 0;
#if defined(BASERT_SIMD)
    const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
    for (; e + 8 <= d; e += 8)
        _mm256_storeu_ps(acc + e, _mm256_fmadd_ps(_mm256_loadu_ps(acc_j + e), vb, _mm256_mul_ps(_mm256_loadu_ps(acc + e), va)));
#endif
    for (; e < d; e++) acc[e] = fmaf(acc_j[e], b, acc[e] * a);
    *sum = fmaf(sum_j, b, *sum * a);
    *top = m;
}

/* One row's output from the partials of its n_segments segments, in segment order: segment j's
 * partial is top[j], sum[j] and acc[j * acc_stride .. + d). out = fold of them all * (1 / its sum);
 * with one segment, out = acc[0] * (1 / sum[0]). out must not overlap the partials. */
static inline void basert_attend_merge(int n_segments, const float *top, const float *sum, const float *acc,
                                       ptrdiff_t acc_stride, ptrdiff_t d, float *out) {
    float m = top[0], l = sum[0];
    memcpy(out, acc, (size_t)d * sizeof(float));
    for (int j = 1; j < n_segments; j++) basert_attend_fold(&m, &l, out, top[j], sum[j], acc + j * acc_stride, d);
    basert_scale(1.0f / l, out, d);
}

/* Floats of scratch basert_attend_rows needs for n_rows rows of head dim d. */
#define BASERT_ATTN_ROWS_SCRATCH(n_rows, d) ((ptrdiff_t)(n_rows) * (BASERT_ATTN_SEGMENT + (d)))

/* out[r][0..d) = softmax(scale * q[r].k_p for basert_attn_first(n_pos[r], window) <= p < n_pos[r]) . v_p for
 * n_rows <= BASERT_ATTN_MAX_ROWS query rows of one kv head, on the calling thread: segment after segment, each
 * folded into out[r] as it completes (a row's first segment taken as it is), which is basert_attend_merge of
 * the same partials, bit for bit. scratch holds BASERT_ATTN_ROWS_SCRATCH(n_rows, d) floats. */
static inline void basert_attend_rows(int n_rows, const float *const *q, const ptrdiff_t *n_pos, ptrdiff_t window,
                                      const void *k, const void *v, int k_type, int v_type, const int32_t *block_table,
                                      ptrdiff_t block_rows, ptrdiff_t d, float scale, float *scratch, float *const *out) {
    float top[BASERT_ATTN_MAX_ROWS], sum[BASERT_ATTN_MAX_ROWS], top_j[BASERT_ATTN_MAX_ROWS], sum_j[BASERT_ATTN_MAX_ROWS];
    float *acc_j[BASERT_ATTN_MAX_ROWS];
    float *scores = scratch, *parts = scratch + (ptrdiff_t)n_rows * BASERT_ATTN_SEGMENT;
    ptrdiff_t n_max = 0, first = -1;
    for (int r = 0; r < n_rows; r++) {
        acc_j[r] = parts + r * d;
        if (n_pos[r] > n_max) n_max = n_pos[r];
        if (n_pos[r] > 0) {
            const ptrdiff_t f = basert_attn_first(n_pos[r], window);
            if (first < 0 || f < first) first = f;
        }
    }
    if (n_max == 0) return;
    for (ptrdiff_t p0 = first - first % BASERT_ATTN_SEGMENT; p0 < n_max; p0 += BASERT_ATTN_SEGMENT) {
        const ptrdiff_t p1 = p0 + BASERT_ATTN_SEGMENT < n_max ? p0 + BASERT_ATTN_SEGMENT : n_max;
        basert_attend_segment(n_rows, q, n_pos, window, p0, p1, k, v, k_type, v_type, block_table, block_rows, d, scale,
                              scores, top_j, sum_j, acc_j);
        for (int r = 0; r < n_rows; r++) {
            if (!basert_attn_takes_part(n_pos[r], window, p0)) continue;
            if (basert_attn_first(n_pos[r], window) >= p0) { /* the row's first segment */
                top[r] = top_j[r];
                sum[r] = sum_j[r];
                memcpy(out[r], acc_j[r], (size_t)d * sizeof(float));
            } else {
                basert_attend_fold(&top[r], &sum[r], out[r], top_j[r], sum_j[r], acc_j[r], d);
            }
        }
    }
    for (int r = 0; r < n_rows; r++)
        if (n_pos[r] > 0) basert_scale(1.0f / sum[r], out[r], d);
}

#endif
