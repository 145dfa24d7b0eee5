"""The quart-trio application: the route blueprints, and around every request the guard (browser safety, draining,
auth, rate limit), CORS, the error envelope and the access log."""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
import time
from collections.abc import Iterable
from urllib.parse import urlsplit

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from basert.server.access_log import log_request
from basert.server.catalog import ModelCatalog
from basert.server.errors import ApiError, internal_error, not_found, to_api_error, unavailable
from basert.server.logs import printable
from basert.server.rate_limit import RateLimiter
from basert.server.routes.anthropic import anthropic
from basert.server.routes.embeddings import embeddings
from basert.server.routes.files import files
from basert.server.routes.llama import llama
from basert.server.routes.models import models
from basert.server.routes.ollama import ollama
from basert.server.routes.openai import openai
from basert.server.routes.operations import operations
from basert.server.routes.responses import responses
from basert.server.routes.slots import slots
from basert.server.routes.webui import is_page_path, webui
from basert.server.state import ServerSettings, ServerState, server_state

# Paths that hold other users' data or control the server: without an API key only loopback clients reach them.
PROTECTED_PREFIXES = ("/slots", "/v1/files", "/models/load", "/models/unload")
CORS_ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP token (RFC 9110), as a header name must be
STATE_CHANGING_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# The routes whose documented body is a multipart form rather than JSON.
MULTIPART_ENDPOINTS = frozenset({"files.upload_file"})


def create_app(catalog: ModelCatalog, settings: ServerSettings) -> QuartTrio:
    """The application serving `catalog`'s models."""
    app = QuartTrio("basert")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 600
    limiter = RateLimiter(settings.rate_limit) if settings.rate_limit > 0 else None
    state = ServerState(catalog, settings, api_keys=[k.encode() for k in settings.api_keys], limiter=limiter)
    app.basert_state = state  # type: ignore[attr-defined]
    app.before_request(admit_request)
    app.after_request(finish_response)
    app.register_error_handler(Exception, handle_error)
    for blueprint in (openai, llama, anthropic, ollama, responses, embeddings, slots, files, operations, models,
                      webui):
        app.register_blueprint(blueprint)
    return app


def is_loopback(address: str | None) -> bool:
    if not address:
        return False
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def error_response(error: ApiError) -> Response:
    response = Response(json.dumps(error.body()), status=error.status, mimetype="application/json")
    response.headers.update(error.headers)
    return response


def supplied_key() -> str:
    auth = request.headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("X-Api-Key", "")


def endpoint_name() -> str:
    """The route pattern (not the concrete path), so metrics labels stay few."""
    rule = request.url_rule
    return rule.rule if rule is not None else "unmatched"


async def admit_request() -> Response | None:
    """Refuse what a web page must not do (see browser_refusal); answer CORS preflights; refuse requests while
    draining, without a valid key, or over the rate limit."""
    request.basert_started = time.monotonic()  # type: ignore[attr-defined]
    state = server_state()
    settings = state.settings
    refusal = browser_refusal(settings, bool(state.api_keys))
    if refusal is not None:
        return error_response(refusal)
    if request.method == "OPTIONS":
        # A CORS preflight carries no credentials; it is answered (or refused by the browser) without a key.
        return preflight_response()
    if state.draining:
        return error_response(unavailable("the server is shutting down", "draining", retry_after=5))
    if request.path == "/health":
        return None
    if request.method == "GET" and settings.webui and is_page_path(request.path):
        return None  # the pages themselves, as llama-server's; every API call they make sends the key
    key = supplied_key()
    if state.api_keys:
        given = key.encode("utf-8", errors="surrogateescape")
        if not any(hmac.compare_digest(given, k) for k in state.api_keys):
            return error_response(ApiError(401, "invalid or missing API key", type="authentication_error",
                                           code="invalid_api_key"))
    elif request.path.startswith(PROTECTED_PREFIXES) and not is_loopback(request.remote_addr):
        return error_response(ApiError(401, "slot, file and model admin endpoints need --api-key when "
                                       "served beyond loopback", type="authentication_error", code="invalid_api_key"))
    if state.limiter is not None:
        retry_after = state.limiter.retry_after(key if state.api_keys else (request.remote_addr or ""))
        if retry_after is not None:
            return error_response(ApiError(
                429, f"rate limit of {settings.rate_limit} requests per minute reached",
                type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(retry_after)}))
    return None


def browser_refusal(settings: ServerSettings, keyed: bool) -> ApiError | None:
    """A 403 or 415 for a request that a web page in the user's browser could have sent against the user's will.

    Without an API key, a page could otherwise drive a loopback server: by a cross-site request (refused by its
    Origin, and by its body type for browsers that send no Origin), or by DNS rebinding, which makes the page's
    own name reach this server (refused by the Host header). Clients outside browsers send neither header.
    """
    if not keyed and not names_this_server(request.headers.get("Host"), settings.allowed_hosts):
        return host_not_allowed(request.headers.get("Host", ""))
    origin = request.headers.get("Origin")
    if origin is not None and request.method != "OPTIONS" and not listed_origin(origin, settings) \
            and not same_origin(origin):
        return ApiError(403, f"requests from web pages of {printable(origin, 64)!r} are not allowed: start the "
                        "server with --cors-allow-origin ORIGIN", type="permission_error", code="origin_not_allowed")
    mimetype = request.mimetype
    if request.method in STATE_CHANGING_METHODS and mimetype and not is_json_type(mimetype) \
            and not (mimetype == "multipart/form-data" and request.endpoint in MULTIPART_ENDPOINTS):
        # A form or text/plain body is what a page sends cross-site without asking the browser first.
        expected = "multipart/form-data" if request.endpoint in MULTIPART_ENDPOINTS else "application/json"
        return ApiError(415, f"Content-Type {printable(mimetype, 64)} is not accepted: send {expected}",
                        code="unsupported_media_type")
    return None


def is_json_type(mimetype: str) -> bool:
    """Whether a (lower-case, parameter-free) media type is JSON: application/json or application/*+json."""
    return mimetype == "application/json" or (mimetype.startswith("application/") and mimetype.endswith("+json"))


def names_this_server(host: str | None, allowed_hosts: Iterable[str]) -> bool:
    """Whether a Host header names this server: an IP address, localhost, or one of `allowed_hosts` (--host and
    the --allowed-host names; '*' any).

    Any other name may be an attacker's, rebound in DNS to this machine's address. No Host at all is allowed:
    browsers always send one.
    """
    if not host:
        return True
    try:
        name = (urlsplit("//" + host).hostname or "").rstrip(".")
    except ValueError:
        return False
    allowed = {h.lower().rstrip(".") for h in allowed_hosts}
    if "*" in allowed or name in allowed or name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_not_allowed(host: str) -> ApiError:
    """The 403 for a Host header that does not name this server (a key-less server, or a cluster's ingress)."""
    return ApiError(403, f"Host {printable(host, 64)!r} is not a name of this server: start it with --allowed-host "
                    "NAME (or --api-key)", type="permission_error", code="host_not_allowed")


def listed_origin(origin: str, settings: ServerSettings) -> bool:
    """Whether --cors-allow-origin allows pages of `origin` ('*': any; 'localhost': pages served from this machine)."""
    allowed = settings.cors_origins
    if "*" in allowed or origin in allowed:
        return True
    if "localhost" not in allowed:
        return False
    try:
        name = urlsplit(origin).hostname or ""
    except ValueError:
        return False
    return name == "localhost" or is_loopback(name)


def same_origin(origin: str) -> bool:
    """Whether `origin` is the server's own (a page served under the same host and port, e.g. by a proxy)."""
    netloc = origin.partition("://")[2]
    return bool(netloc) and netloc.lower() == request.headers.get("Host", "").lower()


def preflight_response() -> Response:
    """The answer to a CORS preflight: 200, the methods, and the headers the request asks for.

    The requested headers are echoed rather than answered with '*': browsers never let '*' cover Authorization,
    and read it literally on credentialed requests. '*' remains when none are asked for.
    """
    asked = (name.strip() for name in request.headers.get("Access-Control-Request-Headers", "").split(","))
    response = Response(b"", status=200)
    response.headers["Access-Control-Allow-Methods"] = CORS_ALLOWED_METHODS
    response.headers["Access-Control-Allow-Headers"] = ", ".join(n for n in asked if HEADER_NAME.fullmatch(n)) or "*"
    response.headers["Access-Control-Max-Age"] = "600"
    return response


async def finish_response(response: Response) -> Response:
    """Add the CORS headers, and log the request unless it streams (a stream logs itself when it ends)."""
    state = server_state()
    origin = request.headers.get("Origin")
    if origin is not None and listed_origin(origin, state.settings):
        # The origin itself, never '*': with credentials allowed, browsers accept only the exact origin.
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Allow-Credentials"] = "true"
        response.headers["Vary"] = "Origin"
    if not getattr(request, "basert_streamed", False):
        started = getattr(request, "basert_started", time.monotonic())
        log_request(state.metrics, endpoint_name(), response.status_code, started,
                    getattr(request, "basert_record", None), request.method, request.path)
    return response


async def handle_error(exc: Exception) -> Response:
    """Every exception a request raises, as its OpenAI error envelope."""
    original = getattr(exc, "original_exception", None)
    if isinstance(exc, HTTPException) and original is not None:
        exc = original
    try:
        error = http_error(exc) if isinstance(exc, HTTPException) else to_api_error(exc)
    except Exception as mapping_failure:  # the error path itself must never take a request down
        error = internal_error(mapping_failure)
    return error_response(error)


def http_error(exc: HTTPException) -> ApiError:
    if exc.code == 404:
        return not_found(f"route {printable(request.method, 16)} {printable(request.path)} not found",
                         "route_not_found")
    if exc.code == 413:
        return ApiError(413, f"request body exceeds {server_state().settings.max_body_bytes} bytes",
                        code="request_too_large")
    if exc.code == 405:
        return ApiError(405, f"method {printable(request.method, 16)} not allowed on {printable(request.path)}",
                        code="method_not_allowed")
    if exc.code is None or exc.code >= 500:
        return internal_error(exc)
    return ApiError(exc.code, exc.description or exc.name, code=exc.name.lower().replace(" ", "_"))
