"""Element-wise and per-head kernels (basert._ext.ops) against float64 numpy references."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from basert._ext import ops

SHAPES = [(1, 4, 32), (3, 9, 64), (17, 2, 24), (70, 3, 20), (5, 2, 13)]


def f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def sigmoid_reference(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


def rmsnorm_reference(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * w.astype(np.float64)


def rope_reference(
    x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool
) -> np.ndarray:
    out = x.astype(np.float64)
    half = cos.shape[1]
    c = cos[positions].astype(np.float64)[:, None, :]
    s = sin[positions].astype(np.float64)[:, None, :]
    if interleaved:
        a, b = out[..., 0 : 2 * half : 2].copy(), out[..., 1 : 2 * half : 2].copy()
        out[..., 0 : 2 * half : 2], out[..., 1 : 2 * half : 2] = a * c - b * s, b * c + a * s
    else:
        a, b = out[..., :half].copy(), out[..., half : 2 * half].copy()
        out[..., :half], out[..., half : 2 * half] = a * c - b * s, b * c + a * s
    return out


def gguf_permute(x: np.ndarray) -> np.ndarray:
    """llama's GGUF q/k row permutation applied to head vectors: dims (i, i + d/2) -> (2i, 2i+1)."""
    t, h, d = x.shape
    return np.ascontiguousarray(x.reshape(t, h, 2, d // 2).swapaxes(2, 3).reshape(t, h, d))


@pytest.mark.parametrize("shape", SHAPES)
def test_rmsnorm_heads_matches_reference(shape: tuple[int, int, int]) -> None:
    rng = np.random.default_rng(sum(shape))
    x = f32(rng.standard_normal(shape) * 3)
    w = f32(rng.standard_normal(shape[2]))
    expected = rmsnorm_reference(x, w, 1e-6)
    ops.rmsnorm_heads(x, w, 1e-6)
    np.testing.assert_allclose(x, expected, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_gated_rmsnorm_matches_reference(shape: tuple[int, int, int]) -> None:
    rng = np.random.default_rng(100 + sum(shape))
    x, z = f32(rng.standard_normal(shape) * 2), f32(rng.standard_normal(shape) * 4)
    w = f32(rng.standard_normal(shape[2]))
    out = np.empty_like(x)
    ops.gated_rmsnorm(x, z, w, 1e-6, out)
    expected = rmsnorm_reference(x, w, 1e-6) * z * sigmoid_reference(z)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("m,n", [(1, 7), (3, 64), (17, 1000), (70, 24)])
def test_silu_mul_matches_reference_and_may_write_into_gate(m: int, n: int) -> None:
    rng = np.random.default_rng(m * 31 + n)
    gate, up = f32(rng.standard_normal((m, n)) * 6), f32(rng.standard_normal((m, n)))
    out = np.empty_like(gate)
    ops.silu_mul(gate, up, out)
    expected = gate * sigmoid_reference(gate) * up
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-7)
    ops.silu_mul(gate, up, gate)
    assert np.array_equal(gate, out)


def gelu_tanh_reference(x: np.ndarray) -> np.ndarray:
    """0.5 x (1 + tanh(u)) as x * sigmoid(2u), which float64 keeps accurate where 1 + tanh(u) would cancel."""
    x64 = x.astype(np.float64)
    return x64 * sigmoid_reference(2.0 * math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * x64**3))


@pytest.mark.parametrize("m,n", [(1, 7), (3, 64), (17, 1000), (70, 24)])
def test_gelu_tanh_mul_matches_reference_and_may_write_into_gate(m: int, n: int) -> None:
    rng = np.random.default_rng(m * 37 + n)
    gate, up = f32(rng.standard_normal((m, n)) * 4), f32(rng.standard_normal((m, n)))
    out = np.empty_like(gate)
    ops.gelu_tanh_mul(gate, up, out)
    np.testing.assert_allclose(out, gelu_tanh_reference(gate) * up, rtol=2e-6, atol=1e-7)
    ops.gelu_tanh_mul(gate, up, gate)
    assert np.array_equal(gate, out)


def test_gelu_tanh_is_accurate_across_the_float_range() -> None:
    gate = f32(np.concatenate([np.linspace(-30, 30, 20001), [-1e4, -200, -20, 0, 20, 200, 1e4, np.inf, -np.inf]]))
    out = np.empty((1, gate.size), dtype=np.float32)
    ops.gelu_tanh_mul(gate[None, :], np.ones((1, gate.size), dtype=np.float32), out)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = gelu_tanh_reference(gate)
    # Where exp(-2u) is huge the rounding of u in float32 shows: about |2u| * 2^-24 relative.
    np.testing.assert_allclose(out[0, :-9], expected[:-9], rtol=1e-5, atol=1e-30)
    assert np.array_equal(out[0, -9:-2], f32([-0.0, -0.0, -0.0, 0.0, 20.0, 200.0, 1e4]))


@pytest.mark.parametrize("m,n", [(1, 5), (3, 64), (17, 1000)])
def test_sigmoid_mul_matches_reference(m: int, n: int) -> None:
    rng = np.random.default_rng(m * 7 + n)
    x, gate = f32(rng.standard_normal((m, n))), f32(rng.standard_normal((m, n)) * 8)
    expected = x * sigmoid_reference(gate)
    ops.sigmoid_mul(x, gate)
    np.testing.assert_allclose(x, expected, rtol=1e-6, atol=1e-7)


def test_sigmoid_is_accurate_across_the_float_range() -> None:
    # One row of 8-wide blocks plus a tail, so both the vector and scalar exp are covered.
    gate = f32(np.concatenate([np.linspace(-87, 88, 20001), [-1e4, -200, -104, 0, 104, 200, 1e4, np.inf, -np.inf]]))
    x = np.ones((1, gate.size), dtype=np.float32)
    ops.sigmoid_mul(x, gate[None, :])
    expected = sigmoid_reference(gate)
    np.testing.assert_allclose(x[0], expected, rtol=1e-6, atol=1e-37)
    tail = x[0, -9:]
    assert np.array_equal(tail, np.array([0, 0, 0, 0.5, 1, 1, 1, 1, 0], dtype=np.float32))


def test_silu_saturates_exactly() -> None:
    gate = f32([[30.0, 100.0, 1e4, -200.0, -1e4, 0.0, 88.0, -88.0, 3.0]])
    out = np.empty_like(gate)
    ops.silu_mul(gate, np.ones_like(gate), out)
    assert np.array_equal(out[0, :6], f32([30.0, 100.0, 1e4, -0.0, -0.0, 0.0]))
    np.testing.assert_allclose(out[0, 6:], gate[0, 6:] * sigmoid_reference(gate[0, 6:]), rtol=1e-6, atol=1e-37)


def test_row_kernels_are_batch_invariant() -> None:
    rng = np.random.default_rng(5)
    x, z = f32(rng.standard_normal((40, 4, 24))), f32(rng.standard_normal((40, 4, 24)))
    w = f32(rng.standard_normal(24))
    whole = np.empty_like(x)
    ops.gated_rmsnorm(x, z, w, 1e-6, whole)
    gate, up = x.reshape(40, 96), z.reshape(40, 96)
    whole_silu = np.empty_like(gate)
    ops.silu_mul(gate, up, whole_silu)
    for rows in (slice(0, 1), slice(7, 8), slice(3, 29)):
        part = np.empty_like(x[rows])
        ops.gated_rmsnorm(f32(x[rows]), f32(z[rows]), w, 1e-6, part)
        assert np.array_equal(part, whole[rows])
        part_silu = np.empty_like(gate[rows])
        ops.silu_mul(f32(gate[rows]), f32(up[rows]), part_silu)
        assert np.array_equal(part_silu, whole_silu[rows])


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(
    "shape,rotary_dim", [((1, 4, 32), 32), ((3, 9, 64), 64), ((17, 2, 24), 24), ((70, 3, 64), 16), ((5, 2, 24), 8)]
)
def test_rope_matches_reference(shape: tuple[int, int, int], rotary_dim: int, interleaved: bool) -> None:
    rng = np.random.default_rng(sum(shape) + rotary_dim)
    cos, sin = ops.rope_tables(10000.0, rotary_dim, 4096)
    x = f32(rng.standard_normal(shape))
    positions = rng.integers(0, 4096, size=shape[0]).astype(np.int32)
    expected = rope_reference(x, positions, cos, sin, interleaved)
    ops.rope(x, positions, cos, sin, interleaved)
    np.testing.assert_allclose(x, expected, rtol=1e-5, atol=1e-6)
    assert np.array_equal(x[..., rotary_dim:], expected[..., rotary_dim:].astype(np.float32))


def test_interleaved_rope_on_gguf_permuted_heads_equals_permuted_split_rope() -> None:
    rng = np.random.default_rng(11)
    cos, sin = ops.rope_tables(500000.0, 64, 512)
    x = f32(rng.standard_normal((17, 9, 64)))
    positions = np.arange(100, 117, dtype=np.int32)
    interleaved = gguf_permute(x)
    ops.rope(interleaved, positions, cos, sin, True)
    ops.rope(x, positions, cos, sin, False)
    assert np.array_equal(interleaved, gguf_permute(x))


def test_rope_tables_follow_hf_float32_recipe() -> None:
    cos, sin = ops.rope_tables(1e6, 64, 70000)
    assert cos.shape == sin.shape == (70000, 32) and cos.dtype == sin.dtype == np.float32
    assert np.array_equal(cos[0], np.ones(32, np.float32)) and np.array_equal(sin[0], np.zeros(32, np.float32))
    # HF: inv_freq = 1 / theta ** (arange(0, R, 2).float() / R), angles = pos.float() * inv_freq, all float32.
    # Like rope_tables, the reference takes pow, cos and sin in float64 from the C library (math), not from
    # numpy, whose float32 pow and vectorised float64 cos/sin differ in the last bit between CPUs; float32
    # division and products are correctly rounded IEEE operations everywhere.
    exponents = np.arange(0, 64, 2).astype(np.float32) / np.float32(64)
    inv_freq = np.float32(1) / np.array([math.pow(1e6, float(e)) for e in exponents]).astype(np.float32)
    angles = np.arange(70000, dtype=np.float32)[:, None] * inv_freq
    flat = angles.astype(np.float64).ravel().tolist()

    def libm(function: Callable[[float], float]) -> np.ndarray:
        return np.fromiter(map(function, flat), np.float64, len(flat)).astype(np.float32).reshape(angles.shape)

    assert np.array_equal(cos, libm(math.cos)) and np.array_equal(sin, libm(math.sin))
    # numpy's cos and sin may differ from the C library in the last float64 bit, so by at most 1 float32 ulp.
    np.testing.assert_array_max_ulp(cos, np.cos(angles.astype(np.float64)).astype(np.float32), maxulp=1)
    np.testing.assert_array_max_ulp(sin, np.sin(angles.astype(np.float64)).astype(np.float32), maxulp=1)
    # At large positions the float32 angle is far from the exact one: the rounding is HF's, on purpose.
    exact = np.cos(np.arange(70000)[:, None] * (1.0 / np.power(1e6, np.arange(0, 64, 2) / 64)))
    assert np.abs(cos[-1000:, 1] - exact[-1000:, 1]).max() > 1e-3


def test_rope_rejects_bad_positions_and_shapes() -> None:
    cos, sin = ops.rope_tables(10000.0, 16, 8)
    x = np.zeros((2, 3, 16), dtype=np.float32)
    for bad in ([0, 8], [-1, 0]):
        with pytest.raises(ValueError, match="outside the RoPE table"):
            ops.rope(x, np.array(bad, dtype=np.int32), cos, sin, False)
    with pytest.raises(ValueError, match="3 positions for 2 tokens"):
        ops.rope(x, np.zeros(3, dtype=np.int32), cos, sin, False)
    with pytest.raises(ValueError, match="rotary dim 32 exceeds head dim 16"):
        ops.rope(x, np.zeros(2, dtype=np.int32), *ops.rope_tables(10000.0, 32, 8), False)
    with pytest.raises(ValueError, match="same shape"):
        ops.rope(x, np.zeros(2, dtype=np.int32), cos, sin[:, :4].copy(), False)
    with pytest.raises(ValueError, match="positive even"):
        ops.rope_tables(10000.0, 7, 8)


def test_kernels_reject_mismatched_shapes() -> None:
    a = np.zeros((2, 3, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="weight has 4 elements"):
        ops.rmsnorm_heads(a, np.ones(4, dtype=np.float32), 1e-6)
    with pytest.raises(ValueError, match="same shape"):
        ops.gated_rmsnorm(a, np.zeros((2, 3, 9), dtype=np.float32), np.ones(8, np.float32), 1e-6, a.copy())
    with pytest.raises(ValueError, match="weight has 9 elements"):
        ops.gated_rmsnorm(a, a, np.ones(9, np.float32), 1e-6, a.copy())
    m = np.zeros((2, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="same shape"):
        ops.silu_mul(m, np.zeros((2, 7), dtype=np.float32), m)
    with pytest.raises(ValueError, match="same shape"):
        ops.sigmoid_mul(m, np.zeros((3, 8), dtype=np.float32))
