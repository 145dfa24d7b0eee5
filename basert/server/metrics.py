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
        self.draft_tokens = Counter("basert_draft_tokens", "drafted tokens fed for verification (speculative "
                                    "decoding)", ["model"], registry=self.registry)
        self.draft_accepted_tokens = Counter("basert_draft_accepted_tokens", "drafted tokens the sampler picked "
                                             "itself (speculative decoding)", ["model"], registry=self.registry)
        self.ttft = Histogram("basert_time_to_first_token_seconds", "time to first token", ["model"],
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.latency = Histogram("basert_request_latency_seconds", "request latency", ["endpoint"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.busy_slots = Gauge("basert_busy_slots", "slots generating now", ["model"], registry=self.registry)
        self.waiting = Gauge("basert_waiting_requests", "requests queued for a slot", ["model"],
                             registry=self.registry)

        self.kv_blocks_used = Gauge("basert_kv_blocks_used", "KV blocks held by slots, the cache or snapshots",
                                    ["model"], registry=self.registry)
        self.kv_blocks_total = Gauge("basert_kv_blocks_total", "KV blocks in the pool", ["model"],
                                     registry=self.registry)
        self.kv_window_blocks_used = Gauge("basert_kv_window_blocks_used", "blocks of the sliding-window layers' "
                                           "pool held by slots or the cache", ["model"], registry=self.registry)
        self.kv_window_blocks_total = Gauge("basert_kv_window_blocks_total", "blocks in the sliding-window layers' "
                                            "pool (0: the model has no such layer)", ["model"], registry=self.registry)
        self.kv_bytes = Gauge("basert_kv_bytes", "bytes of the KV pools (K and V of every attention layer, as their KV "
                              "types store them; the sliding-window layers' pool included)", ["model"],
                              registry=self.registry)
        self.prefix_queries = Gauge("basert_prefix_cache_queries", "prefix cache lookups so far", ["model"],
                                    registry=self.registry)
        self.prefix_hit_tokens = Gauge("basert_prefix_cache_hit_tokens", "prompt tokens served from the prefix "
                                       "cache or the slot's own history so far", ["model"], registry=self.registry)
        self.prefix_blocks_cached = Gauge("basert_prefix_cache_blocks_cached", "KV blocks findable in the prefix "
                                          "cache", ["model"], registry=self.registry)
        self.prefix_snapshots = Gauge("basert_prefix_cache_snapshots", "recurrent-state snapshots in the prefix "
                                      "cache", ["model"], registry=self.registry)
        self.prefix_save_failures = Gauge("basert_prefix_cache_save_failures", "failed prefix cache file saves",
                                          ["model"], registry=self.registry)

        self.model_loaded = Gauge("basert_model_loaded", "1 if the model is loaded, 0 if it is served on demand",
                                  ["model"], registry=self.registry)
        self.model_memory = Gauge("basert_model_memory_bytes", "bytes a loaded model holds (weights and KV pools)",
                                  ["model"], registry=self.registry)
        # The gauges an actor's Stats reply sets: gone with the model when it is unloaded.
        self.model_gauges = (self.busy_slots, self.waiting, self.kv_blocks_used, self.kv_blocks_total,
                             self.kv_window_blocks_used, self.kv_window_blocks_total, self.kv_bytes,
                             self.prefix_queries, self.prefix_hit_tokens, self.prefix_blocks_cached,
                             self.prefix_snapshots, self.prefix_save_failures, self.model_memory)

    def set_loaded(self, model: str, memory_bytes: int | None) -> None:
        """Whether a servable model is loaded (`memory_bytes` its size) or not (None: its gauges are dropped)."""
        self.model_loaded.labels(model).set(memory_bytes is not None)
        if memory_bytes is not None:
            self.model_memory.labels(model).set(memory_bytes)
            return
        for gauge in self.model_gauges:
            try:
                gauge.remove(model)
            except KeyError:
                pass

    def update_model(self, stats: dict) -> None:
        """Set the per-model gauges from an actor's Stats reply."""
        model = stats["model"]
        self.busy_slots.labels(model).set(stats["busy_slots"])
        self.waiting.labels(model).set(stats["waiting"])
        self.kv_blocks_used.labels(model).set(stats["kv_blocks_used"])
        self.kv_blocks_total.labels(model).set(stats["kv_blocks_total"])
        self.kv_window_blocks_used.labels(model).set(stats["kv_window_blocks_used"])
        self.kv_window_blocks_total.labels(model).set(stats["kv_window_blocks_total"])
        self.kv_bytes.labels(model).set(stats["kv_bytes"])
        cache = stats["prefix_cache"]
        if cache is not None:
            self.prefix_queries.labels(model).set(cache["queries"])
            self.prefix_hit_tokens.labels(model).set(cache["hit_tokens"])
            self.prefix_blocks_cached.labels(model).set(cache["blocks_cached"])
            self.prefix_snapshots.labels(model).set(cache["snapshots"])
            self.prefix_save_failures.labels(model).set(stats["prefix_cache_save_failures"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
