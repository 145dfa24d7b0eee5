/* f32, f16 and bf16 weights (matmul.h). */
#include "matmul_kernels.h"

BM_STREAM_FN(bm_f32, BASERT_F32, 0, 0, 0)
BM_STREAM_FN(bm_f16, BASERT_F16, 0, 0, 0)
BM_STREAM_FN(bm_bf16, BASERT_BF16, 0, 0, 0)

bm_stream_kernel bm_dense_kernel(const basert_weight *w) {
    const bm_stream_fn run = w->kind == BASERT_F32 ? bm_f32 : w->kind == BASERT_F16 ? bm_f16 : bm_bf16;
    return (bm_stream_kernel){run, bm_m1_rows(w->kind, 0)};
}

void bm_dense_dequant_row(const basert_weight *w, ptrdiff_t row, float *dst) {
    switch (w->kind) {
    case BASERT_F32: bm_dequant_row_kind(BASERT_F32, 0, w, row, dst); break;
    case BASERT_F16: bm_dequant_row_kind(BASERT_F16, 0, w, row, dst); break;
    default: bm_dequant_row_kind(BASERT_BF16, 0, w, row, dst); break;
    }
}
