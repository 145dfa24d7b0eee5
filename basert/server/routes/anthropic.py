"""Anthropic's Messages API: /v1/messages and /v1/messages/count_tokens, whose errors use Anthropic's envelope."""

from __future__ import annotations

import json

from quart import Blueprint, Response, request

from basert.server.anthropic_api import count_tokens, create_message, error_body
from basert.server.anthropic_schemas import MessagesInput, MessagesRequest
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


@anthropic.after_app_request
async def anthropic_error_envelope(response: Response) -> Response:
    """Rewrite the server's error envelope under /v1/messages (however the error arose: a refusal before the route,
    an exception in it, a method or path no route has) as Anthropic's, keeping the status, so that Anthropic
    clients read the error's type and message."""
    # By path, not by blueprint: a 404 or 405 matched no route, so no blueprint's hook would run.
    if not (request.path == "/v1/messages" or request.path.startswith("/v1/messages/")):
        return response
    if response.status_code < 400 or response.mimetype != "application/json":
        return response
    error = json.loads(await response.get_data()).get("error")
    if isinstance(error, dict):
        response.set_data(json.dumps(error_body(response.status_code, str(error.get("message", "")))))
    return response
