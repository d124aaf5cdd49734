"""The handoff's Prometheus metrics and its counts; one object per daemon (both sides: a daemon may be either).

The table (prefill side) and the puller (decode side) report through the
methods here, which move the Prometheus series and the plain counts that
``Stats`` shows (:meth:`HandoffMetrics.counts`) together: a figure in
``strata stats`` is never read back out of a Prometheus object, and never
drifts from what ``/metrics`` says.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvstore.peer.registry import pull_schemes

OUTCOMES = ("completed", "expired")
PULL_OUTCOMES = ("ok", "failed")
FALLBACK_REASONS = ("unavailable",)
_PULL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True, slots=True)
class HandoffCounts:
    """This daemon's handoffs since it started: as a prefill side (open, opened, ended) and as a
    decode side (pulls, verified bytes pulled, transports fallen back from)."""

    open: int = 0
    opened: int = 0
    completed: int = 0
    expired: int = 0
    pulls_ok: int = 0
    pulls_failed: int = 0
    pulled_bytes: int = 0
    fallbacks: int = 0


class HandoffMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, transports: Iterable[str] | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self._opened = Counter("strata_handoffs_opened_total", "Handoffs opened on this daemon (prefill side)",
                               registry=r)
        self._ended = Counter(
            "strata_handoffs_ended_total",
            "Handoffs of this daemon (prefill side) that ended, by outcome: completed (the decode side "
            "confirmed), expired (its lease ran out: the decode side died or never came)", ["outcome"], registry=r,
        )
        self._open = Gauge("strata_handoffs_open", "Handoffs open on this daemon now (prefill side)", registry=r)
        self._pulls = Counter("strata_handoff_pulls_total", "Pulls run by this daemon (decode side), by outcome",
                              ["outcome"], registry=r)
        self.running = Gauge("strata_handoff_pulls_running",
                             "Pulls running on this daemon now (decode side): each holds one of --handoff-max-pulls",
                             registry=r)
        self._pulled_bytes = Counter(
            "strata_handoff_pulled_bytes_total",
            "Verified block bytes pulled by this daemon (decode side), by the transport they came over",
            ["transport"], registry=r,
        )
        self._pull_seconds = Histogram(
            "strata_handoff_pull_duration_seconds",
            "Duration of a pull that stored every block, from the request to the completion at the prefill side",
            buckets=_PULL_BUCKETS, registry=r,
        )
        self._fallbacks = Counter(
            "strata_handoff_pull_fallbacks_total",
            "Transports a pull (decode side) gave up on for the next one the prefill node offers, by the "
            "transport left and why: unavailable (it could not be reached, or broke off mid-pull)",
            ["transport", "reason"], registry=r,
        )
        for outcome in OUTCOMES:
            self._ended.labels(outcome)
        for outcome in PULL_OUTCOMES:
            self._pulls.labels(outcome)
        for transport in pull_schemes() if transports is None else transports:
            self._pulled_bytes.labels(transport)
            for reason in FALLBACK_REASONS:
                self._fallbacks.labels(transport, reason)
        self._lock = threading.Lock()
        self._counts = HandoffCounts()

    def _add(self, **deltas: int) -> None:
        with self._lock:
            c = self._counts
            self._counts = HandoffCounts(**{k: getattr(c, k) + deltas.get(k, 0) for k in HandoffCounts.__slots__})

    def counts(self) -> HandoffCounts:
        with self._lock:
            return self._counts

    # ---- the prefill side ------------------------------------------------------------

    def opened(self) -> None:
        self._opened.inc()
        self._open.inc()
        self._add(open=1, opened=1)

    def ended(self, outcome: str) -> None:
        """``outcome``: one of :data:`OUTCOMES`."""
        self._ended.labels(outcome).inc()
        self._open.dec()
        self._add(open=-1, **{outcome: 1})

    # ---- the decode side ------------------------------------------------------------------

    def pulled(self, by_transport: dict[str, int], seconds: float) -> None:
        """A pull that stored every block: its verified bytes, by the transport each batch came over."""
        self._pulls.labels("ok").inc()
        for transport, n in by_transport.items():
            self._pulled_bytes.labels(transport).inc(n)
        self._pull_seconds.observe(seconds)
        self._add(pulls_ok=1, pulled_bytes=sum(by_transport.values()))

    def pull_failed(self) -> None:
        self._pulls.labels("failed").inc()
        self._add(pulls_failed=1)

    def fell_back(self, transport: str, reason: str) -> None:
        """A pull left ``transport`` for the next one; ``reason``: one of :data:`FALLBACK_REASONS`."""
        self._fallbacks.labels(transport, reason).inc()
        self._add(fallbacks=1)
