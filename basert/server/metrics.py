"""Prometheus metrics of one server (its own registry, so several servers in one process stay apart)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("basert_requests", "HTTP requests", ["endpoint", "status"], registry=self.registry)
        self.prompt_tokens = Counter("basert_prompt_tokens", "prompt tokens received", ["model"],
                                     registry=self.registry)
        self.cached_tokens = Counter("basert_cached_prompt_tokens", "prompt tokens served from cache", ["model"],
                                     registry=self.registry)
        self.generated_tokens = Counter("basert_generated_tokens", "tokens generated", ["model"],
                                        registry=self.registry)
        self.ttft = Histogram("basert_time_to_first_token_seconds", "time to first token", ["model"],
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.latency = Histogram("basert_request_latency_seconds", "request latency", ["endpoint"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.busy_slots = Gauge("basert_busy_slots", "slots generating now", ["model"], registry=self.registry)
        self.waiting = Gauge("basert_waiting_requests", "requests queued for a slot", ["model"],
                             registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
