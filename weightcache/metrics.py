"""Prometheus metrics of the weight pipeline, in a registry passed in (the daemon's, or a test's).

Labels are bounded: ``source`` is a source kind (origin, peer), ``outcome``
one of ok, corrupt, throttled, unavailable, mismatch, miss. Never a model, file or
digest: those are unbounded and belong in logs.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class WeightMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "strata_weights_chunk_requests_total", "Chunk reads asked of a source, by how they ended",
            ["source", "outcome"], registry=r,
        )
        self.bytes = Counter(
            "strata_weights_fetched_bytes_total", "Verified chunk bytes stored in the node cache, by source",
            ["source"], registry=r,
        )

    def chunk(self, source: str, outcome: str, nbytes: int = 0) -> None:
        self.requests.labels(source, outcome).inc()
        if nbytes:
            self.bytes.labels(source).inc(nbytes)
