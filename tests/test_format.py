"""The .base format: reference quantization, the writer's layout, and the reader's validation of real files."""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

import basert
from basert.format import (
    BadMagicError,
    BaseFile,
    BaseWriter,
    ChecksumMismatchError,
    HeaderOverflowError,
    InvalidHeaderError,
    ModelValidationError,
    QuantizedTensor,
    TensorOutOfBoundsError,
    TruncatedFileError,
    UnknownDtypeError,
    UnsupportedDtypeError,
    UnsupportedVersionError,
    bf16_bits_to_f32,
    dequantize,
    f32_to_bf16_bits,
    from_parts,
    open_base,
    pack_q4,
    quantize,
    round_half_away,
    scale_bits,
    scale_values,
    unpack_q4,
)
from basert.format.ggml_blocks import BLOCK_TYPES

HF_SOURCE = {"format": "hf_safetensors", "sha256": "00" * 32, "filename": "model.safetensors"}
GGUF_SOURCE = {"format": "gguf", "sha256": "11" * 32, "filename": "model.gguf"}


def _codes(q: QuantizedTensor) -> np.ndarray:
    return (unpack_q4(q.packed) if q.bits == 4 else np.asarray(q.packed)).reshape(-1, q.group_size)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


# --- reference quantization ---------------------------------------------------------------


def test_spec_worked_example() -> None:
    q = quantize(np.array([0, 1, 2, 3], dtype=np.float32), "base_q4", 4)
    assert q.scales.tolist() == [0x3266]  # 0.2 rounded to f16
    assert scale_values(q.scales, "f16").tolist() == [0.199951171875]
    assert q.biases.tolist() == [0]
    assert unpack_q4(q.packed).tolist() == [0, 5, 10, 15]
    assert q.packed.tobytes() == bytes([0x50, 0xFA])
    assert dequantize(q).tolist() == [0.0, 0.999755859375, 1.99951171875, 2.999267578125]


def test_round_half_away_on_exact_halves() -> None:
    v = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, -0.49999997, 2.4999998, 3.0], dtype=np.float32)
    assert round_half_away(v).tolist() == [1, 2, 3, -1, -2, -3, 0, 0, 2, 3]


def test_quantize_rounds_halves_away_from_zero() -> None:
    asym = quantize(np.array([0, 15, 0.5, 2.5], dtype=np.float32), "base_q4", 4)
    assert scale_values(asym.scales, "f16").tolist() == [1.0]
    assert unpack_q4(asym.packed).tolist() == [0, 15, 1, 3]
    sym = quantize(np.array([7, -2.5, 0.5, -0.5], dtype=np.float32), "base_q4", 4, symmetric=True)
    assert scale_values(sym.scales, "f16").tolist() == [1.0]
    assert sym.biases is None
    assert unpack_q4(sym.packed).tolist() == [15, 5, 9, 7]


def test_constant_group_gets_scale_one() -> None:
    asym = quantize(np.full(4, 3.0, dtype=np.float32), "base_q8", 4, scale_dtype="bf16")
    assert asym.scales.tolist() == [0x3F80]
    assert asym.biases.tolist() == [0x4040]
    assert asym.packed.tolist() == [0, 0, 0, 0]
    assert dequantize(asym).tolist() == [3.0] * 4
    sym = quantize(np.zeros(4, dtype=np.float32), "base_q4", 4, symmetric=True)
    assert sym.scales.tolist() == [0x3C00]
    assert unpack_q4(sym.packed).tolist() == [8, 8, 8, 8]
    assert dequantize(sym).tolist() == [0.0] * 4


def test_bf16_rounding_is_nearest_even_and_keeps_nan() -> None:
    x = np.array([1.0, 1.00390625, 1.01171875, -2.0, np.inf, 3.4028235e38, np.nan], dtype=np.float32)
    bits = f32_to_bf16_bits(x)
    assert bits[:6].tolist() == [0x3F80, 0x3F80, 0x3F82, 0xC000, 0x7F80, 0x7F80]
    back = bf16_bits_to_f32(bits)
    assert back[:4].tolist() == [1.0, 1.0, 1.015625, -2.0]
    assert np.isnan(back[6])
    assert scale_bits(np.float32(0.2), "f16").tolist() == 0x3266
    assert scale_bits(np.array([0.2], dtype=np.float32), "bf16").tolist() == [0x3E4D]


@pytest.mark.parametrize("scale_dtype", ["f16", "bf16"])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dtype", ["base_q4", "base_q8"])
def test_round_trip_error_is_half_a_step(dtype: str, symmetric: bool, group_size: int, scale_dtype: str) -> None:
    rng = np.random.default_rng([group_size, int(symmetric), len(scale_dtype), len(dtype)])
    x = (rng.standard_normal((16, 512)) * rng.uniform(0.01, 4.0, size=(16, 1))).astype(np.float32)
    q = quantize(x, dtype, group_size, symmetric=symmetric, scale_dtype=scale_dtype)
    levels = (1 << q.bits) - 1
    assert q.shape == (16, 512)
    assert q.packed.size == x.size * q.bits // 8
    assert q.scales.size == x.size // group_size

    groups = x.reshape(-1, group_size).astype(np.float64)
    error = np.abs(dequantize(q).reshape(groups.shape) - groups)
    scale = scale_values(q.scales, scale_dtype).astype(np.float64)[:, None]
    codes = _codes(q)
    slack = 1e-5
    if symmetric:
        exact_scale = np.abs(groups).max(axis=1, keepdims=True) / (levels // 2)
        storage_error = (levels // 2) * np.abs(scale - exact_scale)
        interior = (codes > 0) & (codes < levels)
    else:
        low = groups.min(axis=1, keepdims=True)
        exact_scale = (groups.max(axis=1, keepdims=True) - low) / levels
        bias = scale_values(q.biases, scale_dtype).astype(np.float64)[:, None]
        storage_error = np.abs(bias - low) + levels * np.abs(scale - exact_scale)
        interior = (codes > 0) & (codes < levels)
    # Away from the clamped ends the error is at most half a step of the stored scale ...
    assert (error[interior] <= np.broadcast_to(scale / 2, error.shape)[interior] + slack).all()
    # ... and at the ends it grows only by how far rounding the scale/bias to storage moved the range.
    assert (error <= scale / 2 + storage_error + slack).all()

    again = quantize(dequantize(q), dtype, group_size, symmetric=symmetric, scale_dtype=scale_dtype)
    if symmetric:
        stable = np.ones(len(codes), dtype=bool)
    else:
        # A scale rounded up can leave the top code unused; re-quantizing then picks a smaller scale.
        stable = (codes.min(axis=1) == 0) & (codes.max(axis=1) == levels)
        assert stable.mean() >= 0.5
    assert np.array_equal(_codes(again)[stable], codes[stable])
    assert np.array_equal(again.scales[stable], q.scales[stable])


@pytest.mark.parametrize(
    ("dtype", "symmetric", "scale_dtype", "step", "base", "code_range"),
    [
        ("base_q4", False, "f16", 1.0, -8.0, (0, 15)),
        ("base_q4", True, "bf16", 0.5, 0.0, (-7, 7)),
        ("base_q8", False, "bf16", 0.25, 1.5, (0, 255)),
        ("base_q8", True, "f16", 1.0, 0.0, (-127, 127)),
    ],
)
def test_grid_values_round_trip_exactly(
    dtype: str, symmetric: bool, scale_dtype: str, step: float, base: float, code_range: tuple[int, int]
) -> None:
    rng = np.random.default_rng(7)
    group_size = 32
    steps = rng.integers(code_range[0], code_range[1] + 1, size=(8, group_size))
    steps[:, 0], steps[:, 1] = code_range  # every group spans the full range, so scale == step exactly
    x = (base + steps * step).astype(np.float32)
    q = quantize(x, dtype, group_size, symmetric=symmetric, scale_dtype=scale_dtype)
    assert scale_values(q.scales, scale_dtype).tolist() == [step] * 8
    assert np.array_equal(_bits(dequantize(q)), _bits(x))


def test_quantize_rejects_groups_that_span_rows() -> None:
    with pytest.raises(ValueError, match="not divisible by group_size 32"):
        quantize(np.zeros((2, 48), dtype=np.float32), "base_q4", 32)
    with pytest.raises(ValueError, match="base_q2"):
        quantize(np.zeros((2, 64), dtype=np.float32), "base_q2", 32)


def test_pack_q4_nibble_order() -> None:
    codes = np.array([1, 2, 3, 4, 15, 0], dtype=np.uint8)
    assert pack_q4(codes).tolist() == [0x21, 0x43, 0x0F]
    assert unpack_q4(pack_q4(codes)).tolist() == codes.tolist()


def test_gguf_q4_1_maps_losslessly_and_dequantizes_bit_identically() -> None:
    x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    blocks = gguf_quants.quantize(x, GGMLQuantizationType.Q4_1).reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.uint16).reshape(-1)
    m = blocks[:, 2:4].copy().view(np.uint16).reshape(-1)
    qs = blocks[:, 4:]
    # GGUF byte j holds elements j (low) and j+16 (high); .base wants element 2i low, 2i+1 high.
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    q = from_parts("base_q4", (4, 64), 32, "f16", pack_q4(codes), d, m)
    expected = gguf_quants.dequantize(blocks.reshape(4, -1), GGMLQuantizationType.Q4_1)
    assert np.array_equal(_bits(dequantize(q)), _bits(expected))


# --- writer and reader --------------------------------------------------------------------


def _sample_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    return {
        "f32": rng.standard_normal((3, 64)).astype(np.float32),
        "f16": rng.standard_normal(128).astype(np.float16),
        "bf16": rng.standard_normal((2, 3, 128)).astype(np.float32),
        "q4_asym": rng.standard_normal((3, 64)).astype(np.float32),
        "q4_sym": rng.standard_normal((2, 3, 128)).astype(np.float32),
        "q8_asym": rng.standard_normal(128).astype(np.float32),
        "q8_sym": rng.standard_normal((4, 96)).astype(np.float32),
    }


def _sample_quantized(arrays: dict[str, np.ndarray]) -> dict[str, QuantizedTensor]:
    return {
        "q4_asym": quantize(arrays["q4_asym"], "base_q4", 32),
        "q4_sym": quantize(arrays["q4_sym"], "base_q4", 64, symmetric=True),
        "q8_asym": quantize(arrays["q8_asym"], "base_q8", 128, scale_dtype="bf16"),
        "q8_sym": quantize(arrays["q8_sym"], "base_q8", 32, symmetric=True),
    }


def _write_sample(path: Path) -> tuple[dict[str, np.ndarray], dict[str, QuantizedTensor]]:
    arrays = _sample_arrays()
    quantized = _sample_quantized(arrays)
    with BaseWriter(
        path,
        arch="llama",
        config={"hidden_size": 64, "rms_norm_eps": 1e-5},
        tokenizer={"tokenizer_type": "hf", "tokenizer.json": {"model": {"type": "BPE"}}},
        source=HF_SOURCE,
        quant_scheme="q4",
        metadata={"note": "ünïcode"},
        flags=0x9,
    ) as writer:
        writer.add_dense("f32", arrays["f32"], "f32")
        writer.add_dense("f16", arrays["f16"], "f16", flags=0x5)
        writer.add_dense("bf16", arrays["bf16"], "bf16")
        writer.add_dense("bf16_raw", f32_to_bf16_bits(arrays["bf16"]), "bf16", compute_region="gpu")
        for name, q in quantized.items():
            writer.add_quantized(name, q)
    return arrays, quantized


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    data = path.read_bytes()
    (header_len,) = struct.unpack_from("<Q", data, 8)
    return json.loads(data[16 : 16 + header_len]), header_len


def _patch_header(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite the header in place; it may grow up to the old blob_offset, so payload offsets stay valid."""
    header, old_len = _read_header(path)
    edit(header)
    encoded = json.dumps(header).encode()
    blob_offset = -(-(16 + old_len) // 65536) * 65536
    assert 16 + len(encoded) <= blob_offset
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<Q", len(encoded)) + encoded + bytes(blob_offset - 16 - len(encoded)))


def _patch_bytes(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _tensor(header: dict[str, Any], name: str) -> dict[str, Any]:
    return next(entry for entry in header["tensors"] if entry["name"] == name)


def test_written_header_layout(tmp_path: Path) -> None:
    path = tmp_path / "model.base"
    before = int(time.time())
    _write_sample(path)
    data = path.read_bytes()
    header, header_len = _read_header(path)
    assert data[:4] == b"BASE"
    assert struct.unpack_from("<I", data, 4) == (1,)
    assert list(header) == [
        "schema", "arch", "quant_scheme", "min_hw", "created", "baserT_version", "source", "tokenizer",
        "config", "metadata", "target_backend", "alignment", "flags", "tensors",
    ]  # fmt: skip
    assert header["schema"] == 1
    assert header["min_hw"] == "avx2"
    assert header["target_backend"] == "cpu_avx2"
    assert before <= int(header["created"]) <= time.time()
    assert header["baserT_version"] == basert.__version__
    assert header["alignment"] == {"accel_align_log2": 6, "gpu_page_log2": 14, "cpu_align_log2": 6}
    assert header["flags"] == "0x9"
    assert header["metadata"] == {"note": "ünïcode"}
    blob_offset = 65536
    assert data[16 + header_len : blob_offset] == bytes(blob_offset - 16 - header_len)
    assert [entry["name"] for entry in header["tensors"]] == [
        "f32", "f16", "bf16", "bf16_raw", "q4_asym", "q4_sym", "q8_asym", "q8_sym",
    ]  # fmt: skip

    q4_asym = _tensor(header, "q4_asym")
    # 96 packed bytes, scales at 128 (12 bytes), biases at 192 (12 bytes).
    assert q4_asym == {
        "name": "q4_asym", "dtype": "base_q4", "shape": [3, 64], "offset": q4_asym["offset"], "length": 204,
        "group_size": 32, "scale_dtype": "f16", "scale_offset": 128, "scale_length": 12,
        "bias_offset": 192, "bias_length": 12, "compute_region": "cpu",
        "checksum_xxh64": q4_asym["checksum_xxh64"],
    }  # fmt: skip
    assert data[blob_offset + q4_asym["offset"] + 96 : blob_offset + q4_asym["offset"] + 128] == bytes(32)
    q4_sym = _tensor(header, "q4_sym")
    assert (q4_sym["length"], q4_sym["scale_offset"], q4_sym["scale_length"]) == (408, 384, 24)
    assert "bias_offset" not in q4_sym and "bias_length" not in q4_sym
    assert _tensor(header, "f16")["flags"] == "0x5"
    assert _tensor(header, "bf16_raw")["compute_region"] == "gpu"
    assert _tensor(header, "bf16_raw")["offset"] % 16384 == 0
    for entry in header["tensors"]:
        assert "symmetric" not in entry
        assert entry["offset"] % 64 == 0
        start = blob_offset + entry["offset"]
        # A JSON integer (u64), as BaseRT's own tensor entries have it; flags appear only when set.
        checksum = entry["checksum_xxh64"]
        assert type(checksum) is int and 0 <= checksum < 2**64
        assert checksum == xxhash.xxh64(data[start : start + entry["length"]]).intdigest()
        assert entry.get("flags") != "0x0"
    last = header["tensors"][-1]
    assert len(data) == blob_offset + last["offset"] + last["length"]


def test_read_back_is_bit_identical_and_zero_copy(tmp_path: Path) -> None:
    path = tmp_path / "model.base"
    arrays, quantized = _write_sample(path)
    with open_base(path, verify_checksums=True) as bf:
        assert bf.arch == "llama"
        assert bf.config == {"hidden_size": 64, "rms_norm_eps": 1e-5}
        assert bf.tokenizer["tokenizer_type"] == "hf"
        assert bf.source_format == "hf_safetensors"
        assert bf.blob_offset == 65536
        assert bf.file_size == path.stat().st_size
        assert list(bf.tensors) == ["f32", "f16", "bf16", "bf16_raw", "q4_asym", "q4_sym", "q8_asym", "q8_sym"]

        info = bf.tensors["q4_asym"]
        assert (info.shape, info.array_shape, info.group_size, info.scale_dtype) == ((3, 64), (3, 64), 32, "f16")
        assert (info.offset - bf.blob_offset) % 64 == 0
        assert (info.scale_offset, info.scale_length, info.bias_offset, info.bias_length) == (128, 12, 192, 12)
        assert (info.n_elements, info.is_quantized, info.symmetric) == (192, True, False)
        assert bf.tensors["q4_sym"].symmetric and bf.tensors["q8_asym"].scale_dtype == "bf16"
        assert bf.tensors["f16"].flags == 5 and bf.tensors["f16"].compute_region == "cpu"
        assert not bf.tensors["f32"].is_quantized and bf.tensors["f32"].group_size is None

        assert np.array_equal(_bits(bf.array("f32")), _bits(arrays["f32"]))
        assert bf.array("f16").dtype == np.float16
        assert np.array_equal(bf.array("f16").view(np.uint16), arrays["f16"].view(np.uint16))
        bf16_bits = f32_to_bf16_bits(arrays["bf16"])
        assert bf.array("bf16").shape == (2, 3, 128)
        assert np.array_equal(bf.array("bf16"), bf16_bits)
        assert np.array_equal(bf.array("bf16_raw"), bf16_bits)
        assert np.array_equal(_bits(bf.dequantize("bf16")), _bits(bf16_bits_to_f32(bf16_bits)))
        assert np.array_equal(_bits(bf.dequantize("f16")), _bits(arrays["f16"].astype(np.float32)))

        for name, q in quantized.items():
            read = bf.quantized(name)
            assert (read.dtype, read.shape, read.group_size, read.scale_dtype) == (
                q.dtype, q.shape, q.group_size, q.scale_dtype,
            )  # fmt: skip
            assert np.array_equal(read.packed, q.packed)
            assert np.array_equal(read.scales, q.scales)
            assert (read.biases is None) == q.symmetric
            if not q.symmetric:
                assert np.array_equal(bf.biases(name), q.biases)
            assert np.array_equal(_bits(bf.dequantize(name)), _bits(dequantize(q)))

        payload = bf.payload("q8_asym")
        for view in (bf.packed("q8_asym"), bf.scales("q8_asym"), bf.biases("q8_asym"), bf.array("f32")):
            assert not view.flags.owndata
            assert not view.flags.writeable
        assert np.shares_memory(bf.scales("q8_asym"), payload)
        assert np.shares_memory(bf.array("f32"), bf.payload("f32"))


def test_pop_tokenizer_hands_the_object_over_and_keeps_no_copy(tmp_path: Path) -> None:
    path = tmp_path / "model.base"
    _write_sample(path)
    with open_base(path) as bf:
        tokenizer = bf.pop_tokenizer()
        assert tokenizer["tokenizer_type"] == "hf"
        assert bf.tokenizer == {} and "tokenizer" not in bf.header
        assert bf.pop_tokenizer() == {}
        assert bf.arch == "llama" and bf.array("f32").shape == (3, 64)


def test_closing_with_live_views_keeps_them_readable(tmp_path: Path) -> None:
    path = tmp_path / "model.base"
    arrays, _ = _write_sample(path)
    bf = BaseFile(path)
    view = bf.array("f32")
    bf.close()
    assert np.array_equal(_bits(view), _bits(arrays["f32"]))
    with pytest.raises(ValueError, match="is closed"):
        bf.array("f32")


def _resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_released_pages_leave_memory_and_read_again_from_the_file(tmp_path: Path) -> None:
    """release() drops a payload's mapped pages from the process (a packed weight's copy replaces them); the bytes
    still read the same afterwards."""
    path = tmp_path / "model.base"
    values = np.random.default_rng(0).standard_normal((2048, 4096), dtype=np.float32)  # 32 MiB
    with BaseWriter(path, arch="llama", config={}, tokenizer={}, source=HF_SOURCE, quant_scheme="f32") as writer:
        writer.add_dense("big", values, "f32")
    with BaseFile(path) as bf:
        view = bf.array("big")
        assert float(view.sum(dtype=np.float64)) == float(values.sum(dtype=np.float64))  # every page touched
        touched = _resident_bytes()
        bf.release("big", 0, 4096)  # less than a whole page past the payload's start: nothing goes
        bf.release("big")
        assert touched - _resident_bytes() > 24 * 2**20
        assert np.array_equal(view, values)


def test_verify_checksums_reports_progress(tmp_path: Path) -> None:
    path = tmp_path / "model.base"
    _write_sample(path)
    calls: list[tuple[int, int]] = []
    with BaseFile(path) as bf:
        bf.verify_checksums(lambda done, total: calls.append((done, total)))
        total = sum(info.length for info in bf.tensors.values())
    assert len(calls) == 8
    assert calls[-1] == (total, total)
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)


@pytest.mark.parametrize("form", [lambda c: f"{c:016x}", lambda c: f"{c:016X}", lambda c: f"0x{c:016x}", int])
def test_checksum_accepts_hex_forms_and_ints(tmp_path: Path, form: Callable[[int], Any]) -> None:
    """Files of earlier versions wrote hex strings; integers are what is written now. Both load and verify."""
    path = tmp_path / "model.base"
    _write_sample(path)
    written = {entry["name"]: entry["checksum_xxh64"] for entry in _read_header(path)[0]["tensors"]}

    def edit(header: dict[str, Any]) -> None:
        for entry in header["tensors"]:
            entry["checksum_xxh64"] = form(entry["checksum_xxh64"])

    _patch_header(path, edit)
    with BaseFile(path, verify_checksums=True) as bf:
        assert {name: info.checksum for name, info in bf.tensors.items()} == written


def test_gguf_source_shapes_are_reversed_back(tmp_path: Path) -> None:
    path = tmp_path / "model.base"
    x = np.arange(192, dtype=np.float32).reshape(3, 64)
    q = quantize(np.linspace(-1, 1, 256, dtype=np.float32).reshape(2, 128), "base_q4", 64)
    with BaseWriter(
        path, arch="llama", config={}, tokenizer={"tokenizer_type": "gguf"}, source=GGUF_SOURCE, quant_scheme="q4"
    ) as writer:
        writer.add_dense("explicit", x, "f32", shape=[64, 3])
        writer.add_dense("default", x, "f16")
        writer.add_quantized("q", q, shape=[128, 2])
        with pytest.raises(ValueError, match=r"header shape \[3, 64\] must be the reverse of"):
            writer.add_dense("row_major", x, "f32", shape=[3, 64])
    assert [entry["shape"] for entry in _read_header(path)[0]["tensors"]] == [[64, 3], [64, 3], [128, 2]]
    with BaseFile(path) as bf:
        assert bf.source_format == "gguf"
        assert (bf.tensors["explicit"].shape, bf.tensors["explicit"].array_shape) == ((64, 3), (3, 64))
        assert np.array_equal(bf.array("explicit"), x)
        assert bf.array("default").shape == (3, 64)
        assert bf.quantized("q").shape == (2, 128)
        assert np.array_equal(_bits(bf.dequantize("q")), _bits(dequantize(q)))


def test_writer_rejects_bad_tensors(tmp_path: Path) -> None:
    path = tmp_path / "model.base"
    with BaseWriter(path, arch="llama", config={}, tokenizer={}, source=HF_SOURCE, quant_scheme="q4") as writer:
        writer.add_dense("a", np.zeros(4, dtype=np.float32), "f32")
        with pytest.raises(ValueError, match="duplicate tensor name 'a'"):
            writer.add_dense("a", np.zeros(4, dtype=np.float32), "f32")
        with pytest.raises(ValueError, match=r"group_size must be one of \(32, 64, 128\), got 16"):
            writer.add_quantized("b", quantize(np.zeros((2, 32), dtype=np.float32), "base_q4", 16))
        with pytest.raises(ValueError, match="dense dtype must be one of"):
            writer.add_dense("c", np.zeros(4, dtype=np.float32), "base_q4")
        with pytest.raises(ValueError, match="compute_region"):
            writer.add_dense("d", np.zeros(4, dtype=np.float32), "f32", compute_region="npu")
    with BaseFile(path) as bf:
        assert list(bf.tensors) == ["a"]


@pytest.mark.parametrize("interrupt", [RuntimeError, KeyboardInterrupt])
def test_failed_write_leaves_no_file(tmp_path: Path, interrupt: type[BaseException]) -> None:
    path = tmp_path / "model.base"
    with pytest.raises(interrupt):
        with BaseWriter(path, arch="llama", config={}, tokenizer={}, source=HF_SOURCE, quant_scheme="f16") as writer:
            writer.add_dense("a", np.ones(1024, dtype=np.float32), "f32")
            assert len(list(tmp_path.iterdir())) == 1  # the spool file
            raise interrupt()
    assert list(tmp_path.iterdir()) == []


def test_failed_write_keeps_the_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "model.base"
    _write_sample(path)
    original = path.read_bytes()
    with pytest.raises(RuntimeError):
        with BaseWriter(path, arch="llama", config={}, tokenizer={}, source=HF_SOURCE, quant_scheme="f16") as writer:
            writer.add_dense("a", np.ones(16, dtype=np.float32), "f32")
            raise RuntimeError
    assert path.read_bytes() == original
    assert list(tmp_path.iterdir()) == [path]


# --- malformed files ----------------------------------------------------------------------


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    path = tmp_path / "model.base"
    _write_sample(path)
    return path


@pytest.mark.parametrize("size", [0, 15])
def test_file_shorter_than_preamble(sample: Path, size: int) -> None:
    sample.write_bytes(sample.read_bytes()[:size])
    with pytest.raises(TruncatedFileError, match=f"{size} bytes is shorter than the 16-byte preamble"):
        BaseFile(sample)


def test_file_cut_inside_the_blob(sample: Path) -> None:
    sample.write_bytes(sample.read_bytes()[: 65536 + 100])
    with pytest.raises(TruncatedFileError, match=r"file ends at 65636 inside tensor 'f32' \(bytes 65536..66304\)"):
        BaseFile(sample)


def test_file_cut_before_the_blob(sample: Path) -> None:
    sample.write_bytes(sample.read_bytes()[:60000])
    with pytest.raises(TruncatedFileError, match="blob_offset 65536 is past end of file"):
        BaseFile(sample)


def test_bad_magic(sample: Path) -> None:
    _patch_bytes(sample, 0, b"GGUF")
    with pytest.raises(BadMagicError, match="magic is b'GGUF', expected b'BASE'"):
        BaseFile(sample)


@pytest.mark.parametrize("version", [0, 2])
def test_unsupported_version(sample: Path, version: int) -> None:
    _patch_bytes(sample, 4, struct.pack("<I", version))
    with pytest.raises(UnsupportedVersionError, match=rf"format_version {version} is not supported \(only 1 is\)"):
        BaseFile(sample)


def test_header_len_past_end_of_file(sample: Path) -> None:
    size = sample.stat().st_size
    _patch_bytes(sample, 8, struct.pack("<Q", size))
    with pytest.raises(HeaderOverflowError, match=f"header_len {size} runs past end of file \\(size {size}\\)"):
        BaseFile(sample)


@pytest.mark.parametrize("first_byte", [b"x", b"\xff", b"["])
def test_header_not_json(sample: Path, first_byte: bytes) -> None:
    _patch_bytes(sample, 16, first_byte)
    with pytest.raises(InvalidHeaderError, match="header is not UTF-8 JSON"):
        BaseFile(sample)


@pytest.mark.parametrize("key", ["tensors", "arch", "config"])
def test_header_missing_required_key(sample: Path, key: str) -> None:
    _patch_header(sample, lambda header: header.pop(key))
    with pytest.raises(InvalidHeaderError, match=f"header key '{key}' is missing"):
        BaseFile(sample)


@pytest.mark.parametrize(
    ("name", "field", "value", "message"),
    [
        ("q8_sym", "offset", 10**9, r"tensor 'q8_sym' at bytes 1000065536..1000065944 lies past end of file"),
        ("f32", "length", 767, r"tensor 'f32' length 767 does not match the 768 bytes of f32 \[3, 64\]"),
        ("f32", "length", 832, r"tensor 'f32' length 832 does not match the 768 bytes of f32 \[3, 64\]"),
        ("q4_asym", "length", 200, r"tensor 'q4_asym' length 200 does not match the 204 bytes of its regions"),
        ("q4_asym", "length", 256, r"tensor 'q4_asym' length 256 does not match the 204 bytes of its regions"),
        ("q4_asym", "scale_length", 10, r"tensor 'q4_asym' scale region holds 10 bytes, expected 12 for base_q4"),
        ("q4_asym", "scale_length", 24, r"tensor 'q4_asym' scale region holds 24 bytes, expected 12 for base_q4"),
        ("q4_asym", "scale_offset", 64, r"tensor 'q4_asym' scale region starts at 64, expected 96..128 \(right after"),
        ("q4_asym", "bias_offset", 256, r"tensor 'q4_asym' bias region starts at 256, expected 140..192 \(right after"),
        ("q4_sym", "length", 300, r"tensor 'q4_sym' length 300 does not match the 408 bytes of its regions"),
        ("q4_sym", "dtype", "base_q8", r"tensor 'q4_sym' scale region starts at 384, expected 768 \(right after"),
        ("f16", "offset", 704, r"tensor 'f16' at bytes 66240..66496 overlaps tensor 'f32' at bytes 65536..66304"),
        ("f16", "offset", 800, r"tensor 'f16' offset 800 is not a multiple of 64, the alignment of compute_region"),
        ("q4_asym", "compute_region", "gpu", r"tensor 'q4_asym' offset 17920 is not a multiple of 16384"),
        ("q4_asym", "group_size", 64, r"tensor 'q4_asym' scale region holds 12 bytes, expected 6 for base_q4"),
    ],
)
def test_tensor_out_of_bounds(sample: Path, name: str, field: str, value: int | str, message: str) -> None:
    _patch_header(sample, lambda header: _tensor(header, name).update({field: value}))
    with pytest.raises(TensorOutOfBoundsError, match=message):
        BaseFile(sample)


@pytest.mark.parametrize(
    ("name", "field", "value", "message"),
    [
        ("q4_asym", "compute_region", "npu", r"tensor 'q4_asym' compute_region 'npu' is not one of"),
        ("q4_asym", "group_size", 16, r"tensor 'q4_asym' group_size 16 is not one of 32, 64, 128"),
        ("q8_sym", "group_size", 64, r"tensor 'q8_sym' rows of shape \[4, 96\] do not split into groups of 64"),
    ],
)
def test_invalid_tensor_entry(sample: Path, name: str, field: str, value: int | str, message: str) -> None:
    _patch_header(sample, lambda header: _tensor(header, name).update({field: value}))
    with pytest.raises(InvalidHeaderError, match=message):
        BaseFile(sample)


def test_checksum_mismatch(sample: Path) -> None:
    header, _ = _read_header(sample)
    entry = _tensor(header, "q4_sym")
    flipped = 65536 + entry["offset"] + 17
    original = sample.read_bytes()[flipped]
    _patch_bytes(sample, flipped, bytes([original ^ 0x01]))
    with BaseFile(sample) as bf:
        assert bf.packed("q4_sym")[17] == original ^ 0x01
        with pytest.raises(ChecksumMismatchError, match=f"header records {entry['checksum_xxh64']:016x}"):
            bf.verify_checksums()
    with pytest.raises(ChecksumMismatchError, match="tensor 'q4_sym' hashes to"):
        BaseFile(sample, verify_checksums=True)


@pytest.mark.parametrize("dtype", ["base_q9", "base_q7", "int7", "q4_0"])
def test_unknown_dtype(sample: Path, dtype: str) -> None:
    _patch_header(sample, lambda header: _tensor(header, "q8_sym").update(dtype=dtype))
    with pytest.raises(UnknownDtypeError, match=f"tensor 'q8_sym' has unknown dtype '{dtype}'"):
        BaseFile(sample)


@pytest.mark.parametrize("dtype", ["base_q2", "base_q3", "base_q5", "base_q6"])
def test_unsupported_dtype(sample: Path, dtype: str) -> None:
    _patch_header(sample, lambda header: _tensor(header, "q8_sym").update(dtype=dtype))
    with pytest.raises(UnsupportedDtypeError, match=f"tensor 'q8_sym' has dtype '{dtype}', which this reader"):
        BaseFile(sample)


def test_error_names_the_file(sample: Path) -> None:
    _patch_bytes(sample, 0, b"GGUF")
    with pytest.raises(BadMagicError) as raised:
        BaseFile(sample)
    assert str(raised.value).startswith(f"{sample}: ")
    assert isinstance(raised.value, ModelValidationError) and isinstance(raised.value, ValueError)


def _write_blocks(path: Path) -> np.ndarray:
    """A file with one tensor of Q4_K blocks kept as they are: 3 rows of 512 values (2 super-blocks each)."""
    block_type = BLOCK_TYPES[int(GGMLQuantizationType.Q4_K)]
    raw = np.random.default_rng(2).integers(0, 256, (3, block_type.row_bytes(512)), dtype=np.uint8)
    raw.reshape(-1, block_type.block_bytes)[:, 0:4] = np.frombuffer(
        np.array([0.01, 0.002], dtype="<f2").tobytes(), dtype=np.uint8)  # finite d and dmin
    with BaseWriter(path, arch="llama", config={}, tokenizer={"tokenizer_type": "hf"}, source=HF_SOURCE,
                    quant_scheme="auto") as writer:
        writer.add_blocks("q4k", raw, block_type, (3, 512))
        with pytest.raises(ValueError, match="720 bytes of Q4_K blocks, expected 864"):
            writer.add_blocks("short", raw.reshape(-1)[:-144], block_type, (3, 512))
        with pytest.raises(ValueError, match=r"rows of shape \[3, 480\] do not split into Q4_K blocks of 256"):
            writer.add_blocks("odd", raw, block_type, (3, 480))
    return raw


def test_gguf_blocks_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "blocks.base"
    raw = _write_blocks(path)
    header, _ = _read_header(path)
    entry = _tensor(header, "q4k")
    assert {k: entry[k] for k in ("dtype", "group_size", "layout", "source_ggml_type", "length")} == {
        "dtype": "base_q4", "group_size": 256, "layout": "gguf_super", "source_ggml_type": 12, "length": raw.nbytes}
    with BaseFile(path, verify_checksums=True) as bf:
        info = bf.tensors["q4k"]
        assert (info.storage, info.is_blocks, info.is_quantized) == ("Q4_K", True, False)
        assert np.array_equal(bf.payload("q4k"), raw.reshape(-1))
        expected = gguf_quants.dequantize(raw, GGMLQuantizationType.Q4_K)
        assert np.array_equal(_bits(bf.dequantize("q4k")), _bits(expected))
        with pytest.raises(ValueError, match="not quantized"):
            bf.packed("q4k")


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        ("source_ggml_type", 99, UnsupportedDtypeError, r"source_ggml_type 99, which this reader does not support"),
        ("source_ggml_type", "12", UnsupportedDtypeError, r"source_ggml_type '12', which this reader does not"),
        ("layout", "tiled", UnsupportedDtypeError, r"layout 'tiled', which this reader does not support"),
        ("dtype", "base_q8", InvalidHeaderError, r"holds Q4_K blocks, which are dtype 'base_q4' with group_size 256"),
        ("group_size", 32, InvalidHeaderError, r"holds Q4_K blocks, which are dtype 'base_q4' with group_size 256"),
        ("length", 720, TensorOutOfBoundsError, r"length 720 does not match the 864 bytes of Q4_K \[3, 512\]"),
        ("shape", [3, 480], InvalidHeaderError, r"rows of shape \[3, 480\] do not split into Q4_K blocks of 256"),
    ],
)
def test_bad_gguf_blocks_entry(tmp_path: Path, field: str, value: Any, error: type[Exception], message: str) -> None:
    path = tmp_path / "blocks.base"
    _write_blocks(path)
    _patch_header(path, lambda header: _tensor(header, "q4k").update({field: value}))
    with pytest.raises(error, match=message):
        BaseFile(path)
