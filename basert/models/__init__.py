"""One module per architecture; `build_model` picks it from the .base header's `arch`."""

from __future__ import annotations

from basert.models import llama, qwen3, qwen35
from basert.models.layers import Weights
from basert.models.transformer import DecoderModel

BUILDERS = {
    "llama": llama.build,
    "qwen": qwen3.build,
    "qwen3_moe": qwen3.build,
    "qwen35": qwen35.build,
    "qwen35moe": qwen35.build,
}


class UnsupportedArchitectureError(ValueError):
    """The .base file's architecture has no forward pass here."""


def build_model(weights: Weights, arch: str, config: dict, max_pos: int) -> DecoderModel:
    """The forward pass for a .base file's architecture."""
    try:
        builder = BUILDERS[arch]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"architecture {arch!r} is not supported (supported: {', '.join(sorted(BUILDERS))})") from None
    return builder(weights, config, max_pos)


__all__ = ["BUILDERS", "DecoderModel", "UnsupportedArchitectureError", "build_model"]
