"""Anthropic's Messages API: /v1/messages and /v1/messages/count_tokens."""

from __future__ import annotations

from quart import Blueprint

anthropic = Blueprint("anthropic", __name__)
