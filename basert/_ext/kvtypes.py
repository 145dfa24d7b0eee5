"""KV cache entry types (attention.h's BASERT_KV_*): how one kv head's row of head_dim values is stored.

A cache is a numpy array [n_blocks, n_kv_heads, 16, row_units] of the type's storage dtype; the names are
llama.cpp's `--cache-type-k/-v` names. The storage dtype tells the types apart, so a kernel can check a cache it is
given against the head dim of its queries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from basert.format.quant import bf16_bits_to_f32, f32_to_bf16_bits

Q8_VALUES = 32   # values per q8_0 block
Q8_BYTES = 34    # a half scale and 32 signed codes
MAX_HEAD_DIM = 512  # BASERT_KV_MAX_DIM


@dataclass(frozen=True, slots=True)
class KVType:
    name: str
    code: int             # BASERT_KV_* in attention.h (q8_0: rows turned by the Walsh-Hadamard transform first)
    storage: np.dtype     # element type of the cache array

    @property
    def turned(self) -> bool:
        """Whether rows are turned by the Walsh-Hadamard transform before they are stored (q8_0)."""
        return self.name == "q8_0"

    def supports(self, head_dim: int) -> bool:
        return self.name != "q8_0" or head_dim % Q8_VALUES == 0

    def require(self, head_dim: int) -> None:
        """A ValueError unless rows of head_dim values can be stored as this type."""
        if not self.supports(head_dim):
            raise ValueError(f"{self.name} rows need a head dim that is a multiple of {Q8_VALUES}, not {head_dim}")

    def row_units(self, head_dim: int) -> int:
        """Elements of the storage dtype per row."""
        return head_dim // Q8_VALUES * Q8_BYTES if self.name == "q8_0" else head_dim

    def row_bytes(self, head_dim: int) -> int:
        return self.row_units(head_dim) * self.storage.itemsize


KV_TYPES = {kv.name: kv for kv in (
    KVType("f32", 0, np.dtype(np.float32)),
    KVType("f16", 1, np.dtype(np.float16)),
    KVType("bf16", 2, np.dtype(np.uint16)),
    KVType("q8_0", 4, np.dtype(np.uint8)),
)}


def kv_type(name: str) -> KVType:
    """The type of a name, or a ValueError that lists the names there are."""
    try:
        return KV_TYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown KV cache type {name!r}: use one of {', '.join(KV_TYPES)}") from None


def kv_type_of(cache: np.ndarray, head_dim: int) -> KVType:
    """The type of a cache array [n_blocks, n_kv_heads, 16, row_units] holding rows of head_dim values."""
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {head_dim} is outside 1..{MAX_HEAD_DIM}")
    for kv in KV_TYPES.values():
        if cache.dtype == kv.storage:
            kv.require(head_dim)
            if cache.shape[-1] != kv.row_units(head_dim):
                raise ValueError(f"a {kv.name} cache of head dim {head_dim} has rows of {kv.row_units(head_dim)} "
                                 f"elements, not {cache.shape[-1]}")
            return kv
    raise ValueError(f"a KV cache must be float32, float16, uint16 (bf16) or uint8 (q8_0), not {cache.dtype}")


def hadamard(x: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """Each block of 32 of rows x [..., head_dim] turned by the Walsh-Hadamard transform (entries +-1), then scaled:
    attention.h's basert_hadamard_row, the same float32 additions in the same order."""
    blocks = np.array(x, dtype=np.float32).reshape(*x.shape[:-1], -1, Q8_VALUES)
    h = 1
    while h < Q8_VALUES:
        pairs = blocks.reshape(*blocks.shape[:-1], Q8_VALUES // (2 * h), 2, h)
        a, b = pairs[..., 0, :].copy(), pairs[..., 1, :].copy()
        pairs[..., 0, :], pairs[..., 1, :] = a + b, a - b
        h *= 2
    return (blocks * np.float32(scale)).reshape(x.shape)


def encode(kv: KVType, x: np.ndarray) -> np.ndarray:
    """The numpy reference of attention.h's basert_kv_store: rows x [..., head_dim] float32 as stored (q8_0 turns
    them first)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if kv.turned:
        x = hadamard(x)
    if kv.name == "f32":
        return x.copy()
    if kv.name == "f16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16)
    if kv.name == "bf16":
        return f32_to_bf16_bits(x)
    blocks = x.reshape(*x.shape[:-1], -1, Q8_VALUES)
    with np.errstate(over="ignore"):
        half = (np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float16)
    scale = half.astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(scale != 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
    codes = np.clip(np.rint(blocks * inv), -127, 127).astype(np.int8)
    stored = np.concatenate([half.view(np.uint8), codes.view(np.uint8)], axis=-1)
    return stored.reshape(*x.shape[:-1], -1)


def decode(kv: KVType, stored: np.ndarray, head_dim: int) -> np.ndarray:
    """The floats stored rows [..., row_units] read as (exact: attention.h's basert_kv_load); q8_0 rows read as
    their turned values (hadamard(decoded, 1 / 32) turns them back, up to rounding)."""
    if kv.name in ("f32", "f16"):
        return stored.astype(np.float32)
    if kv.name == "bf16":
        return bf16_bits_to_f32(stored)
    blocks = np.ascontiguousarray(stored).reshape(*stored.shape[:-1], head_dim // Q8_VALUES, Q8_BYTES)
    scale = blocks[..., :2].copy().view(np.float16).astype(np.float32)
    codes = blocks[..., 2:].view(np.int8).astype(np.float32)
    return (scale * codes).reshape(*stored.shape[:-1], head_dim)
