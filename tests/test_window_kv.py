"""Sliding-window layers keep their window only: Gemma 3's 15 local layers (a token sees the last 512 positions)
hold the blocks of the last window (and WINDOW_SLACK positions before it) in a pool of their own, and let go of
the rest as a sequence grows. Released blocks go to other sequences at once, so a kernel that read one would
see another sequence's KV: every check here compares bits or greedy tokens with a computation that kept
everything, or with a fresh engine, after the pool has been reused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_engine_slots import run

from basert.engine import EngineOptions, build_engine
from basert.engine.engine import Engine
from basert.engine.kv import BLOCK_SIZE, WINDOW_SLACK, blocks_for, window_blocks
from basert.engine.runner import ForwardRequest, ModelRunner
from basert.engine.saved_state import load_prefix_cache, save_prefix_cache
from basert.engine.types import GenerationRequest, SamplingParams

CONTEXT = 2048
MAX_TOKENS = 8


def random_tokens(seed: int, n: int, vocab: int = 32000) -> list[int]:
    return np.random.default_rng(seed).integers(10, vocab, n).tolist()


def greedy(rid: str, prompt: list[int]) -> GenerationRequest:
    return GenerationRequest(rid, prompt, MAX_TOKENS, SamplingParams(temperature=0.0), ignore_eos=True)


def make_engine(path: Path, *, slots: int = 1, cache: bool = True, budget: int = 512) -> Engine:
    return build_engine(path, EngineOptions(max_context=CONTEXT, n_slots=slots, continuous_batching=True,
                                            prefix_cache=cache, token_budget=budget))


def held_window_blocks(engine: Engine) -> int:
    """Window-pool blocks that some slot holds (not the cached ones nobody holds)."""
    return sum(slot.sequence.window_table.held().size for slot in engine.slots)


@pytest.fixture(scope="module")
def fresh(gemma3_ids_base: Path):
    """Greedy tokens of a prompt on a fresh one-slot engine (memoised per prompt)."""
    results: dict[tuple[int, ...], list[int]] = {}

    def tokens(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in results:
            engine = make_engine(gemma3_ids_base, cache=False)
            try:
                results[key] = run(engine, [[greedy("fresh", prompt)]])["fresh"][0]
            finally:
                engine.close()
        return results[key]

    return tokens


@pytest.mark.slow
def test_the_window_pool_holds_windows_only_and_gives_the_bits_of_keeping_everything(gemma3_ids_base: Path):
    """Two sequences interleaved in a runner that trims (its blocks reused as soon as they leave the window) give the
    logits bits of each sequence alone in a runner that keeps every position, prompt chunks and decode steps."""
    trimming = ModelRunner(gemma3_ids_base, max_context=CONTEXT, max_sequences=2, cache_type_k="f16",
                           cache_type_v="f16", window_kv_blocks=2 * window_blocks(512, 384))
    keeping = ModelRunner(gemma3_ids_base, max_context=CONTEXT, cache_type_k="f16", cache_type_v="f16",
                          window_slack=CONTEXT)
    try:
        assert trimming.window == keeping.window == 512
        prompts = [random_tokens(1, 1300), random_tokens(2, 1100)]
        chunks = [[384, 384, 300, 232], [200, 384, 384, 132]]
        sequences = [trimming.new_sequence() for _ in prompts]
        logits: list[list[np.ndarray]] = [[], []]
        for step in range(4):
            requests, fed = [], []
            for i, seq in enumerate(sequences):
                start = sum(chunks[i][:step])
                requests.append(ForwardRequest(seq, prompts[i][start: start + chunks[i][step]], "all"))
            for i, rows in enumerate(trimming.forward(requests)):
                logits[i].append(rows.copy())
                fed.append(seq.n_past)
            # The window layers hold their window and the slack before it, never the whole history.
            for seq in sequences:
                assert seq.window_table.held().size <= window_blocks(512, 384)
        history = [list(p) for p in prompts]
        for _ in range(6):   # decode steps, batched
            rows = trimming.forward([ForwardRequest(seq, [h[-1]]) for seq, h in zip(sequences, history)])
            for i, row in enumerate(rows):
                logits[i].append(row.copy())
                history[i].append(int(np.argmax(row[0])))
        for seq in sequences:
            assert seq.window_table.first > 0
            assert seq.window_table.held().size <= blocks_for(512 + WINDOW_SLACK) + 2
        for i, prompt in enumerate(prompts):
            alone = keeping.new_sequence()
            expected = [keeping.forward([ForwardRequest(alone, prompt, "all")])[0].copy()]
            for token in history[i][len(prompt) - 1: -1]:
                expected.append(keeping.forward([ForwardRequest(alone, [token])])[0].copy())
            assert alone.window_table.first == 0     # it kept every block
            got = np.concatenate(logits[i])
            assert np.array_equal(got.view(np.uint32), np.concatenate(expected).view(np.uint32))
            keeping.release(alone)
    finally:
        trimming.close()
        keeping.close()


@pytest.mark.slow
def test_own_history_cache_hits_and_concurrency_give_a_fresh_engines_tokens(gemma3_ids_base: Path, fresh):
    """A slot resumes its own history a little before its end; further back it resumes from the prefix cache (or,
    without one, computes again); another slot hits the cache; slots run at once: each gives a fresh engine's
    tokens."""
    prompt = random_tokens(3, 1000)
    with_cache = make_engine(gemma3_ids_base, slots=2)
    without = make_engine(gemma3_ids_base, cache=False)
    try:
        for engine in (with_cache, without):
            (first, _), = run(engine, [[greedy("first", prompt)]]).values()
            assert first == fresh(prompt)
            history = list(engine.slots[0].sequence.tokens)
            # A turn that shares all but the end of the history resumes it.
            near = [*history[:-3], *random_tokens(4, 20)]
            tokens, cached = run(engine, [[greedy("near", near)]])["near"]
            assert cached == len(history) - 3 and tokens == fresh(near)
            # Far back, the window layers' blocks are gone from the slot.
            far = [*prompt[:300], *random_tokens(5, 30)]
            tokens, cached = run(engine, [[greedy("far", far)]])["far"]
            assert tokens == fresh(far)
            assert cached == (300 // BLOCK_SIZE * BLOCK_SIZE if engine is with_cache else 0)
        # Another slot, busy at the same time, hits the cache for the shared prefix.
        other = [*prompt[:900], *random_tokens(6, 40)]
        again = [*prompt, *random_tokens(7, 10)]
        out = run(with_cache, [[greedy("other", other), greedy("again", again)]])
        assert out["other"][0] == fresh(other) and out["other"][1] >= 896
        assert out["again"][0] == fresh(again)
        for engine in (with_cache, without):
            assert held_window_blocks(engine) <= len(engine.slots) * window_blocks(512, 0)
    finally:
        with_cache.close()
        without.close()


@pytest.mark.slow
def test_concurrent_long_prompts_in_small_steps(gemma3_ids_base: Path, fresh):
    """Three long prompts prefilled together in steps of 96 tokens, then decoded together: each gives its fresh
    tokens, and the window pool (sized for three slots and that budget) holds them."""
    engine = make_engine(gemma3_ids_base, slots=3, cache=False, budget=96)
    try:
        prompts = {f"p{i}": random_tokens(10 + i, 900 + 150 * i) for i in range(3)}
        out = run(engine, [[greedy(rid, prompt) for rid, prompt in prompts.items()]])
        for rid, prompt in prompts.items():
            assert out[rid][0] == fresh(prompt), rid
        pool = engine.runner.window_pool
        assert pool.n_blocks < 3 * blocks_for(CONTEXT) // 2
    finally:
        engine.close()


@pytest.mark.slow
def test_a_snapshot_holds_the_window_and_restores_exactly(gemma3_ids_base: Path, fresh, tmp_path: Path):
    """A slot snapshot keeps the window layers' rows of the last window only; restored into a fresh engine it
    continues as a fresh engine computes the whole conversation."""
    prompt = random_tokens(20, 1300)
    engine = make_engine(gemma3_ids_base)
    restored = make_engine(gemma3_ids_base)
    try:
        run(engine, [[greedy("first", prompt)]])
        seq = engine.slots[0].sequence
        n = seq.n_past
        path = tmp_path / "slot.bin"
        info = engine.save_slot(0, path)
        runner = engine.runner
        row = runner.config.num_key_value_heads * 2 * runner.config.head_dim * 2    # f16 K and V
        kept = n - (n + 1 - 512) // BLOCK_SIZE * BLOCK_SIZE
        assert info.n_bytes < 4 * n + row * (3 * n + 15 * kept) + 4096
        assert restored.restore_slot(0, path).n_tokens == n
        follow = [*seq.tokens, *random_tokens(21, 25)]
        tokens, cached = run(restored, [[greedy("follow", follow)]])["follow"]
        assert cached == n and tokens == fresh(follow)
    finally:
        engine.close()
        restored.close()


@pytest.mark.slow
def test_a_prefix_cache_file_keeps_the_window_blocks(gemma3_ids_base: Path, fresh, tmp_path: Path):
    """Saved and loaded into another engine, the cache gives a hit as long as before, with the window layers'
    blocks its next token reads, and the tokens of a fresh engine."""
    prompt = random_tokens(30, 1200)
    engine = make_engine(gemma3_ids_base)
    loaded = make_engine(gemma3_ids_base)
    try:
        run(engine, [[greedy("first", prompt)]])
        path = tmp_path / "cache.bin"
        saved = save_prefix_cache(engine.runner, engine.prefix_cache, path)
        assert saved == len(engine.slots[0].sequence.tokens) // BLOCK_SIZE
        # Window blocks that left their slot's window stay cached until the pool needs them.
        assert len(engine.prefix_cache.window_block_of) == saved
        assert load_prefix_cache(loaded.runner, loaded.prefix_cache, path) == saved
        follow = [*prompt, *random_tokens(31, 20)]
        tokens, cached = run(loaded, [[greedy("follow", follow)]])["follow"]
        assert cached == len(prompt) // BLOCK_SIZE * BLOCK_SIZE and tokens == fresh(follow)
    finally:
        engine.close()
        loaded.close()


@pytest.mark.slow
def test_a_small_pool_and_idle_slots_keep_the_window_pool_bounded(gemma3_ids_base: Path, fresh):
    """A KV pool too small for two long prompts at once runs them in turn; requests that end right after their
    prompt leave idle slots with a window each: the pool sized for the slots holds them all, and every request
    gives a fresh engine's tokens."""
    engine = build_engine(gemma3_ids_base, EngineOptions(max_context=CONTEXT, n_slots=4, continuous_batching=True,
                                                         prefix_cache=False, kv_cache_tokens=1600))
    try:
        prompts = {"a": random_tokens(40, 900), "b": random_tokens(41, 850)}
        out = run(engine, [[greedy(rid, prompt) for rid, prompt in prompts.items()]])
        for rid, prompt in prompts.items():
            assert out[rid][0] == fresh(prompt), rid
        short = {f"s{i}": random_tokens(50 + i, 700 + 40 * i) for i in range(4)}
        requests = [GenerationRequest(rid, prompt, 1, SamplingParams(temperature=0.0), ignore_eos=True)
                    for rid, prompt in short.items()]
        out = run(engine, [requests])
        for rid, prompt in short.items():
            assert out[rid][0] == fresh(prompt)[:1], rid
        assert held_window_blocks(engine) <= engine.runner.window_pool.n_blocks
    finally:
        engine.close()
