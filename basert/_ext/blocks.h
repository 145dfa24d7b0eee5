/* GGUF quantized blocks kept as they are in a .base file (layout "gguf_super"): one block to its float32
 * values, exactly as gguf-py de-quantizes it (the reference: the same float32 operations in the same order,
 * each product and difference rounded on its own; the build never contracts them into FMAs). Scalar code,
 * so every CPU variant gives the same bits.
 *
 *   basert_block_values(type) / basert_block_bytes(type): values and bytes per block (0 for other types)
 *   basert_dequant_block(type, block, dst): dst[0 .. values) of one block
 *
 * Element order within a block is GGUF's (see each type). */
#ifndef BASERT_BLOCKS_H
#define BASERT_BLOCKS_H

#include <stdint.h>

/* GGUF type codes. */
enum {
    BASERT_GGML_Q5_0 = 6,
    BASERT_GGML_Q5_1 = 7,
    BASERT_GGML_Q2_K = 10,
    BASERT_GGML_Q3_K = 11,
    BASERT_GGML_Q4_K = 12,
    BASERT_GGML_Q5_K = 13,
    BASERT_GGML_Q6_K = 14,
};

static inline int basert_block_values(int type) {
    switch (type) {
    case BASERT_GGML_Q5_0:
    case BASERT_GGML_Q5_1: return 32;
    case BASERT_GGML_Q2_K:
    case BASERT_GGML_Q3_K:
    case BASERT_GGML_Q4_K:
    case BASERT_GGML_Q5_K:
    case BASERT_GGML_Q6_K: return 256;
    default: return 0;
    }
}

static inline int basert_block_bytes(int type) {
    switch (type) {
    case BASERT_GGML_Q5_0: return 22;
    case BASERT_GGML_Q5_1: return 24;
    case BASERT_GGML_Q2_K: return 84;
    case BASERT_GGML_Q3_K: return 110;
    case BASERT_GGML_Q4_K: return 144;
    case BASERT_GGML_Q5_K: return 176;
    case BASERT_GGML_Q6_K: return 210;
    default: return 0;
    }
}

/* IEEE half at p (little-endian) to float, exactly. */
static inline float basert_block_f16(const uint8_t *p) {
    const uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (e == 0) {
        v.f = (float)m * 5.9604644775390625e-8f; /* m * 2^-24, exact */
        v.u |= sign;
    } else if (e == 31) {
        v.u = sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0u);
    } else {
        v.u = sign | ((e + 112) << 23) | (m << 13);
    }
    return v.f;
}

/* Q5_0: d (f16), qh (32 high bits, bit i for element i), qs (16 bytes: elements 0-15 in the low nibbles,
 * 16-31 in the high ones); value d * (q - 16). Q5_1 adds m (f16) after d; value d * q + m. */
static inline void basert_dequant_q5(const uint8_t *b, int with_min, float *dst) {
    const float d = basert_block_f16(b), m = with_min ? basert_block_f16(b + 2) : 0.0f;
    const uint8_t *qh = b + (with_min ? 4 : 2), *qs = qh + 4;
    const uint32_t high = (uint32_t)qh[0] | ((uint32_t)qh[1] << 8) | ((uint32_t)qh[2] << 16) | ((uint32_t)qh[3] << 24);
    for (int i = 0; i < 32; i++) {
        const int q = ((qs[i & 15] >> (4 * (i >> 4))) & 15) | (int)(((high >> i) & 1u) << 4);
        dst[i] = with_min ? d * (float)q + m : d * (float)(q - 16);
    }
}

/* Q2_K: scales (16 bytes: low nibble the scale, high nibble the min of each 16 values), qs (64 bytes), d,
 * dmin; element 128h + 32t + j has code (qs[32h + j] >> 2t) & 3; value (d * scale) * q - (dmin * min). */
static inline void basert_dequant_q2_k(const uint8_t *b, float *dst) {
    const uint8_t *scales = b, *qs = b + 16;
    const float d = basert_block_f16(b + 80), dmin = basert_block_f16(b + 82);
    for (int e = 0; e < 256; e++) {
        const int h = e >> 7, t = (e >> 5) & 3, j = e & 31;
        const int q = (qs[32 * h + j] >> (2 * t)) & 3;
        const float dl = d * (float)(scales[e >> 4] & 15), ml = dmin * (float)(scales[e >> 4] >> 4);
        dst[e] = dl * (float)q - ml;
    }
}

/* Q3_K: hmask (32 bytes), qs (64), scales (12: 16 six-bit values), d; element 128h + 32t + j has low bits
 * (qs[32h + j] >> 2t) & 3 and, unless bit (e >> 5) of hmask[j] is set, 4 subtracted; value (d * scale) * q
 * with scale the signed six-bit value of its 16. */
/* The signed six-bit scale of Q3_K's 16 values k (of 16) in its 12 packed scale bytes. */
static inline int basert_q3_k_scale(const uint8_t *sc, int k) {
    const int low = (sc[k & 7] >> (4 * (k >> 3))) & 15, high = (sc[8 + (k & 3)] >> (2 * (k >> 2))) & 3;
    return (int)(int8_t)(uint8_t)(low | (high << 4)) - 32;
}

static inline void basert_dequant_q3_k(const uint8_t *b, float *dst) {
    const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
    const float d = basert_block_f16(b + 108);
    float dl[16];
    for (int k = 0; k < 16; k++) dl[k] = d * (float)basert_q3_k_scale(sc, k);
    for (int e = 0; e < 256; e++) {
        const int h = e >> 7, t = (e >> 5) & 3, j = e & 31;
        const int low = (qs[32 * h + j] >> (2 * t)) & 3, unset = ((hmask[j] >> (e >> 5)) & 1) ^ 1;
        dst[e] = dl[e >> 4] * (float)(low - (unset << 2));
    }
}

/* The six-bit scale and min of sub-block s (of 8) in the 12 packed bytes of Q4_K and Q5_K. */
static inline void basert_k_scale_min(const uint8_t *sc, int s, int *scale, int *min) {
    if (s < 4) {
        *scale = sc[s] & 63;
        *min = sc[4 + s] & 63;
    } else {
        *scale = (sc[8 + s - 4] & 15) | ((sc[s - 4] >> 2) & 48);
        *min = (sc[8 + s - 4] >> 4) | ((sc[s] >> 2) & 48);
    }
}

/* Q4_K: d, dmin, scales (12), qs (128: sub-block 2c in the low nibbles of bytes 32c .. 32c+31, 2c+1 in the
 * high ones); Q5_K adds qh (32 bytes, bit s of qh[j] the fifth bit of element j of sub-block s) before qs.
 * value (d * scale) * q - (dmin * min) per sub-block of 32. */
static inline void basert_dequant_q45_k(const uint8_t *b, int five, float *dst) {
    const float d = basert_block_f16(b), dmin = basert_block_f16(b + 2);
    const uint8_t *sc = b + 4, *qh = b + 16, *qs = b + (five ? 48 : 16);
    for (int s = 0; s < 8; s++) {
        int scale, min;
        basert_k_scale_min(sc, s, &scale, &min);
        const float ds = d * (float)scale, dm = dmin * (float)min;
        for (int j = 0; j < 32; j++) {
            int q = (qs[32 * (s >> 1) + j] >> (4 * (s & 1))) & 15;
            if (five) q |= ((qh[j] >> s) & 1) << 4;
            dst[32 * s + j] = ds * (float)q - dm;
        }
    }
}

/* Q6_K: ql (128), qh (64), scales (16 signed bytes, one per 16 values), d; element 128h + 32u + j has low
 * bits (ql[64h + 32(u & 1) + j] >> 4(u >> 1)) & 15 and high bits (qh[32h + j] >> 2u) & 3; value
 * (d * scale) * (q - 32). */
static inline void basert_dequant_q6_k(const uint8_t *b, float *dst) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(const void *)(b + 192);
    const float d = basert_block_f16(b + 208);
    for (int e = 0; e < 256; e++) {
        const int h = e >> 7, u = (e >> 5) & 3, j = e & 31;
        const int low = (ql[64 * h + 32 * (u & 1) + j] >> (4 * (u >> 1))) & 15, high = (qh[32 * h + j] >> (2 * u)) & 3;
        const float ds = d * (float)scales[e >> 4];
        dst[e] = ds * (float)((low | (high << 4)) - 32);
    }
}

static inline void basert_dequant_block(int type, const uint8_t *block, float *dst) {
    switch (type) {
    case BASERT_GGML_Q5_0: basert_dequant_q5(block, 0, dst); break;
    case BASERT_GGML_Q5_1: basert_dequant_q5(block, 1, dst); break;
    case BASERT_GGML_Q2_K: basert_dequant_q2_k(block, dst); break;
    case BASERT_GGML_Q3_K: basert_dequant_q3_k(block, dst); break;
    case BASERT_GGML_Q4_K: basert_dequant_q45_k(block, 0, dst); break;
    case BASERT_GGML_Q5_K: basert_dequant_q45_k(block, 1, dst); break;
    case BASERT_GGML_Q6_K: basert_dequant_q6_k(block, dst); break;
    default: break;
    }
}

#endif
