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
    if (m <= 3) {
        /* One activation row: the kind's m1_rows weight rows at a time; two or three: two. Then the rest one by one. */
        const int R = m == 1 ? kernel.m1_rows : 2;
        const ptrdiff_t blocked = r0 + (r1 - r0) / R * R;
        kernel.run(R, (int)m, w, r0, blocked, x, ldx, y, ldy);
        kernel.run(1, (int)m, w, blocked, r1, x, ldx, y, ldy);
        return;
    }
    /* BM_STREAM_ROWS weight rows (then the last ones one by one) against every activation row before the next ones:
     * 8 (avx512), then 4 at a time, then the last 1..3. */
    for (ptrdiff_t row = r0; row < r1;) {
        const int R = row + BM_STREAM_ROWS <= r1 ? BM_STREAM_ROWS : 1;
        ptrdiff_t c0 = 0;
#if defined(BASERT_AVX512)
        for (; c0 + 8 <= m; c0 += 8) kernel.run(R, 8, w, row, row + R, x + c0 * ldx, ldx, y + c0 * ldy, ldy);
#endif
        for (; c0 + 4 <= m; c0 += 4) kernel.run(R, 4, w, row, row + R, x + c0 * ldx, ldx, y + c0 * ldy, ldy);
        if (c0 < m) kernel.run(R, (int)(m - c0), w, row, row + R, x + c0 * ldx, ldx, y + c0 * ldy, ldy);
        row += R;
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
