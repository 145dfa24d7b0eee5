"""Typed model configs and the architecture registry: each header key is read, checked and defaulted in one
place, a bad value is refused naming the file, arch and key, and converter and models agree on the archs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from basert.convert import ConvertError
from basert.convert.config import gguf_arch, hf_arch
from basert.format import (
    ARCHITECTURES,
    BY_GGUF_ARCHITECTURE,
    BY_HF_MODEL_TYPE,
    BaseFile,
    BaseWriter,
    ModelValidationError,
)
from basert.models import FAMILIES, build_model
from basert.models.config import (
    ConfigReader,
    Gemma3Config,
    LlamaConfig,
    MoEConfig,
    Qwen3Config,
    Qwen35Config,
)

DECODER = {
    "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "vocab_size": 512, "intermediate_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rotary_dim": 8,
    "rope_style": "split_half",
}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
LINEAR = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
          "linear_value_head_dim": 24, "linear_conv_kernel_dim": 4,
          "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
SLIDING = {"sliding_window": 8, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 32,
           "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}
MINIMAL = {
    "llama": DECODER,
    "gemma3": {**DECODER, **SLIDING},
    "qwen": DECODER,
    "qwen3_moe": {**DECODER, **MOE},
    "qwen35": {**DECODER, **LINEAR},
    "qwen35moe": {**DECODER, **MOE, **LINEAR},
}


def header_only(directory: Path, arch: str, config: dict[str, Any]) -> Path:
    """A .base file with this arch and config and no tensors: enough to read its config."""
    path = directory / f"{arch}.base"
    with BaseWriter(path, arch=arch, config=config, tokenizer={}, source={"format": "hf_safetensors"},
                    quant_scheme="f32"):
        pass
    return path


def read(directory: Path, arch: str, config: dict[str, Any]):
    """The typed config of a header-only file, read by its arch's family."""
    with BaseFile(header_only(directory, arch, config)) as base:
        return FAMILIES[ARCHITECTURES[arch].family].read_config(ConfigReader(base), ARCHITECTURES[arch])


def test_every_architecture_has_a_family_and_every_family_an_architecture() -> None:
    assert {arch.family for arch in ARCHITECTURES.values()} == set(FAMILIES)
    assert set(MINIMAL) == set(ARCHITECTURES)


def test_each_source_name_maps_to_one_architecture() -> None:
    assert len(BY_HF_MODEL_TYPE) == sum(len(arch.hf_model_types) for arch in ARCHITECTURES.values())
    assert len(BY_GGUF_ARCHITECTURE) == sum(len(arch.gguf_architectures) for arch in ARCHITECTURES.values())
    assert hf_arch("qwen3_next").name == "qwen35moe" and gguf_arch("qwen3moe").name == "qwen3_moe"
    with pytest.raises(ConvertError, match=r"unsupported HF model_type 'gemma3' \(supported: llama, qwen2, "):
        hf_arch("gemma3")


@pytest.mark.parametrize("arch", MINIMAL)
def test_minimal_config_reads_with_the_defaults(tmp_path: Path, arch: str) -> None:
    config = read(tmp_path, arch, MINIMAL[arch])
    assert type(config) is {"llama": LlamaConfig, "qwen3": Qwen3Config, "qwen35": Qwen35Config,
                            "gemma3": Gemma3Config}[ARCHITECTURES[arch].family]
    assert (config.hidden_size, config.num_key_value_heads, config.head_dim, config.vocab_size) == (64, 2, 32, 512)
    assert config.rope_interleaved is False
    if isinstance(config, LlamaConfig):
        assert config.qk_norm is False
    if isinstance(config, Qwen3Config):
        assert config.qk_norm is True
    if isinstance(config, Qwen35Config):
        assert config.attn_output_gate is True
        assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
        assert config.linear_attention.conv_dim == 2 * 2 * 16 + 4 * 24
    if isinstance(config, Gemma3Config):
        assert config.layer_types == ("sliding_attention",) * 3 + ("full_attention",)
        assert (config.sliding_window, config.rope_local_theta, config.query_pre_attn_scalar) == (8, 10000.0, 32.0)
    moe = getattr(config, "moe", None)
    assert (moe is not None) is ARCHITECTURES[arch].moe
    if moe is not None:
        assert moe == MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=None, norm_topk_prob=True, decoder_sparse_step=1,
                                mlp_only_layers=frozenset())


def test_header_values_override_the_defaults(tmp_path: Path) -> None:
    config = read(tmp_path, "qwen3_moe", {**MINIMAL["qwen3_moe"], "qk_norm": False, "norm_topk_prob": False,
                                          "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert config.qk_norm is False and config.moe.norm_topk_prob is False
    assert [config.moe.is_sparse(layer) for layer in range(4)] == [False, True, False, False]
    assert read(tmp_path, "llama", {**DECODER, "qk_norm": True}).qk_norm is True


BAD_VALUES = {
    "llama": [("qk_norm", "yes", "config qk_norm is 'yes', expected true or false"),
              ("rope_style", "rotated", "config rope_style is 'rotated', expected one of interleaved, split_half"),
              ("rotary_dim", 7, "config rotary_dim 7 must be even and at most head_dim 32"),
              ("num_key_value_heads", 3, "config num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
              ("rms_norm_eps", None, "config lacks rms_norm_eps")],
    "qwen3_moe": [("num_experts_per_tok", 5, "config num_experts_per_tok 5 exceeds num_experts 4"),
                  ("mlp_only_layers", [4], "config mlp_only_layers is [4], expected a list of layer indices below 4"),
                  ("decoder_sparse_step", 0, "config decoder_sparse_step is 0, expected a positive integer"),
                  ("moe_intermediate_size", None, "config lacks moe_intermediate_size")],
    "gemma3": [("sliding_window", 0, "config sliding_window is 0, expected a positive integer"),
               ("layer_types", ["linear_attention"] * 4,
                "config layer_types is ['linear_attention', 'linear_attention', 'linear_attention', "
                "'linear_attention'], expected a list of full_attention or sliding_attention"),
               ("layer_types", ["full_attention"] * 3,
                "config layer_types has 3 entries, num_hidden_layers is 4"),
               ("rope_local_base_freq", None, "config lacks rope_local_base_freq")],
    "qwen35moe": [("attn_output_gate", 1, "config attn_output_gate is 1, expected true or false"),
                  ("linear_num_value_heads", 3,
                   "config linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2"),
                  ("linear_key_head_dim", None, "config lacks linear_key_head_dim"),
                  ("shared_expert_intermediate_size", -48,
                   "config shared_expert_intermediate_size is -48, expected a positive integer")],
}


@pytest.mark.parametrize(("arch", "key", "value", "expected"),
                         [(arch, *case) for arch, cases in BAD_VALUES.items() for case in cases])
def test_bad_value_is_refused_naming_file_arch_and_key(tmp_path: Path, arch: str, key: str, value: Any,
                                                       expected: str) -> None:
    config = {**MINIMAL[arch], key: value}
    with pytest.raises(ModelValidationError) as raised:
        read(tmp_path, arch, config)
    assert str(raised.value) == f"{tmp_path / f'{arch}.base'} ({arch}): {expected}"


def test_built_models_expose_their_typed_config(smollm2_base: Path, tiny_f32_bases: dict[str, Path]) -> None:
    with BaseFile(smollm2_base) as base:
        model = build_model(base, max_pos=16)
        assert isinstance(model.config, LlamaConfig)
        assert (model.config.num_key_value_heads, model.config.head_dim, model.config.vocab_size) == (3, 64, 49152)
        assert model.config.rope_interleaved and model.linear_attention is None
    with BaseFile(tiny_f32_bases["qwen3_5_moe-tiny"]) as base:
        model = build_model(base, max_pos=16)
        assert isinstance(model.config, Qwen35Config)
        assert model.config.intermediate_size is None and model.config.moe.shared_expert_intermediate_size == 48
        conv = base.tensors["layers.0.linear_attn.conv1d.weight"]
        assert model.linear_attention.conv_dim == conv.shape[0] == 160
        assert model.n_linear_layers == model.config.layer_types.count("linear_attention") == 3
