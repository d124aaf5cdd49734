"""The ordered chain of tiers a store composes, and the policy of each edge.

``[ram, disk]`` by default, ``[gpu, ram, disk, peer, object]`` with every
tier configured. The head is a :class:`~kvstore.tiers.base.MappableTier`
(same-host clients read and write it in place); below it come the other
tiers, each edge with its own
:class:`~kvstore.store.limits.EdgePolicy`. The store asks the chain
positional questions (the best tier of a block, the tier below, whether a
read from a tier is promoted to the head) and never branches on a tier's
name.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from kvstore.block import TierName
from kvstore.store.limits import EdgePolicy
from kvstore.tiers.base import MappableTier, Tier


@dataclass(frozen=True, slots=True)
class Level:
    position: int
    tier: Tier
    edge: EdgePolicy  # to the next level down; unused on the last level

    @property
    def name(self) -> TierName:
        return self.tier.name


class TierChain:
    def __init__(self, tiers: Sequence[Tier], edges: Sequence[EdgePolicy] = ()) -> None:
        if not tiers or not isinstance(tiers[0], MappableTier):
            raise ValueError("the first tier of a chain must be mappable (the host-RAM arena): put 'ram' first")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"a tier appears twice in the chain {[n.label for n in names]}: list each tier once")
        kinds = [t.remote for t in tiers]
        if kinds != sorted(kinds):
            raise ValueError("remote tiers (peers, object storage) come after every local tier in the chain")
        if len(edges) > max(len(tiers) - 1, 0):
            raise ValueError(f"{len(edges)} edge policies for a chain of {len(tiers)} tiers: give at most one per edge")
        padded = list(edges) + [EdgePolicy()] * (len(tiers) - len(edges))
        self.levels = [Level(i, t, padded[i]) for i, t in enumerate(tiers)]
        self.head: MappableTier = tiers[0]  # type: ignore[assignment]
        self._by_name = {lvl.name: lvl for lvl in self.levels}

    def __iter__(self):
        return iter(self.levels)

    def __len__(self) -> int:
        return len(self.levels)

    @property
    def names(self) -> list[TierName]:
        return [lvl.name for lvl in self.levels]

    def level(self, name: TierName) -> Level:
        return self._by_name[name]

    def tier(self, name: TierName) -> Tier:
        return self._by_name[name].tier

    def is_head(self, name: TierName) -> bool:
        return name == self.head.name

    def best(self, names: Collection[TierName]) -> TierName:
        """The highest tier among ``names`` (which must not be empty)."""
        if len(names) == 1:  # most blocks are in one tier: no sort key to build (Exists asks this per key)
            return next(iter(names))
        return min(names, key=lambda n: self._by_name[n].position)

    def ordered(self, names: Iterable[TierName]) -> list[TierName]:
        return sorted(names, key=lambda n: self._by_name[n].position)

    def below(self, name: TierName) -> Level | None:
        """The next level down from ``name``, or None at the bottom."""
        pos = self._by_name[name].position + 1
        return self.levels[pos] if pos < len(self.levels) else None

    def edge_below(self, name: TierName) -> EdgePolicy:
        return self._by_name[name].edge

    def target_below(self, name: TierName, *, through: bool = False) -> Level | None:
        """Where copies from ``name`` go down: the nearest level below whose edge takes them (demotions,
        or with ``through`` write-through copies). A remote tier that takes none (the peer tier, read-through
        only) is passed over, so ``[ram, disk, peer, object]`` demotes from disk to the bucket; any other
        tier that takes none ends the way down there."""
        pos = self._by_name[name].position + 1
        while pos < len(self.levels):
            edge = self.levels[pos - 1].edge
            if edge.write_through if through else edge.demote:
                return self.levels[pos]
            if not self.levels[pos].tier.remote:
                return None
            pos += 1
        return None

    def promotes(self, name: TierName) -> bool:
        """Whether a read served from ``name`` is copied up into the head (every edge on the way allows it)."""
        pos = self._by_name[name].position
        return pos > 0 and all(self.levels[i].edge.promote for i in range(pos))

    def remote(self) -> list[Level]:
        """The remote levels, in order: where a local miss reads through."""
        return [lvl for lvl in self.levels if lvl.tier.remote]

    def persistent(self) -> list[TierName]:
        return [lvl.name for lvl in self.levels if lvl.tier.persistent]
