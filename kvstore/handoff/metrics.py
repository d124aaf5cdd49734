"""The handoff's Prometheus metrics; one object per daemon (both sides: a daemon may be either)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

OUTCOMES = ("completed", "expired")
PULL_OUTCOMES = ("ok", "failed")
_PULL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class HandoffMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.opened = Counter("strata_handoffs_opened_total", "Handoffs opened on this daemon (prefill side)",
                              registry=r)
        self.ended = Counter(
            "strata_handoffs_ended_total",
            "Handoffs of this daemon (prefill side) that ended, by outcome: completed (the decode side "
            "confirmed), expired (its lease ran out: the decode side died or never came)", ["outcome"], registry=r,
        )
        self.open = Gauge("strata_handoffs_open", "Handoffs open on this daemon now (prefill side)", registry=r)
        self.pulls = Counter("strata_handoff_pulls_total", "Pulls run by this daemon (decode side), by outcome",
                             ["outcome"], registry=r)
        self.pulled_bytes = Counter("strata_handoff_pulled_bytes_total",
                                    "Verified block bytes pulled by this daemon (decode side)", registry=r)
        self.pull_seconds = Histogram(
            "strata_handoff_pull_duration_seconds",
            "Duration of a pull that stored every block, from the request to the completion at the prefill side",
            buckets=_PULL_BUCKETS, registry=r,
        )
        for outcome in OUTCOMES:
            self.ended.labels(outcome)
        for outcome in PULL_OUTCOMES:
            self.pulls.labels(outcome)
