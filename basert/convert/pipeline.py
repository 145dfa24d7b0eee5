"""`convert(src, out)`: read a source, choose each tensor's encoding, write a .base file atomically."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from basert.chat.default_templates import BY_ARCH as DEFAULT_TEMPLATES
from basert.convert.gguf_source import open_gguf
from basert.convert.hf_source import open_hf
from basert.convert.source import (
    HEADER_HAS_HYBRID,
    HEADER_HAS_MOE,
    HEADER_HAS_SSM,
    HEADER_QUANTIZED,
    HEADER_SLIDING_WINDOW,
    HEADER_TIED_EMBEDDINGS,
    ConvertError,
    ProgressHook,
    SourceModel,
)
from basert.convert.targets import choose_encoding, load_policy
from basert.convert.tokenizer_source import tokenizer_object_from_path
from basert.format.quant import quantize
from basert.format.writer import BaseWriter


@dataclass(slots=True)
class ConvertReport:
    output: Path
    arch: str
    tensors: int
    bytes_written: int
    seconds: float
    dtype_counts: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def open_source(src: Path, tokenizer_src: Path | None = None) -> SourceModel:
    """A GGUF file or an HF safetensors directory, with an optional tokenizer from elsewhere."""
    src = Path(src)
    tokenizer = tokenizer_object_from_path(Path(tokenizer_src)) if tokenizer_src else None
    if src.is_dir():
        return open_hf(src, tokenizer)
    if src.is_file() and src.suffix.lower() == ".gguf":
        return open_gguf(src, tokenizer)
    if src.is_file() and src.name == "config.json":
        return open_hf(src.parent, tokenizer)
    if not src.exists():
        raise ConvertError(f"{src} does not exist")
    raise ConvertError(f"{src}: expected a .gguf file or a directory with config.json and *.safetensors")


def convert(
    src: Path,
    out: Path,
    *,
    target: str = "auto",
    profile: Path | None = None,
    tokenizer_src: Path | None = None,
    progress: ProgressHook | None = None,
) -> ConvertReport:
    """Convert `src` to the .base file `out`; nothing is left at `out` if this fails."""
    started = time.monotonic()
    policy = load_policy(target, profile)
    model = open_source(Path(src), tokenizer_src)
    model.tensors.sort(key=_tensor_order)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    warnings = list(model.warnings)
    counts: dict[str, int] = {}
    header_flags = 0
    if model.arch.moe:
        header_flags |= HEADER_HAS_MOE
    if model.arch.hybrid:
        header_flags |= HEADER_HAS_SSM | HEADER_HAS_HYBRID
    if model.config.get("tie_word_embeddings"):
        header_flags |= HEADER_TIED_EMBEDDINGS
    if "sliding_attention" in model.config.get("layer_types", ()):
        header_flags |= HEADER_SLIDING_WINDOW
    tokenizer = model.tokenizer
    if tokenizer.get("tokenizer_type") != "none" and not tokenizer.get("tokenizer.chat_template") \
            and model.arch.name in DEFAULT_TEMPLATES:
        tokenizer = {**tokenizer, "tokenizer.chat_template": DEFAULT_TEMPLATES[model.arch.name]}
        warnings.append(f"the source has no chat template: {model.arch.name}'s turn format is written instead")
    encodings = []
    for tensor in model.tensors:
        encoding, warning = choose_encoding(tensor, policy)
        if warning:
            warnings.append(warning)
        encodings.append(encoding)
    if any(e.quantized or e.native or e.blocks for e in encodings):
        header_flags |= HEADER_QUANTIZED

    total = len(model.tensors)
    with BaseWriter(
        out,
        arch=model.arch.name,
        config=model.config,
        tokenizer=tokenizer,
        source=model.source,
        quant_scheme=target,
        metadata=model.metadata,
        flags=header_flags,
        quant_profile=policy.profile,
    ) as writer:
        for index, (tensor, encoding) in enumerate(zip(model.tensors, encodings)):
            if progress is not None:
                progress(index, total, tensor.name)
            if encoding.native:
                packed = tensor.native()
                writer.add_quantized(tensor.name, packed, shape=tensor.header_shape, flags=tensor.flags)
                stored = packed.dtype
            elif encoding.blocks:
                writer.add_blocks(tensor.name, tensor.load_blocks(), tensor.block_type, tensor.array_shape,
                                  shape=tensor.header_shape, flags=tensor.flags)
                stored = tensor.block_type.name
            elif encoding.quantized:
                packed = quantize(
                    tensor.load_f32(),
                    encoding.dtype,
                    encoding.group_size,
                    symmetric=encoding.symmetric,
                    scale_dtype=encoding.scale_dtype,
                )
                writer.add_quantized(tensor.name, packed, shape=tensor.header_shape, flags=tensor.flags)
                stored = encoding.dtype
            else:
                writer.add_dense(
                    tensor.name, tensor.load_f32(), encoding.dtype, shape=tensor.header_shape, flags=tensor.flags
                )
                stored = encoding.dtype
            counts[stored] = counts.get(stored, 0) + 1
        if progress is not None:
            progress(total, total, "")
    return ConvertReport(
        output=out,
        arch=model.arch.name,
        tensors=total,
        bytes_written=out.stat().st_size,
        seconds=time.monotonic() - started,
        dtype_counts=counts,
        warnings=warnings,
    )


LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def _tensor_order(tensor) -> tuple:
    """Embeddings first, then layers in numeric order, then the head."""
    if tensor.name == "embed_tokens.weight":
        return (0, 0, "")
    match = LAYER.match(tensor.name)
    if match:
        return (1, int(match.group(1)), match.group(2))
    return (2, 0, tensor.name)
