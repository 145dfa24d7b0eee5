# cython: language_level=3
"""The decode step of a pre-norm attention decoder in one call: every layer and the head run as
phases of one job of a persistent thread team (graph.h, team.h), with no Python and no OpenMP region
per kernel. The model files describe the layers (basert.models.plan builds the description); results
are bit-identical to the per-kernel path."""

import os

import numpy as np
cimport numpy as cnp
from libc.stdint cimport int32_t, uint8_t
from libc.stdlib cimport free, malloc

from basert._ext.kvtypes import kv_type_of

cnp.import_array()

cdef extern from "graph.h" nogil:
    ctypedef struct basert_weight:
        Py_ssize_t n, k
    Py_ssize_t basert_qrow_bytes(Py_ssize_t k)
    ctypedef struct basert_member_stats:
        unsigned long long wait_ns, waits
    ctypedef struct basert_team:
        int n_threads
        basert_member_stats *stats
        unsigned long long jobs, job_ns
    basert_team *basert_team_new(int n_threads)
    void basert_team_free(basert_team *t)
    ctypedef void (*basert_phase_fn)(void *ctx, int phase, int chunk, int member)
    ctypedef void (*basert_phase_prologue_fn)(void *ctx, int phase, int member)
    void basert_team_run(basert_team *t, void *ctx, basert_phase_fn fn, basert_phase_prologue_fn prologue,
                         int n_phases, const int32_t *chunks)
    const int BASERT_TEAM_MAX_PHASES
    const int BASERT_KV_BLOCK
    const int BASERT_ATTN_SEGMENT
    const int BG_PHASES_PER_LAYER
    const int BG_SWIGLU
    const int BG_GEGLU
    ctypedef struct bg_layer:
        const float *input_norm
        const float *post_norm
        const float *attn_out_norm
        const float *mlp_out_norm
        const float *q_norm
        const float *k_norm
        const float *bq
        const float *bk
        const float *bv
        const float *cos
        const float *sin
        Py_ssize_t window
        const basert_weight *wq
        const basert_weight *wk
        const basert_weight *wv
        const basert_weight *wo
        const basert_weight *wgate
        const basert_weight *wup
        const basert_weight *wdown
        char *k_cache
        char *v_cache
    ctypedef struct bg_model:
        int n_layers, n_heads, n_kv, head_dim, rope_half, interleaved, k_type, v_type, max_tokens, n_members, activation
        Py_ssize_t dim, ffn, vocab, max_pos
        float eps, scale
        const float *final_norm
        const basert_weight *head
        bg_layer *layers
        float *x
        float *normed
        uint8_t *quantized
        Py_ssize_t max_k
        float *q
        float *k
        float *v
        float *attn
        float *delta
        float *gate
        float *up
        float *logits
        int unit_rows, max_segments
        float *scores
        float *part_top
        float *part_sum
        float *part_acc
        int32_t *attn_chunks
        int32_t *merge_units
        int T, n_items, n_logits, table_stride
        const int32_t *positions
        const int32_t *item_rows
        const int32_t *item_lengths
        const int32_t *item_starts
        const int32_t *tables
        const int32_t *logit_rows
        const int32_t *window_tables
    void bg_prologue(void *ctx, int phase, int member)
    void bg_chunk(void *ctx, int phase, int chunk, int member)
    int bg_plan_step(bg_model *m, int32_t *chunks)
    void bg_plan_chunks(bg_model *m)


cdef const basert_weight *_weight(w, Py_ssize_t n, Py_ssize_t k, str what) except NULL:
    cdef const basert_weight *c = <const basert_weight *> <size_t> w.c_address
    if c.n != n or c.k != k:
        raise ValueError(f"{what} is [{c.n}, {c.k}], expected [{n}, {k}]")
    return c


cdef const float *_vector(a, Py_ssize_t n, str what) except? NULL:
    if a is None:
        return NULL
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or not a.flags.c_contiguous or a.size != n:
        raise ValueError(f"{what} must be a contiguous float32 array of {n} values")
    return <const float *> cnp.PyArray_DATA(a)


cdef float *_buffer(list keep, shape):
    a = np.zeros(shape, dtype=np.float32)
    keep.append(a)
    return <float *> cnp.PyArray_DATA(a)


cdef class DecodeGraph:
    """One model's decode step. `layers` holds, per layer, a dict with input_norm, post_norm, q_norm, k_norm,
    attn_out_norm, mlp_out_norm (float32 arrays or None; the last two norm the attention and MLP outputs
    before they are added to the residual), bq, bk, bv (the q, k and v projections' biases, float32 arrays or
    None), wq, wk, wv, wo, wgate, wup, wdown (basert._ext.matmul.Weight),
    cos and sin (the layer's RoPE tables, [max_pos, rotary_dim / 2], one shape for all layers) and window
    (the sliding window in positions, 0 for none). `activation` is the MLP's: "silu" or "gelu_tanh"."""

    cdef bg_model m
    cdef bg_layer *layers
    cdef basert_team *team
    cdef int team_pid
    cdef int32_t *chunks
    cdef list keep
    cdef list member_buffers  # the current team's per-member buffers (replaced with the team)
    cdef object k_bound, v_bound
    cdef readonly int max_tokens
    cdef readonly Py_ssize_t n_blocks, n_window_blocks
    cdef bint has_global               # whether some layer sees every position
    cdef readonly Py_ssize_t window    # the widest sliding window of the layers (0: none)

    def __cinit__(self):
        self.layers = NULL
        self.team = NULL
        self.chunks = NULL

    def __init__(self, list layers, final_norm, head, bint interleaved, int n_heads, int n_kv, int head_dim,
                 float eps, float scale, str activation="silu", int max_tokens=16):
        cdef Py_ssize_t n_layers = len(layers), i
        if n_layers == 0 or n_layers * BG_PHASES_PER_LAYER + 1 > BASERT_TEAM_MAX_PHASES:
            raise ValueError(f"a decode graph takes 1 to {(BASERT_TEAM_MAX_PHASES - 1) // BG_PHASES_PER_LAYER} layers")
        if n_heads <= 0 or n_kv <= 0 or n_heads % n_kv or head_dim <= 0 or max_tokens <= 0:
            raise ValueError("bad head counts, head_dim or max_tokens")
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"unknown MLP activation {activation!r}")
        tables = []
        for i in range(n_layers):
            cos = np.ascontiguousarray(layers[i]["cos"], dtype=np.float32)
            sin = np.ascontiguousarray(layers[i]["sin"], dtype=np.float32)
            if cos.ndim != 2 or cos.shape != sin.shape or 2 * cos.shape[1] > head_dim:
                raise ValueError("cos and sin tables must be [max_pos, rotary_dim / 2] with rotary_dim <= head_dim")
            if tables and cos.shape != tables[0][0].shape:
                raise ValueError("every layer's RoPE tables must have one shape")
            if layers[i].get("window", 0) < 0:
                raise ValueError(f"layer {i}: negative sliding window")
            tables.append((cos, sin))
        self.keep = [layers, final_norm, head, tables]
        self.window = max(layer.get("window", 0) for layer in layers)
        cdef Py_ssize_t dim = head.k, vocab = head.n, qdim = n_heads * head_dim, kvdim = n_kv * head_dim
        cdef Py_ssize_t ffn = layers[0]["wgate"].n
        self.layers = <bg_layer *> malloc(n_layers * sizeof(bg_layer))
        self.chunks = <int32_t *> malloc(BASERT_TEAM_MAX_PHASES * sizeof(int32_t))
        if self.layers == NULL or self.chunks == NULL:
            raise MemoryError()
        cdef bg_layer *l
        for i in range(n_layers):
            spec = layers[i]
            l = &self.layers[i]
            l.input_norm = _vector(spec["input_norm"], dim, "input_norm")
            l.post_norm = _vector(spec["post_norm"], dim, "post_norm")
            l.attn_out_norm = _vector(spec.get("attn_out_norm"), dim, "attn_out_norm")
            l.mlp_out_norm = _vector(spec.get("mlp_out_norm"), dim, "mlp_out_norm")
            l.q_norm = _vector(spec.get("q_norm"), head_dim, "q_norm")
            l.k_norm = _vector(spec.get("k_norm"), head_dim, "k_norm")
            if l.input_norm == NULL or l.post_norm == NULL or (l.q_norm == NULL) != (l.k_norm == NULL):
                raise ValueError(f"layer {i}: norms missing")
            l.bq = _vector(spec.get("bq"), qdim, "bq")
            l.bk = _vector(spec.get("bk"), kvdim, "bk")
            l.bv = _vector(spec.get("bv"), kvdim, "bv")
            if (l.bq == NULL) != (l.bk == NULL) or (l.bq == NULL) != (l.bv == NULL):
                raise ValueError(f"layer {i}: q, k and v biases go together")
            l.wq = _weight(spec["wq"], qdim, dim, f"layer {i} wq")
            l.wk = _weight(spec["wk"], kvdim, dim, f"layer {i} wk")
            l.wv = _weight(spec["wv"], kvdim, dim, f"layer {i} wv")
            l.wo = _weight(spec["wo"], dim, qdim, f"layer {i} wo")
            l.wgate = _weight(spec["wgate"], ffn, dim, f"layer {i} wgate")
            l.wup = _weight(spec["wup"], ffn, dim, f"layer {i} wup")
            l.wdown = _weight(spec["wdown"], dim, ffn, f"layer {i} wdown")
            l.cos = <const float *> cnp.PyArray_DATA(tables[i][0])
            l.sin = <const float *> cnp.PyArray_DATA(tables[i][1])
            l.window = spec.get("window", 0)
            l.k_cache = NULL
            l.v_cache = NULL
        cdef bg_model *m = &self.m
        m.n_layers, m.n_heads, m.n_kv, m.head_dim = n_layers, n_heads, n_kv, head_dim
        m.rope_half, m.interleaved, m.k_type, m.v_type, m.max_tokens = tables[0][0].shape[1], interleaved, 0, 0, max_tokens
        m.dim, m.ffn, m.vocab, m.max_pos = dim, ffn, vocab, tables[0][0].shape[0]
        m.max_k = max(dim, qdim, ffn)
        m.eps, m.scale = eps, scale
        m.activation = BG_GEGLU if activation == "gelu_tanh" else BG_SWIGLU
        m.final_norm = _vector(final_norm, dim, "final_norm")
        m.head = _weight(head, vocab, dim, "head")
        m.layers = self.layers
        m.q = _buffer(self.keep, (max_tokens, qdim))
        m.k = _buffer(self.keep, (max_tokens, kvdim))
        m.v = _buffer(self.keep, (max_tokens, kvdim))
        m.attn = _buffer(self.keep, (max_tokens, qdim))
        m.delta = _buffer(self.keep, (max_tokens, dim))
        m.gate = _buffer(self.keep, (max_tokens, ffn))
        m.up = _buffer(self.keep, (max_tokens, ffn))
        m.unit_rows = max_tokens * (n_heads // n_kv)
        m.max_segments = (m.max_pos + BASERT_ATTN_SEGMENT - 1) // BASERT_ATTN_SEGMENT
        m.part_top = _buffer(self.keep, (max_tokens * n_heads, m.max_segments))
        m.part_sum = _buffer(self.keep, (max_tokens * n_heads, m.max_segments))
        m.part_acc = _buffer(self.keep, (max_tokens * n_heads, m.max_segments, head_dim))
        chunk_table = np.zeros((max_tokens * n_kv * m.max_segments, 2), dtype=np.int32)
        merge_units = np.zeros(max_tokens * n_kv, dtype=np.int32)
        self.keep += [chunk_table, merge_units]
        m.attn_chunks = <int32_t *> cnp.PyArray_DATA(chunk_table)
        m.merge_units = <int32_t *> cnp.PyArray_DATA(merge_units)
        m.n_members = 0
        self.max_tokens = max_tokens
        self.k_bound = None
        self.v_bound = None

    def __dealloc__(self):
        if self.team != NULL and self.team_pid == os.getpid():
            basert_team_free(self.team)
        free(self.layers)
        free(self.chunks)

    cdef int _ensure_team(self, int n_threads) except -1:
        """A team of n_threads members in this process (a forked child starts its own)."""
        pid = os.getpid()
        if self.team != NULL and self.team_pid == pid and self.team.n_threads == n_threads:
            return 0
        if self.team != NULL and self.team_pid == pid:
            basert_team_free(self.team)
        self.team = basert_team_new(n_threads)
        if self.team == NULL:
            raise MemoryError("cannot start the decode thread team")
        self.team_pid = pid
        cdef bg_model *m = &self.m
        m.n_members = self.team.n_threads
        self.member_buffers = []
        m.normed = _buffer(self.member_buffers, (m.n_members, m.max_tokens, m.dim))
        quantized = np.zeros((m.n_members, m.max_tokens, basert_qrow_bytes(m.max_k)), dtype=np.uint8)
        self.member_buffers.append(quantized)
        m.quantized = <uint8_t *> cnp.PyArray_DATA(quantized)
        # Per member: the scores of one segment of a unit's rows, then the unit's row pointers (graph.h).
        m.scores = _buffer(self.member_buffers, (m.n_members, m.unit_rows * (BASERT_ATTN_SEGMENT + 8)))
        bg_plan_chunks(m)
        return 0

    cdef int _bind_kv(self, list k_caches, list v_caches) except -1:
        if k_caches is self.k_bound and v_caches is self.v_bound:
            return 0
        cdef bg_model *m = &self.m
        if len(k_caches) != m.n_layers or len(v_caches) != m.n_layers:
            raise ValueError(f"{m.n_layers} layers need as many K and V caches")
        k_type, v_type = kv_type_of(k_caches[0], m.head_dim), kv_type_of(v_caches[0], m.head_dim)
        # Layers that see every position share one block count, sliding-window layers (their own pool) another.
        blocks = {}
        for caches in (k_caches, v_caches):
            for i in range(m.n_layers):
                cache, windowed = caches[i], self.layers[i].window > 0
                if (not isinstance(cache, np.ndarray) or cache.ndim != 4 or cache.shape[1] != m.n_kv
                        or cache.shape[2] != BASERT_KV_BLOCK or cache.dtype != caches[0].dtype
                        or cache.shape[3] != caches[0].shape[3] or not cache.flags.c_contiguous
                        or not cache.flags.writeable):
                    raise ValueError(f"the K (and the V) caches must be writable C-contiguous arrays "
                                     f"[n_blocks, {m.n_kv}, {BASERT_KV_BLOCK}, row] of one type")
                if blocks.setdefault(windowed, cache.shape[0]) != cache.shape[0]:
                    raise ValueError("the caches of the layers that see every position (and those of the "
                                     "sliding-window layers) must have as many blocks")
        for i in range(m.n_layers):
            self.layers[i].k_cache = <char *> cnp.PyArray_DATA(k_caches[i])
            self.layers[i].v_cache = <char *> cnp.PyArray_DATA(v_caches[i])
        m.k_type, m.v_type = k_type.code, v_type.code
        self.k_bound, self.v_bound = k_caches, v_caches
        self.has_global = False in blocks
        self.n_blocks = blocks.get(False, 0)
        self.n_window_blocks = blocks.get(True, 0)
        return 0

    def team_stats(self, bint reset=False):
        """Decode steps run by the thread team, their wall seconds, and each member's seconds spent waiting at
        phase boundaries (spinning or asleep); `reset` zeroes them after reading."""
        if self.team == NULL or self.team_pid != os.getpid():
            return {"steps": 0, "seconds": 0.0, "wait_seconds": []}
        cdef int i
        stats = {"steps": self.team.jobs, "seconds": self.team.job_ns * 1e-9,
                 "wait_seconds": [self.team.stats[i].wait_ns * 1e-9 for i in range(self.team.n_threads)]}
        if reset:
            self.team.jobs = self.team.job_ns = 0
            for i in range(self.team.n_threads):
                self.team.stats[i].wait_ns = self.team.stats[i].waits = 0
        return stats

    def run(self, float[:, ::1] x, list k_caches, list v_caches, const int32_t[::1] positions,
            const int32_t[::1] rows, const int32_t[::1] lengths, const int32_t[::1] starts,
            const int32_t[:, ::1] tables, const int32_t[:, ::1] window_tables, const int32_t[::1] logit_rows,
            float[:, ::1] logits, int n_threads):
        """Run every layer over the T new tokens whose embeddings are in x [T, D] (x ends as the last
        residual stream), writing their K/V into the caches, and the head over x's logit_rows into
        logits [len(logit_rows), vocab]. Item i is rows rows[i] .. +lengths[i] of x, at positions
        starts[i] .. of the sequence whose block table is tables[i] (window_tables[i] for the sliding-window
        layers, whose entries before the window may be -1)."""
        cdef bg_model *m = &self.m
        cdef Py_ssize_t T = x.shape[0], n_items = rows.shape[0], i, b, n_blocks
        if T <= 0 or T > m.max_tokens or x.shape[1] != m.dim:
            raise ValueError(f"x must be [1..{m.max_tokens}, {m.dim}], got [{T}, {x.shape[1]}]")
        if positions.shape[0] != T or lengths.shape[0] != n_items or starts.shape[0] != n_items \
                or tables.shape[0] != n_items or window_tables.shape[0] != n_items \
                or window_tables.shape[1] != tables.shape[1]:
            raise ValueError("positions, rows, lengths, starts and tables disagree")
        if logits.shape[0] != logit_rows.shape[0] or logits.shape[1] != m.vocab:
            raise ValueError(f"logits must be [{logit_rows.shape[0]}, {m.vocab}]")
        self._bind_kv(k_caches, v_caches)
        self._ensure_team(n_threads)
        cdef Py_ssize_t covered = 0
        for i in range(n_items):
            if rows[i] != covered or lengths[i] <= 0 or covered + lengths[i] > T or starts[i] < 0 or starts[i] + lengths[i] > m.max_pos:
                raise ValueError(f"item {i} does not continue the rows or leaves the context")
            for b in range(lengths[i]):
                if positions[covered + b] != starts[i] + b:
                    raise ValueError(f"item {i}'s positions do not follow its start")
            covered += lengths[i]
            n_blocks = (starts[i] + lengths[i] + BASERT_KV_BLOCK - 1) // BASERT_KV_BLOCK
            if n_blocks > tables.shape[1]:
                raise ValueError(f"item {i}'s block table is too short")
            if self.has_global:
                for b in range(n_blocks):
                    if tables[i, b] < 0 or tables[i, b] >= self.n_blocks:
                        raise ValueError(f"item {i}'s block table names block {tables[i, b]}")
            if self.window:
                for b in range(max(0, starts[i] + 1 - self.window) // BASERT_KV_BLOCK, n_blocks):
                    if window_tables[i, b] < 0 or window_tables[i, b] >= self.n_window_blocks:
                        raise ValueError(f"item {i}'s window block table names block {window_tables[i, b]}")
        if covered != T:
            raise ValueError("items must cover the rows of x")
        for i in range(logit_rows.shape[0]):
            if logit_rows[i] < 0 or logit_rows[i] >= T:
                raise ValueError(f"logit row {logit_rows[i]} outside the {T} rows")
        if logit_rows.shape[0] > m.max_tokens:
            raise ValueError("more logit rows than tokens")
        m.x = &x[0, 0]
        m.T, m.n_items, m.n_logits, m.table_stride = T, n_items, logit_rows.shape[0], tables.shape[1]
        m.positions = &positions[0]
        m.item_rows, m.item_lengths, m.item_starts = &rows[0], &lengths[0], &starts[0]
        m.tables = &tables[0, 0]
        m.window_tables = &window_tables[0, 0]
        m.logit_rows = &logit_rows[0] if logit_rows.shape[0] else NULL
        m.logits = &logits[0, 0] if logits.shape[0] else NULL
        cdef int n_phases = bg_plan_step(m, self.chunks)
        with nogil:
            basert_team_run(self.team, m, bg_chunk, bg_prologue, n_phases, self.chunks)
