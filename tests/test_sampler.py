"""Sampling: exact penalty arithmetic, truncation that never lets an excluded token through, seeded draws."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from basert.engine.sampler import Sampler, SamplingError, SamplingParams, TokenLogprob, greedy_token

# 99.9% quantiles of the chi-square distribution, by degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 5: 20.52}
SEQUENCE_SCRIPT = """
import numpy as np
from basert.engine.sampler import Sampler, SamplingParams
rows = np.random.default_rng(7).normal(0.0, 1.0, (50, 100)).astype(np.float32)
sampler = Sampler(SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed={seed}), 100)
print(" ".join(str(sampler.sample(row, [])[0]) for row in rows))
"""


def row(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def draw(params: SamplingParams, logits: np.ndarray, n: int) -> np.ndarray:
    sampler = Sampler(params, len(logits))
    return np.array([sampler.sample(logits, [])[0] for _ in range(n)])


def chi_square(draws: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's statistic of the draws against probs, over the tokens whose probability is not 0."""
    counts = np.bincount(draws, minlength=len(probs))
    support = probs > 0
    expected = probs[support] * len(draws)
    return float(((counts[support] - expected) ** 2 / expected).sum())


def renormalised(logits: np.ndarray, temperature: float, kept: list[int]) -> np.ndarray:
    probs = np.zeros(len(logits))
    probs[kept] = softmax64(logits, temperature)[kept]
    return probs / probs.sum()


def softmax64(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    x = logits.astype(np.float64) / temperature
    e = np.exp(x - x.max())
    return e / e.sum()


def sequence(seed: int | None, rows: np.ndarray) -> list[int]:
    sampler = Sampler(SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=seed), rows.shape[1])
    return [sampler.sample(r, [])[0] for r in rows]


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    logits = row(0.5, 2.0, -1.0, 2.0, 1.9)
    assert greedy_token(logits) == 1
    assert Sampler(SamplingParams(temperature=0), 5).sample(logits, []) == (1, None)
    assert Sampler(SamplingParams(temperature=0), 4).sample(row(3.0, 3.0, 3.0, 3.0), []) == (0, None)


def test_logit_bias_forces_a_token() -> None:
    logits = np.random.default_rng(1).normal(0.0, 1.0, 50).astype(np.float32)
    assert greedy_token(logits) != 37
    assert Sampler(SamplingParams(temperature=0, logit_bias={37: 100.0}), 50).sample(logits, [])[0] == 37
    assert set(draw(SamplingParams(logit_bias={37: 100.0}, seed=2), logits, 300)) == {37}


def test_logit_bias_bans_a_token() -> None:
    logits = row(5.0, 0.0, 0.0, 0.0)
    banned = SamplingParams(logit_bias={0: -100.0}, seed=3)
    assert Sampler(SamplingParams(temperature=0, logit_bias={0: -100.0}), 4).sample(logits, [])[0] == 1
    assert set(draw(banned, logits, 2000)) == {1, 2, 3}


@pytest.mark.parametrize(
    ("last_n", "expected"),
    [
        # Window [0, 1, 1, 2, 3]: token 4 is older, token 1 is penalised once though it repeats.
        (5, [1.5, -2.0, 0.25, 0.0, 2.0, -4.0]),
        (-1, [1.5, -2.0, 0.25, 0.0, 1.0, -4.0]),
        (0, [3.0, -1.0, 0.5, 0.0, 2.0, -4.0]),
    ],
)
def test_repeat_penalty_divides_positive_and_multiplies_negative_logits(last_n: int, expected: list[float]) -> None:
    sampler = Sampler(SamplingParams(repeat_penalty=2.0, repeat_last_n=last_n), 6)
    adjusted = sampler.adjust(row(3.0, -1.0, 0.5, 0.0, 2.0, -4.0), [4, 0, 1, 1, 2, 3])
    assert adjusted.tolist() == expected


def test_presence_and_frequency_penalties_subtract_per_count() -> None:
    sampler = Sampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), 6)
    adjusted = sampler.adjust(row(0.0, 0.0, 0.0, 0.0, 0.0, 1.0), [1, 1, 1, 2, 5])
    assert adjusted.tolist() == [0.0, -1.25, -0.75, 0.0, 0.0, 0.25]


@pytest.mark.parametrize("as_array", [False, True], ids=["list", "int32-array"])
def test_counts_span_the_whole_history_and_follow_the_repeat_penalty(as_array: bool) -> None:
    params = SamplingParams(repeat_penalty=2.0, repeat_last_n=4, presence_penalty=0.5, frequency_penalty=0.25)
    history = [5, 5, 5] + [0] * 10
    adjusted = Sampler(params, 6).adjust(
        row(2.0, 0.0, 0.0, 0.0, 0.0, 2.0), np.array(history, dtype=np.int32) if as_array else history
    )
    # Token 0: in the window, 2 / 2 = 1, then 1 - 0.5 - 10 * 0.25. Token 5: outside it, 2 - 0.5 - 3 * 0.25.
    assert adjusted.tolist() == [-2.0, 0.0, 0.0, 0.0, 0.0, 0.75]


def test_negative_presence_penalty_raises_seen_tokens() -> None:
    adjusted = Sampler(SamplingParams(presence_penalty=-1.5), 3).adjust(row(0.0, 0.0, 0.0), [2, 2])
    assert adjusted.tolist() == [0.0, 0.0, 1.5]


@pytest.mark.parametrize("temperature", [0.05, 1.0, 7.0, 1000.0])
def test_top_k_1_is_greedy_at_any_temperature(temperature: float) -> None:
    rng = np.random.default_rng(4)
    sampler = Sampler(SamplingParams(temperature=temperature, top_k=1, seed=5), 300)
    for _ in range(30):
        logits = rng.normal(0.0, 1.0, 300).astype(np.float32)
        logits[[200, 17]] = logits.max() + 1.0
        assert sampler.sample(logits, [])[0] == greedy_token(logits) == 17


def test_tiny_top_p_keeps_only_the_best_token() -> None:
    logits = np.random.default_rng(6).normal(0.0, 0.1, 1000).astype(np.float32)
    logits[[900, 3]] = logits.max() + 0.05
    assert set(draw(SamplingParams(top_p=1e-9, seed=7), logits, 500)) == {3}


@pytest.mark.parametrize(
    ("temperature", "kept"),
    [
        # T=1: cumulative 0.5, 0.8 reaches 0.75 at the second best token.
        (1.0, [1, 3]),
        # T=2 flattens to 0.379, 0.294, 0.207, 0.120: cumulative 0.673 < 0.75 needs a third token.
        (2.0, [1, 3, 0]),
    ],
)
def test_top_p_keeps_the_shortest_prefix_reaching_p_after_temperature(temperature: float, kept: list[int]) -> None:
    probs = np.array([0.15, 0.5, 0.05, 0.3])
    logits = np.log(probs).astype(np.float32)
    draws = draw(SamplingParams(temperature=temperature, top_p=0.75, seed=8), logits, 20000)
    assert set(draws) == set(kept)
    assert chi_square(draws, renormalised(logits, temperature, kept)) < CHI2_999[len(kept) - 1]


def reference_nucleus(logits: np.ndarray, top_p: float) -> tuple[np.ndarray, float]:
    """Nucleus by a full float64 sort, and the distance of its cut from top_p."""
    probs = softmax64(logits)
    order = np.argsort(-logits, kind="stable")
    cumulative = np.cumsum(probs[order])
    n = int(np.searchsorted(cumulative, top_p)) + 1
    return order[:n], min(abs(cumulative[n - 1] - top_p), abs(cumulative[n - 2] - top_p))


@pytest.mark.parametrize(
    "logits",
    [
        # Peaked: the nucleus lies within the first probe of the best tokens.
        np.random.default_rng(9).normal(0.0, 3.0, 4096).astype(np.float32),
        # Slowly decaying: the nucleus holds ~1200 tokens, more than the first probe.
        (-4e-4 * np.arange(2500)).astype(np.float32),
    ],
    ids=["peaked", "flat"],
)
def test_top_p_on_a_large_vocabulary_matches_a_full_sort(logits: np.ndarray) -> None:
    nucleus, margin = reference_nucleus(logits, 0.6)
    assert margin > 1e-5  # float32 weights cannot move the cut
    # Enough draws that the least likely token of the nucleus is expected about 8 times or more.
    n = math.ceil(8 / softmax64(logits)[nucleus[-1]])
    draws = draw(SamplingParams(top_p=0.6, seed=10), logits, n)
    assert set(draws) <= set(nucleus.tolist())
    # The least likely token of the nucleus is drawn, so the cut is not one token short.
    assert nucleus[-1] in draws


@pytest.mark.parametrize(
    ("temperature", "kept"),
    [
        # Threshold 0.2 * 0.4 = 0.08: 0.081 stays, 0.079 goes.
        (1.0, [0, 1, 2, 3]),
        # Square roots: threshold 0.2 * 0.632 = 0.126 is below sqrt(0.07) = 0.265.
        (2.0, [0, 1, 2, 3, 4, 5]),
        # Squares: threshold 0.2 * 0.16 = 0.032 keeps 0.0625 and drops 0.0144.
        (0.5, [0, 1]),
    ],
)
def test_min_p_drops_exactly_the_tokens_below_min_p_times_the_best(temperature: float, kept: list[int]) -> None:
    logits = np.log([0.40, 0.25, 0.12, 0.081, 0.079, 0.07]).astype(np.float32)
    draws = draw(SamplingParams(temperature=temperature, min_p=0.2, seed=11), logits, 20000)
    assert sorted(set(draws.tolist())) == kept
    assert chi_square(draws, renormalised(logits, temperature, kept)) < CHI2_999[len(kept) - 1]


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_the_distribution(temperature: float) -> None:
    logits = row(0.0, 1.0, 2.0, 3.0)
    draws = draw(SamplingParams(temperature=temperature, seed=12), logits, 20000)
    assert chi_square(draws, softmax64(logits, temperature)) < CHI2_999[3]
    # The same draws are far from the untempered distribution, so the bound above can fail.
    assert chi_square(draws, softmax64(logits)) > 200


def test_same_seed_same_tokens_other_seed_other_tokens() -> None:
    rows = np.random.default_rng(7).normal(0.0, 1.0, (50, 100)).astype(np.float32)
    first = sequence(1234, rows)
    assert sequence(1234, rows) == first
    assert sequence(1235, rows) != first
    assert sequence(None, rows) != sequence(None, rows)


def test_seeded_tokens_are_the_same_in_another_process() -> None:
    rows = np.random.default_rng(7).normal(0.0, 1.0, (50, 100)).astype(np.float32)
    result = subprocess.run(
        [sys.executable, "-c", SEQUENCE_SCRIPT.format(seed=99)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[1],
    )
    assert [int(t) for t in result.stdout.split()] == sequence(99, rows)


def test_logprobs_are_the_log_softmax_after_bias_and_penalties() -> None:
    rng = np.random.default_rng(13)
    params = SamplingParams(
        temperature=0.7,
        top_k=3,
        logit_bias={5: 3.0},
        presence_penalty=0.5,
        logprobs=True,
        top_logprobs=5,
        seed=14,
    )
    sampler = Sampler(params, 64)
    for _ in range(20):
        logits = rng.normal(0.0, 2.0, 64).astype(np.float32)
        logits[[40, 9]] = np.sort(logits)[-3]  # a tie inside the top five
        token, logprob = sampler.sample(logits, [1, 2, 2])
        adjusted = logits.copy()
        adjusted[5] += np.float32(3.0)
        adjusted[[1, 2]] -= np.float32(0.5)
        x = adjusted.astype(np.float64)
        reference = x - x.max() - math.log(np.exp(x - x.max()).sum())
        best = np.lexsort((np.arange(64), -reference))[:5]
        assert isinstance(logprob, TokenLogprob)
        assert logprob.token_id == token
        assert logprob.logprob == pytest.approx(reference[token], abs=1e-12)
        assert [i for i, _ in logprob.top] == best.tolist()
        assert [v for _, v in logprob.top] == pytest.approx(reference[best].tolist(), abs=1e-12)
        assert [v for _, v in logprob.top] == sorted((v for _, v in logprob.top), reverse=True)
        assert token in best[:3].tolist()


def test_greedy_logprobs_without_alternatives() -> None:
    logits = row(1.0, 3.0, 2.0)
    token, logprob = Sampler(SamplingParams(temperature=0, logprobs=True), 3).sample(logits, [])
    assert token == 1
    assert logprob is not None and logprob.token_id == 1 and logprob.top == []
    assert logprob.logprob == pytest.approx(3.0 - math.log(math.exp(1.0) + math.exp(3.0) + math.exp(2.0)), abs=1e-12)
    assert Sampler(SamplingParams(temperature=0), 3).sample(logits, [])[1] is None


def test_the_callers_logits_are_never_modified() -> None:
    logits = np.random.default_rng(15).normal(0.0, 1.0, 200).astype(np.float32)
    original = logits.copy()
    params = SamplingParams(
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        min_p=0.05,
        repeat_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.2,
        logit_bias={3: 2.0, 7: -5.0},
        logprobs=True,
        top_logprobs=4,
        seed=16,
    )
    sampler = Sampler(params, 200)
    first = sampler.adjust(logits, [3, 3, 8]).copy()
    for _ in range(10):
        sampler.sample(logits, [3, 3, 8])
    assert np.array_equal(logits, original)
    # The reused buffer starts from the caller's row each time: bias and penalties never accumulate.
    assert np.array_equal(sampler.adjust(logits, [3, 3, 8]), first)
    assert first[7] == original[7] - 5.0


def test_a_row_of_the_wrong_width_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"shape \(10,\)"):
        Sampler(SamplingParams(), 10).sample(np.zeros(11, np.float32), [])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repeat_penalty", 0.0),
        ("repeat_penalty", -1.0),
        ("repeat_last_n", -2),
        ("presence_penalty", math.inf),
        ("frequency_penalty", math.nan),
        ("logit_bias", {100: 1.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {4: math.nan}),
        ("seed", -1),
        ("top_logprobs", 21),
        ("top_logprobs", -1),
    ],
)
def test_each_invalid_field_is_named(field: str, value: object) -> None:
    kwargs = {field: value, "logprobs": True} if field == "top_logprobs" else {field: value}
    params = SamplingParams(**kwargs)
    with pytest.raises(SamplingError, match=f"^{field} must be"):
        params.validate(100)
    with pytest.raises(SamplingError, match=f"^{field} must be"):
        Sampler(params, 100)


def test_top_logprobs_needs_logprobs() -> None:
    with pytest.raises(SamplingError, match="^top_logprobs must be 0 unless logprobs"):
        SamplingParams(top_logprobs=3).validate(100)
    SamplingParams(logprobs=True, top_logprobs=20).validate(100)


def test_logit_bias_keys_must_be_integers() -> None:
    with pytest.raises(SamplingError, match="^logit_bias must map integer token ids"):
        SamplingParams(logit_bias={"5": 1.0})
    assert issubclass(SamplingError, ValueError)


def test_params_are_hashable_and_normalise_logit_bias() -> None:
    params = SamplingParams(logit_bias={7: 1, 3: -2.5})
    assert params.logit_bias == ((3, -2.5), (7, 1.0))
    assert params == SamplingParams(logit_bias=((3, -2.5), (7, 1.0)))
    assert hash(params) == hash(SamplingParams(logit_bias={3: -2.5, 7: 1.0}))
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.01).greedy
