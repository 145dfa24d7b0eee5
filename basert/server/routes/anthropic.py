"""Anthropic's Messages API: /v1/messages and /v1/messages/count_tokens, whose errors use Anthropic's envelope."""

from __future__ import annotations

from quart import Blueprint

from basert.server.anthropic_api import count_tokens, create_message, error_body
from basert.server.anthropic_schemas import MessagesInput, MessagesRequest
from basert.server.errors import envelope_rewriter
from basert.server.json_input import request_json
from basert.server.routes.openai import generation_route
from basert.server.state import server_state

anthropic = Blueprint("anthropic", __name__)


@anthropic.post("/v1/messages")
async def messages():
    return await generation_route("/v1/messages", MessagesRequest, create_message)


@anthropic.post("/v1/messages/count_tokens")
async def count_message_tokens():
    body = MessagesInput.model_validate(await request_json())
    return count_tokens(await server_state().catalog.acquire(body.model), body)


# Anthropic clients read the error's type and message from Anthropic's envelope, whatever the status.
anthropic.after_app_request(envelope_rewriter("/v1/messages", error_body))
