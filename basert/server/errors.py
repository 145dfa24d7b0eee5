"""The OpenAI error envelope, and the one place that maps every exception to it."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable

from pydantic import ValidationError
from quart import Response, request

from basert.errors import BaseRTError

log = logging.getLogger("basert.server")


class ApiError(Exception):
    """An error with its HTTP status and envelope fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | int | None = None, param: str | None = None, extra: dict | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.extra = extra or {}
        self.headers = headers or {}

    def body(self) -> dict:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        error.update(self.extra)
        return {"error": error}


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def not_found(message: str, code: str) -> ApiError:
    return ApiError(404, message, type="not_found_error", code=code)


def not_supported(message: str) -> ApiError:
    return ApiError(501, message, type="not_supported_error", code="not_supported")


def unavailable(message: str, code: str, retry_after: int) -> ApiError:
    """A 503: the server cannot take the request now; the client may retry after `retry_after` seconds."""
    return ApiError(503, message, type="unavailable_error", code=code, headers={"Retry-After": str(retry_after)})


def internal_error(exc: BaseException) -> ApiError:
    """A 500 for a server bug: the log has the traceback under an id; the client gets only the id."""
    error_id = f"err-{uuid.uuid4().hex[:16]}"
    log.error("internal error %s", error_id, exc_info=exc)
    return ApiError(500, f"internal server error (id {error_id}); the server log has the details",
                    type="server_error", code="internal_error", extra={"error_id": error_id})


def to_api_error(exc: BaseException) -> ApiError:
    """Map any exception raised while serving a request to its envelope (unknown ones are 500s)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        return invalid(f"{param}: {first.get('msg', 'invalid value')}" if param else str(exc), param)
    if isinstance(exc, BaseRTError):
        return declared_error(exc)
    return internal_error(exc)


def declared_error(exc: BaseRTError) -> ApiError:
    """The envelope an error declares through its class attributes; a declared 500 is a server fault."""
    if exc.status == 500:
        return internal_error(exc)
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else {}
    return ApiError(exc.status, exc.client_message(), type=exc.error_type, code=exc.code, param=exc.param,
                    extra=exc.extra(), headers=headers)


def envelope_rewriter(prefix: str, body_of: Callable[[int, str], dict]) -> Callable[[Response], Awaitable[Response]]:
    """An after-request hook that rewrites the error envelope of every answer under `prefix` (the path itself, or
    below it) as `body_of(status, message)`, keeping the status and headers, for an API whose clients read another
    vendor's error shape. By path, not by blueprint: a refusal before the route, or a 404 or 405 that matched no
    route, reaches no blueprint's hook."""

    async def rewrite(response: Response) -> Response:
        if not (request.path == prefix or request.path.startswith(prefix + "/")):
            return response
        if response.status_code < 400 or response.mimetype != "application/json":
            return response
        error = json.loads(await response.get_data()).get("error")
        if isinstance(error, dict):
            response.set_data(json.dumps(body_of(response.status_code, str(error.get("message", "")))))
        return response

    return rewrite
