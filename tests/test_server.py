"""The HTTP server end to end: a real `basert serve` on loopback, real SmolLM2 weights, httpx and openai clients."""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
import trio
from conftest import FIXTURES, SMOLLM2_API_FLAGS

from basert.actor.actor import ModelActor, QueueTimeoutError
from basert.actor.messages import Generate
from basert.engine import EngineOptions, build_engine
from basert.engine.sampler import SamplingParams
from basert.engine.scheduler import DEFAULT_TOKEN_BUDGET
from basert.engine.types import FailEvent, GenerationRequest
from basert.testing.client import error_envelope, post, sse_events
from basert.testing.launcher import ServerProcess
from basert.testing.pool import ServerPool


@pytest.fixture(scope="module")
def server(smollm2_base: Path, server_pool: ServerPool) -> ServerProcess:
    return server_pool.get(smollm2_base, *SMOLLM2_API_FLAGS)


@pytest.fixture(scope="module")
def reference() -> dict:
    data = json.loads((FIXTURES / "smollm2" / "reference.json").read_text())
    return {p["name"]: p for p in data["prompts"]}


def test_health_models_tokenize(server: ServerProcess, reference: dict):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = httpx.get(server.url + "/v1/models").json()
    # Outside the models directory the id is the file's stem, never the header's free-text name.
    # The models of the models directory follow it, unloaded.
    assert [m["id"] for m in models["data"] if m["status"]["value"] == "loaded"] == ["smollm2"]
    assert models["data"][0]["id"] == "smollm2"
    model_id = models["data"][0]["id"]
    assert httpx.get(f"{server.url}/v1/models/{model_id}").json()["id"] == model_id
    capital = reference["capital"]
    tokens = post(server.url, "/v1/tokenize", {"content": capital["text"]}).json()["tokens"]
    assert tokens == capital["input_ids"]
    pieces = post(server.url, "/v1/tokenize", {"content": "Hello world", "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == "Hello world"
    assert post(server.url, "/v1/detokenize", {"tokens": tokens}).json()["content"] == capital["text"]


def test_completion_matches_reference_greedy(server: ServerProcess, reference: dict):
    capital = reference["capital"]
    body = {"prompt": capital["text"], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    result = post(server.url, "/v1/completions", body).json()
    ids = post(server.url, "/v1/tokenize", {"content": result["choices"][0]["text"]}).json()["tokens"]
    assert ids == capital["greedy"][: len(ids)]
    assert result["usage"]["prompt_tokens"] == len(capital["input_ids"])
    assert result["usage"]["completion_tokens"] == 16
    assert set(result["timings"]) >= {"prompt_n", "prompt_ms", "predicted_n", "predicted_per_second", "cache_n"}
    by_ids = post(server.url, "/v1/completions", {**body, "prompt": capital["input_ids"]}).json()
    assert by_ids["choices"][0]["text"] == result["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens_details"]["cached_tokens"] == len(capital["input_ids"]) - 1
    echoed = post(server.url, "/v1/completions", {**body, "echo": True, "max_tokens": 4}).json()
    assert echoed["choices"][0]["text"].startswith(capital["text"])
    full_text = result["choices"][0]["text"]
    stop = full_text[len(full_text) // 2: len(full_text) // 2 + 3]
    stopped = post(server.url, "/v1/completions", {**body, "stop": [stop]}).json()
    assert stopped["choices"][0]["text"] == full_text[: full_text.index(stop)]
    assert stopped["choices"][0]["finish_reason"] == "stop"


def test_chat_stream_and_non_stream_give_the_same_text(server: ServerProcess):
    body = {"messages": [{"role": "system", "content": "You are terse."},
                         {"role": "user", "content": "Name three colors."}],
            "max_tokens": 24, "temperature": 0}
    whole = post(server.url, "/v1/chat/completions", body).json()
    text = whole["choices"][0]["message"]["content"]
    assert text and whole["object"] == "chat.completion"
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert streamed == text
    usage = [e for e in events[:-1] if not e["choices"]][0]["usage"]
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"]


def test_n_choices_and_seeded_sampling(server: ServerProcess):
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 7, "n": 2}
    first = post(server.url, "/v1/completions", body).json()
    second = post(server.url, "/v1/completions", body).json()
    assert [c["text"] for c in first["choices"]] == [c["text"] for c in second["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1]


def test_openai_client(server: ServerProcess):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    chat = client.chat.completions.create(model="model", messages=[{"role": "user", "content": "Say hi."}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="model", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0,
        stream=True) if c.choices]
    assert "".join(pieces) == chat.choices[0].message.content
    completion = client.completions.create(model="model", prompt="The sky is", max_tokens=6, temperature=0)
    assert completion.choices[0].text
    tools = [{"type": "function", "function": {"name": "lookup_key", "description": "Look up a key",
                                                "parameters": {"type": "object",
                                                               "properties": {"key": {"type": "string"}},
                                                               "required": ["key"]}}}]
    with_tools = client.chat.completions.create(
        model="model", messages=[{"role": "user", "content": "Call lookup_key with key seq-1."}],
        tools=tools, max_tokens=40, temperature=0)
    assert with_tools.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_bad_requests_get_their_envelope_and_the_server_stays_up(server: ServerProcess):
    chat = "/v1/chat/completions"
    r = post(server.url, chat, b"{not json")
    assert error_envelope(r, 400)["type"] == "invalid_request_error"
    r = post(server.url, chat, {"messages": []})
    assert error_envelope(r, 400)["param"] == "messages"
    r = post(server.url, chat, {"messages": [{"role": "user", "content": "hi"}], "temperature": 7})
    assert error_envelope(r, 400)["param"] == "temperature"
    r = post(server.url, "/v1/completions", {"prompt": "word " * 600})
    error = error_envelope(r, 400)
    assert error["code"] == "context_length_exceeded"
    assert error["n_ctx"] == 512 and error["n_prompt_tokens"] > 512
    r = post(server.url, "/v1/completions", {"prompt": "x" * 300000})
    assert error_envelope(r, 413)["code"] == "request_too_large"
    r = httpx.get(server.url + "/v2/nothing")
    assert error_envelope(r, 404)["code"] == "route_not_found"
    r = post(server.url, "/v1/completions", {"prompt": [10**9]})
    assert r.status_code == 400
    r = post(server.url, "/v1/detokenize", {"tokens": [-1]})
    assert r.status_code == 400
    r = post(server.url, chat, {"messages": [{"role": "wizard", "content": "hi"}]})
    assert r.status_code == 400
    assert httpx.get(server.url + "/health").status_code == 200


def test_slot_save_erase_restore_reproduces_the_request(server: ServerProcess):
    body = {"prompt": "The three primary colors are", "max_tokens": 10, "temperature": 0}
    first = post(server.url, "/v1/completions", body).json()
    saved = post(server.url, "/slots/0/save", {})
    assert saved.status_code == 200, saved.text
    saved = saved.json()
    assert saved["file_id"].startswith("file-") and saved["n_saved"] > 0
    assert post(server.url, "/slots/0/erase", {}).json()["n_erased"] == saved["n_saved"]
    assert httpx.get(server.url + "/slots").json()[0]["cache_tokens"] == 0
    restored = post(server.url, "/slots/0/restore", {"file_id": saved["file_id"]}).json()
    assert restored["n_restored"] == saved["n_saved"]
    again = post(server.url, "/v1/completions", body).json()
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == first["usage"]["prompt_tokens"] - 1
    listed = httpx.get(server.url + "/v1/files").json()["data"]
    assert saved["file_id"] in [f["id"] for f in listed]


def test_slot_errors(server: ServerProcess):
    r = post(server.url, "/slots/7/save", {})
    assert error_envelope(r, 404)["code"] == "slot_not_found"
    r = post(server.url, "/slots/abc/erase", {})
    assert r.status_code == 400
    garbage = httpx.post(server.url + "/v1/files", files={"file": ("junk.bin", b"BSLT" + os.urandom(200))},
                         data={"purpose": "slot_snapshot"}).json()
    # A restore that fails leaves the slot empty, not half restored: fill it first.
    post(server.url, "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert httpx.get(server.url + "/slots").json()[0]["cache_tokens"] > 0
    r = post(server.url, "/slots/0/restore", {"file_id": garbage["id"]})
    assert r.status_code == 400
    assert httpx.get(server.url + "/slots").json()[0]["cache_tokens"] == 0
    r = post(server.url, "/slots/0/restore", {"file_id": "file-" + "0" * 24})
    assert error_envelope(r, 404)["code"] == "file_not_found"
    slots_dir = server.root / "slots"
    outside = server.root / "outside.bin"
    outside.write_bytes(b"x")
    (slots_dir / "link.bin").symlink_to(outside)
    for name in ("../x", "a/b", "link.bin", ".."):
        r = post(server.url, "/slots/0?action=save", {"filename": name})
        assert r.status_code == 400, name
    r = post(server.url, "/slots/0?action=jump", {"filename": "ok.bin"})
    assert r.status_code == 400
    post(server.url, "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    saved = post(server.url, "/slots/0?action=save", {"filename": "ok.bin"}).json()
    assert saved["n_saved"] > 0 and (slots_dir / "ok.bin").is_file()
    restored = post(server.url, "/slots/0?action=restore", {"filename": "ok.bin"}).json()
    assert restored["n_restored"] == saved["n_saved"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_client_disconnect_frees_the_slot(server: ServerProcess):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"prompt": "Write a long story.", "max_tokens": 400, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        if not httpx.get(server.url + "/slots").json()[0]["is_processing"]:
            break
        time.sleep(0.05)
    assert not httpx.get(server.url + "/slots").json()[0]["is_processing"]


def test_metrics_and_access_log(server: ServerProcess):
    post(server.url, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    text = httpx.get(server.url + "/metrics").text
    assert 'basert_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert "basert_generated_tokens_total" in text
    assert "basert_busy_slots" in text
    assert "POST /v1/completions 200 model=" in server.log_text()


def test_slots_cli(server: ServerProcess):
    import subprocess
    import sys

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "basert", "slots", *args, "--url", server.url],
                              capture_output=True, text=True, timeout=120)

    post(server.url, "/v1/completions", {"prompt": "Hi there", "max_tokens": 2, "temperature": 0})
    listing = run("list")
    assert listing.returncode == 0 and "TOKENS" in listing.stdout
    saved = run("save", "0")
    assert saved.returncode == 0, saved.stderr
    file_id = json.loads(saved.stdout)["file_id"]
    assert run("erase", "0").returncode == 0
    restored = run("restore", "0", "--file-id", file_id)
    assert restored.returncode == 0 and json.loads(restored.stdout)["n_restored"] > 0
    missing = run("erase", "9")
    assert missing.returncode == 1 and "slot 9 not found" in missing.stderr


LOOKUP_TOOL = {"type": "function", "function": {"name": "lookup_key", "description": "Look up a key",
                                                "parameters": {"type": "object",
                                                               "properties": {"key": {"type": "string"}},
                                                               "required": ["key"]}}}


def test_forced_tool_call_streams_the_same_call(server: ServerProcess):
    body = {"messages": [{"role": "user", "content": "Call lookup_key with key seq-7."}], "tools": [LOOKUP_TOOL],
            "tool_choice": "required", "temperature": 0, "max_tokens": 64}
    whole = post(server.url, "/v1/chat/completions", body).json()
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls", whole
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "lookup_key"
    assert set(json.loads(call["function"]["arguments"])) == {"key"}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as response:
        events = sse_events(response)
    deltas = [d for e in events[:-1] for d in e["choices"][0]["delta"].get("tool_calls", [])]
    assert deltas[0]["id"] and deltas[0]["function"]["name"] == "lookup_key"
    streamed: dict[int, str] = {}
    for delta in deltas:
        streamed[delta["index"]] = streamed.get(delta["index"], "") + delta["function"]["arguments"]
    # `required` with parallel_tool_calls (the default) allows more than one call: the stream has them all.
    assert [streamed[i] for i in sorted(streamed)] == [c["function"]["arguments"]
                                                       for c in choice["message"]["tool_calls"]]
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    named = client.chat.completions.create(
        model="model", messages=body["messages"], tools=[LOOKUP_TOOL], temperature=0, max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "lookup_key"}})
    assert named.choices[0].message.tool_calls[0].function.name == "lookup_key"
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "days": {"type": "integer"}},
              "required": ["city", "days"], "additionalProperties": False}
    formatted = client.chat.completions.create(
        model="model", messages=[{"role": "user", "content": "Weather in Paris for 2 days, as JSON."}],
        temperature=0, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    parsed = json.loads(formatted.choices[0].message.content)
    assert set(parsed) == {"city", "days"} and isinstance(parsed["days"], int)


def test_files_endpoints(server: ServerProcess):
    uploaded = httpx.post(server.url + "/v1/files", files={"file": ("notes.txt", b"hello files")},
                          data={"purpose": "user_data"}).json()
    assert uploaded["object"] == "file" and uploaded["bytes"] == 11 and uploaded["filename"] == "notes.txt"
    assert httpx.get(f"{server.url}/v1/files/{uploaded['id']}").json() == uploaded
    assert httpx.get(f"{server.url}/v1/files/{uploaded['id']}/content").content == b"hello files"
    deleted = httpx.delete(f"{server.url}/v1/files/{uploaded['id']}").json()
    assert deleted == {"id": uploaded["id"], "object": "file", "deleted": True}
    r = httpx.get(f"{server.url}/v1/files/{uploaded['id']}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "file_not_found"


@pytest.fixture(scope="module")
def timeout_server(smollm2_base: Path, tmp_path_factory: pytest.TempPathFactory):
    """SmolLM2 on one slot with a 1 ms request timeout: every generation is out of time after its first step,
    however fast the machine."""
    log_path = tmp_path_factory.mktemp("timeout") / "log"
    with ServerProcess(smollm2_base, "--max-context", "1024", "--slots", "1", "--request-timeout", "1",
                       log_path=log_path) as proc:
        yield proc


def last_access_line(server: ServerProcess, path: str) -> str:
    time.sleep(0.2)  # the access log line is written once the response is sent
    return [line for line in server.log_text().splitlines() if f"POST {path} " in line][-1]


def test_request_timeout_ends_with_length(timeout_server: ServerProcess):
    result = httpx.post(timeout_server.url + "/v1/completions", timeout=120,
                        json={"prompt": "Tell a story", "max_tokens": 400, "temperature": 0,
                              "ignore_eos": True}).json()
    assert result["choices"][0]["finish_reason"] == "length"
    assert 0 < result["usage"]["completion_tokens"] < 400
    assert last_access_line(timeout_server, "/v1/completions").endswith(" finish=length timed_out")


def test_request_timeout_stops_a_long_prompt_between_prefill_chunks(timeout_server: ServerProcess):
    prompt = list(range(1000, 1000 + DEFAULT_TOKEN_BUDGET + 100))  # two prefill chunks
    result = httpx.post(timeout_server.url + "/v1/completions", timeout=120,
                        json={"prompt": prompt, "max_tokens": 8, "temperature": 0}).json()
    assert (result["choices"][0]["text"], result["choices"][0]["finish_reason"]) == ("", "length")
    assert (result["usage"]["prompt_tokens"], result["usage"]["completion_tokens"]) == (len(prompt), 0)
    assert last_access_line(timeout_server, "/v1/completions").endswith(" finish=length timed_out")
    # Only the first chunk was computed: that is what the slot holds, and what the timings count.
    assert httpx.get(timeout_server.url + "/slots").json()[0]["cache_tokens"] == DEFAULT_TOKEN_BUDGET
    assert result["timings"]["prompt_n"] == DEFAULT_TOKEN_BUDGET


def test_a_request_that_waited_for_a_slot_past_its_deadline_is_told_its_real_wait(smollm2_base: Path):
    # The actor reads its mailbox between steps: a request that arrives during a long step has waited, even if the
    # actor only sees it when its deadline is long past.
    actor = ModelActor(build_engine(smollm2_base, EngineOptions(max_context=256, threads=2)))
    prompt = list(range(1000, 1020))

    async def second_replies() -> list:
        receivers = []
        for request_id, deadline in (("first", None), ("second", time.monotonic())):
            send, receive = trio.open_memory_channel(math.inf)
            request = GenerationRequest(request_id, prompt, 4, SamplingParams(), deadline=deadline)
            actor.mailbox.send_nowait(Generate(request, send))
            receivers.append(receive)
        await trio.sleep(1.0)  # both wait in the mailbox, as behind a long step
        async with trio.open_nursery() as nursery:
            nursery.start_soon(actor.run)
            replies = [reply async for reply in receivers[1]]
            nursery.cancel_scope.cancel()
        return replies

    try:
        [failed] = trio.run(second_replies)
    finally:
        actor.close()
    assert isinstance(failed, FailEvent) and isinstance(failed.error, QueueTimeoutError)
    # It had its chance at the slot (the first request had it), then timed out: it waited the second and a step.
    waited = float(re.fullmatch(r"the request waited ([\d.]+) s for a free slot without starting; retry later",
                                str(failed.error))[1])
    assert waited >= 1.0
