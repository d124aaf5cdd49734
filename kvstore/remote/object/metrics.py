"""The object tier's Prometheus metrics; one object per daemon, shared by every arena's object tier.

Labels are bounded: ``op`` is one of :data:`OPS`, ``code`` one of
:data:`CODES` (S3's own error codes for the answers that matter, a few
transport outcomes, ``other`` for the rest), ``outcome`` one of
:data:`WRITEBACK_OUTCOMES`. The write-back queues' depth is read at scrape
time from the queues themselves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

OPS = ("get", "probe", "put", "put_multipart", "delete", "list", "lease", "list_uploads", "abort_upload")
CODES = (
    "ok", "NoSuchKey", "PreconditionFailed", "SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout",
    "AccessDenied", "NoSuchBucket", "NoSuchUpload", "ConditionalRequestConflict", "timeout", "connection", "other",
)
GC_OUTCOMES = ("expired", "marker", "kept", "upload")  # objects a sweep deleted (by why) or kept
SWEEP_RESULTS = ("done", "leased_elsewhere", "failed")
WRITEBACK_OUTCOMES = ("uploaded", "present", "dropped", "failed", "refused", "corrupt", "closed")
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def code_label(code: str) -> str:
    return code if code in CODES else "other"


class ObjectMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.registry = r
        self.requests = Counter(
            "strata_object_requests_total",
            "S3 requests by op and answer: ok, S3's error code (NoSuchKey and PreconditionFailed are answers: a "
            "miss, already stored), timeout, connection (no answer), other", ["op", "code"], registry=r,
        )
        self.seconds = Histogram(
            "strata_object_request_duration_seconds", "Duration of one S3 request (one attempt), by op",
            ["op"], buckets=_BUCKETS, registry=r,
        )
        self.retries = Counter(
            "strata_object_retries_total", "S3 requests sent again after a retryable answer, by op", ["op"],
            registry=r,
        )
        self.bytes = Counter(
            "strata_object_bytes_total", "Object bytes moved, by direction (sent: uploads; received: reads)",
            ["direction"], registry=r,
        )
        self.corrupt = Counter(
            "strata_object_corrupt_objects_total",
            "Objects whose header or bytes failed their checksum when read: deleted, never served", registry=r,
        )
        self.writeback = Counter(
            "strata_object_writeback_total",
            "Blocks leaving the write-back queue, by outcome: uploaded, present (the bucket had it: no upload), "
            "dropped (oldest first, to make room in a full queue), failed (S3 kept failing), refused (a quota or "
            "a limit), corrupt (bytes did not match), closed (still queued when the daemon stopped)",
            ["outcome"], registry=r,
        )
        self.gc_objects = Counter(
            "strata_object_gc_objects_total",
            "Objects a lifecycle sweep looked at, by outcome: expired (past the namespace's TTL: deleted), marker "
            "(a read marker whose block is gone: deleted), kept, upload (a multipart upload abandoned past its safe "
            "age: aborted, its parts' bytes freed)", ["outcome"], registry=r,
        )
        self.gc_bytes = Counter(
            "strata_object_gc_bytes_total", "Object bytes a lifecycle sweep deleted or kept, by outcome",
            ["outcome"], registry=r,
        )
        self.sweeps = Counter(
            "strata_object_gc_sweeps_total",
            "Lifecycle sweeps of one namespace, by result: done, leased_elsewhere (another daemon holds the "
            "namespace's sweep lease: no work done twice), failed (S3 failed; the next interval tries again)",
            ["result"], registry=r,
        )
        self.refused = Counter(
            "strata_object_quota_refusals_total",
            "Blocks kept local because their namespace's object quota had no room", registry=r,
        )
        for outcome in GC_OUTCOMES:
            self.gc_objects.labels(outcome)
            self.gc_bytes.labels(outcome)
        for result in SWEEP_RESULTS:
            self.sweeps.labels(result)
        for op in OPS:
            self.retries.labels(op)
        for outcome in WRITEBACK_OUTCOMES:
            self.writeback.labels(outcome)
        for direction in ("sent", "received"):
            self.bytes.labels(direction)
        self._queues: list[Callable[[], tuple[int, int, int]]] = []
        self._lock = threading.Lock()
        r.register(_QueueCollector(self))

    def watch_queue(self, read: Callable[[], tuple[int, int, int]]) -> None:
        """Export a write-back queue's (queued blocks, queued bytes, uploads in flight), summed over queues."""
        with self._lock:
            self._queues.append(read)

    def unwatch_queue(self, read: Callable[[], tuple[int, int, int]]) -> None:
        with self._lock:
            if read in self._queues:
                self._queues.remove(read)

    def queue_totals(self) -> tuple[int, int, int]:
        with self._lock:
            readers = list(self._queues)
        totals = [0, 0, 0]
        for read in readers:
            for i, value in enumerate(read()):
                totals[i] += value
        return totals[0], totals[1], totals[2]


class _QueueCollector(Collector):
    def __init__(self, metrics: ObjectMetrics) -> None:
        self._metrics = metrics

    def collect(self):
        blocks, nbytes, uploading = self._metrics.queue_totals()
        out = []
        for name, doc, value in (
            ("strata_object_writeback_queue_blocks", "Blocks waiting in the write-back queue for upload", blocks),
            ("strata_object_writeback_queue_bytes", "Block bytes held by the write-back queue", nbytes),
            ("strata_object_uploads_in_flight", "Uploads to S3 running now", uploading),
        ):
            family = GaugeMetricFamily(name, doc)
            family.add_metric([], value)
            out.append(family)
        return out
