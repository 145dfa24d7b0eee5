/* Matmul kernels over .base weights: out[M, N] = x[M, K] @ W^T, with W dense (f32/f16/bf16) or
 * group-quantized (base_q4/base_q8), de-quantized in registers (small M, streaming the packed
 * bytes) or into a small per-thread tile reused by every activation row (larger M).
 *
 * The summation contract (16 lanes): every out[m, n] is computed by one 16-lane accumulator walking K
 * in steps of 16 (acc = fma(x, w, acc): lane j sums the k = j mod 16 terms in K order), then a
 * fixed-order horizontal sum (lane i + lane i+8 for i = 0..7, then simd.h's 8-lane tree
 * ((0+4)+(2+6))+((1+5)+(3+7))), then the K % 16 tail in order with scalar FMAs. The streaming and
 * tiled kernels, every block shape and every thread split perform exactly this sequence on exactly
 * the reference de-quantized weights, so a row's result never depends on the batch; and every CPU
 * variant performs it too (portable: a 16-float struct with fmaf; avx2: a pair of __m256, lanes 0-7
 * and 8-15; avx512: one __m512), so a row's result is the same bits on every CPU.
 *
 * This header declares the kernels; they are compiled once per CPU variant in kernels/matmul_*.c (one unit per
 * weight family, so that the units compile side by side) and linked into every module that calls them. */
#ifndef BASERT_MATMUL_H
#define BASERT_MATMUL_H

#include <stdint.h>
#include <string.h>

#include "blocks.h"
#include "simd.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* BASERT_BLOCKS: GGUF quantized blocks kept as they are (blocks.h), de-quantized a block at a time (streaming)
 * or a row at a time (into the tiles). */
enum { BASERT_F32 = 0, BASERT_F16 = 1, BASERT_BF16 = 2, BASERT_Q4 = 3, BASERT_Q8 = 4, BASERT_BLOCKS = 5 };

/* One [n, k] weight matrix as raw pointers into arrays the Python Weight keeps alive. */
typedef struct {
    int kind;
    int bf16_scales;           /* scales/biases are bf16 bits (else f16) */
    int ggml_type;             /* BASERT_BLOCKS: the GGUF type of the blocks */
    ptrdiff_t n, k, group_size; /* group_size 0 for dense kinds, the values per block for BASERT_BLOCKS */
    ptrdiff_t row_bytes;       /* bytes of packed values per row */
    const uint8_t *data;
    const uint16_t *scales;    /* k / group_size per row; NULL for dense */
    const uint16_t *biases;    /* NULL: symmetric codes (u - 2^(bits-1)) * scale */
    int integer;               /* meets quantized activations in integer dot products (basert_qmatmul); else the float path */
    int act_max;               /* with integer: the largest activation code, BASERT_ACT8 or BASERT_ACT16 */
    int packed;                /* rows stored eight at a time interleaved (basert_packs: the layout below) */
} basert_weight;

/* The largest code of 8-bit and of 16-bit activations (matmul.h's records hold either). */
enum { BASERT_ACT8 = 127, BASERT_ACT16 = 16383 };

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

/* Batches of up to this many activation rows stream (decoding lanes together); larger ones go
 * through de-quantized tiles. Streaming de-quantizes each weight once per 4 activation rows. */
#define BASERT_STREAM_MAX_M 16

/* dst[0..k) = row `row` of w as float32, exactly the reference de-quantization. */
void basert_dequant_row(const basert_weight *w, ptrdiff_t row, float *dst);

/* Columns r0..r1 of out[m, ldy] = x[m, ldx] @ W^T, m <= BASERT_STREAM_MAX_M, weights read once. */
void basert_stream(const basert_weight *w, const float *x, ptrdiff_t ldx, ptrdiff_t m, ptrdiff_t r0, ptrdiff_t r1,
                   float *y, ptrdiff_t ldy);

/* ---- quantized activations and integer dot products: the default path of quantized weights ----
 *
 * An activation row is quantized once per block of 32 values (basert_quantize_rows) to codes of at most Q = 127
 * (8-bit activations, as llama.cpp's) or Q = 16383 (16-bit ones), the act_max of the weights that read it:
 * d = amax / Q with amax the largest |x| of the block, q = rint(clamp(x * (1 / d), -Q, Q)) (nearest, ties to even;
 * 1 / d taken as 0 when d = 0), and the sum S of the block's 32 codes kept beside them. Every weight block of 32
 * values is read as A * w + B with integer w: base_q4 / base_q8 in groups of 32, 64 or 128: A the group's scale, w
 * the code u (u - 2^(bits-1) when symmetric), B its bias; Q4_K / Q5_K: A = d * scale and B = -(dmin * min) of the
 * sub-block, w = u; Q6_K: A = d, w = scale * (u - 32) with the scale of each 16 values; Q3_K: A = d, w = scale * (u -
 * 4) with u the three-bit code (the two low bits, the hmask bit as 4) and the signed six-bit scale of each 16 values;
 * Q5_0: A = d, w = u - 16; Q5_1: A = d, w = u, B = m. It meets an activation row block by block:
 *
 *     I = sum over the block of w * q                  an exact integer, however it is computed
 *     t = (A * d) * float(I)                           without B
 *     t = (A * d) * float(I) + (B * d) * float(S)      with B
 *     out = ((t_0 + t_1) + t_2) + ...                  in block order
 *
 * each product and sum a float32 operation of its own (no FMA). Blocks of 32 for the K-quants too, where llama.cpp
 * quantizes their activations once per 256 (Q8_K): that arithmetic was measured a few percent faster and several
 * times less accurate, worse than llama.cpp's on Gemma 3 (the README gives the numbers). 16383 is the largest code
 * for which every block sum fits in 32 bits (|w| <= 4096 for Q6_K: 32 * 4096 * 16383 < 2^31). Which weights take
 * 16 bits is the model's choice (basert/models/layers.py: the LM head), measured against the exact path and llama.cpp
 * with tools/check_agreement.py. The integer sums are exact whichever instructions, lanes or order compute them, and
 * the float operations are the same everywhere, so an output is the same bits on every CPU variant, whatever the batch,
 * the rows computed with it or the thread count, and a numpy reference reproduces it exactly. Rows of quantized
 * activations are records of basert_qrow_bytes(k) bytes: k codes (int16 whatever Q; in each block of 32 the 16
 * even-numbered values first, then the 16 odd-numbered ones, the order in which the kernels split a block's weights
 * into 16-bit lanes), k / 32 scales (float32), k / 32 sums (float32: integers of at most 32 * 16383 in magnitude,
 * exact, so that float(S) is read rather than converted), a multiple of 64 bytes. */

static inline ptrdiff_t basert_qrow_bytes(ptrdiff_t k) { return (2 * k + k / 8 + k / 8 + 63) & ~(ptrdiff_t)63; }

/* Whether the weight can take the integer path: base_q4 / base_q8 with groups of a multiple of 32, and the GGUF
 * blocks Q3_K, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1. */
static inline int basert_integer_capable(const basert_weight *w) {
    if (w->kind == BASERT_BLOCKS)
        return w->ggml_type == BASERT_GGML_Q3_K || w->ggml_type == BASERT_GGML_Q4_K || w->ggml_type == BASERT_GGML_Q5_K ||
               w->ggml_type == BASERT_GGML_Q6_K ||
               w->ggml_type == BASERT_GGML_Q5_0 || w->ggml_type == BASERT_GGML_Q5_1;
    return (w->kind == BASERT_Q4 || w->kind == BASERT_Q8) && w->group_size % 32 == 0;
}

/* m rows x[i * ldx .. + k) (k a multiple of 32) quantized into records dst + i * basert_qrow_bytes(k), with codes of at
 * most qmax in magnitude (BASERT_ACT8 or BASERT_ACT16: the act_max of the weights that read them). */
void basert_quantize_rows(const float *x, ptrdiff_t ldx, ptrdiff_t m, ptrdiff_t k, int qmax, uint8_t *dst);

/* ---- packed rows: eight weight rows side by side, as the byte kernels read them ----
 *
 * A base_q4, Q4_K, Q5_K or Q6_K weight on the integer path of a SIMD variant is stored packed when the Weight is built
 * (its file's bytes copied once, basert_pack_rows): rows 8g .. 8g + 8 for g < n / 8 form group g, which takes the
 * bytes rows 8g .. 8g + 8 would take (from data + 8g * row_bytes) and holds their chunks c one after the other (8 *
 * bytes each; a chunk: a GGUF super-block, bytes = basert_block_bytes, or a base_q4 row's codes, bytes = row_bytes:
 * basert_packed_chunk). In a group's chunk, the 16 bytes at offset 16o (o < bytes / 16) of the eight rows take the
 * 128 bytes from 128o as four vectors of 32: vector u holds bytes 16o + 4u .. + 4 of row r at 32u + 4r. The bytes /
 * 16 * 16 .. bytes of each row (Q6_K's d) follow, row after row. The n % 8 last rows stay as stored. So one thread's
 * rows are one sequential stream, and the byte kernels read the transposed units of eight rows with four loads. The
 * portable variant's plain loops, and the exact path, read the file's layout. */

/* Whether a weight is stored packed: integer base_q4 (groups of up to 128 values), Q4_K, Q5_K or Q6_K with eight rows
 * at least, in the SIMD variants. */
static inline int basert_packs(const basert_weight *w) {
#if defined(BASERT_SIMD)
    const int k_quant = w->kind == BASERT_BLOCKS && (w->ggml_type == BASERT_GGML_Q4_K ||
                                                     w->ggml_type == BASERT_GGML_Q5_K || w->ggml_type == BASERT_GGML_Q6_K);
    return w->integer && w->n >= 8 && ((w->kind == BASERT_Q4 && w->group_size <= 128) || k_quant);
#else
    (void)w;
    return 0;
#endif
}

/* The bytes of a packed weight's chunk: a GGUF super-block's, or a base_q4 row's. */
static inline ptrdiff_t basert_packed_chunk(const basert_weight *w) {
    return w->kind == BASERT_BLOCKS ? basert_block_bytes(w->ggml_type) : w->row_bytes;
}

/* The largest GGUF super-block (Q6_K's 210 bytes). */
#define BASERT_MAX_BLOCK_BYTES 256

/* Where byte j of a row's chunk of `bytes` lies in its packed group's chunk, for row r (0..7) of the group. */
static inline ptrdiff_t basert_packed_at(ptrdiff_t bytes, int r, ptrdiff_t j) {
    const ptrdiff_t units = bytes / 16 * 16;
    if (j < units) return 8 * (j & ~(ptrdiff_t)15) + 32 * ((j >> 2) & 3) + 4 * r + (j & 3);
    return 8 * units + (bytes - units) * r + (j - units);
}

/* Bytes off .. off + len of weight row `row` as the file stores them: in place, or copied out of its packed group into
 * buf (len bytes). */
static inline const uint8_t *basert_weight_bytes(const basert_weight *w, ptrdiff_t row, ptrdiff_t off, ptrdiff_t len,
                                                 uint8_t *buf) {
    if (!w->packed || row >= w->n / 8 * 8) return w->data + row * w->row_bytes + off;
    const ptrdiff_t chunk = basert_packed_chunk(w);
    const uint8_t *group = w->data + (row & ~(ptrdiff_t)7) * w->row_bytes;
    const int r = (int)(row & 7);
    for (ptrdiff_t j = off; j < off + len; j++)
        buf[j - off] = group[8 * (j - j % chunk) + basert_packed_at(chunk, r, j % chunk)];
    return buf;
}

/* GGUF block (or super-block) sb of weight row `row` as the file stores it, buf holding BASERT_MAX_BLOCK_BYTES. */
static inline const uint8_t *basert_weight_block(const basert_weight *w, ptrdiff_t row, ptrdiff_t sb, uint8_t *buf) {
    const ptrdiff_t bytes = basert_block_bytes(w->ggml_type);
    return basert_weight_bytes(w, row, sb * bytes, bytes, buf);
}

/* One chunk of `bytes` of eight rows (q[r]: its first byte as the file stores it) into dst in the packed layout. */
static inline void basert_pack_chunk(const uint8_t *const *q, ptrdiff_t bytes, uint8_t *dst) {
    const ptrdiff_t units = bytes / 16 * 16;
    for (int r = 0; r < 8; r++) {
        for (ptrdiff_t j = 0; j < units; j += 4) memcpy(dst + basert_packed_at(bytes, r, j), q[r] + j, 4);
        memcpy(dst + basert_packed_at(bytes, r, units), q[r] + units, (size_t)(bytes - units));
    }
}

/* Rows r0 .. r1 of the weight (r0 a multiple of 8; r1 too, or n) from src, as the file stores them, into dst in the
 * packed layout: bytes r0 * row_bytes .. r1 * row_bytes of each. */
void basert_pack_rows(const basert_weight *w, const uint8_t *src, uint8_t *dst, ptrdiff_t r0, ptrdiff_t r1);

/* Columns r0..r1 of y[m, ldy] = x @ W^T for a weight with `integer` set, x given as m quantized rows (records of
 * basert_qrow_bytes(w->k) bytes from qx). A few rows (decode, a few sequences, verifications), and every batch in the
 * portable variant: weight rows eight at a time streamed against the activation rows; base_q4, Q4_K, Q5_K and Q6_K in
 * the SIMD variants as bytes, eight rows side by side (one row per 32-bit lane, no fold; read packed), up to eight
 * activation rows; the others, up to four, with a horizontal fold per block (on AVX-512, two blocks per 512-bit vector
 * for base_q8). More (SIMD variants): sixteen weight rows at a time unpacked into 16-bit pairs, one row per lane, 2,048
 * values at a time, and every activation row run against them four at a time (no fold; vpdpwssd on AVX512-VNNI CPUs);
 * the activation rows in blocks that stay in L2. All give the same bits. */
void basert_qmatmul(const basert_weight *w, const uint8_t *qx, ptrdiff_t m, ptrdiff_t r0, ptrdiff_t r1, float *y,
                    ptrdiff_t ldy);

/* Rows r0..r1 of y = x @ W^T by the weight's path: the integer one from qx when w->integer is set, else the float one
 * from x (m <= BASERT_STREAM_MAX_M). */
static inline void basert_matmul_rows(const basert_weight *w, const float *x, ptrdiff_t ldx, const uint8_t *qx, ptrdiff_t m,
                                      ptrdiff_t r0, ptrdiff_t r1, float *y, ptrdiff_t ldy) {
    if (w->integer) basert_qmatmul(w, qx, m, r0, r1, y, ldy);
    else basert_stream(w, x, ldx, m, r0, r1, y, ldy);
}

/* ---- larger M: de-quantize a tile of rows once, reuse it for every activation row ---- */

/* Microkernel shape: BM_TILE_R weight rows x BM_TILE_C activation rows of accumulators, sized to the
 * vector registers. avx512: 8 x 3 = 24 of 32 zmm, the 3 activation vectors held in registers and each
 * weight vector loaded once for its 3 FMAs (measured on SmolLM2's shapes against 4 x 4, 6 x 4, 4 x 6, 5 x 4,
 * 7 x 3 and 3 x 8: 10% faster at K = 576 and a third at K = 1536, where fewer activation re-reads matter
 * most). avx2: 4 x 3, 12 of 16 ymm (each accumulator a pair, computed in two passes). */
#if defined(BASERT_AVX512)
#define BM_TILE_R 8
#define BM_TILE_C 3
#else
#define BM_TILE_R 4
#define BM_TILE_C 3
#endif

/* Floats per row of a de-quantized tile or of the aligned copy of x: K rounded up to a cache line
 * so every row starts 64-byte aligned (split loads cost the microkernel about a fifth of its speed). */
static inline ptrdiff_t basert_tile_stride(ptrdiff_t k) { return (k + 15) & ~(ptrdiff_t)15; }

/* Floats of a de-quantized tile: L2-resident. avx512: 256 KiB, so that the activation rows, which do not
 * all fit in L2 at K = 1536 and 512 rows, are swept once per 40 weight rows instead of once per 8 (a third
 * faster there); 64 KiB elsewhere. */
#if defined(BASERT_AVX512)
#define BM_TILE_FLOATS 65536
#else
#define BM_TILE_FLOATS 16384
#endif

/* Weight rows per tile at most: BM_TILE_FLOATS of floats, a multiple of BM_TILE_R, at least BM_TILE_R. */
static inline ptrdiff_t basert_tile_rows(ptrdiff_t k) {
    ptrdiff_t rows = BM_TILE_FLOATS / basert_tile_stride(k) / BM_TILE_R * BM_TILE_R;
    return rows < BM_TILE_R ? BM_TILE_R : rows;
}

/* The tiles of n weight rows for nt threads: about as many as basert_tile_rows needs, rounded up to a
 * multiple of nt, each a whole number of BM_TILE_R-row blocks (tile t: basert_tile_start(t) up to
 * basert_tile_start(t + 1)), so that every thread gets the same number of rows give or take one block. */
static inline ptrdiff_t basert_tile_count(ptrdiff_t n, ptrdiff_t k, ptrdiff_t nt) {
    const ptrdiff_t blocks = (n + BM_TILE_R - 1) / BM_TILE_R, per = basert_tile_rows(k) / BM_TILE_R;
    ptrdiff_t tiles = (blocks + per - 1) / per;
    tiles = (tiles + nt - 1) / nt * nt;
    return tiles < blocks ? tiles : blocks;
}
static inline ptrdiff_t basert_tile_start(ptrdiff_t t, ptrdiff_t tiles, ptrdiff_t n) {
    const ptrdiff_t blocks = (n + BM_TILE_R - 1) / BM_TILE_R, row = t * blocks / tiles * BM_TILE_R;
    return row < n ? row : n;
}

/* out[0..m)[r0..r1) for m activation rows x (row stride ldx); r1 - r0 <= basert_tile_rows(k). buf
 * holds basert_tile_rows(k) * basert_tile_stride(k) floats (unused for f32 weights, read in place). */
void basert_gemm_tile(const basert_weight *w, const float *x, ptrdiff_t ldx, ptrdiff_t m, ptrdiff_t r0, ptrdiff_t r1,
                      float *buf, float *out);

#endif
