"""The OpenAI error envelope, and the one place that maps every exception to it."""

from __future__ import annotations

import logging

from pydantic import ValidationError

log = logging.getLogger("basert.server")


class ApiError(Exception):
    """An error with its HTTP status and envelope fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | int | None = None, param: str | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.extra = extra or {}

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


def to_api_error(exc: BaseException) -> ApiError:
    """Map any exception raised while serving a request to its envelope (unknown ones are 500s)."""
    from basert.actor.actor import SlotNotFoundError
    from basert.chat.grammar import GrammarError
    from basert.chat.template import ChatTemplateError
    from basert.engine.engine import KVCacheTooSmallError
    from basert.engine.kv import OutOfBlocksError
    from basert.engine.runner import ContextOverflowError
    from basert.engine.sampler import SamplingError
    from basert.engine.snapshot import SnapshotError
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
    if isinstance(exc, SlotNotFoundError):
        return not_found(str(exc), "slot_not_found")
    if isinstance(exc, FileNotFoundInStoreError):
        return not_found(str(exc), "file_not_found")
    if isinstance(exc, (SnapshotError, UnsafeFilenameError, StoreFullError, KVCacheTooSmallError)):
        return invalid(str(exc))
    if isinstance(exc, OutOfBlocksError):
        return ApiError(503, f"the KV cache is full ({exc}); retry when running requests finish",
                        type="unavailable_error", code="kv_cache_full")
    log.exception("internal error", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error", code="internal_error")
