"""ServedBytes: the block bytes this daemon served to other nodes, by the transport they left over.

Counted where the bytes go out to a peer: the TCP and UCX peer listeners
(:mod:`kvstore.peer.server`, ``tcp`` and ``ucx``) and KVService's Get when
a peer asks it (``local_only``, the gRPC peer transport and a handoff pulled
over gRPC: ``grpc``). One object per daemon; thread-safe.

Two readers. Prometheus (``strata_peer_served_bytes_total`` by transport),
and the node's own record in the prefix index: the index agent sends
:meth:`snapshot` with every heartbeat, so ``strata peers`` on any daemon
shows what every node served without calling each one (a node the operator
cannot reach still reports). The counters start at zero with each epoch,
as the record does.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter

from kvstore.peer.registry import schemes


class ServedBytes:
    def __init__(self, registry: CollectorRegistry | None = None, transports: Iterable[str] | None = None) -> None:
        self._counter = Counter(
            "strata_peer_served_bytes_total",
            "Block bytes this daemon served to other nodes (their peer reads and handoff pulls), "
            "by the transport they went over", ["transport"],
            registry=registry if registry is not None else CollectorRegistry(),
        )
        self._lock = threading.Lock()
        self._bytes: dict[str, int] = {}
        for transport in schemes() if transports is None else transports:  # a series per scheme from the start
            self._counter.labels(transport)

    def add(self, transport: str, n: int) -> None:
        """``n`` block bytes went out over ``transport`` (a scheme: a bounded label)."""
        if n <= 0:
            return
        self._counter.labels(transport).inc(n)
        with self._lock:
            self._bytes[transport] = self._bytes.get(transport, 0) + n

    def snapshot(self) -> dict[str, int]:
        """Bytes by transport since the daemon started; a transport that served nothing is left out."""
        with self._lock:
            return dict(self._bytes)
