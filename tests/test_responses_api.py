"""OpenAI's Responses API end to end: the `openai` SDK's `client.responses` against a real `basert serve` on loopback,
checked against /v1/chat/completions with the equivalent messages (the same chat driver answers both)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter

from basert.server.errors import ApiError
from basert.server.response_store import ResponseStore
from basert.testing.client import error_envelope, post
from basert.testing.launcher import ServerProcess

QUESTION = "What is the weather and the time in Paris?"
TOOLS = [
    {"type": "function", "name": "weather", "description": "The weather in a city", "strict": True,
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                    "additionalProperties": False}},
    {"type": "function", "name": "clock", "description": "The local time in a city", "strict": True,
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                    "additionalProperties": False}},
]
CHAT_TOOLS = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
              for t in TOOLS]
# Per turn: the tool_choice (Responses form), and what the called tool answers.
TURNS = [({"type": "function", "name": "weather"}, "sunny"), ({"type": "function", "name": "clock"}, "noon"),
         ("required", None)]
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)
# A forced call is about 25 SmolLM2 tokens (`<tool_call>` and `</tool_call>` are plain text to it).
CALL_TOKENS = 32


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def items_of(response) -> list[tuple]:
    """A response's output items without their ids: (type, status, text or name and arguments)."""
    described = []
    for item in response.output:
        if item.type == "message":
            described.append(("message", item.status, [part.text for part in item.content]))
        elif item.type == "reasoning":
            described.append(("reasoning", item.status, [part.text for part in item.content]))
        else:
            described.append((item.type, item.status, item.name, item.arguments))
    return described


def calls_of(response) -> list[tuple[str, str]]:
    return [(item.name, item.arguments) for item in response.output if item.type == "function_call"]


def stream_events(server: ServerProcess, body: dict) -> list[dict]:
    """The events of a streamed response, each checked against the SDK's event types and its SSE event name."""
    events = []
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=300) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
                assert events[-1]["type"] == name
                STREAM_EVENT.validate_python(events[-1])
    return events


def test_text_input_answers_as_chat_does(smollm2_server: ServerProcess):
    client = client_of(smollm2_server)
    response = client.responses.create(model="model", input="Name one color.", max_output_tokens=16, temperature=0)
    chat = client.chat.completions.create(model="model", messages=[{"role": "user", "content": "Name one color."}],
                                          max_tokens=16, temperature=0)
    assert response.id.startswith("resp_") and response.object == "response"
    assert [item.type for item in response.output] == ["message"]
    message = response.output[0]
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert response.output_text == chat.choices[0].message.content
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert (response.temperature, response.max_output_tokens, response.store) == (0, 16, True)


def test_items_and_instructions_are_the_chat_conversation(smollm2_server: ServerProcess):
    client = client_of(smollm2_server)
    items = [
        {"role": "user", "content": "Hi!"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name one fruit."}]},
    ]
    response = client.responses.create(model="model", instructions="You are terse.", input=items,
                                       max_output_tokens=16, temperature=0, metadata={"case": "items"})
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name one fruit."}]
    chat = client.chat.completions.create(model="model", messages=messages, max_tokens=16, temperature=0)
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content
    assert response.instructions == "You are terse." and response.metadata == {"case": "items"}


def test_stream_agrees_with_the_complete_response_and_both_end_incomplete(smollm2_server: ServerProcess):
    client = client_of(smollm2_server)
    body = {"model": "model", "input": "Write a long story about a dragon.", "instructions": "You are a poet.",
            "max_output_tokens": 16, "temperature": 0}
    whole = client.responses.create(**body)
    assert (whole.status, whole.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert whole.usage.output_tokens == 16
    assert items_of(whole) == [("message", "incomplete", [whole.output_text])]
    events = stream_events(smollm2_server, body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:4]] == ["response.created", "response.in_progress",
                                               "response.output_item.added", "response.content_part.added"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert [e["type"] for e in events[-4:]] == ["response.output_text.done", "response.content_part.done",
                                                "response.output_item.done", "response.incomplete"]
    final = Response.model_validate(events[-1]["response"])
    assert final.id == events[0]["response"]["id"]
    assert items_of(final) == items_of(whole)
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == events[-4]["text"] == whole.output_text
    assert (final.status, final.incomplete_details, final.usage.output_tokens) == \
        (whole.status, whole.incomplete_details, whole.usage.output_tokens)


def chat_turns(client: openai.OpenAI) -> tuple[list[list[tuple[str, str]]], list[int]]:
    """The tool conversation through /v1/chat/completions: each turn's calls, and each turn's prompt tokens."""
    messages: list[dict] = [{"role": "user", "content": QUESTION}]
    calls, prompt_tokens = [], []
    for choice, result in TURNS:
        chat_choice = choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice["name"]}}
        chat = client.chat.completions.create(model="model", messages=messages, tools=CHAT_TOOLS,
                                              tool_choice=chat_choice, parallel_tool_calls=False,
                                              max_tokens=CALL_TOKENS, temperature=0)
        message = chat.choices[0].message
        calls.append([(c.function.name, c.function.arguments) for c in message.tool_calls])
        prompt_tokens.append(chat.usage.prompt_tokens)
        messages.append({"role": "assistant", "content": message.content,
                         "tool_calls": [c.model_dump() for c in message.tool_calls]})
        messages += [{"role": "tool", "tool_call_id": c.id, "content": result} for c in message.tool_calls]
    return calls, prompt_tokens


def response_turns(client: openai.OpenAI, chained: bool) -> list:
    """The tool conversation through /v1/responses: the whole item list each turn, or only the new items after
    `previous_response_id`."""
    items: list[dict] = [{"role": "user", "content": QUESTION}]
    responses = []
    for choice, result in TURNS:
        previous = responses[-1].id if (chained and responses) else None
        response = client.responses.create(model="model", input=items, previous_response_id=previous, tools=TOOLS,
                                           tool_choice=choice, parallel_tool_calls=False,
                                           max_output_tokens=CALL_TOKENS, temperature=0)
        responses.append(response)
        outputs = [{"type": "function_call_output", "call_id": call_id, "output": result}
                   for call_id in (item.call_id for item in response.output if item.type == "function_call")]
        answer = [item.model_dump(exclude_none=True) for item in response.output]
        items = outputs if chained else [*items, *answer, *outputs]
    return responses


def test_forced_tool_calls_equal_chat_by_items_and_by_previous_response(smollm2_server: ServerProcess):
    client = client_of(smollm2_server)
    chat_calls, chat_prompts = chat_turns(client)
    assert [[name for name, _ in turn] for turn in chat_calls] == [["weather"], ["clock"], [chat_calls[2][0][0]]]
    for chained in (False, True):
        responses = response_turns(client, chained)
        assert [calls_of(r) for r in responses] == chat_calls
        assert [r.usage.input_tokens for r in responses] == chat_prompts
    for response, (choice, _) in zip(responses, TURNS):
        assert [item.type for item in response.output] == ["function_call"]
        call = response.output[0]
        assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
        assert set(json.loads(call.arguments)) == {"city"}
        echoed = response.tool_choice
        assert response.status == "completed"
        assert (echoed if isinstance(echoed, str) else echoed.model_dump(exclude_none=True)) == choice
    # The SDK's stream helper assembles the same first turn from the events.
    first = {"model": "model", "input": QUESTION, "tools": TOOLS, "tool_choice": TURNS[0][0],
             "parallel_tool_calls": False, "max_output_tokens": CALL_TOKENS, "temperature": 0}
    with client.responses.stream(**first) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    assert items_of(streamed) == items_of(responses[0])
    assert streamed.output[0].parsed_arguments == json.loads(streamed.output[0].arguments)
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == streamed.output[0].arguments
    # Chained, each turn's prompt starts with the previous one: the slot serves that part from its cache.
    for before, after in zip(responses, responses[1:]):
        assert after.previous_response_id == before.id
        assert after.usage.input_tokens_details.cached_tokens >= before.usage.input_tokens - 1 > 0


def test_a_repeated_call_ends_the_response_completed(smollm2_server: ServerProcess):
    """SmolLM2 asked about Rome under `required` calls weather for it twice with the same arguments: the response
    ends at the repeat, completed, with one call, and the stream never opens a second."""
    body = {"model": "model", "input": "What is the weather in Rome?", "tools": TOOLS, "tool_choice": "required",
            "temperature": 0}
    response = client_of(smollm2_server).responses.create(**body)
    assert response.status == "completed"
    assert items_of(response) == [("function_call", "completed", "weather", '{"city":"Rome"}')]
    events = stream_events(smollm2_server, body)
    assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"] == ["function_call"]
    final = Response.model_validate(events[-1]["response"])
    assert (events[-1]["type"], items_of(final)) == ("response.completed", items_of(response))


def test_tool_choice_none_keeps_the_tools_in_the_prompt(smollm2_server: ServerProcess):
    """A turn with tool_choice none has the prompt of one that may call, so it reuses that one's cached prefix."""
    client = client_of(smollm2_server)
    body = {"model": "model", "input": "What is the weather in Rome?", "tools": TOOLS, "max_output_tokens": 8,
            "temperature": 0}
    auto = client.responses.create(**body, tool_choice="auto")
    none = client.responses.create(**body, tool_choice="none")
    assert none.usage.input_tokens == auto.usage.input_tokens
    assert none.usage.input_tokens_details.cached_tokens == none.usage.input_tokens - 1
    assert [item.type for item in none.output] == ["message"] and "<tool_call>" not in none.output_text


def test_stored_responses(smollm2_server: ServerProcess):
    client = client_of(smollm2_server)
    kept = client.responses.create(model="model", input="Name one color.", max_output_tokens=16, temperature=0)
    fetched = Response.model_validate(httpx.get(f"{smollm2_server.url}/v1/responses/{kept.id}").json())
    assert fetched.model_dump() == kept.model_dump() == client.responses.retrieve(kept.id).model_dump()
    follow = client.responses.create(model="model", previous_response_id=kept.id, input="Another one.",
                                     max_output_tokens=16, temperature=0)
    assert follow.usage.input_tokens_details.cached_tokens > 0
    unstored = client.responses.create(model="model", input="Name one color.", store=False, max_output_tokens=16,
                                       temperature=0)
    assert unstored.store is False
    for missing in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as raised:
            client.responses.create(model="model", previous_response_id=missing, input="Hi", max_output_tokens=16)
        assert raised.value.body["code"] == "response_not_found"
        assert raised.value.body["param"] == "previous_response_id"
        error_envelope(httpx.get(f"{smollm2_server.url}/v1/responses/{missing}"), 404, "response_not_found")
    # A stream refused before its first byte answers with the error envelope.
    refused = post(smollm2_server.url, "/v1/responses", {"input": "Hi", "previous_response_id": "resp_unknown",
                                                         "stream": True})
    error_envelope(refused, 404, "response_not_found")
    deleted = httpx.delete(f"{smollm2_server.url}/v1/responses/{kept.id}").json()
    assert deleted == {"id": kept.id, "object": "response", "deleted": True}
    error_envelope(httpx.get(f"{smollm2_server.url}/v1/responses/{kept.id}"), 404, "response_not_found")


def test_bad_requests_get_the_error_envelope(smollm2_server: ServerProcess):
    url = smollm2_server.url
    error_envelope(post(url, "/v1/responses", {"input": [{"type": "web_search_call", "id": "ws_1"}]}), 400)
    error_envelope(post(url, "/v1/responses", {"input": "Hi", "tools": [{"type": "web_search"}]}), 400)
    error_envelope(post(url, "/v1/responses", {"input": []}), 400)
    error = error_envelope(post(url, "/v1/responses", {"input": "Hi", "tools": TOOLS,
                                                       "tool_choice": {"type": "function", "name": "nope"}}), 400)
    assert error["param"] == "tool_choice"
    error_envelope(post(url, "/v1/responses", {"input": "Hi", "text": {"format": {"type": "json_schema"}}}), 400)


class Color(BaseModel):
    color: str = Field(max_length=8)


def test_text_format_json_schema(smollm2_server: ServerProcess):
    client = client_of(smollm2_server)
    parsed = client.responses.parse(model="model", input="What color is the sky? Answer in JSON.",
                                    text_format=Color, max_output_tokens=24, temperature=0)
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, Color)
    assert json.loads(parsed.output_text) == parsed.output_parsed.model_dump()
    assert parsed.text.format.type == "json_schema"


def test_reasoning_items_on_a_thinking_template(hybrid_server: ServerProcess):
    client = client_of(hybrid_server)
    body = {"model": "model", "input": "Hi", "max_output_tokens": 16, "temperature": 0}
    response = client.responses.create(**body)
    chat = client.chat.completions.create(model="model", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=16, temperature=0)
    reasoning = chat.choices[0].message.model_extra["reasoning_content"]
    assert response.output[0].type == "reasoning" and response.output[0].id.startswith("rs_")
    assert response.output[0].content[0].text == reasoning and reasoning
    assert 0 < response.usage.output_tokens_details.reasoning_tokens <= response.usage.output_tokens
    events = stream_events(hybrid_server, body)
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == reasoning
    assert items_of(Response.model_validate(events[-1]["response"])) == items_of(response)
    # Sent back as an item, the reasoning is the assistant turn's reasoning_content, as a chained request has it.
    answer = [item.model_dump(exclude_none=True) for item in response.output]
    by_items = client.responses.create(**{**body, "input": [{"role": "user", "content": "Hi"}, *answer,
                                                            {"role": "user", "content": "Go on."}]})
    chained = client.responses.create(**{**body, "input": "Go on.", "previous_response_id": response.id})
    assert chained.usage.input_tokens == by_items.usage.input_tokens
    assert items_of(chained) == items_of(by_items)
    plain = client.responses.create(**body, reasoning={"effort": "none"})
    assert [item.type for item in plain.output] in (["message"], [])
    assert plain.usage.output_tokens_details.reasoning_tokens == 0


def test_store_keeps_the_most_recently_used_within_its_bounds():
    store = ResponseStore(max_responses=2)
    for name in ("a", "b"):
        store.put({"id": name}, [{"role": "user", "content": name}])
    assert store.get("a").messages == [{"role": "user", "content": "a"}]     # "a" is now the most recent
    store.put({"id": "c"}, [])
    with pytest.raises(ApiError) as evicted:
        store.get("b", "previous_response_id")
    assert (evicted.value.status, evicted.value.code, evicted.value.param) == (404, "response_not_found",
                                                                               "previous_response_id")
    assert [store.get(name).body["id"] for name in ("a", "c")] == ["a", "c"]
    entries = [({"id": "a"}, [{"role": "user", "content": "a"}]), ({"id": "x"}, [{"role": "user", "content": "x"}])]
    both = ResponseStore()
    for body, messages in entries:
        both.put(body, messages)
    small = ResponseStore(max_bytes=both.total_bytes - 1)
    for body, messages in entries:
        small.put(body, messages)
    assert len(small) == 1 and small.total_bytes == small.get("x").size
    assert small.delete("x") and not small.delete("x") and small.total_bytes == 0
