"""The architectures a .base header's `arch` may name, and the source names the converter maps onto each.

Pure data, shared by the converter (which GGUF and Hugging Face names become which arch, and what that
arch implies for the written file) and the models (which family reads the config and builds the forward).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Architecture:
    """One value of the header's `arch`."""

    name: str                            # the header's `arch`
    family: str                          # the config class and forward pass: "llama", "qwen3", "qwen35", "gemma3"
    hf_model_types: tuple[str, ...]      # HF config.json `model_type` values converted to this arch
    gguf_architectures: tuple[str, ...]  # GGUF `general.architecture` values converted to this arch
    rope_style: str                      # q/k row order in the .base file: "interleaved" pairs or "split_half"
    moe: bool                            # feed-forward blocks are sparse mixtures of experts
    hybrid: bool                         # Gated DeltaNet layers alongside full attention
    zero_centred_norms: bool             # HF RMSNorm weights w act as (1 + w); the converter stores 1 + w


ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        Architecture("llama", "llama", ("llama",), ("llama",), "interleaved",
                     moe=False, hybrid=False, zero_centred_norms=False),
        Architecture("qwen", "qwen3", ("qwen2", "qwen3"), ("qwen2", "qwen3"), "split_half",
                     moe=False, hybrid=False, zero_centred_norms=False),
        Architecture("qwen3_moe", "qwen3", ("qwen3_moe",), ("qwen3moe",), "split_half",
                     moe=True, hybrid=False, zero_centred_norms=False),
        Architecture("qwen35", "qwen35", ("qwen3_5", "qwen3_5_text"), ("qwen35",), "split_half",
                     moe=False, hybrid=True, zero_centred_norms=True),
        Architecture("qwen35moe", "qwen35", ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"),
                     ("qwen35moe", "qwen3next"), "split_half", moe=True, hybrid=True, zero_centred_norms=True),
        # From GGUF only: llama.cpp's converter has already added 1 to the norm weights.
        Architecture("gemma3", "gemma3", (), ("gemma3",), "split_half",
                     moe=False, hybrid=False, zero_centred_norms=True),
    )
}

BY_HF_MODEL_TYPE: dict[str, Architecture] = {
    model_type: arch for arch in ARCHITECTURES.values() for model_type in arch.hf_model_types
}

BY_GGUF_ARCHITECTURE: dict[str, Architecture] = {
    gguf_name: arch for arch in ARCHITECTURES.values() for gguf_name in arch.gguf_architectures
}
