"""RMSNorm kernel against its numpy reference, and batch invariance of its rows."""

from __future__ import annotations

import numpy as np
import pytest

from basert._ext import norm


def rmsnorm_reference(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    inv = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return (x64 * inv * weight.astype(np.float64)).astype(np.float32)


@pytest.mark.parametrize("m,k", [(1, 1), (1, 7), (3, 64), (5, 576), (17, 1000), (2, 4099)])
def test_rmsnorm_matches_reference(m: int, k: int) -> None:
    rng = np.random.default_rng(m * 10007 + k)
    x = rng.standard_normal((m, k), dtype=np.float32) * 3
    weight = rng.standard_normal(k, dtype=np.float32)
    got = norm.rmsnorm(x, weight, 1e-5)
    np.testing.assert_allclose(got, rmsnorm_reference(x, weight, 1e-5), rtol=2e-6, atol=2e-6)


def test_rmsnorm_rows_are_batch_invariant() -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((64, 576), dtype=np.float32)
    weight = rng.standard_normal(576, dtype=np.float32)
    whole = norm.rmsnorm(x, weight, 1e-6)
    for rows in (slice(0, 1), slice(5, 13), slice(31, 64)):
        part = norm.rmsnorm(np.ascontiguousarray(x[rows]), weight, 1e-6)
        assert np.array_equal(part, whole[rows])


def test_rmsnorm_writes_into_out_and_checks_shapes() -> None:
    x = np.ones((2, 8), dtype=np.float32)
    out = np.zeros((2, 8), dtype=np.float32)
    result = norm.rmsnorm(x, np.full(8, 2.0, dtype=np.float32), 0.0, out)
    assert np.shares_memory(result, out)
    assert np.array_equal(out, np.full((2, 8), 2.0, dtype=np.float32))
    with pytest.raises(ValueError, match="weight has 4 elements"):
        norm.rmsnorm(x, np.ones(4, dtype=np.float32), 1e-5)
