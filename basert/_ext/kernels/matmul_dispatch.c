/* basert_stream and basert_dequant_row (matmul.h): each weight's family kernel (matmul_dense.c, matmul_q4.c,
 * matmul_q8.c, matmul_blocks.c), and the order in which the streaming kernel's block shapes cover the rows. */
#include "matmul_kernels.h"

static bm_stream_kernel bm_kernel(const basert_weight *w) {
    switch (w->kind) {
    case BASERT_BLOCKS: return bm_blocks_kernel(w);
    case BASERT_Q4: return bm_q4_kernel(w);
    case BASERT_Q8: return bm_q8_kernel(w);
    default: return bm_dense_kernel(w);
    }
}

void basert_stream(const basert_weight *w, const float *x, ptrdiff_t ldx, ptrdiff_t m, ptrdiff_t r0, ptrdiff_t r1, float *y,
                   ptrdiff_t ldy) {
    if (m < 1) return;
    const bm_stream_kernel kernel = bm_kernel(w);
    /* Weight rows R at a time (one activation row: the kind's m1_rows; more: BM_STREAM_ROWS), then the last ones one by
     * one. Two weight rows for two or three activation rows measured no faster than one on avx2 (Zen 3). */
    const int R = m == 1 ? kernel.m1_rows : BM_STREAM_ROWS;
    if (m <= 4) {
        /* All activation rows in every block: one call streams every block of rows. */
        const ptrdiff_t blocked = r0 + (r1 - r0) / R * R;
        kernel.run(R, (int)m, w, r0, blocked, x, ldx, y, ldy);
        kernel.run(1, (int)m, w, blocked, r1, x, ldx, y, ldy);
        return;
    }
    /* A block of weight rows against every activation row before the next block: 8 (avx512), then 4 at a time, then
     * the last 1..3. */
    for (ptrdiff_t row = r0; row < r1;) {
        const int rows = row + R <= r1 ? R : 1;
        ptrdiff_t c0 = 0;
#if defined(BASERT_AVX512)
        for (; c0 + 8 <= m; c0 += 8) kernel.run(rows, 8, w, row, row + rows, x + c0 * ldx, ldx, y + c0 * ldy, ldy);
#endif
        for (; c0 + 4 <= m; c0 += 4) kernel.run(rows, 4, w, row, row + rows, x + c0 * ldx, ldx, y + c0 * ldy, ldy);
        if (c0 < m) kernel.run(rows, (int)(m - c0), w, row, row + rows, x + c0 * ldx, ldx, y + c0 * ldy, ldy);
        row += rows;
    }
}

void basert_dequant_row(const basert_weight *w, ptrdiff_t row, float *dst) {
    switch (w->kind) {
    case BASERT_BLOCKS: bm_blocks_dequant_row(w, row, dst); break;
    case BASERT_Q4: bm_q4_dequant_row(w, row, dst); break;
    case BASERT_Q8: bm_q8_dequant_row(w, row, dst); break;
    default: bm_dense_dequant_row(w, row, dst); break;
    }
}
