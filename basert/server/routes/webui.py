"""The web pages: a chat page at `/` and a server dashboard at `/dashboard`, static files from `basert/webui/`.

The pages are served without an API key (as llama-server serves its page); every API call they make sends the key.
`--no-webui` turns them off: their paths then answer 404 as any unknown route.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

from quart import Blueprint, Response, request
from werkzeug.exceptions import NotFound

from basert.server.state import server_state

WEBUI_DIR = Path(__file__).resolve().parents[2] / "webui"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
# Revalidated on every load (an ETag answers 304): the files are not versioned by name, so a new server version's
# pages must never be mixed with a cached older script.
CACHE_CONTROL = "no-cache"
# Only the server's own files run or load, and the pages reach only their own server: model output that a renderer
# bug let through as markup still could not run a script or send data elsewhere.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                           "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

webui = Blueprint("webui", __name__)


@dataclass(frozen=True, slots=True)
class StaticFile:
    body: bytes
    content_type: str
    etag: str


@functools.cache
def static_files() -> dict[str, StaticFile]:
    """Every file of the web UI by name, read once (the folder is part of the installed package)."""
    files = {}
    for path in sorted(WEBUI_DIR.iterdir()):
        content_type = CONTENT_TYPES.get(path.suffix)
        if content_type is not None and path.is_file():
            body = path.read_bytes()
            files[path.name] = StaticFile(body, content_type, hashlib.sha256(body).hexdigest()[:32])
    return files


def is_page_path(path: str) -> bool:
    """Whether `path` is one of the web UI's pages or files (served without an API key)."""
    return path in ("/", "/dashboard") or path.startswith("/webui/")


def file_response(name: str) -> Response:
    """The named web UI file (a 404 when the web UI is off or there is no such file); 304 when the client has it."""
    if not server_state().settings.webui:
        raise NotFound()
    static = static_files().get(name)
    if static is None:
        raise NotFound()
    if static.etag in request.if_none_match:
        response = Response(b"", status=304)
    else:
        response = Response(static.body, content_type=static.content_type)
    response.set_etag(static.etag)
    response.headers["Cache-Control"] = CACHE_CONTROL
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    if static.content_type.startswith("text/html"):
        response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    return response


def chat_page_response() -> Response:
    """The chat page: what GET / answers a browser (the root route is Ollama's, see routes/ollama.py)."""
    return file_response("index.html")


@webui.get("/dashboard")
async def dashboard_page():
    return file_response("dashboard.html")


@webui.get("/webui/<name>")
async def webui_file(name: str):
    return file_response(name)
