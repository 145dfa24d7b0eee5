"""BaseRTError: the base of the errors a request can run into, each class declaring the HTTP answer it becomes.

The server builds the OpenAI error envelope from these attributes alone: the layer that detects a problem
defines its error on one of these classes, and the server keeps no list of them. Imports nothing from
basert, so every layer may use it.
"""

from __future__ import annotations


class BaseRTError(Exception):
    """An error that knows its HTTP status, the envelope's `type` and `code`, and the request field at fault.

    Subclasses set the class attributes; an instance may override one with what it knows (a `retry_after`
    computed at the point of refusal). A status of 500 marks a fault of the server, not of the request: the
    client then gets only an error id, and the log gets the traceback.
    """

    status: int = 500
    error_type: str = "server_error"
    code: str = "internal_error"
    param: str | None = None
    retry_after: int | None = None          # seconds, sent as the Retry-After header

    def client_message(self) -> str:
        """The envelope's `message`: the exception's text unless a subclass words it for clients."""
        return str(self)

    def extra(self) -> dict[str, object]:
        """Fields the envelope carries after `message`, `type`, `param` and `code`."""
        return {}


class InvalidRequestError(BaseRTError):
    """The request asks for something this server cannot do as asked (400)."""

    status = 400
    error_type = "invalid_request_error"
    code = "invalid_value"


class NotFoundError(BaseRTError):
    """The request names something that does not exist (404); a subclass's `code` says what kind of thing."""

    status = 404
    error_type = "not_found_error"


class UnavailableError(BaseRTError):
    """The server cannot take the request now; the client may retry after `retry_after` seconds (503).

    A subclass sets `code` (why) and `retry_after`, on the class or on the instance.
    """

    status = 503
    error_type = "unavailable_error"
