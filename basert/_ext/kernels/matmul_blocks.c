/* GGUF blocks kept as they are (matmul.h, blocks.h): on the SIMD variants one streaming kernel per GGUF type,
 * de-quantizing in registers; the portable one de-quantizes each block into a buffer, whatever its type. */
#include "matmul_kernels.h"

#if defined(BASERT_SIMD)
BM_STREAM_FN(bm_q2_k, BASERT_BLOCKS, 0, 0, BASERT_GGML_Q2_K)
BM_STREAM_FN(bm_q3_k, BASERT_BLOCKS, 0, 0, BASERT_GGML_Q3_K)
BM_STREAM_FN(bm_q4_k, BASERT_BLOCKS, 0, 0, BASERT_GGML_Q4_K)
BM_STREAM_FN(bm_q5_k, BASERT_BLOCKS, 0, 0, BASERT_GGML_Q5_K)
BM_STREAM_FN(bm_q6_k, BASERT_BLOCKS, 0, 0, BASERT_GGML_Q6_K)
BM_STREAM_FN(bm_q5_0, BASERT_BLOCKS, 0, 0, BASERT_GGML_Q5_0)
BM_STREAM_FN(bm_q5_1, BASERT_BLOCKS, 0, 0, BASERT_GGML_Q5_1)

bm_stream_kernel bm_blocks_kernel(const basert_weight *w) {
    bm_stream_fn run;
    switch (w->ggml_type) {
    case BASERT_GGML_Q2_K: run = bm_q2_k; break;
    case BASERT_GGML_Q3_K: run = bm_q3_k; break;
    case BASERT_GGML_Q4_K: run = bm_q4_k; break;
    case BASERT_GGML_Q5_K: run = bm_q5_k; break;
    case BASERT_GGML_Q6_K: run = bm_q6_k; break;
    case BASERT_GGML_Q5_0: run = bm_q5_0; break;
    default: run = bm_q5_1; break;
    }
    return (bm_stream_kernel){run, bm_m1_rows(BASERT_BLOCKS, w->ggml_type)};
}
#else
BM_STREAM_FN(bm_any_blocks, BASERT_BLOCKS, 0, 0, 0)

bm_stream_kernel bm_blocks_kernel(const basert_weight *w) { return (bm_stream_kernel){bm_any_blocks, bm_m1_rows(BASERT_BLOCKS, w->ggml_type)}; }
#endif

void bm_blocks_dequant_row(const basert_weight *w, ptrdiff_t row, float *dst) {
    const ptrdiff_t values = w->group_size;
    uint8_t buf[BASERT_MAX_BLOCK_BYTES];
    for (ptrdiff_t b = 0; b < w->k / values; b++)
        bm_dequant_block(w->ggml_type, basert_weight_block(w, row, b, buf), dst + b * values);
}
