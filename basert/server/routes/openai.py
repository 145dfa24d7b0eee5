"""The OpenAI endpoints: chat completions, completions, models, and tokenize / detokenize."""

from __future__ import annotations

from collections.abc import AsyncIterator

from quart import Blueprint, Response, request

from basert.server.access_log import RequestRecord, log_request
from basert.server.catalog import ModelEntry
from basert.server.errors import invalid
from basert.server.json_input import request_json
from basert.server.openai_api import chat_completion, completion
from basert.server.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from basert.server.state import server_state

openai = Blueprint("openai", __name__)


def finish(endpoint: str, result: dict | list | AsyncIterator[bytes], record: RequestRecord) -> Response | dict | list:
    """The response for a generation: its JSON value (an object, or a list of them), or an SSE stream that writes
    its access-log line at its end."""
    if isinstance(result, (dict, list)):
        return result
    metrics = server_state().metrics
    started = request.basert_started  # type: ignore[attr-defined]
    method, path = request.method, request.path
    request.basert_streamed = True  # type: ignore[attr-defined]

    async def body() -> AsyncIterator[bytes]:
        try:
            async for piece in result:
                yield piece
        finally:
            log_request(metrics, endpoint, 200, started, record, method, path, streamed=True)

    response = Response(body(), mimetype="text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    response.timeout = None
    return response


async def generation_route(endpoint: str, schema, handler):
    """Validate the body with `schema`, resolve its model, and answer with `handler`'s response or stream."""
    state = server_state()
    record = RequestRecord()
    request.basert_record = record  # type: ignore[attr-defined]
    body = schema.model_validate(await request_json())
    model = await state.catalog.acquire(body.model)
    record.model = model.info.id
    return finish(endpoint, await handler(model, body, state.settings.limits, record), record)


@openai.post("/v1/chat/completions")
@openai.post("/chat/completions")
async def chat_completions():
    return await generation_route("/v1/chat/completions", ChatCompletionRequest, chat_completion)


@openai.post("/v1/completions")
async def completions():
    return await generation_route("/v1/completions", CompletionRequest, completion)


def model_object(entry: ModelEntry) -> dict:
    """A servable model as /v1/models lists it: OpenAI's fields, its load state (as llama-server's router reports
    it) and, when loaded, its context, architecture and slots."""
    model = entry.served
    status: dict = {"value": entry.state}
    if entry.state == "loaded":
        status["memory_bytes"] = entry.memory_bytes
        status["expires_at"] = entry.expires_at_wall()
    body = {"id": entry.name, "object": "model", "created": model.created if model else file_time(entry),
            "owned_by": "basert", "aliases": sorted(entry.aliases - {entry.name}), "status": status}
    if model is not None:
        body["meta"] = {"n_ctx": model.info.n_ctx, "arch": model.info.arch, "slots": model.info.n_slots}
    return body


def file_time(entry: ModelEntry) -> int:
    try:
        return int(entry.path.stat().st_mtime) if entry.path is not None else 0
    except OSError:
        return 0


@openai.get("/v1/models")
@openai.get("/models")
async def list_models():
    return {"object": "list", "data": [model_object(e) for e in server_state().catalog.entries]}


@openai.get("/v1/models/<path:model_id>")
async def get_model(model_id: str):
    return model_object(server_state().catalog.entry(model_id))


@openai.post("/v1/tokenize")
@openai.post("/tokenize")
async def tokenize():
    body = TokenizeRequest.model_validate(await request_json())
    model = await server_state().catalog.acquire(body.model)
    text = body.content if body.content is not None else body.prompt
    if text is None:
        raise invalid("content is required", "content")
    tokenizer = model.require_tokenizer()
    ids = tokenizer.encode(text, add_special=body.add_special, parse_special=body.parse_special)
    if body.with_pieces:
        return {"tokens": [{"id": i, "piece": tokenizer.token_bytes(i).decode("utf-8", errors="replace")}
                           for i in ids]}
    return {"tokens": ids}


@openai.post("/v1/detokenize")
@openai.post("/detokenize")
async def detokenize():
    body = DetokenizeRequest.model_validate(await request_json())
    model = await server_state().catalog.acquire(body.model)
    tokenizer = model.require_tokenizer()
    vocab = model.info.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise invalid(f"token ids must be in [0, {vocab})", "tokens")
    return {"content": tokenizer.decode(body.tokens)}
