/* base_q4 weights (matmul.h): symmetric or not, group 32 unrolled or any other group size. */
#include "matmul_kernels.h"

BM_STREAM_FN(bm_q4_sym_g32, BASERT_Q4, 1, 32, 0)
BM_STREAM_FN(bm_q4_sym, BASERT_Q4, 1, 0, 0)
BM_STREAM_FN(bm_q4_asym_g32, BASERT_Q4, 0, 32, 0)
BM_STREAM_FN(bm_q4_asym, BASERT_Q4, 0, 0, 0)

bm_stream_kernel bm_q4_kernel(const basert_weight *w) {
    return bm_quant_kernel(BASERT_Q4, w, bm_q4_sym_g32, bm_q4_sym, bm_q4_asym_g32, bm_q4_asym);
}

void bm_q4_dequant_row(const basert_weight *w, ptrdiff_t row, float *dst) { bm_quant_dequant_row(BASERT_Q4, w, row, dst); }
