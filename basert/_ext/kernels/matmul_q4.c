/* base_q4 weights (matmul.h): symmetric or not, any group size (see BM_QUANT_FAMILY). */
#include "matmul_kernels.h"

BM_QUANT_FAMILY(bm_q4, BASERT_Q4)
