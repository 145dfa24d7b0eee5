# cython: language_level=3
"""Matmul of float32 activations with .base weights, and embedding row lookup. Quantized weights (base_q4, base_q8
in groups of 32, 64 or 128, and the GGUF blocks Q3_K, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1) meet the activations quantized to 8
(or, per weight, 16) bits in integer dot products (matmul.h states the contract); dense weights, and every weight of the exact path (BASERT_EXACT=1, `--exact`, or Weight(exact=True)),
are de-quantized to float32 on the fly. GIL released, output rows split across OpenMP threads; every output value
is bit-identical whatever the batch size, its row in the batch, the thread count or the CPU variant."""

import os

from cython.parallel cimport prange, threadid
from libc.stdint cimport int8_t, int16_t, int32_t, uint8_t, uint16_t
from libc.stdlib cimport free
from libc.string cimport memcpy

cdef extern from "<stdlib.h>" nogil:
    void *aligned_alloc(size_t alignment, size_t size)

cdef extern from "simd.h" nogil:
    int basert_threads_for(Py_ssize_t elements)

cdef extern from "matmul.h" nogil:
    enum:
        BASERT_F32
        BASERT_F16
        BASERT_BF16
        BASERT_Q4
        BASERT_Q8
        BASERT_BLOCKS
    ctypedef struct basert_weight:
        int kind
        int bf16_scales
        int ggml_type
        Py_ssize_t n, k, group_size, row_bytes
        const uint8_t *data
        const uint16_t *scales
        const uint16_t *biases
        int integer
        int act_max
        int packed
    int basert_packs(const basert_weight *w)
    const uint8_t *basert_weight_bytes(const basert_weight *w, Py_ssize_t row, Py_ssize_t off, Py_ssize_t len,
                                       uint8_t *buf)
    void basert_pack_rows(const basert_weight *w, const uint8_t *src, uint8_t *dst, Py_ssize_t r0, Py_ssize_t r1)
    enum: BASERT_ACT8
    enum: BASERT_ACT16
    int basert_omp_max_threads()
    void basert_omp_set_threads(int n)
    void basert_dequant_row(const basert_weight *w, Py_ssize_t row, float *dst)
    enum: BASERT_STREAM_MAX_M
    void basert_stream(const basert_weight *w, const float *x, Py_ssize_t ldx, Py_ssize_t m, Py_ssize_t r0,
                       Py_ssize_t r1, float *y, Py_ssize_t ldy)
    int basert_block_values(int ggml_type)
    int basert_block_bytes(int ggml_type)
    Py_ssize_t basert_tile_stride(Py_ssize_t k)
    Py_ssize_t basert_tile_rows(Py_ssize_t k)
    Py_ssize_t basert_tile_count(Py_ssize_t n, Py_ssize_t k, Py_ssize_t nt)
    Py_ssize_t basert_tile_start(Py_ssize_t t, Py_ssize_t tiles, Py_ssize_t n)
    void basert_gemm_tile(const basert_weight *w, const float *x, Py_ssize_t ldx, Py_ssize_t m, Py_ssize_t r0,
                          Py_ssize_t r1, float *buf, float *out)
    void basert_matmul_rows(const basert_weight *w, const float *x, Py_ssize_t ldx, const uint8_t *qx, Py_ssize_t m,
                            Py_ssize_t r0, Py_ssize_t r1, float *y, Py_ssize_t ldy)
    Py_ssize_t basert_qrow_bytes(Py_ssize_t k)
    int basert_integer_capable(const basert_weight *w)
    void basert_quantize_rows(const float *x, Py_ssize_t ldx, Py_ssize_t m, Py_ssize_t k, int qmax, uint8_t *dst)
    void basert_qmatmul(const basert_weight *w, const uint8_t *qx, Py_ssize_t m, Py_ssize_t r0, Py_ssize_t r1, float *y,
                        Py_ssize_t ldy)

# kind -> (C enum, bits per stored value)
_KINDS = {"f32": (BASERT_F32, 32), "f16": (BASERT_F16, 16), "bf16": (BASERT_BF16, 16),
          "base_q4": (BASERT_Q4, 4), "base_q8": (BASERT_Q8, 8)}
# GGUF blocks kept as they are: kind (the GGUF type's name) -> its type code.
BLOCK_KINDS = {"Q5_0": 6, "Q5_1": 7, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}

cdef int _num_threads = max(1, basert_omp_max_threads())

cdef enum:
    # Below this many multiply-adds a matmul runs on the calling thread. A parallel region's start and end
    # cost microseconds on idle cores, but a whole scheduler time slice (milliseconds) when another process
    # holds the core its worker needs: a small model's matmuls are cheaper done alone.
    SERIAL_MACS_BELOW = 1 << 20


cdef inline int _threads_for_macs(Py_ssize_t macs) noexcept nogil:
    return 1 if macs < SERIAL_MACS_BELOW else _num_threads


def set_num_threads(int n):
    """Set the OpenMP threads used by the kernels (all of this module's, and prange defaults in this thread)."""
    global _num_threads
    if n < 1:
        raise ValueError(f"thread count must be at least 1, got {n}")
    _num_threads = n
    # Kernels in other modules that call prange without num_threads follow the calling thread's default.
    basert_omp_set_threads(n)


def get_num_threads():
    """The OpenMP threads the kernels use."""
    return _num_threads


# Whether new Weights take the exact float32 path by default: BASERT_EXACT=1 in the environment, or set_exact.
cdef bint _exact = os.environ.get("BASERT_EXACT", "").strip().lower() in ("1", "true", "yes", "on")


def set_exact(bint exact):
    """Make Weights created from now on (without an explicit `exact`) take the exact float32 path, or the integer one."""
    global _exact
    _exact = exact


def get_exact():
    """Whether Weights created without an explicit `exact` take the exact float32 path."""
    return _exact


# The activation bits a weight's input is quantized to, and the largest code of each (matmul.h).
ACT_MAX = {8: BASERT_ACT8, 16: BASERT_ACT16}


from basert._ext.scratch cimport basert_scratch_give, basert_scratch_pool, basert_scratch_take

# The quantized rows' buffer, kept from one matmul to the next.
cdef basert_scratch_pool _rows_pool


cdef class QuantizedRows:
    """x [M, K] quantized per block of 32 (matmul.h's records) to codes of `bits` (8 or 16) bits, in a 64-byte
    aligned buffer (the pool's while no other QuantizedRows holds it, else one of its own)."""

    cdef uint8_t *data
    cdef int owned
    cdef readonly Py_ssize_t m, k, row_bytes

    def __cinit__(self, const float[:, ::1] x, int bits=8):
        self.m, self.k = x.shape[0], x.shape[1]
        if self.k % 32:
            raise ValueError(f"K={self.k} is not a multiple of 32")
        if bits not in ACT_MAX:
            raise ValueError(f"activations take 8 or 16 bits, not {bits}")
        cdef int qmax = ACT_MAX[bits]
        self.row_bytes = basert_qrow_bytes(self.k)
        self.data = <uint8_t *>basert_scratch_take(&_rows_pool, self.m * self.row_bytes, &self.owned)
        if self.data == NULL:
            raise MemoryError()
        cdef Py_ssize_t i, rb = self.row_bytes, k = self.k
        cdef int nt = _threads_for_macs(self.m * self.k * 64)
        if self.m:
            with nogil:
                for i in prange(self.m, num_threads=nt, schedule="static"):
                    basert_quantize_rows(&x[i, 0], k, 1, k, qmax, self.data + i * rb)

    def __dealloc__(self):
        if self.data != NULL:
            basert_scratch_give(&_rows_pool, self.data, self.owned)

    def parts(self):
        """(codes int16 [M, K] in record order, scales float32 [M, K/32], block sums float32 [M, K/32]): copies,
        for tests."""
        import numpy as np
        raw = np.frombuffer((<char *>self.data)[:self.m * self.row_bytes], dtype=np.uint8).reshape(self.m, self.row_bytes)
        k = self.k
        return (raw[:, :2 * k].copy().view(np.int16), raw[:, 2 * k:2 * k + k // 8].copy().view(np.float32),
                raw[:, 2 * k + k // 8:2 * k + k // 4].copy().view(np.float32))


cdef class Weight:
    """One .base weight matrix [N, K]: a read-only view of its arrays, kept alive here; a base_q4, Q4_K, Q5_K or Q6_K
    weight on the integer path of a SIMD variant copies its bytes once into the packed layout instead (matmul.h;
    `packed`), after which the caller may let the file's pages go. `packed=True` says the data already is in that
    layout (another packed weight's rows). `release(start, stop)`, where given, is called as the packing goes with
    each range of data's bytes that it has copied and no longer reads (the caller may let the file's pages go: the copy
    and the file are then never both in memory whole)."""

    cdef readonly str kind, scale_dtype
    cdef readonly int n, k, group_size
    cdef readonly bint exact
    cdef readonly object data, scales, biases
    # Typed views hold a buffer export, so the memory behind the raw pointers cannot move or be freed.
    cdef const uint8_t[::1] _data_view
    cdef const uint16_t[::1] _scales_view, _biases_view
    cdef basert_weight c

    def __init__(self, str kind, int n, int k, data, scales=None, biases=None, int group_size=0,
                 str scale_dtype="f16", exact=None, int act_bits=8, bint packed=False, release=None):
        if kind not in _KINDS and kind not in BLOCK_KINDS:
            raise ValueError(f"kind must be one of {tuple(_KINDS) + tuple(BLOCK_KINDS)}, got {kind!r}")
        if n < 0 or k < 1:
            raise ValueError(f"bad weight shape [{n}, {k}]")
        cdef int ggml_type = BLOCK_KINDS.get(kind, 0), values = 0
        cdef Py_ssize_t row_bytes
        code, bits = _KINDS.get(kind, (BASERT_BLOCKS, 0))
        quantized = code == BASERT_Q4 or code == BASERT_Q8
        if ggml_type:
            values = basert_block_values(ggml_type)
            if scales is not None or biases is not None or group_size not in (0, values):
                raise ValueError(f"{kind} blocks hold their own scales: no scales, biases or group_size")
            if k % values:
                raise ValueError(f"K={k} is not a whole number of {kind} blocks of {values}")
            group_size = values
            row_bytes = k // values * basert_block_bytes(ggml_type)
        elif quantized:
            if scales is None:
                raise ValueError(f"{kind} needs scales")
            if group_size <= 0 or group_size % 8:
                raise ValueError(f"group_size must be a positive multiple of 8, got {group_size}")
            if k % group_size:
                raise ValueError(f"K={k} is not divisible by group_size {group_size}")
            if scale_dtype not in ("f16", "bf16"):
                raise ValueError(f"scale_dtype must be 'f16' or 'bf16', got {scale_dtype!r}")
        elif scales is not None or biases is not None or group_size != 0:
            raise ValueError(f"dense kind {kind} takes no scales, biases or group_size")
        if not ggml_type:
            row_bytes = <Py_ssize_t>k * bits // 8
        cdef Py_ssize_t groups = <Py_ssize_t>n * (k // group_size) if quantized else 0
        self._data_view = data
        if self._data_view.shape[0] != n * row_bytes:
            raise ValueError(f"{kind} [{n}, {k}] needs {n * row_bytes} data bytes, got {self._data_view.shape[0]}")
        if quantized:
            self._scales_view = scales
            if self._scales_view.shape[0] != groups:
                raise ValueError(f"{kind} [{n}, {k}] group {group_size} needs {groups} scales, "
                                 f"got {self._scales_view.shape[0]}")
            if biases is not None:
                self._biases_view = biases
                if self._biases_view.shape[0] != groups:
                    raise ValueError(f"{kind} [{n}, {k}] group {group_size} needs {groups} biases, "
                                     f"got {self._biases_view.shape[0]}")

        self.kind, self.n, self.k, self.group_size, self.scale_dtype = kind, n, k, group_size, scale_dtype
        self.data, self.scales, self.biases = data, scales, biases
        self.c.kind = code
        self.c.ggml_type = ggml_type
        self.c.bf16_scales = scale_dtype == "bf16"
        self.c.n, self.c.k, self.c.group_size, self.c.row_bytes = n, k, group_size, row_bytes
        self.c.data = &self._data_view[0] if self._data_view.shape[0] else NULL
        self.c.scales = NULL
        self.c.biases = NULL
        if quantized and groups:
            self.c.scales = &self._scales_view[0]
            if biases is not None:
                self.c.biases = &self._biases_view[0]
        if code == BASERT_F32 and <size_t>self.c.data % 4:
            raise ValueError("f32 weight data must be 4-byte aligned")
        self.exact = _exact if exact is None else bool(exact)
        self.c.integer = not self.exact and basert_integer_capable(&self.c)
        self.act_bits = act_bits
        self.c.packed = 0
        if packed and not basert_packs(&self.c):
            raise ValueError(f"{self!r} is not stored packed: its data cannot be in the packed layout")
        if packed or basert_packs(&self.c):
            self._pack(packed, release)

    cdef _pack(self, bint already, release):
        """Take the packed layout: the data as it is (`already`), or a copy of it packed, about 8 MiB at a time."""
        import numpy as np
        cdef const uint8_t[::1] src = self._data_view
        cdef uint8_t[::1] dst
        cdef Py_ssize_t rb = self.c.row_bytes, n = self.c.n, r0, r1
        cdef Py_ssize_t step = max(8, (1 << 23) // rb // 8 * 8)
        if not already:
            out = np.empty(src.shape[0], dtype=np.uint8)
            dst = out
            for r0 in range(0, n, step):
                r1 = min(n, r0 + step)
                with nogil:
                    basert_pack_rows(&self.c, &src[0], &dst[0], r0, r1)
                if release is not None:
                    release(r0 * rb, r1 * rb)
            out.flags.writeable = False
            self.data = out
            self._data_view = out
            self.c.data = &self._data_view[0]
        self.c.packed = 1

    @property
    def integer(self):
        """Whether this weight meets quantized activations in integer dot products (else the exact float32 path)."""
        return bool(self.c.integer)

    @property
    def packed(self):
        """Whether the weight's bytes are stored packed (matmul.h): a copy of the file's, which it no longer reads."""
        return bool(self.c.packed)

    @property
    def act_bits(self):
        """The bits its activations are quantized to on the integer path: 8 (the default) or 16."""
        return 8 if self.c.act_max == BASERT_ACT8 else 16

    @act_bits.setter
    def act_bits(self, int bits):
        if bits not in ACT_MAX:
            raise ValueError(f"activations take 8 or 16 bits, not {bits}")
        self.c.act_max = ACT_MAX[bits]

    def rows(self, int start, int stop):
        """A Weight for output rows [start, stop), viewing the same arrays (e.g. one expert of an [E*N, K] stack)."""
        if not 0 <= start <= stop <= self.n:
            raise ValueError(f"rows [{start}, {stop}) out of range for {self.n} rows")
        rb = self.c.row_bytes
        # A packed weight's whole groups (and the rows after them, stored as they are) keep the layout; rows cut out of
        # a group are copied back to the file's.
        whole = self.c.packed and not (start % 8 or (stop % 8 and stop != self.n))
        data = self._stored_rows(start, stop) if self.c.packed and not whole else self.data[start * rb:stop * rb]
        same = dict(exact=self.exact, act_bits=self.act_bits, packed=whole and stop - start >= 8)
        if self.scales is None:
            return Weight(self.kind, stop - start, self.k, data, group_size=self.group_size if self.c.ggml_type else 0,
                          **same)
        g = self.k // self.group_size
        biases = None if self.biases is None else self.biases[start * g:stop * g]
        return Weight(self.kind, stop - start, self.k, data, self.scales[start * g:stop * g], biases,
                      self.group_size, self.scale_dtype, **same)

    def _stored_rows(self, Py_ssize_t start, Py_ssize_t stop):
        """The bytes of rows [start, stop) as the file stores them (a new array)."""
        import numpy as np
        cdef Py_ssize_t rb = self.c.row_bytes, row
        out = np.empty((stop - start) * rb, dtype=np.uint8)
        cdef uint8_t[::1] dst = out
        cdef const uint8_t *src
        for row in range(start, stop):
            src = basert_weight_bytes(&self.c, row, 0, rb, &dst[(row - start) * rb])
            if src != &dst[(row - start) * rb]:
                memcpy(&dst[(row - start) * rb], src, rb)
        return out

    @property
    def c_address(self):
        """Address of this weight's C description (a basert_weight), valid while this object lives."""
        return <size_t>&self.c

    def __repr__(self):
        path = f"integer, {self.act_bits}-bit activations" if self.c.integer else "float32"
        return f"Weight({self.kind}, n={self.n}, k={self.k}, group_size={self.group_size}, {path})"


def matmul(const float[:, ::1] x, Weight w not None, float[:, ::1] out):
    """out[M, N] = x[M, K] @ W^T in float32; out[m, n] does not depend on M, m or the thread count."""
    cdef Py_ssize_t m = x.shape[0], n = w.c.n, k = w.c.k
    cdef Py_ssize_t per, chunks, tiles, stride, ldx, copied, i, t
    cdef int nt = _threads_for_macs(m * n * k)
    cdef float *buf = NULL
    cdef float *xs
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns, the weight has K={k}")
    if out.shape[0] != m or out.shape[1] != n:
        raise ValueError(f"out has shape ({out.shape[0]}, {out.shape[1]}), expected ({m}, {n})")
    if m == 0 or n == 0:
        return
    cdef QuantizedRows qx
    cdef const uint8_t *qdata
    if w.c.integer:
        qx = QuantizedRows(x, w.act_bits)
        qdata = qx.data
        # One contiguous run of rows per thread, a multiple of the kernel's 8 rows.
        per = ((n + nt - 1) // nt + 7) // 8 * 8
        chunks = (n + per - 1) // per
        with nogil:
            for t in prange(chunks, num_threads=nt, schedule="static"):
                basert_qmatmul(&w.c, qdata, m, t * per, min(n, (t + 1) * per), &out[0, 0], n)
        return
    if m <= BASERT_STREAM_MAX_M:
        # One contiguous run of rows per thread (a multiple of 4 for the 4-row kernel) streams best.
        per = ((n + nt - 1) // nt + 3) // 4 * 4
        chunks = (n + per - 1) // per
        with nogil:
            for t in prange(chunks, num_threads=nt, schedule="static"):
                basert_stream(&w.c, &x[0, 0], k, m, t * per, min(n, (t + 1) * per), &out[0, 0], n)
        return
    tiles = basert_tile_count(n, k, nt)
    stride = basert_tile_rows(k) * basert_tile_stride(k) if w.c.kind != BASERT_F32 else 0
    # The microkernel wants 64-byte aligned activation rows (a whole 16-float vector per cache line): copy x
    # unless it already has them.
    copied = m if (<size_t>&x[0, 0]) % 64 or k % 16 else 0
    ldx = basert_tile_stride(k) if copied else k
    if nt * stride + copied * ldx:
        buf = <float *>aligned_alloc(64, (nt * stride + copied * ldx) * sizeof(float))
        if buf == NULL:
            raise MemoryError()
    xs = buf + nt * stride if copied else <float *>&x[0, 0]
    try:
        with nogil:
            # Two parallel regions: every row must be copied before any tile reads it.
            for i in prange(copied, num_threads=nt, schedule="static"):
                memcpy(xs + i * ldx, &x[i, 0], k * sizeof(float))
            for t in prange(tiles, num_threads=nt, schedule="static"):
                basert_gemm_tile(&w.c, xs, ldx, m, basert_tile_start(t, tiles, n), basert_tile_start(t + 1, tiles, n),
                                 buf + threadid() * stride if stride else NULL, &out[0, 0])
    finally:
        free(buf)


cdef enum:
    MAX_FUSED = 8  # weights per matmul_many call (q/k/v needs 3): their pointers live on the stack


def matmul_many(const float[:, ::1] x, list weights, list outs):
    """outs[i] = x @ weights[i]^T for weights sharing x's K (q/k/v, gate/up): x is quantized once for every weight on
    the integer path, and one parallel region over the rows of every weight computes the integer ones at any batch
    size and the float ones up to BASERT_STREAM_MAX_M rows, so one synchronisation serves them all; larger batches
    run `matmul` for each float weight. Each output row is the same as `matmul`'s (bit for bit)."""
    cdef Py_ssize_t m = x.shape[0], k = x.shape[1], count = len(weights), total = 0, per, chunks, t, i
    cdef Py_ssize_t r0, r1, lo, hi, fused = 0
    cdef int nt
    cdef bint any_integer = False
    cdef int act_bits = 0
    cdef Weight w
    cdef float[:, ::1] o
    if len(outs) != count:
        raise ValueError(f"{count} weights but {len(outs)} outputs")
    if count > MAX_FUSED:
        raise ValueError(f"at most {MAX_FUSED} weights in one call, got {count}")
    for i in range(count):
        w = weights[i]
        o = outs[i]
        if w.c.k != k:
            raise ValueError(f"x has {k} columns, weight {i} has K={w.c.k}")
        if o.shape[0] != m or o.shape[1] != w.c.n:
            raise ValueError(f"output {i} has shape ({o.shape[0]}, {o.shape[1]}), expected ({m}, {w.c.n})")
        if w.c.integer:
            if any_integer and w.act_bits != act_bits:
                raise ValueError("the integer weights of one matmul_many share their input's activation bits")
            act_bits = w.act_bits
            any_integer = True
    if m == 0:
        return
    cdef const basert_weight *cw[MAX_FUSED]
    cdef float *co[MAX_FUSED]
    cdef Py_ssize_t first[MAX_FUSED + 1]
    first[0] = 0
    for i in range(count):
        w = weights[i]
        if m > BASERT_STREAM_MAX_M and not w.c.integer:
            matmul(x, w, outs[i])
            continue
        o = outs[i]
        cw[fused] = &w.c
        co[fused] = &o[0, 0] if w.c.n else NULL
        first[fused + 1] = first[fused] + w.c.n
        fused += 1
    total = first[fused]
    if total == 0:
        return
    cdef QuantizedRows qx = QuantizedRows(x, act_bits) if any_integer else None
    cdef const uint8_t *qdata = qx.data if any_integer else NULL
    # One contiguous run of the concatenated rows per thread (a multiple of 8), cut at the weights' boundaries.
    nt = _threads_for_macs(m * total * k)
    per = ((total + nt - 1) // nt + 7) // 8 * 8
    chunks = (total + per - 1) // per
    with nogil:
        for t in prange(chunks, num_threads=nt, schedule="static"):
            r0 = t * per
            r1 = min(total, r0 + per)
            for i in range(fused):
                lo = max(r0, first[i])
                hi = min(r1, first[i + 1])
                if lo < hi:
                    basert_matmul_rows(cw[i], &x[0, 0], k, qdata, m, lo - first[i], hi - first[i], co[i], cw[i].n)


def embed_rows(Weight w not None, const int32_t[::1] ids, float[:, ::1] out):
    """out[i] = row ids[i] of W de-quantized exactly as basert.format.quant.dequantize does."""
    cdef Py_ssize_t count = ids.shape[0], n = w.c.n, i
    if out.shape[0] != count or out.shape[1] != w.c.k:
        raise ValueError(f"out has shape ({out.shape[0]}, {out.shape[1]}), expected ({count}, {w.c.k})")
    for i in range(count):
        if not 0 <= ids[i] < n:
            raise ValueError(f"id {ids[i]} at position {i} is out of range for {n} rows")
    # A decode step's few rows are looked up on the calling thread: an OpenMP region would leave its workers
    # spinning on the cores the decode graph's team is about to use.
    with nogil:
        for i in prange(count, num_threads=basert_threads_for(count * w.c.k), schedule="static"):
            basert_dequant_row(&w.c, ids[i], &out[i, 0])
