"""ASGI middleware around the app: answers sent before the request body was read, and requests in flight; and
hypercorn's own refusals of malformed HTTP/1.1 requests, in the error envelope.

An early answer (401, 404, 405, 413, or a 400 before the body is read) must not leave a kept-alive
connection dead. On HTTP/1.x the answer waits a moment for the rest of the body; if it is still coming,
the answer says `Connection: close`, so the client opens a new connection for its next request. On HTTP/2
the end of the answer waits until the client has sent its whole body (bounded), because a stream must not
be closed while the client still sends on it.
"""

from __future__ import annotations

import json
from itertools import chain

import h11
import hypercorn.protocol
import trio
from hypercorn.protocol.h11 import H11Protocol

from basert.server.catalog import REQUEST_HOLDS
from basert.server.errors import ApiError

# How long an HTTP/2 answer waits for the rest of a body it does not need.
BODY_DRAIN_SECONDS = 30.0
# How long an HTTP/1.x answer waits for the rest of the body before it closes the connection instead.
BODY_WAIT_HTTP1_SECONDS = 1.0
# What hypercorn refuses before the app sees a request (h11's status hints), as envelope message and code.
PROTOCOL_ERRORS = {431: ("request headers are too large", "request_header_fields_too_large")}


def _declares_body(scope: dict) -> bool:
    for name, value in scope.get("headers", ()):
        name = name.lower()
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"", b"0")):
            return True
    return False


class RequestGuard:
    """Wraps the ASGI app: counts requests in flight, releases the models each held when it ends (its stream
    included), and keeps connections usable after early answers."""

    def __init__(self, app) -> None:
        self.app = app
        self.in_flight = 0
        self._idle = trio.Event()
        self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no request is in flight."""
        await self._idle.wait()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_complete = trio.Event()
        if not _declares_body(scope):
            body_complete.set()
        http1 = scope.get("http_version", "1.1").startswith("1")

        async def tracking_receive():
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                body_complete.set()
            return message

        async def guarded_send(message) -> None:
            if message["type"] == "http.response.start" and http1:
                # Header names as HTTP/1.1 servers usually write them (Access-Control-Allow-Origin): quart writes
                # them in lower case, and some clients (llama.cpp's tests) look them up case-sensitively. HTTP/2
                # names must stay lower case.
                message = {**message, "headers": [(name.title(), value) for name, value in message.get("headers", ())]}
            if message["type"] == "http.response.start" and http1 and not body_complete.is_set():
                # The app reads the rest of the body in the background: a short one arrives at once.
                with trio.move_on_after(BODY_WAIT_HTTP1_SECONDS):
                    await body_complete.wait()
                if not body_complete.is_set():
                    message = {**message, "headers": [*message["headers"], (b"Connection", b"close")]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False) and not http1:
                with trio.move_on_after(BODY_DRAIN_SECONDS):
                    await body_complete.wait()
            await send(message)

        self.in_flight += 1
        self._idle = trio.Event() if self.in_flight == 1 else self._idle
        holds: list = []   # the models this request holds (the tasks serving it share the list)
        token = REQUEST_HOLDS.set(holds)
        try:
            await self.app(scope, tracking_receive, guarded_send)
        finally:
            REQUEST_HOLDS.reset(token)
            for release in holds:
                release()
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()


class EnvelopeH11Protocol(H11Protocol):
    """hypercorn's HTTP/1.1 protocol, whose own refusals (headers beyond h11_max_incomplete_size: 431; a request
    that is not HTTP: 400) carry the error envelope as every other answer does, not an empty body."""

    async def _send_error_response(self, status_code: int) -> None:
        message, code = PROTOCOL_ERRORS.get(status_code, ("malformed HTTP request", "bad_http_request"))
        body = json.dumps(ApiError(status_code, message, code=code).body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        await self._send_h11_event(h11.Response(status_code=status_code,
                                                headers=list(chain(headers, self.config.response_headers("h11")))))
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())


def use_envelope_protocol_errors() -> None:
    """Make hypercorn's HTTP/1.1 connections answer with EnvelopeH11Protocol (its connection wrapper builds the
    protocol by this module-level name; hypercorn has no setting for it)."""
    hypercorn.protocol.H11Protocol = EnvelopeH11Protocol
