"""Which copies of each key one engine holds, as its KV events say.

vLLM reports a block once per copy (per medium, per KV-cache group, per physical copy in a
group); the index keeps one row per (engine, key). This map decides when a removal leaves
the key listed and which tier it is listed at.
"""

from __future__ import annotations

from kvstore.block import TierName

class EngineHoldings:
    """Which copies of each key one engine holds, as its events since the last loss say.

    vLLM reports a block once per copy: per medium (GPU, and offloaded CPU or disk
    copies), per KV-cache group (a hybrid model stores the same block hash for its
    full-attention group and its sliding-window group, and a sliding window drops old
    blocks from its group only), and per physical copy inside one group (its block pool
    can cache two blocks under one hash; each store is balanced by one removal). The
    index keeps one row per (engine, key), so a removal of one copy must leave the key
    listed while any other copy remains, and the key's tier is the fastest medium that
    holds it in any group.

    Per key an int: bit ``group * 8 + tier`` is set while that (medium, group) holds a
    copy (an engine that sends no ``group_idx`` uses group 0: one int a key, one group). Further copies of the same (medium, group) are counted in ``_extra`` (rare).
    The same map lets the engine be re-published in full when the index lost it
    (expired, restarted, unreachable for a while). Beyond ``cap`` entries nothing new
    is remembered: such a copy is forgotten, so the key leaves the index at the first
    removal that finds no copy recorded (a miss, never a lie).
    """

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._mask: dict[bytes, int] = {}
        self._extra: dict[tuple[bytes, int], int] = {}  # (key, bit) -> copies beyond the first

    def store(self, key: bytes, tier: TierName, group: int) -> TierName:
        bit = group * _GROUP_BITS + tier
        mask = self._mask.get(key)
        full = len(self._mask) + len(self._extra) >= self._cap
        if mask is None:
            if full:
                return tier
            mask = 0
        if mask >> bit & 1:
            if not full:
                self._extra[key, bit] = self._extra.get((key, bit), 0) + 1
        else:
            mask |= 1 << bit
            self._mask[key] = mask
        return _fastest(mask)

    def remove(self, key: bytes, tier: TierName, group: int) -> TierName | None:
        """The key's fastest tier after this copy is gone; ``None`` if no copy is left."""
        bit = group * _GROUP_BITS + tier
        more = self._extra.get((key, bit))
        if more:
            if more == 1:
                del self._extra[key, bit]
            else:
                self._extra[key, bit] = more - 1
            return _fastest(self._mask[key])
        mask = self._mask.pop(key, 0) & ~(1 << bit)
        if not mask:
            return None
        self._mask[key] = mask
        return _fastest(mask)

    def clear(self) -> None:
        self._mask.clear()
        self._extra.clear()

    def snapshot(self) -> list[tuple[bytes, TierName]]:
        return [(k, _fastest(m)) for k, m in self._mask.items()]


_GROUP_BITS = 8  # bits per KV-cache group in a holdings mask: one per tier (TierName fits in 3 bits)
_TIERS_OF_A_GROUP = (1 << _GROUP_BITS) - 1


def _fastest(mask: int) -> TierName:
    tiers = 0
    while mask:  # fold the groups: a key is as fast as its fastest copy in any group
        tiers |= mask & _TIERS_OF_A_GROUP
        mask >>= _GROUP_BITS
    return TierName((tiers & -tiers).bit_length() - 1)
