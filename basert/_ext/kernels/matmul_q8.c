/* base_q8 weights (matmul.h): symmetric or not, group 32 unrolled or any other group size. */
#include "matmul_kernels.h"

BM_STREAM_FN(bm_q8_sym_g32, BASERT_Q8, 1, 32, 0)
BM_STREAM_FN(bm_q8_sym, BASERT_Q8, 1, 0, 0)
BM_STREAM_FN(bm_q8_asym_g32, BASERT_Q8, 0, 32, 0)
BM_STREAM_FN(bm_q8_asym, BASERT_Q8, 0, 0, 0)

bm_stream_kernel bm_q8_kernel(const basert_weight *w) {
    return bm_quant_kernel(BASERT_Q8, w, bm_q8_sym_g32, bm_q8_sym, bm_q8_asym_g32, bm_q8_asym);
}

void bm_q8_dequant_row(const basert_weight *w, ptrdiff_t row, float *dst) { bm_quant_dequant_row(BASERT_Q8, w, row, dst); }
