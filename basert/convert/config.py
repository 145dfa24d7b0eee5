"""Source architecture names to .base architectures, and the normalised model config every .base header carries."""

from __future__ import annotations

from basert.convert.source import ConvertError
from basert.format.architectures import BY_GGUF_ARCHITECTURE, BY_HF_MODEL_TYPE, Architecture


def hf_arch(model_type: str) -> Architecture:
    """The .base architecture for an HF config `model_type`."""
    try:
        return BY_HF_MODEL_TYPE[model_type]
    except KeyError:
        known = ", ".join(sorted(BY_HF_MODEL_TYPE))
        raise ConvertError(f"unsupported HF model_type {model_type!r} (supported: {known})") from None


def gguf_arch(name: str) -> Architecture:
    """The .base architecture for a GGUF `general.architecture`."""
    try:
        return BY_GGUF_ARCHITECTURE[name]
    except KeyError:
        known = ", ".join(sorted(BY_GGUF_ARCHITECTURE))
        raise ConvertError(f"unsupported GGUF architecture {name!r} (supported: {known})") from None


def finish_config(arch: Architecture, config: dict, *, norm_plus_one_folded: bool) -> dict:
    """Fill the derived keys the engine reads, so it never has to guess a convention."""
    cfg = dict(config)
    rope = cfg.pop("rope_parameters", None) or cfg.get("rope_scaling") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    if "partial_rotary_factor" not in cfg and "partial_rotary_factor" in rope:
        cfg["partial_rotary_factor"] = rope["partial_rotary_factor"]
    if rope:
        cfg["rope_parameters"] = rope
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if key not in cfg:
            raise ConvertError(f"model config lacks {key!r}")
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg.setdefault("rms_norm_eps", 1e-6)
    cfg.setdefault("rope_theta", 10000.0)
    cfg.setdefault("partial_rotary_factor", 1.0)
    cfg.setdefault("tie_word_embeddings", False)
    cfg.setdefault("hidden_act", "silu")
    cfg["rotary_dim"] = int(cfg["head_dim"] * cfg["partial_rotary_factor"])
    cfg["rope_style"] = arch.rope_style
    cfg["norm_plus_one_folded"] = norm_plus_one_folded
    if arch.family == "gemma3":
        _finish_gemma3(cfg)
    if arch.hybrid:
        interval = cfg.setdefault("full_attention_interval", 4)
        cfg.setdefault(
            "layer_types",
            [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(cfg["num_hidden_layers"])
            ],
        )
        cfg.setdefault("attn_output_gate", True)
        if len(cfg["layer_types"]) != cfg["num_hidden_layers"]:
            raise ConvertError(
                f"layer_types has {len(cfg['layer_types'])} entries for {cfg['num_hidden_layers']} layers"
            )
    return cfg


def _finish_gemma3(cfg: dict) -> None:
    """Gemma 3's sliding-window layout, local RoPE base and query scaling, with llama.cpp's values where the
    source does not say (its GGUFs carry only the window): every sixth layer global, local base 10,000, scores
    scaled by head_dim ** -0.5 (hidden / heads for the 62-layer 27B)."""
    if not cfg.get("sliding_window"):
        raise ConvertError("gemma3 model config lacks sliding_window")
    pattern = cfg.setdefault("sliding_window_pattern", 6)
    cfg.setdefault("layer_types", [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(cfg["num_hidden_layers"])
    ])
    if len(cfg["layer_types"]) != cfg["num_hidden_layers"]:
        raise ConvertError(f"layer_types has {len(cfg['layer_types'])} entries for {cfg['num_hidden_layers']} layers")
    cfg.setdefault("rope_local_base_freq", 10000.0)
    n_layers, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    cfg.setdefault("query_pre_attn_scalar", hidden // heads if n_layers == 62 else cfg["head_dim"])
    cfg["hidden_act"] = "gelu_pytorch_tanh"
