"""The pusher: how this node's replicator reaches other nodes' stores (copies, holds, releases).

One per replicator, shared by namespace replication and pinned copies, so
both see the same back-off and the same pooled connections. A target is a
live node (:class:`~kvstore.index.base.NodeInfo`) that advertises a peer
transport with writes (:data:`~kvstore.peer.registry.PUSH_SCHEMES`, the
first one it has); every call has the ``push_s`` deadline. Which transport,
and which targets are passed over for ``backoff_s`` after a failed call
(:meth:`usable` says no), is the :class:`~kvstore.peer.directory.PeerDirectory`'s
answer, as for the peer tier's reads: a dead or refusing node costs one
failed call per back-off period, not one per block.

Calls return the transport's answers and raise its errors
(:class:`~kvstore.errors.StrataError`); the callers decide what a failure
means for their copies. :func:`rank` orders candidate targets the same way
on every node (rendezvous hashing).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from kvstore.block import BlockMeta
from kvstore.errors import InvalidArgument, StrataError
from kvstore.index.base import NodeInfo
from kvstore.peer.base import Held, PeerTransport
from kvstore.peer.directory import PeerDirectory
from kvstore.peer.registry import schemes

log = logging.getLogger(__name__)


def rank(key: bytes, node_ids: Iterable[str]) -> list[str]:
    """``node_ids`` in rendezvous order for ``key``: the same order on every node, spread over keys."""
    return sorted(node_ids, key=lambda n: (hashlib.blake2b(n.encode() + b"\0" + key, digest_size=8).digest(), n))


class Pusher:
    """Not thread-safe: the replicator's event loop calls it."""

    def __init__(self, node_id: str, *, push_s: float, backoff_s: float, token: str = "",
                 transports: Mapping[str, PeerTransport] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.node_id = node_id
        self._push_s = push_s
        push = schemes(writes=True)
        self.directory = PeerDirectory(push, backoff_s=backoff_s, writes=True, transports=transports,
                                       options={s: {"token": token} for s in push} if token else None,
                                       what="replication call", clock=clock)

    # ---- targets ---------------------------------------------------------------------

    def endpoint(self, node: NodeInfo) -> tuple[str, str] | None:
        """(scheme, scheme://host:port) of the node's first transport this node pushes with."""
        if node.node_id == self.node_id:
            return None
        route = self.directory.route(node)
        return None if route is None else (route.scheme, route.address)

    def usable(self, node: NodeInfo, now: float) -> bool:
        """Whether ``node`` can be pushed to now: it has a push endpoint and is not backed off."""
        return self.endpoint(node) is not None and self.directory.usable(node.node_id, now)

    def back_off(self, node_id: str, why: object) -> None:
        self.directory.back_off(node_id, why)

    def forget(self, now: float) -> None:
        """Drop back-offs that ended."""
        self.directory.forget(now)

    # ---- calls ---------------------------------------------------------------------------

    async def write(self, node: NodeInfo, namespace: str, key: bytes, data, meta: BlockMeta) -> tuple[bool, object]:
        """Copy one block to ``node``: (stored or already there, why not). A failure backs the node off."""
        try:
            transport, address = self._route(node)
            [result] = await transport.write(address, namespace, [(key, data, meta)], self._deadline())
            ok, why = result.ok, result.error
        except StrataError as err:
            ok, why = False, err
        if not ok:
            self.back_off(node.node_id, why)
        return ok, why

    async def hold(self, node: NodeInfo, namespace: str, keys: Sequence[bytes], lease_s: float) -> Held:
        """Pin ``keys`` at ``node`` for ``lease_s``; raises the transport's error (and backs the node off)."""
        try:
            transport, address = self._route(node)
            return await transport.hold(address, namespace, keys, lease_s, self._deadline())
        except StrataError as err:
            self.back_off(node.node_id, err)
            raise

    async def release(self, node: NodeInfo, lease_ids: Sequence[int]) -> list[bool]:
        """End holds at ``node``; raises the transport's error (no back-off: a release is best effort)."""
        transport, address = self._route(node)
        return await transport.release(address, lease_ids, self._deadline())

    def _deadline(self) -> float:
        return time.monotonic() + self._push_s

    def _route(self, node: NodeInfo) -> tuple[PeerTransport, str]:
        endpoint = self.endpoint(node)
        if endpoint is None:
            raise InvalidArgument(f"node {node.node_id} advertises no peer transport to push to "
                                  f"({', '.join(self.directory.schemes)})")
        scheme, address = endpoint
        return self.directory.transport(scheme), address

    async def close(self) -> None:
        await self.directory.close()
