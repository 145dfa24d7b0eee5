# cython: language_level=3
"""Element-wise and per-head kernels around the matmuls: q/k RMSNorm, gated RMSNorm, SwiGLU, GeGLU, the
sigmoid output gate and RoPE (float32, GIL released, rows in parallel)."""

import math

import numpy as np
from cython.parallel cimport prange
from libc.math cimport cos, sin
from libc.stdint cimport int32_t

cdef extern from "simd.h" nogil:
    int basert_threads_for(Py_ssize_t elements)
    void basert_rmsnorm_row(const float *x, const float *w, float eps, float *out, Py_ssize_t n)

cdef extern from "ops.h" nogil:
    void basert_silu_mul_row(const float *gate, const float *up, float *out, Py_ssize_t n) noexcept
    void basert_gelu_tanh_mul_row(const float *gate, const float *up, float *out, Py_ssize_t n) noexcept
    void basert_sigmoid_mul_row(float *x, const float *gate, Py_ssize_t n)
    void basert_gated_rmsnorm_row(const float *x, const float *z, const float *w, float eps, float *out,
                                  Py_ssize_t n)
    void basert_rope_row(float *x, const float *cos_row, const float *sin_row, Py_ssize_t half, int interleaved)


cdef inline bint _same_shape(const Py_ssize_t *a, const Py_ssize_t *b, int ndim) noexcept:
    cdef int i
    for i in range(ndim):
        if a[i] != b[i]:
            return False
    return True


def rmsnorm_heads(float[:, :, ::1] x, const float[::1] w, float eps):
    """In place RMSNorm of every head row of x [T, H, d] with weight w [d]."""
    cdef Py_ssize_t rows = x.shape[0] * x.shape[1], d = x.shape[2], i
    if w.shape[0] != d:
        raise ValueError(f"weight has {w.shape[0]} elements, heads have {d}")
    if rows == 0 or d == 0:
        return
    cdef float *base = &x[0, 0, 0]
    with nogil:
        for i in prange(rows, schedule="static", num_threads=basert_threads_for(rows * d)):
            basert_rmsnorm_row(base + i * d, &w[0], eps, base + i * d, d)


def gated_rmsnorm(const float[:, :, ::1] x, const float[:, :, ::1] z, const float[::1] w, float eps,
                  float[:, :, ::1] out):
    """out = x / sqrt(mean(x^2) + eps) * w * silu(z) over the last axis of [T, H, d]."""
    cdef Py_ssize_t rows = x.shape[0] * x.shape[1], d = x.shape[2], i
    if not _same_shape(&x.shape[0], &z.shape[0], 3) or not _same_shape(&x.shape[0], &out.shape[0], 3):
        raise ValueError("x, z and out must have the same shape")
    if w.shape[0] != d:
        raise ValueError(f"weight has {w.shape[0]} elements, heads have {d}")
    if rows == 0 or d == 0:
        return
    cdef const float *xp = &x[0, 0, 0]
    cdef const float *zp = &z[0, 0, 0]
    cdef float *op = &out[0, 0, 0]
    with nogil:
        for i in prange(rows, schedule="static", num_threads=basert_threads_for(rows * d)):
            basert_gated_rmsnorm_row(xp + i * d, zp + i * d, &w[0], eps, op + i * d, d)


ctypedef void (*gated_row)(const float *gate, const float *up, float *out, Py_ssize_t n) noexcept nogil


cdef _gated_rows(const float[:, ::1] gate, const float[:, ::1] up, float[:, ::1] out, gated_row row):
    """out[i] = act(gate[i]) * up[i] for every row, rows in parallel."""
    cdef Py_ssize_t m = gate.shape[0], n = gate.shape[1], i
    if not _same_shape(&gate.shape[0], &up.shape[0], 2) or not _same_shape(&gate.shape[0], &out.shape[0], 2):
        raise ValueError("gate, up and out must have the same shape")
    if m == 0 or n == 0:
        return
    with nogil:
        for i in prange(m, schedule="static", num_threads=basert_threads_for(m * n)):
            row(&gate[i, 0], &up[i, 0], &out[i, 0], n)


def silu_mul(const float[:, ::1] gate, const float[:, ::1] up, float[:, ::1] out):
    """out = silu(gate) * up (SwiGLU); out may be gate."""
    _gated_rows(gate, up, out, basert_silu_mul_row)


def gelu_tanh_mul(const float[:, ::1] gate, const float[:, ::1] up, float[:, ::1] out):
    """out = gelu_tanh(gate) * up (GeGLU, GeLU's tanh approximation); out may be gate."""
    _gated_rows(gate, up, out, basert_gelu_tanh_mul_row)


def sigmoid_mul(float[:, ::1] x, const float[:, ::1] gate):
    """In place x *= sigmoid(gate)."""
    cdef Py_ssize_t m = x.shape[0], n = x.shape[1], i
    if not _same_shape(&x.shape[0], &gate.shape[0], 2):
        raise ValueError("x and gate must have the same shape")
    if m == 0 or n == 0:
        return
    with nogil:
        for i in prange(m, schedule="static", num_threads=basert_threads_for(m * n)):
            basert_sigmoid_mul_row(&x[i, 0], &gate[i, 0], n)


def rope(float[:, :, ::1] x, const int32_t[::1] positions, const float[:, ::1] cos_table,
         const float[:, ::1] sin_table, bint interleaved):
    """In place RoPE on x [T, H, d] at the given positions, over the first 2 * cos_table.shape[1] dims."""
    cdef Py_ssize_t T = x.shape[0], H = x.shape[1], d = x.shape[2]
    cdef Py_ssize_t max_pos = cos_table.shape[0], half = cos_table.shape[1], i, t
    if positions.shape[0] != T:
        raise ValueError(f"{positions.shape[0]} positions for {T} tokens")
    if not _same_shape(&cos_table.shape[0], &sin_table.shape[0], 2):
        raise ValueError("cos and sin tables must have the same shape")
    if 2 * half > d:
        raise ValueError(f"rotary dim {2 * half} exceeds head dim {d}")
    for t in range(T):
        if positions[t] < 0 or positions[t] >= max_pos:
            raise ValueError(f"position {positions[t]} outside the RoPE table (0..{max_pos - 1})")
    if T == 0 or H == 0 or half == 0:
        return
    cdef float *base = &x[0, 0, 0]
    with nogil:
        for i in prange(T * H, schedule="static", num_threads=basert_threads_for(T * H * d)):
            t = i // H
            basert_rope_row(base + i * d, &cos_table[positions[t], 0], &sin_table[positions[t], 0], half,
                            interleaved)


def rope_tables(double theta, int rotary_dim, int max_pos):
    """cos and sin tables [max_pos, rotary_dim / 2] float32, with HF's float32 rounding of the angles.

    Every step gives the same bits on every CPU: the C library's float64 pow, exact float32 products,
    and the C library's float64 cos and sin rounded to float32 (numpy's float32 pow and its vectorised
    float64 cos/sin can differ in the last bit between CPUs)."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    if max_pos <= 0:
        raise ValueError(f"max_pos must be positive, got {max_pos}")
    exponents = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rotary_dim)
    # HF raises theta to a float32 exponent and keeps float32: float64 pow rounded once matches it.
    powers = np.array([math.pow(theta, float(exponent)) for exponent in exponents], dtype=np.float64)
    inv_freq = np.float32(1.0) / powers.astype(np.float32)
    angles = np.arange(max_pos, dtype=np.float32)[:, None] * inv_freq[None, :]
    cos_table = np.empty_like(angles)
    sin_table = np.empty_like(angles)
    cdef const float[::1] a = angles.reshape(-1)
    cdef float[::1] c = cos_table.reshape(-1)
    cdef float[::1] s = sin_table.reshape(-1)
    cdef Py_ssize_t i
    with nogil:
        for i in range(a.shape[0]):
            c[i] = <float>cos(<double>a[i])
        for i in range(a.shape[0]):
            s[i] = <float>sin(<double>a[i])
    return cos_table, sin_table
