"""One access-log line and the request metrics for each finished request."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from basert.engine.types import FinishEvent
from basert.server.logs import log_field
from basert.server.metrics import ServerMetrics

access_log = logging.getLogger("basert.access")


@dataclass(slots=True)
class RequestRecord:
    """What the access log and metrics need about one finished request."""

    model: str = ""
    slot: int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prompt_per_second: float = 0.0
    predicted_per_second: float = 0.0
    ttft_ms: float = 0.0
    finish_reason: str = ""
    timed_out: bool = False
    draft_tokens: int = 0
    draft_accepted_tokens: int = 0

    def absorb(self, done_list: list[FinishEvent]) -> None:
        if not done_list:
            return
        first = done_list[0]
        timings = first.timings.as_dict(first.usage.cached_tokens)
        self.slot = first.slot
        self.cached_tokens = first.usage.cached_tokens
        self.completion_tokens = sum(d.usage.completion_tokens for d in done_list)
        self.prompt_per_second = timings["prompt_per_second"]
        self.predicted_per_second = timings["predicted_per_second"]
        self.ttft_ms = first.timings.ttft_ms
        self.finish_reason = ",".join(sorted({d.finish_reason for d in done_list}))
        self.timed_out = any(d.timed_out for d in done_list)
        self.draft_tokens = sum(d.timings.draft_n for d in done_list)
        self.draft_accepted_tokens = sum(d.timings.draft_n_accepted for d in done_list)


def log_request(metrics: ServerMetrics, endpoint: str, status: int, started: float, record: RequestRecord | None,
                method: str, path: str, streamed: bool = False) -> None:
    """Count the request in `metrics` and write its access-log line; `endpoint` is the route pattern."""
    elapsed = time.monotonic() - started
    metrics.requests.labels(endpoint, str(status)).inc()
    metrics.latency.labels(endpoint).observe(elapsed)
    r = record or RequestRecord()
    if r.model:
        metrics.prompt_tokens.labels(r.model).inc(r.prompt_tokens)
        metrics.cached_tokens.labels(r.model).inc(r.cached_tokens)
        metrics.generated_tokens.labels(r.model).inc(r.completion_tokens)
        metrics.draft_tokens.labels(r.model).inc(r.draft_tokens)
        metrics.draft_accepted_tokens.labels(r.model).inc(r.draft_accepted_tokens)
        if r.ttft_ms:
            metrics.ttft.labels(r.model).observe(r.ttft_ms / 1000)
    access_log.info(
        "%s %s %d model=%s slot=%s prompt=%d cached=%d completion=%d prefill_tps=%.1f decode_tps=%.1f "
        "ttft_ms=%.1f total_ms=%.1f finish=%s%s%s",
        log_field(method, 16), log_field(path), status, r.model or "-", "-" if r.slot is None else r.slot,
        r.prompt_tokens, r.cached_tokens, r.completion_tokens, r.prompt_per_second, r.predicted_per_second,
        r.ttft_ms, 1000 * elapsed, r.finish_reason or ("cancelled" if streamed else "-"),
        " stream" if streamed else "", " timed_out" if r.timed_out else "",
    )
