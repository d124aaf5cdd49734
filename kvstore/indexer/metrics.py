"""The indexer API's Prometheus metrics (``GET /metrics``), on its own registry.

Labels are bounded: ``route`` is one of the API's routes (anything else is
``other``), ``code`` the HTTP status class.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

ROUTES = ("/query", "/query_by_hash", "/register", "/unregister", "/instances", "/health", "/metrics")
DURATION_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class IndexerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("strata_indexer_requests", "Requests the indexer API answered, by route and status "
                                "class (2xx, 4xx, 5xx)", ("route", "code"), registry=r)
        self.duration = Histogram("strata_indexer_request_duration_seconds", "Time to answer one request, body "
                                  "read included, in seconds, by route", ("route",), buckets=DURATION_BUCKETS,
                                  registry=r)
        self.matched = Histogram("strata_indexer_query_matched_blocks", "Blocks of the longest prefix any "
                                 "instance holds, per /query or /query_by_hash", buckets=(0, 1, 4, 16, 64, 256, 1024,
                                                                                          4096), registry=r)
        self.engines = Gauge("strata_indexer_engines_followed", "Engines whose KV events the indexer follows "
                             "(registered through /register, or restored from --registrations-file)", registry=r)
        self.saves = Counter("strata_indexer_registration_saves", "Writes of the registrations file, by outcome "
                             "(ok, failed)", ("outcome",), registry=r)

    def answered(self, path: str, status: int, seconds: float) -> None:
        route = path if path in ROUTES else "other"
        self.requests.labels(route, f"{status // 100}xx").inc()
        self.duration.labels(route).observe(seconds)
