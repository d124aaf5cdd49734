"""Recency: the store's one source of "least recently used", per tier.

Every tier in the chain has an order here, and only this order decides what
the store evicts; the tiers' own orders are not consulted while the daemon
runs. A persistent tier (disk) must hand an order back after a restart, so
uses of its blocks are remembered as *touches* and written back to it in
batches by a background pass (:meth:`take_touched`), never one syscall per
read on the read path. At most ``max_touched`` touches wait; beyond that the
oldest are forgotten, so a restart's order is then approximate for those
blocks, never wrong about which blocks exist.

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

from kvstore.block import BlockKey, TierName

TOUCH_BATCH_BLOCKS = 4096  # touches written back to a persistent tier per pass of the store's reaper


class Recency:
    def __init__(self, tiers: Iterable[TierName], persistent: Iterable[TierName], max_touched: int = 1 << 16) -> None:
        self._order: dict[TierName, OrderedDict[BlockKey, None]] = {t: OrderedDict() for t in tiers}
        self._persistent = frozenset(persistent)
        self._touched: OrderedDict[tuple[TierName, BlockKey], None] = OrderedDict()
        self._max_touched = max_touched

    def add(self, tier: TierName, key: BlockKey) -> None:
        """``key`` gained a copy in ``tier``: it is that tier's most recent block."""
        self._order[tier][key] = None
        self._order[tier].move_to_end(key)

    def discard(self, tier: TierName, key: BlockKey) -> None:
        self._order[tier].pop(key, None)
        if tier in self._persistent:
            self._touched.pop((tier, key), None)

    def touch(self, key: BlockKey, tiers: Iterable[TierName]) -> None:
        """``key`` was used: the most recent block of every tier holding it."""
        for tier in tiers:
            order = self._order[tier]
            if key in order:
                order.move_to_end(key)
                if tier in self._persistent:
                    self._remember(tier, key)

    def oldest(self, tier: TierName) -> Iterator[BlockKey]:
        """Keys of ``tier``, least recent first. Do not add or discard while iterating."""
        return iter(self._order[tier])

    def newest(self, tier: TierName) -> Iterator[BlockKey]:
        return reversed(self._order[tier])

    def take_touched(self, limit: int) -> list[tuple[TierName, BlockKey]]:
        """Up to ``limit`` touches of persistent tiers to write back, oldest first."""
        out = []
        while self._touched and len(out) < limit:
            out.append(self._touched.popitem(last=False)[0])
        return out

    def _remember(self, tier: TierName, key: BlockKey) -> None:
        self._touched[(tier, key)] = None
        self._touched.move_to_end((tier, key))
        if len(self._touched) > self._max_touched:
            self._touched.popitem(last=False)
