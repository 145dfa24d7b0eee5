"""Converter: lossless GGUF mappings (bit-exact against gguf-py), exact safetensors round trips, atomicity."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import FIXTURES, TINY_MODELS
from gguf_files import random_blocks, write_gguf
from safetensors.numpy import load_file

from basert.convert import ConvertError, convert
from basert.convert.gguf_reader import read_gguf
from basert.engine.runner import ModelRunner
from basert.format import BaseFile
from basert.format.quant import bf16_bits_to_f32, f32_to_bf16_bits

Q = gguf.GGMLQuantizationType


def test_smollm2_every_tensor_matches_gguf_dequantization_bit_for_bit(smollm2_gguf_reader, smollm2_base: Path):
    reader = smollm2_gguf_reader
    with BaseFile(smollm2_base, verify_checksums=True) as base:
        assert base.arch == "llama"
        assert base.source_format == "gguf"
        assert len(base.tensors) == len(reader.tensors) == 272
        names = {t.name: t for t in reader.tensors}
        assert base.tensors["embed_tokens.weight"].dtype == "base_q8"
        assert base.tensors["layers.0.mlp.down_proj.weight"].dtype == "base_q4"
        assert base.tensors["layers.0.input_norm.weight"].dtype == "f32"
        pairs = {
            "embed_tokens.weight": "token_embd.weight",
            "final_norm.weight": "output_norm.weight",
        }
        for layer in range(30):
            for ours, theirs in [
                ("input_norm", "attn_norm"), ("post_attn_norm", "ffn_norm"),
                ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
                ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
                ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down"),
            ]:
                pairs[f"layers.{layer}.{ours}.weight"] = f"blk.{layer}.{theirs}.weight"
        assert set(pairs) == set(base.tensors)
        for ours, theirs in pairs.items():
            tensor = names[theirs]
            expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            got = base.dequantize(ours)
            assert got.dtype == np.float32
            assert list(base.tensors[ours].shape) == [int(d) for d in tensor.shape]
            assert got.shape == tuple(reversed([int(d) for d in tensor.shape])), ours
            assert np.array_equal(got.view(np.uint32), expected.reshape(got.shape).view(np.uint32)), ours
        config = base.config
        assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
                config["num_key_value_heads"], config["head_dim"], config["intermediate_size"],
                config["vocab_size"]) == (576, 30, 9, 3, 64, 1536, 49152)
        assert config["rope_theta"] == 100000.0
        assert config["rope_style"] == "interleaved"
        assert config["tie_word_embeddings"] is True
        assert base.tokenizer["tokenizer_type"] == "gguf"
        assert base.tokenizer["tokenizer.ggml.pre"] == "smollm"


def expected_tiny_tensors(name: str) -> dict[str, np.ndarray]:
    """The canonical tensors the converter must produce from a tiny model, computed independently."""
    model_dir = FIXTURES / "refdata" / "models" / name
    raw = load_file(model_dir / "model.safetensors")
    config = json.loads((model_dir / "config.json").read_text())
    hybrid = config["model_type"] not in ("qwen2", "qwen3")
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for key, value in raw.items():
        key = key.removeprefix("model.")
        key = {"norm.weight": "final_norm.weight"}.get(key, key)
        key = key.replace("input_layernorm", "input_norm").replace("post_attention_layernorm", "post_attn_norm")
        m = re.match(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)_proj\.weight", key)
        if m:
            experts.setdefault(f"layers.{m.group(1)}.ffn_{m.group(3)}_exps.weight", {})[int(m.group(2))] = value
            continue
        plus_one = key == "final_norm.weight" or key.endswith(
            ("input_norm.weight", "post_attn_norm.weight", "q_norm.weight", "k_norm.weight"))
        if hybrid and plus_one:
            value = value + np.float32(1.0)
        if key.endswith("in_proj_qkvz.weight"):
            n_k, n_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
            d_k, d_v = config["linear_key_head_dim"], config["linear_value_head_dim"]
            r = n_v // n_k
            g = value.reshape(n_k, 2 * d_k + 2 * r * d_v, -1)
            prefix = key.removesuffix("in_proj_qkvz.weight")
            out[prefix + "in_proj_qkv.weight"] = np.concatenate([
                g[:, :d_k].reshape(n_k * d_k, -1), g[:, d_k:2 * d_k].reshape(n_k * d_k, -1),
                g[:, 2 * d_k:2 * d_k + r * d_v].reshape(n_v * d_v, -1)])
            out[prefix + "in_proj_z.weight"] = g[:, 2 * d_k + r * d_v:].reshape(n_v * d_v, -1)
            continue
        if key.endswith("in_proj_ba.weight"):
            n_k, n_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
            r = n_v // n_k
            g = value.reshape(n_k, 2 * r, -1)
            prefix = key.removesuffix("in_proj_ba.weight")
            out[prefix + "in_proj_b.weight"] = g[:, :r].reshape(n_v, -1)
            out[prefix + "in_proj_a.weight"] = g[:, r:].reshape(n_v, -1)
            continue
        out[key] = value
    for key, by_expert in experts.items():
        out[key] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_models_round_trip_exactly_at_f32(name: str, tiny_f32_bases: dict[str, Path]):
    expected = expected_tiny_tensors(name)
    with BaseFile(tiny_f32_bases[name], verify_checksums=True) as base:
        assert set(base.tensors) == set(expected)
        for key, value in expected.items():
            info = base.tensors[key]
            assert info.dtype == "f32", key
            assert base.array(key).shape == value.shape, key
            assert np.array_equal(base.array(key), value), key
        assert base.source_format == "hf_safetensors"
        dense = name in ("qwen2-tiny", "qwen3-tiny")
        expected_arch = {"qwen2-tiny": "qwen", "qwen3-tiny": "qwen", "qwen3_5-tiny": "qwen35"}.get(name, "qwen35moe")
        assert base.arch == expected_arch
        assert base.config["norm_plus_one_folded"] is not dense
        assert base.config["rope_style"] == "split_half"
        assert base.config["rotary_dim"] == {"qwen2-tiny": 16, "qwen3-tiny": 32}.get(name, 8)
        assert base.config["tie_word_embeddings"] is dense
        assert base.config["qk_norm"] is (name != "qwen2-tiny")
        # Qwen2's q, k and v projections carry biases.
        assert ("layers.0.self_attn.k_proj.bias" in base.tensors) is (name == "qwen2-tiny")
        if not dense:
            assert base.config["layer_types"][3] == "full_attention"
            assert base.tensors["layers.0.linear_attn.A_log"].flags & (1 << 3)


def test_qwen3_next_split_reassembles_to_the_fused_source(tiny_f32_bases: dict[str, Path]):
    raw = load_file(FIXTURES / "refdata" / "models" / "qwen3_next-tiny" / "model.safetensors")
    fused = raw["model.layers.0.linear_attn.in_proj_qkvz.weight"]
    with BaseFile(tiny_f32_bases["qwen3_next-tiny"]) as base:
        qkv = base.array("layers.0.linear_attn.in_proj_qkv.weight")
        z = base.array("layers.0.linear_attn.in_proj_z.weight")
    n_k, d_k, r, d_v = 2, 16, 2, 24
    q, k, v = qkv[: n_k * d_k], qkv[n_k * d_k: 2 * n_k * d_k], qkv[2 * n_k * d_k:]
    rebuilt = np.concatenate([
        np.concatenate([q.reshape(n_k, d_k, -1), k.reshape(n_k, d_k, -1),
                        v.reshape(n_k, r * d_v, -1), z.reshape(n_k, r * d_v, -1)], axis=1)
    ]).reshape(fused.shape)
    assert np.array_equal(rebuilt, fused)


def test_gguf_qwen2_attention_biases_are_converted(tmp_path: Path):
    """Qwen2 GGUFs carry the q, k and v projections' biases as blk.N.attn_{q,k,v}.bias: they become the .base
    tensors the attention adds (dropping them, as once happened, leaves a model that writes nonsense)."""
    hf = load_file(FIXTURES / "refdata" / "models" / "qwen2-tiny" / "model.safetensors")
    layer = "model.layers.0."
    names = {
        "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "blk.0.attn_norm.weight": layer + "input_layernorm.weight",
        "blk.0.ffn_norm.weight": layer + "post_attention_layernorm.weight",
        "blk.0.attn_output.weight": layer + "self_attn.o_proj.weight",
        **{f"blk.0.attn_{p}.{kind}": f"{layer}self_attn.{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias")},
        **{f"blk.0.ffn_{p}.weight": f"{layer}mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
    }
    src = tmp_path / "qwen2.gguf"
    write_gguf(src, "qwen2", {name: (hf[key], Q.F32) for name, key in names.items()}, head_dim=16)
    out = tmp_path / "qwen2.base"
    report = convert(src, out)
    assert not any("skipping" in w for w in report.warnings), report.warnings
    with BaseFile(out, verify_checksums=True) as base:
        for p in "qkv":
            bias = base.array(f"layers.0.self_attn.{p}_proj.bias")
            assert np.array_equal(bias, hf[f"{layer}self_attn.{p}_proj.bias"]) and np.any(bias != 0), p
    runner = ModelRunner(out, max_context=64)
    try:
        assert runner.model.layers[0].mixer.qkv_biases is not None
    finally:
        runner.close()


def test_gguf_lossless_types_dequantize_bit_exact(tmp_path: Path):
    rng = np.random.default_rng(3)
    tensors = {
        "token_embd.weight": (rng.standard_normal((512, 64), dtype=np.float32), Q.Q8_0),
        "output_norm.weight": (rng.standard_normal(64, dtype=np.float32), Q.F32),
        "blk.0.attn_q.weight": (rng.standard_normal((128, 64), dtype=np.float32), Q.Q4_0),
        "blk.0.attn_k.weight": (rng.standard_normal((64, 64), dtype=np.float32), Q.Q4_1),
        "blk.0.attn_v.weight": (rng.standard_normal((64, 64), dtype=np.float32), Q.F16),
        "blk.0.attn_output.weight": (rng.standard_normal((64, 128), dtype=np.float32), Q.BF16),
        "blk.0.ffn_down.weight": (rng.standard_normal((64, 256), dtype=np.float32), Q.Q5_1),
    }
    src = tmp_path / "mixed.gguf"
    write_gguf(src, "qwen3", tensors)
    out = tmp_path / "mixed.base"
    report = convert(src, out)
    assert not any("re-quantized" in w for w in report.warnings)
    reader = gguf.GGUFReader(src)
    expected_dtype = {
        "token_embd.weight": "base_q8", "output_norm.weight": "f32", "blk.0.attn_q.weight": "base_q4",
        "blk.0.attn_k.weight": "base_q4", "blk.0.attn_v.weight": "f16", "blk.0.attn_output.weight": "bf16",
        "blk.0.ffn_down.weight": "base_q5",
    }
    with BaseFile(out, verify_checksums=True) as base:
        assert base.arch == "qwen"
        assert base.config["rope_style"] == "split_half"
        from basert.convert.gguf_source import canonical_name

        for tensor in reader.tensors:
            ours = canonical_name(tensor.name)
            got = base.dequantize(ours)
            reference = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(got.shape)
            if tensor.name in expected_dtype:
                assert base.tensors[ours].dtype == expected_dtype[tensor.name]
                if tensor.tensor_type == Q.Q4_0:
                    # d may be negative: gguf-py's d*(q-8) gives -0.0 at q == 8, q*d + (-8d) gives +0.0.
                    assert np.array_equal(got, reference), tensor.name
                    differ = got.view(np.uint32) != reference.view(np.uint32)
                    assert np.all(got[differ] == 0.0)
                else:
                    assert np.array_equal(got.view(np.uint32), reference.view(np.uint32)), tensor.name


def test_gguf_blocks_are_kept_byte_for_byte(tmp_path: Path):
    """K-quant and Q5_0/Q5_1 rows go into the .base unchanged, and de-quantize to gguf-py's values bit for bit."""
    rng = np.random.default_rng(7)
    types = {
        "blk.0.attn_q.weight": (Q.Q2_K, 128, 256), "blk.0.attn_k.weight": (Q.Q3_K, 64, 256),
        "blk.0.attn_v.weight": (Q.Q4_K, 64, 256), "blk.0.attn_output.weight": (Q.Q5_K, 64, 512),
        "blk.0.ffn_gate.weight": (Q.Q6_K, 128, 256), "blk.0.ffn_up.weight": (Q.Q5_0, 128, 64),
        "blk.0.ffn_down.weight": (Q.Q5_1, 64, 128),
    }
    tensors = {name: (random_blocks(rng, qtype, rows, k), qtype) for name, (qtype, rows, k) in types.items()}
    tensors["token_embd.weight"] = (rng.standard_normal((512, 64), dtype=np.float32), Q.Q8_0)
    tensors["output_norm.weight"] = (rng.standard_normal(64, dtype=np.float32), Q.F32)
    src = tmp_path / "kquants.gguf"
    write_gguf(src, "llama", tensors)
    out = tmp_path / "kquants.base"
    report = convert(src, out)
    assert report.warnings == []
    assert {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"} <= set(report.dtype_counts)
    reader = gguf.GGUFReader(src)
    from basert.convert.gguf_source import canonical_name

    with BaseFile(out, verify_checksums=True) as base:
        for tensor in reader.tensors:
            if tensor.name not in types:
                continue
            qtype, rows, k = types[tensor.name]
            info = base.tensors[canonical_name(tensor.name)]
            assert (info.storage, info.array_shape, info.group_size) == (qtype.name, (rows, k),
                                                                        gguf.GGML_QUANT_SIZES[qtype][0])
            entry = next(e for e in base.header["tensors"] if e["name"] == info.name)
            assert (entry["layout"], entry["source_ggml_type"]) == ("gguf_super", int(qtype))
            assert np.array_equal(base.payload(info.name), np.asarray(tensor.data).reshape(-1))
            got = base.dequantize(info.name)
            reference = gguf.quants.dequantize(tensor.data, qtype).astype(np.float32).reshape(rows, k)
            assert np.array_equal(got.view(np.uint32), reference.view(np.uint32)), tensor.name
    # An explicit base-q8 target re-quantizes them instead.
    q8 = tmp_path / "q8.base"
    convert(src, q8, target="base-q8")
    with BaseFile(q8) as base:
        assert {base.tensors[canonical_name(name)].storage for name in types} == {"base_q8"}


def test_quantized_targets_and_profile(tmp_path: Path):
    src = FIXTURES / "refdata" / "models" / "qwen3-tiny"
    raw = load_file(src / "model.safetensors")
    q4 = tmp_path / "q4.base"
    convert(src, q4, target="base-q4")
    with BaseFile(q4, verify_checksums=True) as base:
        info = base.tensors["layers.0.mlp.down_proj.weight"]
        assert (info.dtype, info.group_size, info.scale_dtype) == ("base_q4", 64, "f16")
        assert base.tensors["layers.0.input_norm.weight"].dtype == "f32"
        w = raw["model.layers.0.mlp.down_proj.weight"]
        err = np.abs(base.dequantize("layers.0.mlp.down_proj.weight") - w)
        group_range = np.ptp(w.reshape(-1, 64), axis=1)
        assert np.all(err.reshape(-1, 64) <= (group_range / 15)[:, None] * 0.5 + 1e-3)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({
        "target": "base-q8", "group_size": 32,
        "overrides": [{"match": "*.mlp.down_proj.weight", "target": "base-q4", "symmetric": True}],
    }))
    mixed = tmp_path / "mixed.base"
    convert(src, mixed, target="base-q4", profile=profile)
    with BaseFile(mixed) as base:
        up = base.tensors["layers.1.mlp.up_proj.weight"]
        down = base.tensors["layers.1.mlp.down_proj.weight"]
        assert (up.dtype, up.group_size, up.scale_dtype, up.symmetric) == ("base_q8", 32, "bf16", False)
        assert (down.dtype, down.symmetric) == ("base_q4", True)
        assert base.header["quant_profile"]["group_size"] == 32
    bf16 = tmp_path / "bf16.base"
    convert(src, bf16, target="bf16")
    with BaseFile(bf16) as base:
        key = "layers.2.self_attn.q_proj.weight"
        assert base.tensors[key].dtype == "bf16"
        expected = bf16_bits_to_f32(f32_to_bf16_bits(raw["model." + key]))
        assert np.array_equal(base.dequantize(key), expected)


def test_interrupted_convert_leaves_nothing(tmp_path: Path):
    out = tmp_path / "out" / "model.base"

    def interrupt(done: int, total: int, name: str) -> None:
        if done == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(FIXTURES / "refdata" / "models" / "qwen3_5-tiny", out, target="f32", progress=interrupt)
    assert not out.exists()
    assert list(out.parent.iterdir()) == []


def metadata_gguf(path: Path) -> None:
    """A GGUF whose metadata holds an array of every scalar type, arrays of strings (empty ones and multi-byte
    UTF-8 among them), an array of arrays, and single values, with one small tensor."""
    writer = gguf.GGUFWriter(path, "llama")
    V = gguf.GGUFValueType
    numbers = {V.UINT8: [0, 7, 255], V.INT8: [-128, 0, 127], V.UINT16: [1, 65535], V.INT16: [-32768, 5],
               V.UINT32: [3, 4294967295], V.INT32: [-2, 2, 0], V.FLOAT32: [0.5, -1e30, 3.25], V.UINT64: [2**64 - 1],
               V.INT64: [-(2**63), 9], V.FLOAT64: [1e300, -0.25], V.BOOL: [True, False, True]}
    for value_type, values in numbers.items():
        writer.add_key_value(f"test.{value_type.name.lower()}s", values, V.ARRAY, sub_type=value_type)
    writer.add_array("test.strings", ["", "Ġhello", "▁wörld", "日本語", "<0x0A>", "a b", ""])
    writer.add_key_value("test.nested", [["x", "yz"], ["", "w"]], V.ARRAY)
    writer.add_string("test.name", "tëst")
    writer.add_uint32("test.count", 42)
    writer.add_tensor("output_norm.weight", np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def empty_arrays_gguf(path: Path) -> None:
    """A GGUF (version 3, no tensors) whose metadata is an empty array of strings and an empty array of int32, which
    gguf-py's writer refuses to write but files may hold."""
    import struct

    def empty_array(name: str, item_type: int) -> bytes:
        """A key/value record: the key, the value type ARRAY, then the item type and a count of 0."""
        header = struct.pack("<IIQ", gguf.GGUFValueType.ARRAY, item_type, 0)
        return struct.pack("<Q", len(name)) + name.encode() + header

    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2)  # version, tensor count, key/value count
                     + empty_array("test.no_strings", gguf.GGUFValueType.STRING)
                     + empty_array("test.no_numbers", gguf.GGUFValueType.INT32))


def assert_same_fields(ours, theirs) -> None:
    """Two readers of one GGUF give the same fields: parts (dtypes, shapes, bytes), data indexes, types, contents."""
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.name, mine.data, mine.types) == (field.offset, field.name, field.data, field.types)
        assert [(p.dtype, p.shape, p.tobytes()) for p in mine.parts] == [(p.dtype, p.shape, p.tobytes())
                                                                         for p in field.parts], name
        assert mine.contents() == field.contents(), name
    assert ours.data_offset == theirs.data_offset


def test_the_converters_gguf_reader_gives_gguf_pys_fields(tmp_path: Path):
    """read_gguf reads arrays in one pass: its fields (parts, their dtypes and bytes, data indexes, types),
    tensors and data offset are gguf-py's GGUFReader's, for every kind of value; an array cut short by the end
    of the file is a ValueError, which the converter reports as an unreadable GGUF."""
    path, empty = tmp_path / "metadata.gguf", tmp_path / "empty.gguf"
    metadata_gguf(path)
    empty_arrays_gguf(empty)
    assert_same_fields(read_gguf(empty), gguf.GGUFReader(empty))
    assert read_gguf(empty).fields["test.no_strings"].contents() == []
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    assert_same_fields(ours, theirs)
    assert ours.fields["test.strings"].contents()[1:4] == ["Ġhello", "▁wörld", "日本語"]
    assert [(t.name, t.data.tobytes()) for t in ours.tensors] == [(t.name, t.data.tobytes()) for t in theirs.tensors]
    # Cut inside the strings' array: inside a string's bytes, inside a length, and where the second string starts
    # (GGUFReader raised IndexError there, which the converter did not report as an unreadable file).
    strings = ours.fields["test.strings"]
    parts_end = [strings.offset + sum(p.nbytes for p in strings.parts[:i]) for i in range(len(strings.parts) + 1)]
    for cut in (strings.offset + 60, parts_end[-1] - 3, parts_end[strings.data[0] + 1]):
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(path.read_bytes()[:cut])
        with pytest.raises(ValueError, match="past the end of the file"):
            read_gguf(short)
        with pytest.raises(ConvertError, match="not a readable GGUF"):
            convert(short, tmp_path / "x.base")


def test_bad_sources_raise_clear_errors(tmp_path: Path):
    with pytest.raises(ConvertError, match="does not exist"):
        convert(tmp_path / "missing.gguf", tmp_path / "x.base")
    not_gguf = tmp_path / "fake.gguf"
    not_gguf.write_bytes(b"not a gguf at all")
    with pytest.raises(ConvertError, match="not a readable GGUF"):
        convert(not_gguf, tmp_path / "x.base")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ConvertError, match="config.json"):
        convert(empty_dir, tmp_path / "x.base")
    with pytest.raises(ConvertError, match="unknown target"):
        convert(FIXTURES / "refdata" / "models" / "qwen3-tiny", tmp_path / "x.base", target="q3")
    assert not (tmp_path / "x.base").exists()
