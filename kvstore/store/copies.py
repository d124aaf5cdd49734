"""Copies down the chain: the work of the write-behind queue.

One :class:`~kvstore.store.demotion.Copy` at a time: read the block from its
upper tier (in place from the head), write it into the lower one, evicting
there as it fills (and further down the chain, synchronously, in this same
worker), then record the new copy and, for a demotion, drop the upper one
unless a reader holds it. Only a copy a writer waits for may drop a block
below to make room; a headroom copy moves blocks further down at most, and
one that finds no room leaves its block where it is.

What a failed copy means for the lower tier, by outcome:

- ``failed`` (its device failed: ``TierUnavailable``, an I/O error): the
  tier is skipped for ``tier_retry_s``; meanwhile eviction above drops
  instead of demoting;
- ``full`` for one namespace (``NamespaceFull``: an object tier's quota):
  only that namespace's blocks stay above for ``tier_retry_s``, neither
  demoted nor dropped; other namespaces keep going down;
- ``full`` (no room even after evicting there, or a full filesystem:
  ``TierFull``, ``DiskFull``): the tier is healthy, only full. It is left
  alone for ``tier_retry_s`` (or until its filesystem has room again) and
  the tier above keeps its blocks instead of dropping them: a writer that
  finds no room is refused with a retry delay; an acknowledged block is
  never dropped because a disk filled;
- ``refused`` (this block can never go down): the block's problem, never
  the tier's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvstore.block import BlockKey, BlockMeta, TierName
from kvstore.errors import (
    BlockTooLarge, CorruptBlock, DiskFull, InvalidArgument, NamespaceFull, TierFull, TierUnavailable,
)
from kvstore.store.demotion import Copy
from kvstore.store.entries import Entry
from kvstore.store.eviction import plan_eviction
from kvstore.store.state import StorePart, StoreState

log = logging.getLogger(__name__)


class CopyDown(StorePart):
    def __init__(self, state: StoreState) -> None:
        super().__init__(state)
        # The write-behind queue (set once it exists): a copy that lands in a tier whose edge below
        # writes through queues the next copy down there.
        self.offer: Callable[[Copy], bool] | None = None

    def copy_down(self, job: Copy) -> None:
        """Write one marked block from ``job.src`` into ``job.dst``; then, for a demotion, drop the upper copy."""
        with self._cond:
            entry = self._catalog.get(job.key)
            if entry is None or not entry.demoting:
                return
            if entry.deleted or job.src not in entry.tiers:
                self._s.end_copy_locked(job.key, entry)
                return
        outcome, reason, one_namespace = "failed", "the copy raised unexpectedly", False
        try:
            outcome, reason = self._write_copy(job, entry)
        except NamespaceFull as err:  # only this namespace waits; the rest of the tier takes copies
            log.info("the %s tier is full for namespace %r, keeping its blocks above: %s", job.dst.label,
                     err.namespace, err)
            with self._s.locked():
                self._s.namespace_full_until[(job.dst, err.namespace)] = self._clock() + self._s.limits.tier_retry_s
            outcome, reason, one_namespace = "full", str(err), True
        finally:  # whatever happened, the mark ends: a copy in flight forever would pin the block above
            self._s.metrics.demotions.labels(outcome).inc()
            self._finish(job, entry, outcome, reason, one_namespace)

    def _finish(self, job: Copy, entry: Entry, outcome: str, reason: str, one_namespace: bool = False) -> None:
        with self._s.locked():
            if outcome == "ok":
                self._s.copies_landed += 1
                if job.dst not in entry.tiers:
                    entry.tiers.add(job.dst)
                    self._recency.add(job.dst, job.key)
                    self._s.moved_locked(job.key, entry, job.src, job.dst)
                if job.evict and not entry.pins:  # a reader may be copying it out right now
                    self._s.drop_copy_locked(job.key, entry, job.src)
                    self._s.metrics.evictions.labels(job.src.label).inc()
            elif outcome == "corrupt":
                self._s.drop_copy_locked(job.key, entry, job.src)
            elif outcome == "refused":  # this block can never go down: its problem, not the tier's
                entry.stays_above = True
            elif outcome == "failed":  # the tier itself failed: evict above by dropping for a while
                self._s.unhealthy_until[job.dst] = self._clock() + self._s.limits.tier_retry_s
                self._s.unhealthy_reason[job.dst] = reason
            elif outcome == "full" and one_namespace:  # recorded for its namespace where it was raised
                pass
            elif outcome == "full":  # it could make no room: keep blocks above for a while
                until = self._clock() + self._s.limits.tier_retry_s
                if job.may_drop:
                    self._s.full_until[job.dst] = until
                else:  # a headroom copy: only headroom waits; a writer's copy may still evict there
                    self._s.no_headroom_until[job.dst] = until
            self._s.end_copy_locked(job.key, entry)
            if outcome == "ok" and self.offer is not None and entry.visible and job.dst in entry.tiers:
                self._s.write_through_locked(job.key, entry, job.dst, self.offer)

    def _write_copy(self, job: Copy, entry: Entry) -> tuple[str, str]:
        """Move the bytes of one copy down; the outcome names what happened (a metric label), and why."""
        try:
            if self._chain.is_head(job.src):
                loc = self._head.locate(job.key)
                if loc is None:
                    return "gone", ""
                with self._head.readable(loc[0], entry.meta.size) as view:
                    self._put_below(job.dst, job.key, view, entry.meta, job.may_drop)
            else:
                data = self._chain.tier(job.src).get(job.key)
                if data is None:
                    return "gone", ""
                self._put_below(job.dst, job.key, data, entry.meta, job.may_drop)
            return "ok", ""
        except CorruptBlock:
            log.error("block %s failed its checksum in the %s tier while being copied down: dropped", job.key, job.src.label)
            self._s.metrics.corrupt.labels(job.src.label).inc()
            return "corrupt", ""
        except NamespaceFull:
            raise
        except TierFull as err:  # full of blocks that cannot leave now: try this one again later
            log.info("no room in the %s tier for %s now, keeping it above: %s", job.dst.label, job.key, err)
            return "full", str(err)
        except InvalidArgument as err:  # BlockTooLarge, a field the tier cannot store: never for this block
            log.warning("the %s tier refuses %s, which stays above and is never demoted: %s",
                        job.dst.label, job.key, err)
            return "refused", str(err)
        except TierUnavailable as err:
            self._s.metrics.tier_errors.labels(job.dst.label).inc()
            log.warning("could not copy %s down to the %s tier, keeping it above: %s", job.key, job.dst.label, err)
            return "failed", str(err)

    def _put_below(self, dst: TierName, key: BlockKey, data, meta: BlockMeta, may_drop: bool = True) -> None:
        """Write a block into a lower tier, evicting from it (and further down) as it fills.

        A write the filesystem refused (``DiskFull``) is tried once more, with
        no eviction: the tier has shrunk its capacity to what it holds and asks
        its filesystem again before that write, so a filesystem that really is
        full turns into an ordinary ``TierFull`` (evict, like a tier at its
        configured size), and one whose space came back takes the block. A
        second refusal means the filesystem is filling from elsewhere: the copy
        ends ``full`` rather than empty the tier into it block by block.
        """
        tier = self._chain.tier(dst)
        if meta.size > tier.capacity_bytes:
            raise BlockTooLarge(f"block {key} ({meta.size} bytes) is larger than the whole {dst.label} tier")
        refused_by_filesystem = False
        while True:
            try:
                tier.put(key, data, meta)
            except DiskFull:
                if refused_by_filesystem:
                    raise
                refused_by_filesystem = True
                continue
            except NamespaceFull:  # a quota: nothing evicted there makes room for this namespace
                raise
            except TierFull:  # a tier whose room is not this node's to make (a bucket's quota) is just full
                if not getattr(tier, "evicts_to_fit", True) or not self._evict_one_below(dst, may_drop):
                    raise
                continue
            self._s.metrics.bytes_in.labels(dst.label).inc(meta.size)
            return

    def fit_capacity(self) -> int:
        """Evict from every lower local tier that holds more than its capacity (a restart
        with a smaller size); returns how many blocks went. Least recently used first,
        a chain from its deepest block up, as for any eviction."""
        evicted = 0
        for level in self._chain:
            if self._chain.is_head(level.name) or level.tier.remote:
                continue
            while level.tier.stats().used_bytes > level.tier.capacity_bytes:
                if not self._evict_one_below(level.name):
                    break
                evicted += 1
            if evicted:
                log.warning("the %s tier held more than its capacity: evicted %d blocks", level.name.label, evicted)
        return evicted

    def _evict_one_below(self, tier: TierName, may_drop: bool = True) -> bool:
        """Make room in a lower tier by one block: drop a copy held elsewhere, demote it further, or
        (``may_drop``, and the tier below it not full) drop it."""
        below = self._s.usable_below(tier)
        with self._s.locked():
            plan = plan_eviction(
                tier, 1, self._catalog, self._recency, can_demote=below is not None, max_victims=1,
                can_drop=may_drop and self._s.full_below(tier) is None,
                held_namespaces=self._s.full_namespaces_below(tier),
            )
            marked = self._s.apply_plan_locked(tier, plan, below)
            if not (plan.frees_now or marked):
                return False
        for key in marked:  # this thread writes it further down itself: it is already a copy in flight
            self.copy_down(Copy(key, tier, below.name, evict=True, may_drop=may_drop))
        return True
