"""Hostile clients, early answers, backpressure and shutdown, against a real `basert serve` on loopback."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from basert.testing.client import error_envelope
from basert.testing.launcher import ServerProcess, free_port

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
LONG_STREAM = {"messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 3000,
               "temperature": 0, "ignore_eos": True, "stream": True}
ORIGIN = "http://app.example"
ALLOWED_HOST = "basert.internal"
EVIL = "http://evil.example"


@pytest.fixture(scope="module")
def server(smollm2_base: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("hardening")
    # One slot, one request at a time: the queue tests fill it with one stream. A queued request waits up to
    # 5 s (the full-queue test waits that long for its 503 queue_timeout answers).
    with ServerProcess(smollm2_base, "--no-continuous-batching", "--max-context", "4096",
                       "--max-body-bytes", "100000",
                       "--files-dir", str(root / "files"), "--slot-save-path", str(root / "slots"),
                       "--cors-allow-origin", ORIGIN, "--max-queued", "2", "--queue-timeout", "5",
                       "--allowed-host", ALLOWED_HOST, log_path=root / "server.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def keyed_server(smollm2_base: Path, tmp_path_factory: pytest.TempPathFactory):
    """Keys from the command line (secret-key) and from a key file (second-key)."""
    root = tmp_path_factory.mktemp("keyed")
    (root / "keys").write_text("second-key\n")
    with ServerProcess(smollm2_base, "--max-context", "512", "--api-key", "secret-key",
                       "--api-key-file", str(root / "keys"), "--rate-limit", "8", "--cors-allow-origin", "*",
                       "--max-body-bytes", "100000", log_path=root / "server.log") as proc:
        yield proc


def assert_health_fast(url: str) -> None:
    started = time.monotonic()
    assert httpx.get(url + "/health", timeout=1.0).status_code == 200
    assert time.monotonic() - started < 1.0


class Stream:
    """A streamed chat request held open in a thread; `started` is set once its first token arrived."""

    def __init__(self, url: str, body: dict, headers: dict | None = None):
        self.started = threading.Event()
        self.stop = threading.Event()
        self.status: int | None = None
        self.thread = threading.Thread(target=self._run, args=(url, body, headers or {}), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict, headers: dict) -> None:
        with httpx.Client(timeout=120) as client:
            with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if '"content": "' in line and '"content": ""' not in line:
                        self.started.set()
                    if self.stop.is_set():
                        break
        self.started.set()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)


def test_a_slot_outside_the_slots_is_a_400_and_the_server_keeps_answering(server: ServerProcess):
    for bad in (1, 5, -5):
        error_envelope(httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "id_slot": bad}, timeout=10), 400)
        assert_health_fast(server.url)
    stream_error = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "id_slot": 3, "stream": True},
                              timeout=10)
    error_envelope(stream_error, 400)
    assert httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "id_slot": -1}, timeout=60).status_code == 200
    assert httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "id_slot": 0}, timeout=60).status_code == 200


def test_health_answers_within_a_second_while_bad_and_good_requests_are_pending(server: ServerProcess):
    stream = Stream(server.url, LONG_STREAM)
    assert stream.started.wait(60)
    try:
        results: list[int] = []
        threads = [threading.Thread(target=lambda body=body: results.append(httpx.post(
            server.url + "/v1/chat/completions", json=body, timeout=60).status_code))
            for body in ({**CHAT, "id_slot": 7}, CHAT, {**CHAT, "id_slot": -2})]
        for thread in threads:
            thread.start()
        for _ in range(5):
            assert_health_fast(server.url)
            time.sleep(0.2)
    finally:
        stream.close()
    for thread in threads:
        thread.join(60)
    assert sorted(results) == [200, 400, 400]


@pytest.mark.parametrize("http2", [False, True], ids=["http1.1", "http2"])
def test_early_answers_leave_the_connection_usable(server: ServerProcess, http2: bool):
    with httpx.Client(base_url=server.url, timeout=20, http1=not http2, http2=http2) as client:
        early = [
            (lambda: client.post("/v1/chat/completions", content=b"x" * 300_000), 413),
            (lambda: client.post("/v1/no-such-route", json={"input": "hello " * 2000}), 404),
            (lambda: client.put("/v1/chat/completions", json=CHAT), 405),
            (lambda: client.post("/slots/abc/save", json={"filename": "x" * 5000}), 400),
        ]
        for send, status in early:
            response = send()
            error_envelope(response, status)
            assert response.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
            follow = client.post("/v1/chat/completions", json=CHAT)
            assert follow.status_code == 200, follow.text


def test_api_keys(keyed_server: ServerProcess):
    assert httpx.get(keyed_server.url + "/health").status_code == 200
    error_envelope(httpx.get(keyed_server.url + "/v1/models"), 401, "invalid_api_key")
    assert httpx.get(keyed_server.url + "/v1/models", headers={"Authorization": "Bearer secret-key"}).status_code == 200
    assert httpx.get(keyed_server.url + "/v1/models", headers={"X-Api-Key": "second-key"}).status_code == 200
    assert httpx.get(keyed_server.url + "/slots", headers={"X-Api-Key": "wrong"}).status_code == 401


@pytest.mark.parametrize("http2", [False, True], ids=["http1.1", "http2"])
def test_a_refused_key_leaves_the_connection_usable(keyed_server: ServerProcess, http2: bool):
    with httpx.Client(base_url=keyed_server.url, timeout=20, http1=not http2, http2=http2) as client:
        error_envelope(client.post("/v1/chat/completions", json={**CHAT, "pad": "x" * 50_000}), 401, "invalid_api_key")
        follow = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer secret-key"})
        assert follow.status_code == 200, follow.text


HOSTILE_BODIES = {
    "deep nesting": b'{"messages": ' + b"[" * 40_000 + b"]" * 40_000 + b"}",
    "moderate nesting": json.dumps({**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters":
                                    json.loads("[" * 200 + "]" * 200)}}]}).encode(),
    "lone surrogate in content": b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
    "lone surrogate in a key": b'{"messages": [{"role": "user", "content": "hi"}], "x": {"\\udfff": 1}}',
    "superscript digit bias": json.dumps({**CHAT, "logit_bias": {"\u00b2": 1}}).encode(),
    "circled digit bias": json.dumps({**CHAT, "logit_bias": {"\u2460": 1}}).encode(),
    "arabic digit bias": json.dumps({**CHAT, "logit_bias": {"\u0663": 1}}).encode(),
    "double minus bias": json.dumps({**CHAT, "logit_bias": {"--5": 1}}).encode(),
    "bias outside the vocabulary": json.dumps({**CHAT, "logit_bias": {"99999999": 1}}).encode(),
    "template kwargs messages": json.dumps({**CHAT, "chat_template_kwargs": {"messages": []}}).encode(),
    "template kwargs tools": json.dumps({**CHAT, "chat_template_kwargs": {"tools": []}}).encode(),
    "template kwargs generation prompt": json.dumps(
        {**CHAT, "chat_template_kwargs": {"add_generation_prompt": False}}).encode(),
    "text part without text": json.dumps(
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]}).encode(),
    "image part": json.dumps(
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    ).encode(),
    "not utf-8": b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
}


@pytest.mark.parametrize("name", list(HOSTILE_BODIES))
def test_hostile_chat_bodies_are_400s(server: ServerProcess, name: str):
    response = httpx.post(server.url + "/v1/chat/completions", content=HOSTILE_BODIES[name], timeout=30,
                          headers={"Content-Type": "application/json"})
    error = error_envelope(response, 400)
    assert "Traceback" not in error["message"] and "/" not in error["message"].split(":")[0]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", b'{"prompt": "a\\udc80", "max_tokens": 1}'),
    ("/v1/completions", b'{"prompt": ["ok", "\\ud800"], "max_tokens": 1}'),
    ("/v1/tokenize", b'{"content": "\\ud800"}'),
    ("/v1/detokenize", b'{"tokens": [' + b"[" * 5000 + b"]" * 5000 + b"]}"),
])
def test_hostile_bodies_on_other_endpoints_are_400s(server: ServerProcess, path: str, body: bytes):
    error_envelope(httpx.post(server.url + path, content=body, timeout=30), 400)


def test_cors_preflight_answers_what_a_browser_asks(server: ServerProcess, keyed_server: ServerProcess):
    # The OpenAI JS SDK's preflight asks for its x-stainless-* headers besides Authorization.
    asked = "authorization, content-type, x-stainless-os, x-stainless-retry-count"
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": asked}
    response = httpx.options(server.url + "/v1/chat/completions", headers=preflight)
    assert response.status_code == 200
    assert response.content == b""
    assert response.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert response.headers["Access-Control-Allow-Credentials"] == "true"
    assert response.headers["Access-Control-Allow-Methods"] == "GET, POST, DELETE, OPTIONS"
    assert response.headers["Access-Control-Allow-Headers"] == asked
    plain = httpx.options(server.url + "/v1/models", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "GET"})
    assert (plain.status_code, plain.headers["Access-Control-Allow-Headers"]) == (200, "*")
    other = httpx.options(server.url + "/v1/chat/completions", headers={**preflight, "Origin": EVIL})
    assert other.status_code == 200 and "Access-Control-Allow-Origin" not in other.headers
    # A keyed server answers the preflight without the key (browsers never send credentials with it); with '*'
    # it names the origin itself, which credentialed requests need.
    keyed = httpx.options(keyed_server.url + "/v1/models", headers={**preflight, "Origin": "http://any.example"})
    assert keyed.status_code == 200 and keyed.headers["Access-Control-Allow-Origin"] == "http://any.example"
    answered = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers={"Origin": ORIGIN}, timeout=60)
    assert answered.status_code == 200
    assert answered.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert answered.headers["Access-Control-Allow-Credentials"] == "true"


def slot_zero_cache(server: ServerProcess) -> int:
    return [slot for slot in httpx.get(server.url + "/slots").json() if slot["id"] == 0][0]["cache_tokens"]


def test_a_web_page_can_neither_change_nor_read_a_keyless_server(server: ServerProcess):
    # What a page would erase or read: slot 0's cached prompt and a stored file.
    assert httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "id_slot": 0}, timeout=60).status_code == 200
    cached = slot_zero_cache(server)
    assert cached > 0
    upload = httpx.post(server.url + "/v1/files", files={"file": ("notes.txt", b"private notes")},
                        data={"purpose": "user_data"})
    file_id = upload.json()["id"]
    listed = httpx.get(server.url + "/v1/files").json()["data"]
    as_text = {"Origin": EVIL, "Content-Type": "text/plain"}
    # DNS rebinding: the page's own name now leads to the server, so its requests are same-origin.
    rebound = {"Host": f"evil.example:{server.port}", "Origin": f"http://evil.example:{server.port}"}
    chat_text = json.dumps({**CHAT, "id_slot": 0})
    attempts = [
        ("POST", "/slots/0?action=erase", as_text, None, 403, "origin_not_allowed"),
        ("POST", "/slots/0/erase", as_text, None, 403, "origin_not_allowed"),
        ("POST", "/v1/chat/completions", as_text, chat_text, 403, "origin_not_allowed"),
        # A browser that sends no Origin with a form still sends the form's type.
        ("POST", "/slots/0?action=erase", {"Content-Type": "text/plain"}, None, 415, "unsupported_media_type"),
        ("POST", "/slots/0/erase", {"Content-Type": "application/x-www-form-urlencoded"}, "a=1", 415,
         "unsupported_media_type"),
        ("POST", "/v1/chat/completions", {"Content-Type": "text/plain"}, chat_text, 415, "unsupported_media_type"),
        ("POST", "/slots/0?action=erase", {**rebound, "Content-Type": "text/plain"}, None, 403, "host_not_allowed"),
        ("DELETE", f"/v1/files/{file_id}", rebound, None, 403, "host_not_allowed"),
        ("GET", "/slots", rebound, None, 403, "host_not_allowed"),
        ("GET", "/v1/files", rebound, None, 403, "host_not_allowed"),
        ("GET", f"/v1/files/{file_id}/content", rebound, None, 403, "host_not_allowed"),
    ]
    for method, path, headers, body, status, code in attempts:
        response = httpx.request(method, server.url + path, headers=headers, content=body, timeout=60)
        error_envelope(response, status, code)
        assert file_id not in response.text and "private notes" not in response.text
    uploaded = httpx.post(server.url + "/v1/files", headers={"Origin": EVIL},
                          files={"file": ("planted.txt", b"x")}, data={"purpose": "user_data"})
    error_envelope(uploaded, 403, "origin_not_allowed")
    assert slot_zero_cache(server) == cached
    assert httpx.get(server.url + "/v1/files").json()["data"] == listed
    assert httpx.get(server.url + f"/v1/files/{file_id}/content").content == b"private notes"
    assert httpx.delete(server.url + f"/v1/files/{file_id}").status_code == 200


def test_host_names_a_keyless_server_answers(server: ServerProcess, keyed_server: ServerProcess):
    port = server.port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", f"10.1.2.3:{port}", "app.localhost",
                 f"{ALLOWED_HOST}:{port}", ALLOWED_HOST.upper()):
        assert httpx.get(server.url + "/v1/models", headers={"Host": host}).status_code == 200, host
    for host in (f"evil.example:{port}", "basert.internal.evil.example", "localhost.evil.example", "[::1"):
        error_envelope(httpx.get(server.url + "/v1/models", headers={"Host": host}), 403, "host_not_allowed")
    # A page of the server's own origin (served by a proxy under an allowed name) is not cross-origin.
    own = {"Host": f"{ALLOWED_HOST}:{port}", "Origin": f"https://{ALLOWED_HOST}:{port}"}
    assert httpx.post(server.url + "/v1/tokenize", json={"content": "hi"}, headers=own).status_code == 200
    # With a key, a rebinding page cannot authenticate, so any name is answered.
    keyed = httpx.get(keyed_server.url + "/v1/models", headers={"Host": "evil.example", "X-Api-Key": "secret-key"})
    assert keyed.status_code == 200
    # JSON under any of its spellings, and no type at all (SDKs outside browsers), are read as before.
    for content_type in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json", None):
        headers = {"Content-Type": content_type} if content_type else {}
        response = httpx.post(server.url + "/v1/tokenize", content=b'{"content": "hi"}', headers=headers)
        assert response.status_code == 200, content_type


def test_rate_limit_per_key(keyed_server: ServerProcess):
    headers = {"X-Api-Key": "secret-key"}
    statuses = [httpx.get(keyed_server.url + "/v1/models", headers=headers).status_code for _ in range(12)]
    assert 429 in statuses and statuses[0] == 200
    refused = httpx.get(keyed_server.url + "/v1/models", headers=headers)
    error_envelope(refused, 429, "rate_limit_exceeded")
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    assert httpx.get(keyed_server.url + "/health").status_code == 200


def test_full_queue_is_503_busy_and_a_long_wait_is_503_queue_timeout(server: ServerProcess):
    stream = Stream(server.url, LONG_STREAM)
    assert stream.started.wait(60)
    try:
        queued: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: queued.append(httpx.post(
            server.url + "/v1/chat/completions", json=CHAT, timeout=60))) for _ in range(2)]
        for thread in threads:
            thread.start()
        time.sleep(0.5)  # both are queued now (the only slot is streaming)
        busy = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=10)
        error_envelope(busy, 503, "server_busy")
        assert busy.headers["Retry-After"] == "1"
        busy_stream = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=10)
        error_envelope(busy_stream, 503, "server_busy")
        assert_health_fast(server.url)
        for thread in threads:
            thread.join(30)
    finally:
        stream.close()
    for response in queued:
        error_envelope(response, 503, "queue_timeout")
        assert "Retry-After" in response.headers
    assert httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=60).status_code == 200
    slots = httpx.get(server.url + "/slots").json()
    assert not any(slot["is_processing"] for slot in slots)


def test_access_log_has_every_request_with_control_characters_and_spaces_escaped(server: ServerProcess,
                                                                                 keyed_server: ServerProcess):
    httpx.get(server.url + "/v1/models/%00evil%0A2026-01-01 forged line")
    httpx.get(server.url + "/v1/models/x 200 model=forged")
    httpx.get(server.url + "/v1/models")
    httpx.get(keyed_server.url + "/v1/models")  # no key: 401
    time.sleep(0.3)
    log = server.log_text()
    assert "GET /v1/models 200" in log
    assert "\\x00evil\\n2026-01-01%20forged%20line 404" in log
    # A space in the path would let it fill the status and model fields.
    assert "GET /v1/models/x%20200%20model=forged 404 model=- " in log
    assert not any(line.startswith("2026-01-01 forged") for line in log.splitlines())
    assert "\x00" not in log
    assert "GET /v1/models 401" in keyed_server.log_text()


def test_internal_errors_carry_an_id_and_no_details(caplog: pytest.LogCaptureFixture):
    from basert.server.errors import to_api_error

    try:
        raise RuntimeError("cannot open /srv/secret/model.base")
    except RuntimeError as exc:
        error = to_api_error(exc)
    assert error.status == 500 and error.code == "internal_error"
    assert "/srv/secret" not in error.message and "RuntimeError" not in error.message
    error_id = error.body()["error"]["error_id"]
    assert error_id in error.message
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert logged and logged[0].exc_info is not None


def test_api_key_file_without_a_key_refuses_to_start(tmp_path: Path):
    key_file = tmp_path / "keys"
    key_file.write_text("\n   \n\n")
    result = subprocess.run([sys.executable, "-m", "basert", "serve", "missing.base", "--api-key-file",
                             str(key_file), "--port", str(free_port())], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no key" in lines[0] and "Traceback" not in result.stderr


def test_upload_on_a_full_disk_is_507_without_paths(smollm2_base: Path, tmp_path: Path):
    files = tmp_path / "files"
    with ServerProcess(smollm2_base, "--max-context", "256", "--files-dir", str(files),
                       log_path=tmp_path / "server.log", file_size_limit=2_000_000) as proc:
        response = httpx.post(proc.url + "/v1/files", files={"file": ("big.bin", b"z" * 3_000_000)},
                              data={"purpose": "user_data"}, timeout=60)
        error = error_envelope(response, 507, "insufficient_storage")
        assert "file upload" in error["message"] and str(tmp_path) not in error["message"]
        assert [p.name for p in files.iterdir()] == []
        small = httpx.post(proc.url + "/v1/files", files={"file": ("small.bin", b"z" * 1000)}, timeout=60)
        assert small.status_code == 200
        # SmolLM2 keeps ~23 KB of KV per token: 200 tokens of history make a snapshot beyond the limit.
        long_prompt = {**CHAT, "messages": [{"role": "user", "content": "word " * 200}]}
        assert httpx.post(proc.url + "/v1/chat/completions", json=long_prompt, timeout=60).status_code == 200
        error = error_envelope(httpx.post(proc.url + "/slots/0/save", json={}, timeout=60), 507, "insufficient_storage")
        assert "slot save" in error["message"] and str(tmp_path) not in error["message"]
        assert sorted(p.name.split(".")[-1] for p in files.iterdir()) == ["data", "json"]


def test_sigterm_drains_running_requests_then_exits_zero(smollm2_base: Path, tmp_path: Path):
    proc = ServerProcess(smollm2_base, "--max-context", "512", "--drain-timeout", "300",
                         log_path=tmp_path / "server.log")
    body = {**CHAT, "max_tokens": 64, "ignore_eos": True, "stream": True}
    chunks: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", proc.url + "/v1/chat/completions", json=body, timeout=60) as response:
            chunks.extend(response.iter_lines())

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while len([c for c in chunks if c.startswith("data: {")]) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.terminate()
        time.sleep(0.2)
        try:
            refused = httpx.post(proc.url + "/v1/chat/completions", json=CHAT, timeout=10)
            error_envelope(refused, 503, "draining")
            assert "Retry-After" in refused.headers
        except (httpx.ConnectError, httpx.RemoteProtocolError):
            pass  # the drain already finished: the listener is closed, or closes as the connection comes in
        thread.join(60)
        assert [c for c in chunks if c][-1] == "data: [DONE]"
        finish = [json.loads(c[6:]) for c in chunks if c.startswith("data: {")][-1]["choices"][0]["finish_reason"]
        assert finish == "length"
        # The one SIGTERM above is all it gets: wait for the exit without signalling again.
        assert proc.wait() == 0, proc.log_text()
        assert "draining" in proc.log_text()
    finally:
        proc.stop()


async def test_files_and_slots_answer_only_loopback_clients_without_a_key(tmp_path: Path):
    from basert.server.app import ServerSettings, create_app
    from basert.server.catalog import ModelCatalog
    from basert.server.files import FilesStore

    app = create_app(ModelCatalog(), ServerSettings(files=FilesStore(tmp_path / "files")))
    client = app.test_client()
    remote = {"client": ("203.0.113.7", 40000)}
    local = {"client": ("127.0.0.1", 40000)}
    for path in ("/v1/files", "/v1/files/file-0123456789abcdef01234567", "/slots"):
        response = await client.get(path, scope_base=remote)
        assert response.status_code == 401, path
        assert (await response.get_json())["error"]["code"] == "invalid_api_key"
    assert (await client.get("/v1/files", scope_base=local)).status_code == 200
    assert (await client.get("/health", scope_base=remote)).status_code == 200


def test_a_server_beyond_loopback_without_a_key_warns(smollm2_base: Path, tmp_path: Path):
    proc = ServerProcess(smollm2_base, "--host", "0.0.0.0", "--max-context", "256",
                         log_path=tmp_path / "server.log")
    assert proc.stop() == 0
    warnings = [line for line in proc.log_text().splitlines() if "WARNING" in line]
    assert any("without --api-key" in line for line in warnings)


def test_a_symlink_loop_in_the_slot_directory_is_a_400_without_the_servers_paths(server: ServerProcess):
    loop = server.log_path.parent / "slots" / "loop.bin"
    loop.symlink_to(loop.name)
    try:
        response = httpx.post(server.url + "/slots/0?action=save", json={"filename": "loop.bin"}, timeout=30)
    finally:
        loop.unlink()
    assert response.json() == {"error": {"message": "filename cannot be resolved (a symbolic link loop?): "
                                                    "'loop.bin'", "type": "invalid_request_error", "param": None,
                                         "code": "invalid_value"}}
    assert response.status_code == 400


def test_an_erase_reads_its_body_and_refuses_one_over_the_limit(server: ServerProcess):
    assert httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "id_slot": 0}, timeout=60).status_code == 200
    cached = slot_zero_cache(server)
    big = b'{"pad": "' + b"x" * 300_000 + b'"}'
    for path in ("/slots/0/erase", "/slots/0?action=erase"):
        error_envelope(httpx.post(server.url + path, content=big, headers={"Content-Type": "application/json"},
                                  timeout=30), 413, "request_too_large")
        error_envelope(httpx.post(server.url + path, content=b"not json", timeout=30), 400)
    assert slot_zero_cache(server) == cached
    erased = httpx.post(server.url + "/slots/0?action=erase", timeout=30)
    assert erased.json() == {"id_slot": 0, "n_erased": cached}


def test_hypercorns_own_refusals_are_error_envelopes(server: ServerProcess):
    too_large = httpx.get(server.url + "/v1/models", headers={"X-Pad": "x" * 100_000})
    assert too_large.status_code == 431
    assert too_large.json() == {"error": {"message": "request headers are too large", "type": "invalid_request_error",
                                          "param": None, "code": "request_header_fields_too_large"}}
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
        raw.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        answer = b""
        while chunk := raw.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400")
    assert json.loads(body) == {"error": {"message": "malformed HTTP request", "type": "invalid_request_error",
                                          "param": None, "code": "bad_http_request"}}
    assert_health_fast(server.url)
