"""Model admin, as llama-server's router names it: load a servable model now, or unload a loaded one."""

from __future__ import annotations

from quart import Blueprint

from basert.server.errors import ApiError
from basert.server.json_input import request_json
from basert.server.routes.openai import model_object
from basert.server.schemas import ModelActionRequest
from basert.server.state import server_state

models = Blueprint("models", __name__)


@models.post("/models/load")
async def load_model():
    """Load the model (waiting, like a request, for room within --queue-timeout); it then stays loaded for its
    keep-alive (the request's, else the server's) as after a request."""
    body = ModelActionRequest.model_validate(await request_json())
    catalog = server_state().catalog
    entry = catalog.entry(body.model)
    await catalog.acquire(entry.name, body.keep_alive, strict=True)
    return {"success": True, "model": model_object(entry)}


@models.post("/models/unload")
async def unload_model():
    """Unload the model now; a 409 while requests hold it (unload it when they end: a keep_alive of 0)."""
    body = ModelActionRequest.model_validate(await request_json())
    catalog = server_state().catalog
    entry = catalog.entry(body.model)
    if entry.holds:
        raise ApiError(409, f"model {entry.name} is in use by {entry.holds} request(s)", code="model_in_use")
    unloaded = await catalog.unload(entry)
    return {"success": True, "unloaded": unloaded, "model": model_object(entry)}
