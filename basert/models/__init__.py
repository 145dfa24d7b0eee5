"""One module per model family; `build_model` picks it through the .base header's `arch`.

The architectures themselves (names, families, source names) are listed in basert.format.architectures;
FAMILIES gives each family its typed config and forward pass. Building a model is what validates it:
the family's config class checks the header's config, every block takes its tensors with the shapes that
config implies, and build_model checks that the tensors cover exactly the configured layers, all used.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from basert.format import ARCHITECTURES, Architecture, BaseFile, ModelValidationError
from basert.models import gemma3, llama, qwen3, qwen35
from basert.models.config import (
    ConfigReader,
    DecoderConfig,
    Gemma3Config,
    LlamaConfig,
    Qwen3Config,
    Qwen35Config,
)
from basert.models.layers import Weights
from basert.models.transformer import DecoderModel


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """How the architectures of one family read their config and build their forward pass."""

    read_config: Callable[[ConfigReader, Architecture], DecoderConfig]
    build: Callable[[Weights, Any, int], DecoderModel]   # (weights, the read config, max positions)


FAMILIES: dict[str, ModelFamily] = {
    "llama": ModelFamily(LlamaConfig.read, llama.build),
    "qwen3": ModelFamily(Qwen3Config.read, qwen3.build),
    "qwen35": ModelFamily(Qwen35Config.read, qwen35.build),
    "gemma3": ModelFamily(Gemma3Config.read, gemma3.build),
}

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


def read_config(base: BaseFile) -> DecoderConfig:
    """The typed config of a .base file's header; raises ModelValidationError when the architecture is not
    supported or the config is not valid for it."""
    arch = ARCHITECTURES.get(base.arch)
    if arch is None:
        raise ModelValidationError(
            f"{base.path}: architecture {base.arch!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})")
    return FAMILIES[arch.family].read_config(ConfigReader(base), arch)


def build_model(base: BaseFile, max_pos: int) -> DecoderModel:
    """The forward pass for a .base file; raises ModelValidationError when its arch, config and tensors
    do not fit together."""
    config = read_config(base)
    family = FAMILIES[ARCHITECTURES[base.arch].family]
    reader = ConfigReader(base)
    n_layers = config.num_hidden_layers
    found = {int(match.group(1)) for name in base.tensors if (match := _LAYER_INDEX.match(name))}
    if found != set(range(n_layers)):
        numbered = f" numbered {min(found)}..{max(found)}" if found else ""
        raise reader.error(f"config num_hidden_layers is {n_layers}, but the file has tensors for "
                           f"{len(found)} layers{numbered}")
    weights = Weights(base)
    model = family.build(weights, config, max_pos)
    unused = [name for name in base.tensors if name not in weights.used]
    if unused:
        raise weights.error(f"tensor {unused[0]!r} is not used by {base.arch} with this config "
                            f"({len(unused)} unused tensors)")
    return model


__all__ = ["FAMILIES", "DecoderModel", "ModelFamily", "build_model", "read_config"]
