"""What every route of a server shares: the served models, the settings, the metrics and the draining flag.

`create_app` puts one ServerState on the application; route handlers reach it with `server_state()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from quart import current_app

from basert.server.catalog import ModelCatalog
from basert.server.errors import not_supported
from basert.server.files import FilesStore
from basert.server.generation import ServerLimits
from basert.server.metrics import ServerMetrics
from basert.server.rate_limit import RateLimiter
from basert.server.response_store import ResponseStore


@dataclass(slots=True)
class ServerSettings:
    api_keys: list[str] = field(default_factory=list)
    limits: ServerLimits = field(default_factory=ServerLimits)
    files: FilesStore | None = None
    slot_save_path: Path | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    cors_origins: list[str] = field(default_factory=list)   # '*' any origin, 'localhost' pages on this machine
    allowed_hosts: list[str] = field(default_factory=list)  # Host names answered without a key (besides IPs, localhost)
    rate_limit: int = 0                      # requests per minute per API key (or client address); 0 = off
    slots_endpoint: bool = True              # GET /slots (off: 501, as llama.cpp's --no-slots)
    metrics_endpoint: bool = True            # GET /metrics (off: 501, as llama.cpp without --metrics)
    webui: bool = True                       # the chat page at / and the dashboard (off: 404, as --no-webui)


@dataclass(slots=True)
class ServerState:
    """The state of one server; set `draining` and new requests are refused with a 503."""

    catalog: ModelCatalog
    settings: ServerSettings
    api_keys: list[bytes] = field(default_factory=list)  # settings.api_keys encoded, for constant-time compares
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    limiter: RateLimiter | None = None
    responses: ResponseStore = field(default_factory=ResponseStore)   # for previous_response_id
    draining: bool = False

    def files(self) -> FilesStore:
        """The files store, or a 501 saying which flag enables it."""
        if self.settings.files is None:
            raise not_supported("slot snapshots and /v1/files need --files-dir DIR")
        return self.settings.files


def server_state() -> ServerState:
    """The state of the application serving the current request."""
    return current_app.basert_state  # type: ignore[attr-defined]
