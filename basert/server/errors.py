"""The OpenAI error envelope, and the one place that maps every exception to it."""

from __future__ import annotations

import logging
import uuid

from pydantic import ValidationError

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
    from basert.actor.actor import QueueTimeoutError, ServerBusyError, SlotNotFoundError, SlotOutOfRangeError
    from basert.chat.grammar import GrammarError
    from basert.chat.template import ChatTemplateError
    from basert.engine.engine import KVCacheTooSmallError
    from basert.engine.kv import OutOfBlocksError
    from basert.engine.runner import ContextOverflowError
    from basert.engine.sampler import SamplingError
    from basert.engine.snapshot import SnapshotError
    from basert.format.atomic import StorageError
    from basert.server.files import FileNotFoundInStoreError, StoreFullError, UnsafeFilenameError
    from basert.tokenizer import TokenizerError

    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        return invalid(f"{param}: {first.get('msg', 'invalid value')}" if param else str(exc), param)
    if isinstance(exc, ContextOverflowError):
        return ApiError(400, f"This model's maximum context length is {exc.n_ctx} tokens; the request has "
                        f"{exc.n_tokens} prompt tokens.", code="context_length_exceeded", param="messages",
                        extra={"n_prompt_tokens": exc.n_tokens, "n_ctx": exc.n_ctx})
    if isinstance(exc, (SamplingError, GrammarError, ChatTemplateError, TokenizerError)):
        return invalid(str(exc))
    if isinstance(exc, SlotOutOfRangeError):
        return invalid(str(exc), "id_slot")
    if isinstance(exc, ServerBusyError):
        return unavailable(str(exc), "server_busy", exc.retry_after)
    if isinstance(exc, QueueTimeoutError):
        return unavailable(str(exc), "queue_timeout", exc.retry_after)
    if isinstance(exc, StorageError):
        return ApiError(507, str(exc), type="server_error", code="insufficient_storage")
    if isinstance(exc, SlotNotFoundError):
        return not_found(str(exc), "slot_not_found")
    if isinstance(exc, FileNotFoundInStoreError):
        return not_found(str(exc), "file_not_found")
    if isinstance(exc, (SnapshotError, UnsafeFilenameError, StoreFullError, KVCacheTooSmallError)):
        return invalid(str(exc))
    if isinstance(exc, OutOfBlocksError):
        return unavailable(f"the KV cache is full ({exc}); retry when running requests finish", "kv_cache_full", 1)
    return internal_error(exc)
