"""Prometheus metrics of the weight pipeline, in a registry passed in (the daemon's, or a test's).

Labels are bounded: ``source`` is where verified bytes came from (``ram``:
the node's host-RAM copy, mapped in place; ``disk``: already in the node
cache when the fetch began; ``peer``; ``origin``),
``outcome`` one of ok, corrupt, throttled, unavailable, mismatch, miss.
Never a model, file or digest: those are unbounded and belong in logs.
(The page cache is not told apart from the disk: a cached chunk is read
through it either way.)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LOAD_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class WeightMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "strata_weights_chunk_requests_total", "Chunk reads asked of a source, by how they ended",
            ["source", "outcome"], registry=r,
        )
        self.bytes = Counter(
            "strata_weights_fetched_bytes_total", "Verified chunk bytes a load had, by source (ram: the node's RAM copy; disk: cached before)",
            ["source"], registry=r,
        )
        self.first_tensor = Histogram(
            "strata_weights_time_to_first_tensor_seconds", "From opening a model to its first tensor yielded",
            registry=r, buckets=_LOAD_BUCKETS,
        )
        self.complete = Histogram(
            "strata_weights_time_to_complete_seconds", "From opening a model to every planned chunk present",
            registry=r, buckets=_LOAD_BUCKETS,
        )
        self.ram_bytes = Gauge(
            "strata_weights_ram_bytes", "Bytes of model files in the node's host-RAM copy (one copy per node)",
            registry=r,
        )
        self.served = Counter(
            "strata_weights_served_bytes_total", "Chunk bytes this node served to peers", registry=r,
        )

    def chunk(self, source: str, outcome: str, nbytes: int = 0) -> None:
        self.requests.labels(source, outcome).inc()
        if nbytes:
            self.bytes.labels(source).inc(nbytes)

    def cached(self, nbytes: int) -> None:
        self.bytes.labels("disk").inc(nbytes)
