# cython: language_level=3
"""Paged KV cache writes and causal GQA attention over it (blocks of 16 positions; rows of one of the KV types of
basert._ext.kvtypes, K and V each their own; GIL released). Groups of query rows sharing a kv head run in parallel; when there
are too few groups for the threads (decode), each group's position segments run in parallel and are
merged after, with the same bits as one thread doing the whole row (see attention.h)."""

import numpy as np
cimport numpy as cnp
from cython.parallel cimport parallel, prange, threadid

cdef extern from "simd.h" nogil:
    int basert_threads_for(Py_ssize_t elements)
from libc.stdint cimport int32_t

from basert._ext.kvtypes import kv_type_of

cnp.import_array()

cdef extern from "attention.h" nogil:
    const int BASERT_KV_BLOCK
    Py_ssize_t basert_kv_row_bytes(int type, Py_ssize_t d)
    void basert_kv_store(int type, const float *x, void *dst, Py_ssize_t d)
    enum: BASERT_ATTN_MAX_ROWS
    enum: BASERT_ATTN_SEGMENT
    Py_ssize_t BASERT_ATTN_ROWS_SCRATCH(Py_ssize_t n_rows, Py_ssize_t d)
    Py_ssize_t basert_attn_first(Py_ssize_t n, Py_ssize_t window)
    void basert_attend_segment(int n_rows, const float *const *q, const Py_ssize_t *n_pos, Py_ssize_t window,
                               Py_ssize_t p0, Py_ssize_t p1, const void *k, const void *v, int k_type, int v_type,
                               const int32_t *block_table, Py_ssize_t block_rows, Py_ssize_t d, float scale, float *scores, float *top,
                               float *sum, float *const *acc)
    void basert_attend_merge(int n_segments, const float *top, const float *sum, const float *acc,
                             Py_ssize_t acc_stride, Py_ssize_t d, float *out)
    void basert_attend_rows(int n_rows, const float *const *q, const Py_ssize_t *n_pos, Py_ssize_t window,
                            const void *k, const void *v,
                            int k_type, int v_type, const int32_t *block_table, Py_ssize_t block_rows, Py_ssize_t d,
                            float scale, float *scratch, float *const *out)

from basert._ext.scratch cimport basert_scratch_give, basert_scratch_pool, basert_scratch_take

# Attention's scratch, kept from one call to the next so that a decode step allocates nothing.
cdef basert_scratch_pool _scratch


cdef int _check_cache(k_cache, v_cache, Py_ssize_t d, bint writable, int *k_type, int *v_type) except -1:
    """Validates a (k, v) cache pair [n_blocks, H_kv, 16, row] of rows of d values; sets their KV type codes."""
    if not isinstance(k_cache, np.ndarray) or not isinstance(v_cache, np.ndarray):
        raise ValueError("k_cache and v_cache must be numpy arrays")
    if k_cache.ndim != 4 or v_cache.ndim != 4 or k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[2] != BASERT_KV_BLOCK:
        raise ValueError(f"caches must both have shape [n_blocks, H_kv, {BASERT_KV_BLOCK}, row], "
                         f"got {k_cache.shape} and {v_cache.shape}")
    k_type[0] = kv_type_of(k_cache, d).code
    v_type[0] = kv_type_of(v_cache, d).code
    if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        raise ValueError("caches must be C-contiguous")
    if writable and not (k_cache.flags.writeable and v_cache.flags.writeable):
        raise ValueError("caches must be writable")
    return 0


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
    cdef Py_ssize_t T = k.shape[0], n_kv = k.shape[1], d = k.shape[2]
    cdef int k_type, v_type
    _check_cache(k_cache, v_cache, d, True, &k_type, &v_type)
    if v.shape[0] != T or v.shape[1] != n_kv or v.shape[2] != d:
        raise ValueError("k and v must have the same shape")
    if k_cache.shape[1] != n_kv:
        raise ValueError(f"k, v have {n_kv} kv heads per token, the cache has {k_cache.shape[1]}")
    _check_items(tables, rows, lengths, starts, T, k_cache.shape[0], True, 0)
    cdef char *kc = <char *> cnp.PyArray_DATA(k_cache)
    cdef char *vc = <char *> cnp.PyArray_DATA(v_cache)
    cdef Py_ssize_t k_bytes = basert_kv_row_bytes(k_type, d), v_bytes = basert_kv_row_bytes(v_type, d)
    cdef Py_ssize_t s, t, h, p, row
    with nogil:
        for s in range(tables.shape[0]):
            for t in range(rows[s], rows[s] + lengths[s]):
                p = starts[s] + t - rows[s]
                for h in range(n_kv):
                    row = tables[s, p // BASERT_KV_BLOCK] * n_kv * BASERT_KV_BLOCK + h * BASERT_KV_BLOCK + p % BASERT_KV_BLOCK
                    basert_kv_store(k_type, &k[t, h, 0], kc + row * k_bytes, d)
                    basert_kv_store(v_type, &v[t, h, 0], vc + row * v_bytes, d)


cdef int _check_items(const int32_t[:, ::1] tables, const int32_t[::1] rows, const int32_t[::1] lengths,
                      const int32_t[::1] starts, Py_ssize_t n_rows, Py_ssize_t n_blocks, bint writing,
                      Py_ssize_t window) except -1:
    """Checks each sequence's rows against the batch and its block table against the cache: the entries of the
    positions written, or of every position read (from the first row's window on, with a sliding window)."""
    cdef Py_ssize_t n = tables.shape[0], s
    if rows.shape[0] != n or lengths.shape[0] != n or starts.shape[0] != n:
        raise ValueError("tables, rows, lengths and starts must describe the same sequences")
    for s in range(n):
        if starts[s] < 0:
            raise ValueError(f"start_pos must be >= 0, got {starts[s]}")
        if lengths[s] < 0 or rows[s] < 0 or rows[s] + lengths[s] > n_rows:
            raise ValueError(f"sequence {s} rows {rows[s]}..{rows[s] + lengths[s]} are outside the {n_rows} rows")
        if lengths[s]:
            _check_blocks(tables[s], starts[s] + lengths[s], n_blocks,
                          starts[s] if writing else basert_attn_first(starts[s] + 1, window))
    return 0


def attention(const float[:, :, ::1] q, k_cache, v_cache, const int32_t[::1] block_table, int start_pos,
              float scale, float[:, :, ::1] out):
    """Causal attention: out[t, h] = softmax(q[t, h].k_p * scale, p <= start_pos + t) . v_p, kv head h // (H / H_kv)."""
    attention_batch(q, k_cache, v_cache, np.asarray(block_table)[None, :], np.zeros(1, dtype=np.int32),
                    np.array([q.shape[0]], dtype=np.int32), np.array([start_pos], dtype=np.int32), scale, out)


cdef struct Plan:
    # Work units: a tile of consecutive tokens of one sequence x a chunk of the query heads of one kv
    # head, at most BASERT_ATTN_MAX_ROWS rows, attended together so each K/V row is loaded once for all.
    const float *q
    float *out
    Py_ssize_t H, d
    const int32_t *rows
    const int32_t *lengths
    const int32_t *starts
    const int32_t *tables
    Py_ssize_t table_stride
    const int32_t *tile_seq
    const int32_t *tile_row
    Py_ssize_t group, heads_per_chunk, chunks_per_group, tokens_per_item, per_tile
    const char *kc
    const char *vc
    Py_ssize_t block_rows, k_bytes, v_bytes   # rows per cache block; bytes per K row, per V row
    int k_type, v_type
    float scale
    Py_ssize_t window   # sliding window in positions, 0 for none
    # Segment partials (split plans): unit u's row r keeps max_seg tops, max_seg sums, then max_seg
    # accumulators of d floats, at parts + (u * BASERT_ATTN_MAX_ROWS + r) * max_seg * (d + 2).
    float *parts
    Py_ssize_t max_seg


cdef int _unit_rows(const Plan *pl, Py_ssize_t u, const float **rows_q, float **rows_out, Py_ssize_t *rows_pos,
                    const int32_t **table, Py_ssize_t *head_row) noexcept nogil:
    """The query rows of unit u, with their output rows and positions seen; returns their count."""
    cdef Py_ssize_t tile = u // pl.per_tile, s = pl.tile_seq[tile], t0 = pl.tile_row[tile], t, h
    cdef Py_ssize_t t1 = min(pl.rows[s] + pl.lengths[s], t0 + pl.tokens_per_item)
    cdef Py_ssize_t kv_head = (u % pl.per_tile) // pl.chunks_per_group, chunk = (u % pl.per_tile) % pl.chunks_per_group
    cdef Py_ssize_t h0 = kv_head * pl.group + chunk * pl.heads_per_chunk
    cdef Py_ssize_t h1 = min(h0 + pl.heads_per_chunk, (kv_head + 1) * pl.group)
    cdef int n = 0
    for t in range(t0, t1):
        for h in range(h0, h1):
            rows_q[n] = pl.q + (t * pl.H + h) * pl.d
            rows_out[n] = pl.out + (t * pl.H + h) * pl.d
            rows_pos[n] = pl.starts[s] + (t - pl.rows[s]) + 1
            n += 1
    table[0] = pl.tables + s * pl.table_stride
    head_row[0] = kv_head * BASERT_KV_BLOCK
    return n


cdef void _attend_unit(const Plan *pl, Py_ssize_t u, float *scratch) noexcept nogil:
    """Unit u's rows, whole, on this thread."""
    cdef const float *rows_q[BASERT_ATTN_MAX_ROWS]
    cdef float *rows_out[BASERT_ATTN_MAX_ROWS]
    cdef Py_ssize_t rows_pos[BASERT_ATTN_MAX_ROWS]
    cdef const int32_t *table
    cdef Py_ssize_t head_row
    cdef int n = _unit_rows(pl, u, rows_q, rows_out, rows_pos, &table, &head_row)
    basert_attend_rows(n, rows_q, rows_pos, pl.window, pl.kc + head_row * pl.k_bytes, pl.vc + head_row * pl.v_bytes,
                       pl.k_type, pl.v_type, table, pl.block_rows, pl.d, pl.scale, scratch, rows_out)


cdef void _attend_unit_segment(const Plan *pl, Py_ssize_t u, Py_ssize_t j, float *scratch) noexcept nogil:
    """The partials of segment j of unit u's rows (nothing for rows that end before it)."""
    cdef const float *rows_q[BASERT_ATTN_MAX_ROWS]
    cdef float *rows_out[BASERT_ATTN_MAX_ROWS]
    cdef float *acc[BASERT_ATTN_MAX_ROWS]
    cdef float top[BASERT_ATTN_MAX_ROWS]
    cdef float total[BASERT_ATTN_MAX_ROWS]
    cdef Py_ssize_t rows_pos[BASERT_ATTN_MAX_ROWS]
    cdef const int32_t *table
    cdef Py_ssize_t head_row, n_max = 0, p0 = j * BASERT_ATTN_SEGMENT, p1
    cdef Py_ssize_t row_floats = pl.max_seg * (pl.d + 2)
    cdef int n = _unit_rows(pl, u, rows_q, rows_out, rows_pos, &table, &head_row), r
    cdef float *part
    for r in range(n):
        n_max = max(n_max, rows_pos[r])
        acc[r] = pl.parts + (u * BASERT_ATTN_MAX_ROWS + r) * row_floats + 2 * pl.max_seg + j * pl.d
    if p0 >= n_max:
        return
    p1 = min(p0 + BASERT_ATTN_SEGMENT, n_max)
    basert_attend_segment(n, rows_q, rows_pos, pl.window, p0, p1, pl.kc + head_row * pl.k_bytes, pl.vc + head_row * pl.v_bytes,
                          pl.k_type, pl.v_type, table, pl.block_rows, pl.d, pl.scale, scratch, top, total, acc)
    for r in range(n):
        if rows_pos[r] > p0 and basert_attn_first(rows_pos[r], pl.window) < p0 + BASERT_ATTN_SEGMENT:
            part = pl.parts + (u * BASERT_ATTN_MAX_ROWS + r) * row_floats
            part[j] = top[r]
            part[pl.max_seg + j] = total[r]


cdef void _merge_unit(const Plan *pl, Py_ssize_t u) noexcept nogil:
    """Unit u's outputs from the partials of all their segments."""
    cdef const float *rows_q[BASERT_ATTN_MAX_ROWS]
    cdef float *rows_out[BASERT_ATTN_MAX_ROWS]
    cdef Py_ssize_t rows_pos[BASERT_ATTN_MAX_ROWS]
    cdef const int32_t *table
    cdef Py_ssize_t head_row, row_floats = pl.max_seg * (pl.d + 2)
    cdef int n = _unit_rows(pl, u, rows_q, rows_out, rows_pos, &table, &head_row), r
    cdef Py_ssize_t first
    cdef float *part
    for r in range(n):
        part = pl.parts + (u * BASERT_ATTN_MAX_ROWS + r) * row_floats
        first = basert_attn_first(rows_pos[r], pl.window) // BASERT_ATTN_SEGMENT
        basert_attend_merge((rows_pos[r] + BASERT_ATTN_SEGMENT - 1) // BASERT_ATTN_SEGMENT - first, part + first,
                            part + pl.max_seg + first, part + 2 * pl.max_seg + first * pl.d, pl.d, pl.d, rows_out[r])


def attention_batch(const float[:, :, ::1] q, k_cache, v_cache, const int32_t[:, ::1] tables,
                    const int32_t[::1] rows, const int32_t[::1] lengths, const int32_t[::1] starts, float scale,
                    float[:, :, ::1] out, Py_ssize_t window=0):
    """attention() for several sequences in one parallel pass: rows rows[i] .. rows[i]+lengths[i]-1 of q
    are positions starts[i] .. of the sequence whose block table is tables[i]. With a sliding window W > 0 the
    token at position p attends to positions max(0, p - W + 1) .. p only."""
    cdef Py_ssize_t T = q.shape[0], H = q.shape[1], d = q.shape[2]
    cdef int k_type, v_type
    _check_cache(k_cache, v_cache, d, False, &k_type, &v_type)
    cdef Py_ssize_t n_kv = k_cache.shape[1]
    if out.shape[0] != T or out.shape[1] != H or out.shape[2] != d:
        raise ValueError("out must have the shape of q")
    if n_kv == 0 or H % n_kv:
        raise ValueError(f"{H} query heads cannot share {n_kv} kv heads")
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: none), got {window}")
    _check_items(tables, rows, lengths, starts, T, k_cache.shape[0], False, window)
    cdef Plan pl
    cdef Py_ssize_t n_seq = tables.shape[0], s, r, n_max = 0, n_tiles = 0, tile = 0
    pl.group = H // n_kv
    pl.heads_per_chunk = min(pl.group, BASERT_ATTN_MAX_ROWS)
    pl.chunks_per_group = (pl.group + pl.heads_per_chunk - 1) // pl.heads_per_chunk
    pl.tokens_per_item = max(1, BASERT_ATTN_MAX_ROWS // pl.heads_per_chunk)
    pl.per_tile = n_kv * pl.chunks_per_group
    for s in range(n_seq):
        n_max = max(n_max, starts[s] + lengths[s])
        n_tiles += (lengths[s] + pl.tokens_per_item - 1) // pl.tokens_per_item
    if n_tiles == 0:
        return
    cdef Py_ssize_t n_units = pl.per_tile * n_tiles, u, i
    cdef int nt = basert_threads_for(T * H * n_max * d)
    # Too few units to keep the threads busy (decode): split them into position segments too.
    cdef bint split = nt > 1 and n_max > BASERT_ATTN_SEGMENT and n_units < 8 * nt
    pl.max_seg = (n_max + BASERT_ATTN_SEGMENT - 1) // BASERT_ATTN_SEGMENT if split else 0
    cdef Py_ssize_t per_thread = BASERT_ATTN_ROWS_SCRATCH(BASERT_ATTN_MAX_ROWS, d)
    cdef Py_ssize_t parts_floats = n_units * BASERT_ATTN_MAX_ROWS * pl.max_seg * (d + 2)
    cdef int owned
    cdef float *scratch = <float *> basert_scratch_take(&_scratch, (2 * n_tiles + nt * per_thread + parts_floats) * sizeof(float),
                                                        &owned)
    if scratch == NULL:
        raise MemoryError(f"no memory for attention scratch over {n_max} positions")
    cdef int32_t *tile_seq = <int32_t *> scratch
    cdef int32_t *tile_row = tile_seq + n_tiles
    cdef float *thread_scratch = scratch + 2 * n_tiles
    for s in range(n_seq):
        for r in range(rows[s], rows[s] + lengths[s], pl.tokens_per_item):
            tile_seq[tile] = s
            tile_row[tile] = r
            tile += 1
    pl.q = &q[0, 0, 0]
    pl.out = &out[0, 0, 0]
    pl.H = H
    pl.d = d
    pl.rows = &rows[0]
    pl.lengths = &lengths[0]
    pl.starts = &starts[0]
    pl.tables = &tables[0, 0]
    pl.table_stride = tables.shape[1]
    pl.tile_seq = tile_seq
    pl.tile_row = tile_row
    pl.kc = <const char *> cnp.PyArray_DATA(k_cache)
    pl.vc = <const char *> cnp.PyArray_DATA(v_cache)
    pl.block_rows = n_kv * BASERT_KV_BLOCK
    pl.k_type, pl.v_type = k_type, v_type
    pl.k_bytes, pl.v_bytes = basert_kv_row_bytes(k_type, d), basert_kv_row_bytes(v_type, d)
    pl.scale = scale
    pl.window = window
    pl.parts = thread_scratch + nt * per_thread
    with nogil:
        if not split:
            for u in prange(n_units, num_threads=nt, schedule="dynamic"):
                _attend_unit(&pl, u, thread_scratch + threadid() * per_thread)
        else:
            with parallel(num_threads=nt):
                for i in prange(n_units * pl.max_seg, schedule="dynamic"):
                    _attend_unit_segment(&pl, i % n_units, i // n_units, thread_scratch + threadid() * per_thread)
                for u in prange(n_units, schedule="static"):
                    _merge_unit(&pl, u)
        basert_scratch_give(&_scratch, scratch, owned)


SEGMENT = BASERT_ATTN_SEGMENT


def segment_partials(const float[:, ::1] q, k_cache, v_cache, int kv_head, const int32_t[::1] block_table,
                     const Py_ssize_t[::1] n_pos, Py_ssize_t p0, Py_ssize_t p1, float scale, Py_ssize_t window=0):
    """basert_attend_segment over positions p0 .. p1-1 for query rows q [R, d] of kv head kv_head, row r
    seeing positions 0 .. n_pos[r]-1 (the last `window` of them when window > 0): (top [R], sum [R],
    acc [R, d]), NaN for rows that take no part (ended by p0, or windowed to start at or after p1)."""
    cdef Py_ssize_t n_rows = q.shape[0], d = q.shape[1], n_max = 0, r
    cdef int k_type, v_type
    _check_cache(k_cache, v_cache, d, False, &k_type, &v_type)
    if n_pos.shape[0] != n_rows or not 0 <= kv_head < k_cache.shape[1]:
        raise ValueError("q, n_pos, kv_head and the cache disagree")
    for r in range(n_rows):
        n_max = max(n_max, n_pos[r])
    if p0 % BASERT_ATTN_SEGMENT or not p0 < p1 <= min(p0 + BASERT_ATTN_SEGMENT, n_max):
        raise ValueError(f"segment {p0}..{p1} is not one of rows seeing up to {n_max} positions")
    _check_blocks(block_table, n_max, k_cache.shape[0], 0)
    top = np.full(n_rows, np.nan, dtype=np.float32)
    total = np.full(n_rows, np.nan, dtype=np.float32)
    acc = np.full((n_rows, d), np.nan, dtype=np.float32)
    scores = np.empty(n_rows * BASERT_ATTN_SEGMENT, dtype=np.float32)
    cdef float[::1] top_v = top, total_v = total, scores_v = scores
    cdef float[:, ::1] acc_v = acc
    rows_array = np.empty(n_rows, dtype=np.uintp)
    acc_array = np.empty(n_rows, dtype=np.uintp)
    cdef size_t[::1] rows_q = rows_array, rows_acc = acc_array
    for r in range(n_rows):
        rows_q[r] = <size_t> &q[r, 0]
        rows_acc[r] = <size_t> &acc_v[r, 0]
    cdef Py_ssize_t head_row = kv_head * BASERT_KV_BLOCK
    cdef const char *kc = <const char *> cnp.PyArray_DATA(k_cache) + head_row * basert_kv_row_bytes(k_type, d)
    cdef const char *vc = <const char *> cnp.PyArray_DATA(v_cache) + head_row * basert_kv_row_bytes(v_type, d)
    cdef Py_ssize_t block_rows = k_cache.shape[1] * BASERT_KV_BLOCK
    with nogil:
        basert_attend_segment(n_rows, <const float *const *> &rows_q[0], &n_pos[0], window, p0, p1, kc,
                              vc, k_type, v_type, &block_table[0], block_rows, d,
                              scale, &scores_v[0], &top_v[0], &total_v[0], <float *const *> &rows_acc[0])
    return top, total, acc


def merge_partials(const float[::1] top, const float[::1] total, const float[:, ::1] acc):
    """basert_attend_merge: one row's output from its segments' partials (top, sum, acc [n_segments, d])."""
    cdef Py_ssize_t n = top.shape[0], d = acc.shape[1]
    if n == 0 or total.shape[0] != n or acc.shape[0] != n:
        raise ValueError("top, sum and acc must describe the same segments")
    out = np.empty(d, dtype=np.float32)
    cdef float[::1] out_v = out
    with nogil:
        basert_attend_merge(<int> n, &top[0], &total[0], &acc[0, 0], d, d, &out_v[0])
    return out
