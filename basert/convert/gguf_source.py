"""GGUF file -> canonical .base tensors: name mapping, config keys, lossless quant mappings."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import gguf
import numpy as np

from basert.convert.config import finish_config, gguf_arch
from basert.convert.gguf_reader import read_gguf
from basert.convert.source import (
    FLAG_EXPERT_WEIGHT,
    FLAG_SSM_A_MATRIX,
    ConvertError,
    SourceModel,
    SourceTensor,
    is_control_tensor,
)
from basert.convert.tokenizer_source import tokenizer_object_from_gguf
from basert.format.ggml_blocks import BLOCK_TYPES
from basert.format.quant import QuantizedTensor, from_parts

Q = gguf.GGMLQuantizationType

GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "final_norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm.weight": "input_norm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attn_norm.weight",
    "post_attention_norm.weight": "post_attn_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_exps.weight": "ffn_gate_exps.weight",
    "ffn_up_exps.weight": "ffn_up_exps.weight",
    "ffn_down_exps.weight": "ffn_down_exps.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_dt": "linear_attn.dt_bias",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
# Where an architecture's GGUF layer names mean something else: Gemma 3's post_attention_norm is the norm of the
# attention output, its ffn_norm the pre-MLP norm (.base's post_attn_norm), and post_ffw_norm the MLP output's.
ARCH_LAYER_NAMES = {
    "gemma3": {
        "post_attention_norm.weight": "attn_out_norm.weight",
        "ffn_norm.weight": "post_attn_norm.weight",
        "post_ffw_norm.weight": "mlp_out_norm.weight",
    },
}
LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
# Qwen3-Next GGUFs keep in_proj_qkvz / in_proj_ba fused and head-interleaved; re-ordering their
# quantized rows is not implemented, so such files are refused rather than converted incompletely.
UNSUPPORTED_FUSED = ("ssm_in.weight", "ssm_ba.weight")

# GGUF metadata key (after "<arch>.") -> normalised config key.
CONFIG_KEYS = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "context_length": "max_position_embeddings",
    "vocab_size": "vocab_size",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    "full_attention_interval": "full_attention_interval",
    "ssm.conv_kernel": "linear_conv_kernel_dim",
    "ssm.state_size": "linear_key_head_dim",
    "ssm.group_count": "linear_num_key_heads",
    "ssm.time_step_rank": "linear_num_value_heads",
    "attention.sliding_window": "sliding_window",
    "rope.freq_base_swa": "rope_local_base_freq",
}

LOSSLESS_DENSE = {Q.F32: "f32", Q.F16: "f16", Q.BF16: "bf16"}
LOSSLESS_QUANT = {Q.Q4_0, Q.Q4_1, Q.Q8_0}


def canonical_name(gguf_name: str, gguf_arch_name: str = "") -> str | None:
    """The .base name of a GGUF tensor of that architecture, or None when the name is not a known text-model
    tensor."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = LAYER.match(gguf_name)
    if match is None:
        return None
    name = ARCH_LAYER_NAMES.get(gguf_arch_name, {}).get(match.group(2)) or LAYER_NAMES.get(match.group(2))
    return None if name is None else f"layers.{match.group(1)}.{name}"


def field_value(reader: gguf.GGUFReader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_config(reader: gguf.GGUFReader, gguf_arch_name: str) -> dict:
    """Model hyper-parameters from `<arch>.*` metadata, under HF config names."""
    config: dict = {"model_type": gguf_arch_name}
    for suffix, key in CONFIG_KEYS.items():
        value = field_value(reader, f"{gguf_arch_name}.{suffix}")
        if value is not None:
            config[key] = value
    rope_dims = field_value(reader, f"{gguf_arch_name}.rope.dimension_count")
    if "vocab_size" not in config:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is not None:
            config["vocab_size"] = len(tokens.data)
    if "num_attention_heads" in config and "head_dim" not in config:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    if rope_dims is not None and "head_dim" in config:
        config["partial_rotary_factor"] = rope_dims / config["head_dim"]
    inner = field_value(reader, f"{gguf_arch_name}.ssm.inner_size")
    if inner is not None and "linear_num_value_heads" in config:
        config["linear_value_head_dim"] = inner // config["linear_num_value_heads"]
    if "num_experts" in config:
        config["norm_topk_prob"] = True
    return config


def native_quantized(tensor: gguf.ReaderTensor) -> QuantizedTensor:
    """Re-pack a Q4_0 / Q4_1 / Q8_0 tensor into the .base layout without changing any value."""
    rows_shape = tuple(int(d) for d in reversed(tensor.shape))
    blocks = np.asarray(tensor.data).reshape(-1)
    qtype = tensor.tensor_type
    if qtype == Q.Q8_0:
        blocks = blocks.reshape(-1, 34)
        scales = blocks[:, 0:2].copy().view(np.uint16).reshape(-1)
        stored = (blocks[:, 2:] ^ np.uint8(0x80)).reshape(-1)  # int8 q -> u = q + 128
        return from_parts("base_q8", rows_shape, 32, "f16", stored, scales, None)
    if qtype == Q.Q4_1:
        blocks = blocks.reshape(-1, 20)
        scales = blocks[:, 0:2].copy().view(np.uint16).reshape(-1)
        biases = blocks[:, 2:4].copy().view(np.uint16).reshape(-1)
        nibbles = blocks[:, 4:]
    elif qtype == Q.Q4_0:
        blocks = blocks.reshape(-1, 18)
        d = blocks[:, 0:2].copy().view(np.float16).reshape(-1)
        scales = d.view(np.uint16)
        biases = (d * np.float16(-8.0)).view(np.uint16)  # exact: a power-of-two multiple
        nibbles = blocks[:, 2:]
    else:
        raise ConvertError(f"{tensor.name}: {qtype.name} has no lossless .base mapping")
    # GGUF: byte j holds elements j (low) and j+16 (high); .base: byte i holds 2i (low), 2i+1 (high).
    values = np.concatenate([nibbles & np.uint8(0x0F), nibbles >> np.uint8(4)], axis=1)
    packed = (values[:, 0::2] | (values[:, 1::2] << np.uint8(4))).astype(np.uint8).reshape(-1)
    return from_parts("base_q4", rows_shape, 32, "f16", packed, scales, biases)


def open_gguf(path: Path, tokenizer_object: dict | None) -> SourceModel:
    """Read a GGUF file's metadata and tensors (loaded lazily from the mmap)."""
    try:
        reader = read_gguf(path)
    except (ValueError, OSError) as exc:
        raise ConvertError(f"{path}: not a readable GGUF file ({exc})") from exc
    arch_name = field_value(reader, "general.architecture")
    if not isinstance(arch_name, str):
        raise ConvertError(f"{path}: GGUF has no general.architecture")
    arch = gguf_arch(arch_name)
    # GGUF q/k rows are already in the arch's RoPE order (llama.cpp permutes llama's to adjacent pairs).
    config = finish_config(arch, gguf_config(reader, arch_name), norm_plus_one_folded=False)
    warnings: list[str] = []
    tensors: list[SourceTensor] = []
    for tensor in reader.tensors:
        if tensor.name.endswith(UNSUPPORTED_FUSED):
            raise ConvertError(
                f"{path}: fused GGUF tensor {tensor.name} is not supported; convert the HF safetensors "
                "checkpoint instead"
            )
        name = canonical_name(tensor.name, arch_name)
        if name is None:
            warnings.append(f"skipping unknown GGUF tensor {tensor.name}")
            continue
        tensors.append(_source_tensor(tensor, name, warnings))
    names = {t.name for t in tensors}
    config["tie_word_embeddings"] = "lm_head.weight" not in names
    config["qk_norm"] = any(n.endswith("self_attn.q_norm.weight") for n in names)
    if any(n.endswith("linear_attn.A_log") for n in names):
        warnings.append(
            "hybrid GGUF: ssm_a is taken as stored -exp(A_log) and converted back to A_log; "
            "norm weights are taken as stored"
        )
    metadata = {
        key: field_value(reader, key)
        for key in ("general.name", "general.organization", "general.basename", "general.size_label")
        if field_value(reader, key) is not None
    }
    tokenizer = tokenizer_object if tokenizer_object is not None else tokenizer_object_from_gguf(reader)
    source = {"format": "gguf", "sha256": file_sha256(path), "filename": path.name}
    return SourceModel(arch, config, tokenizer, source, tensors, metadata, warnings)


def _source_tensor(tensor: gguf.ReaderTensor, name: str, warnings: list[str]) -> SourceTensor:
    qtype = tensor.tensor_type
    header_shape = [int(d) for d in tensor.shape]
    array_shape = tuple(reversed(header_shape))
    is_a_log = name.endswith("linear_attn.A_log")

    def load() -> np.ndarray:
        values = gguf.quants.dequantize(tensor.data, qtype).astype(np.float32, copy=False)
        values = values.reshape(array_shape)
        if is_a_log:
            values = np.log(-values).astype(np.float32)
        return np.ascontiguousarray(values)

    native = None
    native_dense = None
    block_type = None
    if qtype in LOSSLESS_QUANT:
        native = lambda: native_quantized(tensor)  # noqa: E731
    elif qtype in LOSSLESS_DENSE and not is_a_log:
        native_dense = LOSSLESS_DENSE[qtype]
    elif int(qtype) in BLOCK_TYPES and not is_a_log:
        block_type = BLOCK_TYPES[int(qtype)]
    elif not is_a_log:
        warnings.append(f"{tensor.name}: GGUF type {qtype.name} is de-quantized and re-quantized")
    flags = FLAG_EXPERT_WEIGHT if name.endswith("_exps.weight") else 0
    if is_a_log:
        flags |= FLAG_SSM_A_MATRIX
    return SourceTensor(
        name=name,
        array_shape=array_shape,
        header_shape=header_shape,
        source_type=qtype.name,
        load_f32=load,
        native=native,
        native_dense=native_dense,
        block_type=block_type,
        load_blocks=(lambda: np.asarray(tensor.data).reshape(-1)) if block_type is not None else None,
        flags=flags,
        keep_f32=is_control_tensor(name) or len(array_shape) == 1,
    )
