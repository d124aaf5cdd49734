"""Placement in the head: room for a new block, a block adopted, a block promoted.

The head (the shared arena) is where every write lands and every promoted
read goes. Room is made by the eviction rules of :mod:`~kvstore.store.eviction`:
copies with a twin below go at once, others are queued for the write-behind
workers, and a writer waits for them until its deadline, then gets
``TierFull`` with a retry delay — never an unbounded wait. Above the high
watermark the head starts demoting in the background, down to the low one.

Why the wait is counted in rounds, not only timed. A writer's deadline is
read from the store's clock, which tests freeze and which says nothing of
whether waiting helps: a disk that refuses every write, and whose full
period is over by the next look, took each round's copies and freed
nothing, so the writer demoted again, and again, until its deadline (for
ever with a frozen clock). A writer now waits on the store's condition for
the copies in flight to end (``copies_ended`` moves). A wait after which
copies ended but none landed below (``copies_landed``) and no room came
free is *fruitless*; after ``MAX_FRUITLESS_ROUNDS`` of them in a row, or
``MAX_IDLE_WAITS`` waits in a row in which no copy ended at all, the writer
is refused with a retry delay, whatever the clock says. Copies that land
are progress, even when another writer takes the room they made: that
writer waits on, until its deadline.
"""

from __future__ import annotations

import logging

from kvstore.block import BlockKey, BlockMeta, TierName
from kvstore.errors import TierFull, TierUnavailable
from kvstore.store.demotion import Demoter
from kvstore.store.entries import Entry
from kvstore.store.eviction import plan_eviction
from kvstore.store.state import StorePart, StoreState

log = logging.getLogger(__name__)

WAIT_S = 0.05  # one wait for copies in flight (real time): the condition wakes it sooner when one ends
MAX_FRUITLESS_ROUNDS = 3  # waits in a row whose copies all ended without landing below
MAX_IDLE_WAITS = 200  # waits in a row in which no copy ended: 10 s of a stalled write-behind, whatever the clock


class HeadPlacement(StorePart):
    def __init__(self, state: StoreState, demoter: Demoter) -> None:
        super().__init__(state)
        self._demoter = demoter
        self._bytes_in = state.metrics.bytes_in.labels(state.head.name.label)
        self._high_bytes = state.limits.high_watermark * state.head.capacity_bytes

    def reserve(self, size: int, deadline: float | None) -> int:
        """A head extent of ``size`` bytes, evicting and waiting (until ``deadline``) as needed."""
        if deadline is None:
            deadline = self._clock() + self._s.limits.put_wait_s
        fruitless = idle = 0
        with self._s.locked():
            while True:
                self._s.expire_locked()
                try:
                    return self._head.reserve(size)
                except TierFull:
                    pass
                freed, pending = self._make_room_locked(size)
                if freed:
                    continue
                remaining = deadline - self._clock()
                if not pending or remaining <= 0 or fruitless >= MAX_FRUITLESS_ROUNDS or idle >= MAX_IDLE_WAITS:
                    raise self._no_room(size, copies_failed=fruitless >= MAX_FRUITLESS_ROUNDS)
                used, ended, landed = self._head.used_bytes, self._s.copies_ended, self._s.copies_landed
                self._wait_for_copies_locked(ended, remaining)
                if self._s.copies_ended == ended:
                    idle += 1
                    continue
                idle = 0
                if self._s.copies_landed == landed and self._head.used_bytes >= used:
                    fruitless += 1  # copies ended, none of them landed below, and no room came free
                else:
                    fruitless = 0  # progress: the next round may find its room

    def _wait_for_copies_locked(self, ended: int, remaining: float) -> None:
        """Until a copy in flight ends (or ``WAIT_S``): inline, by writing the queued copies here."""
        if not self._demoter.threaded:
            self._cond.release()
            try:
                self._s.run_deletes()
                self._demoter.flush()
            finally:
                self._cond.acquire()
            if self._s.copies_ended != ended:
                return  # the copies were written here; otherwise another thread is writing them: wait
        self._cond.wait_for(lambda: self._s.copies_ended != ended, timeout=min(remaining, WAIT_S))

    def _no_room(self, size: int, copies_failed: bool) -> TierFull:
        stats = self._head.stats()
        full = self._s.full_below(self._head.name)
        below = self._chain.below(self._head.name)
        if full is not None:
            why = f"the {full.label} tier below is full, so nothing can go down and no block is dropped for it"
        elif copies_failed and below is not None:
            why = f"every copy down to the {below.name.label} tier ended without making room"
        else:
            why = "the rest is pinned, leased or being demoted"
        return TierFull(
            f"the {self._head.name.label} tier has no room for {size} bytes ({stats.used_bytes} of "
            f"{stats.capacity_bytes} used, largest free extent {self._head.largest_free_bytes}; {why}): "
            "retry later, unpin blocks, or raise --ram-bytes",
            retry_after_s=1.0 if full is not None or copies_failed else 0.1,
        )

    def adopt(self, key: BlockKey, offset: int, meta: BlockMeta, verify: bool) -> tuple[bool, TierName]:
        head = self._head.name
        with self._cond:
            entry = self._catalog.get(key)
            if entry is not None and not entry.deleted:
                self._head.unreserve(offset)  # lost a race with another writer of the same key
                self._cond.notify_all()
                return False, self._s.best(entry)
            if entry is not None and entry.tiers:
                # Deleted but still pinned by a reader: revive it. Keys are
                # content- or prefix-addressed, so the bytes are the same.
                entry.deleted = False
                self._head.unreserve(offset)
                self._cond.notify_all()
                self._s.stored_locked(key, entry, self._s.best(entry))
                return True, self._s.best(entry)
            if not self._head.commit(key, offset, meta, verify=verify):
                self._cond.notify_all()
                return False, head
            if entry is not None:  # a pinned tombstone (its copies are gone): this write brings it back
                entry.meta, entry.deleted = meta, False
                entry.tiers.add(head)
            else:
                entry = Entry(meta, {head})
                self._catalog.add(key, entry)
            self._recency.add(head, key)
            self._bytes_in.inc(meta.size)
            self._s.stored_locked(key, entry, head)
            self.write_through_locked(key, entry)
            self.keep_headroom_locked()
            return True, head

    def promote(self, key: BlockKey, data: bytes, meta: BlockMeta, deadline: float | None, source: TierName) -> bool:
        """Copy a block read below up into the head (keeping the lower copy); False when there is no room in time."""
        head = self._head.name
        try:
            offset = self.reserve(meta.size, deadline)
        except TierFull:
            return False
        try:
            self._head.write_extent(offset, data)
        except BaseException:
            with self._cond:
                self._head.unreserve(offset)
                self._cond.notify_all()
            raise
        with self._cond:
            entry = self._catalog.live(key)
            if entry is None or head in entry.tiers:
                self._head.unreserve(offset)
                self._cond.notify_all()
                return entry is not None and head in entry.tiers
            try:
                self._head.commit(key, offset, meta, verify=False)
            except (TierFull, TierUnavailable) as err:  # the head could not keep it (it freed the extent)
                self._cond.notify_all()
                log.debug("block %s stays in the %s tier, not promoted: %s", key, source.label, err)
                return False
            entry.tiers.add(head)
            self._recency.add(head, key)
            self._s.moved_locked(key, entry, source, head)
            self._s.metrics.promotions.inc()
            self._bytes_in.inc(meta.size)
            return True

    def keep_headroom_locked(self) -> None:
        if self._head.used_bytes <= self._high_bytes:
            return
        stats = self._head.stats()
        below = self._s.usable_below(self._head.name)
        if below is not None and self._clock() >= self._s.no_headroom_until.get(below.name, 0.0):
            target_free = int((1 - self._s.limits.low_watermark) * stats.capacity_bytes)
            self._make_room_locked(target_free - (stats.capacity_bytes - stats.used_bytes), background=True)

    def _make_room_locked(self, need: int, background: bool = False) -> tuple[bool, bool]:
        """Evict from the head; returns (freed now, copies down pending)."""
        head = self._head.name
        below = self._s.usable_below(head)
        plan = plan_eviction(
            head, need, self._catalog, self._recency, can_demote=below is not None, background=background,
            can_drop=self._s.full_below(head) is None, held_namespaces=self._s.full_namespaces_below(head),
        )
        self._s.apply_plan_locked(head, plan, below, self._demoter.offer, may_drop=not background)
        return plan.frees_now, self._s.demoting > 0

    def write_through_locked(self, key: BlockKey, entry: Entry) -> None:
        self._s.write_through_locked(key, entry, self._head.name, self._demoter.offer)
