"""Anthropic's Messages API through the official `anthropic` SDK against a real `basert serve` on loopback: SmolLM2
and the tiny Qwen3.5-style hybrid (served with the real Qwen3.5 template, which has tools and thinking).

Each answer is checked against what /v1/chat/completions answers for the equivalent OpenAI request at
temperature 0: the same prompt, the same text, the same tool calls. The SDK has no sampling parameters, so
`temperature` travels in the body as `extra_body`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from conftest import HYBRID_CHAT_FLAGS, SMOLLM2_CHAT_FLAGS

from basert.chat.tool_calls import ToolCallDelta
from basert.server.anthropic_api import ContentBlocks
from basert.server.app import ServerSettings, create_app
from basert.server.catalog import ModelCatalog
from basert.server.chat_api import ChoiceDelta
from basert.testing.client import answer, post
from basert.testing.pool import ServerPool

if TYPE_CHECKING:  # the SDK takes seconds to import: only the tests that run import it (collection does not)
    import anthropic

GREEDY = {"temperature": 0}
SYSTEM = "You are a terse assistant."
QUESTION = "Name three colors."
# A forced call takes 25 to 28 tokens in either dialect (tags, name, one enum argument).
CALL_TOKENS = 32
TOOLS = [
    {"name": "weather", "description": "The weather in a city",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Rome", "Oslo"]}},
                      "required": ["city"]}},
    {"name": "clock", "description": "The time in a time zone",
     "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                      "required": ["zone"]}},
]
OPENAI_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                  "parameters": t["input_schema"]}} for t in TOOLS]
ARGUMENT_OF = {"weather": "city", "clock": "zone"}


@dataclass(frozen=True)
class Served:
    """A shared server, its model id, and an SDK client for it."""

    url: str
    model: str
    client: anthropic.Anthropic


def served_by(server_url: str) -> Served:
    import anthropic

    model = answer(httpx.get(server_url + "/v1/models", timeout=30))["data"][0]["id"]
    return Served(server_url, model, anthropic.Anthropic(base_url=server_url, api_key="unused", max_retries=0))


@pytest.fixture(scope="module")
def smollm2(smollm2_base: Path, server_pool: ServerPool) -> Served:
    return served_by(server_pool.get(smollm2_base, *SMOLLM2_CHAT_FLAGS).url)


@pytest.fixture(scope="module")
def hybrid(qwen35_chat_base: Path, server_pool: ServerPool) -> Served:
    return served_by(server_pool.get(qwen35_chat_base, *HYBRID_CHAT_FLAGS).url)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def chat_completion(served: Served, messages: list[dict], max_tokens: int, **fields) -> dict:
    body = {"model": served.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **fields}
    return answer(post(served.url, "/v1/chat/completions", body))


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def blocks(message: anthropic.types.Message) -> list[dict]:
    """The content blocks' fields, whichever SDK class (streamed or not) holds them."""
    return [block.model_dump(include={"type", "text", "thinking", "signature", "name", "input"})
            for block in message.content]


def prompt_tokens(message: anthropic.types.Message) -> int:
    """The whole prompt of a message: Anthropic's input_tokens leaves out the tokens read from the cache."""
    return message.usage.input_tokens + message.usage.cache_read_input_tokens


@pytest.fixture(scope="module")
def plain(smollm2: Served) -> anthropic.types.Message:
    return smollm2.client.messages.create(model=smollm2.model, max_tokens=12, system=SYSTEM,
                                          messages=[user(QUESTION)], extra_body=GREEDY)


def test_text_message_equals_the_chat_completion(smollm2: Served, plain: anthropic.types.Message):
    chat = chat_completion(smollm2, [{"role": "system", "content": SYSTEM}, user(QUESTION)], 12)
    choice = chat["choices"][0]
    assert plain.id.startswith("msg_")
    assert (plain.type, plain.role, plain.model) == ("message", "assistant", smollm2.model)
    assert [block.type for block in plain.content] == ["text"]
    assert plain.content[0].text == choice["message"]["content"]
    assert plain.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[choice["finish_reason"]]
    assert plain.stop_sequence is None
    assert plain.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert prompt_tokens(plain) == chat["usage"]["prompt_tokens"]
    assert plain.usage.cache_creation_input_tokens == 0


def test_system_blocks_render_like_the_system_string(smollm2: Served, plain: anthropic.types.Message):
    def count(system: str | list[dict]) -> int:
        counted = smollm2.client.messages.count_tokens(model=smollm2.model, system=system, messages=[user(QUESTION)])
        return counted.input_tokens

    assert count([{"type": "text", "text": SYSTEM}]) == count(SYSTEM) == prompt_tokens(plain)
    parts = [{"type": "text", "text": SYSTEM}, {"type": "text", "text": "Answer in English."}]
    chat = chat_completion(smollm2, [{"role": "system", "content": parts}, user(QUESTION)], 1)
    assert count(parts) == chat["usage"]["prompt_tokens"] > count(SYSTEM)


def test_stop_sequence_ends_the_text_before_it(smollm2: Served, plain: anthropic.types.Message):
    text = text_of(plain)
    stop = text.split()[1]
    stopped = smollm2.client.messages.create(model=smollm2.model, max_tokens=12, system=SYSTEM,
                                             messages=[user(QUESTION)], stop_sequences=["@@", stop],
                                             extra_body=GREEDY)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert text_of(stopped) == text[: text.find(stop)]


def test_max_tokens_ends_with_stop_reason_max_tokens(smollm2: Served, plain: anthropic.types.Message):
    short = smollm2.client.messages.create(model=smollm2.model, max_tokens=3, system=SYSTEM,
                                           messages=[user(QUESTION)], extra_body=GREEDY)
    assert (short.stop_reason, short.stop_sequence, short.usage.output_tokens) == ("max_tokens", None, 3)
    assert text_of(plain).startswith(text_of(short))


def test_streamed_text_equals_the_message(smollm2: Served, plain: anthropic.types.Message):
    with smollm2.client.messages.stream(model=smollm2.model, max_tokens=12, system=SYSTEM,
                                        messages=[user(QUESTION)], extra_body=GREEDY) as stream:
        pieces = [event.delta.text for event in stream if event.type == "content_block_delta"]
        final = stream.get_final_message()
    assert blocks(final) == blocks(plain) and "".join(pieces) == text_of(plain)
    assert (final.stop_reason, final.stop_sequence) == (plain.stop_reason, plain.stop_sequence)
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert prompt_tokens(final) == prompt_tokens(plain)


def named_events(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[6:])))
    return events


def test_stream_sends_anthropics_event_sequence(smollm2: Served):
    body = {"model": smollm2.model, "max_tokens": 4, "messages": [user(QUESTION)], "stream": True,
            "metadata": {"user_id": "u-1"}, **GREEDY}
    headers = {"x-api-key": "unused", "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", smollm2.url + "/v1/messages", json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = named_events(response)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "content_block_start"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in events)
    opening = events[0][1]["message"]
    assert (opening["content"], opening["stop_reason"], opening["usage"]["output_tokens"]) == ([], None, 0)
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 4


@pytest.mark.parametrize(("model", "choice"), [("smollm2", {"type": "any", "disable_parallel_tool_use": True}),
                                               ("hybrid", {"type": "tool", "name": "clock"})])
def test_forced_tool_use_streams_the_same_call(request: pytest.FixtureRequest, model: str, choice: dict):
    served = request.getfixturevalue(model)
    body = {"model": served.model, "max_tokens": CALL_TOKENS, "tools": TOOLS, "tool_choice": choice,
            "messages": [user("What is the weather in Rome?")], "extra_body": GREEDY}
    message = served.client.messages.create(**body)
    [call] = message.content
    assert call.type == "tool_use" and call.id.startswith("toolu_") and message.stop_reason == "tool_use"
    assert call.name == choice.get("name", call.name) and list(call.input) == [ARGUMENT_OF[call.name]]
    with served.client.messages.stream(**body) as stream:
        fragments = [event.delta.partial_json for event in stream
                     if event.type == "content_block_delta" and event.delta.type == "input_json_delta"]
        final = stream.get_final_message()
    assert [(block.type, block.name, block.input) for block in final.content] == [("tool_use", call.name, call.input)]
    assert json.loads("".join(fragments)) == call.input
    assert (final.stop_reason, final.usage.output_tokens) == (message.stop_reason, message.usage.output_tokens)


def test_a_repeated_call_ends_the_message_with_one_tool_use(smollm2: Served):
    """SmolLM2 asked about Rome under `any` (parallel calls allowed) calls weather for Rome twice: the message ends
    at the repeat, with one tool_use block, streamed or not."""
    body = {"model": smollm2.model, "max_tokens": 200, "tools": TOOLS, "tool_choice": {"type": "any"},
            "messages": [user("What is the weather in Rome?")], "extra_body": GREEDY}
    message = smollm2.client.messages.create(**body)
    assert [(block.type, block.name, block.input) for block in message.content] == [
        ("tool_use", "weather", {"city": "Rome"})]
    assert message.stop_reason == "tool_use"
    with smollm2.client.messages.stream(**body) as stream:
        starts = [event.content_block.type for event in stream if event.type == "content_block_start"]
        final = stream.get_final_message()
    assert starts == ["tool_use"]
    assert (blocks(final), final.stop_reason, final.usage.output_tokens) == \
        (blocks(message), "tool_use", message.usage.output_tokens)


def test_tool_choice_none_keeps_the_tools_in_the_prompt(smollm2: Served):
    messages = [user("What is the weather in Rome?")]
    auto = smollm2.client.messages.count_tokens(model=smollm2.model, tools=TOOLS, messages=messages,
                                                tool_choice={"type": "auto"})
    none = smollm2.client.messages.count_tokens(model=smollm2.model, tools=TOOLS, messages=messages,
                                                tool_choice={"type": "none"})
    assert none.input_tokens == auto.input_tokens
    message = smollm2.client.messages.create(model=smollm2.model, max_tokens=8, tools=TOOLS, messages=messages,
                                             tool_choice={"type": "none"}, extra_body=GREEDY)
    assert prompt_tokens(message) == auto.input_tokens
    assert [block.type for block in message.content] == ["text"] and "<tool_call>" not in text_of(message)


def test_content_blocks_are_the_same_however_a_call_is_split():
    arguments = '{"city":"Rome","days":2}'
    whole = [ChoiceDelta(0, reasoning="Hm."), ChoiceDelta(0, content="Checking."),
             ChoiceDelta(0, tool_calls=[ToolCallDelta(0, "call_a1", "weather", arguments)])]
    pieces = [ChoiceDelta(0, reasoning="H"), ChoiceDelta(0, reasoning="m."), ChoiceDelta(0, content="Checking."),
              ChoiceDelta(0, tool_calls=[ToolCallDelta(0, "call_a1", "weather", "")]),
              ChoiceDelta(0, tool_calls=[ToolCallDelta(0, None, None, '{"city":"Rome"')]),
              ChoiceDelta(0, tool_calls=[ToolCallDelta(0, None, None, ',"days":2'), ToolCallDelta(0, None, None, "}")])]
    expected = [{"type": "thinking", "thinking": "Hm.", "signature": ""}, {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_a1", "name": "weather", "input": {"city": "Rome", "days": 2}}]
    for deltas in (whole, pieces):
        blocks = ContentBlocks()
        events = [event for delta in deltas for event in blocks.feed(delta)] + blocks.close()
        assert blocks.blocks == expected
        bounds = [(event["type"], event["index"]) for event in events if event["type"] != "content_block_delta"]
        assert bounds == [(kind, index) for index in range(3) for kind in ("content_block_start", "content_block_stop")]
        fragments = [event["delta"]["partial_json"] for event in events
                     if event["type"] == "content_block_delta" and event["index"] == 2]
        assert "".join(fragments) == arguments and "" not in fragments


# Each turn forces one call: (Anthropic tool_choice, OpenAI tool_choice, the tool's result, what the user adds).
TOOL_TURNS = [
    ({"type": "tool", "name": "weather"}, {"type": "function", "function": {"name": "weather"}}, "Sunny, 24 C", None),
    ({"type": "tool", "name": "clock"}, {"type": "function", "function": {"name": "clock"}}, "14:05", "And Oslo?"),
    ({"type": "any"}, "required", None, None),
]


def test_tool_conversation_makes_the_calls_of_the_chat_completion(hybrid: Served):
    question = "What is the weather in Rome, and the time there?"
    conversation, chat_messages = [user(question)], [user(question)]
    for anthropic_choice, openai_choice, result, follow_up in TOOL_TURNS:
        message = hybrid.client.messages.create(
            model=hybrid.model, max_tokens=CALL_TOKENS, tools=TOOLS, messages=conversation,
            tool_choice={**anthropic_choice, "disable_parallel_tool_use": True}, extra_body=GREEDY)
        chat = chat_completion(hybrid, chat_messages, CALL_TOKENS, tools=OPENAI_TOOLS, tool_choice=openai_choice,
                               parallel_tool_calls=False)
        assert prompt_tokens(message) == chat["usage"]["prompt_tokens"]
        [use] = message.content
        reply = chat["choices"][0]["message"]
        [call] = reply["tool_calls"]
        assert (use.type, use.name, use.input) == ("tool_use", call["function"]["name"],
                                                   json.loads(call["function"]["arguments"]))
        assert (message.stop_reason, chat["choices"][0]["finish_reason"]) == ("tool_use", "tool_calls")
        if result is None:
            break
        extra = [{"type": "text", "text": follow_up}] if follow_up else []
        conversation += [{"role": "assistant", "content": message.content},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                       "content": result}, *extra]}]
        chat_messages += [reply, {"role": "tool", "tool_call_id": call["id"], "content": result}]
        chat_messages += [user(follow_up)] if follow_up else []


def test_count_tokens_equals_the_chat_prompt(smollm2: Served):
    messages = [
        user("Weather in Rome?"),
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "weather",
                                           "input": {"city": "Rome"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                      "content": [{"type": "text", "text": "no data"}]}]},
    ]
    counted = smollm2.client.messages.count_tokens(model=smollm2.model, system=SYSTEM, tools=TOOLS,
                                                   messages=messages)
    call = {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}
    chat = chat_completion(smollm2, [
        {"role": "system", "content": SYSTEM}, user("Weather in Rome?"),
        {"role": "assistant", "content": "Let me check.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: no data"},
    ], 1, tools=OPENAI_TOOLS)
    assert counted.input_tokens == chat["usage"]["prompt_tokens"]


def test_thinking_blocks_in_the_history_become_reasoning(hybrid: Served):
    thought = "The user wants the weather in Rome."
    call = {"type": "tool_use", "id": "toolu_7", "name": "weather", "input": {"city": "Rome"}}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_7", "content": "Sunny"}]}

    def count(assistant_blocks: list[dict]) -> int:
        messages = [user("Weather in Rome?"), {"role": "assistant", "content": assistant_blocks}, result]
        return hybrid.client.messages.count_tokens(model=hybrid.model, tools=TOOLS, messages=messages).input_tokens

    chat = chat_completion(hybrid, [
        user("Weather in Rome?"),
        {"role": "assistant", "content": None, "reasoning_content": thought,
         "tool_calls": [{"id": "toolu_7", "type": "function",
                         "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_7", "content": "Sunny"},
    ], 1, tools=OPENAI_TOOLS)
    with_thinking = count([{"type": "thinking", "thinking": thought, "signature": ""}, call])
    assert with_thinking == chat["usage"]["prompt_tokens"] > count([call])


def test_thinking_config_turns_thinking_blocks_on_and_off(hybrid: Served):
    request = {"model": hybrid.model, "max_tokens": 16, "messages": [user("Hi")], "extra_body": GREEDY}
    thinking = hybrid.client.messages.create(**request, thinking={"type": "enabled", "budget_tokens": 1024})
    reasoned = chat_completion(hybrid, [user("Hi")], 16, chat_template_kwargs={"enable_thinking": True})
    [block, *_] = thinking.content
    assert (block.type, block.signature) == ("thinking", "")
    assert block.thinking == reasoned["choices"][0]["message"]["reasoning_content"]
    assert text_of(thinking) == (reasoned["choices"][0]["message"]["content"] or "")
    with hybrid.client.messages.stream(**request, thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        pieces = [event.delta.thinking for event in stream
                  if event.type == "content_block_delta" and event.delta.type == "thinking_delta"]
        assert blocks(stream.get_final_message()) == blocks(thinking)
    assert "".join(pieces) == block.thinking
    unthinking = hybrid.client.messages.create(**request, thinking={"type": "disabled"})
    direct = chat_completion(hybrid, [user("Hi")], 16, chat_template_kwargs={"enable_thinking": False})
    assert [item["type"] for item in blocks(unthinking)] == ["text"]
    assert text_of(unthinking) == direct["choices"][0]["message"]["content"]


def test_errors_come_in_anthropics_envelope(smollm2: Served):
    import anthropic

    client = smollm2.client
    with pytest.raises(anthropic.BadRequestError) as missing:
        client.post("/v1/messages", cast_to=object, body={"model": smollm2.model, "messages": [user("Hi")]})
    assert missing.value.body["type"] == "error" and missing.value.type == "invalid_request_error"
    assert "max_tokens" in missing.value.api_message
    for stream in (False, True):     # a stream refused before its first byte answers with the status
        with pytest.raises(anthropic.BadRequestError) as overflow:
            client.messages.create(model=smollm2.model, max_tokens=4, messages=[user("word " * 1100)], stream=stream)
        assert overflow.value.type == "invalid_request_error" and "context length" in overflow.value.api_message
    with pytest.raises(anthropic.BadRequestError) as forced:
        client.messages.create(model=smollm2.model, max_tokens=4, messages=[user("Hi")], tools=TOOLS,
                               tool_choice={"type": "any"}, thinking={"type": "enabled", "budget_tokens": 1024})
    assert "thinking may not be enabled" in forced.value.api_message
    misplaced = {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}}
    with pytest.raises(anthropic.BadRequestError) as wrong_role:
        client.messages.create(model=smollm2.model, max_tokens=4, messages=[{"role": "user", "content": [misplaced]}])
    assert "a user message cannot hold a tool_use block" in wrong_role.value.api_message


async def test_refusals_before_the_route_come_in_anthropics_envelope():
    app = create_app(ModelCatalog(), ServerSettings(api_keys=["secret"], max_body_bytes=400))
    client = app.test_client()
    body = {"model": "m", "max_tokens": 4, "messages": [user("Hi")]}
    key = {"x-api-key": "secret", "anthropic-version": "2023-06-01"}

    async def refusal(path: str, payload: dict, headers: dict) -> tuple[int, dict]:
        response = await client.post(path, json=payload, headers=headers)
        return response.status_code, await response.get_json()

    status, envelope = await refusal("/v1/messages", body, {"x-api-key": "wrong"})
    assert (status, envelope) == (401, {"type": "error", "error": {"type": "authentication_error",
                                                                    "message": "invalid or missing API key"}})
    status, envelope = await refusal("/v1/messages", {**body, "system": "x" * 500}, key)
    assert (status, envelope["error"]["type"]) == (413, "request_too_large")
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        status, envelope = await refusal(path, body, key)
        assert (status, envelope["error"]["type"]) == (404, "not_found_error")
    # The OpenAI routes keep their own envelope.
    status, envelope = await refusal("/v1/chat/completions", body, {"x-api-key": "wrong"})
    assert (status, envelope["error"]["code"]) == (401, "invalid_api_key")
    app.basert_state.draining = True
    status, envelope = await refusal("/v1/messages", body, key)
    assert (status, envelope["error"]["type"]) == (503, "overloaded_error")
