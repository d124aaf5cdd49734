"""The router's Prometheus metrics, on its own registry (several routers can live in one process).

Labels are bounded: ``endpoint`` is the endpoint's position in --endpoint
order (at most MAX_ENDPOINTS; ``strata_router_endpoint_info`` maps it to
the URL), ``policy`` one of three, ``reason``, ``outcome`` and ``kind``
small fixed sets, ``code`` the HTTP status class.

The cache-aware policy's TTFT estimate (:mod:`kvstore.router.ttft`) is
exported as its three coefficients in use (the priors until enough samples),
the samples it learned from, its mean absolute error, and each endpoint's
backlog of prefill tokens: enough to see what the router believes a token of
prefill and a request ahead cost, and how far off it is.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
INDEX_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1)

# Why an endpoint was picked.
REASONS = ("cache_hit", "cache_bypassed", "load", "round_robin", "fallback_index_down", "retry")


DISAGGREGATED_OUTCOMES = ("handoff", "no_prefill_endpoint", "prefill_failed", "no_kv_transfer_params")


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "strata_router_time_to_first_byte_seconds",
            "From the request's arrival to the first byte of the engine's response body (TTFT of a stream)",
            ["endpoint", "policy", "stream"], buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram(
            "strata_router_request_duration_seconds", "From the request's arrival to the end of its response",
            ["api", "policy", "code"], buckets=LATENCY_BUCKETS, registry=r)
        self.decisions = Counter(
            "strata_router_decisions_total", "Endpoints picked, by policy and reason", ["policy", "reason"], registry=r)
        self.refused = Counter(
            "strata_router_refused_total", "Requests the router answered itself, by HTTP status", ["code"], registry=r)
        self.upstream_errors = Counter(
            "strata_router_upstream_errors_total",
            "Proxied requests that failed at an engine: connect (refused, before any byte), disconnect, timeout",
            ["endpoint", "kind"], registry=r)
        self.in_flight = Gauge("strata_router_in_flight_requests", "Requests the router has outstanding", registry=r)
        self.reading = Gauge(
            "strata_router_reading_body_requests",
            "Requests whose body is still arriving (not yet counted in strata_router_in_flight_requests)", registry=r)
        self.endpoint_in_flight = Gauge(
            "strata_router_endpoint_in_flight_requests", "Requests outstanding per endpoint", ["endpoint"], registry=r)
        self.endpoint_healthy = Gauge(
            "strata_router_endpoint_healthy", "1 while the endpoint is in rotation", ["endpoint"], registry=r)
        self.endpoint_info = Gauge(
            "strata_router_endpoint_info", "An endpoint's URL and index ids, by its label", ["endpoint", "url", "ids"],
            registry=r)
        self.queue_depth = Gauge(
            "strata_router_endpoint_queue_depth_requests", "The engine's waiting queue, as scraped from its /metrics",
            ["endpoint"], registry=r)
        self.health_rounds = Counter(
            "strata_router_health_rounds_total", "Health-check rounds completed over every endpoint", registry=r)
        self.index_latency = Histogram(
            "strata_router_index_query_duration_seconds", "Score RPCs to the prefix index, by outcome",
            ["outcome"], buckets=INDEX_BUCKETS, registry=r)
        self.index_available = Gauge(
            "strata_router_index_available", "1 while the prefix index answers within its deadline", registry=r)
        self.prefix_blocks = Histogram(
            "strata_router_prefix_hit_ratio", "Cached fraction of the prompt's blocks at the chosen endpoint",
            buckets=(0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry=r)
        self.ttft_overhead = Gauge(
            "strata_router_ttft_model_overhead_seconds",
            "Estimated TTFT of a request with nothing to prefill and nothing ahead (the fit's intercept)", registry=r)
        self.ttft_per_token = Gauge(
            "strata_router_ttft_model_prefill_seconds_per_token",
            "Estimated prefill time of one uncached prompt token (queued ahead or the request's own)", registry=r)
        self.ttft_per_request = Gauge(
            "strata_router_ttft_model_seconds_per_request_ahead",
            "Estimated wait per request ahead at an endpoint beyond its prefill (its decode on a one-slot engine)",
            registry=r)
        self.ttft_samples = Counter(
            "strata_router_ttft_model_samples_total",
            "Streamed requests' measured TTFT the estimate learned from; kind outlier: down-weighted (far off the fit)",
            ["kind"], registry=r)
        self.ttft_error = Gauge(
            "strata_router_ttft_model_mean_abs_error_seconds",
            "Running mean of |measured - estimated| TTFT over recent samples (each residual capped as an outlier's)",
            registry=r)
        self.endpoint_backlog = Gauge(
            "strata_router_endpoint_backlog_prefill_tokens",
            "Uncached prompt tokens the router sent to the endpoint whose first byte has not come back", ["endpoint"],
            registry=r)
        self.disaggregated = Counter(
            "strata_router_disaggregated_requests_total",
            "Requests of disaggregated serving (--prefill-endpoint), by outcome: handoff (prefilled, sent to decode "
            "with its kv_transfer_params), or a fallback where the decode engine computes the whole prompt: "
            "no_prefill_endpoint (none in rotation), prefill_failed (refused, errored or timed out), "
            "no_kv_transfer_params (the prefill answer carried none)", ["outcome"], registry=r)
        self.prefill = Histogram(
            "strata_router_prefill_duration_seconds",
            "A disaggregated request's prefill on its prefill engine: sent to answered (kv_transfer_params back)",
            buckets=LATENCY_BUCKETS, registry=r)
        for outcome in DISAGGREGATED_OUTCOMES:
            self.disaggregated.labels(outcome)
        for kind in ("fit", "outlier"):
            self.ttft_samples.labels(kind)
        for reason in REASONS:
            for policy in ("round-robin", "least-loaded", "cache-aware"):
                self.decisions.labels(policy, reason)
