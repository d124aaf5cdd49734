"""The engine's Prometheus metrics, on a registry of its own (served at ``GET /metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60)


class EngineMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.queue_depth = Gauge("e2e_engine_queue_depth", "Requests admitted and waiting to compute", registry=r)
        self.running = Gauge("e2e_engine_running", "Requests computing now (0 or 1)", registry=r)
        self.requests = Counter("e2e_engine_requests_total", "Requests answered, by HTTP status", ["code"], registry=r)
        self.prefill_seconds = Histogram("e2e_engine_prefill_seconds", "Prompt prefill time (to the first token)",
                                         buckets=_SECONDS, registry=r)
        self.decode_seconds = Histogram("e2e_engine_decode_seconds", "Decode time after the first token",
                                        buckets=_SECONDS, registry=r)
        self.ttft_seconds = Histogram("e2e_engine_time_to_first_token_seconds",
                                      "Admission to first token, queueing included", buckets=_SECONDS, registry=r)
        self.prompt_tokens = Counter("e2e_engine_prompt_tokens_total", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("e2e_engine_generation_tokens_total", "Tokens generated", registry=r)
        self.cached_tokens = Counter("e2e_engine_cached_tokens_total",
                                     "Prompt tokens whose KV was reused, by source", ["source"], registry=r)
        self.prefix_hits = Counter("e2e_engine_prefix_cache_hits_total",
                                   "Requests that reused any cached prefix, by source", ["source"], registry=r)
        self.cache_blocks = Gauge("e2e_engine_cache_blocks", "Blocks held in the engine's block cache", registry=r)
        self.pool_blocks = Counter("e2e_engine_pool_blocks_total",
                                   "Shared-pool block operations, by op and outcome", ["op", "outcome"], registry=r)
        self.pool_pending = Gauge("e2e_engine_pool_pending_blocks", "Blocks waiting to be stored to the pool",
                                  registry=r)
        self.events_dropped = Gauge("e2e_engine_kv_event_batches_dropped",
                                    "KV-event batches dropped on a full publisher queue", registry=r)
