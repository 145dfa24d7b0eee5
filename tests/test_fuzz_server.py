"""A subset of tools/fuzz_server.py: 300 malformed requests (fixed seed) against a real SmolLM2 server (-m slow),
and the checks of the tool itself."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
from conftest import API_BODY_LIMIT, SMOLLM2_API_FLAGS

from basert.testing.launcher import ServerProcess
from basert.testing.pool import ServerPool

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import fuzz_server

# Routes beside OpenAI's chat and completions: the subset reaches each of them.
NEWER_ROUTES = {"POST /v1/messages", "POST /v1/messages/count_tokens", "POST /v1/responses", "GET /v1/responses/{id}",
                "DELETE /v1/responses/{id}", "POST /v1/embeddings", "POST /completion", "POST /completions",
                "GET /props", "POST /props", "POST /apply-template", "POST /v1/chat/completions/input_tokens"}


@pytest.fixture(scope="module")
def server(smollm2_base: Path, server_pool: ServerPool) -> ServerProcess:
    return server_pool.get(smollm2_base, *SMOLLM2_API_FLAGS)


# A stress run: under -m slow (CI's slow stage), 300 requests (the fixed hostile cases of every route and 100
# drawn from the request schemas; tools/fuzz_server.py sends thousands). The default run's hostile-input checks
# are test_hardening.py's, test_error_envelopes.py's and each API's bad-request tests.
@pytest.mark.slow
@pytest.mark.parametrize("requests", [300])
def test_fuzz_subset_no_5xx_hang_or_bad_envelope(server: ServerProcess, requests: int):
    # One slot serves the generations one at a time: few in flight and a long timeout keep a slow (shared)
    # machine from turning a queue into a "hang". /health latency is reported, not asserted, for the same reason.
    result = fuzz_server.run_fuzz(server.url, requests=requests, seed=20261130, concurrency=3, timeout=60.0,
                                  body_limit=API_BODY_LIMIT, process_alive=lambda: server.process.poll() is None)
    report = io.StringIO()
    fuzz_server.print_report(result, examples=3, out=report)
    assert result["sent"] >= requests, report.getvalue()
    assert NEWER_ROUTES <= set(result["endpoints"]), report.getvalue()
    assert {"query", "origin"} <= {word for line in result["log"] for word in line["tag"].split()}
    # A generation that is slow only because a busy machine is slow is not a hang; one never answered is.
    counts = {**result["counts"], "hang": result["counts"]["hang"] - result["hangs_answered_late"]}
    failures = {kind: n for kind, n in counts.items() if n and kind != "health"}
    assert failures == {}, report.getvalue() + "\nserver log tail:\n" + server.log_text()[-3000:]
    assert result["alive"] and not result["frozen"]


@pytest.mark.slow  # three request lists built from generated schema pools: about half a minute
def test_probes_are_reproducible_for_a_seed():
    target = fuzz_server.Target(url="http://127.0.0.1:1", model_id="m", n_slots=2, n_ctx=512)
    first = fuzz_server.ProbeFactory(target, 5, 120).build(120)
    second = fuzz_server.ProbeFactory(target, 5, 120).build(120)
    assert [(p.method, p.path, p.body, p.raw, p.tag) for p in first] == \
           [(p.method, p.path, p.body, p.raw, p.tag) for p in second]
    other = fuzz_server.ProbeFactory(target, 6, 120).build(120)
    assert [p.body for p in other] != [p.body for p in first]


def test_checks_flag_what_a_client_cannot_use():
    probe = fuzz_server.Probe(0, "POST /x", "POST", "/x")
    json_type = {"content-type": "application/json"}
    cases = [
        (fuzz_server.Outcome(500, json_type, b'{"error": {"message": "m", "type": "server_error", "param": null, '
                                              b'"code": "internal_error"}}', 0.1), {"5xx"}),
        (fuzz_server.Outcome(400, {"content-type": "text/html"}, b"<h1>Bad</h1>", 0.1), {"envelope"}),
        (fuzz_server.Outcome(400, json_type, b'{"error": {"message": "x", "type": "t", "param": NaN, "code": 1}}',
                             0.1), {"envelope"}),
        (fuzz_server.Outcome(400, json_type, b'{"error": {"message": "Traceback (most recent call last):", '
                                              b'"type": "t", "param": null, "code": null}}', 0.1), {"leak"}),
        (fuzz_server.Outcome(503, json_type, b'{"error": {"message": "busy", "type": "unavailable_error", '
                                              b'"param": null, "code": "server_busy"}}', 0.1), {"retry_after"}),
        (fuzz_server.Outcome(200, json_type, b'{"logprob": -Infinity}', 0.1), {"bad_json"}),
        (fuzz_server.Outcome(200, json_type, b'{"text": "\\ud800"}', 0.1), {"bad_json"}),
        (fuzz_server.Outcome(None, {}, b"", 10.0, error="timeout"), {"hang"}),
        (fuzz_server.Outcome(404, json_type, b'{"error": {"message": "m", "type": "not_found_error", "param": null, '
                                              b'"code": "route_not_found"}}', 0.1), set()),
        (fuzz_server.Outcome(503, {**json_type, "retry-after": "1"}, b'{"error": {"message": "busy", "type": '
                                   b'"unavailable_error", "param": null, "code": "server_busy"}}', 0.1), set()),
    ]
    for outcome, kinds in cases:
        state = fuzz_server.RunState()
        fuzz_server.check(probe, outcome, state)
        assert {p.kind for p in state.problems} == kinds, (outcome, state.problems)


def test_checks_hold_each_route_to_its_own_error_envelope():
    openai = b'{"error": {"message": "m", "type": "invalid_request_error", "param": null, "code": null}}'
    anthropic = b'{"type": "error", "error": {"type": "invalid_request_error", "message": "m"}}'
    json_type = {"content-type": "application/json"}
    messages = fuzz_server.Probe(0, "POST /v1/messages", "POST", "/v1/messages")
    chat = fuzz_server.Probe(0, "POST /v1/chat/completions", "POST", "/v1/chat/completions")
    wrong_method = fuzz_server.Probe(0, "GET /v1/messages/count_tokens", "GET", "/v1/messages/count_tokens?x=1")
    below = fuzz_server.Probe(0, "unknown route", "POST", "/v1/messages/batches")
    llama = fuzz_server.Probe(0, "POST /completion", "POST", "/completion?model=x")
    cases = [
        (messages, anthropic, set()), (messages, openai, {"envelope"}), (chat, anthropic, {"envelope"}),
        (chat, openai, set()), (wrong_method, anthropic, set()), (wrong_method, openai, {"envelope"}),
        (below, anthropic, set()), (below, openai, set()), (llama, openai, set()), (llama, anthropic, {"envelope"}),
        (messages, b'{"type": "error", "error": {"type": "invalid_request_error", "message": "m", "param": null}}',
         {"envelope"}),
        (messages, b'{"type": "error", "error": {"type": "bad_request", "message": "m"}}', {"envelope"}),
        (messages, b'{"type": "error", "error": {"type": "api_error", "message": 5}}', {"envelope"}),
        (messages, b'{"type": "error", "error": {"type": "api_error", "message": "m"}, "x": NaN}', {"envelope"}),
    ]
    for probe, body, kinds in cases:
        state = fuzz_server.RunState()
        fuzz_server.check(probe, fuzz_server.Outcome(400, json_type, body, 0.1), state)
        assert {p.kind for p in state.problems} == kinds, (probe.endpoint, body, state.problems)


def test_checks_find_server_faults_in_each_stream_shape():
    stream = {"content-type": "text/event-stream"}
    faults = [
        b'data: {"error": {"message": "m", "type": "server_error", "param": null, "code": "internal_error"}}\n\n',
        b'event: error\ndata: {"type": "error", "error": {"type": "api_error", "message": "m"}}\n\n',
        b'event: error\ndata: {"type": "error", "code": "server_error", "message": "m", "param": null}\n\n',
        b'event: response.failed\ndata: {"type": "response.failed", "response": {"error": {"code": '
        b'"server_error"}}}\n\n',
    ]
    fine = b'event: error\ndata: {"type": "error", "error": {"type": "overloaded_error", "message": "m"}}\n\n'
    probe = fuzz_server.Probe(0, "POST /v1/messages", "POST", "/v1/messages")
    for body, kinds in [(fault, {"stream_error"}) for fault in faults] + [(fine, set())]:
        state = fuzz_server.RunState()
        fuzz_server.check(probe, fuzz_server.Outcome(200, stream, body, 0.1), state)
        assert {p.kind for p in state.problems} == kinds, (body, state.problems)
    # llama.cpp's /completion stream ends a failure with an `error:` line holding the error object alone.
    llama = fuzz_server.Probe(0, "POST /completion", "POST", "/completion")
    token = b'data: {"content": "a", "stop": false}\n\n'
    for line, kinds in [
        (b'error: {"message": "m", "type": "server_error", "param": null, "code": "internal_error"}', {"stream_error"}),
        (b'error: {"message": "m", "type": "unavailable_error", "param": null, "code": "draining"}', set()),
        (b'error: {"message": NaN}', {"bad_json"}),
    ]:
        state = fuzz_server.RunState()
        fuzz_server.check(llama, fuzz_server.Outcome(200, stream, token + line + b"\n\n", 0.1), state)
        assert {p.kind for p in state.problems} == kinds, (line, state.problems)
