"""Watch a server's /health while a tool sends it traffic: how often it answered, how slowly, and when not."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import trio


@dataclass(slots=True)
class HealthLog:
    """What polling /health saw: polls, the slowest answer, and each poll that failed or took over `limit_s`."""

    limit_s: float = 1.0
    polls: int = 0
    max_s: float = 0.0
    failures: list[str] = field(default_factory=list)
    frozen: bool = False        # no poll succeeded for the freeze time: polling stopped

    def summary(self, keep: int) -> dict:
        """The log as JSON, with the first `keep` failures."""
        return {"polls": self.polls, "max_latency_s": round(self.max_s, 3), "failures": self.failures[:keep]}


async def poll_health(url: str, log: HealthLog, done: trio.Event, *, interval_s: float = 0.5,
                      request_timeout_s: float = 5.0, freeze_after_s: float | None = None,
                      after_poll: Callable[[], None] | None = None) -> None:
    """GET `url`/health every `interval_s` until `done` is set, recording each poll in `log`.

    Returns early, with `log.frozen` set, once no poll has succeeded for `freeze_after_s` seconds.
    `after_poll` runs after each poll (a tool samples the server's memory there).
    """
    began = time.monotonic()
    last_ok = began
    async with httpx.AsyncClient(timeout=request_timeout_s) as client:
        while not done.is_set():
            start = time.monotonic()
            try:
                response = await client.get(f"{url}/health")
                ok, what = response.status_code == 200, f"status {response.status_code}"
            except httpx.HTTPError as exc:
                ok, what = False, type(exc).__name__
            elapsed = time.monotonic() - start
            log.polls += 1
            log.max_s = max(log.max_s, elapsed)
            if not ok or elapsed > log.limit_s:
                log.failures.append(f"t={start - began:.1f}s {what} in {elapsed:.2f}s")
            if after_poll is not None:
                after_poll()
            if ok:
                last_ok = time.monotonic()
            elif freeze_after_s is not None and time.monotonic() - last_ok > freeze_after_s:
                log.frozen = True
                return
            with trio.move_on_after(max(0.0, interval_s - elapsed)):
                await done.wait()
