"""Hugging Face safetensors directory -> canonical .base tensors (name mapping and convert-time transforms)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
from safetensors import safe_open

from basert.convert.config import finish_config, hf_arch
from basert.convert.source import (
    FLAG_EXPERT_WEIGHT,
    FLAG_SSM_A_MATRIX,
    ConvertError,
    SourceModel,
    SourceTensor,
    is_control_tensor,
    is_zero_centred_norm,
)
from basert.convert.tokenizer_source import tokenizer_object_from_hf
from basert.format.architectures import Architecture

# Prefixes that carry the text model's weights; anything else under these is not ours to convert.
TEXT_PREFIXES = ("model.language_model.", "model.", "language_model.model.", "language_model.")
SKIPPED_PREFIXES = ("mtp.", "model.visual.", "visual.", "model.mtp.")

RENAMES = {
    "embed_tokens.weight": "embed_tokens.weight",
    "norm.weight": "final_norm.weight",
    "lm_head.weight": "lm_head.weight",
}
LAYER_RENAMES = {
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "post_attn_norm.weight",
}
PER_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
FUSED_EXPERTS = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(\.weight)?$")
LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def canonical_name(hf_name: str) -> str | None:
    """The .base name for an HF tensor name, or None for tensors outside the text model."""
    if hf_name.startswith(SKIPPED_PREFIXES):
        return None
    name = hf_name
    for prefix in TEXT_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if name in RENAMES:
        return RENAMES[name]
    match = LAYER.match(name)
    if match is None:
        return None
    layer, rest = match.groups()
    return f"layers.{layer}.{LAYER_RENAMES.get(rest, rest)}"


def load_hf_config(model_dir: Path) -> dict:
    """config.json, using `text_config` for vision-language wrappers."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConvertError(f"{model_dir} has no config.json")
    config = json.loads(path.read_text())
    text = config.get("text_config")
    if isinstance(text, dict) and "hidden_size" in text:
        merged = {**text}
        merged.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
        return merged
    return config


def directory_sha256(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def permute_for_interleaved_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder q/k rows of each head from split-half to adjacent-pair RoPE order."""
    out_dim = w.shape[0]
    head_dim = out_dim // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class HFDirectory:
    """Lazy access to every tensor in a directory's *.safetensors files."""

    def __init__(self, model_dir: Path):
        self.files = sorted(model_dir.glob("*.safetensors"))
        if not self.files:
            raise ConvertError(f"{model_dir} has no *.safetensors files")
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for path in self.files:
            with safe_open(path, framework="numpy") as handle:
                for key in handle.keys():
                    sl = handle.get_slice(key)
                    self.where[key] = path
                    self.shapes[key] = tuple(sl.get_shape())
                    self.dtypes[key] = sl.get_dtype()

    def load(self, key: str) -> np.ndarray:
        dtype = self.dtypes[key]
        if dtype == "BF16":
            return self._load_bf16(key)
        with safe_open(self.where[key], framework="numpy") as handle:
            return np.ascontiguousarray(handle.get_tensor(key))

    def _load_bf16(self, key: str) -> np.ndarray:
        # numpy has no bfloat16: read the raw bytes from the safetensors layout and widen.
        path = self.where[key]
        with path.open("rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(header_len))
            start, end = header[key]["data_offsets"]
            handle.seek(8 + header_len + start)
            raw = np.frombuffer(handle.read(end - start), dtype=np.uint16)
        return (raw.astype(np.uint32) << 16).view(np.float32).reshape(self.shapes[key])


def open_hf(model_dir: Path, tokenizer_object: dict | None) -> SourceModel:
    """Read an HF safetensors directory into canonical tensors (transforms applied lazily)."""
    raw_config = load_hf_config(model_dir)
    model_type = raw_config.get("model_type", "")
    arch = hf_arch(model_type)
    config = finish_config(arch, raw_config, norm_plus_one_folded=arch.zero_centred_norms)
    files = HFDirectory(model_dir)
    warnings: list[str] = []
    tokenizer = tokenizer_object
    if tokenizer is None and (model_dir / "tokenizer.json").is_file():
        tokenizer = tokenizer_object_from_hf(model_dir)
    elif tokenizer is None:
        # Test and research checkpoints often ship no tokenizer; such a file is driven by token ids.
        tokenizer = {"tokenizer_type": "none"}
        warnings.append(f"{model_dir} has no tokenizer.json: the model takes token ids only "
                        "(pass --tokenizer SRC to embed one)")

    tensors: list[SourceTensor] = []
    experts: dict[tuple[int, str], dict[int, str]] = {}
    for key in files.where:
        name = canonical_name(key)
        if name is None:
            continue
        match = PER_EXPERT.match(name)
        if match:
            layer, expert, proj = int(match.group(1)), int(match.group(2)), match.group(3)
            experts.setdefault((layer, proj), {})[expert] = key
            continue
        match = FUSED_EXPERTS.match(name)
        if match:
            tensors.extend(_split_fused_experts(files, key, int(match.group(1)), match.group(2)))
            continue
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            tensors.extend(_split_qkvz(files, key, name, config))
            continue
        if name.endswith("linear_attn.in_proj_ba.weight"):
            tensors.extend(_split_ba(files, key, name, config))
            continue
        tensors.append(_plain_tensor(files, key, name, arch, config))
    for (layer, proj), by_expert in sorted(experts.items()):
        tensors.append(_stacked_experts(files, layer, proj, by_expert))

    config["tie_word_embeddings"] = not any(t.name == "lm_head.weight" for t in tensors)
    config["qk_norm"] = any(t.name.endswith("self_attn.q_norm.weight") for t in tensors)
    source = {
        "format": "hf_safetensors",
        "sha256": directory_sha256(files.files),
        "filename": model_dir.name,
    }
    return SourceModel(arch=arch, config=config, tokenizer=tokenizer, source=source, tensors=tensors,
                       warnings=warnings)


def _dense_kind(files: HFDirectory, key: str) -> str:
    return {"F32": "f32", "F16": "f16", "BF16": "bf16"}.get(files.dtypes[key], "f32")


def _plain_tensor(files: HFDirectory, key: str, name: str, arch: Architecture, config: dict) -> SourceTensor:
    shape = files.shapes[key]
    transform = None
    folds_norm = arch.zero_centred_norms and is_zero_centred_norm(name)
    # HF checkpoints keep q/k rows in split-half RoPE order.
    interleave = arch.rope_style == "interleaved"
    if folds_norm:
        transform = lambda w: (w + np.float32(1.0)).astype(np.float32)  # noqa: E731
    elif interleave and name.endswith("self_attn.q_proj.weight"):
        heads = config["num_attention_heads"]
        transform = lambda w: permute_for_interleaved_rope(w, heads)  # noqa: E731
    elif interleave and name.endswith("self_attn.k_proj.weight"):
        heads = config["num_key_value_heads"]
        transform = lambda w: permute_for_interleaved_rope(w, heads)  # noqa: E731

    def load() -> np.ndarray:
        w = files.load(key).astype(np.float32, copy=False)
        return np.ascontiguousarray(transform(w) if transform else w)

    flags = FLAG_SSM_A_MATRIX if name.endswith("linear_attn.A_log") else 0
    return SourceTensor(
        name=name,
        array_shape=shape,
        header_shape=list(shape),
        source_type=files.dtypes[key],
        load_f32=load,
        # +1 folded into a bf16/f16 norm is no longer exact in the source dtype: store f32 then.
        native_dense=None if folds_norm else _dense_kind(files, key),
        flags=flags,
        keep_f32=is_control_tensor(name) or len(shape) == 1,
    )


def _stacked_experts(files: HFDirectory, layer: int, proj: str, by_expert: dict[int, str]) -> SourceTensor:
    keys = [by_expert[e] for e in sorted(by_expert)]
    if sorted(by_expert) != list(range(len(keys))):
        raise ConvertError(f"layer {layer} {proj}_proj experts are not numbered 0..{len(keys) - 1}")
    shape = (len(keys), *files.shapes[keys[0]])

    def load() -> np.ndarray:
        return np.stack([files.load(k).astype(np.float32, copy=False) for k in keys])

    return SourceTensor(
        name=f"layers.{layer}.ffn_{proj}_exps.weight",
        array_shape=shape,
        header_shape=list(shape),
        source_type=files.dtypes[keys[0]],
        load_f32=load,
        native_dense=_dense_kind(files, keys[0]),
        flags=FLAG_EXPERT_WEIGHT,
    )


def _split_fused_experts(files: HFDirectory, key: str, layer: int, which: str) -> list[SourceTensor]:
    shape = files.shapes[key]  # gate_up_proj [E, 2I, D] (gate first); down_proj [E, D, I]
    kind = _dense_kind(files, key)
    if which == "down_proj":
        return [
            SourceTensor(f"layers.{layer}.ffn_down_exps.weight", shape, list(shape), files.dtypes[key],
                         lambda: files.load(key).astype(np.float32, copy=False), None, kind, FLAG_EXPERT_WEIGHT)
        ]
    experts, two_i, hidden = shape
    half = two_i // 2
    part_shape = (experts, half, hidden)

    def part(index: int):
        return lambda: np.ascontiguousarray(
            files.load(key).astype(np.float32, copy=False)[:, index * half:(index + 1) * half, :]
        )

    return [
        SourceTensor(f"layers.{layer}.ffn_{proj}_exps.weight", part_shape, list(part_shape), files.dtypes[key],
                     part(index), None, kind, FLAG_EXPERT_WEIGHT)
        for index, proj in enumerate(("gate", "up"))
    ]


def _split_qkvz(files: HFDirectory, key: str, name: str, config: dict) -> list[SourceTensor]:
    """Qwen3-Next's per-key-head interleaved [q|k|v|z] rows -> in_proj_qkv and in_proj_z."""
    n_k, n_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
    d_k, d_v = config["linear_key_head_dim"], config["linear_value_head_dim"]
    r = n_v // n_k
    hidden = files.shapes[key][1]
    prefix = name[: -len("in_proj_qkvz.weight")]

    def grouped() -> np.ndarray:
        return files.load(key).astype(np.float32, copy=False).reshape(n_k, 2 * d_k + 2 * r * d_v, hidden)

    def qkv() -> np.ndarray:
        g = grouped()
        q = g[:, :d_k].reshape(n_k * d_k, hidden)
        k = g[:, d_k:2 * d_k].reshape(n_k * d_k, hidden)
        v = g[:, 2 * d_k:2 * d_k + r * d_v].reshape(n_v * d_v, hidden)
        return np.ascontiguousarray(np.concatenate([q, k, v]))

    def z() -> np.ndarray:
        return np.ascontiguousarray(grouped()[:, 2 * d_k + r * d_v:].reshape(n_v * d_v, hidden))

    kind = _dense_kind(files, key)
    qkv_shape = (2 * n_k * d_k + n_v * d_v, hidden)
    z_shape = (n_v * d_v, hidden)
    return [
        SourceTensor(prefix + "in_proj_qkv.weight", qkv_shape, list(qkv_shape), files.dtypes[key], qkv, None, kind),
        SourceTensor(prefix + "in_proj_z.weight", z_shape, list(z_shape), files.dtypes[key], z, None, kind),
    ]


def _split_ba(files: HFDirectory, key: str, name: str, config: dict) -> list[SourceTensor]:
    """Qwen3-Next's per-key-head interleaved [b|a] rows -> in_proj_b and in_proj_a."""
    n_k, n_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
    r = n_v // n_k
    hidden = files.shapes[key][1]
    prefix = name[: -len("in_proj_ba.weight")]

    def part(index: int):
        return lambda: np.ascontiguousarray(
            files.load(key).astype(np.float32, copy=False).reshape(n_k, 2 * r, hidden)[:, index * r:(index + 1) * r]
            .reshape(n_v, hidden)
        )

    kind = _dense_kind(files, key)
    return [
        SourceTensor(prefix + f"in_proj_{which}.weight", (n_v, hidden), [n_v, hidden], files.dtypes[key],
                     part(index), None, kind)
        for index, which in enumerate(("b", "a"))
    ]
