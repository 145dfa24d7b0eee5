"""Matmul kernels against the numpy reference de-quantization, batch invariance of output rows,
row slicing, exact embedding lookup, and argument errors."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import gguf
import numpy as np
import pytest
from gguf_files import random_blocks

from basert._ext import matmul as mm
from basert.format.quant import bf16_bits_to_f32, dequantize, f32_to_bf16_bits, from_parts, quantize


@dataclass(frozen=True, slots=True)
class Spec:
    """How a test weight is stored."""

    kind: str
    group: int = 0
    symmetric: bool = False
    scale_dtype: str = "f16"

    def __str__(self) -> str:
        if not self.group:
            return self.kind
        return f"{self.kind}-g{self.group}-{'sym' if self.symmetric else 'asym'}-{self.scale_dtype}"


DENSE = [Spec("f32"), Spec("f16"), Spec("bf16")]
QUANTIZED = [
    Spec(kind, group, symmetric, scale_dtype)
    for kind in ("base_q4", "base_q8")
    for group in (32, 64, 128)
    for symmetric in (False, True)
    for scale_dtype in ("f16", "bf16")
]
# Dense K includes values that are not multiples of 8 (the scalar K tail).
DENSE_K = (13, 32, 96, 576, 608, 1000, 1001, 2080)
GROUP_K = {32: (32, 96, 576, 608, 2080), 64: (64, 576, 1216, 2112), 128: (128, 640, 1152, 2176)}
M_VALUES = (1, 2, 3, 5, 17, 64, 130)
N_VALUES = (1, 7, 33, 100)


def spec_k_cases() -> Iterator[tuple[Spec, int]]:
    for spec in DENSE:
        for k in DENSE_K:
            yield spec, k
    for spec in QUANTIZED:
        for k in GROUP_K[spec.group]:
            yield spec, k


def readonly(array: np.ndarray) -> np.ndarray:
    """The array flagged read-only, like the mmap views the engine passes."""
    array.setflags(write=False)
    return array


def make_weight(spec: Spec, values: np.ndarray) -> tuple[mm.Weight, np.ndarray]:
    """A Weight storing `values` [n, k] as `spec`, and the float32 values it stands for (the reference)."""
    n, k = values.shape
    if spec.kind == "f32":
        return mm.Weight("f32", n, k, readonly(values.reshape(-1).view(np.uint8))), values
    if spec.kind == "f16":
        half = values.astype(np.float16)
        return mm.Weight("f16", n, k, readonly(half.reshape(-1).view(np.uint8))), half.astype(np.float32)
    if spec.kind == "bf16":
        bits = f32_to_bf16_bits(values)
        return mm.Weight("bf16", n, k, readonly(bits.reshape(-1).view(np.uint8))), bf16_bits_to_f32(bits).reshape(n, k)
    q = quantize(values, spec.kind, spec.group, symmetric=spec.symmetric, scale_dtype=spec.scale_dtype)
    biases = None if q.biases is None else readonly(q.biases)
    weight = mm.Weight(spec.kind, n, k, readonly(q.packed), readonly(q.scales), biases, spec.group, spec.scale_dtype,
                       exact=True)
    return weight, dequantize(q)


def random_weight(spec: Spec, n: int, k: int, seed: int) -> tuple[mm.Weight, np.ndarray]:
    rng = np.random.default_rng(seed)
    return make_weight(spec, rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.5))


def run(x: np.ndarray, weight: mm.Weight) -> np.ndarray:
    out = np.full((x.shape[0], weight.n), np.nan, dtype=np.float32)
    mm.matmul(np.ascontiguousarray(x), weight, out)
    return out


def assert_close_to_reference(out: np.ndarray, x: np.ndarray, reference: np.ndarray) -> None:
    """|out - x @ W^T| <= 1e-5 * sum|x||w| + 1e-6 elementwise, computed in float64."""
    x64, w64 = x.astype(np.float64), reference.astype(np.float64)
    exact = x64 @ w64.T
    bound = 1e-5 * (np.abs(x64) @ np.abs(w64).T) + 1e-6
    excess = np.abs(out.astype(np.float64) - exact) - bound
    worst = np.unravel_index(np.argmax(excess), excess.shape)
    assert excess[worst] <= 0, f"out{worst} = {out[worst]!r}, exact {exact[worst]!r}, bound {bound[worst]!r}"


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.fixture
def threads() -> Iterator[None]:
    """Restores the kernels' thread count after a test that changes it."""
    before = mm.get_num_threads()
    yield
    mm.set_num_threads(before)


@pytest.mark.parametrize("n", N_VALUES)
@pytest.mark.parametrize(("spec", "k"), list(spec_k_cases()), ids=lambda v: str(v))
def test_matmul_matches_reference(spec: Spec, k: int, n: int) -> None:
    weight, reference = random_weight(spec, n, k, seed=n * 7919 + k)
    x = np.random.default_rng(k).standard_normal((max(M_VALUES), k), dtype=np.float32)
    # One reference product for all batch sizes: each M's rows stacked.
    outs = np.concatenate([run(x[:m], weight) for m in M_VALUES])
    assert_close_to_reference(outs, np.concatenate([x[:m] for m in M_VALUES]), reference)


@pytest.mark.parametrize("spec", DENSE + QUANTIZED, ids=str)
def test_rows_are_batch_and_thread_invariant(spec: Spec, threads: None) -> None:
    k = {0: 1007, 32: 608}.get(spec.group, 1152)  # 1007: a 7-value scalar K tail
    # 37 rows: neither threads nor 4-row kernels divide it evenly.
    weight, _ = random_weight(spec, 37, k, seed=11)
    x = np.random.default_rng(12).standard_normal((130, k), dtype=np.float32)
    mm.set_num_threads(2)
    whole = run(x, weight)
    for row in (0, 1, 64, 129):
        assert same_bits(run(x[row:row + 1], weight), whole[row:row + 1])
    # Batches of up to 16 rows stream (1 to 3 rows, or 8 at a time); longer ones use de-quantized tiles.
    for start, count in ((0, 8), (3, 8), (122, 8), (5, 2), (50, 3), (10, 4), (20, 5), (30, 11), (60, 16), (1, 129)):
        assert same_bits(run(x[start:start + count], weight), whole[start:start + count])
    mm.set_num_threads(1)
    assert same_bits(run(x, weight), whole)
    assert same_bits(run(x[7:8], weight), whole[7:8])
    # Rows sliced off a 4-row boundary go through the other row kernels.
    part = weight.rows(3, 37)
    assert same_bits(run(x, part), whole[:, 3:37])
    assert same_bits(run(x[9:10], part), whole[9:10, 3:37])


@pytest.mark.parametrize("spec", [Spec("f32"), Spec("bf16"), Spec("base_q4", 32), Spec("base_q8", 64, True)], ids=str)
def test_matmul_many_equals_one_matmul_per_weight(spec: Spec, threads: None) -> None:
    """Fused weights (q/k/v, gate/up) give each output the bits of its own matmul, whatever the thread count
    and batch; row counts that neither 4 nor the threads divide cut the thread runs inside a weight."""
    k = 576 if spec.group != 64 else 640
    weights = [random_weight(spec, n, k, seed=20 + n)[0] for n in (37, 9, 9, 130)]
    x = np.random.default_rng(21).standard_normal((20, k), dtype=np.float32)
    for nt in (1, 2, 3):
        mm.set_num_threads(nt)
        for rows in (1, 3, 16, 20):   # 20 rows: above the streaming size, one matmul per weight
            outs = [np.full((rows, w.n), np.nan, dtype=np.float32) for w in weights]
            mm.matmul_many(x[:rows], weights, outs)
            assert all(same_bits(out, run(x[:rows], w)) for out, w in zip(outs, weights)), (nt, rows)
    with pytest.raises(ValueError, match="weight 1 has K"):
        mm.matmul_many(x, [weights[0], random_weight(spec, 4, 2 * k, seed=1)[0]],
                       [np.zeros((20, 37), np.float32), np.zeros((20, 4), np.float32)])
    with pytest.raises(ValueError, match="output 0 has shape"):
        mm.matmul_many(x, [weights[0]], [np.zeros((20, 36), np.float32)])


@pytest.mark.parametrize(("n", "k"), [(700, 576), (301, 1536)])
def test_tiles_split_across_threads_agree(n: int, k: int, threads: None) -> None:
    # Enough rows for several weight tiles per thread (301: the last tile ends inside a row block), and M
    # above one activation block; 3 threads split the tiles unevenly.
    weight, reference = random_weight(Spec("base_q4", 32), n, k, seed=3)
    x = np.random.default_rng(4).standard_normal((300, k), dtype=np.float32)
    mm.set_num_threads(2)
    two = run(x, weight)
    for nt in (1, 3):
        mm.set_num_threads(nt)
        assert same_bits(run(x, weight), two), nt
    assert same_bits(run(x[299:], weight), two[299:])
    assert same_bits(run(x[1:140], weight), two[1:140])
    assert_close_to_reference(two, x, reference)


def at_offset(x: np.ndarray, offset: int) -> np.ndarray:
    """A copy of x whose data starts `offset` bytes past a 64-byte boundary."""
    raw = np.empty(x.nbytes + 128, dtype=np.uint8)
    start = -raw.ctypes.data % 64 + offset
    copy = raw[start:start + x.nbytes].view(np.float32).reshape(x.shape)
    copy[...] = x
    return copy


@pytest.mark.parametrize("spec", [Spec("f32"), Spec("base_q4", 32), Spec("base_q8", 32, True)], ids=str)
def test_activation_alignment_does_not_change_results(spec: Spec) -> None:
    # Activations that are not 32-byte aligned are copied to aligned rows first; the bits must not move.
    weight, _ = random_weight(spec, 40, 576, seed=13)
    x = np.random.default_rng(14).standard_normal((20, 576), dtype=np.float32)
    outs = []
    for offset in (0, 4, 16, 32):
        out = np.empty((20, 40), dtype=np.float32)
        mm.matmul(at_offset(x, offset), weight, out)
        outs.append(out)
    assert all(same_bits(out, outs[0]) for out in outs[1:])


@pytest.mark.parametrize("spec", [Spec("f32"), Spec("bf16"), Spec("base_q4", 32), Spec("base_q8", 32, True),
                                  Spec("base_q4", 64, True, "bf16")], ids=str)
def test_rows_slice_views_the_same_bytes(spec: Spec) -> None:
    weight, reference = random_weight(spec, 4 * 24, 128, seed=5)
    x = np.random.default_rng(6).standard_normal((9, 128), dtype=np.float32)
    whole = run(x, weight)
    for start, stop in ((24, 48), (0, 1), (61, 96), (95, 96)):
        part = weight.rows(start, stop)
        assert (part.n, part.k, part.kind, part.group_size) == (stop - start, 128, spec.kind, spec.group)
        assert np.shares_memory(part.data, weight.data)
        out = run(x, part)
        assert_close_to_reference(out, x, reference[start:stop])
        assert same_bits(out, whole[:, start:stop])
        assert same_bits(run(x[2:3], part), whole[2:3, start:stop])
    assert weight.rows(10, 10).n == 0


@pytest.mark.parametrize("spec", DENSE + QUANTIZED, ids=str)
def test_embed_rows_is_the_exact_dequantization(spec: Spec) -> None:
    weight, reference = random_weight(spec, 50, 256 if spec.group else 259, seed=8)
    ids = np.array([0, 49, 17, 17, 3, 0], dtype=np.int32)
    out = np.full((len(ids), weight.k), np.nan, dtype=np.float32)
    mm.embed_rows(weight, ids, out)
    assert same_bits(out, reference[ids])


@pytest.mark.parametrize("scale_dtype", ["f16", "bf16"])
@pytest.mark.parametrize("kind", ["base_q4", "base_q8"])
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_arbitrary_codes_and_scale_bits(kind: str, scale_dtype: str, symmetric: bool) -> None:
    # Negative, subnormal and zero scales and every code: what a lossless GGUF mapping can hold.
    rng = np.random.default_rng(9)
    n, k, group = 40, 192, 32
    packed = rng.integers(0, 256, n * k * (4 if kind == "base_q4" else 8) // 8, dtype=np.uint8)
    groups = n * k // group
    if scale_dtype == "f16":
        exponent = rng.integers(0, 31, (2, groups), dtype=np.uint16)  # 0 = zero/subnormal, never inf/NaN
    else:
        exponent = rng.integers(100, 150, (2, groups), dtype=np.uint16)
    shift = 10 if scale_dtype == "f16" else 7
    mantissa = rng.integers(0, 1 << shift, (2, groups), dtype=np.uint16)
    sign = rng.integers(0, 2, (2, groups), dtype=np.uint16) << np.uint16(15)
    bits = sign | (exponent << np.uint16(shift)) | mantissa
    q = from_parts(kind, (n, k), group, scale_dtype, packed, bits[0], None if symmetric else bits[1])
    reference = dequantize(q)
    weight = mm.Weight(kind, n, k, q.packed, q.scales, q.biases, group, scale_dtype, exact=True)
    out = np.empty((n, k), dtype=np.float32)
    mm.embed_rows(weight, np.arange(n, dtype=np.int32), out)
    assert same_bits(out, reference)
    x = rng.standard_normal((6, k), dtype=np.float32)
    whole = run(x, weight)
    assert_close_to_reference(whole, x, reference)
    assert same_bits(run(x[4:5], weight), whole[4:5])


def test_f16_conversion_is_exact_for_every_non_nan_value() -> None:
    # NaNs are left out: F16C quiets signalling NaNs where numpy keeps their bits.
    bits = np.arange(1 << 16, dtype=np.uint16)
    bits = readonly(bits[~np.isnan(bits.view(np.float16))])
    weight = mm.Weight("f16", 1, bits.size, bits.view(np.uint8))
    out = np.empty((1, bits.size), dtype=np.float32)
    mm.embed_rows(weight, np.zeros(1, np.int32), out)
    assert same_bits(out[0], bits.view(np.float16).astype(np.float32))
    # The same values as group scales (q8, every code 1, zero biases).
    q = from_parts("base_q8", (1, bits.size * 32), 32, "f16", np.ones(bits.size * 32, np.uint8), bits,
                   np.zeros(bits.size, np.uint16))
    q8 = mm.Weight("base_q8", 1, q.shape[1], q.packed, q.scales, q.biases, 32, "f16", exact=True)
    wide = np.empty((1, q8.k), dtype=np.float32)
    mm.embed_rows(q8, np.zeros(1, np.int32), wide)
    assert same_bits(wide, dequantize(q))


def test_threads_setting() -> None:
    before = mm.get_num_threads()
    assert before >= 1
    try:
        mm.set_num_threads(3)
        assert mm.get_num_threads() == 3
    finally:
        mm.set_num_threads(before)
    with pytest.raises(ValueError, match="at least 1"):
        mm.set_num_threads(0)


def test_errors_raise_value_error() -> None:
    weight, _ = random_weight(Spec("base_q4", 32), 8, 64, seed=1)
    with pytest.raises(ValueError, match="x has 32 columns"):
        mm.matmul(np.zeros((2, 32), np.float32), weight, np.zeros((2, 8), np.float32))
    with pytest.raises(ValueError, match=r"out has shape \(2, 7\)"):
        mm.matmul(np.zeros((2, 64), np.float32), weight, np.zeros((2, 7), np.float32))
    with pytest.raises(ValueError, match="not divisible by group_size"):
        mm.Weight("base_q4", 8, 48, np.zeros(8 * 24, np.uint8), np.zeros(8, np.uint16), None, 32)
    with pytest.raises(ValueError, match="multiple of 8"):
        mm.Weight("base_q8", 8, 36, np.zeros(8 * 36, np.uint8), np.zeros(8, np.uint16), None, 12)
    with pytest.raises(ValueError, match="needs 256 data bytes"):
        mm.Weight("base_q4", 8, 64, np.zeros(255, np.uint8), np.zeros(16, np.uint16), None, 32)
    with pytest.raises(ValueError, match="needs 16 scales"):
        mm.Weight("base_q4", 8, 64, np.zeros(256, np.uint8), np.zeros(15, np.uint16), None, 32)
    with pytest.raises(ValueError, match="needs 16 biases"):
        mm.Weight("base_q4", 8, 64, np.zeros(256, np.uint8), np.zeros(16, np.uint16), np.zeros(17, np.uint16), 32)
    with pytest.raises(ValueError, match="needs scales"):
        mm.Weight("base_q8", 8, 64, np.zeros(512, np.uint8), group_size=32)
    with pytest.raises(ValueError, match="needs 2048 data bytes"):
        mm.Weight("f32", 8, 64, np.zeros(2047, np.uint8))
    with pytest.raises(ValueError, match="takes no scales"):
        mm.Weight("f16", 8, 64, np.zeros(1024, np.uint8), np.zeros(16, np.uint16))
    with pytest.raises(ValueError, match="kind must be one of"):
        mm.Weight("base_q5", 8, 64, np.zeros(320, np.uint8), np.zeros(16, np.uint16), None, 32)
    with pytest.raises(ValueError, match="scale_dtype"):
        mm.Weight("base_q4", 8, 64, np.zeros(256, np.uint8), np.zeros(16, np.uint16), None, 32, "f32")
    with pytest.raises(ValueError, match="4-byte aligned"):
        mm.Weight("f32", 2, 2, np.zeros(17, np.uint8)[1:])
    with pytest.raises(ValueError, match="dtype mismatch"):
        mm.Weight("f32", 2, 2, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match=r"rows \[4, 9\) out of range"):
        weight.rows(4, 9)
    out = np.zeros((2, 64), np.float32)
    for bad in (8, -1):
        with pytest.raises(ValueError, match=f"id {bad} at position 1 is out of range"):
            mm.embed_rows(weight, np.array([0, bad], np.int32), out)
    with pytest.raises(ValueError, match=r"out has shape \(2, 64\), expected \(3, 64\)"):
        mm.embed_rows(weight, np.zeros(3, np.int32), out)


def test_empty_batch_and_empty_weight_leave_out_untouched() -> None:
    weight, _ = random_weight(Spec("base_q8", 32, True), 4, 32, seed=2)
    mm.matmul(np.zeros((0, 32), np.float32), weight, np.zeros((0, 4), np.float32))
    out = np.full((3, 0), 7.0, np.float32)
    mm.matmul(np.ones((3, 32), np.float32), weight.rows(2, 2), out)
    assert out.shape == (3, 0)


@pytest.mark.parametrize("kind", sorted(mm.BLOCK_KINDS))
def test_gguf_blocks_compute_with_gguf_pys_values(kind: str, threads: None) -> None:
    """Weights of GGUF blocks give the bits of the same values as an f32 weight (gguf-py's de-quantization), at
    every batch size and thread count; embed_rows returns those values."""
    qtype = gguf.GGMLQuantizationType[kind]
    values = gguf.GGML_QUANT_SIZES[qtype][0]
    n, k = 37, 3 * values if values == 256 else 9 * values
    rng = np.random.default_rng(mm.BLOCK_KINDS[kind])
    raw = random_blocks(rng, qtype, n, k)
    weight = mm.Weight(kind, n, k, readonly(raw.reshape(-1)), exact=True)
    assert (weight.kind, weight.group_size) == (kind, values)
    reference = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    as_f32 = mm.Weight("f32", n, k, readonly(reference.reshape(-1).view(np.uint8)))
    ids = np.array([0, 36, 5, 5], dtype=np.int32)
    rows = np.empty((4, k), dtype=np.float32)
    mm.embed_rows(weight, ids, rows)
    assert same_bits(rows, reference[ids])
    x = rng.standard_normal((40, k), dtype=np.float32)
    for nt in (1, 2, 3):
        mm.set_num_threads(nt)
        for m in (1, 3, 16, 40):
            assert same_bits(run(x[:m], weight), run(x[:m], as_f32)), (nt, m)
    assert same_bits(run(x, weight.rows(5, 30)), run(x, as_f32)[:, 5:30])
    outs = [np.empty((8, n), dtype=np.float32), np.empty((8, n), dtype=np.float32)]
    mm.matmul_many(x[:8], [weight, as_f32], outs)
    assert same_bits(outs[0], outs[1])
    assert_close_to_reference(run(x, weight), x, reference)


def test_gguf_block_weights_are_checked() -> None:
    raw = np.zeros(144 * 2, dtype=np.uint8)
    with pytest.raises(ValueError, match="K=300 is not a whole number of Q4_K blocks of 256"):
        mm.Weight("Q4_K", 1, 300, raw)
    with pytest.raises(ValueError, match=r"Q4_K \[2, 256\] needs 288 data bytes, got 144"):
        mm.Weight("Q4_K", 2, 256, raw[:144])
    with pytest.raises(ValueError, match="hold their own scales"):
        mm.Weight("Q4_K", 1, 512, raw, np.zeros(2, np.uint16))
    with pytest.raises(ValueError, match="kind must be one of"):
        mm.Weight("Q4_Z", 1, 512, raw)
