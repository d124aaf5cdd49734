"""The store's upkeep: what its reaper does every second besides expiring leases.

Two jobs that no request waits for and that keep the chain's facts true:
the recency of persistent tiers, written back to them in batches (the order
is a hint, so a failed stamp loses no block and waits for the next round),
and each tier's health, checked again on its device so a tier that has room
again ends the store's full period at once. ``tier_stats`` reports that
health as the store sees it. They are apart from the facade
(:mod:`~kvstore.store.tiered`) because they act on tiers, not on a
client's request, and keep their own memory of which tiers were degraded.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from kvstore.errors import TierUnavailable
from kvstore.store.recency import TOUCH_BATCH_BLOCKS
from kvstore.store.state import StorePart, StoreState
from kvstore.tiers.base import TierStats

log = logging.getLogger(__name__)


class Upkeep(StorePart):
    def __init__(self, state: StoreState) -> None:
        super().__init__(state)
        self._was_degraded: dict = {lvl.name: bool(lvl.tier.stats().degraded) for lvl in state.chain}

    def tier_stats(self) -> list[TierStats]:
        """Each tier's occupancy; ``degraded`` says why a tier cannot do its job now: its own
        reason (a full filesystem), or the store's (a write failed and it is skipped for a while)."""
        out = []
        now = self._clock()
        for lvl in self._chain:
            stats = lvl.tier.stats()
            if not stats.degraded and now < self._s.unhealthy_until.get(lvl.name, 0.0):
                stats = replace(stats, degraded=f"a write failed, skipped for now: {self._s.unhealthy_reason.get(lvl.name, '')}")
            out.append(stats)
        return out

    def upkeep(self) -> None:
        """Let every tier check its device again (the reaper does this every second). A tier that
        has room again ends the store's full period for it at once, not after ``tier_retry_s``."""
        for lvl in self._chain:
            lvl.tier.upkeep()
            degraded = bool(lvl.tier.stats().degraded)
            if self._was_degraded.get(lvl.name) and not degraded:
                with self._cond:
                    self._s.full_until.pop(lvl.name, None)
                    self._s.no_headroom_until.pop(lvl.name, None)
            self._was_degraded[lvl.name] = degraded

    def flush_recency(self) -> int:
        """Write the recency of persistent tiers back to them now (the reaper does this every second)."""
        written = 0
        while True:
            with self._cond:
                touched = self._recency.take_touched(TOUCH_BATCH_BLOCKS)
            if not touched:
                return written
            for tier, key in touched:
                try:
                    self._chain.tier(tier).touch(key)
                except TierUnavailable as err:  # the order is a hint: a failed stamp loses no block
                    log.warning("could not record the use of %s in tier %s: %s", key, tier.label, err)
                    return written
                written += 1
