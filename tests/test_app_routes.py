"""The application without a model: routing, CORS, the files store, operations and the access log, in process."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from basert.server.app import ServerSettings, create_app
from basert.server.catalog import ModelCatalog
from basert.server.files import FilesStore

LOCAL = {"client": ("127.0.0.1", 40000)}


def app_with(tmp_path: Path, **settings):
    return create_app(ModelCatalog(), ServerSettings(files=FilesStore(tmp_path / "files"), **settings))


async def test_unknown_route_and_method_get_their_envelopes(tmp_path: Path):
    client = app_with(tmp_path).test_client()
    response = await client.get("/v1/nothing", scope_base=LOCAL)
    assert response.status_code == 404
    assert json.loads(await response.get_data()) == {"error": {
        "message": "route GET /v1/nothing not found", "type": "not_found_error", "param": None,
        "code": "route_not_found"}}
    response = await client.get("/v1/chat/completions", scope_base=LOCAL)
    assert response.status_code == 405
    assert (await response.get_json())["error"]["code"] == "method_not_allowed"


async def test_cors_preflight_and_allowed_origin(tmp_path: Path):
    client = app_with(tmp_path, cors_origins=["http://a.example"]).test_client()
    preflight = await client.options("/v1/chat/completions", headers={"Origin": "http://a.example"},
                                     scope_base=LOCAL)
    assert preflight.status_code == 200
    assert preflight.headers["Access-Control-Allow-Origin"] == "http://a.example"
    assert preflight.headers["Access-Control-Allow-Methods"] == "GET, POST, DELETE, OPTIONS"
    other = await client.get("/health", headers={"Origin": "http://b.example"}, scope_base=LOCAL)
    assert "Access-Control-Allow-Origin" not in other.headers


async def test_files_round_trip(tmp_path: Path):
    client = app_with(tmp_path).test_client()
    uploaded = await client.post("/v1/files", files={"file": _upload(b"hello", "x.txt")},
                                 form={"purpose": "batch"}, scope_base=LOCAL)
    assert uploaded.status_code == 200, await uploaded.get_data()
    stored = await uploaded.get_json()
    assert (stored["filename"], stored["bytes"], stored["purpose"]) == ("x.txt", 5, "batch")
    listed = await (await client.get("/v1/files?purpose=batch", scope_base=LOCAL)).get_json()
    assert [f["id"] for f in listed["data"]] == [stored["id"]]
    content = await client.get(f"/v1/files/{stored['id']}/content", scope_base=LOCAL)
    assert await content.get_data() == b"hello"
    deleted = await client.delete(f"/v1/files/{stored['id']}", scope_base=LOCAL)
    assert await deleted.get_json() == {"id": stored["id"], "object": "file", "deleted": True}
    missing = await client.get(f"/v1/files/{stored['id']}", scope_base=LOCAL)
    assert missing.status_code == 404
    assert (await missing.get_json())["error"]["code"] == "file_not_found"


async def test_files_need_a_files_dir():
    client = create_app(ModelCatalog(), ServerSettings()).test_client()
    for method, path in (("GET", "/v1/files"), ("POST", "/v1/files"), ("DELETE", "/v1/files/file-x")):
        response = await client.open(path, method=method, scope_base=LOCAL)
        assert response.status_code == 501, path
        assert (await response.get_json())["error"]["message"] == "slot snapshots and /v1/files need --files-dir DIR"


async def test_health_metrics_and_the_access_log(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    client = app_with(tmp_path).test_client()
    with caplog.at_level(logging.INFO, logger="basert.access"):
        assert await (await client.get("/health", scope_base=LOCAL)).get_json() == {"status": "ok"}
    [line] = [r.getMessage() for r in caplog.records if r.name == "basert.access"]
    assert line.startswith("GET /health 200 model=- slot=- prompt=0 cached=0 completion=0 prefill_tps=0.0 ")
    assert line.endswith(" finish=-")
    metrics = await (await client.get("/metrics", scope_base=LOCAL)).get_data()
    assert b'basert_requests_total{endpoint="/health",status="200"} 1.0' in metrics


async def test_draining_refuses_new_requests(tmp_path: Path):
    app = app_with(tmp_path)
    app.basert_state.draining = True
    response = await app.test_client().get("/v1/models", scope_base=LOCAL)
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "5"
    assert (await response.get_json())["error"]["code"] == "draining"


def _upload(data: bytes, filename: str):
    from io import BytesIO

    from werkzeug.datastructures import FileStorage

    return FileStorage(BytesIO(data), filename=filename)


async def test_web_pages_serve_their_own_files_only(tmp_path: Path):
    """The pages' files by name, and nothing else under /webui/ (traversal, unknown names, other folders: 404 in
    the envelope); a browser gets the chat page at /, other clients Ollama's answer; --no-webui: no pages."""
    client = app_with(tmp_path).test_client()
    page = await client.get("/", headers={"Accept": "text/html,*/*;q=0.8"}, scope_base=LOCAL)
    assert page.status_code == 200 and page.mimetype == "text/html"
    assert "/webui/chat.js" in (await page.get_data()).decode()
    plain = await client.get("/", scope_base=LOCAL)
    assert (await plain.get_data()) == b"Ollama is running"
    script = await client.get("/webui/chat.js", scope_base=LOCAL)
    assert script.status_code == 200 and script.mimetype == "text/javascript"
    for path in ("/webui/../../etc/passwd", "/webui/%2e%2e%2fcatalog.py", "/webui/nope.js", "/webui/",
                 "/webui/__init__.py", "/webui/index.html/x", "/webui/%00"):
        response = await client.get(path, scope_base=LOCAL)
        assert response.status_code == 404, path
        assert (await response.get_json())["error"]["type"] == "not_found_error"
    off = app_with(tmp_path, webui=False).test_client()
    for path in ("/dashboard", "/webui/chat.js"):
        assert (await off.get(path, scope_base=LOCAL)).status_code == 404
    assert (await (await off.get("/", headers={"Accept": "text/html"}, scope_base=LOCAL)).get_data()) == \
        b"Ollama is running"
