"""Building blocks shared by the architectures: weights from a .base file, norms, attention, MLPs.

Every block works on a flat activation matrix [T, D] holding the new tokens of all sequences in
the batch; attention takes every sequence in one kernel call, DeltaNet walks the batch items for
their per-sequence state. Scratch arrays come from a Workspace so that decoding allocates no array
data per token.

Each block takes its tensors with the shape its config implies (Weights checks them), so the dims a
block later passes to a kernel always match the buffers the kernel reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from basert._ext import attention as attn_ext
from basert._ext import matmul as mm
from basert._ext import norm, ops
from basert.format import BaseFile, ModelValidationError, TensorInfo
from basert.models.config import DecoderConfig


class Workspace:
    """Named scratch arrays that grow to the largest row count seen and are reused."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, rows: int, *shape: int, dtype: type = np.float32) -> np.ndarray:
        """A [rows, *shape] view of the scratch array `name` (contents undefined)."""
        array = self.arrays.get(name)
        if array is None or array.shape[0] < rows or array.shape[1:] != shape or array.dtype != dtype:
            array = np.empty((max(rows, 1), *shape), dtype=dtype)
            self.arrays[name] = array
        return array[:rows]


class Weights:
    """Kernel views of a .base file's tensors, each checked against the shape its block expects (zero-copy, but for
    the packed weights' one copy each: matmul.Weight); `used` collects the names taken."""

    def __init__(self, base: BaseFile):
        self.base = base
        self.where = f"{base.path} ({base.arch})"
        self.used: set[str] = set()
        # Tensor name -> its packed weight: a tensor taken twice (a tied embedding and LM head) shares one copy.
        self.packed: dict[str, mm.Weight] = {}

    def error(self, message: str) -> ModelValidationError:
        """An error whose message starts with the file and its arch."""
        return ModelValidationError(f"{self.where}: {message}")

    def has(self, name: str) -> bool:
        return name in self.base.tensors

    def matrix(self, name: str, rows: int, cols: int, act_bits: int = 8) -> mm.Weight:
        """A weight matrix [rows, cols]; on the integer path its input is quantized to `act_bits` bits (8 or 16)."""
        return self._kernel_weight(self._take(name, (rows, cols)), rows, cols, act_bits)

    def experts(self, name: str, n_experts: int, rows: int, cols: int) -> list[mm.Weight]:
        """One [rows, cols] weight per expert of an [n_experts, rows, cols] stack, sharing the file's bytes."""
        stacked = self._kernel_weight(self._take(name, (n_experts, rows, cols)), n_experts * rows, cols)
        return [stacked.rows(e * rows, (e + 1) * rows) for e in range(n_experts)]

    def vector(self, name: str, *shape: int) -> np.ndarray:
        """A small tensor of shape's element count as a contiguous float32 array of that shape (norm weights,
        gates, conv kernels; files may store them with extra unit dims)."""
        self._take(name, shape, same_dims=False)
        return np.ascontiguousarray(self.base.dequantize(name), dtype=np.float32).reshape(shape)

    def _take(self, name: str, shape: tuple[int, ...], same_dims: bool = True) -> TensorInfo:
        info = self.base.tensors.get(name)
        if info is None:
            raise self.error(f"tensor {name!r} is missing")
        fits = info.array_shape == shape if same_dims else info.n_elements == math.prod(shape)
        if not fits:
            # Shapes are shown in the header's own order (reversed for GGUF sources), as in the file.
            expected = list(reversed(shape)) if self.base.source_format == "gguf" else list(shape)
            raise self.error(f"tensor {name!r} has shape {list(info.shape)}, expected {expected} from the config")
        self.used.add(name)
        return info

    def _kernel_weight(self, info: TensorInfo, n: int, k: int, act_bits: int = 8) -> mm.Weight:
        if not (info.is_blocks or info.is_quantized):
            return mm.Weight(info.dtype, n, k, self.base.payload(info.name))
        if info.is_blocks:
            kind, data, scales = info.block_type.name, self.base.payload(info.name), {}
        else:
            kind, data = info.dtype, self.base.packed(info.name)
            scales = dict(scales=self.base.scales(info.name), biases=self.base.biases(info.name),
                          group_size=info.group_size, scale_dtype=info.scale_dtype or "f16")
        shared = self.packed.get(info.name)
        if shared is not None:
            return mm.Weight(kind, n, k, shared.data, **scales, act_bits=act_bits, packed=True)
        # A packed weight keeps a copy: the file's pages it has copied (its codes, from the payload's start) would only
        # add to the process's memory.
        weight = mm.Weight(kind, n, k, data, **scales, act_bits=act_bits,
                           release=lambda start, stop: self.base.release(info.name, start, stop))
        if weight.packed:
            self.packed[info.name] = weight
        return weight


class KVTensors(Protocol):
    """Per attention layer K and V arrays [n_blocks, n_kv_heads, 16, head_dim] (owned by the engine)."""

    k: list[np.ndarray]
    v: list[np.ndarray]


@dataclass(slots=True)
class BatchItem:
    """One sequence's slice of the flat token batch, with views of its state (owned by the engine)."""

    row: int                          # first row of this sequence in the [T, D] activations
    length: int                       # new tokens in this forward
    start: int                        # position of the first new token
    block_table: np.ndarray           # int32 block ids covering positions [0, start + length)
    conv_state: np.ndarray | None     # [n_linear_layers, conv_dim, K-1] float32, hybrids only
    ssm_state: np.ndarray | None      # [n_linear_layers, n_v, d_k, d_v] float32, hybrids only


@dataclass(slots=True)
class Batch:
    items: list[BatchItem]
    tokens: np.ndarray      # int32 [T]
    positions: np.ndarray   # int32 [T]
    # The items' rows, lengths, start positions and block tables (zero-padded) as arrays, for kernels
    # that take every sequence of the batch in one call.
    rows: np.ndarray        # int32 [n_items]
    lengths: np.ndarray     # int32 [n_items]
    starts: np.ndarray      # int32 [n_items]
    tables: np.ndarray      # int32 [n_items, max blocks per sequence]
    # The sliding-window layers' block tables (entries before a window may be NO_BLOCK); `tables` itself for a
    # model without such layers.
    window_tables: np.ndarray

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])


class RMSNorm:
    def __init__(self, weights: Weights, name: str, size: int, eps: float):
        self.weight = weights.vector(name, size)
        self.eps = eps

    def __call__(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        return norm.rmsnorm(x, self.weight, self.eps, out)


class Linear:
    def __init__(self, weights: Weights, name: str, n_out: int, n_in: int):
        self.weight = weights.matrix(name, n_out, n_in)

    def __call__(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        mm.matmul(x, self.weight, out)
        return out


class RopeTables:
    """cos/sin tables for positions [0, max_pos) and the first rotary_dim dims of a head."""

    def __init__(self, theta: float, rotary_dim: int, max_pos: int, interleaved: bool):
        self.cos, self.sin = ops.rope_tables(theta, rotary_dim, max_pos)
        self.interleaved = interleaved
        self.max_pos = max_pos

    def apply(self, x: np.ndarray, positions: np.ndarray) -> None:
        ops.rope(x, positions, self.cos, self.sin, self.interleaved)


class Attention:
    """Causal GQA attention over the paged KV cache; optional per-head q/k norm, output gate and sliding window
    (a token at position p then sees positions p - window + 1 .. p)."""

    def __init__(self, weights: Weights, prefix: str, config: DecoderConfig, kv_layer: int, rope: RopeTables,
                 *, qk_norm: bool, output_gate: bool, window: int = 0, scale: float | None = None):
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        hidden = config.hidden_size
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.q_proj = Linear(weights, f"{prefix}.q_proj.weight", 2 * q_dim if output_gate else q_dim, hidden)
        self.k_proj = Linear(weights, f"{prefix}.k_proj.weight", kv_dim, hidden)
        self.v_proj = Linear(weights, f"{prefix}.v_proj.weight", kv_dim, hidden)
        self.o_proj = Linear(weights, f"{prefix}.o_proj.weight", hidden, q_dim)
        self.qkv_weights = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]   # one fused call
        # Projection biases (Qwen2): all three or none, added to the projections before the norms and RoPE.
        names = [f"{prefix}.{proj}_proj.bias" for proj in ("q", "k", "v")]
        self.qkv_biases = ([weights.vector(name, size) for name, size in zip(names, (q_dim, kv_dim, kv_dim))]
                           if any(weights.has(name) for name in names) else None)
        self.q_norm = weights.vector(f"{prefix}.q_norm.weight", self.head_dim) if qk_norm else None
        self.k_norm = weights.vector(f"{prefix}.k_norm.weight", self.head_dim) if qk_norm else None
        self.output_gate = output_gate
        self.kv_layer = kv_layer
        self.rope = rope
        self.scale = float(self.head_dim) ** -0.5 if scale is None else scale
        self.window = window

    def __call__(self, h: np.ndarray, batch: Batch, kv: KVTensors, ws: Workspace, out: np.ndarray) -> np.ndarray:
        t, hd = h.shape[0], self.head_dim
        q = ws.get("attn.q", t, self.n_heads, hd)
        k = ws.get("attn.k", t, self.n_kv, hd)
        v = ws.get("attn.v", t, self.n_kv, hd)
        projected = [k.reshape(t, self.n_kv * hd), v.reshape(t, self.n_kv * hd)]
        if self.output_gate:
            # q_proj rows are per head [query | gate]: split into contiguous q and gate.
            qg = ws.get("attn.qg", t, self.n_heads * 2 * hd)
            mm.matmul_many(h, self.qkv_weights, [qg, *projected])
            qg = qg.reshape(t, self.n_heads, 2 * hd)
            np.copyto(q, qg[:, :, :hd])
            gate = ws.get("attn.gate", t, self.n_heads * hd)
            np.copyto(gate.reshape(t, self.n_heads, hd), qg[:, :, hd:])
        else:
            mm.matmul_many(h, self.qkv_weights, [q.reshape(t, self.n_heads * hd), *projected])
        if self.qkv_biases is not None:
            for rows, bias in zip((q.reshape(t, self.n_heads * hd), *projected), self.qkv_biases):
                np.add(rows, bias, out=rows)
        if self.q_norm is not None:
            ops.rmsnorm_heads(q, self.q_norm, self.eps)
            ops.rmsnorm_heads(k, self.k_norm, self.eps)
        self.rope.apply(q, batch.positions)
        self.rope.apply(k, batch.positions)
        attn = ws.get("attn.out", t, self.n_heads, hd)
        k_cache, v_cache = kv.k[self.kv_layer], kv.v[self.kv_layer]
        tables = batch.window_tables if self.window else batch.tables
        attn_ext.kv_write_batch(k_cache, v_cache, k, v, tables, batch.rows, batch.lengths, batch.starts)
        attn_ext.attention_batch(q, k_cache, v_cache, tables, batch.rows, batch.lengths, batch.starts,
                                 self.scale, attn, self.window)
        flat = attn.reshape(t, self.n_heads * hd)
        if self.output_gate:
            ops.sigmoid_mul(flat, gate)
        return self.o_proj(flat, out)


# The gated MLP's activations: act(gate) * up, computed in place into gate.
ACTIVATIONS = {"silu": ops.silu_mul, "gelu_tanh": ops.gelu_tanh_mul}


# Rows of the gated MLP computed at a time (MLP.__call__).
MLP_ROWS = 64


class MLP:
    """Gated MLP: down(act(gate(x)) * up(x)), SwiGLU (silu) or GeGLU (GeLU's tanh form)."""

    def __init__(self, weights: Weights, prefix: str, d_model: int, hidden: int, activation: str = "silu"):
        self.gate_proj = Linear(weights, f"{prefix}.gate_proj.weight", hidden, d_model)
        self.up_proj = Linear(weights, f"{prefix}.up_proj.weight", hidden, d_model)
        self.down_proj = Linear(weights, f"{prefix}.down_proj.weight", d_model, hidden)
        self.gate_up_weights = [self.gate_proj.weight, self.up_proj.weight]   # one fused call
        self.hidden = hidden
        self.activation = activation
        self._gated = ACTIVATIONS[activation]

    def __call__(self, h: np.ndarray, ws: Workspace, out: np.ndarray, tag: str = "mlp") -> np.ndarray:
        # MLP_ROWS rows at a time: each row's output is the same bits however the rows are split (matmul.h), and the
        # [rows, hidden] scratch of a long prefill stays small (a 512-token chunk of a 1B model: 4 MiB, not 32).
        for start in range(0, h.shape[0], MLP_ROWS):
            rows = h[start:start + MLP_ROWS]
            gate = ws.get(f"{tag}.gate", rows.shape[0], self.hidden)
            up = ws.get(f"{tag}.up", rows.shape[0], self.hidden)
            mm.matmul_many(rows, self.gate_up_weights, [gate, up])
            self._gated(gate, up, gate)
            self.down_proj(gate, out[start:start + MLP_ROWS])
        return out
