/* Larger M (basert_gemm_tile, matmul.h): a tile of weight rows de-quantized once, then a register-blocked
 * microkernel of BM_TILE_R weight rows x BM_TILE_C activation rows over it, for every activation row. */
#include "matmul_kernels.h"

/* Keeps a vector in a register: without it the compiler folds a load into every FMA that uses it, and
 * the loads, not the FMAs, set the pace. */
#if defined(BASERT_AVX512)
#define BM_IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define BM_IN_REGISTER(v) ((void)0)
#endif

#if defined(BASERT_SIMD) && !defined(BASERT_AVX512)
/* avx2: lanes 0-7 and lanes 8-15 of every accumulator are independent sums, so they are computed in two
 * passes over K (the first 8 and the last 8 floats of each 16), each with R x C single registers: 4 x 3
 * accumulators fit the 16 ymm registers, where pairs would spill. */
BASERT_ALWAYS_INLINE void bm_block_half(const int R, const int C, const float *w, ptrdiff_t ldw, const float *x, ptrdiff_t ldx,
                                        ptrdiff_t k16, ptrdiff_t half, __m256 acc[BM_TILE_R][BM_TILE_C]) {
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (ptrdiff_t e = half; e < k16; e += 16) {
        __m256 xv[BM_TILE_C];
        for (int c = 0; c < C; c++) xv[c] = _mm256_loadu_ps(x + c * ldx + e);
        for (int r = 0; r < R; r++) {
            __m256 wv = _mm256_loadu_ps(w + r * ldw + e);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv[c], wv, acc[r][c]);
        }
    }
}
#endif

/* Microkernel: out[c * ldo + r] for R (1..BM_TILE_R) float weight rows x C (1..BM_TILE_C) activation
 * rows; each weight load serves C accumulators and each activation load R. */
BASERT_ALWAYS_INLINE void bm_block(const int R, const int C, const float *w, ptrdiff_t ldw, const float *x, ptrdiff_t ldx,
                                   ptrdiff_t k, float *out, ptrdiff_t ldo) {
    bm_v acc[BM_TILE_R][BM_TILE_C];
    const ptrdiff_t k16 = k & ~(ptrdiff_t)15;
#if defined(BASERT_SIMD) && !defined(BASERT_AVX512)
    __m256 lo[BM_TILE_R][BM_TILE_C], hi[BM_TILE_R][BM_TILE_C];
    bm_block_half(R, C, w, ldw, x, ldx, k16, 0, lo);
    bm_block_half(R, C, w, ldw, x, ldx, k16, 8, hi);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = (bm_v){lo[r][c], hi[r][c]};
#else
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = bm_zero();
    for (ptrdiff_t e = 0; e < k16; e += 16) {
        bm_v xv[BM_TILE_C];
        for (int c = 0; c < C; c++) {
            xv[c] = bm_load(x + c * ldx + e);
            BM_IN_REGISTER(xv[c]);
        }
        for (int r = 0; r < R; r++) {
            bm_v wv = bm_load(w + r * ldw + e);
            BM_IN_REGISTER(wv);
            for (int c = 0; c < C; c++) acc[r][c] = bm_fma(xv[c], wv, acc[r][c]);
        }
    }
#endif
    for (int c = 0; c < C; c++) {
        float total[BM_TILE_R];
        int r = 0;
        for (; r + 4 <= R; r += 4) bm_hsum4(acc[r][c], acc[r + 1][c], acc[r + 2][c], acc[r + 3][c], total + r);
        for (; r < R; r++) total[r] = bm_hsum(acc[r][c]);
        for (r = 0; r < R; r++) {
            for (ptrdiff_t e = k16; e < k; e++) total[r] = fmaf(x[c * ldx + e], w[r * ldw + e], total[r]);
            out[c * ldo + r] = total[r];
        }
    }
}

/* Activation rows i0..i1 against R weight rows: full BM_TILE_C blocks, then one block of the rest. */
BASERT_ALWAYS_INLINE void bm_block_rows(const int R, const float *w, ptrdiff_t ldw, const float *x, ptrdiff_t ldx, ptrdiff_t k,
                                        ptrdiff_t i0, ptrdiff_t i1, float *out, ptrdiff_t ldo) {
    ptrdiff_t i = i0;
    for (; i + BM_TILE_C <= i1; i += BM_TILE_C) bm_block(R, BM_TILE_C, w, ldw, x + i * ldx, ldx, k, out + i * ldo, ldo);
    switch (i1 - i) {
    case 2: bm_block(R, 2, w, ldw, x + i * ldx, ldx, k, out + i * ldo, ldo); break;
    case 1: bm_block(R, 1, w, ldw, x + i * ldx, ldx, k, out + i * ldo, ldo); break;
    default: break;
    }
}

static void bm_block_rows_full(const float *w, ptrdiff_t ldw, const float *x, ptrdiff_t ldx, ptrdiff_t k, ptrdiff_t i0,
                               ptrdiff_t i1, float *out, ptrdiff_t ldo) {
    bm_block_rows(BM_TILE_R, w, ldw, x, ldx, k, i0, i1, out, ldo);
}

static void bm_block_rows_one(const float *w, ptrdiff_t ldw, const float *x, ptrdiff_t ldx, ptrdiff_t k, ptrdiff_t i0,
                              ptrdiff_t i1, float *out, ptrdiff_t ldo) {
    bm_block_rows(1, w, ldw, x, ldx, k, i0, i1, out, ldo);
}

/* Activation rows per block: about 96 KiB, so a block stays in L2 while the tile's rows sweep it. */
static ptrdiff_t bm_x_block_rows(ptrdiff_t k) {
    ptrdiff_t rows = 24576 / k / BM_TILE_C * BM_TILE_C;
    return rows < BM_TILE_C ? BM_TILE_C : rows;
}

void basert_gemm_tile(const basert_weight *w, const float *x, ptrdiff_t ldx, ptrdiff_t m, ptrdiff_t r0, ptrdiff_t r1, float *buf,
                      float *out) {
    const ptrdiff_t k = w->k, n = w->n, rows = r1 - r0, mb = bm_x_block_rows(k);
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
        for (; r + BM_TILE_R <= rows; r += BM_TILE_R) bm_block_rows_full(tile + r * ldw, ldw, x, ldx, k, m0, m1, out + r0 + r, n);
        for (; r < rows; r++) bm_block_rows_one(tile + r * ldw, ldw, x, ldx, k, m0, m1, out + r0 + r, n);
    }
}
