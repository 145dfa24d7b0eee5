"""OpenAI's Responses API: create a response (complete or streamed), and read or delete a stored one."""

from __future__ import annotations

from quart import Blueprint

from basert.server.responses_api import create_response
from basert.server.responses_schemas import ResponsesRequest
from basert.server.routes.openai import generation_route
from basert.server.state import server_state

responses = Blueprint("responses", __name__)


@responses.post("/v1/responses")
async def create():
    return await generation_route("/v1/responses", ResponsesRequest, create_response)


@responses.get("/v1/responses/<response_id>")
async def retrieve(response_id: str):
    return server_state().responses.get(response_id).body


@responses.delete("/v1/responses/<response_id>")
async def delete(response_id: str):
    store = server_state().responses
    store.get(response_id)          # a 404 for an unknown id
    store.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
