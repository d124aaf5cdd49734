"""Scoring policy: how a router ranks nodes for a prefix chain.

The index answers a fact (node N holds the first k blocks of the chain, its
best copy in tier T); turning facts into a ranking is policy, kept here so
the IndexService and a router rank the same way. A node's score is
``blocks × weight(tier)``: a longer cached prefix saves more prefill, and a
copy in GPU memory is worth more than one on disk (the weight stands for
the fraction of recompute a load from that tier saves). Ties go to the
longer prefix, then to the node id, so a ranking is deterministic.
Candidates the index knows nothing about are listed last with score 0, so a
router that names its candidates always gets all of them back.
"""

from __future__ import annotations

import math

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvstore.block import TierName
from kvstore.errors import InvalidArgument
from kvstore.index.base import NodeMatch

DEFAULT_TIER_WEIGHTS: Mapping[TierName, float] = {
    TierName.GPU: 1.0,
    TierName.HOST: 0.8,
    TierName.DISK: 0.5,
    TierName.PEER: 0.3,
    TierName.OBJECT: 0.1,
}


@dataclass(frozen=True, slots=True)
class NodeScore:
    node_id: str
    blocks: int  # leading blocks of the chain the node holds
    tier: TierName | None  # the tier those blocks are scored at; None: holds none
    score: float


class ScoringPolicy:
    """Tier weights and the ranking rule; immutable (``with_weights`` makes a new one)."""

    def __init__(self, weights: Mapping[TierName, float] = DEFAULT_TIER_WEIGHTS) -> None:
        merged = {**DEFAULT_TIER_WEIGHTS, **weights}
        for tier, weight in merged.items():
            if not (math.isfinite(weight) and weight >= 0):  # refuses NaN and infinities too
                raise InvalidArgument(
                    f"tier weight for {TierName(tier).label} is {weight}: weights must be finite and non-negative"
                )
        self._weights = {TierName(t): float(w) for t, w in merged.items()}

    @property
    def weights(self) -> Mapping[TierName, float]:
        return dict(self._weights)

    def with_weights(self, overrides: Mapping[TierName, float]) -> ScoringPolicy:
        """This policy with some tiers re-weighted (a request's own weights)."""
        return ScoringPolicy({**self._weights, **overrides}) if overrides else self

    def rank(self, matches: Iterable[NodeMatch], candidates: Iterable[str] = ()) -> list[NodeScore]:
        scored = [NodeScore(m.node_id, m.blocks, m.tier, m.blocks * self._weights[m.tier]) for m in matches]
        seen = {s.node_id for s in scored}
        scored += [NodeScore(c, 0, None, 0.0) for c in dict.fromkeys(candidates) if c not in seen]
        return sorted(scored, key=lambda s: (-s.score, -s.blocks, s.node_id))
