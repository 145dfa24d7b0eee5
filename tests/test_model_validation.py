"""Models are validated before they serve: header values that contradict the tensors, and flipped payload
bits, are refused at load with one ModelValidationError whose one-line message names the problem."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from basert.engine.runner import ForwardRequest, ModelRunner
from basert.format import ModelValidationError

Edit = Callable[[dict[str, Any]], None]


def edited_copy(source: Path, directory: Path, edit: Edit) -> Path:
    """A copy of `source` whose JSON header `edit` rewrote; the header length field is updated and the
    header may grow up to the old blob_offset, so the payloads keep their places."""
    path = directory / source.name
    shutil.copyfile(source, path)
    with open(path, "r+b") as f:
        prefix = f.read(16)
        (header_len,) = struct.unpack_from("<Q", prefix, 8)
        header = json.loads(f.read(header_len))
        edit(header)
        encoded = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
        blob_offset = -(-(16 + header_len) // 65536) * 65536
        assert 16 + len(encoded) <= blob_offset
        f.seek(8)
        f.write(struct.pack("<Q", len(encoded)) + encoded + bytes(blob_offset - 16 - len(encoded)))
    return path


def config(key: str, value: Any) -> Edit:
    return lambda header: header["config"].update({key: value})


def tensor(name: str, **fields: Any) -> Edit:
    def edit(header: dict[str, Any]) -> None:
        entry = next(entry for entry in header["tensors"] if entry["name"] == name)
        entry.update({key: change(entry[key]) if callable(change) else change for key, change in fields.items()})

    return edit


def refusal(path: Path, **kwargs: Any) -> str:
    """The message of the ModelValidationError that loading `path` raises; it must be one line."""
    with pytest.raises(ModelValidationError) as raised:
        ModelRunner(path, max_context=64, **kwargs)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"{path}")
    return message


Q_PROJ = "layers.0.self_attn.q_proj.weight"
K_PROJ = "layers.0.self_attn.k_proj.weight"

# SmolLM2 is converted from GGUF, so header shapes are in GGUF order [in, out].
SMOLLM2_EDITS = {
    "num_attention_heads": (config("num_attention_heads", 12),
                            f"tensor '{Q_PROJ}' has shape [576, 576], expected [576, 768] from the config"),
    "num_attention_heads_not_grouped": (config("num_attention_heads", 10),
                                        "num_attention_heads 10 is not a multiple of num_key_value_heads 3"),
    "hidden_size": (config("hidden_size", 512), f"tensor '{Q_PROJ}' has shape [576, 576], expected [512, 576]"),
    "head_dim": (config("head_dim", 128), f"tensor '{Q_PROJ}' has shape [576, 576], expected [576, 1152]"),
    "head_dim_below_rotary_dim": (config("head_dim", 32),
                                  "config rotary_dim 64 must be even and at most head_dim 32"),
    "num_key_value_heads": (config("num_key_value_heads", 1),
                            f"tensor '{K_PROJ}' has shape [576, 192], expected [576, 64]"),
    "vocab_size": (config("vocab_size", 50000),
                   "tensor 'embed_tokens.weight' has shape [576, 49152], expected [576, 50000]"),
    "intermediate_size": (config("intermediate_size", 9536),
                          "tensor 'layers.0.mlp.gate_proj.weight' has shape [576, 1536], expected [576, 9536]"),
    "num_hidden_layers_fewer": (config("num_hidden_layers", 29),
                                "num_hidden_layers is 29, but the file has tensors for 30 layers numbered 0..29"),
    "num_hidden_layers_more": (config("num_hidden_layers", 31),
                               "num_hidden_layers is 31, but the file has tensors for 30 layers numbered 0..29"),
    "num_hidden_layers_zero": (config("num_hidden_layers", 0), "config num_hidden_layers is 0, expected a positive"),
    "arch": (lambda header: header.update(arch="llama9"),
             "architecture 'llama9' is not supported (supported: gemma3, llama"),
    "embedding_dtype_q4": (tensor("embed_tokens.weight", dtype="base_q4"),
                           "tensor 'embed_tokens.weight' scale region starts at 28311552, expected 14155776"),
    "embedding_dtype_f16": (tensor("embed_tokens.weight", dtype="f16"),
                            "tensor 'embed_tokens.weight' length 30081024 does not match the 56623104 bytes of f16"),
    "rope_theta_zero": (config("rope_theta", 0), "config rope_theta is 0, expected a finite positive number"),
    "rope_theta_negative": (config("rope_theta", -1e5), "config rope_theta is -100000.0, expected a finite positive"),
    "rope_theta_text": (config("rope_theta", "1e5"), "config rope_theta is '1e5', expected a finite positive number"),
    "rope_theta_null": (config("rope_theta", None), "config lacks rope_theta"),
    "group_size": (tensor(Q_PROJ, group_size=64),
                   f"tensor '{Q_PROJ}' scale region holds 20736 bytes, expected 10368 for base_q4 [576, 576]"),
    "group_size_not_allowed": (tensor(Q_PROJ, group_size=48), f"tensor '{Q_PROJ}' group_size 48 is not one of"),
    "length": (tensor(Q_PROJ, length=lambda n: n + 64),
               f"tensor '{Q_PROJ}' length 207424 does not match the 207360 bytes of its regions"),
    "offset_misaligned": (tensor(Q_PROJ, offset=lambda n: n + 32),
                          f"tensor '{Q_PROJ}' offset 32021024 is not a multiple of 64"),
    "offset_overlapping": (tensor(Q_PROJ, offset=lambda n: n + 64),
                           "tensor 'layers.0.self_attn.v_proj.weight' at bytes ", f"overlaps tensor '{Q_PROJ}'"),
    "offset_past_end": (tensor(Q_PROJ, offset=10**10), f"tensor '{Q_PROJ}' at bytes ", "lies past end of file"),
    "shape": (tensor(K_PROJ, shape=[192, 576]), f"tensor '{K_PROJ}' has shape [192, 576], expected [576, 192]"),
    "shape_count": (tensor(K_PROJ, shape=[576, 128]), f"tensor '{K_PROJ}' scale region starts at 55296, expected"),
}


@pytest.mark.parametrize("case", SMOLLM2_EDITS)
def test_contradictory_header_is_refused_at_load(smollm2_base: Path, tmp_path: Path, case: str) -> None:
    edit, *expected = SMOLLM2_EDITS[case]
    message = refusal(edited_copy(smollm2_base, tmp_path, edit))
    assert all(fragment in message for fragment in expected), message


def flipped_copy(source: Path, directory: Path, name: str, byte: int) -> Path:
    """A copy of `source` with one bit flipped at `byte` of tensor `name`'s payload."""
    path = directory / source.name
    shutil.copyfile(source, path)
    with open(path, "r+b") as f:
        (header_len,) = struct.unpack_from("<Q", f.read(16), 8)
        entry = next(entry for entry in json.loads(f.read(header_len))["tensors"] if entry["name"] == name)
        position = -(-(16 + header_len) // 65536) * 65536 + entry["offset"] + byte
        f.seek(position)
        value = f.read(1)[0]
        f.seek(position)
        f.write(bytes([value ^ 0x10]))
    return path


def test_flipped_payload_bit_is_refused_by_its_checksum(smollm2_base: Path, tmp_path: Path) -> None:
    path = flipped_copy(smollm2_base, tmp_path, Q_PROJ, 1000)
    assert f"tensor '{Q_PROJ}' hashes to" in refusal(path)
    runner = ModelRunner(path, max_context=64, verify_checksums=False)
    try:
        [logits] = runner.forward([ForwardRequest(runner.new_sequence(), [1, 2, 3])])
        assert logits.shape == (1, 49152)
    finally:
        runner.close()


def test_unedited_models_load_with_validation(smollm2_base: Path, tiny_f32_bases: dict[str, Path]) -> None:
    for path in (smollm2_base, *tiny_f32_bases.values()):
        ModelRunner(path, max_context=64).close()


def swap_first_layer_kinds(header: dict[str, Any]) -> None:
    kinds = header["config"]["layer_types"]
    kinds[0], kinds[3] = kinds[3], kinds[0]


HYBRID_EDITS = {
    "layer_types": (swap_first_layer_kinds, "tensor 'layers.0.self_attn.q_proj.weight' is missing"),
    "layer_types_length": (lambda header: header["config"]["layer_types"].pop(),
                           "config layer_types has 7 entries, num_hidden_layers is 8"),
    "linear_num_value_heads": (config("linear_num_value_heads", 8),
                               "tensor 'layers.0.linear_attn.in_proj_qkv.weight' has shape [160, 64], "
                               "expected [256, 64]"),
    "linear_conv_kernel_dim": (config("linear_conv_kernel_dim", 3),
                               "tensor 'layers.0.linear_attn.conv1d.weight' has shape [160, 1, 4], expected [160, 3]"),
}


@pytest.mark.parametrize("case", HYBRID_EDITS)
def test_hybrid_header_edit_is_refused(tiny_f32_bases: dict[str, Path], tmp_path: Path, case: str) -> None:
    edit, expected = HYBRID_EDITS[case]
    message = refusal(edited_copy(tiny_f32_bases["qwen3_5-tiny"], tmp_path, edit))
    assert expected in message, message


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case", ["intermediate_size", "offset_misaligned"])
def test_serve_refuses_an_edited_model_in_one_line(smollm2_base: Path, tmp_path: Path, case: str) -> None:
    edit, expected = SMOLLM2_EDITS[case]
    path = edited_copy(smollm2_base, tmp_path, edit)
    env = {**os.environ, "BASERT_MODELS_DIR": str(tmp_path / "models")}
    result = subprocess.run([sys.executable, "-m", "basert", "serve", str(path), "--port", str(free_port())],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert expected in result.stderr


def test_inspect_reports_the_problem_in_one_line(smollm2_base: Path, tmp_path: Path) -> None:
    edit, expected = SMOLLM2_EDITS["intermediate_size"]
    path = edited_copy(smollm2_base, tmp_path, edit)
    result = subprocess.run([sys.executable, "-m", "basert", "inspect", str(path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1
    assert "arch:     llama" in result.stdout
    [line] = result.stderr.splitlines()
    assert line.startswith(f"error: {path} (llama): ") and expected in line
