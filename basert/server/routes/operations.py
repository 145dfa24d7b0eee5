"""Operations: the health check and the Prometheus metrics."""

from __future__ import annotations

from quart import Blueprint, Response

from basert.actor.messages import Stats
from basert.server.errors import not_supported
from basert.server.state import server_state

operations = Blueprint("operations", __name__)


@operations.get("/health")
async def health():
    return {"status": "ok"}


@operations.get("/metrics")
async def metrics():
    state = server_state()
    if not state.settings.metrics_endpoint:
        raise not_supported("the metrics endpoint is off: the server was started with --no-metrics")
    for entry in state.catalog.entries:
        model = state.catalog.hold_loaded(entry)
        state.metrics.set_loaded(entry.name, entry.memory_bytes if model is not None else None)
        if model is not None:
            state.metrics.update_model(await model.ask(Stats))
    return Response(state.metrics.render(), mimetype="text/plain; version=0.0.4")
