"""The quart-trio application: the route blueprints, and around every request the guard (draining, auth,
rate limit), CORS, the error envelope and the access log."""

from __future__ import annotations

import hmac
import ipaddress
import json
import time

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
from basert.server.routes.openai import openai
from basert.server.routes.operations import operations
from basert.server.routes.responses import responses
from basert.server.routes.slots import slots
from basert.server.state import ServerSettings, ServerState, server_state

# Paths that hold other users' data or control the server: without an API key only loopback clients reach them.
PROTECTED_PREFIXES = ("/slots", "/v1/files")
CORS_ALLOWED_HEADERS = "Authorization, Content-Type, X-Api-Key, anthropic-version, anthropic-beta"
CORS_ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"


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
    for blueprint in (openai, llama, anthropic, responses, embeddings, slots, files, operations):
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


def cors_origin(settings: ServerSettings) -> str | None:
    """The Access-Control-Allow-Origin value for this request, or None."""
    origin = request.headers.get("Origin")
    if not origin or not settings.cors_origins:
        return None
    if "*" in settings.cors_origins:
        return "*"
    return origin if origin in settings.cors_origins else None


def endpoint_name() -> str:
    """The route pattern (not the concrete path), so metrics labels stay few."""
    rule = request.url_rule
    return rule.rule if rule is not None else "unmatched"


async def admit_request() -> Response | None:
    """Answer CORS preflights; refuse requests while draining, without a valid key, or over the rate limit."""
    request.basert_started = time.monotonic()  # type: ignore[attr-defined]
    if request.method == "OPTIONS":
        # A CORS preflight carries no credentials; it is answered (or refused by the browser) without a key.
        response = Response(b"", status=204)
        response.headers["Access-Control-Allow-Methods"] = CORS_ALLOWED_METHODS
        response.headers["Access-Control-Allow-Headers"] = CORS_ALLOWED_HEADERS
        response.headers["Access-Control-Max-Age"] = "600"
        return response
    state = server_state()
    if state.draining:
        return error_response(unavailable("the server is shutting down", "draining", retry_after=5))
    if request.path == "/health":
        return None
    settings = state.settings
    key = supplied_key()
    if state.api_keys:
        given = key.encode("utf-8", errors="surrogateescape")
        if not any(hmac.compare_digest(given, k) for k in state.api_keys):
            return error_response(ApiError(401, "invalid or missing API key", type="authentication_error",
                                           code="invalid_api_key"))
    elif request.path.startswith(PROTECTED_PREFIXES) and not is_loopback(request.remote_addr):
        return error_response(ApiError(401, "slot and file endpoints need --api-key when served beyond "
                                       "loopback", type="authentication_error", code="invalid_api_key"))
    if state.limiter is not None:
        retry_after = state.limiter.retry_after(key if state.api_keys else (request.remote_addr or ""))
        if retry_after is not None:
            return error_response(ApiError(
                429, f"rate limit of {settings.rate_limit} requests per minute reached",
                type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(retry_after)}))
    return None


async def finish_response(response: Response) -> Response:
    """Add the CORS headers, and log the request unless it streams (a stream logs itself when it ends)."""
    state = server_state()
    origin = cors_origin(state.settings)
    if origin is not None:
        response.headers["Access-Control-Allow-Origin"] = origin
        if origin != "*":
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
