"""Chat requests as agents and llama.cpp clients send them, through a real server: assistant prefill,
add_generation_prompt and continue_final_message, constrained output (GBNF grammar, json_schema, response_format
with a schema), n_predict, the shape of a streamed answer, tool calls streamed in fragments, parallel_tool_calls
and the per-turn limit of calls, and conversations a template refuses."""

from __future__ import annotations

import json

import httpx
import pytest

from basert.chat.tool_calls import MAX_TOOL_CALLS_PER_TURN, OPEN_TAG
from basert.testing.launcher import ServerProcess

SYSTEM = "You are a terse assistant."
QUESTION = "Name a colour of the sky."
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}


def smollm2_prompt(*turns: tuple[str, str], open_assistant: bool = True) -> str:
    """SmolLM2's chat format written out by hand: the reference for what the server renders."""
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return text + ("<|im_start|>assistant\n" if open_assistant else "")


def chat(server: ServerProcess, messages: list[dict], **fields) -> httpx.Response:
    body = {"messages": messages, "temperature": 0, "max_tokens": 12, **fields}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


def complete(server: ServerProcess, prompt: str, max_tokens: int = 12) -> dict:
    response = httpx.post(f"{server.url}/v1/completions", timeout=120,
                          json={"prompt": prompt, "temperature": 0, "max_tokens": max_tokens})
    response.raise_for_status()
    return response.json()


def stream_chunks(server: ServerProcess, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    return chunks


def error_of(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


# --- prefill and the generation prompt -------------------------------------------------------------

def test_a_final_assistant_message_is_continued(smollm2_server: ServerProcess):
    prefill = "The sky is"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
                {"role": "assistant", "content": prefill}]
    answer = chat(smollm2_server, messages).json()
    expected = complete(smollm2_server, smollm2_prompt(("system", SYSTEM), ("user", QUESTION)) + prefill)
    assert answer["choices"][0]["message"]["content"] == expected["choices"][0]["text"]
    assert answer["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]
    # The same with the field said out loud.
    explicit = chat(smollm2_server, messages, continue_final_message=True).json()
    assert explicit["choices"][0]["message"] == answer["choices"][0]["message"]


def test_continue_final_message_false_closes_the_assistant_turn(smollm2_server: ServerProcess):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
                {"role": "assistant", "content": "Blue."}]
    answer = chat(smollm2_server, messages, continue_final_message=False).json()
    expected = complete(smollm2_server, smollm2_prompt(("system", SYSTEM), ("user", QUESTION), ("assistant", "Blue.")))
    assert answer["choices"][0]["message"]["content"] == expected["choices"][0]["text"]
    assert answer["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]


def test_add_generation_prompt_false_leaves_the_turn_unopened(smollm2_server: ServerProcess):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    answer = chat(smollm2_server, messages, add_generation_prompt=False).json()
    expected = complete(smollm2_server, smollm2_prompt(("system", SYSTEM), ("user", QUESTION), open_assistant=False))
    assert answer["choices"][0]["message"]["content"] == expected["choices"][0]["text"]
    assert answer["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]


def test_continuing_a_user_message_is_a_400(smollm2_server: ServerProcess):
    error = error_of(chat(smollm2_server, [{"role": "user", "content": QUESTION}], continue_final_message=True))
    assert error["param"] == "continue_final_message"


def test_a_conversation_the_template_refuses_is_a_400(hybrid_server: ServerProcess):
    # Qwen3.5's template allows a system message only at the start.
    messages = [{"role": "user", "content": QUESTION}, {"role": "system", "content": SYSTEM}]
    error = error_of(chat(hybrid_server, messages))
    assert "System message must be at the beginning" in error["message"]
    assert error["type"] == "invalid_request_error"


# --- constrained output ------------------------------------------------------------------------------

def test_gbnf_grammar_constrains_the_answer(smollm2_server: ServerProcess):
    grammar = 'root ::= ("yes" | "no") "."'
    messages = [{"role": "user", "content": "Is the sky blue?"}]
    answer = chat(smollm2_server, messages, grammar=grammar, max_tokens=8).json()
    assert answer["choices"][0]["message"]["content"] in ("yes.", "no.")
    assert answer["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("constraint", [
    {"json_schema": {"type": "object", "properties": {"colour": {"enum": ["blue", "grey"]}},
                     "required": ["colour"], "additionalProperties": False}},
    {"response_format": {"type": "json_object", "schema": {
        "type": "object", "properties": {"colour": {"enum": ["blue", "grey"]}}, "required": ["colour"],
        "additionalProperties": False}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "sky", "schema": {
        "type": "object", "properties": {"colour": {"enum": ["blue", "grey"]}}, "required": ["colour"],
        "additionalProperties": False}}}},
], ids=["json_schema", "response_format-schema", "response_format-json_schema"])
def test_schema_forms_constrain_the_answer(smollm2_server: ServerProcess, constraint: dict):
    answer = chat(smollm2_server, [{"role": "user", "content": QUESTION}], max_tokens=24, **constraint).json()
    assert json.loads(answer["choices"][0]["message"]["content"])["colour"] in ("blue", "grey")


@pytest.mark.parametrize("fields", [
    {"grammar": "root ::= ("},
    {"grammar": ""},
    {"json_schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}},
    {"response_format": {"type": "json_object", "schema": {"type": 7}}},
    {"grammar": 'root ::= "a"', "json_schema": {"type": "object"}},
], ids=["bad-gbnf", "empty-gbnf", "bad-schema", "bad-format-schema", "two-constraints"])
def test_an_invalid_constraint_is_a_400_never_ignored(smollm2_server: ServerProcess, fields: dict):
    error_of(chat(smollm2_server, [{"role": "user", "content": QUESTION}], **fields))
    # Completions take the same fields.
    response = httpx.post(f"{smollm2_server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4, **fields},
                          timeout=60)
    error_of(response)


def test_completions_follow_a_grammar(smollm2_server: ServerProcess):
    response = httpx.post(f"{smollm2_server.url}/v1/completions", timeout=60,
                          json={"prompt": "The answer is", "max_tokens": 8, "temperature": 0,
                                "grammar": 'root ::= " " [0-9] [0-9]'})
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["text"]
    assert len(text) == 3 and text[0] == " " and text[1:].isdigit()


def test_n_predict_is_max_tokens(smollm2_server: ServerProcess):
    answer = chat(smollm2_server, [{"role": "user", "content": "Tell me a long story."}], max_tokens=None,
                  n_predict=3, ignore_eos=True).json()
    assert answer["usage"]["completion_tokens"] == 3
    assert answer["choices"][0]["finish_reason"] == "length"


# --- streaming ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["smollm2_server", "hybrid_server"])
def test_a_stream_opens_with_the_role_and_never_sends_empty_content(name: str, request: pytest.FixtureRequest):
    server = request.getfixturevalue(name)
    body = {"messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 12}
    chunks = stream_chunks(server, body)
    first = chunks[0]["choices"][0]["delta"]
    assert first["role"] == "assistant" and first.get("content") is None
    for chunk in chunks:
        for choice in chunk["choices"]:
            assert choice["delta"].get("content", None) != ""
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    whole = chat(server, body["messages"]).json()["choices"][0]["message"]["content"]
    assert streamed == whole


# --- tool calls --------------------------------------------------------------------------------------

def tool_request(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "What is the weather in Oslo and in Paris?"}],
            "tools": [WEATHER], "temperature": 0, "max_tokens": 400, **fields}


def calls_of(answer: dict) -> list[tuple[str, str]]:
    message = answer["choices"][0]["message"]
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]


def test_parallel_tool_calls_false_makes_one_call(smollm2_server: ServerProcess):
    response = httpx.post(f"{smollm2_server.url}/v1/chat/completions", timeout=120,
                          json=tool_request(tool_choice="required", parallel_tool_calls=False))
    answer = response.json()
    assert len(calls_of(answer)) == 1
    assert answer["choices"][0]["finish_reason"] == "tool_calls"


def test_required_calls_stop_at_the_per_turn_limit(smollm2_server: ServerProcess):
    """SmolLM2 asked about several days keeps opening calls for one more day while more are allowed: calls of the
    same name with other arguments are all kept, and the turn ends at the limit, as a tool_calls finish, never by
    running into max_tokens."""
    question = "What's the weather like in Berlin for the next 3 days?"
    body = tool_request(messages=[{"role": "user", "content": question}], tool_choice="required")
    answer = httpx.post(f"{smollm2_server.url}/v1/chat/completions", json=body, timeout=300).json()
    assert calls_of(answer) == [("get_weather", json.dumps({"city": "Berlin", "days": days}, separators=(",", ":")))
                                for days in range(1, MAX_TOOL_CALLS_PER_TURN + 1)]
    assert answer["choices"][0]["finish_reason"] == "tool_calls"


# SmolLM2 asked about one city under `required` calls get_weather for it, then again with the same arguments.
ONE_CITY = [{"role": "user", "content": "What is the weather in Oslo?"}]
OSLO_CALL = ("get_weather", '{"city":"Oslo","days":1}')


def test_a_repeated_call_ends_the_turn_and_is_neither_returned_nor_streamed(smollm2_server: ServerProcess):
    body = tool_request(messages=ONE_CITY, tool_choice="required")
    answer = httpx.post(f"{smollm2_server.url}/v1/chat/completions", json=body, timeout=120).json()
    assert calls_of(answer) == [OSLO_CALL]
    assert answer["choices"][0]["finish_reason"] == "tool_calls"
    assert answer["choices"][0]["message"]["content"] is None
    chunks = stream_chunks(smollm2_server, body)
    pieces = [d for c in chunks for ch in c["choices"] for d in ch["delta"].get("tool_calls") or []]
    assert [(piece["index"], piece.get("id") is not None) for piece in pieces][:1] == [(0, True)]
    assert {piece["index"] for piece in pieces} == {0} and len([piece for piece in pieces if "id" in piece]) == 1
    assert "".join(piece["function"]["arguments"] for piece in pieces) == OSLO_CALL[1]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks if c["choices"])


def apply_template(server: ServerProcess, body: dict) -> str:
    response = httpx.post(f"{server.url}/apply-template", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["prompt"]


def test_tool_choice_none_keeps_the_tools_in_the_prompt_and_forbids_a_call(smollm2_server: ServerProcess):
    """A `none` turn has the prompt of an `auto` turn, so it reuses what that turn left in the cache. Pushed towards
    `<` (SmolLM2 then opens a call under `auto`), it cannot write the call's opening."""
    body = tool_request(messages=ONE_CITY)
    prompt = apply_template(smollm2_server, {**body, "tool_choice": "auto"})
    assert apply_template(smollm2_server, {**body, "tool_choice": "none"}) == prompt
    assert '"name": "get_weather"' in prompt
    auto = chat(smollm2_server, ONE_CITY, tools=[WEATHER], tool_choice="auto", max_tokens=8).json()
    none = chat(smollm2_server, ONE_CITY, tools=[WEATHER], tool_choice="none", max_tokens=8).json()
    assert none["usage"]["prompt_tokens"] == auto["usage"]["prompt_tokens"]
    assert none["usage"]["prompt_tokens_details"]["cached_tokens"] == none["usage"]["prompt_tokens"] - 1
    less_than = {str(token): 5 for token in smollm2_server_tokens(smollm2_server, "<")}
    pushed = {"tools": [WEATHER], "max_tokens": 24, "logit_bias": less_than}
    auto = chat(smollm2_server, ONE_CITY, tool_choice="auto", **pushed).json()["choices"][0]["message"]
    assert auto["content"].startswith(OPEN_TAG)
    none = chat(smollm2_server, ONE_CITY, tool_choice="none", **pushed).json()["choices"][0]
    assert none["message"]["content"].startswith("<") and OPEN_TAG not in none["message"]["content"]
    assert "tool_calls" not in none["message"]


def smollm2_server_tokens(server: ServerProcess, text: str) -> list[int]:
    response = httpx.post(f"{server.url}/tokenize", json={"content": text}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_tool_choice_none_leaves_a_response_format_to_shape_the_output(smollm2_server: ServerProcess):
    schema = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}}, "required": ["city"],
              "additionalProperties": False}
    answer = chat(smollm2_server, ONE_CITY, tools=[WEATHER], tool_choice="none", max_tokens=24, json_schema=schema)
    assert json.loads(answer.json()["choices"][0]["message"]["content"]) == {"city": "Oslo"}


def test_streamed_tool_calls_come_as_a_head_then_argument_fragments(smollm2_server: ServerProcess):
    body = tool_request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    chunks = stream_chunks(smollm2_server, body)
    pieces = [d for c in chunks for ch in c["choices"] for d in ch["delta"].get("tool_calls") or []]
    assert pieces[0]["id"] and pieces[0]["function"]["name"] == "get_weather"
    assert all("id" not in piece for piece in pieces[1:])
    # More than one fragment: the arguments went out as they were generated.
    assert len([piece for piece in pieces if piece["function"]["arguments"]]) > 1
    streamed = "".join(piece["function"]["arguments"] for piece in pieces)
    answer = httpx.post(f"{smollm2_server.url}/v1/chat/completions", json=body, timeout=120).json()
    assert [("get_weather", streamed)] == calls_of(answer)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
