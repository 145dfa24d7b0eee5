"""OpenAI's Responses API: /v1/responses."""

from __future__ import annotations

from quart import Blueprint

responses = Blueprint("responses", __name__)
