"""StoreGroup: one :class:`~kvstore.store.tiered.TieredStore` per arena, behind the store's own methods.

An *arena* is a group of namespaces with a shared-memory file, a RAM size
and a chain below it of its own (its own disk directory and share of the
disk). Isolation follows from the layout, not from checks on each read: a
tenant's puts can only evict blocks of its own arena, and a client that
maps one arena's file holds no byte of another's. The servicers call the
group exactly as they called one store:

- a call that names a namespace (put, get, allocate, lookup, exists, list,
  pin, stats...) goes to the store of that namespace's arena
  (:class:`~kvstore.store.namespace_rules.NamespaceRules`);
- a call that carries only ids (commit, abort, release, unpin, end_lease)
  goes by the id: each store puts its arena's index in the top bits of its
  lease and slot ids (``id_tag``; the other 55 bits stay random), so no
  shared table maps ids to stores and nothing has to be kept in step. With
  one arena (the default config) ids are 63 random bits;
- calls about the node (stats without a namespace, holdings, persist_ram,
  close, lease expiry) cover every store; stats sum them.

:meth:`only` gives the view of one arena, for a path that serves one arena
(its same-host socket): a namespace or an id of another arena there is
refused with :class:`WrongArena`, or is unknown, never served.

Errors, beyond :mod:`kvstore.errors`::

    StrataError
    └── InvalidArgument
        └── WrongArena    a namespace of another arena, on a path that serves one arena
"""

from __future__ import annotations

import copy
import itertools
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from kvstore.block import BlockKey, BlockMeta, TierName, validate_namespace
from kvstore.errors import InvalidArgument, UnknownLease
from kvstore.metrics import StoreMetrics
from kvstore.shm.arena import ShmArena
from kvstore.store.leases import MAX_ID_TAG, Lease, LeaseKind, tag_of
from kvstore.store.namespace_rules import EVERYTHING_ELSE, NamespaceRules
from kvstore.store.holds import Located
from kvstore.store.moves import Placed
from kvstore.store.tiered import Listed, SlotGrant, SlotWrite, StoreStats, TieredStore
from kvstore.tiers.base import MappableTier, TierStats

MAX_ARENAS = MAX_ID_TAG + 1


class WrongArena(InvalidArgument):
    """A namespace of another arena, on a path that serves one arena only."""


@dataclass(frozen=True, slots=True)
class StoreArena:
    """One arena: its name, its namespace rules as configured (:data:`EVERYTHING_ELSE` for the
    default arena), its store, and its index (the tag in its ids)."""

    name: str
    namespaces: tuple[str, ...]
    store: TieredStore
    index: int = 0

    @property
    def ram(self):
        """The host-RAM tier: the head, or the tier below the gpu tier when the chain starts there."""
        return next(level.tier for level in self.store.chain if level.name == TierName.HOST)

    @property
    def shm(self) -> ShmArena:
        """The shared-memory file a same-host client maps for this arena (the RAM tier's)."""
        return self.ram.arena


class StoreGroup:
    """The stores of every arena, the default one first. Thread-safe as the stores are: routing
    reads only what was fixed at construction."""

    def __init__(self, arenas: Sequence[StoreArena], *, metrics: StoreMetrics | None = None,
                 member: str | None = None) -> None:
        if not arenas or arenas[0].namespaces != EVERYTHING_ELSE:
            raise ValueError("a store group needs the default arena (namespaces ('*',)) first")
        if len(arenas) > MAX_ARENAS:
            raise ValueError(f"{len(arenas)} arenas; at most {MAX_ARENAS} fit the tag bits of lease ids")
        if [a.index for a in arenas] != list(range(len(arenas))):
            raise ValueError("arena indexes must be 0, 1, ... in order: they are the tags in lease ids")
        self.arenas = tuple(arenas)
        self._by_name = {a.name: a for a in arenas}
        self._rules = NamespaceRules([(a.name, a.namespaces) for a in arenas[1:]], arenas[0].name)
        self.metrics = metrics if metrics is not None else arenas[0].store.metrics
        self._member = member
        if member is not None and member not in self._by_name:
            raise ValueError(f"no arena {member!r}")

    def only(self, name: str) -> StoreGroup:
        """The view of arena ``name`` alone: namespaces and ids of the others are refused."""
        if name not in self._by_name:
            raise WrongArena(f"this daemon has no arena {name!r} (it may have restarted with other arenas): Attach again")
        view = copy.copy(self)
        view._member = name
        return view

    # ---- routing ---------------------------------------------------------------

    @property
    def default(self) -> StoreArena:
        return self.arenas[0]

    @property
    def member(self) -> StoreArena:
        """The arena of a one-arena view (:meth:`only`); the default arena of the whole group."""
        return self._by_name[self._member or self.default.name]

    def arena(self, name: str) -> StoreArena:
        return self._by_name[name]

    def arena_of(self, namespace: str) -> StoreArena:
        """The arena holding ``namespace`` (validated); on a one-arena view, only that one's."""
        arena = self._by_name[self._rules.arena_of(validate_namespace(namespace))]
        if self._member is not None and arena.name != self._member:
            raise WrongArena(
                f"namespace {namespace!r} belongs to arena {arena.name!r}, and this path serves arena "
                f"{self._member!r} only: Attach with namespace {namespace!r} and use the arena and socket it names"
            )
        return arena

    def store_for(self, namespace: str) -> TieredStore:
        return self.arena_of(namespace).store

    def _stores(self) -> Iterator[TieredStore]:
        for arena in self.arenas:
            if self._member is None or arena.name == self._member:
                yield arena.store

    def _by_id(self, lease_id: int) -> TieredStore | None:
        """The store that issued ``lease_id`` (by its tag), or None when no store of this view did."""
        if len(self.arenas) == 1:
            arena = self.arenas[0]
        else:
            tag = tag_of(lease_id)
            if tag >= len(self.arenas):
                return None
            arena = self.arenas[tag]
        if self._member is not None and arena.name != self._member:
            return None
        return arena.store

    def _split(self, ids: Iterable[int]) -> dict[TieredStore | None, list[int]]:
        by_store: dict[TieredStore | None, list[int]] = defaultdict(list)
        for lease_id in ids:
            by_store[self._by_id(lease_id)].append(lease_id)
        return by_store

    # ---- the store's methods -----------------------------------------------------

    @property
    def limits(self):
        return self.default.store.limits

    @property
    def head(self) -> MappableTier:
        """The head tier of :attr:`member`'s chain: a one-arena view's own, the default arena's for the
        whole group (the tier whose offsets Lookup and Allocate hand out)."""
        return self.member.store.head

    @property
    def chain(self):
        """:attr:`member`'s chain (as :attr:`head`)."""
        return self.member.store.chain

    def check_batch(self, items) -> None:
        self.default.store.check_batch(items)

    def create_namespace(self, namespace: str) -> None:
        self.store_for(namespace).create_namespace(namespace)

    def namespaces(self) -> list[str]:
        return sorted(itertools.chain.from_iterable(s.namespaces() for s in self._stores()))

    def put(self, key: BlockKey, data, meta: BlockMeta, deadline: float | None = None) -> tuple[bool, TierName]:
        return self.store_for(key.namespace).put(key, data, meta, deadline)

    def open_write(self, key: BlockKey, meta: BlockMeta):
        """A streamed block's writer, into its namespace's arena (see :meth:`TieredStore.open_write`)."""
        return self.store_for(key.namespace).open_write(key, meta)

    def get(self, key: BlockKey, *, local_only: bool = False):
        return self.store_for(key.namespace).get(key, local_only=local_only)

    def get_many(self, namespace: str, keys: Sequence[bytes], *, local_only: bool = False):
        return self.store_for(namespace).get_many(namespace, keys, local_only=local_only)

    def allocate(self, namespace: str, blocks, lease_s: float | None = None, deadline: float | None = None,
                 owner: str = "") -> list[SlotGrant]:
        return self.store_for(namespace).allocate(namespace, blocks, lease_s, deadline, owner)

    def commit(self, items: list[tuple[int, int]], owner: str = "") -> list[tuple[BlockKey, bool, TierName]]:
        """All or nothing, so within one arena: a Commit naming slots of two arenas is refused."""
        by_store = self._split(slot_id for slot_id, _ in items)
        if None in by_store:
            slot_id = by_store[None][0]
            raise UnknownLease(f"no slot lease {slot_id}: it was never issued by this daemon (it may have restarted)")
        if len(by_store) > 1:
            raise InvalidArgument(
                "a Commit names slots of more than one arena: commit each Allocate's slots in their own Commit"
            )
        [store] = by_store or [self._by_name[self._member or self.default.name].store]  # none: the store says why
        return store.commit(items, owner)

    def writing(self, slot_id: int, owner: str = "") -> AbstractContextManager[SlotWrite]:
        """The daemon's own write into a slot, in the store that issued it (see :meth:`TieredStore.writing`)."""
        store = self._by_id(slot_id)
        if store is None:
            raise UnknownLease(f"no slot lease {slot_id}: it was never issued by this daemon (it may have restarted)")
        return store.writing(slot_id, owner)

    def abort(self, slot_ids: Iterable[int], owner: str = "") -> None:
        slot_ids = list(slot_ids)
        self.check_batch(slot_ids)  # the whole request, before it is split by arena
        for store, ids in self._split(slot_ids).items():
            if store is not None:  # unknown ids are already given back, as in one store
                store.abort(ids, owner)

    def lookup(self, namespace: str, keys: list[bytes], lease_s: float | None = None, deadline: float | None = None,
               owner: str = "", *, local_only: bool = False) -> list[Located | None]:
        return self.store_for(namespace).lookup(namespace, keys, lease_s, deadline, owner, local_only=local_only)

    def release(self, lease_ids: Iterable[int], owner: str = "") -> list[bool]:
        lease_ids = list(lease_ids)
        self.check_batch(lease_ids)  # the whole request, before it is split by arena
        valid = dict.fromkeys(lease_ids, False)
        for store, ids in self._split(lease_ids).items():
            if store is not None:
                for lease_id, ok in zip(ids, store.release(ids, owner)):
                    valid[lease_id] = ok
        # A repeated id: the first release counts, as in one store.
        out, seen = [], set()
        for lease_id in lease_ids:
            out.append(valid[lease_id] and lease_id not in seen)
            seen.add(lease_id)
        return out

    def exists(self, namespace: str, keys: list[bytes]) -> list[TierName]:
        return self.store_for(namespace).exists(namespace, keys)

    def touch(self, namespace: str, keys: list[bytes]) -> int:
        return self.store_for(namespace).touch(namespace, keys)

    def place(self, namespace: str, keys: list[bytes], warm: bool) -> Placed:
        return self.store_for(namespace).place(namespace, keys, warm)

    def delete(self, namespace: str, keys: list[bytes]) -> int:
        return self.store_for(namespace).delete(namespace, keys)

    def list_keys(self, namespace: str, prefix: bytes = b"", page_size: int = 0, page_token: bytes = b"") -> tuple[list[Listed], bytes]:
        return self.store_for(namespace).list_keys(namespace, prefix, page_size, page_token)

    def lease(self, namespace: str, keys: list[bytes], kind: LeaseKind, lease_s: float | None = None,
              owner: str = "") -> tuple[Lease, list[bytes]]:
        return self.store_for(namespace).lease(namespace, keys, kind, lease_s, owner)

    def end_lease(self, lease_id: int, kind: LeaseKind, owner: str = "") -> bool:
        store = self._by_id(lease_id)
        return False if store is None else store.end_lease(lease_id, kind, owner)

    def meta(self, namespace: str, key: bytes) -> BlockMeta | None:
        return self.store_for(namespace).meta(namespace, key)

    def extend_lease(self, lease_id: int, kind: LeaseKind, lease_s: float) -> float:
        store = self._by_id(lease_id)
        if store is None:
            raise UnknownLease(f"no {kind.value} lease {lease_id}: it was never issued by this daemon")
        return store.extend_lease(lease_id, kind, lease_s)

    def pin(self, namespace: str, keys: list[bytes], lease_s: float | None = None, owner: str = "") -> tuple[Lease, list[bytes]]:
        return self.lease(namespace, keys, LeaseKind.PIN, lease_s, owner)

    def unpin(self, lease_id: int, owner: str = "") -> bool:
        return self.end_lease(lease_id, LeaseKind.PIN, owner)

    # ---- the node's view -----------------------------------------------------------

    def stats(self, namespace: str = "") -> StoreStats:
        """A namespace's arena's stats; without one, the sum over every arena (tiers summed by name)."""
        if namespace:
            return self.store_for(namespace).stats(namespace)
        parts = [s.stats() for s in self._stores()]
        return StoreStats(
            tiers=sum_tiers(p.tiers for p in parts),
            blocks=sum(p.blocks for p in parts),
            pinned_blocks=sum(p.pinned_blocks for p in parts),
            active_leases=sum(p.active_leases for p in parts),
            open_slots=sum(p.open_slots for p in parts),
            demotion_queue_depth=sum(p.demotion_queue_depth for p in parts),
            namespaces=sorted(itertools.chain.from_iterable(p.namespaces for p in parts)),
        )

    def tier_stats(self) -> list[TierStats]:
        return sum_tiers(s.tier_stats() for s in self._stores())

    def arena_tier_stats(self) -> Iterator[tuple[str, TierStats]]:
        for arena in self.arenas:
            for t in arena.store.tier_stats():
                yield arena.name, t

    def demotion_queue_depth(self) -> int:
        return sum(s.demotion_queue_depth() for s in self._stores())

    def holdings(self, page_blocks: int = 4096) -> Iterator[tuple[BlockKey, TierName]]:
        for store in self._stores():
            yield from store.holdings(page_blocks)

    def expire_leases(self) -> None:
        for store in self._stores():
            store.expire_leases()

    def flush_demotions(self) -> None:
        for store in self._stores():
            store.flush_demotions()

    def flush_recency(self) -> int:
        return sum(store.flush_recency() for store in self._stores())

    def persist_ram(self, deadline: float, evict: bool = True) -> int:
        """Each arena's RAM-only blocks down its chain, the default arena first, until ``deadline``
        (``evict``: as :meth:`TieredStore.persist_ram`)."""
        return sum(store.persist_ram(deadline, evict=evict) for store in self._stores())

    def close(self) -> None:
        for store in self._stores():
            store.close()


def sum_tiers(per_store: Iterable[Iterable[TierStats]]) -> list[TierStats]:
    """Tier stats of several stores added up by tier name, in the order tiers first appear."""
    total: dict[TierName, list[int]] = {}
    degraded: dict[TierName, list[str]] = {}  # every arena's reason, once each: a tier is degraded if any arena's is
    for tiers in per_store:
        for t in tiers:
            acc = total.setdefault(t.tier, [0, 0, 0])
            acc[0] += t.used_bytes
            acc[1] += t.capacity_bytes
            acc[2] += t.blocks
            reasons = degraded.setdefault(t.tier, [])
            if t.degraded and t.degraded not in reasons:
                reasons.append(t.degraded)
    return [
        TierStats(tier, used, cap, blocks, "; ".join(degraded[tier])) for tier, (used, cap, blocks) in total.items()
    ]


def watch_group(metrics: StoreMetrics, group: StoreGroup) -> None:
    """The node's tier gauges, summed over arenas (the series a one-arena node always had), plus
    per-arena gauges when there is more than one arena."""
    metrics.watch_tiers(group.tier_stats, group.demotion_queue_depth)
    if len(group.arenas) > 1:
        metrics.watch_arenas(group.arena_tier_stats)

