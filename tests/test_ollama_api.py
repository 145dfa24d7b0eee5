"""Ollama's API through the official `ollama` client against real `basert serve` processes on loopback: SmolLM2 (with
an empty models directory, so that the pullable SmolLM2 can be pulled, listed, used and deleted) and the tiny
Qwen3.5-style hybrid (served with the real Qwen3.5 template, which thinks).

Each answer is checked against what the OpenAI routes answer for the equivalent request at temperature 0 with
Ollama's sampling defaults (top_k 40, top_p 0.9, repeat_penalty 1.1): the same prompt, the same text, the same tool
calls. Every answer is parsed by the client into its own types.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import httpx
import ollama
import pytest
from conftest import HYBRID_CHAT_FLAGS

from basert import __version__
from basert.server.app import ServerSettings, create_app
from basert.server.catalog import ModelCatalog
from basert.testing.client import answer, post
from basert.testing.launcher import ServerProcess
from basert.testing.pool import ServerPool

BODY_LIMIT = 200_000
GREEDY = {"temperature": 0}
# What the OpenAI routes need to sample as Ollama's defaults do.
OLLAMA_DEFAULTS = {"temperature": 0, "top_k": 40, "top_p": 0.9, "repeat_penalty": 1.1}
SYSTEM = "You are a terse assistant."
QUESTION = "Name three colors."
PULLABLE = "HuggingFaceTB/SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# The tool as the client sends it (it puts `required` before `properties`), for the OpenAI routes' equivalent.
WEATHER_AS_SENT = ollama.Tool.model_validate(WEATHER).model_dump(exclude_none=True)
# SmolLM2 (whose template has no tools: it gets BaseRT's tool prompt) calls the tool after seeing a call in the
# conversation written out as text.
FEW_SHOT = [
    {"role": "user", "content": "What is the weather in Oslo?"},
    {"role": "assistant", "content": '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'},
    {"role": "tool", "content": "Sunny, 21 C", "tool_name": "weather"},
    {"role": "assistant", "content": "It is sunny in Oslo, 21 C."},
    {"role": "user", "content": "What is the weather in Paris?"},
]
COLORS = {"type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["colors"], "additionalProperties": False}


@dataclass(frozen=True)
class Served:
    """A server, its model's id, and an `ollama` client for it."""

    url: str
    model: str
    client: ollama.Client


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ollama-models")


@pytest.fixture(scope="module")
def smollm2(smollm2_base: Path, models_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("ollama-smollm2") / "server.log"
    with ServerProcess(smollm2_base, "--max-context", "1024", "--max-body-bytes", str(BODY_LIMIT), log_path=log,
                       env={"BASERT_MODELS_DIR": str(models_dir)}) as server:
        yield Served(server.url, "smollm2", ollama.Client(host=server.url))


@pytest.fixture(scope="module")
def hybrid(qwen35_chat_base: Path, server_pool: ServerPool) -> Served:
    url = server_pool.get(qwen35_chat_base, *HYBRID_CHAT_FLAGS).url
    return Served(url, "qwen35-chat", ollama.Client(host=url))


def chat_completion(served: Served, messages: list[dict], max_tokens: int, **fields) -> dict:
    body = {"model": served.model, "messages": messages, "max_tokens": max_tokens, **OLLAMA_DEFAULTS, **fields}
    return answer(post(served.url, "/v1/chat/completions", body))


def user(text: str) -> dict:
    return {"role": "user", "content": text}


@pytest.fixture(scope="module")
def plain(smollm2: Served) -> ollama.ChatResponse:
    return smollm2.client.chat(smollm2.model, [{"role": "system", "content": SYSTEM}, user(QUESTION)],
                               options={**GREEDY, "num_predict": 12})


def test_chat_equals_the_chat_completion(smollm2: Served, plain: ollama.ChatResponse):
    chat = chat_completion(smollm2, [{"role": "system", "content": SYSTEM}, user(QUESTION)], 12)
    choice = chat["choices"][0]
    assert (plain.model, plain.message.role, plain.done) == (smollm2.model, "assistant", True)
    assert plain.message.content == choice["message"]["content"] and plain.message.tool_calls is None
    assert plain.done_reason == choice["finish_reason"] == "length"
    assert (plain.prompt_eval_count, plain.eval_count) == (chat["usage"]["prompt_tokens"], 12)
    assert plain.total_duration >= plain.prompt_eval_duration + plain.eval_duration > 0
    # options reach the sampler: without the repeat penalty the answer is the OpenAI routes' default one
    unpenalized = smollm2.client.chat(smollm2.model, [{"role": "system", "content": SYSTEM}, user(QUESTION)],
                                      options={**GREEDY, "num_predict": 12, "repeat_penalty": 1.0, "stop": ["\n\n"]})
    openai = chat_completion(smollm2, [{"role": "system", "content": SYSTEM}, user(QUESTION)], 12,
                             repeat_penalty=1.0, stop=["\n\n"])
    assert unpenalized.message.content == openai["choices"][0]["message"]["content"]


def test_logprobs_come_with_the_tokens(smollm2: Served, plain: ollama.ChatResponse):
    scored = smollm2.client.chat(smollm2.model, [{"role": "system", "content": SYSTEM}, user(QUESTION)],
                                 options={**GREEDY, "num_predict": 12}, logprobs=True, top_logprobs=2)
    assert scored.message.content == plain.message.content and len(scored.logprobs) == 12
    assert "".join(item.token for item in scored.logprobs) == plain.message.content
    assert all(len(item.top_logprobs) == 2 and item.top_logprobs[0].token == item.token for item in scored.logprobs)
    parts = list(smollm2.client.chat(smollm2.model, [{"role": "system", "content": SYSTEM}, user(QUESTION)],
                                     options={**GREEDY, "num_predict": 12}, logprobs=True, stream=True))
    assert [item.logprob for part in parts for item in part.logprobs or []] == \
        [item.logprob for item in scored.logprobs]


def test_streamed_chat_equals_the_complete_one(smollm2: Served, plain: ollama.ChatResponse):
    parts = list(smollm2.client.chat(smollm2.model, [{"role": "system", "content": SYSTEM}, user(QUESTION)],
                                     options={**GREEDY, "num_predict": 12}, stream=True))
    *pieces, final = parts
    assert not any(part.done for part in pieces) and final.done and final.message.content == ""
    assert "".join(part.message.content for part in pieces) == plain.message.content
    assert (final.done_reason, final.prompt_eval_count, final.eval_count) == \
        (plain.done_reason, plain.prompt_eval_count, plain.eval_count)
    # Ollama streams unless told not to: newline-delimited JSON objects
    body = {"model": smollm2.model, "messages": [user(QUESTION)], "options": {**GREEDY, "num_predict": 3}}
    with httpx.stream("POST", smollm2.url + "/api/chat", json=body, timeout=60) as response:
        assert response.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in response.iter_lines() if line]
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True]
    assert lines[-1]["eval_count"] == 3


def test_a_tool_call_comes_back_in_ollamas_shape(smollm2: Served):
    openai_turns = [{"role": "tool", "name": m["tool_name"], "content": m["content"]} if m["role"] == "tool" else m
                    for m in FEW_SHOT]
    chat = chat_completion(smollm2, openai_turns, 40, tools=[WEATHER_AS_SENT])
    [call] = chat["choices"][0]["message"]["tool_calls"]
    response = smollm2.client.chat(smollm2.model, FEW_SHOT, tools=[WEATHER], options={**GREEDY, "num_predict": 40})
    [made] = response.message.tool_calls
    assert (made.function.name, made.function.arguments) == ("weather", {"city": "Paris"})
    assert (made.function.name, made.function.arguments) == \
        (call["function"]["name"], json.loads(call["function"]["arguments"]))
    assert response.prompt_eval_count == chat["usage"]["prompt_tokens"]
    assert response.message.content == "" and response.done_reason == "stop"
    parts = list(smollm2.client.chat(smollm2.model, FEW_SHOT, tools=[WEATHER], options={**GREEDY, "num_predict": 40},
                                     stream=True))
    calls = [call for part in parts for call in part.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("weather", {"city": "Paris"})]
    assert parts[-1].done and parts[-1].eval_count == response.eval_count


def test_format_constrains_the_answer_to_json(smollm2: Served):
    request = [user("Name three colors as JSON.")]
    shaped = smollm2.client.chat(smollm2.model, request, format=COLORS, options={**GREEDY, "num_predict": 40})
    colors = json.loads(shaped.message.content)
    assert set(colors) == {"colors"} and len(colors["colors"]) <= 3
    openai = chat_completion(smollm2, request, 40, response_format={
        "type": "json_schema", "json_schema": {"name": "colors", "schema": COLORS}})
    assert shaped.message.content == openai["choices"][0]["message"]["content"]
    anything = smollm2.client.chat(smollm2.model, [user('Give the color of the sky as JSON, like {"color": "..."}.')],
                                   format="json", options={**GREEDY, "num_predict": 200})
    assert anything.done_reason == "stop" and isinstance(json.loads(anything.message.content), dict)


def test_tool_turns_render_as_the_openai_conversation(hybrid: Served):
    """An assistant turn with Ollama's tool calls (arguments as an object, no id) and the tool's answer make the
    prompt of the OpenAI conversation, on a template that renders calls."""
    ollama_turns = [user("Weather in Rome?"),
                    {"role": "assistant", "content": "", "thinking": "Rome, then.",
                     "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Rome"}}}]},
                    {"role": "tool", "content": "Sunny", "tool_name": "weather"}]
    response = hybrid.client.chat(hybrid.model, ollama_turns, tools=[WEATHER], options={**GREEDY, "num_predict": 1})
    chat = chat_completion(hybrid, [
        user("Weather in Rome?"),
        {"role": "assistant", "content": None, "reasoning_content": "Rome, then.",
         "tool_calls": [{"id": "call_1_0", "type": "function",
                         "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1_0", "name": "weather", "content": "Sunny"}], 1,
        tools=[WEATHER_AS_SENT])
    assert response.prompt_eval_count == chat["usage"]["prompt_tokens"]


def test_think_splits_the_thinking_off(hybrid: Served):
    assert "thinking" in hybrid.client.show(hybrid.model).capabilities
    for think in (True, False):
        response = hybrid.client.chat(hybrid.model, [user("Hi")], think=think, options={**GREEDY, "num_predict": 16})
        chat = chat_completion(hybrid, [user("Hi")], 16, chat_template_kwargs={"enable_thinking": think})
        message = chat["choices"][0]["message"]
        assert response.message.thinking == message.get("reasoning_content")
        assert response.message.content == (message["content"] or "")
    assert response.message.thinking is None
    parts = list(hybrid.client.chat(hybrid.model, [user("Hi")], think=True, options={**GREEDY, "num_predict": 16},
                                    stream=True))
    thought = hybrid.client.chat(hybrid.model, [user("Hi")], think=True, options={**GREEDY, "num_predict": 16})
    assert "".join(part.message.thinking or "" for part in parts) == thought.message.thinking != ""
    generated = hybrid.client.generate(hybrid.model, "Hi", think=True, options={**GREEDY, "num_predict": 16})
    assert generated.thinking == thought.message.thinking
    with pytest.raises(ollama.ResponseError) as shaped:
        hybrid.client.chat(hybrid.model, [user("Hi")], think=True, format="json")
    assert shaped.value.status_code == 400 and "think cannot be combined with format" in shaped.value.error


def test_generate_renders_a_one_turn_chat_or_the_raw_prompt(smollm2: Served):
    generated = smollm2.client.generate(smollm2.model, QUESTION, system=SYSTEM, options={**GREEDY, "num_predict": 12})
    chat = chat_completion(smollm2, [{"role": "system", "content": SYSTEM}, user(QUESTION)], 12)
    assert generated.response == chat["choices"][0]["message"]["content"]
    assert generated.prompt_eval_count == chat["usage"]["prompt_tokens"]
    assert len(generated.context) == generated.prompt_eval_count + generated.eval_count
    streamed = list(smollm2.client.generate(smollm2.model, QUESTION, system=SYSTEM, stream=True,
                                            options={**GREEDY, "num_predict": 12}))
    assert "".join(part.response for part in streamed) == generated.response
    assert streamed[-1].context == generated.context

    raw = smollm2.client.generate(smollm2.model, "The capital of France is", raw=True,
                                  options={**GREEDY, "num_predict": 8})
    completion = answer(post(smollm2.url, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8,
                                                              **OLLAMA_DEFAULTS}))
    assert raw.response == completion["choices"][0]["text"] and raw.context is None

    # `context` continues an earlier answer: its token ids, then the new turn's
    follow = smollm2.client.generate(smollm2.model, "And one more?", context=generated.context,
                                     options={**GREEDY, "num_predict": 8})
    turn = answer(post(smollm2.url, "/apply-template", {"messages": [user("And one more?")]}))["prompt"]
    turn_ids = answer(post(smollm2.url, "/v1/tokenize", {"content": turn}))["tokens"]
    continued = answer(post(smollm2.url, "/v1/completions", {"prompt": generated.context + turn_ids,
                                                             "max_tokens": 8, **OLLAMA_DEFAULTS}))
    assert follow.response == continued["choices"][0]["text"]
    assert follow.prompt_eval_count == len(generated.context) + len(turn_ids)


def test_embed_returns_the_embeddings_of_the_openai_route(smollm2: Served):
    embedded = smollm2.client.embed(smollm2.model, ["hello", "world"])
    openai = answer(post(smollm2.url, "/v1/embeddings", {"input": ["hello", "world"]}))
    assert embedded.embeddings == [item["embedding"] for item in openai["data"]]
    assert embedded.prompt_eval_count == openai["usage"]["prompt_tokens"]
    assert smollm2.client.embeddings(smollm2.model, "hello").embedding == embedded.embeddings[0]
    assert smollm2.client.embed(smollm2.model, "hello").embeddings == embedded.embeddings[:1]
    assert smollm2.client.embed(smollm2.model, "").embeddings == []


def test_list_show_ps_version_and_root(smollm2: Served):
    listed = {model.model: model for model in smollm2.client.list().models}
    assert set(listed) >= {"smollm2:latest", f"{PULLABLE}:latest"}
    mine = listed["smollm2:latest"]
    assert mine.size > 0 and len(mine.digest) == 64 and mine.modified_at is not None
    assert (mine.details.format, mine.details.family, mine.details.parameter_size) == ("base", "llama", "134.52M")
    shown = smollm2.client.show("smollm2:latest")
    assert shown.capabilities == ["completion", "tools", "embedding"]
    assert "<|im_start|>" in shown.template and shown.modelinfo["llama.context_length"] == 1024
    assert shown.modelinfo["general.parameter_count"] == 134_515_008 and shown.details == mine.details
    loaded = {model.model: model for model in smollm2.client.ps().models}
    assert loaded["smollm2:latest"].size_vram == 0 and loaded["smollm2:latest"].size > mine.size
    assert loaded["smollm2:latest"].expires_at.year > 2100      # named on the command line: loaded until unloaded
    assert answer(httpx.get(smollm2.url + "/api/version")) == {"version": __version__}
    for method in ("GET", "HEAD"):
        root = httpx.request(method, smollm2.url + "/")
        assert root.status_code == 200 and root.headers["content-type"].startswith("text/plain")
    assert httpx.get(smollm2.url + "/").text == "Ollama is running"


def test_pull_list_use_and_delete_a_pullable_model(smollm2: Served, models_dir: Path):
    client = smollm2.client
    assert next(m for m in client.list().models if m.model == f"{PULLABLE}:latest").size == 0
    with pytest.raises(ollama.ResponseError) as not_pulled:
        client.show(PULLABLE)
    assert not_pulled.value.status_code == 404
    statuses = list(client.pull(PULLABLE, stream=True))
    assert statuses[-1].status == "success" and len(statuses) > 3
    assert all(0 <= s.completed <= s.total for s in statuses if s.total)
    installed = next(models_dir.rglob("model.base"))
    assert next(m for m in client.list().models if m.model == f"{PULLABLE}:latest").size == installed.stat().st_size
    assert client.pull(f"{PULLABLE}:latest", stream=False).status == "success"     # installed: nothing to do
    reply = client.chat(PULLABLE, [user(QUESTION)], options={**GREEDY, "num_predict": 4}, keep_alive="1m")
    assert reply.eval_count == 4
    [entry] = [m for m in client.ps().models if m.model == f"{PULLABLE}:latest"]
    assert entry.expires_at is not None
    assert client.delete(PULLABLE).status == "success" and not installed.exists()
    assert next(m for m in client.list().models if m.model == f"{PULLABLE}:latest").size == 0
    with pytest.raises(ollama.ResponseError) as named:
        client.delete(smollm2.model)
    assert named.value.status_code == 409


def test_load_and_unload_without_a_prompt(smollm2: Served):
    client = smollm2.client
    unloaded = client.generate(smollm2.model, keep_alive=0)
    assert (unloaded.done, unloaded.done_reason) == (True, "unload")
    assert "smollm2:latest" not in {m.model for m in client.ps().models}
    loaded = client.chat(smollm2.model, keep_alive="10m")
    assert (loaded.done, loaded.done_reason, loaded.message.content) == (True, "load", "")
    assert "smollm2:latest" in {m.model for m in client.ps().models}


# (body, status, what the error says) for each route; every answer is Ollama's {"error": "..."}.
CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "options": {"num_predict": 1}}
HOSTILE = [
    ("/api/chat", {**CHAT, "model": "nope"}, 404, "model 'nope' not found"),
    ("/api/chat", {**CHAT, "model": "smollm2:7b"}, 404, "not found"),
    ("/api/chat", {**CHAT, "model": 5}, 400, "model"),
    ("/api/chat", {"messages": CHAT["messages"]}, 400, "model"),
    ("/api/chat", {**CHAT, "messages": "Hi"}, 400, "messages"),
    ("/api/chat", {**CHAT, "messages": [{"role": "robot", "content": "Hi"}]}, 400, "role"),
    ("/api/chat", {**CHAT, "messages": [{"role": "user", "content": "Hi", "images": ["aGk="]}]}, 400, "images"),
    ("/api/chat", {**CHAT, "keep_alive": "forever"}, 400, "keep_alive"),
    ("/api/chat", {**CHAT, "keep_alive": "1000000h"}, 400, "keep_alive"),
    ("/api/chat", {**CHAT, "keep_alive": 1e300}, 400, "keep_alive"),
    ("/api/chat", {**CHAT, "keep_alive": [5]}, 400, "keep_alive"),
    ("/api/chat", {**CHAT, "options": {"num_ctx": 4096}}, 400, "num_ctx"),
    ("/api/chat", {**CHAT, "options": {"temperature": "hot"}}, 400, "temperature"),
    ("/api/chat", {**CHAT, "options": {"top_k": -1}}, 400, "top_k"),
    ("/api/chat", {**CHAT, "options": {"stop": "x"}}, 400, "stop"),
    ("/api/chat", {**CHAT, "options": 5}, 400, "options"),
    ("/api/chat", {**CHAT, "format": "xml"}, 400, "format"),
    ("/api/chat", {**CHAT, "format": {"type": "string", "pattern": "("}}, 400, ""),
    ("/api/chat", {**CHAT, "think": True}, 400, "does not support thinking"),
    ("/api/chat", {**CHAT, "think": "max"}, 400, "think"),
    ("/api/chat", {**CHAT, "stream": True, "messages": [{"role": "user", "content": "word " * 1100}]}, 400,
     "context"),
    ("/api/chat", {**CHAT, "tools": [{"type": "function", "function": {"name": ""}}]}, 400, "name"),
    ("/api/chat", {**CHAT, "messages": [{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{}"}}]}]}, 400, "arguments"),
    ("/api/generate", {"model": "smollm2", "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/api/generate", {"model": "smollm2", "prompt": "x", "template": "{{ .Prompt }}"}, 400, "template"),
    ("/api/generate", {"model": "smollm2", "prompt": "x", "images": ["aGk="]}, 400, "images"),
    ("/api/generate", {"model": "smollm2", "prompt": "x", "context": [-1]}, 400, "token ids"),
    ("/api/generate", {"model": "smollm2", "prompt": "x", "context": ["a"]}, 400, "context"),
    ("/api/generate", {"model": "smollm2", "prompt": 5}, 400, "prompt"),
    ("/api/generate", {"model": "smollm2", "keep_alive": "NaN"}, 400, "keep_alive"),
    ("/api/embed", {"model": "smollm2", "input": 5}, 400, "input"),
    ("/api/embed", {"model": "smollm2", "input": [""]}, 400, "empty"),
    ("/api/embed", {"model": "smollm2", "input": "x", "dimensions": 7}, 400, "dimensions"),
    ("/api/embed", {"model": "smollm2", "input": "word " * 1100, "truncate": False}, 400, "context"),
    ("/api/embed", {"model": "nope", "input": "x"}, 404, "not found"),
    ("/api/embeddings", {"model": "smollm2", "prompt": ["x"]}, 400, "prompt"),
    ("/api/show", {}, 400, "model"),
    ("/api/show", {"model": "nope"}, 404, "not found"),
    ("/api/pull", {"model": "nope"}, 404, "not found"),
    ("/api/pull", {"model": "smollm2", "stream": "maybe"}, 400, "stream"),
    ("/api/create", {"model": "x", "from": "smollm2"}, 501, "not supported"),
    ("/api/copy", {"source": "smollm2", "destination": "x"}, 501, "not supported"),
    ("/api/push", {"model": "smollm2"}, 501, "not supported"),
]


def test_hostile_input_is_a_4xx_in_ollamas_shape(smollm2: Served):
    def check(response: httpx.Response, status: int, says: str) -> None:
        assert response.status_code == status, response.text
        assert response.headers["content-type"] == "application/json"
        body = response.json()
        assert set(body) == {"error"} and isinstance(body["error"], str) and says in body["error"], body

    for path, body, status, says in HOSTILE:
        check(post(smollm2.url, path, body), status, says)
    check(httpx.request("DELETE", smollm2.url + "/api/delete", json={"model": "nope"}), 404, "not found")
    check(post(smollm2.url, "/api/chat", b'{"model": "smollm2", "messages": [], "keep_alive": NaN}'), 400, "keep_alive")
    check(post(smollm2.url, "/api/chat", b"{"), 400, "JSON")
    check(post(smollm2.url, "/api/generate", {"model": "smollm2", "prompt": "a" * BODY_LIMIT}), 413, "exceeds")
    check(httpx.get(smollm2.url + "/api/chat"), 405, "not allowed")
    check(httpx.get(smollm2.url + "/api/nope"), 404, "not found")
    # the other routes keep the OpenAI envelope
    assert post(smollm2.url, "/v1/chat/completions", {"messages": []}).json()["error"]["type"]


async def test_refusals_before_the_route_come_in_ollamas_shape():
    app = create_app(ModelCatalog(), ServerSettings(api_keys=["secret"], max_body_bytes=400))
    client = app.test_client()
    key = {"Authorization": "Bearer secret"}

    async def refusal(path: str, payload: dict, headers: dict) -> tuple[int, dict, dict]:
        response = await client.post(path, json=payload, headers=headers)
        return response.status_code, await response.get_json(), response.headers

    assert (await refusal("/api/chat", CHAT, {}))[:2] == (401, {"error": "invalid or missing API key"})
    assert (await refusal("/api/generate", {"model": "m", "prompt": "x" * 500}, key))[0] == 413
    assert (await refusal("/api/chat", CHAT, key))[:2] == (404, {"error": "model 'smollm2' not found"})
    app.basert_state.draining = True
    status, body, headers = await refusal("/api/chat", CHAT, key)
    assert (status, body, headers["Retry-After"]) == (503, {"error": "the server is shutting down"}, "5")
