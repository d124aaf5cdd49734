"""Which peer, over which transport, and which peers to pass over for now: one answer for every caller.

The peer tier (reads, :mod:`kvstore.peer.source`), replication (pushes and
holds, :mod:`kvstore.replication.pusher`) and the handoff's decode side
(pulls, :mod:`kvstore.handoff.pull`) all reach other nodes the same way: a
node's index record (:class:`~kvstore.index.base.NodeInfo`) advertises one
endpoint per transport it serves, this node has its own order of preference,
and a node whose call just failed is passed over for a while so a dead node
costs one failed call per back-off period, not one per block. A
:class:`PeerDirectory` holds that order, the transports it opened (one per
scheme, pooled connections inside) and the back-offs.

:meth:`PeerDirectory.routes` lists every (scheme, address) both sides have,
in this node's order (a caller that falls back over them, as a handoff pull
does with its blocking clients); :meth:`PeerDirectory.route` picks one: a
same-host-only transport (shared memory) that reaches the node comes first,
whatever its place in the order, and one that does not reach it is never
used; otherwise the first scheme of this node's order the node advertises.
Scheme names come from :mod:`kvstore.peer.registry`.

Not thread-safe: each owner calls its directory from one event loop (or,
for :meth:`routes` alone, from any thread: it reads only the order).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvstore.errors import InvalidArgument, StrataError
from kvstore.index.base import NodeInfo
from kvstore.peer.base import PeerTransport
from kvstore.peer.registry import open_peer_transport

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Route:
    scheme: str
    address: str  # scheme://host:port
    near: bool = False  # over a same-host-only transport: the node is on this host


class PeerDirectory:
    """``schemes``: the transports this node uses, preferred first. ``transports``: ready ones by
    scheme (tests), else each is opened on first use with its entry of ``options`` (scheme ->
    keyword options: the token). ``writes``: only transports that can write blocks (pushes).
    ``backoff_s``: how long a node whose call failed is passed over. ``what``: the caller's name
    in log lines ("peer read", "replication call")."""

    def __init__(self, schemes: Sequence[str], *, backoff_s: float, writes: bool = False,
                 transports: Mapping[str, PeerTransport] | None = None,
                 options: Mapping[str, Mapping[str, object]] | None = None, what: str = "peer call",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not schemes:
            raise InvalidArgument(f"a {what} needs at least one peer transport scheme")
        self.schemes = tuple(schemes)
        self._backoff_s = backoff_s
        self._writes = writes
        self._transports: dict[str, PeerTransport] = dict(transports or {})
        self._options = {scheme: dict(o) for scheme, o in (options or {}).items()}
        self._what = what
        self._clock = clock
        self._backoff: dict[str, float] = {}  # node id -> passed over until

    # ---- routes --------------------------------------------------------------------

    def routes(self, node: NodeInfo) -> list[Route]:
        """Every (scheme, address) both sides have, in this node's order: for each of this node's
        schemes, the first endpoint of that scheme the node advertises."""
        out = []
        for scheme in self.schemes:
            endpoint = node.endpoint(scheme)
            if endpoint is not None:
                out.append(Route(scheme, f"{scheme}://{endpoint}"))
        return out

    def route(self, node: NodeInfo) -> Route | None:
        """How to reach ``node`` now (see the module docstring); None when no scheme fits."""
        first = None
        for r in self.routes(node):
            try:
                transport = self.transport(r.scheme)
            except StrataError:
                transport = None  # unusable here: the call says why
            if transport is not None and transport.same_host_only:
                if transport.reaches(r.address):
                    return Route(r.scheme, r.address, near=True)
            elif first is None:
                first = r
        return first

    def transport(self, scheme: str) -> PeerTransport:
        """The transport of ``scheme``, opened on first use."""
        transport = self._transports.get(scheme)
        if transport is None:
            transport = open_peer_transport(scheme, **self._options.get(scheme, {}))
            if self._writes and not transport.writes:
                raise InvalidArgument(f"the {scheme} peer transport cannot write blocks: {self._what}s need one "
                                      f"of {', '.join(self.schemes)} with writes")
            self._transports[scheme] = transport
        return transport

    # ---- back-off ------------------------------------------------------------------

    def usable(self, node_id: str, now: float | None = None) -> bool:
        """Whether ``node_id`` is not passed over now."""
        return self._backoff.get(node_id, 0.0) <= (self._clock() if now is None else now)

    def back_off(self, node_id: str, why: object, address: str = "") -> None:
        """Pass ``node_id`` over for the back-off period (none when it is 0), and say why."""
        if self._backoff_s > 0:
            self._backoff[node_id] = self._clock() + self._backoff_s
        where = f" ({address})" if address else ""
        log.warning("a %s to %s%s failed: %s; passing it over for %.1fs", self._what, node_id, where, why,
                    self._backoff_s)

    def succeeded(self, node_id: str) -> None:
        """A call to ``node_id`` worked: its back-off, if any, ends now."""
        self._backoff.pop(node_id, None)

    def forget(self, now: float | None = None) -> None:
        """Drop back-offs that ended."""
        now = self._clock() if now is None else now
        self._backoff = {n: t for n, t in self._backoff.items() if t > now}

    async def close(self) -> None:
        """Close every transport this directory opened (or was given)."""
        transports, self._transports = list(self._transports.values()), {}
        for transport in transports:
            try:
                await transport.close()
            except StrataError as err:
                log.warning("peer transport %s did not close cleanly: %s", transport.scheme, err)
