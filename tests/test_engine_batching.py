"""Batch invariance of the whole forward pass: a sequence's logits are bit-identical alone, batched, or split, in
every KV type."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from basert.engine.runner import ForwardRequest, ModelRunner


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(0, vocab, n).tolist() for n in (37, 5, 70)]


def run_alone(runner: ModelRunner, prompt: list[int], decode: list[int]) -> list[np.ndarray]:
    seq = runner.new_sequence()
    out = [runner.forward([ForwardRequest(seq, prompt, logits="all")])[0].copy()]
    for token in decode:
        out.append(runner.forward([ForwardRequest(seq, [token])])[0].copy())
    runner.release(seq)
    return out


# Gemma 3 over the 8- and 16-bit KV types under -m slow (its f16 KV stays in the default run).
SLOW_PAIRS = {("gemma3", "q8_0"), ("gemma3", "bf16")}


@pytest.fixture(params=[pytest.param((model, kv), marks=[pytest.mark.slow] if (model, kv) in SLOW_PAIRS else [])
                        for model in ("smollm2", "gemma3", "qwen3_5-tiny", "qwen3_5_moe-tiny")
                        for kv in ("f16", "q8_0", "bf16")], ids=lambda param: "-".join(param))
def runner(request, smollm2_base: Path, tiny_f32_bases: dict[str, Path]):
    """Every family, over each KV type the server offers (f32 is the Python API's default, tested everywhere else)."""
    model, kv = request.param
    if model == "gemma3":
        path = request.getfixturevalue("gemma3_base")
    else:
        path = smollm2_base if model == "smollm2" else tiny_f32_bases[model]
    runner = ModelRunner(path, max_context=256, max_sequences=3, cache_type_k=kv, cache_type_v=kv)
    yield runner
    runner.close()


def test_batched_prefill_and_decode_equal_running_alone(runner: ModelRunner):
    batch_prompts = prompts(runner.vocab_size)
    decode = [[5, 17, 3], [9, 2, 44], [1, 1, 8]]
    alone = [run_alone(runner, p, d) for p, d in zip(batch_prompts, decode)]
    seqs = [runner.new_sequence() for _ in batch_prompts]
    requests = [ForwardRequest(s, p, logits="all") for s, p in zip(seqs, batch_prompts)]
    together = [r.copy() for r in runner.forward(requests)]
    for i in range(3):
        assert np.array_equal(together[i], alone[i][0]), f"prefill of sequence {i}"
    for step in range(3):
        out = [r.copy() for r in runner.forward([ForwardRequest(s, [d[step]]) for s, d in zip(seqs, decode)])]
        for i in range(3):
            assert np.array_equal(out[i], alone[i][step + 1]), f"decode step {step} of sequence {i}"
    for seq in seqs:
        runner.release(seq)
    assert runner.pool.n_free == runner.pool.n_blocks


def test_prompt_split_into_chunks_gives_identical_logits(runner: ModelRunner):
    prompt = prompts(runner.vocab_size)[2]
    whole = run_alone(runner, prompt, [])[0]
    seq = runner.new_sequence()
    pieces = [prompt[:16], prompt[16:17], prompt[17:50], prompt[50:]]
    got = [runner.forward([ForwardRequest(seq, piece, logits="all")])[0].copy() for piece in pieces]
    runner.release(seq)
    assert np.array_equal(np.concatenate(got), whole)
