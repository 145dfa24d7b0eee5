"""llama.cpp's native routes (llama-server's contract): /completion, /props, /apply-template and the
route names without /v1."""

from __future__ import annotations

from quart import Blueprint

llama = Blueprint("llama", __name__)
