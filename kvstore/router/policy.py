"""Routing policies: which healthy endpoint gets a request, and why.

    round-robin    the next endpoint in turn                                  reason round_robin
    least-loaded   the smallest load (outstanding + scraped queue)            reason load
    cache-aware    the largest  prefix_weight * hit - load_weight * load / max_load
                   hit: the endpoint's tier-weighted cached blocks of the prompt / the prompt's
                   full blocks (0..1, best of its index ids); max_load: the largest load among
                   the healthy endpoints (at least 1), so the penalty is 0..1 as well.
                   reason cache_hit when the pick holds some of the prefix, else load;
                   fallback_index_down when the index did not answer (least-loaded then)

This is the shape of llm-d's endpoint picker (a weighted sum of a prefix
scorer and a load scorer, both normalized to 0..1). Ties go to the smaller
load, then to the next endpoint in round-robin order, so equal endpoints
share the work instead of the first one taking all of it.

Policies are looked up by name in :data:`POLICIES`; each is a class with
``pick(endpoints, hits)`` over the healthy endpoints, ``hits`` being None
when there is no cache information.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvstore.router.endpoint import Endpoint


@dataclass(frozen=True, slots=True)
class Decision:
    endpoint: Endpoint
    reason: str
    hit: float = 0.0  # the cached fraction of the prompt at the pick


class RoundRobin:
    name = "round-robin"

    def __init__(self, **_: float) -> None:
        self._next = 0

    def turn(self, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        """``endpoints`` starting at this turn's, and the turn advanced."""
        start = self._next % len(endpoints)
        self._next += 1
        return [*endpoints[start:], *endpoints[:start]]

    def pick(self, endpoints: Sequence[Endpoint], hits: Mapping[Endpoint, float] | None) -> Decision:
        return Decision(self.turn(endpoints)[0], "round_robin")


class LeastLoaded(RoundRobin):
    name = "least-loaded"

    def pick(self, endpoints: Sequence[Endpoint], hits: Mapping[Endpoint, float] | None) -> Decision:
        return Decision(min(self.turn(endpoints), key=lambda e: e.load), "load")


class CacheAware(LeastLoaded):
    name = "cache-aware"

    def __init__(self, *, prefix_weight: float = 2.0, load_weight: float = 1.0) -> None:
        super().__init__()
        self.prefix_weight = prefix_weight
        self.load_weight = load_weight

    def score(self, e: Endpoint, hit: float, max_load: float) -> float:
        return self.prefix_weight * hit - self.load_weight * e.load / max_load

    def pick(self, endpoints: Sequence[Endpoint], hits: Mapping[Endpoint, float] | None) -> Decision:
        if hits is None:
            chosen = super().pick(endpoints, None).endpoint
            return Decision(chosen, "fallback_index_down")
        max_load = max(1.0, *(e.load for e in endpoints))
        ordered = self.turn(endpoints)  # max() keeps the first of equals: the round-robin turn breaks ties
        best = max(ordered, key=lambda e: (self.score(e, hits.get(e, 0.0), max_load), -e.load))
        hit = hits.get(best, 0.0)
        return Decision(best, "cache_hit" if hit > 0 else "load", hit)


POLICIES = {p.name: p for p in (RoundRobin, LeastLoaded, CacheAware)}


def make_policy(name: str, *, prefix_weight: float, load_weight: float):
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}") from None
    return cls(prefix_weight=prefix_weight, load_weight=load_weight)
