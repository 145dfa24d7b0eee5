"""Requests per minute per client (API key, or address without keys): a sliding window of arrival times."""

from __future__ import annotations

import math
import time
from collections import deque

WINDOW_SECONDS = 60.0


class RateLimiter:
    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._arrivals: dict[str, deque[float]] = {}

    def retry_after(self, client: str) -> int | None:
        """Record a request from `client`; None when it may go on, else the seconds until it may retry."""
        now = time.monotonic()
        if len(self._arrivals) > 10_000:
            self._forget_idle(now)
        arrivals = self._arrivals.setdefault(client, deque())
        while arrivals and now - arrivals[0] >= WINDOW_SECONDS:
            arrivals.popleft()
        if len(arrivals) >= self.per_minute:
            return max(1, math.ceil(arrivals[0] + WINDOW_SECONDS - now))
        arrivals.append(now)
        return None

    def _forget_idle(self, now: float) -> None:
        for client in [c for c, a in self._arrivals.items() if not a or now - a[-1] >= WINDOW_SECONDS]:
            del self._arrivals[client]
