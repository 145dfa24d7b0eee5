"""The quart-trio application: routes, auth, the error envelope, SSE, metrics and the access log."""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from basert.actor.messages import SlotErase, SlotList, SlotRestore, SlotSave, Stats
from basert.format.atomic import StorageError
from basert.server.catalog import ModelCatalog, ServedModel
from basert.server.chat_api import RequestRecord, chat_completion, completion
from basert.server.errors import ApiError, internal_error, invalid, not_found, not_supported, to_api_error, unavailable
from basert.server.files import FilesStore, safe_child
from basert.server.generation import ServerLimits
from basert.server.json_input import parse_json_object
from basert.server.logs import printable
from basert.server.metrics import ServerMetrics
from basert.server.rate_limit import RateLimiter
from basert.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SlotFileRequest,
    TokenizeRequest,
)

access_log = logging.getLogger("basert.access")
SNAPSHOT_PURPOSE = "slot_snapshot"
# Paths that hold other users' data or control the server: without an API key only loopback clients reach them.
PROTECTED_PREFIXES = ("/slots", "/v1/files")
CORS_ALLOWED_HEADERS = "Authorization, Content-Type, X-Api-Key"
CORS_ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"
SLOT_ID = re.compile(r"-?[0-9]{1,9}")


@dataclass(slots=True)
class ServerSettings:
    api_keys: list[str] = field(default_factory=list)
    limits: ServerLimits = field(default_factory=ServerLimits)
    files: FilesStore | None = None
    slot_save_path: Path | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    cors_origins: list[str] = field(default_factory=list)
    rate_limit: int = 0                      # requests per minute per API key (or client address); 0 = off


@dataclass(slots=True)
class ServerState:
    """What changes while the server runs: set `draining` and new requests are refused with a 503."""

    draining: bool = False


def is_loopback(address: str | None) -> bool:
    if not address:
        return False
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def error_response(error: ApiError) -> Response:
    response = Response(json.dumps(error.body()), status=error.status, mimetype="application/json")
    response.headers.update(error.headers)
    return response


def create_app(catalog: ModelCatalog, settings: ServerSettings) -> QuartTrio:
    """The application serving `catalog`'s models."""
    app = QuartTrio("basert")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 600
    metrics = ServerMetrics()
    state = ServerState()
    app.basert_metrics = metrics  # type: ignore[attr-defined]
    app.basert_state = state  # type: ignore[attr-defined]
    keys = [k.encode() for k in settings.api_keys]
    limiter = RateLimiter(settings.rate_limit) if settings.rate_limit > 0 else None

    def log_request(endpoint: str, status: int, started: float, record: RequestRecord | None,
                    method: str, path: str, streamed: bool = False) -> None:
        elapsed = time.monotonic() - started
        metrics.requests.labels(endpoint, str(status)).inc()
        metrics.latency.labels(endpoint).observe(elapsed)
        r = record or RequestRecord()
        if r.model:
            metrics.prompt_tokens.labels(r.model).inc(r.prompt_tokens)
            metrics.cached_tokens.labels(r.model).inc(r.cached_tokens)
            metrics.generated_tokens.labels(r.model).inc(r.completion_tokens)
            if r.ttft_ms:
                metrics.ttft.labels(r.model).observe(r.ttft_ms / 1000)
        access_log.info(
            "%s %s %d model=%s slot=%s prompt=%d cached=%d completion=%d prefill_tps=%.1f decode_tps=%.1f "
            "ttft_ms=%.1f total_ms=%.1f finish=%s%s%s",
            printable(method, 16), printable(path), status, r.model or "-", "-" if r.slot is None else r.slot,
            r.prompt_tokens, r.cached_tokens, r.completion_tokens, r.prompt_per_second, r.predicted_per_second,
            r.ttft_ms, 1000 * elapsed, r.finish_reason or ("cancelled" if streamed else "-"),
            " stream" if streamed else "", " timed_out" if r.timed_out else "",
        )

    def supplied_key() -> str:
        auth = request.headers.get("Authorization", "")
        if auth.lower().startswith("bearer "):
            return auth[7:].strip()
        return request.headers.get("X-Api-Key", "")

    def cors_origin() -> str | None:
        """The Access-Control-Allow-Origin value for this request, or None."""
        origin = request.headers.get("Origin")
        if not origin or not settings.cors_origins:
            return None
        if "*" in settings.cors_origins:
            return "*"
        return origin if origin in settings.cors_origins else None

    @app.before_request
    async def admit_request() -> Response | None:
        request.basert_started = time.monotonic()  # type: ignore[attr-defined]
        if request.method == "OPTIONS":
            # A CORS preflight carries no credentials; it is answered (or refused by the browser) without a key.
            response = Response(b"", status=204)
            response.headers["Access-Control-Allow-Methods"] = CORS_ALLOWED_METHODS
            response.headers["Access-Control-Allow-Headers"] = CORS_ALLOWED_HEADERS
            response.headers["Access-Control-Max-Age"] = "600"
            return response
        if state.draining:
            return error_response(unavailable("the server is shutting down", "draining", retry_after=5))
        if request.path == "/health":
            return None
        key = supplied_key()
        if keys:
            given = key.encode("utf-8", errors="surrogateescape")
            if not any(hmac.compare_digest(given, k) for k in keys):
                return error_response(ApiError(401, "invalid or missing API key", type="authentication_error",
                                               code="invalid_api_key"))
        elif request.path.startswith(PROTECTED_PREFIXES) and not is_loopback(request.remote_addr):
            return error_response(ApiError(401, "slot and file endpoints need --api-key when served beyond "
                                           "loopback", type="authentication_error", code="invalid_api_key"))
        if limiter is not None:
            retry_after = limiter.retry_after(key if keys else (request.remote_addr or ""))
            if retry_after is not None:
                return error_response(ApiError(
                    429, f"rate limit of {settings.rate_limit} requests per minute reached",
                    type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(retry_after)}))
        return None

    @app.after_request
    async def finish_response(response: Response) -> Response:
        origin = cors_origin()
        if origin is not None:
            response.headers["Access-Control-Allow-Origin"] = origin
            if origin != "*":
                response.headers["Vary"] = "Origin"
        if not getattr(request, "basert_streamed", False):  # a stream logs itself when it ends
            started = getattr(request, "basert_started", time.monotonic())
            log_request(endpoint_name(), response.status_code, started, getattr(request, "basert_record", None),
                        request.method, request.path)
        return response

    @app.errorhandler(Exception)
    async def handle_error(exc: Exception) -> Response:
        original = getattr(exc, "original_exception", None)
        if isinstance(exc, HTTPException) and original is not None:
            exc = original
        try:
            error = http_error(exc) if isinstance(exc, HTTPException) else to_api_error(exc)
        except Exception as mapping_failure:  # the error path itself must never take a request down
            error = internal_error(mapping_failure)
        return error_response(error)

    def http_error(exc: HTTPException) -> ApiError:
        if exc.code == 404:
            return not_found(f"route {printable(request.method, 16)} {printable(request.path)} not found",
                             "route_not_found")
        if exc.code == 413:
            return ApiError(413, f"request body exceeds {settings.max_body_bytes} bytes", code="request_too_large")
        if exc.code == 405:
            return ApiError(405, f"method {printable(request.method, 16)} not allowed on {printable(request.path)}",
                            code="method_not_allowed")
        if exc.code is None or exc.code >= 500:
            return internal_error(exc)
        return ApiError(exc.code, exc.description or exc.name, code=exc.name.lower().replace(" ", "_"))

    def endpoint_name() -> str:
        """The route pattern (not the concrete path), so metrics labels stay few."""
        rule = request.url_rule
        return rule.rule if rule is not None else "unmatched"

    async def json_body() -> dict:
        return parse_json_object(await request.get_data())

    def finish(endpoint: str, result, record: RequestRecord) -> Response | dict:
        if isinstance(result, dict):
            return result
        started = request.basert_started  # type: ignore[attr-defined]
        method, path = request.method, request.path
        request.basert_streamed = True  # type: ignore[attr-defined]

        async def body() -> AsyncIterator[bytes]:
            try:
                async for piece in result:
                    yield piece
            finally:
                log_request(endpoint, 200, started, record, method, path, streamed=True)

        response = Response(body(), mimetype="text/event-stream")
        response.headers["Cache-Control"] = "no-cache"
        response.timeout = None
        return response

    # --- OpenAI endpoints -----------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions():
        record = RequestRecord()
        request.basert_record = record  # type: ignore[attr-defined]
        body = ChatCompletionRequest.model_validate(await json_body())
        model = catalog.resolve(body.model)
        record.model = model.model_id
        return finish("/v1/chat/completions", await chat_completion(model, body, settings.limits, record), record)

    @app.post("/v1/completions")
    async def completions():
        record = RequestRecord()
        request.basert_record = record  # type: ignore[attr-defined]
        body = CompletionRequest.model_validate(await json_body())
        model = catalog.resolve(body.model)
        record.model = model.model_id
        return finish("/v1/completions", await completion(model, body, settings.limits, record), record)

    def model_object(model: ServedModel) -> dict:
        return {"id": model.model_id, "object": "model", "created": model.created, "owned_by": "basert",
                "meta": {"n_ctx": model.n_ctx, "arch": model.actor.engine.runner.arch,
                         "slots": len(model.actor.engine.lanes)}}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_object(m) for m in catalog.models]}

    @app.get("/v1/models/<path:model_id>")
    async def get_model(model_id: str):
        return model_object(catalog.resolve(model_id))

    @app.post("/v1/tokenize")
    @app.post("/tokenize")
    async def tokenize():
        body = TokenizeRequest.model_validate(await json_body())
        model = catalog.resolve(body.model)
        text = body.content if body.content is not None else body.prompt
        if text is None:
            raise invalid("content is required", "content")
        tokenizer = model.require_tokenizer()
        ids = tokenizer.encode(text, add_special=body.add_special, parse_special=body.parse_special)
        if body.with_pieces:
            return {"tokens": [{"id": i, "piece": tokenizer.token_bytes(i).decode("utf-8", errors="replace")}
                               for i in ids]}
        return {"tokens": ids}

    @app.post("/v1/detokenize")
    @app.post("/detokenize")
    async def detokenize():
        body = DetokenizeRequest.model_validate(await json_body())
        model = catalog.resolve(body.model)
        tokenizer = model.require_tokenizer()
        vocab = model.actor.engine.runner.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise invalid(f"token ids must be in [0, {vocab})", "tokens")
        return {"content": tokenizer.decode(body.tokens)}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_endpoint():
        for model in catalog.models:
            metrics.update_model(await ask(model, Stats))
        return Response(metrics.render(), mimetype="text/plain; version=0.0.4")

    # --- slots ----------------------------------------------------------------------------------
    async def ask(model: ServedModel, message_type: Callable, *args):
        send, receive = trio.open_memory_channel(math.inf)
        await model.actor.mailbox.send(message_type(*args, send))
        async with receive:
            result = await receive.receive()
        if isinstance(result, Exception):
            raise result
        return result

    def slot_model() -> ServedModel:
        return catalog.resolve(request.args.get("model"))

    def slot_id(raw: str) -> int:
        # ASCII digits only: int() also reads "٣" and " 3 " as 3.
        if not SLOT_ID.fullmatch(raw):
            raise invalid(f"slot id must be an integer, got {printable(raw, 32)!r}", "id_slot")
        value = int(raw)
        if value < 0:
            raise not_found(f"slot {value} not found", "slot_not_found")
        return value

    @app.get("/slots")
    async def slots():
        return await ask(slot_model(), SlotList)

    def require_files() -> FilesStore:
        if settings.files is None:
            raise not_supported("slot snapshots and /v1/files need --files-dir DIR")
        return settings.files

    @app.post("/slots/<raw_id>/save")
    async def slot_save(raw_id: str):
        slot = slot_id(raw_id)
        model = slot_model()
        files = require_files()
        body = SlotFileRequest.model_validate(await json_body() if await request.get_data() else {})
        filename = body.filename or f"slot-{slot}.bin"
        # Written inside the store's directory, so handing it to the store is a rename.
        path = files.new_partial_path()
        try:
            result = await ask(model, SlotSave, slot, path)
            stored = await trio.to_thread.run_sync(files.create_from_path, path, filename, SNAPSHOT_PURPOSE)
        finally:
            path.unlink(missing_ok=True)
        return {"object": "slot.snapshot", "id_slot": slot, "file_id": stored.id, "filename": filename,
                "n_saved": result.n_tokens, "n_written": result.n_bytes, "timings": {"save_ms": result.milliseconds}}

    @app.post("/slots/<raw_id>/restore")
    async def slot_restore(raw_id: str):
        slot = slot_id(raw_id)
        model = slot_model()
        files = require_files()
        body = SlotFileRequest.model_validate(await json_body())
        if not body.file_id:
            raise invalid("file_id is required", "file_id")
        path = files.path(body.file_id)
        result = await ask(model, SlotRestore, slot, path)
        return {"object": "slot.snapshot", "id_slot": slot, "file_id": body.file_id, "n_restored": result.n_tokens,
                "n_read": result.n_bytes, "timings": {"restore_ms": result.milliseconds}}

    @app.post("/slots/<raw_id>/erase")
    async def slot_erase(raw_id: str):
        result = await ask(slot_model(), SlotErase, slot_id(raw_id))
        return {"id_slot": result.slot, "n_erased": result.n_tokens}

    @app.post("/slots/<raw_id>")
    async def slot_action(raw_id: str):
        slot = slot_id(raw_id)
        action = request.args.get("action", "")
        if action not in ("save", "restore", "erase"):
            raise invalid(f"action must be save, restore or erase, got {action!r}", "action")
        model = slot_model()
        if action == "erase":
            result = await ask(model, SlotErase, slot)
            return {"id_slot": slot, "n_erased": result.n_tokens}
        if settings.slot_save_path is None:
            raise not_supported("llama.cpp-style slot save/restore needs --slot-save-path DIR")
        body = SlotFileRequest.model_validate(await json_body())
        if not body.filename:
            raise invalid("filename is required", "filename")
        path = safe_child(settings.slot_save_path, body.filename)
        if action == "save":
            result = await ask(model, SlotSave, slot, path)
            return {"id_slot": slot, "filename": body.filename, "n_saved": result.n_tokens,
                    "n_written": result.n_bytes, "timings": {"save_ms": result.milliseconds}}
        if not path.is_file():
            raise not_found(f"snapshot file {body.filename!r} not found", "file_not_found")
        result = await ask(model, SlotRestore, slot, path)
        return {"id_slot": slot, "filename": body.filename, "n_restored": result.n_tokens,
                "n_read": result.n_bytes, "timings": {"restore_ms": result.milliseconds}}

    # --- files ----------------------------------------------------------------------------------
    @app.post("/v1/files")
    async def upload_file():
        files = require_files()
        try:
            # Large parts are spooled to a temporary file while the form is parsed.
            form = await request.form
            uploads = await request.files
        except OSError as exc:
            raise StorageError("file upload", exc) from None
        if "file" not in uploads:
            raise invalid("multipart field 'file' is required", "file")
        upload = uploads["file"]
        content = upload.read()
        stored = await trio.to_thread.run_sync(files.create, content, upload.filename or "upload",
                                               form.get("purpose", "user_data"))
        return stored.to_openai()

    @app.get("/v1/files")
    async def list_files():
        files = require_files()
        return {"object": "list", "data": [f.to_openai() for f in files.list(request.args.get("purpose"))]}

    @app.get("/v1/files/<file_id>")
    async def get_file(file_id: str):
        return require_files().get(file_id).to_openai()

    @app.get("/v1/files/<file_id>/content")
    async def file_content(file_id: str):
        content = await trio.to_thread.run_sync(require_files().content, file_id)
        return Response(content, mimetype="application/octet-stream")

    @app.delete("/v1/files/<file_id>")
    async def delete_file(file_id: str):
        stored = require_files().delete(file_id)
        return {"id": stored.id, "object": "file", "deleted": True}

    return app
