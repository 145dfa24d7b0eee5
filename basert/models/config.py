"""The hyper-parameters of a .base header's `config`, as one frozen dataclass per model family.

Each family's `read` takes every value its forward pass uses through ConfigReader's checks, so a missing or
out-of-range key raises ModelValidationError naming the file, arch and key at model build, instead of a
KeyError or a wrong shape deep inside a forward pass. A key a header may omit has its default here, in
the `read` of the one class that uses it, and nowhere else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from basert.format import Architecture, BaseFile, ModelValidationError

LAYER_KINDS = ("full_attention", "linear_attention")        # hybrid models
ATTENTION_KINDS = ("full_attention", "sliding_attention")   # models with sliding-window layers
ROPE_STYLES = ("interleaved", "split_half")


class ConfigReader:
    """Checked reads of one model's raw config; `error()` makes a ModelValidationError naming the file and arch."""

    def __init__(self, base: BaseFile):
        self.values = base.config
        self.where = f"{base.path} ({base.arch})"

    def error(self, message: str) -> ModelValidationError:
        """An error whose message starts with the file and its arch."""
        return ModelValidationError(f"{self.where}: {message}")

    def count(self, key: str, default: int | None = None) -> int:
        """A positive integer."""
        value = self._get(key, default)
        if not _is_int(value) or value <= 0:
            raise self.error(f"config {key} is {value!r}, expected a positive integer")
        return value

    def optional_count(self, key: str) -> int | None:
        """A positive integer, or None when the key is absent."""
        return None if self.values.get(key) is None else self.count(key)

    def number(self, key: str) -> float:
        """A finite positive number."""
        value = self._get(key, None)
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

    def layer_set(self, key: str) -> frozenset[int]:
        """A list of layer indices (empty when absent)."""
        value = self._get(key, [])
        n_layers = self.count("num_hidden_layers")
        if not isinstance(value, list) or not all(_is_int(i) and 0 <= i < n_layers for i in value):
            raise self.error(f"config {key} is {value!r}, expected a list of layer indices below {n_layers}")
        return frozenset(value)

    def layer_types(self, kinds: tuple[str, ...] = LAYER_KINDS) -> tuple[str, ...]:
        """The kind of each layer, one of `kinds` per hidden layer."""
        value = self._get("layer_types", None)
        n_layers = self.count("num_hidden_layers")
        if not isinstance(value, list) or any(kind not in kinds for kind in value):
            raise self.error(f"config layer_types is {value!r}, expected a list of {' or '.join(kinds)}")
        if len(value) != n_layers:
            raise self.error(f"config layer_types has {len(value)} entries, num_hidden_layers is {n_layers}")
        return tuple(value)

    def _get(self, key: str, default: Any) -> Any:
        value = self.values.get(key)
        if value is not None:
            return value
        if default is None:
            raise self.error(f"config lacks {key}")
        return default


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """The sparse mixture-of-experts feed-forward of the MoE architectures."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int                    # hidden width of each expert
    shared_expert_intermediate_size: int | None   # None when the header does not give one
    norm_topk_prob: bool                          # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int                      # every step-th layer is sparse ...
    mlp_only_layers: frozenset[int]               # ... except these, which keep a dense MLP

    @classmethod
    def read(cls, config: ConfigReader) -> MoEConfig:
        """The MoE keys of a header's config, checked."""
        num_experts = config.count("num_experts")
        top_k = config.count("num_experts_per_tok")
        if top_k > num_experts:
            raise config.error(f"config num_experts_per_tok {top_k} exceeds num_experts {num_experts}")
        return cls(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=config.count("moe_intermediate_size"),
            shared_expert_intermediate_size=config.optional_count("shared_expert_intermediate_size"),
            norm_topk_prob=config.flag("norm_topk_prob", True),
            decoder_sparse_step=config.count("decoder_sparse_step", 1),
            mlp_only_layers=config.layer_set("mlp_only_layers"),
        )

    def is_sparse(self, layer: int) -> bool:
        """True when `layer`'s feed-forward block is the sparse MoE rather than a dense MLP."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True, slots=True)
class LinearAttentionConfig:
    """The sizes of a hybrid model's Gated DeltaNet layers (header keys `linear_*`)."""

    num_key_heads: int     # linear_num_key_heads
    num_value_heads: int   # linear_num_value_heads, a multiple of num_key_heads
    key_head_dim: int      # linear_key_head_dim
    value_head_dim: int    # linear_value_head_dim
    conv_kernel_dim: int   # linear_conv_kernel_dim: the causal conv1d's kernel width K

    @classmethod
    def read(cls, config: ConfigReader) -> LinearAttentionConfig:
        """The linear_* keys of a header's config, checked."""
        n_k, n_v = config.count("linear_num_key_heads"), config.count("linear_num_value_heads")
        if n_v % n_k:
            raise config.error(f"config linear_num_value_heads {n_v} is not a multiple of linear_num_key_heads {n_k}")
        return cls(
            num_key_heads=n_k,
            num_value_heads=n_v,
            key_head_dim=config.count("linear_key_head_dim"),
            value_head_dim=config.count("linear_value_head_dim"),
            conv_kernel_dim=config.count("linear_conv_kernel_dim"),
        )

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv1d over the mixed [q | k | v] projection (and of its carried state)."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """What every family shares: residual stream, attention heads, RoPE, vocabulary."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int        # a divisor of num_attention_heads (grouped-query attention)
    head_dim: int
    vocab_size: int
    intermediate_size: int | None   # dense MLP width; None when absent (MoE models whose every layer is sparse)
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int                 # leading dims of each head that RoPE rotates, even and at most head_dim
    rope_style: str                 # "interleaved" (adjacent pairs) or "split_half"
    trained_context: int | None     # positions the model was trained on (max_position_embeddings), if known

    @property
    def rope_interleaved(self) -> bool:
        return self.rope_style == "interleaved"

    @property
    def kv_layers(self) -> int:
        """Layers that keep K and V for every position (attention layers that see every position)."""
        return self.num_hidden_layers

    @property
    def window_layers(self) -> int:
        """Attention layers that see a sliding window of positions only (their KV is kept for the window)."""
        return 0

    @property
    def window(self) -> int:
        """The widest sliding window in positions (0: no window layer)."""
        return 0


def _decoder_values(config: ConfigReader) -> dict[str, Any]:
    """The DecoderConfig fields, checked."""
    n_heads, n_kv = config.count("num_attention_heads"), config.count("num_key_value_heads")
    if n_heads % n_kv:
        raise config.error(f"config num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
    head_dim, rotary_dim = config.count("head_dim"), config.count("rotary_dim")
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise config.error(f"config rotary_dim {rotary_dim} must be even and at most head_dim {head_dim}")
    return {
        "hidden_size": config.count("hidden_size"),
        "num_hidden_layers": config.count("num_hidden_layers"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "vocab_size": config.count("vocab_size"),
        "intermediate_size": config.optional_count("intermediate_size"),
        "rms_norm_eps": config.number("rms_norm_eps"),
        "rope_theta": config.number("rope_theta"),
        "rotary_dim": rotary_dim,
        "rope_style": config.choice("rope_style", ROPE_STYLES),
        "trained_context": config.optional_count("max_position_embeddings"),
    }


@dataclass(frozen=True, slots=True)
class LlamaConfig(DecoderConfig):
    """Llama: attention and a dense MLP in every layer."""

    qk_norm: bool   # per-head RMSNorm of q and k before RoPE

    @classmethod
    def read(cls, config: ConfigReader, arch: Architecture) -> LlamaConfig:
        """A llama header's config, checked."""
        return cls(**_decoder_values(config), qk_norm=config.flag("qk_norm", False))


@dataclass(frozen=True, slots=True)
class Qwen3Config(DecoderConfig):
    """Qwen2 / Qwen3 dense and Qwen3-MoE: the llama layer, q/k norm (Qwen3), sparse MoE in the MoE arch."""

    qk_norm: bool            # per-head RMSNorm of q and k before RoPE (Qwen3; Qwen2 has none)
    moe: MoEConfig | None    # None for the dense arch

    @classmethod
    def read(cls, config: ConfigReader, arch: Architecture) -> Qwen3Config:
        """A qwen or qwen3_moe header's config, checked; the MoE keys only for an MoE arch."""
        moe = MoEConfig.read(config) if arch.moe else None
        return cls(**_decoder_values(config), qk_norm=config.flag("qk_norm", True), moe=moe)


@dataclass(frozen=True, slots=True)
class Qwen35Config(DecoderConfig):
    """Qwen3.5 / 3.6 hybrid and Qwen3-Next: Gated DeltaNet and gated full-attention layers, dense or MoE."""

    layer_types: tuple[str, ...]               # "full_attention" or "linear_attention", one per layer
    attn_output_gate: bool                     # full attention's output is multiplied by sigmoid(gate)
    linear_attention: LinearAttentionConfig
    moe: MoEConfig | None                      # None for the dense arch

    @property
    def kv_layers(self) -> int:
        return self.layer_types.count("full_attention")

    @classmethod
    def read(cls, config: ConfigReader, arch: Architecture) -> Qwen35Config:
        """A qwen35 or qwen35moe header's config, checked; the MoE keys only for an MoE arch."""
        moe = MoEConfig.read(config) if arch.moe else None
        return cls(
            **_decoder_values(config),
            layer_types=config.layer_types(),
            attn_output_gate=config.flag("attn_output_gate", True),
            linear_attention=LinearAttentionConfig.read(config),
            moe=moe,
        )


@dataclass(frozen=True, slots=True)
class Gemma3Config(DecoderConfig):
    """Gemma 3: sliding-window and global attention layers with their own RoPE bases, q/k norms, GeGLU."""

    layer_types: tuple[str, ...]   # "sliding_attention" or "full_attention", one per layer
    sliding_window: int            # positions a sliding layer's token sees, itself included
    rope_local_theta: float        # RoPE base of the sliding layers (rope_theta is the global layers')
    query_pre_attn_scalar: float   # attention scores are scaled by query_pre_attn_scalar ** -0.5

    @property
    def kv_layers(self) -> int:
        return self.layer_types.count("full_attention")

    @property
    def window_layers(self) -> int:
        return self.layer_types.count("sliding_attention")

    @property
    def window(self) -> int:
        return self.sliding_window if self.window_layers else 0

    @classmethod
    def read(cls, config: ConfigReader, arch: Architecture) -> Gemma3Config:
        """A gemma3 header's config, checked."""
        return cls(
            **_decoder_values(config),
            layer_types=config.layer_types(ATTENTION_KINDS),
            sliding_window=config.count("sliding_window"),
            rope_local_theta=config.number("rope_local_base_freq"),
            query_pre_attn_scalar=config.number("query_pre_attn_scalar"),
        )
