"""Engine slots with a shared KV pool, the prefix cache and continuous batching, on real models (no HTTP).

Every request's greedy tokens must equal its tokens on a fresh engine, whatever ran before or beside it,
whether its prefix came from the cache, and whether it was preempted for lack of blocks.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from basert.engine import EngineOptions, build_engine
from basert.engine.engine import Engine
from basert.engine.kv import BLOCK_SIZE
from basert.engine.sampler import SamplingParams
from basert.engine.types import FailEvent, FinishEvent, GenerationRequest, StepPlan, TokenEvent

MAX_TOKENS = 6


def make_engine(path: Path, *, slots: int = 1, cache: bool = False, kv_tokens: int | None = None) -> Engine:
    return build_engine(path, EngineOptions(max_context=512, n_slots=slots, continuous_batching=True,
                                            kv_cache_tokens=kv_tokens, prefix_cache=cache))


def request(rid: str, prompt: list[int], segment_ends: tuple[int, ...] = ()) -> GenerationRequest:
    return GenerationRequest(rid, prompt, MAX_TOKENS, SamplingParams(temperature=0.0), ignore_eos=True,
                             segment_ends=segment_ends)


def run(engine: Engine, batches: list[list[GenerationRequest]],
        plans: list[StepPlan] | None = None) -> dict[str, tuple[list[int], int]]:
    """Each batch is admitted together (as slots free up); returns tokens and cached_tokens per request."""
    out: dict[str, tuple[list[int], int]] = {}
    tokens: dict[str, list[int]] = {}
    for batch in batches:
        for event in engine.generate(batch, plans):
            if isinstance(event, TokenEvent):
                tokens.setdefault(event.request_id, []).append(event.token_id)
            elif isinstance(event, FinishEvent):
                out[event.request_id] = (tokens.get(event.request_id, []), event.usage.cached_tokens)
            elif isinstance(event, FailEvent):
                raise event.error
    return out


def prompts(vocab: int, shared: int = 100, suffix: int = 9, n: int = 4) -> list[list[int]]:
    rng = np.random.default_rng(5)
    prefix = rng.integers(0, vocab, shared).tolist()
    return [prefix + rng.integers(0, vocab, suffix + i).tolist() for i in range(n)]


# Gemma 3 here is slow (a 262,144-token head): its fast isolation checks are in test_gemma3.py. These checks send
# and read token ids: Gemma is the copy stored without its tokenizer, which each engine would spend 3 s building.
@pytest.fixture(params=["smollm2", pytest.param("gemma3", marks=pytest.mark.slow), "qwen3_5-tiny"])
def model_path(request, smollm2_base: Path, tiny_f32_bases: dict[str, Path]) -> Path:
    if request.param == "gemma3":
        return request.getfixturevalue("gemma3_ids_base")
    return smollm2_base if request.param == "smollm2" else tiny_f32_bases[request.param]


@pytest.fixture(scope="module")
def fresh_answers() -> dict[tuple[str, tuple[int, ...]], list[int]]:
    """Tokens of prompts on a fresh engine, by (model, prompt): a fresh engine's answer to a prompt is the same
    whichever test asks, so the tests that send the same prompts share one fresh run of each."""
    return {}


@pytest.fixture
def fresh(model_path: Path, fresh_answers: dict):
    """Each prompt's tokens on a fresh engine."""

    def answer(prompt: list[int]) -> list[int]:
        key = (str(model_path), tuple(prompt))
        if key not in fresh_answers:
            engine = make_engine(model_path)
            fresh_answers[key] = run(engine, [[request("fresh", prompt)]])["fresh"][0]
            engine.close()
        return fresh_answers[key]
    return answer


def test_prefix_cache_hits_and_outputs_equal_fresh(model_path: Path, fresh):
    engine = make_engine(model_path, slots=1, cache=True)
    batch = prompts(engine.info.vocab_size)
    results = run(engine, [[request(f"r{i}", p, segment_ends=(100,))] for i, p in enumerate(batch)])
    for i, p in enumerate(batch):
        assert results[f"r{i}"][0] == fresh(p), f"request {i}"
    # The later requests reuse the shared 100 tokens from the slot's own history: a dense slot truncates it
    # mid-block, a hybrid resumes from the checkpoint it kept at the segment end.
    assert [results[f"r{i}"][1] for i in range(1, 4)] == [100] * 3
    stats = engine.prefix_cache.stats()
    assert stats["hit_tokens"] >= 3 * 96 and stats["blocks_cached"] > 0


def test_continuous_batching_with_prefix_cache_equals_fresh(model_path: Path, fresh):
    engine = make_engine(model_path, slots=4, cache=True)
    batch = prompts(engine.info.vocab_size)
    warm = run(engine, [[request("warm", batch[0], segment_ends=(100,))]])
    results = run(engine, [[request(f"r{i}", p, segment_ends=(100,)) for i, p in enumerate(batch)]])
    assert warm["warm"][0] == fresh(batch[0])
    for i, p in enumerate(batch):
        assert results[f"r{i}"][0] == fresh(p), f"request {i}"
    # The resent warm prompt lands on the warm slot (its own history: all but the last token); the three
    # others start from the cache, whose hits end on a block boundary (hybrid: on the snapshot stored there).
    assert sorted(cached for _, cached in results.values()) == [96, 96, 96, len(batch[0]) - 1]


def test_a_small_paged_pool_preempts_and_still_equals_fresh(model_path: Path, fresh):
    # 4 slots but blocks for about two prompts (7 blocks each, 8 with their tokens): requests wait, get preempted
    # and recompute. The prompts of the prefix-cache checks: their fresh answers are known.
    engine = make_engine(model_path, slots=4, kv_tokens=16 * BLOCK_SIZE)
    batch = prompts(engine.info.vocab_size)
    plans = []
    results = run(engine, [[request(f"r{i}", p) for i, p in enumerate(batch)]], plans)
    for i, p in enumerate(batch):
        assert results[f"r{i}"][0] == fresh(p), f"request {i}"
    assert any(plan.preempt for plan in plans)
    assert max(len(plan.chunks) for plan in plans) >= 2


def test_a_slot_never_writes_into_a_cached_block(model_path: Path, fresh):
    engine = make_engine(model_path, slots=1, cache=True)
    vocab = engine.info.vocab_size
    base = prompts(vocab, shared=40, suffix=0, n=1)[0]
    # Second prompt diverges in the middle of the second block: the slot's own history is cut mid-block.
    other = base[:20] + [(base[20] + 1) % vocab] + base[21:]
    results = run(engine, [[request("a", base)], [request("b", other)], [request("a2", base)]])
    assert results["a"][0] == fresh(base)
    assert results["b"][0] == fresh(other)
    assert results["a2"][0] == fresh(base)


def test_prompt_larger_than_the_pool_is_refused(model_path: Path):
    engine = make_engine(model_path, slots=1, kv_tokens=4 * BLOCK_SIZE)
    with pytest.raises(ValueError, match="KV cache"):
        engine.admit(request("big", list(range(5 * BLOCK_SIZE))), engine.slots[0])


def test_concurrent_requests_compute_a_common_prefix_once(model_path: Path, fresh):
    engine = make_engine(model_path, slots=4, cache=True)
    batch = prompts(engine.info.vocab_size)
    plans = []
    results = run(engine, [[request(f"r{i}", p, segment_ends=(100,)) for i, p in enumerate(batch)]], plans)
    for i, p in enumerate(batch):
        assert results[f"r{i}"][0] == fresh(p), f"request {i}"
    # Admitted together with an empty cache; the oldest prefills first and the others adopt its blocks.
    assert sorted(cached for _, cached in results.values()) == [0, 96, 96, 96]
    fed = sum(n for plan in plans for _, n in plan.chunks)
    assert fed == sum(len(p) for p in batch) - 3 * 96 + 4 * (MAX_TOKENS - 1)   # nothing computed twice


def test_a_prefill_stopped_by_its_deadline_leaves_the_slot_consistent(model_path: Path, fresh):
    # A budget of 64 tokens a step: the 109-token prompt (the first of the prefix-cache checks) needs two chunks,
    # and its deadline has passed after one.
    engine = build_engine(model_path, EngineOptions(max_context=512, continuous_batching=True, prefix_cache=True,
                                                    token_budget=64))
    prompt = prompts(engine.info.vocab_size)[0]
    late = GenerationRequest("late", prompt, MAX_TOKENS, SamplingParams(temperature=0.0), ignore_eos=True,
                             deadline=time.monotonic())
    plans: list[StepPlan] = []
    [finish] = engine.generate(late, plans)
    assert (finish.finish_reason, finish.timed_out, finish.usage.completion_tokens) == ("length", True, 0)
    assert [plan.chunks for plan in plans] == [((0, 64),)]
    # The next request on the slot continues from what the stopped prefill computed, and gets its fresh answer.
    assert run(engine, [[request("next", prompt)]])["next"] == (fresh(prompt), 64)
