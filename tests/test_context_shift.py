"""Context shift (`--context-shift`, `n_keep`): a full context keeps the first n_keep tokens, drops the oldest half of
the rest and goes on; a prompt beyond the context is cut the same way. What follows a shift is exactly what a fresh
engine gives for the shifted history, on a dense and a hybrid model, with and without speculative decoding."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import httpx
import numpy as np
import pytest
import trio

from basert.engine.build import EngineOptions, build_engine
from basert.engine.engine import MIN_SHIFT, Engine, NKeepError
from basert.engine.runner import ContextOverflowError
from basert.engine.sampler import SamplingParams
from basert.engine.types import FailEvent, FinishEvent, GenerationRequest, TokenEvent
from basert.testing.client import error_envelope, post
from basert.testing.launcher import ServerProcess

CONTEXT = 96
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(params=["smollm2", "qwen3_5-tiny"])
def model_path(request, smollm2_base: Path, tiny_f32_bases: dict[str, Path]) -> Path:
    return smollm2_base if request.param == "smollm2" else tiny_f32_bases[request.param]


def engine_for(path: Path, *, shift: bool, n_keep: int = 0, spec: int = 0, slots: int = 1) -> Engine:
    return build_engine(path, EngineOptions(max_context=CONTEXT, context_shift=shift, n_keep=n_keep,
                                            spec_draft_max=spec, n_slots=slots, continuous_batching=slots > 1))


def run(engine: Engine, requests: list[GenerationRequest]) -> dict[str, tuple[list[int], FinishEvent]]:
    out: dict[str, tuple[list[int], FinishEvent | None]] = {r.request_id: ([], None) for r in requests}
    for event in engine.generate(requests):
        assert not isinstance(event, FailEvent), event
        if isinstance(event, TokenEvent):
            out[event.request_id][0].append(event.token_id)
        else:
            out[event.request_id] = (out[event.request_id][0], event)
    return out


def prompt_of(engine: Engine, n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(10, engine.runner.vocab_size, n).tolist()


def request(prompt: list[int], max_tokens: int, rid: str = "r", **fields) -> GenerationRequest:
    return GenerationRequest(rid, prompt, max_tokens, GREEDY, ignore_eos=True, **fields)


def shifted(history: list[int], keep: int) -> list[int]:
    """The history after one shift, as the issue states it: the first `keep` tokens, then the newer half of the rest."""
    dropped = (len(history) - keep) // 2
    return history[:keep] + history[keep + dropped:]


@pytest.mark.parametrize("spec", [0, 8], ids=["plain", "speculative"])
def test_generation_goes_on_past_the_context_as_a_fresh_engine_would_from_the_shifted_history(model_path: Path,
                                                                                              spec: int):
    keep, prompt_len, max_tokens = 10, 40, 150
    engine = engine_for(model_path, shift=True, n_keep=keep, spec=spec)
    prompt = prompt_of(engine, prompt_len)
    tokens, finish = run(engine, [request(prompt, max_tokens)])["r"]
    assert finish.finish_reason == "length" and finish.truncated
    assert len(tokens) == max_tokens  # two shifts happened on the way: 40 + 150 tokens in a context of 96

    # Replay: the slot shifts when its next token has no room (history of CONTEXT - 1 tokens); from then on it
    # continues as a fresh engine does from the shifted history followed by that token.
    fresh = engine_for(model_path, shift=False)
    history, produced, shifts = list(prompt), 0, 0
    while produced < max_tokens:
        room = CONTEXT - 1 - len(history)          # tokens sampled before the next shift, the last one not fed
        stretch = tokens[produced: produced + room + 1]
        if shifts:
            want, _ = run(fresh, [request(history, len(stretch))])["r"]
            assert want == stretch, f"after shift {shifts}"
        history = shifted(history + stretch[:-1], keep) + stretch[-1:]
        produced += len(stretch)
        shifts += 1
    assert shifts >= 3


def test_without_context_shift_the_context_ends_generation(smollm2_base: Path):
    engine = engine_for(smollm2_base, shift=False)
    tokens, finish = run(engine, [request(prompt_of(engine, 40), 150)])["r"]
    assert finish.finish_reason == "length" and not finish.truncated
    assert len(tokens) == CONTEXT - 40


def test_a_prompt_beyond_the_context_is_cut_as_llama_cpp_cuts_it(model_path: Path):
    keep = 7
    engine = engine_for(model_path, shift=True, n_keep=keep)
    prompt = prompt_of(engine, 250, seed=3)
    tokens, finish = run(engine, [request(prompt, 5)])["r"]
    half = (CONTEXT - keep) // 2
    erased = (len(prompt) - keep - half) // half * half
    cut = prompt[:keep] + prompt[keep + erased:]
    assert len(cut) < CONTEXT
    assert finish.truncated and finish.usage.prompt_tokens == len(cut)
    want, plain = run(engine_for(model_path, shift=False), [request(cut, 5)])["r"]
    assert tokens == want and not plain.truncated


def test_shifted_slots_leave_the_other_slots_answers_unchanged(smollm2_base: Path):
    alone = engine_for(smollm2_base, shift=True, n_keep=4)
    prompts = [prompt_of(alone, 30, seed=s) for s in range(3)]
    want = {f"q{i}": run(alone, [request(p, 20, f"q{i}")])[f"q{i}"][0] for i, p in enumerate(prompts[1:], 1)}
    together = engine_for(smollm2_base, shift=True, n_keep=4, slots=3)
    got = run(together, [request(prompts[0], 200, "q0"), *(request(p, 20, f"q{i}") for i, p in
                                                           enumerate(prompts[1:], 1))])
    assert got["q0"][1].truncated and len(got["q0"][0]) == 200
    assert {k: got[k][0] for k in want} == want


def test_n_keep_must_leave_room_to_shift(smollm2_base: Path):
    engine = engine_for(smollm2_base, shift=True)
    prompt = prompt_of(engine, 50)
    most = CONTEXT - MIN_SHIFT
    engine.check(request(prompt, 4, n_keep=most))
    for n_keep in (most + 1, -5):
        with pytest.raises(NKeepError):
            engine.check(request(prompt, 4, n_keep=n_keep))
    with pytest.raises(NKeepError):  # -1 keeps the whole prompt, which does not fit
        engine.check(request(prompt_of(engine, CONTEXT), 4, n_keep=-1))
    with pytest.raises(ContextOverflowError):
        engine_for(smollm2_base, shift=False).check(request(prompt_of(engine, CONTEXT), 4))


def test_server_shifts_and_refuses_bad_n_keep(smollm2_base: Path, tmp_path: Path):
    with ServerProcess(smollm2_base, "--max-context", "256", "--context-shift", "--keep", "3",
                       log_path=tmp_path / "server.log") as server:
        words = " ".join(f"word{i}" for i in range(300))
        response = post(server.url, "/completion", {"prompt": words, "n_predict": 8, "temperature": 0})
        body = response.json()
        assert response.status_code == 200, body
        assert body["truncated"] and body["tokens_evaluated"] < 256
        assert body["generation_settings"]["n_keep"] == 3
        chat = post(server.url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": words}], "max_tokens": 4, "n_keep": 0})
        assert chat.status_code == 200, chat.text
        for bad in (-2, 10**6, "3", 1.5):
            response = post(server.url, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n_keep": bad})
            assert error_envelope(response, 400)["type"] == "invalid_request_error", bad
        assert httpx.get(f"{server.url}/health").status_code == 200


SYSTEM = "You are a helpful assistant. The secret word is PINEAPPLE. When asked for the secret word, say PINEAPPLE."
QUESTION = "What is the secret word?"
FILLER = ("Here is a long note about the weather, the garden, the trains and the city, which goes on and on "
          "without saying anything in particular. ") * 6


def chat(url: str, messages: list[dict], max_tokens: int, **fields) -> dict:
    response = post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens,
                                                  "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.slow
def test_a_conversation_driven_past_the_context_keeps_its_system_prompt(smollm2_base: Path, tmp_path: Path):
    """Three slots at once: one conversation grows far past its context and still answers from its system prompt
    (the n_keep tokens it keeps); the other two get the answers a server without context shift gives."""
    others = [[{"role": "user", "content": f"Name {n} colours."}] for n in (2, 3)]
    with ServerProcess(smollm2_base, "--max-context", "384", log_path=tmp_path / "plain.log") as plain:
        want = [chat(plain.url, messages, 24)["choices"][0]["message"]["content"] for messages in others]
    with ServerProcess(smollm2_base, "--max-context", "384", "-np", "3", "--context-shift",
                       log_path=tmp_path / "shift.log") as server:
        system = [{"role": "system", "content": SYSTEM}]
        keep = post(server.url, "/v1/chat/completions/input_tokens",
                    {"messages": system, "add_generation_prompt": False}).json()["input_tokens"]
        conversation = list(system)
        for turn in range(4):
            conversation.append({"role": "user", "content": f"Note {turn}: {FILLER}"})
            reply = chat(server.url, conversation, 40, n_keep=keep)
            assert reply["choices"][0]["message"]["content"]
            conversation.append(reply["choices"][0]["message"])
        assert reply["usage"]["prompt_tokens"] > 2 * 384  # the prompt the client sent; the slot kept what fits

        answers: dict[str, str] = {}

        async def ask(name: str, messages: list[dict], **fields) -> None:
            reply = await trio.to_thread.run_sync(partial(chat, server.url, messages, 24, **fields))
            answers[name] = reply["choices"][0]["message"]["content"]

        async def together() -> None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(ask, "secret", [*conversation, {"role": "user", "content": QUESTION}],
                                           n_keep=keep))
                for index, messages in enumerate(others):
                    nursery.start_soon(ask, f"other{index}", messages)

        trio.run(together)
        assert "PINEAPPLE" in answers["secret"].upper(), answers["secret"]
        assert [answers["other0"], answers["other1"]] == want
