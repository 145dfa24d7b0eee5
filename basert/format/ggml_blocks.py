"""GGUF quantized blocks kept as they are in a .base file (`layout: "gguf_super"`).

The K-quants (Q2_K ... Q6_K, super-blocks of 256 values) and the legacy Q5_0 / Q5_1 (blocks of 32) have no
lossless `base_q*` mapping: their sub-block scales are quantized themselves. A converter keeps every row's
bytes unchanged instead, and records the GGUF type (`source_ggml_type`) and `layout: "gguf_super"` on the
tensor entry. The reference values are gguf-py's de-quantization of those bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

BLOCK_LAYOUT = "gguf_super"


@dataclass(frozen=True, slots=True)
class BlockType:
    """One GGUF block type: its name and type code, values and bytes per block, and the nominal .base dtype."""

    name: str
    ggml_type: int
    block_size: int
    block_bytes: int
    dtype: str

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of k values (k a multiple of the block size)."""
        return k // self.block_size * self.block_bytes


def _block_type(qtype: gguf.GGMLQuantizationType, dtype: str) -> BlockType:
    size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    return BlockType(qtype.name, int(qtype), size, nbytes, dtype)


_Q = gguf.GGMLQuantizationType
BLOCK_TYPES: dict[int, BlockType] = {
    bt.ggml_type: bt
    for bt in (
        _block_type(_Q.Q2_K, "base_q2"),
        _block_type(_Q.Q3_K, "base_q3"),
        _block_type(_Q.Q4_K, "base_q4"),
        _block_type(_Q.Q5_K, "base_q5"),
        _block_type(_Q.Q6_K, "base_q6"),
        _block_type(_Q.Q5_0, "base_q5"),
        _block_type(_Q.Q5_1, "base_q5"),
    )
}
BLOCK_TYPE_NAMES = {bt.name: bt for bt in BLOCK_TYPES.values()}


def dequantize_blocks(raw: np.ndarray, block_type: BlockType, array_shape: tuple[int, ...]) -> np.ndarray:
    """A new float32 array of shape `array_shape` (row-major, last dimension the row) from the blocks' bytes."""
    k = array_shape[-1]
    rows = np.asarray(raw, dtype=np.uint8).reshape(-1, block_type.row_bytes(k))
    values = gguf.quants.dequantize(rows, _Q(block_type.ggml_type))
    return np.ascontiguousarray(values, dtype=np.float32).reshape(array_shape)
