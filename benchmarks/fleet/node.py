"""One node's cache, decided by the store's own code: its catalogue, its recency and its eviction plan.

What runs of Strata here, unchanged: :class:`kvstore.store.entries.Catalog`
(every block the node knows, where its copies are, which blocks name it as
parent), :class:`kvstore.store.recency.Recency` (the one least-recently-used
order per tier the daemon evicts by) and
:func:`kvstore.store.eviction.plan_eviction` (which blocks leave a full tier,
and whether each is dropped, demoted or only loses a copy it has elsewhere).
What this class does is what :class:`~kvstore.store.state.StoreState` does
with a plan (``apply_plan_locked``), with capacities counted instead of
arenas and files holding bytes, and with copies down the chain landing at
once (virtual time) instead of on the store's demotion threads.

The chain is the daemon's ``[ram, disk, peer, object]``, each part optional:
RAM evicts down to disk, disk down to the object tier (the peer tier takes
no demotions: the chain passes over it, as
:meth:`~kvstore.store.chain.TierChain.target_below` does); a read from a
lower tier is promoted into RAM. A block read from a peer or the bucket is
catalogued as held there too (as the store's ``read_through`` does), so
evicting its RAM copy later only drops that copy. A block no tier will take
(RAM full of blocks that may not leave) is refused, as the store refuses a
write with ``TierFull``; :attr:`refused` counts them.

Every change of a block's best tier is recorded in :attr:`changes` (what
the store's events tell the index agent), for the fleet to publish.
"""

from __future__ import annotations

from kvstore.block import BlockKey, BlockMeta, TierName
from kvstore.store.entries import Catalog, Entry
from kvstore.store.eviction import plan_eviction
from kvstore.store.recency import Recency

HOST, DISK, PEER, OBJECT = TierName.HOST, TierName.DISK, TierName.PEER, TierName.OBJECT
LOCAL = (HOST, DISK)
CHAIN = (HOST, DISK, PEER, OBJECT)  # the daemon's order, best first


class NodeStore:
    def __init__(self, ram_bytes: int | None, disk_bytes: int = 0, *, peer: bool = False, bucket: bool = False) -> None:
        """``ram_bytes`` None: unlimited. ``disk_bytes`` 0: no disk tier."""
        self.tiers = [HOST] + ([DISK] if disk_bytes else []) + ([PEER] if peer else []) + ([OBJECT] if bucket else [])
        self.capacity = {HOST: ram_bytes, DISK: disk_bytes}
        self.used = {HOST: 0, DISK: 0}
        self.catalog = Catalog()
        self.recency = Recency(self.tiers, persistent=())
        self._rank = {t: i for i, t in enumerate(CHAIN)}
        # Where an eviction from each local tier sends its blocks: the next local tier, else the bucket.
        self._below = {HOST: DISK if disk_bytes else (OBJECT if bucket else None), DISK: OBJECT if bucket else None}
        self.changes: dict[BlockKey, TierName | None] = {}
        self.bucket_writes: list[BlockKey] = []  # blocks demoted into the object tier since the fleet last looked
        self.refused = 0
        self.evicted = {HOST: 0, DISK: 0}

    # ---- reads -------------------------------------------------------------------

    def find(self, key: BlockKey) -> TierName | None:
        """The best local tier holding ``key`` (a use: it becomes the most recent there), or None."""
        entry = self.catalog.entries.get(key)
        if entry is None:
            return None
        local = [t for t in entry.tiers if t in LOCAL]
        if not local:
            return None
        self.recency.touch(key, entry.tiers)
        return min(local, key=self._rank.__getitem__)

    def promote(self, key: BlockKey, meta: BlockMeta, source: TierName) -> None:
        """A read served from ``source`` (disk, a peer, the bucket) is copied up into RAM."""
        entry = self.catalog.entries.get(key)
        if entry is None:  # read through from a remote tier: catalogued as held there
            entry = Entry(meta, {source})
            self.catalog.add(key, entry)
            self.recency.add(source, key)
        elif source not in entry.tiers and source in (PEER, OBJECT):
            entry.tiers.add(source)
            self.recency.add(source, key)
        self._place(key, entry)

    # ---- writes ------------------------------------------------------------------

    def store(self, key: BlockKey, meta: BlockMeta) -> bool:
        """A block this node computed, into RAM; False when RAM had no room that could be made."""
        entry = self.catalog.entries.get(key)
        if entry is None:
            entry = Entry(meta)
            self.catalog.add(key, entry)
        return self._place(key, entry)

    def _place(self, key: BlockKey, entry: Entry) -> bool:
        if HOST in entry.tiers:
            self.recency.touch(key, entry.tiers)
            return True
        if not self._room(HOST, entry.meta.size):
            self.refused += 1
            if not entry.tiers:
                self.catalog.remove(key)
            return False
        self._add_copy(key, entry, HOST)
        return True

    def _add_copy(self, key: BlockKey, entry: Entry, tier: TierName) -> None:
        entry.tiers.add(tier)
        self.recency.add(tier, key)
        if tier in self.used:
            self.used[tier] += entry.meta.size
        self._changed(key, entry)

    def _room(self, tier: TierName, size: int) -> bool:
        """Make ``size`` bytes free in ``tier`` by the store's eviction plan; False when it cannot."""
        capacity = self.capacity[tier]
        if capacity is None:
            return True
        if size > capacity:
            return False
        while capacity - self.used[tier] < size:
            below = self._below[tier]
            plan = plan_eviction(tier, size - (capacity - self.used[tier]), self.catalog, self.recency,
                                 can_demote=below is not None)
            before = self.used[tier]
            for key in plan.drop_copy:
                self._drop_copy(key, tier)
            for key in plan.drop:
                self._remove(key)
            for key in plan.demote:
                self._demote(key, tier, below)
            if self.used[tier] == before:  # nothing could leave (an empty plan, or nowhere to demote to)
                return False
        return True

    def _demote(self, key: BlockKey, tier: TierName, below: TierName) -> None:
        """The copy down lands at once (virtual time), then the copy above goes (``evict=True``)."""
        entry = self.catalog.entries[key]
        if below is OBJECT:
            entry.tiers.add(OBJECT)
            self.recency.add(OBJECT, key)
            self.bucket_writes.append(key)
        elif self._room(below, entry.meta.size):
            entry.tiers.add(below)
            self.recency.add(below, key)
            self.used[below] += entry.meta.size
        else:  # nowhere below: the store keeps it (it would retry), never loses a block it could not move
            return
        self._drop_copy(key, tier)

    def _drop_copy(self, key: BlockKey, tier: TierName) -> None:
        entry = self.catalog.entries[key]
        if len(entry.tiers) == 1:
            self._remove(key)
            return
        entry.tiers.discard(tier)
        self.recency.discard(tier, key)
        self.used[tier] -= entry.meta.size
        self.evicted[tier] += 1
        self._changed(key, entry)

    def _remove(self, key: BlockKey) -> None:
        entry = self.catalog.remove(key)
        for tier in entry.tiers:
            self.recency.discard(tier, key)
            if tier in self.used:
                self.used[tier] -= entry.meta.size
                self.evicted[tier] += 1
        entry.tiers.clear()
        self.changes[key] = None

    def _changed(self, key: BlockKey, entry: Entry) -> None:
        self.changes[key] = min(entry.tiers, key=self._rank.__getitem__)

    def take_changes(self) -> dict[BlockKey, TierName | None]:
        out, self.changes = self.changes, {}
        return out
