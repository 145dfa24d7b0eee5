"""ModelConfig: the hyper-parameters of a .base header's `config`, read through checks.

A layer asks for each value it uses; a missing or out-of-range one raises ModelValidationError naming
the key, at model build, instead of a KeyError or a wrong shape deep inside a forward pass.
"""

from __future__ import annotations

import math
from typing import Any

from basert.format import BaseFile, ModelValidationError

LAYER_KINDS = ("full_attention", "linear_attention")


class ModelConfig:
    """Checked reads of one model's config; `error()` makes a ModelValidationError naming the file and arch."""

    def __init__(self, base: BaseFile):
        self.values = base.config
        self.where = f"{base.path} ({base.arch})"

    def error(self, message: str) -> ModelValidationError:
        return ModelValidationError(f"{self.where}: {message}")

    def count(self, key: str, default: int | None = None) -> int:
        """A positive integer."""
        value = self._get(key, default)
        if not _is_int(value) or value <= 0:
            raise self.error(f"config {key} is {value!r}, expected a positive integer")
        return value

    def number(self, key: str, default: float | None = None) -> float:
        """A finite positive number."""
        value = self._get(key, default)
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and value > 0):
            raise self.error(f"config {key} is {value!r}, expected a finite positive number")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self.error(f"config {key} is {value!r}, expected true or false")
        return value

    def choice(self, key: str, options: tuple[str, ...]) -> str:
        value = self._get(key, None)
        if value not in options:
            raise self.error(f"config {key} is {value!r}, expected one of {', '.join(options)}")
        return value

    def layer_set(self, key: str) -> set[int]:
        """A list of layer indices (empty when absent)."""
        value = self._get(key, [])
        n_layers = self.count("num_hidden_layers")
        if not isinstance(value, list) or not all(_is_int(i) and 0 <= i < n_layers for i in value):
            raise self.error(f"config {key} is {value!r}, expected a list of layer indices below {n_layers}")
        return set(value)

    def layer_types(self) -> list[str]:
        """The kind of each layer: `full_attention` or `linear_attention`, one per hidden layer."""
        value = self._get("layer_types", None)
        n_layers = self.count("num_hidden_layers")
        if not isinstance(value, list) or any(kind not in LAYER_KINDS for kind in value):
            raise self.error(f"config layer_types is {value!r}, expected a list of {' or '.join(LAYER_KINDS)}")
        if len(value) != n_layers:
            raise self.error(f"config layer_types has {len(value)} entries, num_hidden_layers is {n_layers}")
        return value

    def _get(self, key: str, default: Any) -> Any:
        value = self.values.get(key)
        if value is not None:
            return value
        if default is None:
            raise self.error(f"config lacks {key}")
        return default


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
