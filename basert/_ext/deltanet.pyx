# cython: language_level=3
"""Gated DeltaNet kernels: causal depthwise conv with a carried state, the decay/write gates, and the
per-token gated delta rule used for both prefill and decode (float32, GIL released)."""

import numpy as np
from cython.parallel cimport prange


cdef int _expect_shape(str name, tuple got, tuple expected) except -1:
    if got != expected:
        raise ValueError(f"{name} has shape {got}, expected {expected}")
    return 0


cdef enum:
    # Channels per parallel work item of the conv: long rows for SIMD, still enough items for the cores.
    CONV_CHUNK = 256

cdef extern from "simd.h" nogil:
    int basert_threads_for(Py_ssize_t elements)

cdef extern from "deltanet.h" nogil:
    void basert_gdn_conv_chunk(const float *x, float *out, Py_ssize_t C, Py_ssize_t T, float *state, const float *w,
                               Py_ssize_t K, Py_ssize_t c0, Py_ssize_t n, float *scratch)
    void basert_gdn_gates_row(const float *a, const float *b, const float *A_log, const float *dt_bias, float *g,
                              float *beta, Py_ssize_t n)
    void basert_gdn_head(const float *q, const float *k, Py_ssize_t qk_stride, const float *v, Py_ssize_t v_stride,
                         const float *g, const float *beta, Py_ssize_t gate_stride, Py_ssize_t T, Py_ssize_t dk,
                         Py_ssize_t dv, float *S, float *out, Py_ssize_t out_stride, float *scratch)


def gdn_conv(const float[:, ::1] x, float[:, ::1] conv_state, const float[:, ::1] weight, float[:, ::1] out):
    """out = silu(causal depthwise conv of x [T, C] continuing conv_state [C, K-1]); out must not overlap x."""
    cdef Py_ssize_t T = x.shape[0], C = x.shape[1], K = weight.shape[1]
    if K < 1:
        raise ValueError("the conv kernel needs at least one tap")
    _expect_shape("weight", (weight.shape[0], K), (C, K))
    _expect_shape("conv_state", (conv_state.shape[0], conv_state.shape[1]), (C, K - 1))
    _expect_shape("out", (out.shape[0], out.shape[1]), (T, C))
    if T == 0 or C == 0:
        return
    cdef Py_ssize_t n_chunks = (C + CONV_CHUNK - 1) // CONV_CHUNK, chunk, c0
    cdef float[:, ::1] scratch = np.empty((n_chunks, (2 * K - 1) * CONV_CHUNK), dtype=np.float32)
    # With K == 1 the state has no columns and is never touched; any valid address will do.
    cdef float *state = &conv_state[0, 0] if K > 1 else &out[0, 0]
    with nogil:
        for chunk in prange(n_chunks, schedule="static", num_threads=basert_threads_for(T * C * K)):
            c0 = chunk * CONV_CHUNK
            basert_gdn_conv_chunk(&x[0, 0], &out[0, 0], C, T, state, &weight[0, 0], K, c0, min(CONV_CHUNK, C - c0),
                                  &scratch[chunk, 0])


def gdn_gates(const float[:, ::1] a, const float[:, ::1] b, const float[::1] A_log, const float[::1] dt_bias,
              float[:, ::1] g, float[:, ::1] beta):
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), all [T, n_v]."""
    cdef Py_ssize_t T = a.shape[0], n = a.shape[1], t
    _expect_shape("b", (b.shape[0], b.shape[1]), (T, n))
    _expect_shape("g", (g.shape[0], g.shape[1]), (T, n))
    _expect_shape("beta", (beta.shape[0], beta.shape[1]), (T, n))
    _expect_shape("A_log", (A_log.shape[0],), (n,))
    _expect_shape("dt_bias", (dt_bias.shape[0],), (n,))
    if T == 0 or n == 0:
        return
    with nogil:
        for t in range(T):
            basert_gdn_gates_row(&a[t, 0], &b[t, 0], &A_log[0], &dt_bias[0], &g[t, 0], &beta[t, 0], n)


def gdn_recurrent(const float[:, :, ::1] q, const float[:, :, ::1] k, const float[:, :, ::1] v,
                  const float[:, ::1] g, const float[:, ::1] beta, float[:, :, ::1] state, float[:, :, ::1] out):
    """Gated delta rule token by token: q, k [T, n_k, d_k] raw, v [T, n_v, d_v]; state [n_v, d_k, d_v] advanced."""
    cdef Py_ssize_t T = q.shape[0], n_k = q.shape[1], dk = q.shape[2]
    cdef Py_ssize_t n_v = v.shape[1], dv = v.shape[2], h, kh
    _expect_shape("k", (k.shape[0], k.shape[1], k.shape[2]), (T, n_k, dk))
    if v.shape[0] != T:
        raise ValueError(f"v has {v.shape[0]} tokens, q has {T}")
    if n_k == 0 or n_v % n_k:
        raise ValueError(f"{n_v} value heads cannot share {n_k} key heads")
    _expect_shape("g", (g.shape[0], g.shape[1]), (T, n_v))
    _expect_shape("beta", (beta.shape[0], beta.shape[1]), (T, n_v))
    _expect_shape("state", (state.shape[0], state.shape[1], state.shape[2]), (n_v, dk, dv))
    _expect_shape("out", (out.shape[0], out.shape[1], out.shape[2]), (T, n_v, dv))
    if T == 0 or dk == 0 or dv == 0:
        return
    cdef float[:, ::1] scratch = np.empty((n_v, 2 * dk + dv), dtype=np.float32)
    cdef Py_ssize_t group = n_v // n_k
    with nogil:
        for h in prange(n_v, schedule="static", num_threads=basert_threads_for(T * n_v * dk * dv)):
            kh = h // group
            basert_gdn_head(&q[0, kh, 0], &k[0, kh, 0], n_k * dk, &v[0, h, 0], n_v * dv, &g[0, h], &beta[0, h], n_v,
                            T, dk, dv, &state[h, 0, 0], &out[0, h, 0], n_v * dv, &scratch[h, 0])
