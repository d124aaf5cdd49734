"""Which blocks leave a tier to make room, and how: a pure decision, no I/O.

The rules, in order, for each block of the tier from least recently used on
(pinned blocks and blocks with a copy in flight are skipped):

1. it has a copy in another tier: drop this copy now (free);
2. a tier below accepts demotions: write it down first (it stays readable
   here until its copy below is complete). A block with a cached child in
   this tier goes only when the leaves were not enough, so a chain leaves
   from its deepest block up;
3. nothing below: drop it if no block names it as parent, so a prefix
   always outlives its descendants — unless dropping is ruled out
   (``can_drop=False``: the tier below is full, not absent, and a block
   that could not go down is kept, not lost; the writer is refused instead).

A block of a namespace the tier below is full for (``held_namespaces``: an
object tier's per-namespace quota) is neither demoted nor dropped: it
stays, and blocks of other namespaces leave in its place.

Background headroom (``background=True``) only demotes: it never drops
what a reader may ask for next. The scan decides first and the store acts
after, so it never mutates the order it walks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.block import BlockKey, TierName
from kvstore.store.entries import Catalog
from kvstore.store.recency import Recency


@dataclass(slots=True)
class EvictionPlan:
    drop_copy: list[BlockKey] = field(default_factory=list)
    demote: list[BlockKey] = field(default_factory=list)
    drop: list[BlockKey] = field(default_factory=list)

    @property
    def frees_now(self) -> bool:
        return bool(self.drop_copy or self.drop)


def plan_eviction(
    tier: TierName, need: int, catalog: Catalog, recency: Recency, *, can_demote: bool, background: bool = False,
    max_victims: int | None = None, can_drop: bool = True, held_namespaces: frozenset[str] = frozenset(),
) -> EvictionPlan:
    """Blocks of ``tier`` to evict for ``need`` bytes (or ``max_victims`` blocks)."""
    plan = EvictionPlan()
    later: list[BlockKey] = []  # parents of blocks in this tier: demoted only if the leaves are not enough
    budget = victims = 0

    def enough() -> bool:
        return budget >= need or (max_victims is not None and victims >= max_victims)

    for key in recency.oldest(tier):
        if enough():
            break
        entry = catalog.entries[key]
        if entry.pins or entry.demoting:
            continue
        if len(entry.tiers) > 1:
            if background:
                continue
            plan.drop_copy.append(key)
        elif key.namespace in held_namespaces:
            continue
        elif can_demote and not entry.stays_above and catalog.has_child_in(key, tier):
            later.append(key)
            continue
        elif can_demote and not entry.stays_above:
            plan.demote.append(key)
        elif not background and can_drop and not catalog.has_children(key):
            plan.drop.append(key)
        else:
            continue
        budget += entry.meta.size
        victims += 1
    for key in later:
        if enough():
            break
        plan.demote.append(key)
        budget += catalog.entries[key].meta.size
        victims += 1
    return plan
