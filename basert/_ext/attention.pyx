# cython: language_level=3
"""Paged KV cache writes and causal GQA attention over it (blocks of 16 positions; float32 or
float16 cache entries; GIL released; groups of query rows sharing a kv head in parallel)."""

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
    const int BASERT_ATTN_MAX_ROWS
    void basert_attend_rows(int n_rows, const float *const *q, const Py_ssize_t *n_pos, const void *k, const void *v,
                            int kv_f16, const int32_t *block_table, Py_ssize_t block_stride, Py_ssize_t d,
                            float scale, float *scores, Py_ssize_t score_stride, float *const *out)


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
    kv_write_batch(k_cache, v_cache, k, v, np.asarray(block_table)[None, :],
                   np.zeros(1, dtype=np.int32), np.array([k.shape[0]], dtype=np.int32),
                   np.array([start_pos], dtype=np.int32))


def kv_write_batch(k_cache, v_cache, const float[:, :, ::1] k, const float[:, :, ::1] v,
                   const int32_t[:, ::1] tables, const int32_t[::1] rows, const int32_t[::1] lengths,
                   const int32_t[::1] starts):
    """kv_write for several sequences: rows rows[i] .. rows[i]+lengths[i]-1 of k, v go to positions
    starts[i] .. of the sequence whose block table is tables[i]."""
    cdef bint f16 = _check_cache(k_cache, v_cache, True)
    cdef Py_ssize_t T = k.shape[0], n_kv = k.shape[1], d = k.shape[2]
    if v.shape[0] != T or v.shape[1] != n_kv or v.shape[2] != d:
        raise ValueError("k and v must have the same shape")
    if k_cache.shape[1] != n_kv or k_cache.shape[3] != d:
        raise ValueError(f"k, v have [{n_kv}, {d}] per token, the cache has [{k_cache.shape[1]}, {k_cache.shape[3]}]")
    _check_items(tables, rows, lengths, starts, T, k_cache.shape[0], True)
    cdef char *kc = <char *> cnp.PyArray_DATA(k_cache)
    cdef char *vc = <char *> cnp.PyArray_DATA(v_cache)
    cdef Py_ssize_t item = 2 if f16 else 4
    cdef Py_ssize_t block_stride = n_kv * BASERT_KV_BLOCK * d, s, t, h, p, row
    with nogil:
        for s in range(tables.shape[0]):
            for t in range(rows[s], rows[s] + lengths[s]):
                p = starts[s] + t - rows[s]
                for h in range(n_kv):
                    row = (tables[s, p // BASERT_KV_BLOCK] * block_stride
                           + (h * BASERT_KV_BLOCK + p % BASERT_KV_BLOCK) * d) * item
                    if f16:
                        basert_store_f16(&k[t, h, 0], <uint16_t *> (kc + row), d)
                        basert_store_f16(&v[t, h, 0], <uint16_t *> (vc + row), d)
                    else:
                        memcpy(kc + row, &k[t, h, 0], d * sizeof(float))
                        memcpy(vc + row, &v[t, h, 0], d * sizeof(float))


cdef int _check_items(const int32_t[:, ::1] tables, const int32_t[::1] rows, const int32_t[::1] lengths,
                      const int32_t[::1] starts, Py_ssize_t n_rows, Py_ssize_t n_blocks, bint writing) except -1:
    """Checks each sequence's rows against the batch and its block table against the cache."""
    cdef Py_ssize_t n = tables.shape[0], s
    if rows.shape[0] != n or lengths.shape[0] != n or starts.shape[0] != n:
        raise ValueError("tables, rows, lengths and starts must describe the same sequences")
    for s in range(n):
        if starts[s] < 0:
            raise ValueError(f"start_pos must be >= 0, got {starts[s]}")
        if lengths[s] < 0 or rows[s] < 0 or rows[s] + lengths[s] > n_rows:
            raise ValueError(f"sequence {s} rows {rows[s]}..{rows[s] + lengths[s]} are outside the {n_rows} rows")
        if lengths[s]:
            _check_blocks(tables[s], starts[s] + lengths[s], n_blocks, starts[s] if writing else 0)
    return 0


def attention(const float[:, :, ::1] q, k_cache, v_cache, const int32_t[::1] block_table, int start_pos,
              float scale, float[:, :, ::1] out):
    """Causal attention: out[t, h] = softmax(q[t, h].k_p * scale, p <= start_pos + t) . v_p, kv head h // (H / H_kv)."""
    attention_batch(q, k_cache, v_cache, np.asarray(block_table)[None, :], np.zeros(1, dtype=np.int32),
                    np.array([q.shape[0]], dtype=np.int32), np.array([start_pos], dtype=np.int32), scale, out)


def attention_batch(const float[:, :, ::1] q, k_cache, v_cache, const int32_t[:, ::1] tables,
                    const int32_t[::1] rows, const int32_t[::1] lengths, const int32_t[::1] starts, float scale,
                    float[:, :, ::1] out):
    """attention() for several sequences in one parallel pass: rows rows[i] .. rows[i]+lengths[i]-1 of q
    are positions starts[i] .. of the sequence whose block table is tables[i]."""
    cdef bint f16 = _check_cache(k_cache, v_cache, False)
    cdef Py_ssize_t T = q.shape[0], H = q.shape[1], d = q.shape[2]
    cdef Py_ssize_t n_kv = k_cache.shape[1]
    if out.shape[0] != T or out.shape[1] != H or out.shape[2] != d:
        raise ValueError("out must have the shape of q")
    if k_cache.shape[3] != d:
        raise ValueError(f"q has head dim {d}, the cache {k_cache.shape[3]}")
    if n_kv == 0 or H % n_kv:
        raise ValueError(f"{H} query heads cannot share {n_kv} kv heads")
    _check_items(tables, rows, lengths, starts, T, k_cache.shape[0], False)
    cdef Py_ssize_t n_seq = tables.shape[0], s, n_max = 0, n_tiles = 0
    cdef const char *kc = <const char *> cnp.PyArray_DATA(k_cache)
    cdef const char *vc = <const char *> cnp.PyArray_DATA(v_cache)
    cdef Py_ssize_t item = 2 if f16 else 4, group = H // n_kv
    cdef Py_ssize_t block_stride = n_kv * BASERT_KV_BLOCK * d
    # Work items: a tile of consecutive tokens of one sequence x a chunk of the query heads of one kv
    # head, at most BASERT_ATTN_MAX_ROWS rows, attended together so each K/V row is loaded once for all.
    cdef Py_ssize_t heads_per_chunk = min(group, BASERT_ATTN_MAX_ROWS)
    cdef Py_ssize_t chunks_per_group = (group + heads_per_chunk - 1) // heads_per_chunk
    cdef Py_ssize_t tokens_per_item = max(1, BASERT_ATTN_MAX_ROWS // heads_per_chunk)
    cdef Py_ssize_t per_tile = n_kv * chunks_per_group
    for s in range(n_seq):
        n_max = max(n_max, starts[s] + lengths[s])
        n_tiles += (lengths[s] + tokens_per_item - 1) // tokens_per_item
    if n_tiles == 0:
        return
    tile_seq_array = np.empty(n_tiles, dtype=np.int32)
    tile_row_array = np.empty(n_tiles, dtype=np.int32)
    cdef int32_t[::1] tile_seq = tile_seq_array, tile_row = tile_row_array
    cdef Py_ssize_t tile = 0, r
    for s in range(n_seq):
        for r in range(rows[s], rows[s] + lengths[s], tokens_per_item):
            tile_seq[tile] = s
            tile_row[tile] = r
            tile += 1
    cdef Py_ssize_t n_items = per_tile * n_tiles, i, t, h, t0, t1, h0, h1, kv_head, chunk, head_offset
    cdef int n_rows
    cdef float *scores = NULL
    cdef const float **rows_q = NULL
    cdef float **rows_out = NULL
    cdef Py_ssize_t *rows_pos = NULL
    cdef int failed = 0
    with nogil, parallel(num_threads=basert_threads_for(T * H * n_max * d)):
        scores = <float *> malloc(BASERT_ATTN_MAX_ROWS * n_max * sizeof(float))
        rows_q = <const float **> malloc(BASERT_ATTN_MAX_ROWS * sizeof(float *))
        rows_out = <float **> malloc(BASERT_ATTN_MAX_ROWS * sizeof(float *))
        rows_pos = <Py_ssize_t *> malloc(BASERT_ATTN_MAX_ROWS * sizeof(Py_ssize_t))
        for i in prange(n_items, schedule="dynamic"):
            if scores == NULL or rows_q == NULL or rows_out == NULL or rows_pos == NULL:
                failed += 1
                continue
            s = tile_seq[i // per_tile]
            t0 = tile_row[i // per_tile]
            t1 = min(rows[s] + lengths[s], t0 + tokens_per_item)
            kv_head = (i % per_tile) // chunks_per_group
            chunk = (i % per_tile) % chunks_per_group
            h0 = kv_head * group + chunk * heads_per_chunk
            h1 = min(h0 + heads_per_chunk, (kv_head + 1) * group)
            n_rows = 0
            for t in range(t0, t1):
                for h in range(h0, h1):
                    rows_q[n_rows] = &q[t, h, 0]
                    rows_out[n_rows] = &out[t, h, 0]
                    rows_pos[n_rows] = starts[s] + (t - rows[s]) + 1
                    n_rows = n_rows + 1
            head_offset = kv_head * BASERT_KV_BLOCK * d * item
            basert_attend_rows(n_rows, rows_q, rows_pos, kc + head_offset, vc + head_offset, f16, &tables[s, 0],
                               block_stride, d, scale, scores, n_max, rows_out)
        free(scores)
        free(rows_q)
        free(rows_out)
        free(rows_pos)
    if failed:
        raise MemoryError(f"no memory for {n_max} attention scores")
