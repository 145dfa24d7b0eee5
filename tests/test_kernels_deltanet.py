"""Gated DeltaNet kernels (basert._ext.deltanet) against float64 numpy references of hybrid-math
section 4, and bit-identical outputs and states however a sequence is split into calls."""

from __future__ import annotations

import numpy as np
import pytest

from basert._ext import deltanet as gdn

# The tiny hybrid models' linear attention: n_k=2, n_v=4, d_k=16, d_v=24, conv kernel 4.
TINY = dict(n_k=2, n_v=4, d_k=16, d_v=24)
LARGER = dict(n_k=3, n_v=9, d_k=64, d_v=40)


def f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def conv_reference(x: np.ndarray, state: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(out [T, C], new state [C, K-1]) of the causal depthwise conv continuing from state."""
    K = weight.shape[1]
    ext = np.concatenate([state.T, x]).astype(np.float64)
    T = x.shape[0]
    acc = sum(weight[:, j].astype(np.float64) * ext[j : j + T] for j in range(K))
    return silu(acc), ext[ext.shape[0] - (K - 1) :].T


def gates_reference(
    a: np.ndarray, b: np.ndarray, A_log: np.ndarray, dt_bias: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    x = a.astype(np.float64) + dt_bias
    softplus = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))
    return -np.exp(A_log.astype(np.float64)) * softplus, 1.0 / (1.0 + np.exp(-b.astype(np.float64)))


def recurrent_reference(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Section 4.5-4.6 token by token in float64; returns (out [T, n_v, d_v], final state)."""
    T, n_k, d_k = q.shape
    n_v = v.shape[1]
    S = state.astype(np.float64).copy()
    out = np.empty((T, n_v, v.shape[2]))
    q64, k64 = q.astype(np.float64), k.astype(np.float64)
    q_hat = q64 / np.sqrt((q64 * q64).sum(-1, keepdims=True) + 1e-6) * d_k**-0.5
    k_hat = k64 / np.sqrt((k64 * k64).sum(-1, keepdims=True) + 1e-6)
    for t in range(T):
        for h in range(n_v):
            kh = h // (n_v // n_k)
            S[h] *= np.exp(np.float64(g[t, h]))
            m = S[h].T @ k_hat[t, kh]
            delta = beta[t, h] * (v[t, h] - m)
            S[h] += np.outer(k_hat[t, kh], delta)
            out[t, h] = S[h].T @ q_hat[t, kh]
    return out, S


def random_sequence(rng: np.random.Generator, T: int, n_k: int, n_v: int, d_k: int, d_v: int) -> dict[str, np.ndarray]:
    a, b = f32(rng.standard_normal((T, n_v))), f32(rng.standard_normal((T, n_v)))
    g, beta = gates_reference(a, b, f32(rng.standard_normal(n_v) - 2), f32(rng.standard_normal(n_v)))
    return dict(
        q=f32(rng.standard_normal((T, n_k, d_k))),
        k=f32(rng.standard_normal((T, n_k, d_k))),
        v=f32(rng.standard_normal((T, n_v, d_v))),
        g=f32(g),
        beta=f32(beta),
    )


def run_recurrent(seq: dict[str, np.ndarray], state: np.ndarray, chunks: list[int]) -> tuple[np.ndarray, np.ndarray]:
    state = state.copy()
    outs, pos = [], 0
    for n in chunks:
        part = {name: f32(a[pos : pos + n]) for name, a in seq.items()}
        out = np.empty((n, *seq["v"].shape[1:]), dtype=np.float32)
        gdn.gdn_recurrent(part["q"], part["k"], part["v"], part["g"], part["beta"], state, out)
        outs.append(out)
        pos += n
    return np.concatenate(outs), state


def run_conv(x: np.ndarray, state: np.ndarray, weight: np.ndarray, chunks: list[int]) -> tuple[np.ndarray, np.ndarray]:
    state = state.copy()
    outs, pos = [], 0
    for n in chunks:
        out = np.empty((n, x.shape[1]), dtype=np.float32)
        gdn.gdn_conv(f32(x[pos : pos + n]), state, weight, out)
        outs.append(out)
        pos += n
    return np.concatenate(outs), state


@pytest.mark.parametrize("fresh", [True, False])
@pytest.mark.parametrize("T", [1, 2, 3, 17, 70])
def test_conv_matches_reference_and_keeps_the_last_inputs(T: int, fresh: bool) -> None:
    rng = np.random.default_rng(T + 100 * fresh)
    C, K = 160, 4
    x = f32(rng.standard_normal((T, C)) * 2)
    weight = f32(rng.standard_normal((C, K)))
    state = np.zeros((C, K - 1), np.float32) if fresh else f32(rng.standard_normal((C, K - 1)))
    expected_out, expected_state = conv_reference(x, state, weight)
    out = np.empty_like(x)
    gdn.gdn_conv(x, state, weight, out)
    np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=1e-6)
    # The state holds inputs, copied exactly; with T < K-1 part of it is the old state shifted left.
    assert np.array_equal(state, expected_state.astype(np.float32))


def test_conv_split_is_bit_identical() -> None:
    rng = np.random.default_rng(1)
    C, K = 160, 4
    x = f32(rng.standard_normal((7, C)))
    weight = f32(rng.standard_normal((C, K)))
    start = f32(rng.standard_normal((C, K - 1)))
    whole_out, whole_state = run_conv(x, start, weight, [7])
    for chunks in ([3, 4], [1] * 7, [2, 1, 4]):
        out, state = run_conv(x, start, weight, chunks)
        assert np.array_equal(out, whole_out) and np.array_equal(state, whole_state)


def test_conv_with_a_single_tap_has_no_state() -> None:
    x = f32([[1.0, -2.0], [3.0, 0.5]])
    out = np.empty_like(x)
    gdn.gdn_conv(x, np.zeros((2, 0), np.float32), f32([[2.0], [1.0]]), out)
    np.testing.assert_allclose(out, silu(np.array([[2.0, -2.0], [6.0, 0.5]])), rtol=1e-6)


def test_gates_match_reference() -> None:
    rng = np.random.default_rng(2)
    T, n_v = 17, 9
    a = f32(rng.standard_normal((T, n_v)) * 10)
    a[0, :3] = [25.0, 19.9, -40.0]  # both sides of torch's softplus threshold, and a vanishing one
    b = f32(rng.standard_normal((T, n_v)) * 5)
    A_log, dt_bias = f32(rng.standard_normal(n_v)), f32(rng.standard_normal(n_v))
    dt_bias[:3] = 0
    g, beta = np.empty_like(a), np.empty_like(a)
    gdn.gdn_gates(a, b, A_log, dt_bias, g, beta)
    expected_g, expected_beta = gates_reference(a, b, A_log, dt_bias)
    np.testing.assert_allclose(g, expected_g, rtol=2e-6, atol=1e-30)
    np.testing.assert_allclose(beta, expected_beta, rtol=1e-6, atol=1e-30)
    assert (g <= 0).all() and g[0, 0] == -np.exp(A_log[0]) * np.float32(25.0)


@pytest.mark.parametrize("dims", [TINY, LARGER], ids=["tiny", "larger"])
@pytest.mark.parametrize("T", [1, 3, 17, 70])
def test_recurrent_matches_reference(T: int, dims: dict[str, int]) -> None:
    rng = np.random.default_rng(T * 7 + dims["d_k"])
    seq = random_sequence(rng, T, **dims)
    state = f32(rng.standard_normal((dims["n_v"], dims["d_k"], dims["d_v"])) * 0.3)
    expected_out, expected_state = recurrent_reference(**seq, state=state)
    out = np.empty((T, dims["n_v"], dims["d_v"]), np.float32)
    gdn.gdn_recurrent(seq["q"], seq["k"], seq["v"], seq["g"], seq["beta"], state, out)
    np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(state, expected_state, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("dims", [TINY, LARGER], ids=["tiny", "larger"])
def test_recurrent_split_is_bit_identical(dims: dict[str, int]) -> None:
    rng = np.random.default_rng(3)
    seq = random_sequence(rng, 7, **dims)
    start = np.zeros((dims["n_v"], dims["d_k"], dims["d_v"]), np.float32)
    whole_out, whole_state = run_recurrent(seq, start, [7])
    assert whole_state.any()
    for chunks in ([3, 4], [1] * 7):
        out, state = run_recurrent(seq, start, chunks)
        assert np.array_equal(out, whole_out) and np.array_equal(state, whole_state)


def test_value_heads_share_consecutive_key_heads() -> None:
    # With identical v and gates, value heads 0 and 1 (key head 0) agree, and differ from head 2 (key head 1).
    rng = np.random.default_rng(4)
    seq = random_sequence(rng, 3, **TINY)
    seq["v"][:] = seq["v"][:, :1]
    seq["g"][:] = seq["g"][:, :1]
    seq["beta"][:] = seq["beta"][:, :1]
    out, _ = run_recurrent(seq, np.zeros((4, 16, 24), np.float32), [3])
    assert np.array_equal(out[:, 0], out[:, 1]) and np.array_equal(out[:, 2], out[:, 3])
    assert not np.array_equal(out[:, 1], out[:, 2])


def test_kernels_reject_mismatched_shapes() -> None:
    x, out = np.zeros((3, 8), np.float32), np.zeros((3, 8), np.float32)
    with pytest.raises(ValueError, match="conv_state has shape"):
        gdn.gdn_conv(x, np.zeros((8, 2), np.float32), np.zeros((8, 4), np.float32), out)
    with pytest.raises(ValueError, match="weight has shape"):
        gdn.gdn_conv(x, np.zeros((8, 3), np.float32), np.zeros((7, 4), np.float32), out)
    with pytest.raises(ValueError, match="out has shape"):
        gdn.gdn_conv(x, np.zeros((8, 3), np.float32), np.zeros((8, 4), np.float32), out[:2])
    g = np.zeros((3, 4), np.float32)
    with pytest.raises(ValueError, match="dt_bias has shape"):
        gdn.gdn_gates(g, g, np.zeros(4, np.float32), np.zeros(5, np.float32), g.copy(), g.copy())
    with pytest.raises(ValueError, match="beta has shape"):
        gdn.gdn_gates(g, g, np.zeros(4, np.float32), np.zeros(4, np.float32), g.copy(), g[:2].copy())
    seq = random_sequence(np.random.default_rng(0), 3, **TINY)
    state, out3 = np.zeros((4, 16, 24), np.float32), np.zeros((3, 4, 24), np.float32)
    args = [seq["q"], seq["k"], seq["v"], seq["g"], seq["beta"], state, out3]
    for index, bad, message in [
        (1, seq["k"][:, :1].copy(), "k has shape"),
        (2, np.zeros((3, 3, 24), np.float32), "3 value heads cannot share 2 key heads"),
        (3, seq["g"][:2].copy(), "g has shape"),
        (5, np.zeros((4, 16, 23), np.float32), "state has shape"),
        (6, np.zeros((3, 4, 16), np.float32), "out has shape"),
    ]:
        with pytest.raises(ValueError, match=message):
            gdn.gdn_recurrent(*args[:index], bad, *args[index + 1 :])
