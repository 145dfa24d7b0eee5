"""The C decode graph (basert._ext.graph, built by basert.models.plan) against the per-kernel path of the
model files: the same bits for decode steps and short chunks, alone and batched, for any thread count."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from basert.engine.runner import ForwardRequest, ModelRunner
from basert.models.plan import MAX_GRAPH_TOKENS


def open_runner(path: Path, kv: str, threads: int, graph: bool, max_context: int = 320) -> ModelRunner:
    runner = ModelRunner(path, max_context=max_context, max_sequences=3, cache_type_k=kv, cache_type_v=kv,
                         threads=threads)
    if not graph:
        runner.model.graph = None
    return runner


def script(runner: ModelRunner, lengths: tuple[int, int, int] = (40, 3, 250)) -> list[np.ndarray]:
    """Logits of a fixed mix of steps: prefills of `lengths` (the graph takes the short ones), then batched
    decode steps of three sequences, a batch of one decode and one 10-token chunk, and a chunk of exactly
    MAX_GRAPH_TOKENS (after the default lengths its rows lie on both sides of an attention segment boundary,
    at 256 positions)."""
    rng = np.random.default_rng(5)
    vocab = runner.vocab_size
    seqs = [runner.new_sequence() for _ in range(3)]
    out = []
    for seq, n in zip(seqs, lengths):
        out.append(runner.forward([ForwardRequest(seq, rng.integers(0, vocab, n).tolist(), logits="all")])[0].copy())
    for _ in range(4):
        steps = [ForwardRequest(seq, [int(rng.integers(0, vocab))]) for seq in seqs]
        out.extend(r.copy() for r in runner.forward(steps))
    mixed = [ForwardRequest(seqs[0], [7]), ForwardRequest(seqs[1], rng.integers(0, vocab, 10).tolist(), logits="all")]
    out.extend(r.copy() for r in runner.forward(mixed))
    chunk = rng.integers(0, vocab, MAX_GRAPH_TOKENS).tolist()
    out.append(runner.forward([ForwardRequest(seqs[2], chunk, logits="all")])[0].copy())
    for seq in seqs:
        runner.release(seq)
    return out


def same_bits(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x.view(np.uint32), y.view(np.uint32)) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def per_kernel_logits() -> dict[tuple[str, str], list[np.ndarray]]:
    """The per-kernel path's logits of `script` (2 threads), by (model, KV dtype): one reference for every thread
    count of the graph."""
    return {}


def graph_cases() -> list:
    """(model, KV type, threads): the default run checks SmolLM2 at 2 threads (test_one_graph_follows_thread_count_
    changes holds its graph to the same bits at 1, 2 and 3) and the tiny models (Qwen3; Qwen2, whose projections
    have biases) at each, in f16 and q8_0 KV (Qwen2: f16); `-m slow` adds SmolLM2's graph started at 1 and 3
    threads, and f32 and bf16 KV."""
    cases = []
    for name in ("smollm2", "qwen3-tiny", "qwen2-tiny"):
        # q8_0 rows need a head dim of a multiple of 32: not the tiny Qwen2's 16.
        for kv in ("f16", "f32", "bf16") if name == "qwen2-tiny" else ("f16", "q8_0", "f32", "bf16"):
            for threads in (1, 2, 3):
                slow = kv in ("f32", "bf16") or (name == "smollm2" and threads != 2)
                cases.append(pytest.param(name, kv, threads, marks=pytest.mark.slow if slow else (),
                                          id=f"{name}-kv-{kv}-{threads}-threads"))
    return cases


@pytest.mark.parametrize(("name", "kv", "threads"), graph_cases())
def test_graph_steps_equal_the_per_kernel_path(name: str, kv: str, threads: int, smollm2_base: Path,
                                               tiny_f32_bases: dict[str, Path], per_kernel_logits: dict):
    path = smollm2_base if name == "smollm2" else tiny_f32_bases[name]
    key = (name, kv)
    if key not in per_kernel_logits:
        reference_runner = open_runner(path, kv, threads=2, graph=False)
        per_kernel_logits[key] = script(reference_runner)
        reference_runner.close()
    runner = open_runner(path, kv, threads=threads, graph=True)
    assert runner.model.graph is not None
    got = script(runner)
    runner.close()
    assert same_bits(got, per_kernel_logits[key]), f"{threads} threads"


@pytest.mark.slow
def test_gemma3_graph_steps_beyond_the_sliding_window_equal_the_per_kernel_path(gemma3_base: Path):
    """Gemma 3 in the graph: block outputs normed before the residual add, GeGLU, per-layer RoPE bases, and
    sliding-window layers at 770+ positions, where the window (512) no longer reaches the first segment."""
    lengths = (40, 3, 770)
    reference_runner = open_runner(gemma3_base, "f16", threads=2, graph=False, max_context=832)
    reference = script(reference_runner, lengths)
    reference_runner.close()
    for threads in (1, 2):
        runner = open_runner(gemma3_base, "f16", threads=threads, graph=True, max_context=832)
        assert runner.model.graph is not None
        got = script(runner, lengths)
        runner.close()
        assert same_bits(got, reference), f"{threads} threads"


def test_one_graph_follows_thread_count_changes(smollm2_base: Path):
    """A graph whose thread count changes between steps starts a team of that size with buffers to match: the
    same bits as before."""
    # Prompts of at most MAX_GRAPH_TOKENS: every step runs in the graph, prefills included, at each thread count
    # (the bits across an attention segment boundary are the test above's).
    lengths = (12, 3, MAX_GRAPH_TOKENS)
    runner = open_runner(smollm2_base, "f16", threads=1, graph=True)
    first = script(runner, lengths)
    for threads in (3, 2, 1):
        runner.threads = threads
        assert same_bits(script(runner, lengths), first), f"{threads} threads"
    runner.close()


def test_models_the_graph_does_not_run_keep_the_per_kernel_path(tiny_f32_bases: dict[str, Path]):
    for name in ("qwen3_5-tiny", "qwen3_5_moe-tiny"):
        runner = ModelRunner(tiny_f32_bases[name], max_context=64)
        assert runner.model.graph is None, name
        runner.close()


def test_graph_rejects_inconsistent_steps(smollm2_base: Path):
    runner = ModelRunner(smollm2_base, max_context=64)
    graph = runner.model.graph
    hidden, vocab = runner.hidden_size, runner.vocab_size
    x = np.zeros((2, hidden), dtype=np.float32)
    logits = np.zeros((1, vocab), dtype=np.float32)
    positions = np.array([0, 1], dtype=np.int32)
    one = np.array([0], dtype=np.int32)
    tables = np.zeros((1, 4), dtype=np.int32)
    k, v = runner.kv.k, runner.kv.v
    with pytest.raises(ValueError, match="cover"):
        graph.run(x, k, v, positions, one, np.array([1], dtype=np.int32), one, tables, tables, one, logits, 1)
    with pytest.raises(ValueError, match="block table names"):
        graph.run(x, k, v, positions, one, np.array([2], dtype=np.int32), one,
                  np.full((1, 4), runner.kv.n_blocks, dtype=np.int32), tables, one, logits, 1)
    with pytest.raises(ValueError, match="leaves the context"):
        graph.run(x, k, v, positions, one, np.array([2], dtype=np.int32), np.array([63], dtype=np.int32), tables,
                  tables, one, logits, 1)
    with pytest.raises(ValueError, match="logit row"):
        graph.run(x, k, v, positions, one, np.array([2], dtype=np.int32), one, tables, tables,
                  np.array([2], dtype=np.int32), logits, 1)
    with pytest.raises(ValueError, match="x must be"):
        graph.run(np.zeros((MAX_GRAPH_TOKENS + 1, hidden), dtype=np.float32), k, v, positions, one, one, one,
                  tables, tables, one, logits, 1)
    runner.close()
