"""Embeddings: /v1/embeddings and /embeddings."""

from __future__ import annotations

from quart import Blueprint

embeddings = Blueprint("embeddings", __name__)
