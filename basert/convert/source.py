"""What a model source (GGUF file or HF safetensors directory) hands the converter."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from basert.format.architectures import Architecture
from basert.format.ggml_blocks import BlockType
from basert.format.quant import QuantizedTensor

# Tensor flags of the .base format.
FLAG_EXPERT_WEIGHT = 1 << 1
FLAG_SSM_A_MATRIX = 1 << 3

# Header flags of the .base format.
HEADER_QUANTIZED = 1 << 0
HEADER_HAS_MOE = 1 << 1
HEADER_HAS_SSM = 1 << 2
HEADER_HAS_HYBRID = 1 << 3
HEADER_TIED_EMBEDDINGS = 1 << 10
HEADER_SLIDING_WINDOW = 1 << 11


class ConvertError(ValueError):
    """A source cannot be converted; the message says what and why."""


@dataclass(slots=True)
class SourceTensor:
    """One tensor under its canonical .base name, loaded lazily."""

    name: str
    array_shape: tuple[int, ...]          # row-major numpy order
    header_shape: list[int]               # what the header records (GGUF keeps its own order)
    source_type: str                      # e.g. "F32", "Q4_1", "BF16"
    load_f32: Callable[[], np.ndarray]    # the exact float32 values
    native: Callable[[], QuantizedTensor] | None = None  # lossless quantized form, if any
    native_dense: str | None = None       # lossless dense dtype ("f32", "f16", "bf16"), if any
    block_type: BlockType | None = None   # GGUF blocks that can be kept as they are, if any
    load_blocks: Callable[[], np.ndarray] | None = None  # their bytes, every row unchanged
    flags: int = 0
    keep_f32: bool = False                # small control tensors that must stay float32


@dataclass(slots=True)
class SourceModel:
    """A parsed source: architecture, normalised config, tokenizer object and tensors."""

    arch: Architecture
    config: dict
    tokenizer: dict
    source: dict
    tensors: list[SourceTensor]
    metadata: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


class ProgressHook(Protocol):
    def __call__(self, done: int, total: int, name: str) -> None: ...


# Norms whose HF weight w acts as (1 + w) in architectures with zero-centred norms; stored with the +1 added.
ZERO_CENTRED_NORM_SUFFIXES = (
    "input_norm.weight",
    "post_attn_norm.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
)


def is_zero_centred_norm(name: str) -> bool:
    """True for the (1 + w) norms of architectures with zero-centred norms (not the gated linear_attn.norm)."""
    return name == "final_norm.weight" or name.endswith(ZERO_CENTRED_NORM_SUFFIXES)


def is_control_tensor(name: str) -> bool:
    """Router and gate vectors that decide routing: kept in float32 whatever the target."""
    return name.endswith(
        ("mlp.gate.weight", "mlp.router.weight", "shared_expert_gate.weight", "linear_attn.A_log",
         "linear_attn.dt_bias", "linear_attn.conv1d.weight")
    )
