"""One module per architecture; `build_model` picks it from the .base header's `arch`.

Building a model is what validates it: every block takes its tensors with the shapes its config
implies, and build_model checks that the tensors cover exactly the configured layers, all used.
"""

from __future__ import annotations

import re

from basert.format import BaseFile, ModelValidationError
from basert.models import llama, qwen3, qwen35
from basert.models.config import ModelConfig
from basert.models.layers import Weights
from basert.models.transformer import DecoderModel

BUILDERS = {
    "llama": llama.build,
    "qwen": qwen3.build,
    "qwen3_moe": qwen3.build,
    "qwen35": qwen35.build,
    "qwen35moe": qwen35.build,
}

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


def build_model(base: BaseFile, max_pos: int) -> DecoderModel:
    """The forward pass for a .base file; raises ModelValidationError when its arch, config and tensors
    do not fit together."""
    builder = BUILDERS.get(base.arch)
    if builder is None:
        raise ModelValidationError(
            f"{base.path}: architecture {base.arch!r} is not supported (supported: {', '.join(sorted(BUILDERS))})")
    config = ModelConfig(base)
    n_layers = config.count("num_hidden_layers")
    found = {int(match.group(1)) for name in base.tensors if (match := _LAYER_INDEX.match(name))}
    if found != set(range(n_layers)):
        numbered = f" numbered {min(found)}..{max(found)}" if found else ""
        raise config.error(f"config num_hidden_layers is {n_layers}, but the file has tensors for "
                           f"{len(found)} layers{numbered}")
    weights = Weights(base)
    model = builder(weights, config, max_pos)
    unused = [name for name in base.tensors if name not in weights.used]
    if unused:
        raise config.error(f"tensor {unused[0]!r} is not used by {base.arch} with this config "
                           f"({len(unused)} unused tensors)")
    return model


__all__ = ["BUILDERS", "DecoderModel", "build_model"]
