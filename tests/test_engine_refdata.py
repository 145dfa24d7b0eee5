"""The engine against the independent reference outputs: tiny Qwen3 / Qwen3.5 / MoE models and SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES, TINY_MODELS

from basert.engine.runner import ForwardRequest, ModelRunner

LOGIT_ATOL = 1e-4


def load_reference(name: str) -> dict:
    return json.loads((FIXTURES / "refdata" / "models" / name / "reference.json").read_text())


def greedy_continue(runner: ModelRunner, seq, last_logits: np.ndarray, steps: int) -> list[int]:
    tokens = []
    logits = last_logits
    for _ in range(steps):
        token = int(np.argmax(logits))
        tokens.append(token)
        if len(tokens) == steps:
            break
        logits = runner.forward([ForwardRequest(seq, [token])])[0][0].copy()
    return tokens


@pytest.fixture(scope="module")
def tiny_runners(tiny_f32_bases: dict[str, Path]):
    runners = {name: ModelRunner(path, max_context=512) for name, path in tiny_f32_bases.items()}
    yield runners
    for runner in runners.values():
        runner.close()


@pytest.mark.parametrize("name", TINY_MODELS)
@pytest.mark.parametrize("prompt_index", [0, 1, 2])
def test_tiny_model_matches_reference(name: str, prompt_index: int, tiny_runners):
    runner = tiny_runners[name]
    prompt = load_reference(name)["prompts"][prompt_index]
    ids = prompt["input_ids"]
    seq = runner.new_sequence()
    try:
        all_logits = runner.forward([ForwardRequest(seq, ids, logits="all")])[0].copy()
        last = all_logits[-1]
        expected_last = np.asarray(prompt["last_logits"], dtype=np.float32)
        assert np.max(np.abs(last - expected_last)) <= LOGIT_ATOL
        margins = np.asarray(prompt["margin_all"])
        argmax = np.argmax(all_logits, axis=1)
        decided = margins > 10 * LOGIT_ATOL
        assert np.array_equal(argmax[decided], np.asarray(prompt["argmax_all"])[decided])
        assert greedy_continue(runner, seq, last, len(prompt["greedy"])) == prompt["greedy"]
    finally:
        runner.release(seq)

    split = prompt["two_piece"]["split"]
    seq = runner.new_sequence()
    try:
        runner.forward([ForwardRequest(seq, ids[:split], logits="none")])
        last = runner.forward([ForwardRequest(seq, ids[split:])])[0][0].copy()
        assert greedy_continue(runner, seq, last, len(prompt["two_piece"]["greedy"])) == prompt["two_piece"]["greedy"]
    finally:
        runner.release(seq)


def test_smollm2_greedy_and_top20_match_reference(smollm2_base: Path, fixtures_dir: Path):
    reference = json.loads((fixtures_dir / "smollm2" / "reference.json").read_text())
    prompts = reference["prompts"] if "prompts" in reference else reference
    runner = ModelRunner(smollm2_base, max_context=512, exact=True)   # the reference is the float computation's
    try:
        items = prompts.items() if isinstance(prompts, dict) else [(p["name"], p) for p in prompts]
        for name, prompt in items:
            seq = runner.new_sequence()
            last = runner.forward([ForwardRequest(seq, prompt["input_ids"])])[0][0].copy()
            top = prompt["last_top20"]
            ids = [entry[0] if isinstance(entry, list) else entry["id"] for entry in top]
            values = [entry[1] if isinstance(entry, list) else entry["logit"] for entry in top]
            assert np.max(np.abs(last[ids] - np.asarray(values, dtype=np.float32))) <= 2e-2, name
            assert greedy_continue(runner, seq, last, len(prompt["greedy"])) == prompt["greedy"], name
            runner.release(seq)
    finally:
        runner.close()
