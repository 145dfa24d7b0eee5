"""llama.cpp's native routes (llama-server's contract): /completion (and /completions, as llama-server routes it),
/props, /apply-template and the prompt size of a chat request."""

from __future__ import annotations

from quart import Blueprint, request

from basert.server.errors import not_supported
from basert.server.json_input import request_json
from basert.server.llama_api import chat_input_tokens, native_completion, props, rendered_chat
from basert.server.routes.openai import generation_route
from basert.server.schemas import ChatCompletionRequest, LlamaCompletionRequest
from basert.server.state import server_state

llama = Blueprint("llama", __name__)


@llama.post("/completion")
@llama.post("/completions")
async def completion():
    """A result object, a list of them (several prompts), or llama.cpp's SSE stream."""
    return await generation_route("/completion", LlamaCompletionRequest, native_completion)


@llama.get("/props")
async def get_props():
    state = server_state()
    return props(await state.catalog.acquire(request.args.get("model")), state.settings.limits)


@llama.post("/props")
async def change_props():
    raise not_supported("this server's properties cannot be changed through POST /props")


@llama.post("/apply-template")
async def apply_template():
    body = ChatCompletionRequest.model_validate(await request_json())
    return rendered_chat(await server_state().catalog.acquire(body.model), body)


@llama.post("/chat/completions/input_tokens")
@llama.post("/v1/chat/completions/input_tokens")
async def input_tokens():
    body = ChatCompletionRequest.model_validate(await request_json())
    return chat_input_tokens(await server_state().catalog.acquire(body.model), body)
