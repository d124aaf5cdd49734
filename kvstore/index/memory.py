"""The embedded prefix index: plain dictionaries in this process, one event loop.

The daemon's default when no Redis is configured (it then knows only its own
holdings), and the reference the Redis index is tested against: both pass
``tests/index/test_index_contract.py``.

Every holder row is tagged with an *incarnation*, a number this index hands
out each time a node (re)starts membership. An answer counts a row only if
its incarnation is the node's current one and the node is alive, so a node
that restarts, leaves or misses its heartbeats drops out of every answer at
once while its rows wait for :meth:`MemoryIndex.sweep`. Membership rules
(shared with :class:`~kvstore.index.redis.RedisIndex`):

- ``join`` with a greater epoch, or with the same epoch after the node
  expired, starts a new incarnation; the same epoch while alive only
  refreshes the TTL; a smaller epoch raises ``StaleEpoch``;
- an incarnation that expired never comes back: ``heartbeat`` and writes
  then raise ``StaleEpoch`` and the node must join again and re-add its
  blocks (its old rows may already be half swept);
- ``leave`` forgets the node and deletes its rows at once.

Time comes from an injectable monotonic clock so tests can move it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvstore.block import TierName, validate_namespace
from kvstore.errors import StaleEpoch
from kvstore.index.base import (
    Holder,
    NodeInfo,
    NodeMatch,
    PrefixIndex,
    check_blocks,
    check_budget,
    check_candidates,
    check_contact,
    check_keys,
    check_node,
    check_node_id,
    check_served,
    check_ttl,
    sort_matches,
)


@dataclass(slots=True)
class _Member:
    epoch: int
    incarnation: int
    deadline: float
    address: str = ""
    transports: tuple[str, ...] = ()
    served: tuple[tuple[str, int], ...] = ()


@dataclass(slots=True)
class _Incarnation:
    node_id: str
    epoch: int
    rows: dict[str, set[bytes]] = field(default_factory=dict)  # namespace -> keys it holds (the reverse set)


class MemoryIndex(PrefixIndex):
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._members: dict[str, _Member] = {}
        self._incarnations: dict[int, _Incarnation] = {}  # every incarnation that still has rows, or is current
        self._next_incarnation = 1
        self._rows: dict[str, dict[bytes, dict[int, TierName]]] = {}  # namespace -> key -> incarnation -> tier

    # ---- membership ------------------------------------------------------------

    async def join(
        self, node_id: str, epoch: int, ttl_s: float, *, address: str = "", transports: Sequence[str] = ()
    ) -> None:
        check_node(node_id, epoch)
        check_ttl(ttl_s)
        address, transports = check_contact(address, transports)
        now = self._clock()
        m = self._members.get(node_id)
        if m is not None:
            if epoch < m.epoch:
                raise StaleEpoch(_older(node_id, epoch, m.epoch))
            if epoch == m.epoch and m.deadline > now:
                m.deadline = now + ttl_s
                m.address, m.transports = address, transports
                return
        inc = self._next_incarnation
        self._next_incarnation += 1
        self._incarnations[inc] = _Incarnation(node_id, epoch)
        self._members[node_id] = _Member(epoch, inc, now + ttl_s, address, transports)
        if m is not None:
            self._forget_if_empty(m.incarnation)

    async def heartbeat(self, node_id: str, epoch: int, ttl_s: float, *, served: Mapping[str, int] | None = None) -> None:
        check_node(node_id, epoch)
        check_ttl(ttl_s)
        counters = check_served(served)
        m = self._current(node_id, epoch)
        m.deadline = self._clock() + ttl_s
        if counters is not None:
            m.served = counters

    async def leave(self, node_id: str) -> None:
        check_node_id(node_id)
        m = self._members.pop(node_id, None)
        if m is not None:
            self._drop_rows(m.incarnation, None)
            self._forget_if_empty(m.incarnation)

    async def nodes(self) -> list[NodeInfo]:
        now = self._clock()
        return sorted(
            (NodeInfo(n, m.epoch, m.deadline > now, m.address, m.transports, m.served)
             for n, m in self._members.items()),
            key=lambda i: i.node_id,
        )

    # ---- writes ----------------------------------------------------------------

    async def add(self, namespace: str, node_id: str, epoch: int, blocks: Sequence[tuple[bytes, TierName]]) -> None:
        validate_namespace(namespace)
        check_node(node_id, epoch)
        checked = check_blocks(blocks)
        inc = self._current(node_id, epoch).incarnation
        rows = self._rows.setdefault(namespace, {})
        mine = self._incarnations[inc].rows.setdefault(namespace, set())
        for key, tier in checked:
            rows.setdefault(key, {})[inc] = tier
            mine.add(key)

    async def remove(self, namespace: str, node_id: str, epoch: int, keys: Sequence[bytes]) -> None:
        validate_namespace(namespace)
        check_node(node_id, epoch)
        checked = check_keys(keys, allow_empty=True)
        inc = self._current(node_id, epoch).incarnation
        mine = self._incarnations[inc].rows.get(namespace)
        if not mine:
            return
        for key in checked:
            if key in mine:
                mine.discard(key)
                self._drop_row(namespace, key, inc)

    async def clear(self, node_id: str, namespace: str | None = None) -> None:
        check_node_id(node_id)
        if namespace is not None:
            validate_namespace(namespace)
        m = self._members.get(node_id)
        if m is not None:
            self._drop_rows(m.incarnation, namespace)

    # ---- reads -----------------------------------------------------------------

    async def lookup(
        self, namespace: str, keys: Sequence[bytes], candidates: Sequence[str] | None = None
    ) -> list[NodeMatch]:
        validate_namespace(namespace)
        chain = check_keys(keys)
        wanted = check_candidates(candidates)
        rows = self._rows.get(namespace, {})
        live = self._live_incarnations()
        counts: dict[str, int] = {}
        tiers: dict[str, TierName] = {}
        for depth, key in enumerate(chain):
            extended = False
            for inc, tier in rows.get(key, {}).items():
                node = live.get(inc)
                if node is None or (wanted is not None and node not in wanted) or counts.get(node, 0) != depth:
                    continue
                counts[node] = depth + 1
                tiers[node] = max(tiers.get(node, tier), tier)
                extended = True
            if not extended:
                break
        return sort_matches(NodeMatch(n, c, tiers[n]) for n, c in counts.items())

    async def holders(self, namespace: str, keys: Sequence[bytes]) -> list[list[Holder]]:
        validate_namespace(namespace)
        checked = check_keys(keys, allow_empty=True)
        rows = self._rows.get(namespace, {})
        live = self._live_incarnations()
        out = []
        for key in checked:
            found = [
                Holder(live[inc], tier, self._incarnations[inc].epoch)
                for inc, tier in rows.get(key, {}).items()
                if inc in live
            ]
            out.append(sorted(found, key=lambda h: h.node_id))
        return out

    # ---- maintenance -----------------------------------------------------------

    async def sweep(self, max_entries: int = 1000) -> int:
        check_budget(max_entries)
        live = self._live_incarnations()
        deleted = 0
        for inc in [i for i in self._incarnations if i not in live]:
            inc_rows = self._incarnations[inc].rows
            while inc_rows and deleted < max_entries:
                namespace, keys = next(iter(inc_rows.items()))
                while keys and deleted < max_entries:
                    self._drop_row(namespace, keys.pop(), inc)
                    deleted += 1
                if not keys:
                    del inc_rows[namespace]
            self._forget_if_empty(inc)
            if deleted >= max_entries:
                break
        return deleted

    # ---- internals -------------------------------------------------------------

    def _current(self, node_id: str, epoch: int) -> _Member:
        """The node's membership if ``epoch`` is its live, current one; StaleEpoch otherwise."""
        m = self._members.get(node_id)
        if m is None:
            raise StaleEpoch(f"node {node_id!r} is not a member of the prefix index: join it first")
        if epoch < m.epoch:
            raise StaleEpoch(_older(node_id, epoch, m.epoch))
        if epoch > m.epoch:
            raise StaleEpoch(f"node {node_id!r} joined at epoch {m.epoch}, not {epoch}: join at epoch {epoch} first")
        if m.deadline <= self._clock():
            raise StaleEpoch(_expired(node_id))
        return m

    def _live_incarnations(self) -> dict[int, str]:
        now = self._clock()
        return {m.incarnation: n for n, m in self._members.items() if m.deadline > now}

    def _drop_rows(self, inc: int, namespace: str | None) -> None:
        inc_rows = self._incarnations[inc].rows
        for ns in [namespace] if namespace is not None else list(inc_rows):
            for key in inc_rows.pop(ns, ()):
                self._drop_row(ns, key, inc)

    def _drop_row(self, namespace: str, key: bytes, inc: int) -> None:
        rows = self._rows[namespace]
        holders = rows[key]
        del holders[inc]
        if not holders:
            del rows[key]
            if not rows:
                del self._rows[namespace]

    def _forget_if_empty(self, inc: int) -> None:
        current = any(m.incarnation == inc for m in self._members.values())
        if not current and not self._incarnations[inc].rows:
            del self._incarnations[inc]


def _older(node_id: str, epoch: int, current: int) -> str:
    return (
        f"node {node_id!r} is at epoch {current}; epoch {epoch} is older: "
        "this process was replaced by a restarted one and must stop writing"
    )


def _expired(node_id: str) -> str:
    return f"node {node_id!r} missed its heartbeats and expired: join again and re-add its blocks"
