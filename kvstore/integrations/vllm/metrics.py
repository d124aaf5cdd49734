"""What the tier reports to vLLM's Prometheus metrics (``get_stats``), beyond the tiering manager's own.

The manager already counts each tier's bytes, transfer time, job failures
and lookups; these say why Strata dropped or failed chunks and whether the
daemon answers. Labels are bounded: ``reason`` and ``result`` take the
values of :data:`REASONS` and :data:`RESULTS`. Observations come from the
tier's worker threads and are handed over (and reset) on the scheduler
thread, under one lock.
"""

from __future__ import annotations

import threading

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)

DROPPED_STORE_CHUNKS = "vllm:kv_offload_strata_dropped_store_chunks"
FAILED_LOAD_CHUNKS = "vllm:kv_offload_strata_failed_load_chunks"
LOOKUP_BATCHES = "vllm:kv_offload_strata_lookup_batches"
LOOKUP_BATCH_SECONDS = "vllm:kv_offload_strata_lookup_batch_seconds"
DAEMON_UP = "vllm:kv_offload_strata_daemon_up"
QUEUED_JOBS = "vllm:kv_offload_strata_queued_jobs"
KV_HINTS = "vllm:kv_offload_strata_kv_hints"
KV_HINT_CHUNKS = "vllm:kv_offload_strata_kv_hint_chunks"

# Why a chunk was not stored or not loaded.
REASONS = ("down", "queue_full", "expired", "full", "missing", "layout", "error")
RESULTS = ("ok", "down", "error")
HINT_ACTIONS = ("pin", "retain", "share", "prefetch", "demote", "other")  # "other": an action_type not implemented
HINT_OUTCOMES = ("accepted", "clipped", "deferred", "rejected")
HINT_RESULTS = ("done", "missing", "failed")  # what an applied hint did, per chunk


def definitions() -> dict[str, OffloadingMetricMetadata]:
    return {
        DROPPED_STORE_CHUNKS: OffloadingCounterMetadata(
            documentation="Chunks the Strata tier did not store, by reason (down: the daemon is unreachable; "
                          "queue_full; expired: waited past job_timeout_s; full: the daemon declined; error).",
            labelnames=("reason",),
        ),
        FAILED_LOAD_CHUNKS: OffloadingCounterMetadata(
            documentation="Chunks the Strata tier failed to load into the primary tier, by reason (down, queue_full, "
                          "expired, missing: gone from the daemon, layout: another layout's bytes, error).",
            labelnames=("reason",),
        ),
        LOOKUP_BATCHES: OffloadingCounterMetadata(
            documentation="Batched lookups the Strata tier sent (one per request and step), by result.",
            labelnames=("result",),
        ),
        LOOKUP_BATCH_SECONDS: OffloadingHistogramMetadata(
            documentation="Time of one batched Strata lookup on the tier's lookup thread, in seconds "
                          "(the scheduler thread never waits for it).",
            buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
        ),
        DAEMON_UP: OffloadingGaugeMetadata(
            documentation="1 while the Strata daemon answers, 0 while the tier is backing off from it.",
        ),
        QUEUED_JOBS: OffloadingGaugeMetadata(
            documentation="Strata store and load jobs waiting or running.",
        ),
        KV_HINTS: OffloadingCounterMetadata(
            documentation="KV hint actions the Strata tier received, by action (pin, retain, share, prefetch, "
                          "demote; other: not implemented) and outcome (accepted, clipped, deferred, rejected).",
            labelnames=("action", "outcome"),
        ),
        KV_HINT_CHUNKS: OffloadingCounterMetadata(
            documentation="Chunks an applied KV hint acted on, by action and result (done: moved or pinned; "
                          "missing: not held by the daemon; failed: the daemon refused or was down).",
            labelnames=("action", "result"),
        ),
    }


class TierMetrics:
    """Counts from any thread; :meth:`take` builds vLLM's stats payload and starts over."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dropped: dict[str, int] = {}
        self._failed: dict[str, int] = {}
        self._batches: dict[str, int] = {}
        self._batch_seconds: list[float] = []
        self._hints: dict[tuple[str, str], int] = {}
        self._hint_chunks: dict[tuple[str, str], int] = {}
        self.totals: dict[str, int] = {}  # every count since start, for tests and logs

    def dropped(self, reason: str, chunks: int) -> None:
        self._add(self._dropped, reason, chunks, "dropped")

    def failed_load(self, reason: str, chunks: int) -> None:
        self._add(self._failed, reason, chunks, "failed_load")

    def lookup(self, result: str, seconds: float | None) -> None:
        assert result in RESULTS
        with self._lock:
            self._batches[result] = self._batches.get(result, 0) + 1
            if seconds is not None and len(self._batch_seconds) < 4096:  # a bound between two takes
                self._batch_seconds.append(seconds)

    def hint(self, action: str, outcome: str) -> None:
        assert outcome in HINT_OUTCOMES
        self._count(self._hints, (action if action in HINT_ACTIONS else "other", outcome), 1, "hint")

    def hint_chunks(self, action: str, result: str, chunks: int) -> None:
        assert action in HINT_ACTIONS and result in HINT_RESULTS
        if chunks > 0:
            self._count(self._hint_chunks, (action, result), chunks, "hint_chunks")

    def _count(self, counts: dict, labels: tuple[str, str], n: int, what: str) -> None:
        with self._lock:
            counts[labels] = counts.get(labels, 0) + n
            name = f"{what}:{':'.join(labels)}"
            self.totals[name] = self.totals.get(name, 0) + n

    def _add(self, counts: dict[str, int], reason: str, chunks: int, what: str) -> None:
        assert reason in REASONS
        if chunks <= 0:
            return
        with self._lock:
            counts[reason] = counts.get(reason, 0) + chunks
            name = f"{what}:{reason}"
            self.totals[name] = self.totals.get(name, 0) + chunks

    def take(self, daemon_up: bool, queued_jobs: int) -> OffloadingConnectorStats:
        stats = OffloadingConnectorStats()
        with self._lock:
            dropped, self._dropped = self._dropped, {}
            failed, self._failed = self._failed, {}
            batches, self._batches = self._batches, {}
            seconds, self._batch_seconds = self._batch_seconds, []
            hints, self._hints = self._hints, {}
            hint_chunks, self._hint_chunks = self._hint_chunks, {}
        for reason, n in dropped.items():
            stats.increase_counter(DROPPED_STORE_CHUNKS, n, (reason,))
        for reason, n in failed.items():
            stats.increase_counter(FAILED_LOAD_CHUNKS, n, (reason,))
        for result, n in batches.items():
            stats.increase_counter(LOOKUP_BATCHES, n, (result,))
        for s in seconds:
            stats.observe_histogram(LOOKUP_BATCH_SECONDS, s)
        for labels, n in hints.items():
            stats.increase_counter(KV_HINTS, n, labels)
        for labels, n in hint_chunks.items():
            stats.increase_counter(KV_HINT_CHUNKS, n, labels)
        stats.set_gauge(DAEMON_UP, 1 if daemon_up else 0)
        stats.set_gauge(QUEUED_JOBS, queued_jobs)
        return stats
