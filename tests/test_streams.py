"""Streams end to end, on every streaming API: each chunk carries the text of the tokens it comes with (and their
logprobs), text held back for a possible stop string goes out with the token that decides it, and a server that
stops while streams run ends each of them with its API's error event and a complete body."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import SMOLLM2_CHAT_FLAGS

from basert.testing.client import answer, post, sse_events
from basert.testing.launcher import ServerProcess
from basert.testing.pool import ServerPool

MESSAGES = [{"role": "user", "content": "Name three colors."}]
PROMPT = "The capital of France is"      # a text completion that runs on (with ignore_eos)
NEVER = "\u00a7\u00a7"     # a text SmolLM2 does not write: a stop string made of a token's text and this is held back


@pytest.fixture(scope="module")
def server(smollm2_base: Path, server_pool: ServerPool) -> ServerProcess:
    return server_pool.get(smollm2_base, *SMOLLM2_CHAT_FLAGS)


def chat_tokens(server: ServerProcess) -> list[str]:
    """The texts of the tokens of the greedy answer to MESSAGES, which ends at the end-of-sequence token."""
    whole = answer(post(server.url, "/v1/chat/completions", {"messages": MESSAGES, "temperature": 0,
                                                             "max_tokens": 200, "logprobs": True}))
    assert whole["choices"][0]["finish_reason"] == "stop"
    return [entry["token"] for entry in whole["choices"][0]["logprobs"]["content"]]


def rendered_chat(server: ServerProcess) -> str:
    """MESSAGES rendered by the model's chat template: a completion prompt whose greedy output ends at the
    end-of-sequence token."""
    return answer(post(server.url, "/apply-template", {"messages": MESSAGES}))["prompt"]


def completion_tokens(server: ServerProcess, prompt: str) -> list[str]:
    """The texts of the tokens of the greedy continuation of `prompt`, which ends at the end-of-sequence token."""
    whole = answer(post(server.url, "/completion", {"prompt": prompt, "temperature": 0, "n_predict": 200,
                                                    "n_probs": 1}))
    assert whole["stop_type"] == "eos"
    return [entry["token"] for entry in whole["completion_probabilities"]]


def token_groups(tokens: list[str], stop: str = "") -> list[list[str]]:
    """The tokens each chunk must carry together: a token whose text leaves the text ending in the beginning of
    `stop` waits for the token that decides; the end of the generation decides about the last ones."""
    groups, group, text = [], [], ""
    for token in tokens:
        group.append(token)
        text += token
        if not any(text.endswith(stop[:size]) for size in range(1, len(stop))):
            groups.append(group)
            group = []
    return groups + [group] if group else groups


def ending_cases(tokens: list[str]) -> list[tuple[str, dict, str, list[list[str]]]]:
    """(name, request fields, finish reason, the tokens each chunk carries) for each way a generation ends, with and
    without text held back for a stop string; `tokens` is the greedy output of the request."""
    # A token that could start the stop string, and the next token (before the end) decides that it does not.
    held = next(i for i in range(1, len(tokens) - 2)
                if len(token_groups(tokens[:i + 3], tokens[i] + NEVER)[-2]) > 1)
    stop = tokens[held] + NEVER
    cases = [
        ("length", {"max_tokens": 5}, "length", token_groups(tokens[:5])),
        ("held then released", {"max_tokens": held + 3, "stop": [stop]}, "length",
         token_groups(tokens[:held + 3], stop)),
        # The token limit decides about the held last token.
        ("held at length", {"max_tokens": held + 1, "stop": [stop]}, "length", token_groups(tokens[:held + 1], stop)),
    ]
    at = next(i for i in range(3, len(tokens)) if tokens[i].strip() and tokens[i] not in "".join(tokens[:i]))
    return cases + [
        ("stop string", {"max_tokens": 200, "stop": [tokens[at]]}, "stop", token_groups(tokens[:at + 1], tokens[at])),
        ("eos", {"max_tokens": 200}, "stop", token_groups(tokens)),
        # The end of the sequence decides about the held last token: it goes out with the end.
        ("held at eos", {"max_tokens": 200, "stop": [tokens[-1] + NEVER]}, "stop",
         token_groups(tokens, tokens[-1] + NEVER)),
    ]


def check_groups(groups: list[tuple[str, list[str]]], expected: list[list[str]], whole_text: str, stop: str):
    """Each chunk's logprob tokens are the expected group and spell the chunk's text (the last one the text and the
    stop string that ended the generation), and the chunks' text is the whole text."""
    assert [tokens for _, tokens in groups] == expected
    for text, tokens in groups[:-1]:
        assert "".join(tokens) == text
    last_text, last_tokens = groups[-1]
    assert "".join(last_tokens) == last_text + stop
    assert "".join(text for text, _ in groups) == whole_text


def whole_and_streamed(server: ServerProcess, path: str, body: dict, finish: str, name: str) -> tuple[dict, list]:
    """The non-streamed answer's first choice (checked to end with `finish`) and the streamed answer's events."""
    whole = answer(post(server.url, path, body))["choices"][0]
    assert whole["finish_reason"] == finish, name
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    return whole, events


def test_openai_chat_chunks_carry_their_tokens_text_and_logprobs(server: ServerProcess):
    tokens = chat_tokens(server)
    for name, fields, finish, expected in ending_cases(tokens):
        body = {"messages": MESSAGES, "temperature": 0, "logprobs": True, "top_logprobs": 2, **fields}
        whole, events = whole_and_streamed(server, "/v1/chat/completions", body, finish, name)
        chunks = [event["choices"][0] for event in events[1:-1]]
        assert chunks[-1]["finish_reason"] == finish and chunks[-1]["delta"] == {}, name
        groups = []
        for chunk in chunks[:-1]:
            assert chunk["finish_reason"] is None and set(chunk["delta"]) <= {"content"}, name
            assert all(len(entry["top_logprobs"]) == 2 for entry in chunk["logprobs"]["content"])
            groups.append((chunk["delta"].get("content", ""), [e["token"] for e in chunk["logprobs"]["content"]]))
        stop = fields["stop"][0] if name == "stop string" else ""
        check_groups(groups, expected, whole["message"]["content"], stop)


def test_completions_chunks_carry_their_tokens_text_and_logprobs(server: ServerProcess):
    prompt = rendered_chat(server)
    for name, fields, finish, expected in ending_cases(completion_tokens(server, prompt)):
        body = {"prompt": prompt, "temperature": 0, "logprobs": 1, **fields}
        whole, events = whole_and_streamed(server, "/v1/completions", body, finish, name)
        chunks = [event["choices"][0] for event in events[:-1]]
        assert [chunk["finish_reason"] for chunk in chunks] == [None] * (len(chunks) - 1) + [finish], name
        # The finish chunk carries the tokens no earlier chunk did (the stop string's, whose text is cut).
        groups = [(chunk["text"], chunk["logprobs"]["tokens"]) for chunk in chunks
                  if chunk["text"] or chunk["logprobs"]["tokens"]]
        stop = fields["stop"][0] if name == "stop string" else ""
        check_groups(groups, expected, whole["text"], stop)


def test_llama_completion_chunks_carry_their_tokens_text_and_probabilities(server: ServerProcess):
    prompt = rendered_chat(server)
    for name, fields, finish, expected in ending_cases(completion_tokens(server, prompt)):
        body = {"prompt": prompt, "temperature": 0, "n_probs": 2, "n_predict": fields["max_tokens"],
                "stop": fields.get("stop", [])}
        whole = answer(post(server.url, "/completion", body))
        stop_type = "limit" if finish == "length" else "word" if name == "stop string" else "eos"
        assert whole["stop_type"] == stop_type, name
        with httpx.stream("POST", server.url + "/completion", json={**body, "stream": True}, timeout=120) as response:
            events = sse_events(response)
        assert [event["stop"] for event in events] == [False] * (len(events) - 1) + [True], name
        assert events[-1]["content"] == "" and events[-1]["stop_type"] == whole["stop_type"], name
        groups = []
        for chunk in events[:-1]:
            assert chunk["tokens"] == [entry["id"] for entry in chunk["completion_probabilities"]], name
            groups.append((chunk["content"], [entry["token"] for entry in chunk["completion_probabilities"]]))
        stop = fields["stop"][0] if name == "stop string" else ""
        check_groups(groups, expected, whole["content"], stop)


def test_anthropic_and_responses_streams_carry_the_whole_text(server: ServerProcess):
    tokens = chat_tokens(server)
    headers = {"x-api-key": "unused", "anthropic-version": "2023-06-01"}
    for name, fields, finish, _ in ending_cases(tokens):
        anthropic_body = {"model": "smollm2", "messages": MESSAGES, "temperature": 0,
                          "max_tokens": fields["max_tokens"], "stop_sequences": fields.get("stop", [])}
        whole = answer(post(server.url, "/v1/messages", anthropic_body, headers=headers))
        reason = "stop_sequence" if name == "stop string" else {"length": "max_tokens", "stop": "end_turn"}[finish]
        assert whole["stop_reason"] == reason, name
        with httpx.stream("POST", server.url + "/v1/messages", json={**anthropic_body, "stream": True},
                          headers=headers, timeout=120) as response:
            events = sse_events(response)
        assert events[-1]["type"] == "message_stop", name
        streamed = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
        assert streamed == whole["content"][0]["text"], name
        if "stop" in fields:
            continue        # the Responses API has no stop strings
        responses_body = {"model": "smollm2", "input": MESSAGES[0]["content"], "temperature": 0,
                          "max_output_tokens": fields["max_tokens"]}
        whole = answer(post(server.url, "/v1/responses", responses_body))
        with httpx.stream("POST", server.url + "/v1/responses", json={**responses_body, "stream": True},
                          timeout=120) as response:
            events = sse_events(response)
        assert events[-1]["type"] == ("response.incomplete" if finish == "length" else "response.completed"), name
        streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert streamed == whole["output"][0]["content"][0]["text"], name


# --- a stop while streams run -------------------------------------------------------------------

# Each streaming API: its path and a request that runs far longer than the drain timeout.
STORY = [{"role": "user", "content": "Write a long story about a dragon."}]
CUT_STREAMS = {
    "openai chat": ("/v1/chat/completions", {"messages": STORY, "max_tokens": 400, "ignore_eos": True}),
    "openai completions": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}),
    "llama completion": ("/completion", {"prompt": PROMPT, "n_predict": 400, "ignore_eos": True}),
    "anthropic": ("/v1/messages", {"model": "smollm2", "messages": STORY, "max_tokens": 400}),
    "responses": ("/v1/responses", {"model": "smollm2", "input": STORY[0]["content"], "max_output_tokens": 400}),
}


def read_stream(url: str, path: str, body: dict, lines: list[str], failures: list[Exception]) -> None:
    """Read a stream to its end into `lines`; a body cut short is recorded in `failures`."""
    try:
        with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as response:
            assert response.status_code == 200, response.read()
            lines.extend(response.iter_lines())
    except Exception as exc:
        failures.append(exc)


def payloads(lines: list[str]) -> list:
    """The parsed `data:` payloads of a stream ("[DONE]" as it is)."""
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_drain_timeout_ends_each_stream_with_its_error_event(smollm2_base: Path, tmp_path: Path):
    proc = ServerProcess(smollm2_base, "--max-context", "1024", "--slots", "5",
                         "--drain-timeout", "1", log_path=tmp_path / "server.log")
    lines = {name: [] for name in CUT_STREAMS}
    failures: list[Exception] = []
    threads = [threading.Thread(target=read_stream, args=(proc.url, path, body, lines[name], failures))
               for name, (path, body) in CUT_STREAMS.items()]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while not all(len(payloads(got)) >= 4 for got in lines.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.terminate()
        for thread in threads:
            thread.join(60)
        assert failures == []
        assert proc.wait() == 0, proc.log_text()
    finally:
        proc.stop()
    draining = {"message": "the server is shutting down and stopped this request", "type": "unavailable_error",
                "param": None, "code": "draining"}
    chat, completions, llama = (payloads(lines[name]) for name in ("openai chat", "openai completions",
                                                                   "llama completion"))
    assert chat[-2:] == [{"error": draining}, "[DONE]"]
    assert completions[-2:] == [{"error": draining}, "[DONE]"]
    assert all(not chunk["stop"] for chunk in llama)
    assert [line for line in lines["llama completion"] if line][-1] == f"error: {json.dumps(draining)}"
    assert payloads(lines["anthropic"])[-1] == {"type": "error", "error": {"type": "overloaded_error",
                                                                           "message": draining["message"]}}
    responses = payloads(lines["responses"])
    assert [event["type"] for event in responses[-2:]] == ["error", "response.failed"]
    assert responses[-2]["code"] == "server_error" and responses[-2]["message"] == draining["message"]
    assert responses[-1]["response"]["status"] == "failed"
