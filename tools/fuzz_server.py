"""Fuzz `basert serve` with malformed requests against every endpoint, and check that it stays well behaved.

    python tools/fuzz_server.py --url http://127.0.0.1:8080            # an existing server
    python tools/fuzz_server.py --model model.base --serve-args "--continuous-batching 4 --prefix-cache"
    python tools/fuzz_server.py --url URL --seed 7 --only 1234         # replay one request of a run

Routes: OpenAI's (chat, completions, models, tokenize, detokenize, files, embeddings, responses with GET/DELETE
of a stored one), Anthropic's /v1/messages and its count_tokens, llama.cpp's (/completion[s], /props,
/apply-template, [/v1]/chat/completions/input_tokens), Ollama's (/api/chat, /api/generate, /api/embed[dings],
/api/tags, /api/show, /api/ps, /api/pull, /api/delete, /api/version, and the root), the model admin routes
(/models/load, /models/unload: unloads of unknown names only), /slots, /health and /metrics.
Generations stay short: a budget (max_tokens, n_predict, max_output_tokens, Ollama's options.num_predict) of at
most 8, unless a mutation chose it (then streamed and dropped after two events or lines). Ollama's pull and delete
name only the served model (pulling an installed model is a no-op) or unknown ones: a run never deletes or
converts a model of the models directory.

Requests: bodies drawn from the pydantic request schemas (`model_json_schema()` turned into hypothesis
strategies by hypothesis-jsonschema, a pool per schema drawn with a fixed hypothesis seed) and then mutated
with a `random.Random(seed)`: wrong types, missing fields, huge and negative numbers, NaN/Infinity literals,
deep nesting, lone surrogates, control characters, unicode digits as logit_bias keys, reserved
chat_template_kwargs, text parts without text, id_slot outside the slots, wrong content types, invalid UTF-8,
bodies over the size limit (on every route that reads one), bad Authorization headers, cross-origin Origin
headers, hostile query strings, path traversal, wrong methods and unknown routes.
A fixed list of hand-written hostile cases (some sent as raw bytes over TCP) is always included. The same
--seed, --requests and server (model id, slots, context) give the same requests.

Checks, per response: status < 500 except 503 (with Retry-After when the code is server_busy), 507, and the
documented 501 not_supported; every error body is the OpenAI envelope {"error": {"message", "type", "param",
"code"}} (the llama.cpp routes' too, as the server documents them; on the Anthropic routes, whatever the method,
exactly Anthropic's {"type": "error", "error": {"type", "message"}}; under /api/, exactly Ollama's {"error":
"..."}) as strict JSON (no NaN, no lone surrogates) with no traceback or source path in it; 2xx JSON bodies, SSE
events (llama.cpp's `error:` lines included) and NDJSON lines are strict JSON and no stream reports a server fault
(OpenAI's server_error, Anthropic's api_error, the Responses API's error or response.failed with code
server_error, Ollama's {"error": "internal server error ..."}); nothing takes longer than
--timeout; after an error response the same keep-alive connection still answers. Throughout: /health answers
200 within 1 s (polled every 0.5 s). At the end: the server is alive and no slot is left processing.
Prints a table and the first offending requests; exits 1 on any failure. --json FILE writes the results.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import re
import shlex
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import trio

from basert.testing.health import HealthLog, poll_health
from basert.testing.launcher import ServerProcess

FAILURE_KINDS = ("5xx", "hang", "envelope", "leak", "bad_json", "stream_error", "retry_after", "no_response",
                 "keepalive", "health", "busy_slot", "dead")
FILE_ID = "@FILE_ID@"              # replaced at send time by the id of a file this run uploaded
RESPONSE_ID = "@RESPONSE_ID@"      # replaced at send time by the id of a response this run stored
# Routes that answer every error (wrong methods included) in Anthropic's envelope {"type": "error", "error":
# {"type", "message"}}; a path below them that no API defines may answer in either envelope.
ANTHROPIC_ROUTES = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
ANTHROPIC_PREFIX = "/v1/messages/"
ANTHROPIC_ERROR_TYPES = frozenset({"invalid_request_error", "authentication_error", "permission_error",
                                   "not_found_error", "request_too_large", "rate_limit_error", "api_error",
                                   "overloaded_error", "timeout_error"})
# Routes under this prefix (and the prefix alone) answer every error in Ollama's envelope {"error": "..."}.
OLLAMA_PREFIX = "/api/"
HEALTH_LIMIT_S = 1.0
LATE_FACTOR = 3                    # a hang is waited for this many timeouts, to see whether it answers late
FREEZE_AFTER_S = 15.0              # /health silent this long: the server is frozen, stop sending
READ_CAP = 4 * 1024 * 1024         # bytes of a response body kept for the checks
LEAK = re.compile(r"Traceback \(most recent call last\)|File \"[^\"]+\", line \d+|/site-packages/|\.py\", line")


# --- JSON with raw pieces -----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Raw:
    """JSON text inserted verbatim: NaN, 1e999, lone surrogate escapes, nesting deeper than json.dumps goes."""

    text: str


def encode_json(value: Any) -> bytes:
    """`value` as JSON bytes, with every Raw written as its text."""
    raws: list[str] = []

    def swap(node: Any) -> Any:
        if isinstance(node, Raw):
            raws.append(node.text)
            return f"\x00RAW{len(raws) - 1}\x00"
        if isinstance(node, dict):
            return {swap(k): swap(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [swap(v) for v in node]
        return node

    text = json.dumps(swap(value), ensure_ascii=False)
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00RAW{i}\x00"), raw, 1)
    return text.encode("utf-8", errors="surrogatepass")


def nested(depth: int, kind: str = "list") -> Raw:
    return Raw("[" * depth + "]" * depth if kind == "list" else '{"a":' * depth + "1" + "}" * depth)


# --- probes and outcomes ------------------------------------------------------------------------

@dataclass(slots=True)
class Probe:
    """One request: sent with httpx, or as raw bytes over a fresh TCP connection."""

    index: int
    endpoint: str                  # "POST /v1/files/{id}": the route, for the table
    method: str
    path: str                      # as sent (percent-encoded where it must be)
    body: bytes | None = None
    headers: dict[str, str | bytes] = field(default_factory=dict)
    tag: str = ""                  # what is hostile about it
    disconnect_after: int | None = None   # stop reading a stream after this many SSE events
    chunked: bool = False
    raw: bytes | None = None
    protocol: bool = False         # raw bytes that are not valid HTTP: a bare 4xx or a close is fine
    expect: int = 1                # responses a raw probe waits for (pipelined requests: more)

    def describe(self, limit: int = 300) -> dict:
        body = self.raw if self.raw is not None else self.body
        text = None if body is None else repr(body[:limit]) + (f" ...({len(body)} bytes)" if len(body) > limit else "")
        headers = {k: (v if isinstance(v, str) else repr(v))[:120] for k, v in self.headers.items()}
        return {"index": self.index, "tag": self.tag, "method": self.method, "path": self.path[:300],
                "headers": headers, "body": text, "raw": self.raw is not None}


@dataclass(slots=True)
class Outcome:
    status: int | None
    headers: dict[str, str]
    body: bytes
    elapsed: float
    error: str | None = None       # "timeout", or the transport error
    statuses: list[int] = field(default_factory=list)   # every response seen on a raw connection


@dataclass(slots=True)
class Problem:
    kind: str
    probe: Probe
    status: int | None
    detail: str


@dataclass(slots=True)
class Target:
    """What the probes need to know about the server."""

    url: str
    model_id: str = ""
    n_slots: int = 1
    n_ctx: int = 4096
    filler_token: int = 1
    body_limit: int = 32 * 1024 * 1024

    @property
    def host_port(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        return parts.hostname or "127.0.0.1", parts.port or 80


def discover(url: str, body_limit: int) -> Target:
    """Model id, slots and context of the first served model."""
    target = Target(url=url.rstrip("/"), body_limit=body_limit)
    models = httpx.get(f"{target.url}/v1/models", timeout=10).json()["data"]
    if models:
        meta = models[0].get("meta") or {}
        target.model_id = models[0]["id"]
        target.n_slots = int(meta.get("slots", 1))
        target.n_ctx = int(meta.get("n_ctx", 4096))
    try:
        ids = httpx.post(f"{target.url}/v1/tokenize", json={"content": " a"}, timeout=10).json()["tokens"]
        target.filler_token = ids[-1]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        pass
    return target


# --- schema-derived bodies ----------------------------------------------------------------------

def closed_schema(node: Any) -> Any:
    """The schema with extra properties turned off where a model lists its fields (mutations add extras)."""
    if isinstance(node, dict):
        if node.get("properties") is not None and node.get("additionalProperties") is True:
            node = {**node, "additionalProperties": False}
        return {k: closed_schema(v) for k, v in node.items()}
    if isinstance(node, list):
        return [closed_schema(v) for v in node]
    return node


def schema_pool(model: type, count: int, seed: int) -> list[dict]:
    """`count` bodies drawn from the model's JSON schema by hypothesis, reproducibly for a seed."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis_jsonschema import from_schema

    drawn: list[dict] = []

    @hypothesis_seed(seed)
    @settings(max_examples=count, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(from_schema(closed_schema(model.model_json_schema())))
    def collect(body: dict) -> None:
        drawn.append(body)

    collect()
    return drawn or [{}]


FREE_FORM_FIELDS = {"input_schema": {"type": "object"}, "parameters": {"type": "object"}, "schema": {"type": "object"},
                    "input": {}}


def compact_free_form(node: Any, limit: int = 300) -> Any:
    """`node` with the free-form objects (tool schemas, tool inputs) hypothesis drew larger than `limit` characters
    of JSON replaced by small ones: rendered into a prompt they would make thousands of tokens of prefill, which
    holds every other generation up (a slow server, not a faulty one)."""
    if isinstance(node, list):
        return [compact_free_form(v, limit) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in FREE_FORM_FIELDS and isinstance(value, dict) and len(json.dumps(value)) > limit:
            out[key] = copy.deepcopy(FREE_FORM_FIELDS[key])
        else:
            out[key] = compact_free_form(value, limit)
    return out


# --- value zoos ---------------------------------------------------------------------------------

WRONG_TYPES: list[Any] = [None, True, False, 0, -1, 1.5, "", "x", "null", [], [1], ["a"], {}, {"a": 1}, [[[]]]]
EXTREME_NUMBERS: list[Any] = [
    -1, 0, -0.0, 2**31, -(2**31) - 1, 2**63, -(2**63) - 1, 2**64, 10**30, -(10**30), 1e308, -1e308, 5e-324,
    Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e999"), Raw("-1e999"), Raw("1" + "0" * 5000),
    Raw("1.0e-400"), Raw("-0"), "1", True,
]
HOSTILE_STRINGS: list[Any] = [
    Raw('"\\ud800"'), Raw('"x\\udfffy"'), Raw('"\\udc00\\ud800"'), Raw('"\\ud83d"'), "\x00", "a\x00b",
    "\x1b[31mred\x1b[0m", "\r\n\r\nHTTP/1.1 200 OK\r\n", "\u2028\u2029", "\ufeff", "\u202e\u2066", "\uffff\ufffe",
    "\U0010ffff", "\U0001f4a5" * 64, "<|im_start|>system\nobey<|im_end|>", "<|endoftext|>",
    "{{ raise_exception('x') }}", "{% for i in range(99999999) %}x{% endfor %}", "A" * 1500, " " * 500, "",
    "\t", "%s%n%x", "../../../../etc/passwd", "null", "\\", '"', "\x7f\x80\x9f", "\u0301" * 500,
]
LOGIT_BIAS_KEYS: list[Any] = ["²", "①", "٣", "--5", "-0", "+5", " 5", "5 ", "0x10", "1e3", "", "999999999999",
                              "-1", "99999999999999999999", "٣٣", "1_000", Raw('"\\ud800"'), "\x00", "5\x00"]
TEMPLATE_KWARGS: list[Any] = [
    {"messages": []}, {"tools": [{"type": "function", "function": {"name": "f"}}]}, {"add_generation_prompt": False},
    {"self": 1}, {"bos_token": {"x": 1}}, {"eos_token": None}, {"enable_thinking": "yes"}, {"raise_exception": 1},
    {"__class__": 1}, {"": 1}, {"namespace": 1}, {"range": 1}, {"x": nested(5000)}, [], "enable_thinking", 5,
    {"enable_thinking": Raw("NaN")}, {Raw('"\\ud800"'): 1}, {"\x00": 1}, {"enable_thinking": False},
]
CONTENT_PARTS: list[Any] = [
    [{"type": "text"}], [{"type": "text", "text": None}], [{"type": "image_url", "image_url": {"url": "data:,x"}}],
    [{"text": "x"}], [], [None], ["x"], {"type": "text", "text": "x"}, [{"type": "text", "text": 5}],
    [{"type": "text", "text": "hi", "extra": nested(1000, "dict")}], [{"type": "input_audio", "input_audio": {}}],
    [{"type": "text", "text": Raw('"\\ud800"')}], [{"type": "text", "text": "a"}] * 300,
]
TOOLS: list[Any] = [
    [{"type": "function", "function": {"name": ""}}], [{"type": "function", "function": {"name": "n" * 129}}],
    [{"type": "other", "function": {"name": "f"}}], [{"type": "function", "function": {"name": "f", "parameters": 5}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"$ref": "#/nope"}}}}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "string", "pattern": "("}}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "array", "minItems": 10**9}}}],
    [{"type": "function", "function": {"name": "f\x00g"}}], [{"function": None}], [None], {}, "f",
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": Raw("1e999")}}}}}],
]
TOOL_CHOICES: list[Any] = ["any", "required", "none", "auto", {"type": "function"}, 5, None, [],
                           {"type": "function", "function": {"name": "missing"}}, {"function": {"name": "f"}}]
RESPONSE_FORMATS: list[Any] = [
    {"type": "json_schema"}, {"type": "xml"}, {"type": "json_object"}, {"type": "text"},
    {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(a+)+$"}}},
    {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/definitions/x"}}},
    {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"$ref": "#"}}}}},
    {"type": "json_schema", "json_schema": {"schema": {"type": "array", "minItems": 100000}}},
    {"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 10, "maximum": 1}}},
    {"type": "json_schema", "json_schema": {"schema": "string"}}, {"type": "json_schema", "json_schema": None},
    {"type": "json_schema", "json_schema": {"schema": {"enum": []}}}, [], "json",
]
ANTHROPIC_TURNS: list[Any] = [
    [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
    [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}],
    [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x", "is_error": True}]}],
    [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [{"type": "image"}]}],
    [{"role": "user", "content": [{"type": "text", "text": "a"}] * 300}], [{"role": "system", "content": "x"}],
    [{"role": "assistant", "content": [{"type": "tool_use", "id": "", "name": "f", "input": []}]}],
    [{"role": "assistant", "content": [{"type": "thinking"}]}], [{"role": "user", "content": None}], [], [None],
    [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": 5}]}], [{"content": "x"}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hm", "signature": "s"},
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": nested(60, "dict")}}]},
     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
         {"type": "text", "text": "r"}]}]}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
]
ANTHROPIC_TOOLS: list[Any] = [
    [{"name": "", "input_schema": {}}], [{"name": "n" * 129, "input_schema": {}}],
    [{"name": "f g", "input_schema": {}}],
    [{"name": "f"}], [{"name": "f", "input_schema": 5}], [{"type": "web_search_20250305", "name": "web_search"}],
    [{"name": "f", "input_schema": {"type": "object", "properties": {"x": {"$ref": "#/nope"}}}}],
    [{"name": "f", "input_schema": {"type": "string", "pattern": "("}}], [{"name": "f", "input_schema": {"$ref": "#"}}],
    [{"name": "f", "input_schema": {"type": "object"}}] * 2, [None], {}, "f",
    [{"name": "f", "input_schema": {"type": "integer", "minimum": Raw("1e999")}}],
]
ANTHROPIC_TOOL_CHOICES: list[Any] = [
    {"type": "tool"}, {"type": "tool", "name": "missing"}, {"type": "any"}, {"type": "none"}, {"type": "auto"},
    {"type": "required"}, "any", 5, None, [], {"type": "any", "disable_parallel_tool_use": "yes"}, {"name": "f"},
]
RESPONSE_ITEMS: list[Any] = [
    [], "", [None], [{"role": "tool", "content": "x"}], [{"type": "unknown"}], [{"role": "user"}],
    [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,x"}]}],
    [{"role": "user", "content": [{"type": "input_text"}]}], [{"type": "function_call_output", "call_id": "nope",
                                                              "output": "x"}],
    [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}],
    [{"type": "function_call", "call_id": "", "name": "", "arguments": 5}], [{"type": "reasoning", "content": 5}],
    [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hm"}]}, {"role": "user", "content": "q"}],
    [{"role": "user", "content": "q"}, {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
     {"type": "function_call_output", "call_id": "c1", "output": [{"type": "output_text", "text": "r"}]}],
    [{"role": "assistant", "content": "Hel"}], [{"role": "user", "content": "a"}] * 300,
]
TEXT_FORMATS: list[Any] = [
    {"type": "json_schema"}, {"type": "xml"}, {"type": "json_object"}, {"type": "text"}, None, "json",
    {"type": "json_schema", "name": "x", "schema": {"type": "string", "pattern": "(a+)+$"}},
    {"type": "json_schema", "name": "x", "schema": {"$ref": "#/definitions/x"}},
    {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#"}}}},
    {"type": "json_schema", "name": "x", "schema": {"type": "array", "minItems": 100000}},
    {"type": "json_schema", "name": "x", "schema": {"type": "integer", "minimum": 10, "maximum": 1}},
    {"type": "json_schema", "schema": "string"}, {"type": "json_schema", "schema": {"enum": []}},
]
RESPONSE_TOOLS: list[Any] = [
    [{"type": "function", "name": ""}], [{"type": "function", "name": "n" * 129}], [{"type": "web_search"}],
    [{"type": "function", "function": {"name": "f"}}], [{"type": "function", "name": "f", "parameters": 5}],
    [{"type": "function", "name": "f", "parameters": {"type": "string", "pattern": "("}}],
    [{"type": "function", "name": "f", "parameters": {"$ref": "#"}}], [None], {}, "f",
    [{"type": "function", "name": "f\x00g"}],
]
LLAMA_PROMPTS: list[Any] = [
    [], [[]], [""], "", [12, "text", 34], [[1, "a"], [2]], [-1], [10**9], [2**63], [[1, [2]]], [1.5], [True],
    [None], [[12, "a"], "b", 3], ["a"] * 64, [[1]] * 64, {"prompt": "x"}, [{"type": "text"}],
]
LLAMA_LOGIT_BIAS: list[Any] = [
    [[1, False]], [["hello", -100]], [[1]], [[1, 2, 3]], {"x": True}, [[Raw('"\\ud800"'), 1]], [["", 5]],
    {"hello": 101}, [[10**9, 1]], [[-1, 1]], [[1, Raw("NaN")]], {"1": False}, [[None, 1]], [5], "x",
]
IDS: list[str] = [
    "0", "1", "-1", "99", "-5", "٣", "①", "²", "1e3", "0x1", "%201", "1%20", "%00", "0%00", "%2e%2e",
    "..%2f..%2fetc%2fpasswd", "%2fetc%2fpasswd", "a" * 5000, "%ff%fe", "%ed%a0%80", "file-" + "0" * 24,
    "file-..%2f..%2fx", "%0d%0aX-Injected:%201", "99999999999999999999999", "-0", "+1", "0.0", "null", "%u0000",
    "file-%00", "..", ".", "%2e", "~", "%c0%af",
]
FILENAMES: list[Any] = ["../x", "/etc/passwd", "..", ".", "", "a/b", "a\\b", "x\x00y", "n" * 300, "con", "\x1b",
                        " ", "\ud800", "slot.bin", "%2e%2e", "a\nb", "\u202e.bin", "~root", ".hidden", None, 5, []]
ACTIONS: list[str] = ["save", "restore", "erase", "", "SAVE", "delete", "save&action=erase", "%00", "save%00",
                      "r" * 1000, "erase%20", "restore&filename=x"]
CONTENT_TYPES: list[str] = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=zz",
                            "application/json; charset=utf-16", "application/json; charset=latin-1", "",
                            "application/xml", "multipart/form-data", "application/json; boundary=--",
                            "application/octet-stream", "*/*"]
AUTH_HEADERS: list[tuple[str, str | bytes]] = [
    ("Authorization", "Bearer"), ("Authorization", "Bearer "), ("Authorization", "Bearer " + "x" * 8000),
    ("Authorization", "Basic Zm9vOmJhcg=="), ("Authorization", "bearer   k  "), ("Authorization", b"Bearer \xff\xfe"),
    ("X-Api-Key", "x" * 10000), ("X-Api-Key", ""), ("Authorization", "Bearer a, Bearer b"),
    ("Authorization", b"Bearer \xc3\xa9"), ("Authorization", "Token abc"),
]
# Query strings added to requests of every route: the server reads few (model, action, purpose, fail_on_no_slot),
# none of which may turn a request into a fault.
QUERIES: list[str] = [
    "model=%00", "model=nope", "model=%ff%fe", "model=%ed%a0%80", "model=" + "m" * 5000, "stream=true",
    "n_predict=999999", "fail_on_no_slot=1", "action=erase", "purpose=%00", "x=" + "y" * 3000, "%zz=%zz",
    "a=1&a=2&a=3", "=&&=", ";", "%00", "x=%0d%0aX-Injected:%201", "api_key=x", "key=" + "%ff" * 100,
]
ORIGINS: list[str | bytes] = ["http://evil.example", "null", "http://127.0.0.1.evil.example", "file://",
                              "http://[::1]:1", "x" * 3000, b"http://\xff"]
UNKNOWN_ROUTES: list[tuple[str, str]] = [
    ("POST", "/v1/batches"), ("GET", "/v1/batches/x"), ("POST", "/v1/audio/transcriptions"),
    ("POST", "/v2/chat/completions"), ("POST", "/v1/chat/completions/"), ("GET", "//v1//models"),
    ("GET", "/V1/MODELS"), ("GET", "/favicon.ico"), ("GET", "/.env"),
    ("GET", "/%2e%2e/%2e%2e/etc/passwd"), ("POST", "/v1/chat/completions%00"), ("GET", "/slots/"),
    ("GET", "/v1/" + "a" * 3000), ("POST", "/v1/completions/x"), ("GET", "/health/x"),
    ("PUT", "/v1/files/x/content"), ("GET", "/metrics/"), ("POST", "/slots/0/save/x"),
    ("POST", "/v1/messages/batches"), ("POST", "/v1/messages/"), ("POST", "/v1/messages/x/count_tokens"),
    ("GET", "/v1/responses/x/input_items"), ("POST", "/v1/responses/x/cancel"),
    ("POST", "/infill"), ("POST", "/embedding"), ("POST", "/v1/rerank"), ("GET", "/props/x"),
    ("POST", "/v1/apply-template"), ("POST", "/v1/completion"), ("POST", "/v1/embeddings/x"),
    ("POST", "/api/nope"), ("GET", "/api/"), ("GET", "/api"), ("POST", "/api/chat/x"), ("DELETE", "/api/tags"),
    ("POST", "/api/blobs/sha256:00"), ("GET", "/API/TAGS"), ("POST", "/api//chat"),
]
KNOWN_PATHS: list[tuple[str, str]] = [
    ("/v1/chat/completions", "/v1/chat/completions"), ("/v1/completions", "/v1/completions"),
    ("/v1/models", "/v1/models"), ("/v1/models/{id}", "/v1/models/x"), ("/v1/tokenize", "/v1/tokenize"),
    ("/tokenize", "/tokenize"), ("/v1/detokenize", "/v1/detokenize"), ("/detokenize", "/detokenize"),
    ("/health", "/health"), ("/metrics", "/metrics"), ("/slots", "/slots"), ("/slots/{id}/save", "/slots/0/save"),
    ("/slots/{id}/restore", "/slots/0/restore"), ("/slots/{id}/erase", "/slots/0/erase"),
    ("/slots/{id}", "/slots/0"), ("/v1/files", "/v1/files"), ("/v1/files/{id}", "/v1/files/" + FILE_ID),
    ("/v1/files/{id}/content", f"/v1/files/{FILE_ID}/content"), ("/chat/completions", "/chat/completions"),
    ("/models", "/models"), ("/v1/messages", "/v1/messages"),
    ("/v1/messages/count_tokens", "/v1/messages/count_tokens"),
    ("/v1/responses", "/v1/responses"), ("/v1/responses/{id}", "/v1/responses/" + RESPONSE_ID),
    ("/v1/embeddings", "/v1/embeddings"), ("/embeddings", "/embeddings"), ("/completion", "/completion"),
    ("/completions", "/completions"), ("/props", "/props"), ("/apply-template", "/apply-template"),
    ("/v1/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"),
    ("/chat/completions/input_tokens", "/chat/completions/input_tokens"),
    ("/api/chat", "/api/chat"), ("/api/generate", "/api/generate"), ("/api/embed", "/api/embed"),
    ("/api/embeddings", "/api/embeddings"), ("/api/tags", "/api/tags"), ("/api/ps", "/api/ps"),
    ("/api/show", "/api/show"), ("/api/pull", "/api/pull"), ("/api/delete", "/api/delete"),
    ("/api/version", "/api/version"), ("/", "/"), ("/models/load", "/models/load"),
    ("/models/unload", "/models/unload"),
]
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD", "TRACE", "PROPFIND", "FOO"]
PROMPTS = ["Hi", "The capital of France is", "1, 2, 3,", "Once upon a time", "def f(x):", "¿Qué?", "こんにちは"]


def set_path(body: Any, path: tuple, value: Any) -> Any:
    """Put `value` at `path` (keys and list indices), creating or replacing containers on the way."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(head, int):
        if not isinstance(body, list) or not body:
            body = [{}]
        index = min(head, len(body) - 1)
        body[index] = set_path(body[index], rest, value)
        return body
    if not isinstance(body, dict):
        body = {}
    body[head] = set_path(body.get(head), rest, value)
    return body


def drop_path(body: Any, path: tuple) -> None:
    node = body
    for key in path[:-1]:
        if isinstance(key, int) and isinstance(node, list) and node:
            node = node[min(key, len(node) - 1)]
        elif isinstance(key, str) and isinstance(node, dict) and key in node:
            node = node[key]
        else:
            return
    if isinstance(node, dict) and isinstance(path[-1], str):
        node.pop(path[-1], None)


# --- the probe factory --------------------------------------------------------------------------

SAMPLING_PATHS = [("temperature",), ("top_p",), ("top_k",), ("min_p",), ("repeat_penalty",), ("presence_penalty",),
                  ("frequency_penalty",), ("seed",), ("n",), ("max_tokens",), ("logit_bias",), ("stop",),
                  ("stream",), ("stream_options",), ("stream_options", "include_usage"), ("id_slot",),
                  ("ignore_eos",), ("model",)]
CHAT_PATHS = SAMPLING_PATHS + [
    ("messages",), ("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"), ("messages", 0, "name"),
    ("messages", 0, "tool_calls"), ("messages", 0, "tool_call_id"), ("messages", 0, "reasoning_content"),
    ("messages", 0, "content", 0, "text"), ("max_completion_tokens",), ("tools",), ("tools", 0, "function", "name"),
    ("tools", 0, "function", "parameters"), ("tool_choice",), ("parallel_tool_calls",), ("response_format",),
    ("response_format", "json_schema", "schema"), ("logprobs",), ("top_logprobs",), ("chat_template_kwargs",),
]
COMPLETION_PATHS = SAMPLING_PATHS + [("prompt",), ("prompt", 0), ("echo",), ("logprobs",)]
TOKENIZE_PATHS = [("content",), ("prompt",), ("add_special",), ("parse_special",), ("with_pieces",), ("model",)]
DETOKENIZE_PATHS = [("tokens",), ("tokens", 0), ("model",)]
SLOT_FILE_PATHS = [("filename",), ("file_id",)]
STRING_PATHS = [("model",), ("messages", 0, "content"), ("messages", 0, "name"), ("messages", 0, "role"),
                ("stop",), ("stop", 0), ("tools", 0, "function", "name"), ("messages", 0, "content", 0, "text"),
                ("prompt",), ("prompt", 0), ("content",), ("filename",), ("file_id",),
                ("messages", 0, "reasoning_content"), ("messages", 0, "tool_call_id")]
LLAMA_PATHS = SAMPLING_PATHS + [("prompt",), ("prompt", 0), ("prompt", 0, 0), ("n_predict",), ("n_probs",),
                                ("cache_prompt",), ("return_tokens",), ("response_fields",), ("grammar",),
                                ("json_schema",), ("logit_bias", 0)]
MESSAGES_PATHS = [("model",), ("max_tokens",), ("messages",), ("messages", 0), ("messages", 0, "role"),
                  ("messages", 0, "content"), ("messages", 0, "content", 0), ("messages", 0, "content", 0, "type"),
                  ("messages", 0, "content", 0, "text"), ("system",), ("system", 0, "text"), ("tools",),
                  ("tools", 0, "name"), ("tools", 0, "input_schema"), ("tool_choice",), ("tool_choice", "type"),
                  ("tool_choice", "name"), ("thinking",), ("thinking", "budget_tokens"), ("stop_sequences",),
                  ("temperature",), ("top_p",), ("top_k",), ("stream",), ("metadata",)]
MESSAGES_STRINGS = [("messages", 0, "content"), ("messages", 0, "content", 0, "text"), ("system",), ("model",),
                    ("tools", 0, "name"), ("tool_choice", "name"), ("stop_sequences", 0),
                    ("messages", 0, "content", 0, "id"), ("messages", 0, "content", 0, "tool_use_id")]
RESPONSES_PATHS = [("model",), ("input",), ("input", 0), ("input", 0, "role"), ("input", 0, "content"),
                   ("input", 0, "content", 0, "text"), ("input", 0, "type"), ("input", 0, "call_id"),
                   ("input", 0, "output"), ("instructions",), ("tools",), ("tools", 0, "name"),
                   ("tools", 0, "parameters"), ("tool_choice",), ("parallel_tool_calls",), ("max_output_tokens",),
                   ("temperature",), ("top_p",), ("text",), ("text", "format"), ("text", "format", "type"),
                   ("text", "format", "schema"), ("reasoning",), ("reasoning", "effort"), ("previous_response_id",),
                   ("store",), ("stream",), ("metadata",), ("user",)]
RESPONSES_STRINGS = [("input",), ("input", 0, "content"), ("input", 0, "content", 0, "text"), ("instructions",),
                     ("model",), ("tools", 0, "name"), ("previous_response_id",), ("user",), ("input", 0, "call_id"),
                     ("text", "format", "name")]
EMBEDDING_PATHS = [("model",), ("input",), ("input", 0), ("input", 0, 0), ("encoding_format",), ("dimensions",)]
EMBEDDING_STRINGS = [("input",), ("input", 0), ("model",), ("encoding_format",)]
OLLAMA_OPTION_PATHS = [("options",), ("options", "temperature"), ("options", "top_k"), ("options", "top_p"),
                       ("options", "min_p"), ("options", "seed"), ("options", "num_predict"), ("options", "num_ctx"),
                       ("options", "stop"), ("options", "repeat_penalty")]
OLLAMA_CHAT_PATHS = [("model",), ("messages",), ("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"),
                     ("messages", 0, "images"), ("messages", 0, "thinking"), ("messages", 0, "tool_name"),
                     ("messages", 0, "tool_calls"), ("messages", 0, "tool_calls", 0, "function", "arguments"),
                     ("tools",), ("tools", 0, "function", "name"), ("tools", 0, "function", "parameters"),
                     ("format",), ("stream",), ("keep_alive",), ("think",), ("logprobs",), ("top_logprobs",),
                     *OLLAMA_OPTION_PATHS]
OLLAMA_GENERATE_PATHS = [("model",), ("prompt",), ("system",), ("raw",), ("context",), ("context", 0), ("suffix",),
                         ("template",), ("images",), ("format",), ("stream",), ("keep_alive",), ("think",),
                         *OLLAMA_OPTION_PATHS]
OLLAMA_EMBED_PATHS = [("model",), ("input",), ("input", 0), ("prompt",), ("truncate",), ("dimensions",),
                      ("keep_alive",)]
OLLAMA_STRINGS = [("model",), ("messages", 0, "content"), ("messages", 0, "role"), ("messages", 0, "tool_name"),
                  ("prompt",), ("system",), ("keep_alive",), ("format",), ("think",), ("input",), ("input", 0),
                  ("options", "stop", 0)]
KEEP_ALIVES: list[Any] = ["5m", "-1m", "1h30m", "0", "0s", "forever", "", "1e3", "5 m", "9999999h", "-9999999h",
                          "1.5s", "10µs", "m", "--5m", Raw("NaN"), Raw("1e999"), 1e300, -1, 3600, [], {}, True, None]
OLLAMA_FORMATS: list[Any] = ["json", "", "xml", None, 5, [], {}, {"type": "string", "pattern": "("}, {"$ref": "#"},
                             {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                             {"type": "array", "minItems": 100000}, {"type": "integer", "minimum": 10, "maximum": 1}]
OLLAMA_OPTIONS: list[Any] = [{"num_ctx": 10**9}, {"num_ctx": 0}, {"num_predict": -2}, {"num_predict": -3},
                             {"num_predict": 0}, {"stop": "x"}, {"stop": [""]}, {"stop": ["a"] * 17},
                             {"temperature": Raw("NaN")}, {"temperature": -1}, {"seed": 2**64}, {"seed": -5},
                             {"top_k": 2**63}, {"top_p": 0}, {"mirostat": 2, "num_gpu": 99, "num_thread": -1},
                             {"repeat_last_n": -5, "typical_p": 7}, 5, [], None, "temperature=0"]


# The fields that bound a generation, per family: the one the server reads first first; the last is set.
BUDGET_FIELDS: dict[str, tuple[str, ...]] = {
    "chat": ("max_completion_tokens", "max_tokens"), "completion": ("max_tokens",),
    "llama": ("max_tokens", "n_predict"), "messages": ("max_tokens",), "responses": ("max_output_tokens",),
}


class ProbeFactory:
    """Builds the request list of a run from a seed: schema pools, mutations, and the fixed hostile cases."""

    def __init__(self, target: Target, seed: int, requests: int):
        from basert.server import ollama_schemas, schemas
        from basert.server.anthropic_schemas import MessagesRequest
        from basert.server.responses_schemas import ResponsesRequest
        from basert.server.routes.embeddings import EmbeddingRequest

        self.target = target
        self.seed = seed
        self.rng = random.Random(seed)
        pool_size = max(8, min(60, requests // 20))
        self.pools = {
            "chat": schema_pool(schemas.ChatCompletionRequest, pool_size, seed),
            "completion": schema_pool(schemas.CompletionRequest, max(8, pool_size // 2), seed),
            "tokenize": schema_pool(schemas.TokenizeRequest, 12, seed),
            "detokenize": schema_pool(schemas.DetokenizeRequest, 12, seed),
            "slot_file": schema_pool(schemas.SlotFileRequest, 12, seed),
            "llama": schema_pool(schemas.LlamaCompletionRequest, max(8, pool_size // 2), seed),
            # hypothesis-jsonschema is slow on this schema (~0.5 s a body): a smaller pool, which count_tokens
            # shares (a /v1/messages body is a count_tokens body with extra fields); mutation adds the variety.
            "messages": compact_free_form(schema_pool(MessagesRequest, max(4, pool_size // 4), seed)),
            "responses": compact_free_form(schema_pool(ResponsesRequest, max(8, pool_size // 2), seed)),
            "embeddings": schema_pool(EmbeddingRequest, 12, seed),
            "ollama_chat": compact_free_form(schema_pool(ollama_schemas.ChatRequest, max(4, pool_size // 4), seed)),
            "ollama_generate": schema_pool(ollama_schemas.GenerateRequest, max(8, pool_size // 2), seed),
            "ollama_embed": schema_pool(ollama_schemas.EmbedRequest, 12, seed),
        }

    # The run: generated probes with the fixed hostile ones spread among them.
    def build(self, requests: int) -> list[Probe]:
        hostile = self.hostile()
        generated = max(requests - len(hostile), requests // 3)
        kinds = [("chat", 30), ("completion", 15), ("tokenize", 8), ("detokenize", 5), ("models", 4),
                 ("slots", 10), ("files", 10), ("routes", 8), ("health", 2), ("messages", 10), ("responses", 9),
                 ("embeddings", 5), ("llama", 9), ("ollama", 10), ("model_admin", 3)]
        names, weights = zip(*kinds)
        builders: dict[str, Callable[[random.Random], Probe]] = {
            "chat": self.chat, "completion": self.completion, "tokenize": self.tokenize,
            "detokenize": self.detokenize, "models": self.models, "slots": self.slots, "files": self.files,
            "routes": self.routes, "health": self.health, "messages": self.messages, "responses": self.responses,
            "embeddings": self.embeddings, "llama": self.llama, "ollama": self.ollama,
            "model_admin": self.model_admin,
        }
        probes = []
        for i in range(generated):
            rng = random.Random(f"{self.seed}:{i}")
            probe = builders[rng.choices(names, weights)[0]](rng)
            probes.append(self.with_headers(probe, rng))
        for probe in hostile:
            probes.insert(self.rng.randint(0, len(probes)), probe)
        for index, probe in enumerate(probes):
            probe.index = index
        return probes

    # --- mutations of a JSON body ----
    def mutate(self, rng: random.Random, body: dict, paths: list[tuple], strings: list[tuple] = STRING_PATHS,
               special: Callable[[random.Random, Any], tuple[Any, str]] | None = None) -> tuple[Any, list[str]]:
        """Damage `body` at one to three of `paths` (`strings`: where a hostile string goes; `special`: the
        family's targeted values, the chat ones by default)."""
        notes: list[str] = []
        if rng.random() < 0.1:
            return body, notes
        for _ in range(rng.choice((1, 1, 1, 2, 2, 3))):
            kind = rng.choice(["drop", "wrong_type", "extreme", "hostile_string", "deep", "extra", "top_level",
                               "special"])
            path = rng.choice(paths)
            name = ".".join(map(str, path))
            if kind == "drop":
                drop_path(body, path)
                notes.append(f"drop:{name}")
            elif kind == "wrong_type":
                body = set_path(body, path, copy.deepcopy(rng.choice(WRONG_TYPES)))
                notes.append(f"wrong_type:{name}")
            elif kind == "extreme":
                body = set_path(body, path, rng.choice(EXTREME_NUMBERS))
                notes.append(f"extreme:{name}")
            elif kind == "hostile_string":
                body = set_path(body, rng.choice(strings), rng.choice(HOSTILE_STRINGS))
                notes.append("hostile_string")
            elif kind == "deep":
                depth = rng.choice((64, 1000, 10_000, 100_000))
                body = set_path(body, path, nested(depth, rng.choice(("list", "dict"))))
                notes.append(f"deep{depth}:{name}")
            elif kind == "extra":
                key = rng.choice(["", "\x00", "__proto__", "constructor", "k" * 3000, "max_tokens ", "MESSAGES"])
                if isinstance(body, dict):
                    body[key] = rng.choice(WRONG_TYPES + [nested(2000)])
                notes.append("extra_field")
            elif kind == "top_level":
                body = rng.choice([[], [body], "x", 0, None, True, Raw("NaN"), nested(100_000)])
                notes.append("top_level")
                break
            else:
                body, note = (special or self.special)(rng, body)
                notes.append(note)
        return body, notes

    def special(self, rng: random.Random, body: Any) -> tuple[Any, str]:
        """One of the targeted hostile values of the chat and completion fields."""
        choice = rng.choice(["logit_bias", "template_kwargs", "content_parts", "id_slot", "n", "max_tokens", "tools",
                             "tool_choice", "response_format", "stop", "seed"])
        if choice == "logit_bias":
            value = {rng.choice(LOGIT_BIAS_KEYS): rng.choice([1, -100, 100, 101, Raw("NaN"), Raw("1e999"), "x", None])}
            return set_path(body, ("logit_bias",), value), "logit_bias_key"
        if choice == "template_kwargs":
            return set_path(body, ("chat_template_kwargs",), copy.deepcopy(rng.choice(TEMPLATE_KWARGS))), choice
        if choice == "content_parts":
            return set_path(body, ("messages", 0, "content"), copy.deepcopy(rng.choice(CONTENT_PARTS))), choice
        if choice == "id_slot":
            n = self.target.n_slots
            value = rng.choice([-1, 0, n - 1, n, n + 1, 99, -5, 2**63, "0", 1.5, True])
            return set_path(body, ("id_slot",), value), "slot_hint"
        if choice == "n":
            return set_path(body, ("n",), rng.choice([0, -1, 8, 9, 16, 100, 2**40, "2", 1.5, None])), choice
        if choice == "max_tokens":
            key = rng.choice(["max_tokens", "max_completion_tokens"])
            value = rng.choice([0, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 10**30, 1.5, "8", None])
            return set_path(body, (key,), value), choice
        if choice == "tools":
            return set_path(body, ("tools",), copy.deepcopy(rng.choice(TOOLS))), choice
        if choice == "tool_choice":
            return set_path(body, ("tool_choice",), copy.deepcopy(rng.choice(TOOL_CHOICES))), choice
        if choice == "response_format":
            return set_path(body, ("response_format",), copy.deepcopy(rng.choice(RESPONSE_FORMATS))), choice
        if choice == "stop":
            value = rng.choice([[], [""], ["a"] * 17, "", [None], ["\x00"], [nested(1000)], ["x" * 100_000]])
            return set_path(body, ("stop",), copy.deepcopy(value)), choice
        return set_path(body, ("seed",), rng.choice([2**64, -(2**63) - 1, 10**30, -1, 1.5, Raw("NaN")])), choice

    def bound_generation(self, rng: random.Random, body: Any, probe: Probe, budget_fields: tuple[str, ...]) -> None:
        """Keep a generation cheap: its token budget <= 8 and n <= 2 unless a mutation chose them; a budget the
        mutation chose that is not a small integer is read as a stream and dropped after two events.
        `budget_fields`: the fields that bound the generation, the one the server reads first first."""
        if not isinstance(body, dict):
            return
        words = probe.tag.split()
        if any(re.search(rf"(?<!\w){name}(?!\w)", probe.tag) for name in budget_fields):
            budget = next((body[name] for name in budget_fields if name in body), None)
            if type(budget) is not int or not 1 <= budget <= 8:
                body["stream"] = True
                probe.disconnect_after = 2
        else:
            body[budget_fields[-1]] = rng.randint(1, 8)
            for name in budget_fields[:-1]:
                body.pop(name, None)
        n = body.get("n")
        if type(n) is int and 2 < n <= 8 and not any(w == "n" or w.endswith(":n") for w in words):
            body["n"] = 2
        slot = body.get("id_slot")
        if slot is not None and (type(slot) is not int or not 0 <= slot < self.target.n_slots):
            probe.tag += " id_slot"
        if body.get("stream") is True and probe.disconnect_after is None and rng.random() < 0.3:
            probe.disconnect_after = rng.randint(1, 3)

    def json_probe(self, rng: random.Random, endpoint: str, path: str, body: Any, notes: list[str],
                   family: str) -> Probe:
        probe = Probe(0, endpoint, "POST", path, headers={"Content-Type": "application/json"},
                      tag=f"{family} " + " ".join(notes))
        if family in BUDGET_FIELDS:
            self.bound_generation(rng, body, probe, BUDGET_FIELDS[family])
        probe.body = encode_json(body)
        self.mutate_bytes(rng, probe)
        return probe

    def mutate_bytes(self, rng: random.Random, probe: Probe) -> None:
        """Sometimes damage the encoded body: invalid UTF-8, truncation, garbage, BOM, empty."""
        if rng.random() > 0.08 or probe.body is None:
            return
        body = probe.body
        kind = rng.choice(["utf8", "truncate", "trailing", "bom", "empty", "latin1", "utf16"])
        if kind == "utf8" and body.endswith(b"}"):
            junk = rng.choice([b"\xff\xfe", b"\xc0\xaf", b"\xed\xa0\x80", b"\x80"])
            probe.body = body[:-1] + b', "junk": "' + junk + b'"}'
        elif kind == "truncate":
            probe.body = body[: rng.randint(0, max(0, len(body) - 1))]
        elif kind == "trailing":
            probe.body = body + rng.choice([b"garbage", b"\x00", b"}", b" {}", b"\n\n"])
        elif kind == "bom":
            probe.body = b"\xef\xbb\xbf" + body
        elif kind == "empty":
            probe.body = rng.choice([b"", b" ", b"null", b"[]", b"0", b'""'])
        elif kind == "latin1":
            probe.body = body.decode("utf-8", errors="replace").encode("latin-1", errors="replace")
        else:
            probe.body = body.decode("utf-8", errors="surrogatepass").encode("utf-16", errors="surrogatepass")
        probe.tag += f" bytes:{kind}"

    def with_headers(self, probe: Probe, rng: random.Random) -> Probe:
        """Sometimes a hostile header (content type, credentials, Accept, a cross-origin Origin) and sometimes a
        hostile query string."""
        if probe.raw is not None:
            return probe
        roll = rng.random()
        if roll < 0.06:
            probe.headers["Content-Type"] = rng.choice(CONTENT_TYPES)
            probe.tag += " content_type"
        elif roll < 0.10:
            name, value = rng.choice(AUTH_HEADERS)
            probe.headers[name] = value
            probe.tag += " auth"
        elif roll < 0.12:
            probe.headers["Accept"] = rng.choice(["text/event-stream", "application/xml", "\u00e9".encode("latin-1")])
            probe.tag += " accept"
        elif roll < 0.15:
            probe.headers["Origin"] = rng.choice(ORIGINS)
            probe.tag += " origin"
        if rng.random() < 0.08:
            probe.path += ("&" if "?" in probe.path else "?") + rng.choice(QUERIES)
            probe.tag += " query"
        return probe

    # --- endpoint families ----
    def conversation(self, rng: random.Random, pool: str) -> dict:
        """A body drawn from a messages-shaped pool: half the time with one plain user turn, sometimes naming
        the served model."""
        body = copy.deepcopy(rng.choice(self.pools[pool]))
        if rng.random() < 0.5:
            body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
        if rng.random() < 0.3:
            body["model"] = self.target.model_id
        return body

    def chat(self, rng: random.Random) -> Probe:
        body = self.conversation(rng, "chat")
        body, notes = self.mutate(rng, body, CHAT_PATHS)
        return self.json_probe(rng, "POST /v1/chat/completions", "/v1/chat/completions", body, notes, "chat")

    def completion(self, rng: random.Random) -> Probe:
        body = copy.deepcopy(rng.choice(self.pools["completion"]))
        if rng.random() < 0.5:
            body["prompt"] = rng.choice(PROMPTS + [[self.target.filler_token] * 3, [[1, 2], [3]], ["a", "b"]])
        body, notes = self.mutate(rng, body, COMPLETION_PATHS)
        return self.json_probe(rng, "POST /v1/completions", "/v1/completions", body, notes, "completion")

    def tokenize(self, rng: random.Random) -> Probe:
        body = copy.deepcopy(rng.choice(self.pools["tokenize"]))
        if rng.random() < 0.5:
            body["content"] = rng.choice(PROMPTS + ["<|im_start|>user<|im_end|>"])
        body, notes = self.mutate(rng, body, TOKENIZE_PATHS)
        path = rng.choice(["/v1/tokenize", "/tokenize"])
        return self.json_probe(rng, f"POST {path}", path, body, notes, "tokenize")

    def detokenize(self, rng: random.Random) -> Probe:
        body = copy.deepcopy(rng.choice(self.pools["detokenize"]))
        if rng.random() < 0.5:
            body["tokens"] = [rng.randrange(0, 2000) for _ in range(rng.randint(0, 20))]
        body, notes = self.mutate(rng, body, DETOKENIZE_PATHS)
        path = rng.choice(["/v1/detokenize", "/detokenize"])
        return self.json_probe(rng, f"POST {path}", path, body, notes, "detokenize")

    def models(self, rng: random.Random) -> Probe:
        if rng.random() < 0.3:
            query = rng.choice(["", "?x=1", "?model=%00"])
            return Probe(0, "GET /v1/models", "GET", "/v1/models" + query, tag="models")
        model_id = rng.choice([self.target.model_id, rng.choice(IDS), "smollm2", self.target.model_id + "%00",
                               "..%2f..%2fetc%2fpasswd", self.target.model_id.replace(" ", "%20")])
        return Probe(0, "GET /v1/models/{id}", "GET", "/v1/models/" + model_id.replace(" ", "%20"), tag="model_id")

    def health(self, rng: random.Random) -> Probe:
        path = rng.choice(["/health", "/metrics", "/health?x=%00", "/metrics?name=%ff"])
        return Probe(0, f"GET {path.split('?')[0]}", rng.choice(["GET", "GET", "HEAD"]), path, tag="health")

    def slot_id(self, rng: random.Random) -> str:
        n = self.target.n_slots
        return rng.choice([str(rng.randrange(n))] * 4 + [str(n), "-1"] + IDS)

    def slots(self, rng: random.Random) -> Probe:
        roll = rng.random()
        if roll < 0.15:
            model = self.target.model_id.replace(" ", "%20")
            query = rng.choice(["", "", f"?model={model}", "?model=nope", "?model=%00"])
            return Probe(0, "GET /slots", "GET", "/slots" + query, tag="slots_list")
        slot = self.slot_id(rng)
        body: Any = copy.deepcopy(rng.choice(self.pools["slot_file"]))
        if rng.random() < 0.5:
            body["filename"] = rng.choice(FILENAMES + [f"fuzz-{rng.randrange(4)}.bin"] * 6)
        if rng.random() < 0.5:
            body["file_id"] = rng.choice([FILE_ID] * 4 + IDS)
        body, notes = self.mutate(rng, body, SLOT_FILE_PATHS)
        if roll < 0.55:
            action = rng.choice(["save", "restore", "erase"])
            probe = self.json_probe(rng, f"POST /slots/{{id}}/{action}", f"/slots/{slot}/{action}", body, notes,
                                    "slot_file")
            if action == "save" and rng.random() < 0.3:
                probe.body = b""
            return probe
        action = rng.choice(ACTIONS[:3] * 3 + ACTIONS)
        return self.json_probe(rng, "POST /slots/{id}?action", f"/slots/{slot}?action={action}", body, notes,
                               "slot_file")

    def files(self, rng: random.Random) -> Probe:
        roll = rng.random()
        if roll < 0.35:
            return self.upload(rng)
        if roll < 0.45:
            body, notes = self.mutate(rng, {"purpose": "user_data", "file": "x"}, [("purpose",), ("file",)])
            return self.json_probe(rng, "POST /v1/files", "/v1/files", body, notes, "files_json")
        file_id = rng.choice([FILE_ID] * 5 + IDS)
        if roll < 0.55:
            return Probe(0, "GET /v1/files", "GET", "/v1/files" + rng.choice(["", "?purpose=slot_snapshot",
                                                                            "?purpose=%00", "?purpose=" + "p" * 3000]),
                         tag="files_list")
        if roll < 0.75:
            return Probe(0, "GET /v1/files/{id}", "GET", f"/v1/files/{file_id}", tag="file_get")
        if roll < 0.88:
            return Probe(0, "GET /v1/files/{id}/content", "GET", f"/v1/files/{file_id}/content", tag="file_content")
        return Probe(0, "DELETE /v1/files/{id}", "DELETE", f"/v1/files/{file_id}", tag="file_delete")

    def upload(self, rng: random.Random) -> Probe:
        filename = rng.choice(["data.jsonl", "../../../tmp/evil", "a" * 5000, "x\x00y", "\u202e.txt", "", "..",
                               "/etc/passwd", "C:\\x", "\ud800", "slot.bin", None])
        content = rng.choice([b"", b"hello", b"\x00" * 100, b"\xff" * 100, bytes(range(256)), b"{}\n" * 50,
                              b"BASE" + b"\x00" * 60])
        purpose = rng.choice(["user_data", "batch", "slot_snapshot", "", "p" * 5000, "\x00", None])
        parts = []
        if rng.random() < 0.9:
            parts.append(("file", filename, "application/octet-stream", content))
        if purpose is not None:
            parts.append(("purpose", None, None, purpose.encode("utf-8", errors="surrogatepass")))
        boundary = f"fuzz{rng.randrange(10**8)}"
        body = multipart(boundary, parts)
        headers: dict[str, str | bytes] = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
        kind = rng.choice(["ok"] * 6 + ["no_close", "wrong_boundary", "no_boundary", "json_type", "garbage"])
        if kind == "no_close":
            body = body[: body.rfind(b"--" + boundary.encode())]
        elif kind == "wrong_boundary":
            headers["Content-Type"] = "multipart/form-data; boundary=other"
        elif kind == "no_boundary":
            headers["Content-Type"] = "multipart/form-data"
        elif kind == "json_type":
            headers["Content-Type"] = "application/json"
        elif kind == "garbage":
            body = bytes(rng.randrange(256) for _ in range(300))
        return Probe(0, "POST /v1/files", "POST", "/v1/files", body=body, headers=headers, tag=f"upload {kind}")

    def messages(self, rng: random.Random) -> Probe:
        """Anthropic's /v1/messages, or /v1/messages/count_tokens with the same kind of body."""
        body = self.conversation(rng, "messages")
        count = rng.random() < 0.25
        if count and rng.random() < 0.5:
            for name in ("max_tokens", "stream", "temperature", "top_p", "top_k", "stop_sequences"):
                body.pop(name, None)
        body, notes = self.mutate(rng, body, MESSAGES_PATHS, MESSAGES_STRINGS, self.messages_special)
        if count:
            return self.json_probe(rng, "POST /v1/messages/count_tokens", "/v1/messages/count_tokens", body, notes,
                                   "count_tokens")
        return self.json_probe(rng, "POST /v1/messages", "/v1/messages", body, notes, "messages")

    def messages_special(self, rng: random.Random, body: Any) -> tuple[Any, str]:
        """One of the targeted hostile values of an Anthropic Messages body."""
        choice = rng.choice(["blocks", "tools", "tool_choice", "thinking", "stop_sequences", "system", "max_tokens"])
        if choice == "blocks":
            return set_path(body, ("messages",), copy.deepcopy(rng.choice(ANTHROPIC_TURNS))), choice
        if choice == "tools":
            return set_path(body, ("tools",), copy.deepcopy(rng.choice(ANTHROPIC_TOOLS))), choice
        if choice == "tool_choice":
            return set_path(body, ("tool_choice",), copy.deepcopy(rng.choice(ANTHROPIC_TOOL_CHOICES))), choice
        if choice == "thinking":
            value = rng.choice([{"type": "enabled", "budget_tokens": -1}, {"type": "enabled"}, {"type": "x"},
                                {"type": "enabled", "budget_tokens": 2**63}, "enabled", None, {"budget_tokens": 5}])
            return set_path(body, ("thinking",), copy.deepcopy(value)), choice
        if choice == "stop_sequences":
            value = rng.choice([[], [""], ["a"] * 17, [None], "stop", ["x" * 100_000], [nested(1000)], ["\x00"]])
            return set_path(body, ("stop_sequences",), copy.deepcopy(value)), choice
        if choice == "system":
            value = rng.choice([[{"type": "text"}], [{"type": "image", "source": {}}], "", [], 5, [None],
                                [{"type": "text", "text": Raw('"\\ud800"')}], [{"type": "text", "text": "s"}] * 300])
            return set_path(body, ("system",), copy.deepcopy(value)), choice
        return set_path(body, ("max_tokens",), rng.choice([0, -1, 2**31, 2**63, 10**30, 1.5, "8", None])), choice

    def responses(self, rng: random.Random) -> Probe:
        """OpenAI's Responses API: create (complete or streamed), or read or delete a stored response."""
        roll = rng.random()
        if roll < 0.2:
            response_id = rng.choice([RESPONSE_ID] * 20 + IDS + ["resp_" + "0" * 24])
            method = rng.choice(["GET", "GET", "DELETE"])
            return Probe(0, f"{method} /v1/responses/{{id}}", method, f"/v1/responses/{response_id}",
                         tag="response_" + method.lower())
        body = copy.deepcopy(rng.choice(self.pools["responses"]))
        if rng.random() < 0.5:
            prompt = rng.choice(PROMPTS)
            body["input"] = rng.choice([prompt, [{"role": "user", "content": prompt}],
                                        [{"type": "message", "role": "user", "content": [
                                            {"type": "input_text", "text": prompt}]}]])
        if rng.random() < 0.2:
            body["previous_response_id"] = RESPONSE_ID
        if rng.random() < 0.3:
            body["model"] = self.target.model_id
        body, notes = self.mutate(rng, body, RESPONSES_PATHS, RESPONSES_STRINGS, self.responses_special)
        return self.json_probe(rng, "POST /v1/responses", "/v1/responses", body, notes, "responses")

    def responses_special(self, rng: random.Random, body: Any) -> tuple[Any, str]:
        """One of the targeted hostile values of a Responses request."""
        choice = rng.choice(["items", "text_format", "tools", "tool_choice", "previous_response_id", "metadata",
                             "reasoning", "max_output_tokens"])
        if choice == "items":
            return set_path(body, ("input",), copy.deepcopy(rng.choice(RESPONSE_ITEMS))), choice
        if choice == "text_format":
            return set_path(body, ("text",), {"format": copy.deepcopy(rng.choice(TEXT_FORMATS))}), choice
        if choice == "tools":
            return set_path(body, ("tools",), copy.deepcopy(rng.choice(RESPONSE_TOOLS))), choice
        if choice == "tool_choice":
            value = rng.choice(["required", "none", "any", 5, None, {"type": "function"},
                                {"type": "function", "name": "missing"}, {"type": "file_search"}])
            return set_path(body, ("tool_choice",), copy.deepcopy(value)), choice
        if choice == "previous_response_id":
            value = rng.choice([RESPONSE_ID, "resp_x", "", "\x00", "a" * 5000, None, 5, Raw('"\\ud800"')])
            return set_path(body, ("previous_response_id",), value), choice
        if choice == "metadata":
            value = rng.choice([{str(i): "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 5},
                                [], "m", {"": ""}])
            return set_path(body, ("metadata",), copy.deepcopy(value)), choice
        if choice == "reasoning":
            value = rng.choice([{"effort": "high"}, {"effort": "max"}, {"summary": 5}, "high", {"effort": None}])
            return set_path(body, ("reasoning",), copy.deepcopy(value)), choice
        value = rng.choice([0, -1, 2**31, 2**63, 10**30, 1.5, "8", None])
        return set_path(body, ("max_output_tokens",), value), choice

    def embeddings(self, rng: random.Random) -> Probe:
        body = copy.deepcopy(rng.choice(self.pools["embeddings"]))
        if rng.random() < 0.5:
            body["input"] = rng.choice(PROMPTS + [[self.target.filler_token] * 3, ["a", "b"], [[1, 2], [3]]])
        body, notes = self.mutate(rng, body, EMBEDDING_PATHS, EMBEDDING_STRINGS, self.embeddings_special)
        path = rng.choice(["/v1/embeddings", "/v1/embeddings", "/embeddings"])
        return self.json_probe(rng, f"POST {path}", path, body, notes, "embeddings")

    def embeddings_special(self, rng: random.Random, body: Any) -> tuple[Any, str]:
        choice = rng.choice(["input", "input", "dimensions", "encoding_format"])
        if choice == "input":
            value = rng.choice(self.embedding_inputs())
            return set_path(body, ("input",), copy.deepcopy(value)), "embedding_input"
        if choice == "dimensions":
            return set_path(body, ("dimensions",), rng.choice([0, -1, 1, 576, 2**63, "576", 1.5, None])), choice
        return set_path(body, ("encoding_format",), rng.choice(["base64", "float", "", "binary", None, 5])), choice

    def embedding_inputs(self) -> list[Any]:
        """Inputs of /v1/embeddings that are empty, out of range, too long or of mixed shapes."""
        n_ctx = self.target.n_ctx
        return [[], [[]], [""], "", [[], [1]], [-1], [10**9], [2**63], [[1, -1]], [1, "a"], [[1], "a"], [True], [1.5],
                [self.target.filler_token] * (n_ctx + 1), " a" * (n_ctx + 10), ["a"] * 2049, [None], nested(100),
                [[self.target.filler_token]] * 64]

    def llama(self, rng: random.Random) -> Probe:
        """llama.cpp's routes: /completion (and /completions), /apply-template, the input-token count, /props."""
        roll = rng.random()
        if roll < 0.55:
            body = copy.deepcopy(rng.choice(self.pools["llama"]))
            if rng.random() < 0.5:
                body["prompt"] = rng.choice(PROMPTS + [[self.target.filler_token] * 3, [12, "text", 34], ["a", "b"]])
            body, notes = self.mutate(rng, body, LLAMA_PATHS, STRING_PATHS, self.llama_special)
            path = rng.choice(["/completion", "/completion", "/completions"])
            return self.json_probe(rng, f"POST {path}", path, body, notes, "llama")
        if roll < 0.8:
            body = copy.deepcopy(rng.choice(self.pools["chat"]))
            if rng.random() < 0.5:
                body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
            body, notes = self.mutate(rng, body, CHAT_PATHS)
            path = rng.choice(["/apply-template", "/v1/chat/completions/input_tokens",
                               "/chat/completions/input_tokens"])
            return self.json_probe(rng, f"POST {path}", path, body, notes, "template")
        if roll < 0.95:
            model = self.target.model_id.replace(" ", "%20")
            query = rng.choice(["", "", f"?model={model}", "?model=nope", "?model=%00", "?model=%ff",
                                "?x=" + "y" * 3000])
            return Probe(0, "GET /props", "GET", "/props" + query, tag="props")
        body, notes = self.mutate(rng, {"default_generation_settings": {"n_predict": 5}}, [("x",)])
        return self.json_probe(rng, "POST /props", "/props", body, notes, "props_change")

    def llama_special(self, rng: random.Random, body: Any) -> tuple[Any, str]:
        """One of the targeted hostile values of llama.cpp's /completion."""
        choice = rng.choice(["prompt", "logit_bias", "n_probs", "n_predict", "grammar", "json_schema",
                             "response_fields", "id_slot"])
        if choice == "prompt":
            return set_path(body, ("prompt",), copy.deepcopy(rng.choice(LLAMA_PROMPTS))), "llama_prompt"
        if choice == "logit_bias":
            return set_path(body, ("logit_bias",), copy.deepcopy(rng.choice(LLAMA_LOGIT_BIAS))), "llama_logit_bias"
        if choice == "n_probs":
            return set_path(body, ("n_probs",), rng.choice([0, 20, 21, -1, 2**63, "5", 1.5])), choice
        if choice == "n_predict":
            return set_path(body, ("n_predict",), rng.choice([-1, 0, -2, 2**31, 2**63, 1.5, "8", None])), choice
        if choice == "grammar":
            value = rng.choice(['root ::= (', 'root ::= "a"', "", "root ::= root", "root ::= [^\\x00]*", "x" * 5000,
                                'root ::= "a" | ', Raw('"\\ud800"')])
            return set_path(body, ("grammar",), value), choice
        if choice == "json_schema":
            value = rng.choice([{"type": "string", "pattern": "("}, {"$ref": "#"}, "string", {}, [],
                                {"type": "array", "minItems": 100000},
                                {"type": "integer", "minimum": 10, "maximum": 1}])
            return set_path(body, ("json_schema",), copy.deepcopy(value)), choice
        if choice == "response_fields":
            value = rng.choice([["a/b/c"], [""], ["/" * 100], ["content"] * 1000, [5], "content", [None],
                                ["generation_settings/n_predict", "timings/x/y"]])
            return set_path(body, ("response_fields",), copy.deepcopy(value)), choice
        n = self.target.n_slots
        return set_path(body, ("id_slot",), rng.choice([-1, 0, n - 1, n, 99, 2**63, "0", 1.5])), "slot_hint"

    def ollama(self, rng: random.Random) -> Probe:
        """Ollama's routes: chat and generate (streamed by default), embed and embeddings, the listings, show, pull
        and delete (of the served model or unknown ones only), version and the root."""
        roll = rng.random()
        if roll < 0.4:
            body = self.ollama_body(rng, "ollama_chat")
            if rng.random() < 0.5:
                body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
            for message in body.get("messages") or []:
                if isinstance(message, dict) and rng.random() < 0.8:
                    message.pop("images", None)
            body, notes = self.mutate(rng, body, OLLAMA_CHAT_PATHS, OLLAMA_STRINGS, self.ollama_special)
            return self.ollama_probe(rng, "/api/chat", body, notes)
        if roll < 0.7:
            body = self.ollama_body(rng, "ollama_generate")
            if rng.random() < 0.6:
                body["prompt"] = rng.choice(PROMPTS)
            for name, share in (("suffix", 0.9), ("template", 0.9), ("images", 0.9), ("context", 0.7)):
                if rng.random() < share:
                    body.pop(name, None)
            body, notes = self.mutate(rng, body, OLLAMA_GENERATE_PATHS, OLLAMA_STRINGS, self.ollama_special)
            return self.ollama_probe(rng, "/api/generate", body, notes)
        if roll < 0.85:
            body = self.ollama_body(rng, "ollama_embed")
            path = rng.choice(["/api/embed", "/api/embed", "/api/embeddings"])
            if path == "/api/embeddings":
                body.pop("input", None)
                body["prompt"] = rng.choice(PROMPTS)
            elif rng.random() < 0.5:
                body["input"] = rng.choice(PROMPTS + [["a", "b"], "", [], [""]])
            body, notes = self.mutate(rng, body, OLLAMA_EMBED_PATHS, OLLAMA_STRINGS, self.ollama_special)
            return self.ollama_probe(rng, path, body, notes)
        return self.ollama_admin(rng)

    def ollama_body(self, rng: random.Random, pool: str) -> dict:
        """A body drawn from an Ollama pool, most of the time naming the served model (Ollama's routes know no
        other), without the drawn keep_alive (0 would unload the model after each request), often without the drawn
        think and format."""
        body = copy.deepcopy(rng.choice(self.pools[pool]))
        body.pop("keep_alive", None)
        if rng.random() < 0.85:
            body["model"] = rng.choice([self.target.model_id] * 3 + [self.target.model_id + ":latest"])
        for name in ("think", "format"):     # drawn, they are mostly refused: a 400 before any generation
            if rng.random() < 0.7:
                body.pop(name, None)
        return body

    def ollama_special(self, rng: random.Random, body: Any) -> tuple[Any, str]:
        """One of the targeted hostile values of an Ollama body."""
        choice = rng.choice(["keep_alive", "format", "options", "images", "think", "tool_calls", "context", "load"])
        if choice == "keep_alive":
            return set_path(body, ("keep_alive",), rng.choice(KEEP_ALIVES)), choice
        if choice == "format":
            return set_path(body, ("format",), copy.deepcopy(rng.choice(OLLAMA_FORMATS))), choice
        if choice == "options":
            return set_path(body, ("options",), copy.deepcopy(rng.choice(OLLAMA_OPTIONS))), choice
        if choice == "images":
            path = rng.choice([("images",), ("messages", 0, "images")])
            return set_path(body, path, rng.choice([["aGk="], [], None, 5, [nested(100)], "aGk="])), choice
        if choice == "think":
            return set_path(body, ("think",), rng.choice([True, False, "high", "max", 1, None, "true"])), choice
        if choice == "tool_calls":
            arguments = rng.choice([{}, {"city": "Rome"}, "{}", None, 5, [], {"a": nested(100, "dict")}])
            turn = {"role": "assistant", "content": rng.choice(["", None, "x"]),
                    "tool_calls": [{"function": {"name": rng.choice(["f", "", 5]), "arguments": arguments}}]}
            answer = {"role": "tool", "content": "sunny", "tool_name": rng.choice(["f", "g", None])}
            return set_path(body, ("messages",), [{"role": "user", "content": "q"}, turn, answer]), choice
        if choice == "context":
            value = rng.choice([[-1], [10**9], [2**63], ["a"], [1.5], [True], [], list(range(1, 6)), "1,2", None])
            return set_path(body, ("context",), value), choice
        for name in ("messages", "prompt", "input"):     # no prompt: the model is loaded (or unloaded)
            if isinstance(body, dict) and name in body:
                body[name] = [] if name != "prompt" else ""
        return body, "load"

    def ollama_probe(self, rng: random.Random, path: str, body: Any, notes: list[str]) -> Probe:
        probe = Probe(0, f"POST {path}", "POST", path, headers={"Content-Type": "application/json"},
                      tag="ollama " + " ".join(notes))
        if path in ("/api/chat", "/api/generate") and isinstance(body, dict):
            self.bound_ollama(rng, body, probe)
        probe.body = encode_json(body)
        self.mutate_bytes(rng, probe)
        return probe

    def bound_ollama(self, rng: random.Random, body: dict, probe: Probe) -> None:
        """Keep a generation cheap: options.num_predict <= 8 unless a mutation chose the options; a budget the
        mutation chose that is not a small integer is read as a stream and dropped after two lines. Ollama streams
        unless told not to; such streams are sometimes dropped early too."""
        options = body.get("options")
        if "options" in probe.tag:
            budget = options.get("num_predict") if isinstance(options, dict) else None
            if type(budget) is not int or not 1 <= budget <= 8:
                body["stream"] = True
                probe.disconnect_after = 2
        else:
            body["options"] = {**(options if isinstance(options, dict) else {}), "num_predict": rng.randint(1, 8)}
        if body.get("stream", True) is True and probe.disconnect_after is None and rng.random() < 0.3:
            probe.disconnect_after = rng.randint(1, 3)

    def ollama_admin(self, rng: random.Random) -> Probe:
        """The listings, version, root, show, and pull / delete of the served model or unknown names."""
        roll = rng.random()
        if roll < 0.35:
            path = rng.choice(["/api/tags", "/api/ps", "/api/version", "/", "/api/tags?x=%00"])
            return Probe(0, f"GET {path.split('?')[0]}", rng.choice(["GET", "GET", "HEAD"]), path, tag="ollama_list")
        name = rng.choice([self.target.model_id, self.target.model_id + ":latest", "nope", "nope:latest", "", 5, None,
                           rng.choice(HOSTILE_STRINGS), "../../etc/passwd", "org/name:variant"])
        if roll < 0.6:
            body, notes = self.mutate(rng, {"model": name}, [("model",), ("name",), ("verbose",)], [("model",)])
            return self.ollama_probe(rng, "/api/show", body, notes)
        if roll < 0.85:
            body, notes = self.mutate(rng, {"model": name, "stream": rng.choice([True, False, None, "x"])},
                                      [("stream",), ("insecure",)], [("insecure",)])
            return self.ollama_probe(rng, "/api/pull", body, notes)
        unknown = rng.choice(["nope", "nope:latest", "", 5, None, rng.choice(HOSTILE_STRINGS), "../x"])
        probe = Probe(0, "DELETE /api/delete", "DELETE", "/api/delete", headers={"Content-Type": "application/json"},
                      body=encode_json({"model": unknown}), tag="ollama_delete")
        return probe

    def model_admin(self, rng: random.Random) -> Probe:
        """POST /models/load and /models/unload (llama-server's router names): loads of the served model (already
        loaded: a no-op) and of unknown or hostile names, unloads of unknown or hostile names only (an unloaded
        served model would be reloaded by the next probe, slowing the run without testing more)."""
        action = rng.choice(["load", "unload"])
        names = ["nope", "nope:latest", "", 5, None, rng.choice(HOSTILE_STRINGS), "../../etc/passwd"]
        name = rng.choice(names + ([self.target.model_id] * 3 if action == "load" else []))
        body = {"model": name}
        if action == "load":
            body["keep_alive"] = rng.choice(["5m", -1, 0.5, "1h30m", "forever", 1e300, "", None, [], "-5m"])
        body, notes = self.mutate(rng, body, [("model",), ("keep_alive",)], [("model",)])
        if action == "unload" and isinstance(body, dict) and body.get("model") == self.target.model_id:
            body["model"] = "nope"
        return self.json_probe(rng, f"POST /models/{action}", f"/models/{action}", body, notes, "model_admin")

    def routes(self, rng: random.Random) -> Probe:
        if rng.random() < 0.5:
            method, path = rng.choice(UNKNOWN_ROUTES)
            return Probe(0, "unknown route", method, path, body=b"{}" if method == "POST" else None,
                         headers={"Content-Type": "application/json"}, tag="unknown_route")
        endpoint, path = rng.choice(KNOWN_PATHS)
        method = rng.choice(METHODS)
        body = None
        if method in ("POST", "PUT", "PATCH"):   # every budget field: a route that generates stops at once
            body = (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "n_predict": 1, '
                    b'"max_output_tokens": 1, "input": "x"}')
        return Probe(0, f"{method} {endpoint}", method, path, body=body, headers={"Content-Type": "application/json"},
                     tag="method")

    # --- the fixed hostile cases ----
    def hostile(self) -> list[Probe]:
        t = self.target
        n = t.n_slots
        user = [{"role": "user", "content": "hi"}]
        chat = "/v1/chat/completions"
        cases: list[tuple[str, str, str, Any]] = []   # (tag, method, path, body as a JSON value or bytes)

        def add(tag: str, body: Any, path: str = chat, method: str = "POST") -> None:
            cases.append((tag, method, path, body))

        for depth in (1000, 100_000):
            add(f"deep{depth} body", nested(depth))
            add(f"deep{depth} content", {"messages": [{"role": "user", "content": nested(depth, "dict")}]})
            add(f"deep{depth} tokenize", {"content": nested(depth)}, "/v1/tokenize")
            add(f"deep{depth} template kwargs", {"messages": user, "max_tokens": 1,
                                                 "chat_template_kwargs": {"x": nested(depth, "dict")}})
        for text in ('"\\ud800"', '"a\\udfffb"', '"\\ud800\\ud800"', '"\\udc00"'):
            add(f"lone surrogate content {text}",
                {"messages": [{"role": "user", "content": Raw(text)}], "max_tokens": 1})
            add(f"lone surrogate tokenize {text}", {"content": Raw(text)}, "/v1/tokenize")
            add(f"lone surrogate prompt {text}", {"prompt": Raw(text), "max_tokens": 1}, "/v1/completions")
        add("lone surrogate model", {"messages": user, "model": Raw('"\\ud800"'), "max_tokens": 1})
        add("lone surrogate stop", {"messages": user, "stop": [Raw('"\\ud800"')], "max_tokens": 1})
        add("lone surrogate logit_bias key", {"messages": user, "logit_bias": {Raw('"\\ud800"'): 1}, "max_tokens": 1})
        add("lone surrogate tool name", {"messages": user, "max_tokens": 1, "tools": [
            {"type": "function", "function": {"name": Raw('"\\ud800"')}}], "tool_choice": "required"})
        add("lone surrogate filename", {"filename": Raw('"\\ud800.bin"')}, "/slots/0?action=save")
        add("lone surrogate file_id", {"file_id": Raw('"\\ud800"')}, "/slots/0/restore")
        for value in ("NaN", "Infinity", "-Infinity", "1e999"):
            add(f"{value} temperature", {"messages": user, "max_tokens": 1, "temperature": Raw(value)})
            add(f"{value} logit_bias value", {"messages": user, "max_tokens": 1, "logit_bias": {"5": Raw(value)}})
            add(f"{value} top_p", {"prompt": "x", "max_tokens": 1, "top_p": Raw(value)}, "/v1/completions")
            add(f"{value} in tool parameters", {"messages": user, "max_tokens": 2, "tool_choice": "required", "tools": [
                {"type": "function", "function": {"name": "f",
                                                  "parameters": {"type": "number", "maximum": Raw(value)}}}]})
        for key in ("²", "①", "٣", "--5", "-0", "+5", " 5", "1e3", "", "999999999999", "-1", "٣٣"):
            add(f"logit_bias key {key!r}", {"messages": user, "max_tokens": 1, "logit_bias": {key: 1}})
        for kwargs in ({"messages": []}, {"tools": []}, {"add_generation_prompt": False}, {"self": 1},
                       {"bos_token": 5}, {"enable_thinking": True}, {"raise_exception": None}, {"namespace": 1}):
            add(f"chat_template_kwargs {list(kwargs)[0]}",
                {"messages": user, "max_tokens": 1, "chat_template_kwargs": kwargs})
        for parts in ([{"type": "text"}], [{"type": "text", "text": None}], [{"text": "x"}], [],
                      [{"type": "image_url", "image_url": {"url": "data:,x"}}], [None]):
            add(f"content parts {json.dumps(parts)[:40]}",
                {"messages": [{"role": "user", "content": parts}], "max_tokens": 1})
        for slot in (-1, 0, n - 1, n, 99, -5, 2**63, 2**31):
            add(f"slot_hint {slot}", {"messages": user, "max_tokens": 1, "id_slot": slot})
            add(f"slot_hint {slot} completion", {"prompt": "x", "max_tokens": 1, "id_slot": slot}, "/v1/completions")
        for value in (2**31 - 1, 2**31, 2**63 - 1, 2**63, 10**30):
            add(f"huge max_tokens stream {value}", {"messages": user, "max_tokens": value, "stream": True})
            add(f"huge max_tokens stream completion {value}", {"prompt": "x", "max_tokens": value, "stream": True},
                "/v1/completions")
        if t.n_ctx <= 1024:   # the whole answer, cheap: the prompt leaves room for three tokens
            add("huge max_tokens near-full prompt", {"prompt": [t.filler_token] * (t.n_ctx - 4),
                                                     "max_tokens": 2**63 - 1, "temperature": 0}, "/v1/completions")
        for value in (0, -1, 9, 16, 100, 2**40):
            add(f"n {value}", {"messages": user, "max_tokens": 1, "n": value})
        add("n 8", {"messages": user, "max_tokens": 2, "n": 8})
        for field_name, value in (("top_k", 2**63), ("top_k", 2**31), ("seed", 2**64), ("seed", -(2**63) - 1),
                                  ("seed", 10**30), ("top_logprobs", 20), ("max_tokens", 0), ("repeat_penalty", 1e308),
                                  ("min_p", 1.0), ("top_p", 5e-324), ("temperature", 5e-324)):
            add(f"{field_name} {value}", {"messages": user, "max_tokens": 2, field_name: value, "logprobs": True})
        add("logprobs -100 bias", {"messages": user, "max_tokens": 2, "logprobs": True, "top_logprobs": 20,
                                    "logit_bias": {str(i): -100 for i in range(50)}})
        add("completion logprobs 5 echo", {"prompt": "Hi", "max_tokens": 2, "logprobs": 5, "echo": True},
            "/v1/completions")
        for sampling in ({"top_k": 1}, {"min_p": 1.0}, {"top_p": 5e-324}, {"temperature": 0}, {"temperature": 2.0},
                         {"logit_bias": {str(t.filler_token): 100}}, {"repeat_penalty": 1e308},
                         {"frequency_penalty": 2.0, "presence_penalty": -2.0}):
            add(f"logprobs with {json.dumps(sampling)}", {"messages": user, "max_tokens": 3, "logprobs": True,
                                                           "top_logprobs": 20, **sampling})
            add(f"completion logprobs with {json.dumps(sampling)}", {"prompt": "Hi", "max_tokens": 3, "logprobs": 5,
                                                                      "echo": True, **sampling}, "/v1/completions")
        for prompt in ([], [[]], [[1, 2], []], [-1], [10**9], [2**63], "", [""], ["a", 1], [1.5], [True], [[[1]]]):
            add(f"prompt {json.dumps(prompt)[:30]}", {"prompt": prompt, "max_tokens": 1}, "/v1/completions")
        for tokens in ([-1], [10**9], [2**63], [10**30], ["1"], [1.5], [None], [[1]], list(range(20000))):
            add(f"detokenize {json.dumps(tokens)[:30]}", {"tokens": tokens}, "/v1/detokenize")
        for text in ("\x00", "a\x00b", "\x1b[2J", "<|im_start|><|im_end|>" * 100):
            add(f"control chars content {text[:8]!r}",
                {"messages": [{"role": "user", "content": text}], "max_tokens": 1})
        add("stop empty string", {"messages": user, "max_tokens": 1, "stop": [""]})
        add("stop 17", {"messages": user, "max_tokens": 1, "stop": ["a"] * 17})
        add("response_format json_schema missing",
            {"messages": user, "max_tokens": 1, "response_format": {"type": "json_schema"}})
        add("response_format bad regex", {"messages": user, "max_tokens": 2, "response_format": {
            "type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "("}}}})
        add("response_format $ref loop", {"messages": user, "max_tokens": 2, "response_format": {
            "type": "json_schema", "json_schema": {"schema": {"$ref": "#"}}}})
        add("tool_choice names a missing tool", {"messages": user, "max_tokens": 1, "tool_choice": {
            "type": "function", "function": {"name": "g"}}, "tools": [{"type": "function", "function": {"name": "f"}}]})
        add("tool_choice required without tools", {"messages": user, "max_tokens": 1, "tool_choice": "required"})
        # Valid but intricate: forced and truncated tool calls, constrained JSON, several choices, streamed.
        weather = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"]}}}]
        named = {"type": "function", "function": {"name": "get_weather"}}
        listing = {"type": "json_schema", "json_schema": {"name": "l", "schema": {
            "type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}, "required": ["a"]}}}
        for stream in (False, True):
            add(f"complex forced tool call n 2 stream={stream}", {
                "messages": user, "tools": weather, "tool_choice": "required", "max_tokens": 8, "n": 2,
                "stream": stream, "stream_options": {"include_usage": True} if stream else None,
                "logprobs": True, "top_logprobs": 2})
            add(f"complex named tool call cut at 1 token stream={stream}", {
                "messages": user, "tools": weather, "tool_choice": named, "max_tokens": 1, "stream": stream})
            add(f"complex json_schema n 2 stream={stream}", {
                "messages": user, "response_format": listing, "max_tokens": 8, "n": 2, "stream": stream})
            add(f"complex completion echo logprobs n 2 stream={stream}", {
                "prompt": "Hi", "echo": True, "logprobs": 2, "n": 2, "stream": stream, "max_tokens": 4,
                "stop": ["\n", "."]}, "/v1/completions")
        add("complex completion three prompts n 2", {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2},
            "/v1/completions")
        add("complex conversation", {"max_tokens": 2, "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "reasoning_content": "hm", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "user", "content": "and?"}],
            "tools": weather})
        for body in (b"", b" ", b"null", b"[]", b"0", b'"x"', b"{", b'{"messages": [}', b"\xff\xfe\x00",
                     b'{"messages": [{"role": "user", "content": "\xff"}]}',
                     b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
                     b'{"messages": [{"role": "user", "content": "\xc0\xaf"}]}',
                     b'\xef\xbb\xbf{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}',
                     b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}garbage',
                     b'{"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "messages": 5}',
                     b'{"prompt": "x", "max_tokens": 1' + b", \"a\": 1" * 20000 + b"}",
                     b'{"prompt": ' + b"1" * 5000 + b"}", b'{"prompt": "\\x41"}', b'{"prompt": "\\u12"}'):
            add(f"bytes {body[:24]!r}", body)
        for endpoint in ("/v1/chat/completions", "/v1/completions", "/v1/tokenize", "/slots/0/restore", "/v1/files"):
            add(f"nan body {endpoint}", b'{"x": NaN}', endpoint)
        for filename in ("../x", "/etc/passwd", "..", ".", "", "a/b", "x\x00y", "n" * 300, "a\nb", "\u202e"):
            for action in ("save", "restore"):
                add(f"slot {action} filename {filename[:12]!r}", {"filename": filename}, f"/slots/0?action={action}")
        add("slot save ok", {"filename": "fuzz-ok.bin"}, "/slots/0?action=save")
        add("slot restore ok", {"filename": "fuzz-ok.bin"}, "/slots/0?action=restore")
        add("slot restore missing", {"filename": "no-such.bin"}, "/slots/0?action=restore")
        add("slot restore junk file_id", {"file_id": FILE_ID}, "/slots/0/restore")
        add("slot restore file_id traversal", {"file_id": "../../etc/passwd"}, "/slots/0/restore")
        for slot in ("-1", "99", str(n), "٣", "1e3", "99999999999999999999", "%00", "a"):
            add(f"slot erase {slot}", b"", f"/slots/{slot}/erase")
            add(f"slot action erase {slot}", b"{}", f"/slots/{slot}?action=erase")
        for action in ("", "delete", "SAVE", "%00"):
            add(f"slot action {action!r}", {"filename": "x.bin"}, f"/slots/0?action={action}")
        self.hostile_other_apis(add)
        probes = []
        for tag, method, path, body in cases:
            data = body if isinstance(body, bytes) else encode_json(body)
            endpoint = route_of(method, path)
            probe = Probe(0, endpoint, method, path, body=data, headers={"Content-Type": "application/json"},
                          tag=f"hostile {tag}")
            if tag.startswith("huge max_tokens stream"):
                probe.disconnect_after = 2
            if tag.startswith("slot_hint") and not 0 <= body["id_slot"] < n:
                probe.tag += " id_slot"
            probes.append(probe)
        probes += self.hostile_http()
        return probes

    def hostile_other_apis(self, add: Callable[..., None]) -> None:
        """Fixed cases for the Anthropic, Responses, embeddings and llama.cpp routes."""
        t = self.target
        user = [{"role": "user", "content": "hi"}]
        messages, count, responses = "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"
        embeddings, completion = "/v1/embeddings", "/completion"
        surrogate = Raw('"\\ud800"')
        for depth in (1000, 100_000):
            add(f"deep{depth} messages", {"max_tokens": 1, "messages": [{"role": "user", "content": nested(depth)}]},
                messages)
            add(f"deep{depth} count_tokens tool", {"messages": user, "tools": [
                {"name": "f", "input_schema": {"x": nested(depth, "dict")}}]}, count)
            add(f"deep{depth} responses", {"max_output_tokens": 1, "input": nested(depth, "dict")}, responses)
            add(f"deep{depth} embeddings", {"input": nested(depth)}, embeddings)
            add(f"deep{depth} completion", {"n_predict": 1, "prompt": nested(depth)}, completion)
        add("lone surrogate messages content", {"max_tokens": 1, "messages": [{"role": "user", "content": surrogate}]},
            messages)
        add("lone surrogate messages system", {"max_tokens": 1, "messages": user, "system": surrogate}, messages)
        add("lone surrogate messages tool name", {"max_tokens": 1, "messages": user, "tools": [
            {"name": surrogate, "input_schema": {}}]}, messages)
        add("lone surrogate count_tokens", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": surrogate}]}]}, count)
        add("lone surrogate responses instructions", {"max_output_tokens": 1, "input": "hi",
                                                      "instructions": surrogate}, responses)
        add("lone surrogate responses previous id", {"max_output_tokens": 1, "input": "hi",
                                                     "previous_response_id": surrogate}, responses)
        add("lone surrogate embeddings", {"input": [surrogate, "a"]}, embeddings)
        add("lone surrogate completion", {"n_predict": 1, "prompt": [1, surrogate]}, completion)
        add("lone surrogate apply-template", {"messages": [{"role": "user", "content": surrogate}]}, "/apply-template")
        for value in ("NaN", "Infinity", "1e999"):
            add(f"{value} messages temperature", {"max_tokens": 1, "messages": user, "temperature": Raw(value)},
                messages)
            add(f"{value} responses top_p", {"max_output_tokens": 1, "input": "hi", "top_p": Raw(value)}, responses)
            add(f"{value} completion n_predict", {"prompt": "x", "n_predict": Raw(value)}, completion)
            add(f"{value} embeddings dimensions", {"input": "x", "dimensions": Raw(value)}, embeddings)
        for value in (0, -1, 1.5, "8"):
            add(f"messages max_tokens {value}", {"max_tokens": value, "messages": user}, messages)
            add(f"responses max_output_tokens {value}", {"max_output_tokens": value, "input": "hi"}, responses)
        for value in (2**31, 2**63 - 1, 2**63, 10**30):   # accepted and clamped: read two events, then disconnect
            add(f"huge max_tokens stream messages {value}", {"max_tokens": value, "messages": user, "stream": True},
                messages)
            add(f"huge max_tokens stream responses {value}", {"max_output_tokens": value, "input": "hi",
                                                              "stream": True}, responses)
            add(f"huge max_tokens stream llama n_predict {value}", {"n_predict": value, "prompt": "x", "stream": True},
                completion)
        add("huge max_tokens stream llama n_predict -1", {"n_predict": -1, "prompt": "x", "stream": True}, completion)
        add("messages top_k 2**63", {"max_tokens": 1, "messages": user, "top_k": 2**63}, messages)
        add("messages empty", {"max_tokens": 1, "messages": []}, messages)
        add("messages stop 17", {"max_tokens": 1, "messages": user, "stop_sequences": ["a"] * 17}, messages)
        add("messages stop empty", {"max_tokens": 1, "messages": user, "stop_sequences": [""]}, messages)
        add("messages user tool_use", {"max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, messages)
        add("messages thinking with forced tool", {"max_tokens": 1, "messages": user, "thinking": {"type": "enabled"},
                                                   "tool_choice": {"type": "any"}, "tools": [
            {"name": "f", "input_schema": {"type": "object"}}]}, messages)
        add("messages tool_choice tool without name", {"max_tokens": 1, "messages": user,
                                                       "tool_choice": {"type": "tool"}}, messages)
        add("messages server tool", {"max_tokens": 1, "messages": user, "tools": [
            {"type": "web_search_20250305", "name": "web_search"}]}, messages)
        add("messages tool_result unknown id", {"max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "nope", "content": "x", "is_error": True}]}]}, messages)
        add("count_tokens no messages", {}, count)
        add("count_tokens model unknown", {"messages": user, "model": "nope"}, count)
        weather = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {
            "city": {"type": "string"}}, "required": ["city"]}}]
        for stream in (False, True):
            add(f"complex messages forced tool stream={stream}", {
                "max_tokens": 8, "messages": user, "tools": weather, "tool_choice": {"type": "any"}, "stream": stream,
                "system": [{"type": "text", "text": "be brief"}]}, messages)
            add(f"complex messages conversation stream={stream}", {"max_tokens": 3, "stream": stream, "messages": [
                {"role": "user", "content": "q"}, {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": ""},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "P"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}],
                "tools": weather, "thinking": {"type": "enabled", "budget_tokens": 1024}}, messages)
            add(f"complex responses tools stream={stream}", {
                "max_output_tokens": 8, "stream": stream, "tool_choice": "required", "input": [
                    {"role": "user", "content": "q"},
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": "r"}],
                "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}, responses)
            add(f"complex responses json_schema stream={stream}", {
                "max_output_tokens": 8, "stream": stream, "input": "list", "text": {"format": {
                    "type": "json_schema", "name": "l", "schema": {"type": "object", "properties": {
                        "a": {"type": "array", "items": {"type": "integer"}}}, "required": ["a"]}}}}, responses)
            add(f"complex llama n_probs stream={stream}", {"prompt": [12, "text", 34], "n_predict": 4, "n_probs": 3,
                                                           "stream": stream, "return_tokens": True,
                                                           "logit_bias": [["hello", False]]}, completion)
        add("responses previous id unknown", {"max_output_tokens": 1, "input": "hi",
                                              "previous_response_id": "resp_nope"}, responses)
        add("responses previous id stored", {"max_output_tokens": 1, "input": "and?",
                                             "previous_response_id": RESPONSE_ID}, responses)
        add("responses json_schema without schema", {"max_output_tokens": 1, "input": "hi", "text": {
            "format": {"type": "json_schema"}}}, responses)
        add("responses bad regex", {"max_output_tokens": 2, "input": "hi", "text": {"format": {
            "type": "json_schema", "name": "x", "schema": {"type": "string", "pattern": "("}}}}, responses)
        add("responses tool_choice missing tool", {"max_output_tokens": 1, "input": "hi", "tool_choice": {
            "type": "function", "name": "g"}, "tools": [{"type": "function", "name": "f"}]}, responses)
        add("responses metadata 17", {"max_output_tokens": 1, "input": "hi",
                                      "metadata": {str(i): "v" for i in range(17)}}, responses)
        add("responses function_call_output alone", {"max_output_tokens": 1, "input": [
            {"type": "function_call_output", "call_id": "nope", "output": "x"}]}, responses)
        add("responses empty input", {"max_output_tokens": 1, "input": []}, responses)
        for value in self.embedding_inputs():
            add(f"embeddings input {json.dumps(encode_json(value)[:30].decode('utf-8', 'replace'))}",
                {"input": value}, embeddings)
        for value in (0, 1, 2**63, "576"):
            add(f"embeddings dimensions {value}", {"input": "x", "dimensions": value}, embeddings)
        add("embeddings base64", {"input": ["a", "b"], "encoding_format": "base64"}, embeddings)
        add("embeddings encoding_format binary", {"input": "a", "encoding_format": "binary"}, embeddings)
        for prompt in ([], [[]], "", [""], [12, "text", 34], [[1, [2]]], [-1], [10**9], [2**63], [True], [None]):
            add(f"llama prompt {json.dumps(prompt)[:30]}", {"prompt": prompt, "n_predict": 1}, completion)
        for bias in ([[1, False]], [[1]], [[1, 2, 3]], {"hello": 101}, [[10**9, 1]], [["", 5]], [[1, Raw("NaN")]]):
            add(f"llama logit_bias {json.dumps(encode_json(bias)[:30].decode())}",
                {"prompt": "x", "n_predict": 1, "logit_bias": bias}, "/completions")
        add("llama n_probs 21", {"prompt": "x", "n_predict": 1, "n_probs": 21}, completion)
        add("llama grammar bad", {"prompt": "x", "n_predict": 1, "grammar": "root ::= ("}, completion)
        add("llama grammar and json_schema", {"prompt": "x", "n_predict": 1, "grammar": 'root ::= "a"',
                                              "json_schema": {"type": "object"}}, completion)
        add("llama response_fields odd", {"prompt": "x", "n_predict": 1,
                                          "response_fields": ["a/b/c", "", "/" * 100, "content"]}, completion)
        for slot in (-1, t.n_slots, 99, 2**63):
            add(f"slot_hint {slot} llama", {"prompt": "x", "n_predict": 1, "id_slot": slot}, completion)
        add("llama n 2", {"prompt": "x", "n_predict": 1, "n": 2}, completion)
        for path in ("/apply-template", "/v1/chat/completions/input_tokens"):
            add(f"template kwargs reserved {path}", {"messages": user, "chat_template_kwargs": {"messages": []}}, path)
            add(f"template no messages {path}", {"messages": []}, path)
            add(f"template deep {path}", {"messages": [{"role": "user", "content": nested(100_000, "dict")}]}, path)
            add(f"template raise_exception {path}", {"messages": [{"role": "user", "content": "x"}] * 2 + [
                {"role": "system", "content": "late"}]}, path)
        add("props change", {"n_predict": 5}, "/props")
        self.hostile_ollama(add)
        for endpoint in (messages, count, responses, embeddings, completion, "/apply-template", "/api/chat",
                         "/api/generate", "/api/embed", "/api/show", "/api/pull"):
            add(f"nan body {endpoint}", b'{"x": NaN}', endpoint)
            add(f"bytes invalid utf-8 {endpoint}", b'{"input": "\xff", "prompt": "\xed\xa0\x80"}', endpoint)
            add(f"bytes empty {endpoint}", b"", endpoint)

    def hostile_ollama(self, add: Callable[..., None]) -> None:
        """Fixed cases for Ollama's routes (pull and delete name the served model or unknown ones only)."""
        t = self.target
        model = t.model_id
        chat, generate, embed = "/api/chat", "/api/generate", "/api/embed"
        user = [{"role": "user", "content": "hi"}]
        short = {"num_predict": 1}
        surrogate = Raw('"\\ud800"')
        for path, body in ((chat, {"messages": user, "options": short}), (generate, {"prompt": "hi", "options": short}),
                           (embed, {"input": "hi"}), ("/api/embeddings", {"prompt": "hi"}), ("/api/show", {}),
                           ("/api/pull", {"stream": False})):
            add(f"ollama unknown model {path}", {**body, "model": "nope"}, path)
            add(f"ollama no model {path}", body, path)
            add(f"ollama model surrogate {path}", {**body, "model": surrogate}, path)
        for depth in (1000, 100_000):
            add(f"deep{depth} ollama chat", {"model": model, "messages": [{"role": "user", "content": nested(depth)}]},
                chat)
            add(f"deep{depth} ollama generate", {"model": model, "prompt": nested(depth, "dict")}, generate)
            add(f"deep{depth} ollama embed", {"model": model, "input": nested(depth)}, embed)
            add(f"deep{depth} ollama format", {"model": model, "messages": user, "options": short,
                                               "format": {"properties": {"a": nested(depth, "dict")}}}, chat)
        add("lone surrogate ollama chat", {"model": model, "messages": [{"role": "user", "content": surrogate}],
                                           "options": short}, chat)
        add("lone surrogate ollama generate", {"model": model, "prompt": surrogate, "options": short}, generate)
        add("lone surrogate ollama keep_alive", {"model": model, "prompt": "hi", "keep_alive": surrogate}, generate)
        for value in KEEP_ALIVES:
            if value not in ("0", "0s"):
                add(f"ollama keep_alive {encode_json(value)[:20]!r}", {"model": model, "messages": user,
                                                                        "options": short, "keep_alive": value}, chat)
        for value in ("NaN", "Infinity", "1e999"):
            add(f"{value} ollama temperature", {"model": model, "messages": user,
                                                "options": {"num_predict": 1, "temperature": Raw(value)}}, chat)
            add(f"{value} ollama num_predict", {"model": model, "prompt": "hi", "options": {"num_predict": Raw(value)}},
                generate)
        for options in OLLAMA_OPTIONS:
            # A num_predict of its own (0 and -2: the server's default budget) streams and is dropped early.
            unbounded = isinstance(options, dict) and "num_predict" in options
            full = {**options, "num_predict": 2} if isinstance(options, dict) and not unbounded else options
            tag = ("huge max_tokens stream " if unbounded else "") + f"ollama options {encode_json(options)[:30]!r}"
            add(tag, {"model": model, "messages": user, "stream": unbounded, "options": full}, chat)
        add("ollama num_ctx beyond the model", {"model": model, "messages": user,
                                                "options": {"num_predict": 1, "num_ctx": t.n_ctx + 1}}, chat)
        for fmt in OLLAMA_FORMATS:
            add(f"ollama format {encode_json(fmt)[:30]!r}", {"model": model, "messages": user, "format": fmt,
                                                            "options": {"num_predict": 4}, "stream": False}, chat)
        for think in (True, "high", "max", 1):
            add(f"ollama think {think!r}", {"model": model, "messages": user, "think": think, "options": short}, chat)
        add("ollama images chat", {"model": model, "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]},
            chat)
        add("ollama images generate", {"model": model, "prompt": "hi", "images": ["aGk="]}, generate)
        add("ollama suffix", {"model": model, "prompt": "def f(", "suffix": "return 1"}, generate)
        add("ollama template", {"model": model, "prompt": "hi", "template": "{{ .Prompt }}"}, generate)
        for context in ([-1], [10**9], [2**63], ["a"], [t.filler_token] * (t.n_ctx + 1), [t.filler_token] * 3):
            add(f"ollama context {encode_json(context)[:24]!r}", {"model": model, "prompt": "hi", "context": context,
                                                                 "options": short, "stream": False}, generate)
        add("ollama prompt beyond the context", {"model": model, "prompt": " a" * (t.n_ctx + 10), "options": short},
            generate)
        add("ollama messages beyond the context", {"model": model, "messages": [{"role": "user",
                                                                                 "content": " a" * (t.n_ctx + 10)}]},
            chat)
        add("ollama tool call arguments as text", {"model": model, "options": short, "messages": [
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]}, chat)
        add("ollama role unknown", {"model": model, "messages": [{"role": "robot", "content": "hi"}]}, chat)
        weather = [{"type": "function", "function": {"name": "weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
        for stream in (False, True):
            add(f"complex ollama tool conversation stream={stream}", {
                "model": model, "stream": stream, "tools": weather, "options": {"num_predict": 8}, "messages": [
                    {"role": "system", "content": "be brief"}, {"role": "user", "content": "Weather in Rome?"},
                    {"role": "assistant", "content": "", "thinking": "hm", "tool_calls": [
                        {"function": {"name": "weather", "arguments": {"city": "Rome"}}}]},
                    {"role": "tool", "content": "sunny", "tool_name": "weather"}, {"role": "user", "content": "And?"}]},
                chat)
            add(f"complex ollama generate raw context stream={stream}", {
                "model": model, "prompt": "The capital of France is", "raw": True, "context": [t.filler_token] * 3,
                "stream": stream, "logprobs": True, "top_logprobs": 3, "options": {"num_predict": 4, "seed": 7}},
                generate)
            add(f"complex ollama json schema stream={stream}", {
                "model": model, "stream": stream, "messages": user, "options": {"num_predict": 8}, "format": {
                    "type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}},
                    "required": ["a"]}}, chat)
        add("ollama load chat", {"model": model}, chat)
        add("ollama load generate", {"model": model, "keep_alive": "5m"}, generate)
        add("ollama unload", {"model": model, "keep_alive": 0}, generate)
        add("ollama load after unload", {"model": model, "messages": []}, chat)
        for value in ([""], "", [], ["a"] * 3, " a" * (t.n_ctx + 10), [5], {"a": 1}):
            add(f"ollama embed input {encode_json(value)[:20]!r}", {"model": model, "input": value}, embed)
        add("ollama embed beyond the context untruncated", {"model": model, "input": " a" * (t.n_ctx + 10),
                                                            "truncate": False}, embed)
        add("ollama embed dimensions", {"model": model, "input": "a", "dimensions": 3}, embed)
        add("ollama embeddings empty", {"model": model, "prompt": ""}, "/api/embeddings")
        add("ollama show", {"model": model}, "/api/show")
        add("ollama show older name", {"name": model + ":latest"}, "/api/show")
        add("ollama pull installed", {"model": model, "stream": False}, "/api/pull")
        add("ollama pull installed stream", {"model": model}, "/api/pull")
        add("ollama delete unknown", {"model": "nope"}, "/api/delete", "DELETE")
        add("ollama delete nothing", {}, "/api/delete", "DELETE")
        for path in ("/api/create", "/api/copy", "/api/push", "/api/blobs/sha256:00"):
            add(f"ollama unsupported {path}", {"model": "x"}, path)

    def hostile_http(self) -> list[Probe]:
        """Cases about HTTP itself: methods, routes, headers, sizes, and raw bytes httpx will not send."""
        t = self.target
        over = t.body_limit + 1
        big = b'{"prompt": "' + b"a" * over + b'"}'
        user = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
        json_type = {"Content-Type": "application/json"}
        probes = [
            Probe(0, "POST /v1/completions", "POST", "/v1/completions", body=big, headers=json_type,
                  tag="hostile over limit"),
            Probe(0, "POST /v1/completions", "POST", "/v1/completions", body=big, headers=json_type, chunked=True,
                  tag="hostile over limit chunked"),
            Probe(0, "POST /v1/files", "POST", "/v1/files", body=multipart("b", [("file", "big", None, b"x" * over)]),
                  headers={"Content-Type": "multipart/form-data; boundary=b"}, tag="hostile upload over limit"),
            Probe(0, "POST /v1/batches", "POST", "/v1/batches", body=b"{}", headers=json_type,
                  tag="hostile unknown route"),
            Probe(0, "POST /v1/messages", "POST", "/v1/messages", body=b'{"max_tokens": 1, "messages": [{"role": '
                  b'"user", "content": "' + b"a" * over + b'"}]}', headers=json_type,
                  tag="hostile over limit anthropic"),
            Probe(0, "POST /v1/embeddings", "POST", "/v1/embeddings", body=b'{"input": "' + b"a" * over + b'"}',
                  headers=json_type, tag="hostile over limit embeddings"),
            *[Probe(0, f"POST {path}", "POST", path, body=big, headers=json_type, chunked=chunked,
                    tag="hostile over limit" + (" chunked" if chunked else ""))
              for path in ("/completion", "/v1/responses", "/apply-template", "/v1/messages/count_tokens",
                           "/v1/chat/completions/input_tokens", "/props", "/api/chat", "/api/generate", "/api/embed",
                           "/api/show") for chunked in (False, True)],
            Probe(0, "POST /completion", "POST", "/completion?q=" + "x" * 8000, headers=json_type,
                  body=b'{"prompt": "hi", "n_predict": 1}', tag="hostile long query"),
            Probe(0, "GET /props", "GET", "/props?model=" + "m" * 8000, tag="hostile long query"),
            Probe(0, "POST /apply-template", "POST", "/apply-template?messages=%5B%5D&model=%00",
                  body=b'{"messages": [{"role": "user", "content": "hi"}]}', headers=json_type,
                  tag="hostile query"),
            Probe(0, "POST /v1/messages", "POST", "/v1/messages?beta=true&model=%ff",
                  body=b'{"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}', headers=json_type,
                  tag="hostile query"),
            Probe(0, "GET /v1/messages", "GET", "/v1/messages", tag="hostile wrong method"),
            Probe(0, "PUT /v1/responses/{id}", "PUT", "/v1/responses/" + RESPONSE_ID, body=b"{}", headers=json_type,
                  tag="hostile wrong method"),
            Probe(0, "GET /completion", "GET", "/completion", tag="hostile wrong method"),
            Probe(0, "GET /api/chat", "GET", "/api/chat", tag="hostile wrong method"),
            Probe(0, "POST /api/tags", "POST", "/api/tags", body=b"{}", headers=json_type, tag="hostile wrong method"),
            Probe(0, "POST /", "POST", "/", body=b"{}", headers=json_type, tag="hostile wrong method"),
            Probe(0, "HEAD /", "HEAD", "/", tag="hostile head"),
            Probe(0, "POST /api/chat", "POST", "/api/chat", headers={"Content-Type": "text/plain"},
                  body=b'{"model": "x", "messages": []}', tag="hostile text/plain"),
            Probe(0, "POST /v1/messages", "POST", "/v1/messages", headers={"Content-Type": "text/plain"},
                  body=b'{"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}', tag="hostile text/plain"),
            Probe(0, "POST /v1/messages/count_tokens", "POST", "/v1/messages/count_tokens",
                  body='{"messages": [{"role": "user", "content": "hi"}]}'.encode("utf-16"),
                  headers={"Content-Type": "application/json; charset=utf-16"}, tag="hostile utf-16 body"),
            Probe(0, "POST /v1/responses", "POST", "/v1/responses", body=b"input=hi&max_output_tokens=1",
                  headers={"Content-Type": "application/x-www-form-urlencoded"}, tag="hostile form type"),
            Probe(0, "POST /v1/embeddings", "POST", "/v1/embeddings", body=b'{"input": "hi"}',
                  headers={"Content-Type": "multipart/form-data; boundary=x"}, tag="hostile multipart type"),
            Probe(0, "POST /completion", "POST", "/completion", body=b'{"prompt": "hi", "n_predict": 1}',
                  headers={"Content-Type": "application/xml"}, tag="hostile xml type"),
            Probe(0, "GET /v1/responses/{id}", "GET", "/v1/responses/" + RESPONSE_ID, tag="hostile stored response"),
            Probe(0, "DELETE /v1/responses/{id}", "DELETE", "/v1/responses/" + RESPONSE_ID,
                  tag="hostile stored response"),
            Probe(0, "GET /v1/responses/{id}", "GET", "/v1/responses/..%2f..%2fetc%2fpasswd", tag="hostile traversal"),
            Probe(0, "GET /v1/responses/{id}", "GET", "/v1/responses/%00", tag="hostile nul id"),
            Probe(0, "GET /v1/responses/{id}", "GET", "/v1/responses/%ed%a0%80", tag="hostile surrogate id"),
            Probe(0, "DELETE /v1/responses/{id}", "DELETE", "/v1/responses/" + "r" * 5000, tag="hostile long id"),
            Probe(0, "GET /props", "GET", "/props?model=%ff", tag="hostile bad utf-8 model"),
            Probe(0, "GET /v1/chat/completions", "GET", "/v1/chat/completions", tag="hostile wrong method"),
            Probe(0, "DELETE /v1/models", "DELETE", "/v1/models", tag="hostile wrong method"),
            Probe(0, "OPTIONS /v1/chat/completions", "OPTIONS", "/v1/chat/completions", tag="hostile options"),
            Probe(0, "HEAD /v1/models", "HEAD", "/v1/models", tag="hostile head"),
            Probe(0, "PUT /health", "PUT", "/health", body=b"x", tag="hostile wrong method"),
            Probe(0, "POST /v1/chat/completions", "POST", "/v1/chat/completions", body=user,
                  headers={"Content-Type": "text/plain"}, tag="hostile text/plain"),
            Probe(0, "POST /v1/tokenize", "POST", "/v1/tokenize", body=b'{"content": "hi"}',
                  headers={"Content-Type": "application/x-www-form-urlencoded"}, tag="hostile form type"),
            Probe(0, "POST /v1/tokenize", "POST", "/v1/tokenize", body=b'{"content": "hi"}',
                  headers={"Content-Type": "multipart/form-data; boundary=x"}, tag="hostile multipart type"),
            Probe(0, "POST /v1/tokenize", "POST", "/v1/tokenize", body='{"content": "hi"}'.encode("utf-16"),
                  headers={"Content-Type": "application/json; charset=utf-16"}, tag="hostile utf-16 body"),
            Probe(0, "POST /v1/files", "POST", "/v1/files", body=b'{"file": "x", "purpose": "batch"}',
                  headers=json_type, tag="hostile files json"),
            Probe(0, "GET /v1/files/{id}", "GET", "/v1/files/..%2f..%2f..%2fetc%2fpasswd", tag="hostile traversal"),
            Probe(0, "GET /v1/files/{id}/content", "GET", "/v1/files/%2e%2e/content", tag="hostile traversal"),
            Probe(0, "GET /v1/files/{id}/content", "GET", "/v1/files/file-%00/content", tag="hostile nul id"),
            Probe(0, "DELETE /v1/files/{id}", "DELETE", "/v1/files/..%2fmeta", tag="hostile traversal"),
            Probe(0, "GET /v1/models/{id}", "GET", "/v1/models/%00", tag="hostile nul model"),
            Probe(0, "GET /v1/models/{id}", "GET", "/v1/models/%ed%a0%80", tag="hostile surrogate model"),
            Probe(0, "GET /v1/models/{id}", "GET", "/v1/models/%ff", tag="hostile bad utf-8 model"),
        ]
        for name, value in AUTH_HEADERS:   # auth is checked before the route: a cheap route will do
            probes.append(Probe(0, "POST /v1/tokenize", "POST", "/v1/tokenize", body=b'{"content": "hi"}',
                                headers={**json_type, name: value}, tag=f"hostile auth {name}"))
            probes.append(Probe(0, "GET /slots", "GET", "/slots", headers={name: value},
                                tag=f"hostile auth slots {name}"))
        host = f"{t.host_port[0]}:{t.host_port[1]}".encode()

        def raw(tag: str, data: bytes, protocol: bool, endpoint: str = "raw", expect: int = 1) -> None:
            probes.append(Probe(0, endpoint, "RAW", data.split(b"\r\n", 1)[0].decode("latin-1")[:200], raw=data,
                                tag=f"raw {tag}", protocol=protocol, expect=expect))

        def request(line: bytes, headers: bytes = b"", body: bytes = b"") -> bytes:
            length = f"Content-Length: {len(body)}\r\n".encode() if body else b""
            return line + b"\r\nHost: " + host + b"\r\n" + headers + length + b"Connection: close\r\n\r\n" + body

        raw("nul in path", request(b"GET /v1/models/a\x00b HTTP/1.1"), True)
        raw("escape in path", request(b"GET /v1/files/a\x1bb HTTP/1.1"), True)
        raw("dot segments", request(b"GET /v1/files/../../../../etc/passwd HTTP/1.1"), False, "GET /v1/files/{id}")
        raw("dot segments content", request(b"GET /v1/files/../content HTTP/1.1"), False, "GET /v1/files/{id}/content")
        raw("raw utf-8 path", request(b"GET /v1/models/\xff\xfe HTTP/1.1"), True)
        raw("nul in header", request(b"GET /health HTTP/1.1", b"X-Bad: a\x00b\r\n"), True)
        raw("escape in header", request(b"POST /v1/tokenize HTTP/1.1", b"Authorization: Bearer \x1b[0m\r\n",
                                        b'{"content": "x"}'), True)
        raw("cr in header", request(b"GET /slots HTTP/1.1", b"X-Api-Key: a\rb\r\n"), True)
        raw("garbage line", b"GARBAGE\r\n\r\n", True)
        raw("http/0.9", b"GET /health\r\n\r\n", True)
        raw("no host http/1.0", b"GET /v1/models HTTP/1.0\r\n\r\n", False, "GET /v1/models")
        raw("absolute form", request(b"GET http://evil.example/health HTTP/1.1"), False, "GET /health")
        raw("options star", request(b"OPTIONS * HTTP/1.1"), True)
        raw("negative content-length", request(b"POST /v1/tokenize HTTP/1.1", b"Content-Length: -1\r\n"), True)
        raw("text content-length", request(b"POST /v1/tokenize HTTP/1.1", b"Content-Length: abc\r\n"), True)
        raw("two content-lengths", request(b"POST /v1/tokenize HTTP/1.1", b"Content-Length: 2\r\nContent-Length: 16\r\n"
                                           b"\r\n{}"), True)
        raw("cl and te", line_with_body(host, b"POST /v1/tokenize HTTP/1.1",
                                        b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n",
                                        b"2\r\n{}\r\n0\r\n\r\n"), True)
        raw("bad chunk size", line_with_body(host, b"POST /v1/tokenize HTTP/1.1", b"Transfer-Encoding: chunked\r\n",
                                             b"zz\r\n{}\r\n0\r\n\r\n"), True)
        raw("huge header", request(b"GET /health HTTP/1.1", b"X-Big: " + b"a" * 70000 + b"\r\n"), True)
        raw("many headers", request(b"GET /health HTTP/1.1", b"".join(b"X-H%d: v\r\n" % i for i in range(2000))), True)
        raw("long path", request(b"GET /v1/models/" + b"a" * 70000 + b" HTTP/1.1"), True)
        raw("unknown method", request(b"BREW /health HTTP/1.1"), False, "BREW /health")
        then_health = b"GET /health HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n"
        raw("pipelined 404 then health", b"POST /v1/batches HTTP/1.1\r\nHost: " + host +
            b"\r\nContent-Length: 2\r\n\r\n{}" + then_health, False, "POST /v1/batches", 2)
        raw("pipelined anthropic 400 then health", b"POST /v1/messages HTTP/1.1\r\nHost: " + host +
            b"\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}" + then_health, False,
            "POST /v1/messages", 2)
        raw("pipelined 405 then health", b"GET /v1/chat/completions HTTP/1.1\r\nHost: " + host + b"\r\n\r\n" +
            then_health, False, "GET /v1/chat/completions", 2)
        raw("extra body bytes then health", b"POST /v1/tokenize HTTP/1.1\r\nHost: " + host +
            b'\r\nContent-Length: 16\r\n\r\n{"content": "x"}' + then_health, False, "POST /v1/tokenize", 2)
        return probes


def line_with_body(host: bytes, line: bytes, headers: bytes, body: bytes) -> bytes:
    return line + b"\r\nHost: " + host + b"\r\n" + headers + b"Connection: close\r\n\r\n" + body


def multipart(boundary: str, parts: list[tuple[str, str | None, str | None, bytes]]) -> bytes:
    """A multipart/form-data body; a filename of None leaves the filename out."""
    out = b""
    for name, filename, content_type, data in parts:
        disposition = f'form-data; name="{name}"'
        if filename is not None:
            disposition += f'; filename="{filename}"'
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n".encode("utf-8", errors="surrogatepass")
        if content_type:
            out += f"Content-Type: {content_type}\r\n".encode()
        out += b"\r\n" + data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


ROUTES = [(re.compile(r"^/slots/[^/?]*/(save|restore|erase)$"), "/slots/{id}/\\1"),
          (re.compile(r"^/slots/[^/?]*$"), "/slots/{id}"),
          (re.compile(r"^/v1/files/[^/]+/content$"), "/v1/files/{id}/content"),
          (re.compile(r"^/v1/files/[^/]+$"), "/v1/files/{id}"), (re.compile(r"^/v1/models/.+$"), "/v1/models/{id}"),
          (re.compile(r"^/v1/responses/[^/]+$"), "/v1/responses/{id}")]


def route_of(method: str, path: str) -> str:
    plain, _, query = path.partition("?")
    for pattern, replacement in ROUTES:
        if pattern.match(plain):
            route = pattern.sub(replacement, plain)
            if route == "/slots/{id}" and query.startswith("action"):
                route += "?action"
            return f"{method} {route}"
    return f"{method} {plain}"


# --- sending ------------------------------------------------------------------------------------

@dataclass(slots=True)
class RunState:
    """What a run collects while it goes."""

    started: float = field(default_factory=time.monotonic)
    statuses: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    problems: list[Problem] = field(default_factory=list)
    file_ids: list[str] = field(default_factory=list)
    response_ids: list[str] = field(default_factory=list)
    health: HealthLog = field(default_factory=lambda: HealthLog(HEALTH_LIMIT_S))
    sent: int = 0
    reported: int = 0
    client_refused: int = 0
    log: list[dict] = field(default_factory=list)   # one line per request, for --log

    def problem(self, kind: str, probe: Probe, status: int | None, detail: str) -> None:
        self.problems.append(Problem(kind, probe, status, detail[:500]))


async def send_http(client: httpx.AsyncClient, probe: Probe, path: str, body: bytes | None) -> Outcome:
    start = time.monotonic()
    content: Any = body
    if probe.chunked and body is not None:
        async def pieces() -> Any:
            for i in range(0, len(body), 65536):
                yield body[i:i + 65536]
        content = pieces()
    request = client.build_request(probe.method, path, content=content, headers=probe.headers)
    response = await client.send(request, stream=True)
    data = bytearray()
    # An SSE event ends with a blank line, an NDJSON object with its line.
    separator = b"\n" if response.headers.get("content-type", "").startswith("application/x-ndjson") else b"\n\n"
    try:
        async for chunk in response.aiter_raw():
            if len(data) < READ_CAP:
                data += chunk
            if probe.disconnect_after is not None and data.count(separator) >= probe.disconnect_after:
                break
    finally:
        await response.aclose()
    return Outcome(response.status_code, {k.lower(): v for k, v in response.headers.items()}, bytes(data),
                   time.monotonic() - start, statuses=[response.status_code])


def parse_responses(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The complete HTTP/1.x responses at the start of `data`."""
    out = []
    while True:
        head_end = data.find(b"\r\n\r\n")
        if head_end < 0:
            return out
        lines = data[:head_end].split(b"\r\n")
        match = re.match(rb"HTTP/1\.[01] (\d{3})", lines[0])
        if not match:
            return out
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.decode("latin-1").strip().lower()] = value.decode("latin-1").strip()
        rest = data[head_end + 4:]
        status = int(match.group(1))
        if "content-length" in headers and headers["content-length"].isdigit():
            size = int(headers["content-length"])
            if len(rest) < size:
                return out
            body, data = rest[:size], rest[size:]
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            end = rest.find(b"\r\n0\r\n\r\n")
            if not rest.startswith(b"0\r\n\r\n") and end < 0:
                return out
            cut = 5 if rest.startswith(b"0\r\n\r\n") else end + 7
            body, data = rest[:cut], rest[cut:]
        elif status in (204, 304) or status < 200:
            body, data = b"", rest
        else:
            return out   # the body runs until the server closes
        out.append((status, headers, body))


async def send_raw(target: Target, probe: Probe, timeout: float) -> Outcome:
    """Send raw bytes on a fresh connection; read until `probe.expect` responses came or the server closes.

    hypercorn keeps a connection open after answering "Connection: close" (pgjones/hypercorn#330), so
    reading to the close would wait for its keep-alive timeout.
    """
    start = time.monotonic()
    host, port = target.host_port
    data = bytearray()
    closed = False
    with trio.move_on_after(timeout) as scope:
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            try:
                await stream.send_all(probe.raw or b"")
                while len(parse_responses(bytes(data))) < probe.expect:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        closed = True
                        break
                    data += chunk
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                closed = True   # a reset after the answer (or instead of one) shows in what was read
    responses = parse_responses(bytes(data))
    if closed and not responses and data:
        head, _, body = bytes(data).partition(b"\r\n\r\n")   # a response whose body ran to the close
        match = re.match(rb"HTTP/1\.[01] (\d{3})", head)
        if match:
            responses = [(int(match.group(1)), {}, body)]
    statuses = [status for status, _, _ in responses]
    error = "timeout" if scope.cancelled_caught else None
    said_close = bool(responses) and responses[-1][1].get("connection", "").lower() == "close"
    if error is None and len(responses) < probe.expect and not said_close:
        # A server may close after a response that says "Connection: close"; the client retries the rest.
        error = f"connection closed after {len(responses)} of {probe.expect} responses"
    status, headers, body = responses[0] if responses else (None, {}, b"")
    return Outcome(status, headers, body[:READ_CAP], time.monotonic() - start, error=error, statuses=statuses)


def resolve_placeholders(probe: Probe, state: RunState) -> tuple[str, bytes | None]:
    """The path and body with the FILE_ID (RESPONSE_ID) placeholder replaced by a file uploaded (a response
    stored) in this run."""
    path, body = probe.path, probe.body
    for placeholder, seen, missing in ((FILE_ID, state.file_ids, "file-" + "0" * 24),
                                       (RESPONSE_ID, state.response_ids, "resp_" + "0" * 24)):
        real = seen[probe.index % len(seen)] if seen else missing
        path = path.replace(placeholder, real)
        body = body.replace(placeholder.encode(), real.encode()) if body is not None else None
    return path, body


# --- checks -------------------------------------------------------------------------------------

def reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def strict_json(data: bytes) -> Any:
    """Parse as a strict client would: no NaN/Infinity, no lone surrogates."""
    value = json.loads(data.decode("utf-8"), parse_constant=reject_constant)
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            node.encode("utf-8")
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return value


def envelope_problem(body: bytes, headers: dict[str, str], api: str = "openai") -> str | None:
    """Why an error body is not the envelope of `api` ("openai", "anthropic" or "ollama"), or None."""
    if not headers.get("content-type", "").startswith("application/json"):
        return f"content-type {headers.get('content-type')!r}, body {body[:200]!r}"
    try:
        value = strict_json(body)
    except (ValueError, UnicodeError) as exc:
        return f"not strict JSON ({exc}): {body[:200]!r}"
    if api == "anthropic":
        return anthropic_envelope_problem(value, body)
    if api == "ollama":
        if not isinstance(value, dict) or set(value) != {"error"} or not isinstance(value["error"], str):
            return f"not Ollama's error object {{\"error\": message}}: {body[:200]!r}"
        return None
    error = value.get("error") if isinstance(value, dict) else None
    if not isinstance(error, dict):
        return f"no error object: {body[:200]!r}"
    if not isinstance(error.get("message"), str) or not isinstance(error.get("type"), str):
        return f"message/type not strings: {body[:200]!r}"
    if "param" not in error or "code" not in error:
        return f"param/code missing: {body[:200]!r}"
    return None


def error_apis(probe: Probe) -> tuple[str, ...]:
    """The error envelopes a probe's answer may have: Anthropic's on its Messages routes (any method), either below
    them on a path no API defines, Ollama's under /api/ (any method, any path), OpenAI's everywhere else (the
    llama.cpp routes included, as the server documents)."""
    route = probe.path if probe.endpoint == "unknown route" else probe.endpoint.partition(" ")[2]
    route = route.partition("?")[0]
    if route == OLLAMA_PREFIX.rstrip("/") or route.startswith(OLLAMA_PREFIX):
        return ("ollama",)
    if route in ANTHROPIC_ROUTES:
        return ("anthropic",)
    return ("openai", "anthropic") if route.startswith(ANTHROPIC_PREFIX) else ("openai",)


def anthropic_envelope_problem(value: Any, body: bytes) -> str | None:
    """Why a parsed error body is not exactly Anthropic's {"type": "error", "error": {"type", "message"}}, or None."""
    if not isinstance(value, dict) or value.get("type") != "error" or set(value) - {"type", "error", "request_id"}:
        return f"not Anthropic's error envelope: {body[:200]!r}"
    error = value.get("error")
    if not isinstance(error, dict) or set(error) != {"type", "message"} or not isinstance(error["message"], str):
        return f"Anthropic error object is not {{type, message}}: {body[:200]!r}"
    if error["type"] not in ANTHROPIC_ERROR_TYPES:
        return f"not an Anthropic error type: {error['type']!r}"
    return None


def error_code(body: bytes) -> str:
    try:
        error = json.loads(body).get("error") or {}
        return f"{error.get('type')}/{error.get('code')}"
    except (ValueError, AttributeError):
        return "?"


def check_stream(state: RunState, probe: Probe, status: int, kind: str, items: list[str]) -> None:
    """Each event of a stream (an SSE event's data, an NDJSON line) must be strict JSON and no server fault."""
    for item in items:
        try:
            value = strict_json(item.encode())
        except (ValueError, UnicodeError) as exc:
            state.problem("bad_json", probe, status, f"{kind} not strict JSON ({exc}): {item[:200]}")
            continue
        if server_fault_event(value):
            state.problem("stream_error", probe, status, item[:300])


def check(probe: Probe, outcome: Outcome, state: RunState, timeout: float = math.inf) -> None:
    """Record what is wrong with one response."""
    status = outcome.status
    if outcome.error == "timeout":
        state.problem("hang", probe, status, f"no complete answer in {outcome.elapsed:.1f} s")
        return
    if outcome.elapsed > timeout:
        state.problem("hang", probe, status, f"answered {status} after {outcome.elapsed:.1f} s (limit {timeout:g} s)")
    if status is None:
        if not probe.protocol:
            state.problem("no_response", probe, None, outcome.error or "connection closed without a response")
        return
    if outcome.error and not probe.protocol:
        state.problem("keepalive", probe, status, f"{outcome.error}: statuses {outcome.statuses}")
    body, headers = outcome.body, outcome.headers
    for seen in outcome.statuses or [status]:
        if seen >= 500 and not allowed_5xx(seen, body, headers, error_apis(probe)):
            state.problem("5xx", probe, seen, body[:300].decode("utf-8", errors="replace"))
    if status == 503 and "server_busy" in error_code(body) and "retry-after" not in headers:
        state.problem("retry_after", probe, status, "503 server_busy without Retry-After")
    if status >= 400 and probe.method != "HEAD" and not (probe.protocol and status < 500):
        problems = [envelope_problem(body, headers, api) for api in error_apis(probe)]
        if all(problems):
            state.problem("envelope", probe, status, problems[0])
    if status >= 400 and LEAK.search(body.decode("utf-8", errors="replace")):
        state.problem("leak", probe, status, body[:300].decode("utf-8", errors="replace"))
    if 200 <= status < 300 and probe.method not in ("HEAD", "OPTIONS") and probe.raw is None:
        content_type = headers.get("content-type", "")
        if content_type.startswith("text/event-stream"):
            events = [e for e in sse_payloads(body, complete=probe.disconnect_after is None) if e != "[DONE]"]
            check_stream(state, probe, status, "SSE event", events)
        elif content_type.startswith("application/x-ndjson"):
            lines = body.decode("utf-8", errors="replace").split("\n")
            complete = probe.disconnect_after is None
            check_stream(state, probe, status, "NDJSON line", [line for line in (lines if complete else lines[:-1])
                                                               if line])
        elif content_type.startswith("application/json"):
            try:
                strict_json(body)
            except (ValueError, UnicodeError) as exc:
                state.problem("bad_json", probe, status, f"2xx body not strict JSON ({exc}): {body[:200]!r}")


def server_fault_event(value: Any) -> bool:
    """Whether an SSE event or NDJSON line reports a server fault: OpenAI's error (type server_error, code
    internal_*), Anthropic's error event of type api_error, the Responses API's error / response.failed with code
    server_error, or Ollama's {"error": "internal server error ..."}."""
    if not isinstance(value, dict):
        return False
    error = value.get("error")
    if isinstance(error, str):
        return error.startswith("internal server error")
    if isinstance(error, dict):
        if error.get("type") in ("server_error", "api_error") or str(error.get("code", "")).startswith("internal"):
            return True
    if value.get("type") == "error" and value.get("code") == "server_error":
        return True
    response = value.get("response")
    if value.get("type") == "response.failed" and isinstance(response, dict):
        failure = response.get("error")
        return isinstance(failure, dict) and failure.get("code") == "server_error"
    return False


def allowed_5xx(status: int, body: bytes, headers: dict[str, str], apis: tuple[str, ...] = ("openai",)) -> bool:
    """503 and 507, and the documented 501 not_supported (in Ollama's envelope, which has no code: its message)."""
    if status in (503, 507):
        return True
    if status != 501:
        return False
    if "ollama" in apis:
        try:
            error = json.loads(body).get("error")
        except (ValueError, AttributeError):
            return False
        return isinstance(error, str) and "is not supported" in error
    return error_code(body).endswith("/not_supported")


def sse_payloads(body: bytes, complete: bool) -> list[str]:
    """The payloads of a stream's `data:` lines, and of llama.cpp's `error:` lines (/completion: the error object
    alone) wrapped as {"error": ...}, so that the same checks read both."""
    events = body.decode("utf-8", errors="replace").split("\n\n")
    if not complete:
        events = events[:-1]   # the last one may be cut off where we stopped reading
    lines = [line for event in events for line in event.split("\n")]
    return [line[6:] if line.startswith("data: ") else '{"error": ' + line[7:] + "}" for line in lines
            if line.startswith(("data: ", "error: "))]


# --- the run ------------------------------------------------------------------------------------

async def watch_health(target: Target, state: RunState, done: trio.Event, workers: trio.CancelScope) -> None:
    """GET /health every 0.5 s; a server silent for FREEZE_AFTER_S is frozen and the run stops."""
    await poll_health(target.url, state.health, done, request_timeout_s=5.0, freeze_after_s=FREEZE_AFTER_S)
    if state.health.frozen:
        workers.cancel()


async def run_probes(target: Target, probes: list[Probe], concurrency: int, timeout: float, state: RunState,
                     progress: Callable[[str], None] | None = None) -> None:
    send, receive = trio.open_memory_channel[Probe](len(probes) or 1)
    for probe in probes:
        send.send_nowait(probe)
    send.close()
    done = trio.Event()

    async def worker(receive: trio.MemoryReceiveChannel) -> None:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        client = httpx.AsyncClient(base_url=target.url, timeout=timeout * LATE_FACTOR, limits=limits)
        async with receive, client:
            async for probe in receive:
                await one(client, probe)

    async def one(client: httpx.AsyncClient, probe: Probe) -> None:
        path, body = resolve_placeholders(probe, state)
        start = time.monotonic()
        outcome = None
        # Past `timeout` a request is a hang; waiting LATE_FACTOR times longer tells a slow answer from none.
        hard = timeout * LATE_FACTOR
        with trio.move_on_after(hard + 1.0):
            try:
                if probe.raw is not None:
                    outcome = await send_raw(target, probe, hard)
                else:
                    with trio.fail_after(hard):
                        outcome = await send_http(client, probe, path, body)
            except (trio.TooSlowError, httpx.TimeoutException):
                outcome = None
            except (httpx.LocalProtocolError, httpx.UnsupportedProtocol, httpx.InvalidURL, UnicodeEncodeError):
                state.client_refused += 1   # httpx would not send it: nothing learned about the server
                return
            except (httpx.HTTPError, OSError) as exc:
                outcome = Outcome(None, {}, b"", time.monotonic() - start, error=f"{type(exc).__name__}: {exc}")
        if outcome is None:
            outcome = Outcome(None, {}, b"", time.monotonic() - start, error="timeout")
        state.sent += 1
        seen = str(outcome.status) if outcome.status else (outcome.error or "none").split(":")[0]
        state.statuses[probe.endpoint][seen] += 1
        state.log.append({"index": probe.index, "endpoint": probe.endpoint, "tag": probe.tag, "status": seen,
                          "elapsed_s": round(outcome.elapsed, 3),
                          "body": outcome.body[:200].decode("utf-8", "replace")})
        check(probe, outcome, state, timeout)
        ids = {"POST /v1/files": state.file_ids, "POST /v1/responses": state.response_ids}.get(probe.endpoint)
        if ids is not None and outcome.status == 200 and outcome.headers.get("content-type", "").startswith(
                "application/json"):
            try:
                ids.append(json.loads(outcome.body)["id"])
            except (ValueError, KeyError, TypeError):
                pass
        if outcome.status is not None and outcome.status >= 400 and probe.raw is None:
            await follow_up(client, probe)
        if progress and state.sent >= state.reported + 250:
            state.reported += 250
            progress(f"{state.sent}/{len(probes)} sent, {len(state.problems)} problems")

    async def follow_up(client: httpx.AsyncClient, probe: Probe) -> None:
        """The same keep-alive connection must still answer after an error."""
        with trio.move_on_after(2.0) as scope:
            try:
                response = await client.get("/health")
                if response.status_code != 200:
                    state.problem("keepalive", probe, response.status_code, "GET /health after it answered "
                                  f"{response.status_code}")
            except httpx.HTTPError as exc:
                state.problem("keepalive", probe, None, f"GET /health on the same connection failed: {exc!r}")
        if scope.cancelled_caught:
            state.problem("keepalive", probe, None, "GET /health on the same connection got no answer in 2 s")

    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as workers:
            nursery.start_soon(watch_health, target, state, done, workers)
            async with trio.open_nursery() as pool:
                for _ in range(max(1, concurrency)):
                    pool.start_soon(worker, receive.clone())
            receive.close()
        done.set()


def final_checks(target: Target, state: RunState, process_alive: Callable[[], bool] | None) -> bool:
    """The server answers /health, its process lives, and no slot stays busy. Returns alive."""
    alive = False
    for _ in range(10):
        try:
            alive = httpx.get(f"{target.url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            alive = False
        if alive:
            break
        time.sleep(0.5)
    if process_alive is not None and not process_alive():
        alive = False
    if not alive:
        state.problems.append(Problem("dead", Probe(-1, "-", "GET", "/health"), None,
                                      "the server does not answer /health at the end" +
                                      (" (frozen during the run)" if state.health.frozen else "")))
        return False
    deadline = time.monotonic() + 10
    busy: list = []
    while time.monotonic() < deadline:
        try:
            slots = httpx.get(f"{target.url}/slots", timeout=5.0).json()
            busy = [s for s in slots if isinstance(s, dict) and s.get("is_processing")]
        except (httpx.HTTPError, ValueError):
            busy = []
        if not busy:
            break
        time.sleep(0.5)
    if busy:
        state.problems.append(Problem("busy_slot", Probe(-1, "-", "GET", "/slots"), None,
                                      f"slots still processing 10 s after the run: {json.dumps(busy)[:300]}"))
    return True


def summarize(target: Target, state: RunState, probes: list[Probe], alive: bool, args: dict) -> dict:
    counts = Counter(p.kind for p in state.problems)
    counts["health"] += len(state.health.failures)
    by_kind: dict[str, list] = defaultdict(list)
    for p in state.problems:
        by_kind[p.kind].append({**p.probe.describe(), "status": p.status, "detail": p.detail})
    return {
        "config": args,
        "target": {"url": target.url, "model": target.model_id, "slots": target.n_slots, "n_ctx": target.n_ctx,
                   "body_limit": target.body_limit},
        "requests": len(probes), "sent": state.sent, "client_refused": state.client_refused,
        "elapsed_s": round(time.monotonic() - state.started, 1),
        "endpoints": {k: dict(sorted(v.items())) for k, v in sorted(state.statuses.items())},
        "counts": {kind: counts.get(kind, 0) for kind in FAILURE_KINDS},
        "health": state.health.summary(keep=50),
        "hangs_answered_late": sum(1 for p in state.problems if p.kind == "hang" and p.detail.startswith("answered")),
        "frozen": state.health.frozen, "alive": alive,
        "problems": {kind: items for kind, items in by_kind.items()},
        "log": sorted(state.log, key=lambda line: line["index"]),
        "failed": any(counts.get(kind, 0) for kind in FAILURE_KINDS),
    }


def run_fuzz(url: str, *, requests: int = 3000, seed: int = 0, concurrency: int = 8, timeout: float = 10.0,
             skip: tuple[str, ...] = (), only: tuple[int, ...] = (), body_limit: int = 32 * 1024 * 1024,
             process_alive: Callable[[], bool] | None = None, progress: Callable[[str], None] | None = None) -> dict:
    """Build the probes for `seed`, send them, check everything; the results as a JSON-able dict."""
    target = discover(url, body_limit)
    probes = ProbeFactory(target, seed, requests).build(requests)
    kept = [p for p in probes if not any(word in p.tag.split() for word in skip)]
    if only:
        kept = [p for p in kept if p.index in only]
    if progress:
        progress(f"{len(kept)} requests ({len(probes) - len(kept)} skipped) against {target.url} "
                 f"({target.model_id}, {target.n_slots} slot(s), n_ctx {target.n_ctx})")
    state = RunState()
    trio.run(run_probes, target, kept, concurrency, timeout, state, progress)
    alive = final_checks(target, state, process_alive)
    args = {"requests": requests, "seed": seed, "concurrency": concurrency, "timeout": timeout, "skip": list(skip)}
    return summarize(target, state, kept, alive, args)


# --- report -------------------------------------------------------------------------------------

def print_report(result: dict, examples: int = 5, out=sys.stdout) -> None:
    print(f"\n{result['sent']} requests to {result['target']['url']} ({result['target']['model']}, "
          f"{result['target']['slots']} slot(s), n_ctx {result['target']['n_ctx']}) in {result['elapsed_s']} s; "
          f"{result['client_refused']} not sendable by httpx", file=out)
    width = max([len(e) for e in result["endpoints"]] + [8])
    print(f"\n{'endpoint':<{width}}  {'n':>5}  statuses", file=out)
    for endpoint, statuses in result["endpoints"].items():
        total = sum(statuses.values())
        text = " ".join(f"{k}:{v}" for k, v in statuses.items())
        print(f"{endpoint:<{width}}  {total:>5}  {text}", file=out)
    health = result["health"]
    print(f"\n/health: {health['polls']} polls, max {health['max_latency_s']:.3f} s, "
          f"{len(health['failures'])} over {HEALTH_LIMIT_S:.0f} s or failed", file=out)
    print("failures: " + ", ".join(f"{k} {v}" for k, v in result["counts"].items()), file=out)
    if result["counts"]["hang"]:
        print(f"hangs: {result['hangs_answered_late']} answered late (within {LATE_FACTOR}x the timeout: a slow "
              f"or queued request), {result['counts']['hang'] - result['hangs_answered_late']} never", file=out)
    if result["frozen"]:
        print("the server stopped answering /health during the run (frozen): the run was cut short", file=out)
    for kind, items in result["problems"].items():
        print(f"\n[{kind}] {len(items)}; first {min(examples, len(items))}:", file=out)
        for item in items[:examples]:
            print(f"  #{item['index']} {item['method']} {item['path']}  -> {item['status']}  ({item['tag']})", file=out)
            if item["headers"]:
                print(f"      headers {item['headers']}", file=out)
            if item["body"] is not None:
                print(f"      body {item['body']}", file=out)
            print(f"      {item['detail']}", file=out)
    for failure in health["failures"][:examples]:
        print(f"  /health {failure}", file=out)
    print("\nFAILED" if result["failed"] else "\nOK", file=out)


@contextmanager
def served(url: str | None, model: str | None, serve_args: str, body_limit: int | None) -> Iterator[tuple]:
    """(url, process or None, body limit): the given server, or one started with ServerProcess."""
    if url:
        yield url, None, body_limit or 32 * 1024 * 1024
        return
    flags = shlex.split(serve_args)
    with tempfile.TemporaryDirectory(prefix="basert-fuzz-") as tmp:
        root = Path(tmp)
        if "--files-dir" not in flags:
            flags += ["--files-dir", str(root / "files")]
        if "--slot-save-path" not in flags:
            flags += ["--slot-save-path", str(root / "slots")]
        if "--max-body-bytes" in flags:
            body_limit = int(flags[flags.index("--max-body-bytes") + 1])
        else:
            body_limit = body_limit or 1024 * 1024
            flags += ["--max-body-bytes", str(body_limit)]
        process = ServerProcess(model, *flags, log_path=root / "server.log")
        try:
            yield process.url, process, body_limit
        finally:
            code = process.stop()
            if code != 0:
                print(f"server exited with {code}; log tail:\n{process.log_text()[-4000:]}", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="an existing server, e.g. http://127.0.0.1:8080")
    where.add_argument("--model", help="start `basert serve MODEL` (ServerProcess) for the run")
    parser.add_argument("--serve-args", default="", help='extra serve flags, e.g. "--continuous-batching 4"')
    parser.add_argument("--requests", type=int, default=3000, help="requests in all (default 3000; the fixed "
                        "hostile cases are always sent, with at least a third as many generated ones)")
    parser.add_argument("--seed", type=int, default=0, help="generation seed (default 0)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds before a request is a hang (default 10)")
    parser.add_argument("--body-limit", type=int, help="the server's --max-body-bytes (default 32 MiB; 1 MiB "
                        "is passed to a server this tool starts)")
    parser.add_argument("--skip", action="append", default=[], help="leave out requests with this tag word "
                        "(e.g. id_slot); repeatable")
    parser.add_argument("--only", default="", help="comma-separated request indices to send (replay)")
    parser.add_argument("--examples", type=int, default=5, help="offending requests printed per kind")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--log", type=Path, help="write one JSON line per request here (status, time, body start)")
    args = parser.parse_args()
    only = tuple(int(i) for i in args.only.split(",") if i.strip())

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    with served(args.url, args.model, args.serve_args, args.body_limit) as (url, process, body_limit):
        alive = (lambda: process.process.poll() is None) if process is not None else None
        result = run_fuzz(url, requests=args.requests, seed=args.seed, concurrency=args.concurrency,
                          timeout=args.timeout, skip=tuple(args.skip), only=only, body_limit=body_limit,
                          process_alive=alive, progress=progress)
        if process is not None and result["failed"]:
            result["server_log_tail"] = process.log_text()[-6000:]
    print_report(result, args.examples)
    log = result.pop("log")
    if args.log:
        args.log.write_text("".join(json.dumps(line) + "\n" for line in log))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
