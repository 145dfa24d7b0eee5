"""The Python API on real models: reference greedy outputs, streaming, callbacks, seeds, prefix reuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FIXTURES

import basert


@pytest.fixture(scope="module")
def smollm2(smollm2_base: Path):
    with basert.Model(smollm2_base, max_context=512) as model:
        yield model


@pytest.fixture(scope="module")
def smollm2_prompts() -> dict:
    reference = json.loads((FIXTURES / "smollm2" / "reference.json").read_text())
    return {p["name"]: p for p in reference["prompts"]}


def test_text_prompt_encodes_like_the_reference_and_generates_its_greedy_tokens(smollm2, smollm2_prompts):
    prompt = smollm2_prompts["capital"]
    assert smollm2.encode(prompt["text"]) == prompt["input_ids"]
    stats = smollm2.generate(prompt["text"], max_tokens=32, stop_at_eos=False)
    assert stats.tokens == prompt["greedy"]
    assert stats.prompt_tokens == len(prompt["input_ids"])
    assert stats.finish_reason == "length"
    assert stats.prefill_tokens_per_second > 0 and stats.decode_tokens_per_second > 0
    assert stats.text == smollm2.decode(prompt["greedy"])


def test_eos_stops_generation_like_hf_generate(smollm2, smollm2_prompts):
    prompt = smollm2_prompts["chat"]
    stats = smollm2.generate(prompt["input_ids"], max_tokens=64)
    assert stats.tokens == prompt["generate"][: len(stats.tokens)]
    assert stats.finish_reason == "stop"
    assert len(stats.tokens) < 64


def test_callback_stops_and_stream_matches_generate(smollm2, smollm2_prompts):
    text = smollm2_prompts["story"]["text"]
    seen = []
    stats = smollm2.generate(text, max_tokens=20, callback=lambda tok, piece: len(seen.append(tok) or seen) < 3)
    assert len(stats.tokens) == 3 and stats.finish_reason == "callback"
    streamed = "".join(smollm2.stream(text, max_tokens=20))
    assert streamed == smollm2.generate_text(text, max_tokens=20)


def test_seeded_sampling_is_reproducible(smollm2, smollm2_prompts):
    text = smollm2_prompts["story"]["text"]
    first = smollm2.generate(text, max_tokens=24, temperature=0.9, top_p=0.95, seed=1234).tokens
    second = smollm2.generate(text, max_tokens=24, temperature=0.9, top_p=0.95, seed=1234).tokens
    other = smollm2.generate(text, max_tokens=24, temperature=0.9, top_p=0.95, seed=99).tokens
    assert first == second
    assert first != other


def test_prefix_reuse_gives_identical_output(smollm2, smollm2_prompts):
    prompt = smollm2_prompts["code"]
    smollm2.reset()
    fresh = smollm2.generate(prompt["input_ids"], max_tokens=16, stop_at_eos=False)
    again = smollm2.generate(prompt["input_ids"], max_tokens=16, stop_at_eos=False)
    assert fresh.cached_tokens == 0
    assert again.cached_tokens == len(prompt["input_ids"]) - 1
    assert again.tokens == fresh.tokens == prompt["greedy"][:16]


def test_hybrid_model_takes_token_ids_and_continues_its_sequence(tiny_f32_bases: dict[str, Path]):
    reference = json.loads((FIXTURES / "refdata" / "models" / "qwen3_5-tiny" / "reference.json").read_text())
    prompt = reference["prompts"][1]
    with basert.Model(tiny_f32_bases["qwen3_5-tiny"], max_context=256) as model:
        assert model.arch == "qwen35"
        assert any(t["name"] == "layers.0.linear_attn.A_log" for t in model.tensors())
        with pytest.raises(ValueError, match="no tokenizer"):
            model.encode("hello")
        stats = model.generate(prompt["input_ids"], max_tokens=8)
        assert stats.tokens == prompt["greedy"][:8]
        # A prompt that extends the computed sequence (prompt + 7 fed-back tokens) continues the
        # recurrent state...
        extended = prompt["input_ids"] + prompt["greedy"][:8]
        continued = model.generate(extended, max_tokens=8)
        assert continued.cached_tokens == len(extended) - 1
        assert continued.tokens == prompt["greedy"][8:16]
        # ...a resent prompt resumes from the checkpoint kept before its last token...
        restarted = model.generate(prompt["input_ids"], max_tokens=16)
        assert restarted.cached_tokens == len(prompt["input_ids"]) - 1
        assert restarted.tokens == prompt["greedy"]
        # ...and anything else recomputes from scratch; each still gives the reference output.
        other = reference["prompts"][0]
        assert other["input_ids"][0] != prompt["input_ids"][0]
        fresh = model.generate(other["input_ids"], max_tokens=8)
        assert fresh.cached_tokens == 0
        assert fresh.tokens == other["greedy"][:8]
