"""Which .base dtype each tensor gets: the --target, an optional --profile, and lossless sources."""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path

from basert.convert.source import ConvertError, SourceTensor
from basert.format.quant import ALLOWED_GROUP_SIZES

TARGETS = ("auto", "base-q4", "base-q8", "bf16", "f16", "f32")
QUANT_TARGETS = {"base-q4": "base_q4", "base-q8": "base_q8"}
DEFAULT_GROUP = {"base_q4": 64, "base_q8": 128}


@dataclass(frozen=True, slots=True)
class Encoding:
    """How one tensor is stored: a dense dtype, or a quantized dtype with its group layout."""

    dtype: str
    group_size: int | None = None
    scale_dtype: str = "f16"
    symmetric: bool = False
    native: bool = False  # the source's own bytes, re-packed losslessly
    blocks: bool = False  # the source's GGUF blocks, kept as they are

    @property
    def quantized(self) -> bool:
        return self.group_size is not None


@dataclass(frozen=True, slots=True)
class Rule:
    target: str
    group_size: int | None
    scale_dtype: str
    symmetric: bool


@dataclass(frozen=True, slots=True)
class TargetPolicy:
    """The default rule plus ordered per-name overrides (first match wins)."""

    default: Rule
    overrides: tuple[tuple[str, Rule], ...] = ()
    profile: dict | None = None

    def rule_for(self, name: str) -> Rule:
        for pattern, rule in self.overrides:
            if fnmatch.fnmatchcase(name, pattern):
                return rule
        return self.default


def _rule(spec: dict, fallback_target: str, scale_dtype: str, where: str) -> Rule:
    target = spec.get("target", fallback_target)
    if target not in TARGETS:
        raise ConvertError(f"{where}: unknown target {target!r} (choose from {', '.join(TARGETS)})")
    group = spec.get("group_size")
    if group is not None and group not in ALLOWED_GROUP_SIZES:
        raise ConvertError(f"{where}: group_size {group} not in {ALLOWED_GROUP_SIZES}")
    scale = spec.get("scale_dtype", scale_dtype)
    if scale not in ("f16", "bf16"):
        raise ConvertError(f"{where}: scale_dtype must be f16 or bf16, not {scale!r}")
    return Rule(target, group, scale, bool(spec.get("symmetric", False)))


def load_policy(target: str, profile_path: Path | None) -> TargetPolicy:
    """The policy for a bare --target (f16 scales) or a JSON profile (bf16 scales by default)."""
    if target not in TARGETS:
        raise ConvertError(f"unknown target {target!r} (choose from {', '.join(TARGETS)})")
    if profile_path is None:
        return TargetPolicy(Rule(target, None, "f16", False))
    try:
        profile = json.loads(Path(profile_path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConvertError(f"cannot read profile {profile_path}: {exc}") from exc
    if not isinstance(profile, dict):
        raise ConvertError(f"profile {profile_path} must be a JSON object")
    default = _rule(profile, target, "bf16", f"profile {profile_path}")
    overrides = []
    for index, entry in enumerate(profile.get("overrides", [])):
        if not isinstance(entry, dict) or "match" not in entry:
            raise ConvertError(f"profile {profile_path}: overrides[{index}] needs a 'match' pattern")
        overrides.append((entry["match"], _rule(entry, default.target, default.scale_dtype,
                                                f"profile {profile_path} overrides[{index}]")))
    return TargetPolicy(default, tuple(overrides), profile)


def choose_encoding(tensor: SourceTensor, policy: TargetPolicy) -> tuple[Encoding, str | None]:
    """The encoding for a tensor, and a warning when the requested one cannot apply."""
    if tensor.keep_f32:
        return Encoding("f32"), None
    rule = policy.rule_for(tensor.name)
    native_quant = tensor.native is not None
    if rule.target == "auto":
        if native_quant:
            return Encoding("native", native=True), None
        if tensor.native_dense is not None:
            return Encoding(tensor.native_dense), None
        if tensor.block_type is not None:
            return Encoding(tensor.block_type.dtype, blocks=True), None
        return _quantized(tensor, "base_q8", rule)
    if rule.target in ("f32", "f16", "bf16"):
        return Encoding(rule.target), None
    dtype = QUANT_TARGETS[rule.target]
    if native_quant and tensor.source_type in _NATIVE_FAMILY[dtype] and rule.group_size in (None, 32):
        return Encoding("native", native=True), None
    return _quantized(tensor, dtype, rule)


_NATIVE_FAMILY = {"base_q4": {"Q4_0", "Q4_1"}, "base_q8": {"Q8_0"}}


def _quantized(tensor: SourceTensor, dtype: str, rule: Rule) -> tuple[Encoding, str | None]:
    last = tensor.array_shape[-1] if tensor.array_shape else 0
    preferred = rule.group_size or DEFAULT_GROUP[dtype]
    candidates = [preferred] + [g for g in sorted(ALLOWED_GROUP_SIZES, reverse=True) if g < preferred]
    for group in candidates:
        if len(tensor.array_shape) >= 2 and last % group == 0:
            return Encoding(dtype, group, rule.scale_dtype, rule.symmetric), None
    return Encoding("f32"), f"{tensor.name}: shape {list(tensor.array_shape)} cannot be grouped for {dtype}; kept f32"
