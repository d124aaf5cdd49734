"""The store's shared state and the bookkeeping every part of it does under its one lock.

:class:`~kvstore.store.tiered.TieredStore` is a facade over parts that each
do one job — placement in the head (:mod:`~kvstore.store.placement`), reads
down the chain (:mod:`~kvstore.store.reads`), copies down the chain
(:mod:`~kvstore.store.copies`) — and all of them decide on the same facts:
the catalogue, the recency, the leases, which tiers are failing, which
deletes are queued. Those facts and the small operations on them live here,
once: dropping a copy or a block, pins, lease expiry, publication to the
store's listener, and the rule that deletes in tiers other than the head
run after the lock is released (``locked()`` runs them).

Every method whose name ends in ``_locked`` must be called with ``cond``
held; the others take it themselves.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from kvstore.block import BlockKey, BlockMeta, TierName, validate_namespace
from kvstore.errors import TierUnavailable, UnknownNamespace
from kvstore.metrics import StoreMetrics
from kvstore.store.chain import Level, TierChain
from kvstore.store.checks import BlockChecks
from kvstore.store.demotion import Copy
from kvstore.store.entries import Catalog, Entry
from kvstore.events import BlockEvent, Evicted, Moved, Removed, Stored
from kvstore.store.eviction import EvictionPlan
from kvstore.store.leases import Lease, LeaseKind, LeaseTable
from kvstore.store.limits import StoreLimits
from kvstore.store.recency import Recency
from kvstore.tiers.base import Tier

log = logging.getLogger(__name__)


class EventSink(Protocol):
    """Where the store publishes its events: an :class:`~kvstore.events.EventBus`, or
    anything else whose ``publish`` is cheap and never blocks (it runs under the store lock)."""

    def publish(self, event: BlockEvent) -> None: ...


class _Locked:
    """``with state.locked():`` — a plain object, not a generator: it is on every hot path."""

    __slots__ = ("_state", "_cond")

    def __init__(self, state: StoreState) -> None:
        self._state = state
        self._cond = state.cond

    def __enter__(self) -> None:
        self._cond.acquire()

    def __exit__(self, *exc) -> None:
        self._cond.release()
        if self._state.deletes:
            self._state.run_deletes()


class StoreState:
    def __init__(
        self, chain: TierChain, limits: StoreLimits, metrics: StoreMetrics, clock: Callable[[], float],
        namespaces: Iterable[str], auto_create_namespaces: bool,
        events: EventSink | None, id_tag: int | None = None,
    ) -> None:
        self.chain = chain
        self.head = chain.head
        self.limits = limits
        self.checks = BlockChecks(limits)
        self.metrics = metrics
        self.clock = clock
        self.cond = threading.Condition(threading.Lock())
        self.catalog = Catalog()
        self.recency = Recency(chain.names, chain.persistent())
        self.leases = LeaseTable(limits.max_leases, id_tag, per_owner=limits.max_leases_per_owner)
        self.namespaces = {validate_namespace(ns) for ns in namespaces}
        self.auto_create = auto_create_namespaces
        # Told of every change (under the lock: publish never blocks): the
        # prefix index's and the metrics' feed.
        self.events = events
        self.unhealthy_until: dict[TierName, float] = {}  # a lower tier that failed a write: skipped until then
        self.unhealthy_reason: dict[TierName, str] = {}
        # A lower tier that could make no room for a copy (a full filesystem, or only pinned
        # blocks there): until then nothing is demoted into it, and the tier above keeps its
        # blocks rather than drop them; a writer that finds no room is refused, with a retry delay.
        self.full_until: dict[TierName, float] = {}
        self.no_headroom_until: dict[TierName, float] = {}  # a headroom copy found no room there: none until then
        # A lower tier full for one namespace (an object tier's quota): until then that namespace's
        # blocks stay in the tier above (neither demoted nor dropped); other namespaces go down.
        self.namespace_full_until: dict[tuple[TierName, str], float] = {}
        self.demoting = 0  # blocks marked for a copy down, queued or being written
        self.copies_ended = 0  # marked copies that ended, however: a writer waiting for room watches it
        self.copies_landed = 0  # of them, those whose block now has its copy below
        # Deletes of copies in tiers other than the head, run outside the lock.
        self.deletes: list[tuple[Tier, BlockKey]] = []
        # Extents of slots whose lease ran out unwritten: (when they may be reused, offset, size).
        # A same-host writer copies into its slot with no lock of ours; one that stalled past the
        # lease may still be copying, so the extent is not another block's until this hold ends.
        self.lapsed: deque[tuple[float, int, int]] = deque()
        self.lapsed_bytes = 0
        self.deleting: dict[tuple[TierName, BlockKey], int] = {}
        self._locked = _Locked(self)

    def locked(self) -> _Locked:
        """The store lock; deletes queued while it was held run once it is released."""
        return self._locked

    def best(self, entry: Entry) -> TierName:
        return self.chain.best(entry.tiers)

    def touch_locked(self, key: BlockKey, entry: Entry) -> None:
        self.recency.touch(key, entry.tiers)

    def unpin_locked(self, key: BlockKey, entry: Entry) -> None:
        entry.pins -= 1
        self.maybe_remove_locked(key, entry)

    def end_pins_locked(self, lease: Lease) -> None:
        # A pinned entry cannot be removed, so each key still maps to the
        # entry the lease pinned.
        for key in lease.keys:
            self.unpin_locked(key, self.catalog.entries[key])
        self.cond.notify_all()

    def maybe_remove_locked(self, key: BlockKey, entry: Entry) -> None:
        if entry.deleted and not entry.pins and not entry.demoting and self.catalog.get(key) is entry:
            self.remove_locked(key, entry)

    def drop_copy_locked(self, key: BlockKey, entry: Entry, tier: TierName) -> None:
        if tier not in entry.tiers:
            return
        if len(entry.tiers) == 1:
            self.remove_locked(key, entry)
            return
        self.free_copy_locked(tier, key)
        entry.tiers.discard(tier)
        if not entry.deleted:
            self.emit_locked(Evicted(key, tier, self.best(entry)))
        self.cond.notify_all()

    def forget_copy_locked(self, key: BlockKey, entry: Entry, tier: TierName) -> None:
        """Forget a copy its tier turned out not to have (a remote tier answered miss for it): nothing is
        deleted there. The block leaves the store when that was its last copy."""
        if tier not in entry.tiers:
            return
        self.recency.discard(tier, key)
        entry.tiers.discard(tier)
        if not entry.tiers:
            self.remove_locked(key, entry)
            return
        if not entry.deleted:
            self.emit_locked(Evicted(key, tier, self.best(entry)))
        self.cond.notify_all()

    def write_through_locked(self, key: BlockKey, entry: Entry, tier: TierName, offer: Callable[[Copy], bool]) -> None:
        """``key`` was just stored in ``tier``: when the edge below it writes through, queue a copy
        down at once (keeping this one). A full queue leaves it to eviction to demote later."""
        below = self.chain.target_below(tier, through=True)
        if below is None or below.name in entry.tiers:
            return
        now = self.clock()
        if now < self.unhealthy_until.get(below.name, 0.0) or now < self.full_until.get(below.name, 0.0):
            return
        if now < self.namespace_full_until.get((below.name, key.namespace), 0.0):
            return
        if self.mark_copy_locked(key, below.name) and not offer(Copy(key, tier, below.name, evict=False)):
            self.unmark_copy_locked(key)

    def remove_locked(self, key: BlockKey, entry: Entry) -> None:
        """The block leaves the store. One still pinned (a reader dropped its corrupt last copy
        while a lease names it) stays as an invisible tombstone until its last pin goes."""
        for tier in entry.tiers:
            self.free_copy_locked(tier, key)
        entry.tiers.clear()
        if not entry.deleted:  # a client's delete published its Removed already
            self.emit_locked(Removed(key, dropped=True))
        if entry.pins:
            entry.deleted = True
        else:
            self.catalog.remove(key)
        self.cond.notify_all()

    def free_copy_locked(self, tier: TierName, key: BlockKey) -> None:
        """Forget a copy now; free its bytes now in the head, after the lock elsewhere."""
        self.recency.discard(tier, key)
        if self.chain.is_head(tier):
            self.head.delete(key)
            return
        self.deletes.append((self.chain.tier(tier), key))
        self.deleting[(tier, key)] = self.deleting.get((tier, key), 0) + 1

    def run_deletes(self) -> None:
        """Delete the copies queued under the lock (disk unlinks), outside it."""
        with self.cond:
            deletes, self.deletes = self.deletes, []
        for tier, key in deletes:
            try:
                tier.delete(key)
            except TierUnavailable as err:  # the copy is forgotten; recovery drops or re-finds the file
                self.metrics.tier_errors.labels(tier.name.label).inc()
                log.warning("could not delete %s from the %s tier: %s", key, tier.name.label, err)
            finally:
                with self.cond:
                    left = self.deleting[(tier.name, key)] - 1
                    if left:
                        self.deleting[(tier.name, key)] = left
                    else:
                        del self.deleting[(tier.name, key)]

    def emit_locked(self, event: BlockEvent) -> None:
        if self.events is not None:
            self.events.publish(event)

    def stored_locked(self, key: BlockKey, entry: Entry, tier: TierName) -> None:
        """``key`` is now held in ``tier`` (written there, or found there by a read through)."""
        self.emit_locked(Stored(key, tier, entry.meta.size, self.best(entry)))

    def moved_locked(self, key: BlockKey, entry: Entry, source: TierName, target: TierName) -> None:
        """A copy of ``key`` was added in ``target`` from ``source`` (a promotion or a copy down)."""
        if not entry.deleted:
            self.emit_locked(Moved(key, source, target, self.best(entry)))

    def expire_locked(self) -> None:
        now = self.clock()
        expired = self.leases.pop_expired(now)
        for lease in expired:
            self.metrics.leases_expired.labels(lease.kind.value).inc()
            if lease.kind == LeaseKind.SLOT:
                self.free_slot_locked(lease, lapsed=True)
            self.end_pins_locked(lease)
        freed = self.lapsed and self.lapsed[0][0] <= now
        while self.lapsed and self.lapsed[0][0] <= now:
            _, offset, size = self.lapsed.popleft()
            self.lapsed_bytes -= size
            self.head.unreserve(offset)
        if freed:
            self.metrics.lapsed_slot_bytes.set(self.lapsed_bytes)
        if expired or freed:
            self.cond.notify_all()

    def free_slot_locked(self, lease: Lease, lapsed: bool = False) -> None:
        """Give back the extent of a slot that ended uncommitted (expired or aborted), unless the
        daemon is writing into it right now: then the last of those writes gives it back when it
        ends (:meth:`~kvstore.store.slots.SlotProtocol.writing`). Freed at once, the extent could
        be another block's before those bytes stop landing. A slot whose lease ran out
        (``lapsed``) may also have a same-host writer still copying into it: its extent is held
        for ``lapsed_slot_hold_s`` first (an aborted one is not: its writer said it stopped)."""
        lease.ended = True
        if lease.writing:
            return
        hold = self.limits.lapsed_slot_hold_s if lapsed else 0.0
        if hold <= 0:
            self.head.unreserve(lease.offset)
            return
        size = lease.meta.size if lease.meta is not None else 0
        self.lapsed.append((self.clock() + hold, lease.offset, size))
        self.lapsed_bytes += size
        self.metrics.lapsed_slot_bytes.set(self.lapsed_bytes)

    def pin_parent_locked(self, key: BlockKey, meta: BlockMeta) -> list[BlockKey]:
        """Pin the parent of a block being written, so eviction cannot take it meanwhile."""
        if not meta.parent:
            return []
        parent = BlockKey(key.namespace, meta.parent)
        entry = self.catalog.live(parent)
        if entry is None:
            return []
        entry.pins += 1
        return [parent]

    def usable_below(self, tier: TierName) -> Level | None:
        """The level copies go down to when it takes them now (its edge demotes and it has not just failed)."""
        below = self.chain.target_below(tier)
        if below is None:
            return None
        now = self.clock()
        if now < self.unhealthy_until.get(below.name, 0.0) or now < self.full_until.get(below.name, 0.0):
            return None
        return below

    def full_namespaces_below(self, tier: TierName) -> frozenset[str]:
        """The namespaces the tier below ``tier`` is full for now (their blocks stay above)."""
        if not self.namespace_full_until:
            return frozenset()
        below = self.chain.target_below(tier)
        now = self.clock()
        for k in [k for k, until in self.namespace_full_until.items() if until <= now]:
            del self.namespace_full_until[k]
        if below is None:
            return frozenset()
        return frozenset(ns for (t, ns) in self.namespace_full_until if t == below.name)

    def full_below(self, tier: TierName) -> TierName | None:
        """The tier copies go down to, when it is in its full period: the tier above then drops nothing of its own."""
        below = self.chain.target_below(tier)
        if below is None:
            return None
        return below.name if self.clock() < self.full_until.get(below.name, 0.0) else None

    def mark_copy_locked(self, key: BlockKey, dst: TierName) -> bool:
        entry = self.catalog.entries[key]
        if entry.demoting or (dst, key) in self.deleting:
            return False
        entry.demoting = True
        self.demoting += 1
        return True

    def unmark_copy_locked(self, key: BlockKey) -> None:
        entry = self.catalog.entries[key]
        entry.demoting = False
        self.demoting -= 1

    def end_copy_locked(self, key: BlockKey, entry: Entry) -> None:
        entry.demoting = False
        self.demoting -= 1
        self.copies_ended += 1
        self.maybe_remove_locked(key, entry)
        self.cond.notify_all()

    def apply_plan_locked(
        self, tier: TierName, plan: EvictionPlan, below: Level | None, offer: Callable[[Copy], bool] | None = None,
        may_drop: bool = True,
    ) -> list[BlockKey]:
        """Carry out an eviction plan in ``tier``; returns the blocks marked for a copy down.

        With ``offer`` (the head's write-behind queue) each marked block is
        queued; without, the caller writes the marked blocks itself.
        """
        for key in plan.drop_copy:
            self.drop_copy_locked(key, self.catalog.entries[key], tier)
            self.metrics.evictions.labels(tier.label).inc()
        for key in plan.drop:
            self.remove_locked(key, self.catalog.entries[key])
            self.metrics.evictions.labels(tier.label).inc()
            self.metrics.drops.inc()
        marked = []
        for key in plan.demote:
            if below is None:
                break
            if not self.mark_copy_locked(key, below.name):
                continue  # its old copy below is still being deleted: try it next time
            if offer is not None and not offer(Copy(key, tier, below.name, evict=True, may_drop=may_drop)):
                self.unmark_copy_locked(key)
                break
            marked.append(key)
        return marked

    def known_namespace(self, namespace: str, *, write: bool = False) -> None:
        validate_namespace(namespace)
        if namespace in self.namespaces:
            return
        if write and self.auto_create:
            self.namespaces.add(namespace)
            return
        raise UnknownNamespace(
            f"namespace {namespace!r} is unknown to this daemon: nothing was ever stored in it "
            "(check the model or tenant name), or declare it with --namespaces"
        )

    def readable_namespace(self, namespace: str) -> None:
        """Reads of a namespace this node never saw are errors, unless a remote tier may hold it."""
        try:
            self.known_namespace(namespace)
        except UnknownNamespace:
            if not self.chain.remote():
                raise


class StorePart:
    """A part of the store (placement, reads, copies down, the facade): the shared state,
    and short names for the objects on it that every part uses."""

    def __init__(self, state: StoreState) -> None:
        self._s = state
        self._cond = state.cond
        self._catalog = state.catalog
        self._recency = state.recency
        self._chain = state.chain
        self._head = state.head
        self._clock = state.clock
