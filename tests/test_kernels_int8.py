"""The integer path of quantized weights (matmul.h's contract): activations quantized to 8 bits per block of 32
and integer dot products, against a numpy reference that performs the same integer sums and float32 operations, so
the kernels must match it bit for bit on every CPU variant; then batch, thread and fused-call invariance, the
tolerance against the exact float32 path, and which weights take which path."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from basert._ext import matmul as mm
from basert.format.quant import QuantizedTensor, quantize, scale_values, unpack_q4

KINDS = [(kind, group, symmetric, scale_dtype)
         for kind in ("base_q4", "base_q8")
         for group in (32, 64, 128)
         for symmetric in (False, True)
         for scale_dtype in ("f16", "bf16")]
K_VALUES = {32: (32, 96, 576, 2080), 64: (64, 576, 2112), 128: (128, 1152, 2176)}
M_VALUES = (1, 2, 3, 4, 5, 9, 17, 64, 130)
N_VALUES = (1, 7, 8, 33, 100)


def kind_id(case: tuple[str, int, bool, str]) -> str:
    kind, group, symmetric, scale_dtype = case
    return f"{kind}-g{group}-{'sym' if symmetric else 'asym'}-{scale_dtype}"


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes int8 [M, K], scales float32 [M, K/32], sums of 16 codes int16 [M, K/16]) as matmul.h defines them."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    scale = np.abs(blocks).max(axis=2) / np.float32(127)
    inv = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale != 0)
    codes = np.rint(np.clip(blocks * inv[:, :, None], np.float32(-127), np.float32(127))).astype(np.int8)
    sums = codes.reshape(m, k // 16, 16).astype(np.int32).sum(axis=2).astype(np.int16)
    return codes.reshape(m, k), scale.astype(np.float32), sums


def integer_reference(x: np.ndarray, q: QuantizedTensor) -> np.ndarray:
    """out[M, N] by the integer contract: exact block sums, then (s * d) * I (+ (m * d) * S) summed in block order."""
    n, k = q.shape
    m, blocks = x.shape[0], k // 32
    codes = (unpack_q4(q.packed) if q.dtype == "base_q4" else q.packed).reshape(n, blocks, 32).astype(np.int64)
    if q.symmetric:
        codes -= 8 if q.dtype == "base_q4" else 128
    a, d, sums = quantize_activations(x)
    a = a.reshape(m, blocks, 32).astype(np.int64)
    block_sums = sums.reshape(m, blocks, 2).astype(np.int64).sum(axis=2).astype(np.float32)
    dots = np.einsum("nbj,mbj->mnb", codes, a).astype(np.float32)
    group_of = np.arange(blocks) * 32 // q.group_size
    scales = scale_values(q.scales, q.scale_dtype).reshape(n, -1)[:, group_of]
    biases = None if q.symmetric else scale_values(q.biases, q.scale_dtype).reshape(n, -1)[:, group_of]
    out = np.zeros((m, n), dtype=np.float32)
    for b in range(blocks):
        t = (scales[None, :, b] * d[:, None, b]) * dots[:, :, b]
        if biases is not None:
            t = t + (biases[None, :, b] * d[:, None, b]) * block_sums[:, None, b]
        out = out + t
    return out


def make(case: tuple[str, int, bool, str], n: int, k: int, seed: int) -> tuple[mm.Weight, QuantizedTensor, np.ndarray]:
    kind, group, symmetric, scale_dtype = case
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.5)
    q = quantize(values, kind, group, symmetric=symmetric, scale_dtype=scale_dtype)
    weight = mm.Weight(kind, n, k, q.packed, q.scales, q.biases, group, scale_dtype, exact=False)
    return weight, q, values


def activations(m: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Rows of very different magnitudes, and some blocks of zeros (scale 0).
    magnitude = np.float32(10.0) ** rng.integers(-3, 3, (m, 1)).astype(np.float32)
    x = rng.standard_normal((m, k), dtype=np.float32) * magnitude
    if k > 32:
        x[:, :32] = 0
    return x


def run(x: np.ndarray, weight: mm.Weight) -> np.ndarray:
    out = np.full((x.shape[0], weight.n), np.nan, dtype=np.float32)
    mm.matmul(np.ascontiguousarray(x), weight, out)
    return out


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.fixture
def threads() -> Iterator[None]:
    before = mm.get_num_threads()
    yield
    mm.set_num_threads(before)


@pytest.mark.parametrize("k", (32, 64, 576, 2080))
def test_activation_quantization_matches_the_reference(k: int) -> None:
    x = activations(5, k, seed=k)
    # Halfway values (x * (1/d) = j + 0.5 exactly for d = 1) round to even, as rint does.
    x[0, -32:] = np.float32(127.0) * np.sign(np.arange(32) - 15.5).astype(np.float32)
    x[1, -32:] = np.arange(32, dtype=np.float32) + np.float32(0.5)
    x[1, -1] = np.float32(127)
    codes, scales, sums = mm.QuantizedRows(x).parts()
    want = quantize_activations(x)
    assert np.array_equal(codes, want[0])
    assert same_bits(scales, want[1])
    assert np.array_equal(sums, want[2])


@pytest.mark.parametrize("n", N_VALUES)
@pytest.mark.parametrize("case", KINDS, ids=kind_id)
def test_integer_path_matches_the_reference_bit_for_bit(case: tuple[str, int, bool, str], n: int) -> None:
    for k in K_VALUES[case[1]]:
        weight, q, _ = make(case, n, k, seed=n * 7 + k)
        assert weight.int8
        x = activations(max(M_VALUES), k, seed=k)
        out = run(x, weight)
        want = integer_reference(x, q)
        for m in M_VALUES:
            # Every batch size: the rows of a smaller batch are the same bits as in the largest.
            assert same_bits(run(x[:m], weight), want[:m]), f"K={k} M={m}"
        assert same_bits(out, want), f"K={k}"


@pytest.mark.parametrize("case", KINDS[::5], ids=kind_id)
def test_rows_do_not_depend_on_threads_or_fused_calls(case: tuple[str, int, bool, str], threads: None) -> None:
    weights = [make(case, n, 1152, seed=n)[0] for n in (64, 40, 40)]
    for m in (1, 3, 16, 17, 40):
        x = activations(m, 1152, seed=m)
        alone = []
        for n_threads in (1, 2, 3):
            mm.set_num_threads(n_threads)
            alone.append([run(x, w) for w in weights])
            outs = [np.full((m, w.n), np.nan, dtype=np.float32) for w in weights]
            mm.matmul_many(x, weights, outs)
            for a, b in zip(alone[0], outs):
                assert same_bits(a, b)
        for other in alone[1:]:
            for a, b in zip(alone[0], other):
                assert same_bits(a, b)


def test_fused_call_mixes_integer_and_float_weights() -> None:
    case = ("base_q4", 32, False, "f16")
    int8, q, values = make(case, 48, 576, seed=1)
    exact = mm.Weight("base_q4", 48, 576, q.packed, q.scales, q.biases, 32, "f16", exact=True)
    dense = mm.Weight("f32", 24, 576, np.ascontiguousarray(values[:24]).reshape(-1).view(np.uint8))
    for m in (2, 40):
        x = activations(m, 576, seed=m)
        outs = [np.full((m, w.n), np.nan, dtype=np.float32) for w in (int8, exact, dense)]
        mm.matmul_many(x, [int8, exact, dense], outs)
        for w, out in zip((int8, exact, dense), outs):
            assert same_bits(out, run(x, w))


@pytest.mark.parametrize("case", [c for c in KINDS if c[3] == "f16"], ids=kind_id)
def test_integer_path_stays_close_to_the_exact_path(case: tuple[str, int, bool, str]) -> None:
    weight, q, _ = make(case, 96, 1152 if case[1] == 128 else 576, seed=3)
    exact = mm.Weight(q.dtype, weight.n, weight.k, q.packed, q.scales, q.biases, q.group_size, q.scale_dtype,
                      exact=True)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((8, weight.k), dtype=np.float32)
    fast, slow = run(x, weight), run(x, exact)
    # 8-bit activations: an error of about 1/254 of each block's largest value, across the row.
    error = np.abs(fast - slow).max() / np.abs(slow).max()
    assert error < 0.02, error


def test_which_weights_take_the_integer_path() -> None:
    rng = np.random.default_rng(0)
    values = rng.standard_normal((8, 64), dtype=np.float32)
    q = quantize(values, "base_q4", 32)
    assert mm.Weight("base_q4", 8, 64, q.packed, q.scales, q.biases, 32, exact=False).int8
    assert not mm.Weight("base_q4", 8, 64, q.packed, q.scales, q.biases, 32, exact=True).int8
    q16 = quantize(values, "base_q8", 16)
    assert not mm.Weight("base_q8", 8, 64, q16.packed, q16.scales, q16.biases, 16, exact=False).int8
    dense = mm.Weight("f32", 8, 64, values.reshape(-1).view(np.uint8), exact=False)
    assert not dense.int8
    weight = mm.Weight("base_q4", 8, 64, q.packed, q.scales, q.biases, 32, exact=False)
    assert weight.rows(0, 4).int8 and not mm.Weight("base_q4", 8, 64, q.packed, q.scales, q.biases, 32,
                                                    exact=True).rows(0, 4).int8
    before = mm.get_exact()
    try:
        mm.set_exact(True)
        assert not mm.Weight("base_q4", 8, 64, q.packed, q.scales, q.biases, 32).int8
        mm.set_exact(False)
        assert mm.Weight("base_q4", 8, 64, q.packed, q.scales, q.biases, 32).int8
    finally:
        mm.set_exact(before)


def test_quantized_rows_need_whole_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        mm.QuantizedRows(np.zeros((2, 48), dtype=np.float32))
