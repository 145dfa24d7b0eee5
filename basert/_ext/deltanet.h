/* Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention): the short causal conv, the gates, and the
 * per-token gated delta rule on a float32 state. Prefill and decode run the same per-token code, so
 * splitting a sequence into calls of any length gives bit-identical outputs and states. */
#ifndef BASERT_DELTANET_H
#define BASERT_DELTANET_H

#include <string.h>
#include "simd.h"
#include "ops.h"

/* The depthwise causal conv for channels c0 .. c0+n-1 of every token:
 *   out[t, c] = silu(sum_j w[c, j] * xe[t + j, c]),  xe = the K-1 state columns, then the T rows of x,
 * summed in order j = 0 .. K-1 from 0. Afterwards state[c] holds the last K-1 rows of xe. x and out
 * are [T, C] rows, state is [C, K-1], w is [C, K]. The chunk's weights and state are first
 * transposed into scratch ((2K-1) * n floats) so that every step runs along contiguous channels. */
static inline void basert_gdn_conv_chunk(const float *x, float *out, ptrdiff_t C, ptrdiff_t T, float *state,
                                         const float *w, ptrdiff_t K, ptrdiff_t c0, ptrdiff_t n, float *scratch) {
    ptrdiff_t n_state = K - 1;
    float *wt = scratch, *st = scratch + K * n;
    for (ptrdiff_t c = 0; c < n; c++) {
        for (ptrdiff_t j = 0; j < K; j++) wt[j * n + c] = w[(c0 + c) * K + j];
        for (ptrdiff_t i = 0; i < n_state; i++) st[i * n + c] = state[(c0 + c) * n_state + i];
    }
    for (ptrdiff_t t = 0; t < T; t++) {
        float *o = out + t * C + c0;
        memset(o, 0, (size_t)n * sizeof(float));
        for (ptrdiff_t j = 0; j < K; j++) {
            ptrdiff_t r = t + j; /* row of xe */
            basert_axpy_rows(wt + j * n, r < n_state ? st + r * n : x + (r - n_state) * C + c0, o, n);
        }
        basert_silu_row(o, n);
    }
    for (ptrdiff_t i = 0; i < n_state; i++) {
        ptrdiff_t r = T + i;
        const float *src = r < n_state ? st + r * n : x + (r - n_state) * C + c0;
        for (ptrdiff_t c = 0; c < n; c++) state[(c0 + c) * n_state + i] = src[c];
    }
}

/* g = -exp(A_log) * softplus(a + dt_bias) (torch's softplus: linear above 20), beta = sigmoid(b). */
static inline void basert_gdn_gates_row(const float *a, const float *b, const float *A_log, const float *dt_bias,
                                        float *g, float *beta, ptrdiff_t n) {
    for (ptrdiff_t i = 0; i < n; i++) {
        float x = a[i] + dt_bias[i];
        float softplus = x > 20.0f ? x : log1pf(expf(x));
        g[i] = -expf(A_log[i]) * softplus;
        beta[i] = basert_sigmoid(b[i]);
    }
}

/* row *= decay, then m += k_i * row (one row of S: decay it and accumulate S^T k). */
static inline void basert_gdn_decay_read(float *row, float decay, float k_i, float *m, ptrdiff_t n) {
    ptrdiff_t j = 0;
#if defined(BASERT_SIMD)
    __m256 vd = _mm256_set1_ps(decay), vk = _mm256_set1_ps(k_i);
    for (; j + 8 <= n; j += 8) {
        __m256 s = _mm256_mul_ps(_mm256_loadu_ps(row + j), vd);
        _mm256_storeu_ps(row + j, s);
        _mm256_storeu_ps(m + j, _mm256_fmadd_ps(vk, s, _mm256_loadu_ps(m + j)));
    }
#endif
    for (; j < n; j++) {
        row[j] *= decay;
        m[j] = fmaf(k_i, row[j], m[j]);
    }
}

/* row += k_i * delta, then o += q_i * row (write the rank-1 update, read S^T q). */
static inline void basert_gdn_write_read(float *row, float k_i, const float *delta, float q_i, float *o, ptrdiff_t n) {
    ptrdiff_t j = 0;
#if defined(BASERT_SIMD)
    __m256 vk = _mm256_set1_ps(k_i), vq = _mm256_set1_ps(q_i);
    for (; j + 8 <= n; j += 8) {
        __m256 s = _mm256_fmadd_ps(vk, _mm256_loadu_ps(delta + j), _mm256_loadu_ps(row + j));
        _mm256_storeu_ps(row + j, s);
        _mm256_storeu_ps(o + j, _mm256_fmadd_ps(vq, s, _mm256_loadu_ps(o + j)));
    }
#endif
    for (; j < n; j++) {
        row[j] = fmaf(k_i, delta[j], row[j]);
        o[j] = fmaf(q_i, row[j], o[j]);
    }
}

/* x_hat = x / sqrt(sum x^2 + 1e-6) * scale (l2norm with the eps inside the sqrt, as in HF). */
static inline void basert_gdn_l2norm(const float *x, float scale, float *x_hat, ptrdiff_t n) {
    float inv = 1.0f / sqrtf(basert_sumsq(x, n) + 1e-6f);
    for (ptrdiff_t i = 0; i < n; i++) x_hat[i] = (x[i] * inv) * scale;
}

/* The gated delta rule for one value head over T tokens, per token:
 *   S = exp(g) S;  m = S^T k_hat;  delta = beta (v - m);  S += k_hat delta^T;  o = S^T q_hat.
 * q, k, v, g, beta and out point at this head's entries of token 0 and step by their strides;
 * S is the head's [dk, dv] state; scratch holds 2 * dk + dv floats. */
static inline void basert_gdn_head(const float *q, const float *k, ptrdiff_t qk_stride, const float *v,
                                   ptrdiff_t v_stride, const float *g, const float *beta, ptrdiff_t gate_stride,
                                   ptrdiff_t T, ptrdiff_t dk, ptrdiff_t dv, float *S, float *out,
                                   ptrdiff_t out_stride, float *scratch) {
    float *q_hat = scratch, *k_hat = scratch + dk, *delta = scratch + 2 * dk;
    /* HF multiplies by the float32 rounding of the double 1/sqrt(dk). */
    float q_scale = (float)(1.0 / sqrt((double)dk));
    for (ptrdiff_t t = 0; t < T; t++) {
        basert_gdn_l2norm(q + t * qk_stride, q_scale, q_hat, dk);
        basert_gdn_l2norm(k + t * qk_stride, 1.0f, k_hat, dk);
        float decay = expf(g[t * gate_stride]), b = beta[t * gate_stride];
        const float *vt = v + t * v_stride;
        float *o = out + t * out_stride;
        memset(delta, 0, (size_t)dv * sizeof(float));
        for (ptrdiff_t i = 0; i < dk; i++) basert_gdn_decay_read(S + i * dv, decay, k_hat[i], delta, dv);
        for (ptrdiff_t j = 0; j < dv; j++) delta[j] = (vt[j] - delta[j]) * b;
        memset(o, 0, (size_t)dv * sizeof(float));
        for (ptrdiff_t i = 0; i < dk; i++) basert_gdn_write_read(S + i * dv, k_hat[i], delta, q_hat[i], o, dv);
    }
}

#endif
