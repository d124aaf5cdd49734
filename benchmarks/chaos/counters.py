"""The daemons' own counters over the whole run, across their restarts.

A restarted daemon counts from 0 again, so before a daemon is killed its
counters are scraped and carried; the run's figure is what was carried plus
what the last incarnation counts. Only the families that show how faults
were met are reported (fallbacks by reason, corrupt blocks found, index
resyncs, evictions and drops: the last two should stay 0).
"""

from __future__ import annotations

from collections import Counter

from tests.support.peer_cluster import PeerNode

REPORTED = (
    "strata_peer_fallbacks_total", "strata_peer_reads_total", "strata_peer_index_repairs_total",
    "strata_kv_corrupt_blocks_total", "strata_object_corrupt_objects_total", "strata_kv_tier_errors_total",
    "strata_kv_evictions_total", "strata_kv_dropped_total", "strata_object_writeback_total",
    "strata_object_retries_total", "strata_index_resyncs_total", "strata_rpc_rejected_total",
)


def _label(name: str, labels: tuple) -> str:
    inner = ",".join(f"{k}={v}" for k, v in labels)
    return f"{name}{{{inner}}}" if inner else name


class Counters:
    def __init__(self, nodes: list[PeerNode]) -> None:
        self.nodes = nodes
        self._carried: list[Counter[str]] = [Counter() for _ in nodes]

    def _scrape(self, i: int) -> Counter[str]:
        out: Counter[str] = Counter()
        for (name, labels), value in self.nodes[i].metrics().items():
            if name in REPORTED and value:
                out[_label(name, labels)] += value
        return out

    def carry(self, i: int) -> None:
        """Before daemon ``i`` is killed: keep what it counted so far."""
        try:
            self._carried[i] += self._scrape(i)
        except OSError:  # not answering (stalled, or already gone): what it counted since the last carry is lost
            pass

    def totals(self) -> dict[str, dict[str, int]]:
        """Per daemon, every reported counter that is not 0, over the whole run."""
        out = {}
        for i, node in enumerate(self.nodes):
            now = self._carried[i].copy()
            try:
                now += self._scrape(i)
            except OSError:
                pass
            out[node.name] = {k: int(v) for k, v in sorted(now.items())}
        return out

    def fleet_total(self, sample: str) -> int:
        """One counter (``name{label=value}``) summed over every daemon."""
        return sum(values.get(sample, 0) for values in self.totals().values())
