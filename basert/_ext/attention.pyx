# cython: language_level=3
"""Paged KV cache writes and causal GQA attention over it (blocks of 16 positions; float32 or
float16 cache entries; GIL released, (token, head) rows in parallel)."""

import numpy as np
cimport numpy as cnp
from cython.parallel cimport parallel, prange

cdef extern from "simd.h" nogil:
    int basert_threads_for(Py_ssize_t elements)
from libc.stdint cimport int32_t, uint16_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

cnp.import_array()

cdef extern from "attention.h" nogil:
    const int BASERT_KV_BLOCK
    void basert_store_f16(const float *x, uint16_t *dst, Py_ssize_t n)
    void basert_attend_row(const float *q, const void *k, const void *v, int kv_f16, const int32_t *block_table,
                           Py_ssize_t block_stride, Py_ssize_t n_pos, Py_ssize_t d, float scale, float *scores,
                           float *out)


cdef bint _check_cache(k_cache, v_cache, bint writable) except -1:
    """Validates a (k, v) cache pair [n_blocks, H_kv, 16, d]; returns True for float16 entries."""
    if not isinstance(k_cache, np.ndarray) or not isinstance(v_cache, np.ndarray):
        raise ValueError("k_cache and v_cache must be numpy arrays")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (np.float32, np.float16):
        raise ValueError(f"caches must both be float32 or float16, got {k_cache.dtype} and {v_cache.dtype}")
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2] != BASERT_KV_BLOCK:
        raise ValueError(f"caches must both have shape [n_blocks, H_kv, {BASERT_KV_BLOCK}, d], "
                         f"got {k_cache.shape} and {v_cache.shape}")
    if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        raise ValueError("caches must be C-contiguous")
    if writable and not (k_cache.flags.writeable and v_cache.flags.writeable):
        raise ValueError("caches must be writable")
    return k_cache.dtype == np.float16


cdef int _check_blocks(const int32_t[::1] block_table, Py_ssize_t n_pos, Py_ssize_t n_blocks,
                       Py_ssize_t first_pos) except -1:
    """Checks that block_table maps positions first_pos .. n_pos-1 to existing blocks."""
    cdef Py_ssize_t needed = (n_pos + BASERT_KV_BLOCK - 1) // BASERT_KV_BLOCK, i
    if block_table.shape[0] < needed:
        raise ValueError(f"block table has {block_table.shape[0]} blocks, {n_pos} positions need {needed}")
    for i in range(first_pos // BASERT_KV_BLOCK, needed):
        if block_table[i] < 0 or block_table[i] >= n_blocks:
            raise ValueError(f"block table entry {i} is {block_table[i]}, the cache has {n_blocks} blocks")
    return 0


def kv_write(k_cache, v_cache, const float[:, :, ::1] k, const float[:, :, ::1] v,
             const int32_t[::1] block_table, int start_pos):
    """Writes k, v [T, H_kv, d] at positions start_pos .. start_pos+T-1 of the paged caches."""
    cdef bint f16 = _check_cache(k_cache, v_cache, True)
    cdef Py_ssize_t T = k.shape[0], n_kv = k.shape[1], d = k.shape[2]
    if v.shape[0] != T or v.shape[1] != n_kv or v.shape[2] != d:
        raise ValueError("k and v must have the same shape")
    if k_cache.shape[1] != n_kv or k_cache.shape[3] != d:
        raise ValueError(f"k, v have [{n_kv}, {d}] per token, the cache has [{k_cache.shape[1]}, {k_cache.shape[3]}]")
    if start_pos < 0:
        raise ValueError(f"start_pos must be >= 0, got {start_pos}")
    if T == 0:
        return
    _check_blocks(block_table, start_pos + T, k_cache.shape[0], start_pos)
    cdef char *kc = <char *> cnp.PyArray_DATA(k_cache)
    cdef char *vc = <char *> cnp.PyArray_DATA(v_cache)
    cdef Py_ssize_t item = 2 if f16 else 4
    cdef Py_ssize_t block_stride = n_kv * BASERT_KV_BLOCK * d, t, h, p, row
    with nogil:
        for t in range(T):
            p = start_pos + t
            for h in range(n_kv):
                row = (block_table[p // BASERT_KV_BLOCK] * block_stride
                       + (h * BASERT_KV_BLOCK + p % BASERT_KV_BLOCK) * d) * item
                if f16:
                    basert_store_f16(&k[t, h, 0], <uint16_t *> (kc + row), d)
                    basert_store_f16(&v[t, h, 0], <uint16_t *> (vc + row), d)
                else:
                    memcpy(kc + row, &k[t, h, 0], d * sizeof(float))
                    memcpy(vc + row, &v[t, h, 0], d * sizeof(float))


def attention(const float[:, :, ::1] q, k_cache, v_cache, const int32_t[::1] block_table, int start_pos,
              float scale, float[:, :, ::1] out):
    """Causal attention: out[t, h] = softmax(q[t, h].k_p * scale, p <= start_pos + t) . v_p, kv head h // (H / H_kv)."""
    cdef bint f16 = _check_cache(k_cache, v_cache, False)
    cdef Py_ssize_t T = q.shape[0], H = q.shape[1], d = q.shape[2]
    cdef Py_ssize_t n_kv = k_cache.shape[1]
    if out.shape[0] != T or out.shape[1] != H or out.shape[2] != d:
        raise ValueError("out must have the shape of q")
    if k_cache.shape[3] != d:
        raise ValueError(f"q has head dim {d}, the cache {k_cache.shape[3]}")
    if n_kv == 0 or H % n_kv:
        raise ValueError(f"{H} query heads cannot share {n_kv} kv heads")
    if start_pos < 0:
        raise ValueError(f"start_pos must be >= 0, got {start_pos}")
    if T == 0:
        return
    _check_blocks(block_table, start_pos + T, k_cache.shape[0], 0)
    cdef const char *kc = <const char *> cnp.PyArray_DATA(k_cache)
    cdef const char *vc = <const char *> cnp.PyArray_DATA(v_cache)
    cdef Py_ssize_t item = 2 if f16 else 4, group = H // n_kv
    cdef Py_ssize_t block_stride = n_kv * BASERT_KV_BLOCK * d, n_max = start_pos + T, i, t, h, head_offset
    cdef float *scores = NULL
    cdef int failed = 0
    with nogil, parallel(num_threads=basert_threads_for(T * H * n_max * d)):
        scores = <float *> malloc(n_max * sizeof(float))
        for i in prange(T * H, schedule="dynamic"):
            if scores == NULL:
                failed += 1
                continue
            t = i // H
            h = i % H
            head_offset = (h // group) * BASERT_KV_BLOCK * d * item
            basert_attend_row(&q[t, h, 0], kc + head_offset, vc + head_offset, f16, &block_table[0], block_stride,
                              start_pos + t + 1, d, scale, scores, &out[t, h, 0])
        free(scores)
    if failed:
        raise MemoryError(f"no memory for {n_max} attention scores")
