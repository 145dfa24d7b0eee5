"""Embeddings: /v1/embeddings and /embeddings (llama.cpp's name), in OpenAI's request and response shapes.

The vectors are the model's last hidden states pooled as the server was started with (`--pooling`) and
L2-normalised, computed by the model's actor between generation steps.
"""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np
from pydantic import Field, StrictInt, StrictStr
from quart import Blueprint, request

from basert.actor.messages import Embed
from basert.server.access_log import RequestRecord
from basert.server.catalog import ServedModel
from basert.server.errors import invalid
from basert.server.json_input import request_json
from basert.server.schemas import Lenient
from basert.server.state import server_state

embeddings = Blueprint("embeddings", __name__)

MAX_INPUTS = 2048   # inputs per request, as OpenAI allows

EmbeddingInput = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class EmbeddingRequest(Lenient):
    """OpenAI's embeddings request: text, texts, token ids or lists of token ids."""

    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)   # only the model's own width: vectors are never cut


def input_token_lists(model: ServedModel, value: EmbeddingInput) -> list[list[int]]:
    """Each input as token ids; text is tokenized as a completion prompt is (no BOS added)."""
    if isinstance(value, str):
        texts = [value]
    elif value and all(isinstance(item, int) for item in value):
        return [list(value)]
    elif all(isinstance(item, str) for item in value):
        texts = value
    else:
        return [list(item) for item in value]
    tokenizer = model.require_tokenizer()
    return [tokenizer.encode(text) for text in texts]


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """A vector as JSON floats, or as base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


@embeddings.post("/v1/embeddings")
@embeddings.post("/embeddings")
async def create_embeddings():
    record = RequestRecord()
    request.basert_record = record  # type: ignore[attr-defined]
    body = EmbeddingRequest.model_validate(await request_json())
    model = await server_state().catalog.acquire(body.model)
    record.model = model.info.id
    if body.dimensions is not None and body.dimensions != model.info.hidden_size:
        raise invalid(f"dimensions must be {model.info.hidden_size}, the width of {model.info.id}'s hidden "
                      "states (they are not truncated)", "dimensions")
    token_lists = input_token_lists(model, body.input)
    if len(token_lists) > MAX_INPUTS:
        raise invalid(f"input has {len(token_lists)} items; at most {MAX_INPUTS} are allowed", "input")
    record.prompt_tokens = sum(len(tokens) for tokens in token_lists)
    vectors = await model.ask(Embed, token_lists, model.info.pooling)
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": index, "embedding": encoded(vector, body.encoding_format)}
                 for index, vector in enumerate(vectors)],
        "model": model.info.id,
        "usage": {"prompt_tokens": record.prompt_tokens, "total_tokens": record.prompt_tokens},
    }
