"""The cluster's two Ray Serve deployments: replicas that each run a `basert serve`, and the ingress before them.

`BaseRTReplica` starts an ordinary `basert serve` (its trio actors, one per model, unchanged) as a child process
on a loopback port and relays requests to it over HTTP. A child process rather than the server embedded in
the replica: trio and Ray's asyncio loop each keep a process of their own, the engine's threads never share a
GIL with Ray's, and a server that dies fails the replica's health check, so Ray replaces the replica as it
replaces any failed one. The child drains and exits when its replica's process does (`--exit-with-parent`).

`BaseRTIngress` takes HTTP from Ray Serve's proxy, works out each request's route (its prompt's block keys,
or the replica the client names with `?replica=K` or an `X-BaseRT-Replica: K` header), and streams the answer
of the replica the router picks, with `X-BaseRT-Replica` saying which. `GET /metrics`, `GET /slots` and
`GET /cluster` gather every replica's. A replica that fails under a request answers it with a 503 the client
may retry.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode

import httpx

from basert.cluster.metrics import merge_replica_metrics
from basert.cluster.prompts import PromptKeys, PromptModel
from basert.cluster.routing import Route
from basert.local_server import free_port, wait_healthy
from basert.server.app import PROTECTED_PREFIXES, host_not_allowed, is_loopback, names_this_server
from basert.server.errors import ApiError, invalid, unavailable

REPLICA_HEADER = "x-basert-replica"
ROUTE_TIMEOUT_S = 60.0          # a request no replica takes within this gets a 503
ADMIN_TIMEOUT_S = 10.0          # one replica's answer to /metrics, /slots or /cluster
HOP_BY_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade"})
FROM_PROXY = frozenset({"date", "server"})      # Ray Serve's proxy writes its own


@dataclass(frozen=True, slots=True)
class ForwardedRequest:
    """An HTTP request as the ingress passes it to a replica."""

    method: str
    path: str
    query: str
    headers: tuple[tuple[str, str], ...]
    body: bytes


@dataclass(frozen=True, slots=True)
class Accepted:
    """A replica's first message for a request: it has it (routing is over)."""

    replica: int


@dataclass(frozen=True, slots=True)
class ResponseHead:
    status: int
    headers: tuple[tuple[str, str], ...]


class ServerGone(Exception):
    """A replica's `basert serve` stopped answering."""


class BaseRTReplica:
    """One replica: a supervised `basert serve` of the cluster's models on a loopback port."""

    def __init__(self, models: list[str], serve_args: list[str], threads: int, start_timeout_s: float = 600.0):
        from ray import serve

        context = serve.get_replica_context()
        self.rank = context.rank.rank
        self.replica_id = context.replica_id.unique_id
        self.port = free_port()
        model_args = [models[0]] + [arg for extra in models[1:] for arg in ("--model", extra)]
        argv = [sys.executable, "-m", "basert", "serve", *model_args, *serve_args, "--host", "127.0.0.1",
                "--port", str(self.port), "--threads", str(threads), "--replica", str(self.rank), "--exit-with-parent"]
        self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        self._wait_until_serving(start_timeout_s)
        self.client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.port}", timeout=None)

    def _wait_until_serving(self, timeout_s: float) -> None:
        if wait_healthy(f"http://127.0.0.1:{self.port}", timeout_s, lambda: self.process.poll() is None):
            return
        if self.process.poll() is not None:
            raise RuntimeError(f"replica {self.rank}: basert serve exited with status {self.process.returncode} "
                               "before serving (its log is in this replica's log)")
        self.process.kill()
        raise RuntimeError(f"replica {self.rank}: basert serve did not answer within {timeout_s:.0f} s")

    def record_replica_metadata(self) -> dict:
        """What the router knows this replica by."""
        return {"rank": self.rank}

    def check_health(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"replica {self.rank}: basert serve exited with status {self.process.returncode}")

    async def forward(self, request: ForwardedRequest, route: Route) -> AsyncIterator[Accepted | ResponseHead | bytes]:
        """Accepted, then the server's status and headers, then its body as it comes.

        `route` is for the router, which reads it from the call's arguments.
        """
        yield Accepted(self.rank)
        url = request.path + (f"?{request.query}" if request.query else "")
        try:
            async with self.client.stream(request.method, url, headers=list(request.headers),
                                          content=request.body) as response:
                yield ResponseHead(response.status_code, tuple(
                    (name.lower(), value) for name, value in response.headers.multi_items()
                    if name.lower() not in HOP_BY_HOP | FROM_PROXY))
                async for chunk in response.aiter_raw():
                    yield chunk
        except httpx.TransportError as exc:
            raise ServerGone(f"replica {self.rank}'s server stopped answering ({type(exc).__name__})") from None

    def info(self, route: Route) -> dict:
        """This replica's identity, for GET /cluster."""
        return {"replica": self.rank, "replica_id": self.replica_id, "pid": os.getpid(),
                "server_pid": self.process.pid, "port": self.port}

    def __del__(self) -> None:
        process = getattr(self, "process", None)
        if process is not None and process.poll() is None:
            process.terminate()     # drains: running requests finish, the prefix cache is saved
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


class BaseRTIngress:
    """The cluster's HTTP entry: routes each request to a replica and streams its answer back."""

    def __init__(self, replicas, models: list[str], n_replicas: int, template_file: str | None = None,
                 alias: str | None = None, max_body_bytes: int = 32 * 1024 * 1024, api_keys: bool = False,
                 allowed_hosts: list[str] | None = None):
        self.replicas = replicas
        self.api_keys = api_keys
        self.allowed_hosts = allowed_hosts or []
        self.n_replicas = n_replicas
        self.max_body_bytes = max_body_bytes
        template = Path(template_file) if template_file else None
        self.prompts = PromptKeys([PromptModel.open(Path(path), template_file=template, alias=alias if i == 0 else None)
                                   for i, path in enumerate(models)])
        self.served: Counter[int] = Counter()

    async def __call__(self, request):
        from starlette.responses import JSONResponse

        try:
            replica = requested_replica(request.query_params.get("replica"), request.headers.get(REPLICA_HEADER),
                                        self.n_replicas)
            path = request.url.path
            client = request.client.host if request.client else None
            # The replicas see every request come from loopback, with their own address as its Host: without keys,
            # the ingress applies their rules on the client and on the Host header (DNS rebinding) for them.
            if not self.api_keys and not names_this_server(request.headers.get("host"), self.allowed_hosts):
                raise host_not_allowed(request.headers.get("host", ""))
            if not self.api_keys and path.startswith(PROTECTED_PREFIXES) and not is_loopback(client):
                raise ApiError(401, "slot and file endpoints need --api-key when served beyond loopback",
                               type="authentication_error", code="invalid_api_key")
            if request.method == "GET" and replica is None:
                if path == "/cluster":
                    return JSONResponse(await self.cluster_status())
                if path == "/metrics":
                    return await self.gathered_metrics(request)
                if path == "/slots":
                    return await self.gathered_slots(request)
            if path.startswith("/slots") and replica is None:
                raise invalid(f"slot actions address one replica: add ?replica=K (K = 0..{self.n_replicas - 1})",
                              "replica")
            body = await self.read_body(request)
        except ApiError as exc:
            return error_response(exc)
        keys = self.prompts.keys(path, body) if request.method == "POST" else ()
        return await self.relay(forwarded(request, body), Route(keys, replica))

    async def read_body(self, request) -> bytes:
        """The request body, refused (413, as the replicas' servers would) once it exceeds their limit: the
        ingress holds a body whole before it routes it, so an unbounded one must not be read."""
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise ApiError(413, f"request body exceeds {self.max_body_bytes} bytes", code="request_too_large")
            parts.append(chunk)
        return b"".join(parts)

    async def relay(self, request: ForwardedRequest, route: Route):
        from ray.exceptions import RayError
        from starlette.responses import StreamingResponse

        stream = self.replicas.options(stream=True).forward.remote(request, route=route)
        try:
            accepted = await asyncio.wait_for(stream.__anext__(), ROUTE_TIMEOUT_S)
            head = await stream.__anext__()
        except asyncio.TimeoutError:
            stream.cancel()
            where = "no replica" if route.replica is None else f"replica {route.replica}"
            return error_response(unavailable(f"{where} took the request within {ROUTE_TIMEOUT_S:.0f} s; retry later",
                                              "replica_unavailable", retry_after=5))
        except (RayError, StopAsyncIteration) as exc:
            return error_response(replica_failed(exc))
        self.served[accepted.replica] += 1
        headers = dict(head.headers)
        headers[REPLICA_HEADER] = str(accepted.replica)
        event_stream = headers.get("content-type", "").startswith("text/event-stream")

        async def body() -> AsyncIterator[bytes]:
            finished = False
            try:
                async for chunk in stream:
                    yield chunk
                finished = True
            except RayError as exc:
                finished = True
                if event_stream:    # the status is sent already: the stream ends with an error event
                    yield b"data: " + json.dumps(replica_failed(exc).body()).encode() + b"\n\n"
            finally:
                if not finished:    # the client went away: the replica's server stops generating
                    stream.cancel()

        return StreamingResponse(body(), status_code=head.status, headers=headers)

    async def ask_each(self, request, path: str) -> list[tuple[int, int | None, bytes]]:
        """(replica, status, body) of `GET path` on every replica; status None for one that did not answer."""
        from ray.exceptions import RayError

        ask = ForwardedRequest("GET", path, query_without_replica(request), forwarded_headers(request), b"")

        async def one(rank: int) -> tuple[int, int | None, bytes]:
            own_request_context()
            stream = self.replicas.options(stream=True).forward.remote(ask, route=Route(replica=rank))
            status, parts = None, []

            async def collect() -> None:
                nonlocal status
                async for item in stream:
                    if isinstance(item, ResponseHead):
                        status = item.status
                    elif isinstance(item, bytes):
                        parts.append(item)

            try:
                await asyncio.wait_for(collect(), ADMIN_TIMEOUT_S)
            except (asyncio.TimeoutError, RayError):
                stream.cancel()
                return rank, None, b""
            return rank, status, b"".join(parts)

        return list(await asyncio.gather(*(one(rank) for rank in range(self.n_replicas))))

    async def gathered_metrics(self, request):
        from starlette.responses import Response

        answers = await self.ask_each(request, "/metrics")
        failed = next(((status, body) for _, status, body in answers if status not in (None, 200)), None)
        if failed is not None:
            return Response(failed[1], status_code=failed[0], media_type="application/json")
        texts = {rank: body.decode() for rank, status, body in answers if status == 200}
        return Response(merge_replica_metrics(texts), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def gathered_slots(self, request):
        from starlette.responses import JSONResponse, Response

        answers = await self.ask_each(request, "/slots")
        slots = []
        for rank, status, body in answers:
            if status is None:
                continue
            if status != 200:
                return Response(body, status_code=status, media_type="application/json")
            slots += [{**slot, "replica": rank} for slot in json.loads(body)]
        return JSONResponse(slots)

    async def cluster_status(self) -> dict:
        from ray.exceptions import RayError

        async def one(rank: int) -> dict:
            own_request_context()
            try:
                info = await asyncio.wait_for(self.replicas.info.remote(route=Route(replica=rank)), ADMIN_TIMEOUT_S)
            except (asyncio.TimeoutError, RayError):
                return {"replica": rank, "state": "unavailable", "requests": self.served[rank]}
            return {**info, "state": "serving", "requests": self.served[rank]}

        return {"replicas": list(await asyncio.gather(*(one(rank) for rank in range(self.n_replicas))))}


def own_request_context() -> None:
    """Give the calls of the current task a request id of their own.

    Ray Serve hands a routed replica to the pending call with the same internal request id, and every call made
    while serving one HTTP request inherits that request's id: calls made concurrently for one request (one per
    replica) would take each other's replicas and wait forever. Each such call runs in a task of its own
    (`asyncio.gather`), whose copy of the context this changes.
    """
    from ray.serve.context import _set_request_context

    _set_request_context(_internal_request_id=uuid.uuid4().hex)


def requested_replica(query: str | None, header: str | None, n_replicas: int) -> int | None:
    """The replica a client names (?replica=K wins over X-BaseRT-Replica); None when it names none."""
    text = query if query is not None else header
    if text is None:
        return None
    try:
        replica = int(text)
    except ValueError:
        replica = -1
    if not 0 <= replica < n_replicas:
        raise invalid(f"replica must be an integer from 0 to {n_replicas - 1}, not {text!r}", "replica")
    return replica


def forwarded_headers(request) -> tuple[tuple[str, str], ...]:
    return tuple((name, value) for name, value in request.headers.items()
                 if name not in HOP_BY_HOP and name != REPLICA_HEADER)


def query_without_replica(request) -> str:
    return urlencode([(name, value) for name, value in request.query_params.multi_items() if name != "replica"])


def forwarded(request, body: bytes) -> ForwardedRequest:
    return ForwardedRequest(request.method, request.url.path, query_without_replica(request),
                            forwarded_headers(request), body)


def replica_failed(exc: BaseException) -> ApiError:
    return unavailable(f"the replica serving this request failed ({type(exc).__name__}); retry the request",
                       "replica_failed", retry_after=1)


def error_response(exc: ApiError):
    from starlette.responses import JSONResponse

    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
