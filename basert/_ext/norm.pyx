# cython: language_level=3
"""Normalisation kernels over rows of float32 activations (GIL released, rows in parallel)."""

import numpy as np
cimport numpy as cnp
from cython.parallel cimport prange

cdef extern from "simd.h" nogil:
    int basert_threads_for(Py_ssize_t elements)
    void basert_rmsnorm_row(const float *x, const float *w, float eps, float *out, Py_ssize_t n)


def rmsnorm(const float[:, ::1] x, const float[::1] weight, float eps, float[:, ::1] out=None):
    """RMSNorm of each row of x: x / sqrt(mean(x^2) + eps) * weight; returns out [M, K] float32."""
    cdef Py_ssize_t m = x.shape[0], k = x.shape[1], i
    if weight.shape[0] != k:
        raise ValueError(f"weight has {weight.shape[0]} elements, rows have {k}")
    if out is None:
        out = np.empty((m, k), dtype=np.float32)
    elif out.shape[0] != m or out.shape[1] != k:
        raise ValueError("out must have the shape of x")
    with nogil:
        for i in prange(m, schedule="static", num_threads=basert_threads_for(m * k)):
            basert_rmsnorm_row(&x[i, 0], &weight[0], eps, &out[i, 0], k)
    return np.asarray(out)
