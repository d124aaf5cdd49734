"""Routing policies: which healthy endpoint gets a request, and why.

    round-robin    the next endpoint in turn                                  reason round_robin
    least-loaded   the smallest load (outstanding + scraped queue)            reason load
    cache-aware    the smallest estimated time to first token (``--cache-aware-score estimated-ttft``,
                   the default; :mod:`kvstore.router.ttft`):
                       overhead + per_token * (uncached + backlog) + per_request * ahead
                   uncached: the prompt's tokens the endpoint does not hold; backlog: the uncached
                   prefill the router sent there whose first byte has not come back; ahead: requests
                   ahead there. Ties: more cached tokens, then the smaller load, then round-robin.
                   Or the largest ``prefix_weight * hit - load_weight * load / max_load``
                   (``--cache-aware-score weighted``; hit: the cached fraction of the prompt's full
                   blocks, max_load: the largest load among the healthy endpoints, at least 1).
                   reason cache_hit when the pick holds the most of the prompt (and some), load when
                   nothing is cached anywhere, cache_bypassed when another endpoint held more of it but
                   its queue would cost more than recomputing here; fallback_index_down when the
                   index did not answer (least-loaded then)

Why the estimate is the default. A request waits for the work queued ahead
of it, then for the prefill of what its endpoint has not cached: both are
seconds, and the estimate adds them. The weighted sum (the shape of llm-d's
first endpoint picker: a prefix scorer and a load scorer, each normalized to
0..1) adds a fraction of cached blocks to a fraction of the busiest queue,
so its answer depends on the weights rather than on the prompt: with the
defaults a full hit wins however long the queue in front of it (the
busiest endpoint's penalty is 1 whether one request or ten are ahead), and
a quarter of a 4,000-token prefix loses to an idle endpoint even where the
queue is one short decode and the 1,000 cached tokens a second of prefill.
Which trade is right depends on how long a token of prefill and a request
ahead take on these engines, and the estimate learns both from the
requests' measured TTFT (production pickers' latency-predicting scorers do
the same) rather than asking the operator for weights. The weighted score
stays for operators who tuned its weights; with it the estimate is still
fitted and exported, so the two can be compared before switching.

Policies are looked up by name in :data:`POLICIES`; each is a class with
``pick(endpoints, hits, prompt)`` over the healthy endpoints, ``hits``
being None when there is no cache information, and ``model``, the
:class:`~kvstore.router.ttft.TtftModel` the router reports each request's
progress to (None for the policies that do not use one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvstore.router.endpoint import Endpoint
from kvstore.router.ttft import PRIOR, TtftFit, TtftModel

SCORES = ("estimated-ttft", "weighted")


@dataclass(frozen=True, slots=True)
class PromptSize:
    """A prompt's length as the router scored it: its tokens, and the tokens of its full blocks that
    were sent to the index (an endpoint's hit is a fraction of those)."""

    tokens: int
    scored_tokens: int

    def uncached(self, hit: float) -> float:
        return max(0.0, self.tokens - hit * self.scored_tokens)


@dataclass(frozen=True, slots=True)
class Decision:
    endpoint: Endpoint
    reason: str
    hit: float = 0.0  # the cached fraction of the prompt at the pick
    uncached: float | None = None  # the prompt's tokens not cached at the pick; None when unknown


class RoundRobin:
    name = "round-robin"
    model: TtftModel | None = None

    def __init__(self, **_: float) -> None:
        self._next = 0

    def turn(self, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        """``endpoints`` starting at this turn's, and the turn advanced."""
        start = self._next % len(endpoints)
        self._next += 1
        return [*endpoints[start:], *endpoints[:start]]

    def pick(self, endpoints: Sequence[Endpoint], hits: Mapping[Endpoint, float] | None,
             prompt: PromptSize | None = None) -> Decision:
        return Decision(self.turn(endpoints)[0], "round_robin")


class LeastLoaded(RoundRobin):
    name = "least-loaded"

    def pick(self, endpoints: Sequence[Endpoint], hits: Mapping[Endpoint, float] | None,
             prompt: PromptSize | None = None) -> Decision:
        return Decision(min(self.turn(endpoints), key=lambda e: e.load), "load")


class CacheAware(LeastLoaded):
    name = "cache-aware"

    def __init__(self, *, score: str = "estimated-ttft", prefix_weight: float = 2.0, load_weight: float = 1.0,
                 fit: TtftFit | None = None) -> None:
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"unknown cache-aware score {score!r}; known: {', '.join(SCORES)}")
        self.score_kind = score
        self.prefix_weight = prefix_weight
        self.load_weight = load_weight
        self.model = TtftModel(fit if fit is not None else TtftFit(PRIOR))

    def score(self, e: Endpoint, hit: float, max_load: float) -> float:
        return self.prefix_weight * hit - self.load_weight * e.load / max_load

    def pick(self, endpoints: Sequence[Endpoint], hits: Mapping[Endpoint, float] | None,
             prompt: PromptSize | None = None) -> Decision:
        if hits is None:
            chosen = super().pick(endpoints, None).endpoint
            return Decision(chosen, "fallback_index_down")
        if self.score_kind == "weighted" or prompt is None:  # no prompt size: nothing to estimate with
            return self._weighted(endpoints, hits, prompt)
        return self._estimated(endpoints, hits, prompt)

    def _weighted(self, endpoints: Sequence[Endpoint], hits: Mapping[Endpoint, float],
                  prompt: PromptSize | None) -> Decision:
        max_load = max(1.0, *(e.load for e in endpoints))
        ordered = self.turn(endpoints)  # max() keeps the first of equals: the round-robin turn breaks ties
        best = max(ordered, key=lambda e: (self.score(e, hits.get(e, 0.0), max_load), -e.load))
        hit = hits.get(best, 0.0)
        return Decision(best, "cache_hit" if hit > 0 else "load", hit,
                        prompt.uncached(hit) if prompt is not None else None)

    def _estimated(self, endpoints: Sequence[Endpoint], hits: Mapping[Endpoint, float],
                   prompt: PromptSize) -> Decision:
        assert self.model is not None
        uncached = {e: prompt.uncached(hits.get(e, 0.0)) for e in endpoints}
        # Microsecond resolution: estimates equal but for float noise are ties, decided by the cache.
        ordered = self.turn(endpoints)  # min() keeps the first of equals: the round-robin turn breaks ties
        best = min(ordered, key=lambda e: (round(self.model.estimate(e, uncached[e]), 6), uncached[e], e.load))
        hit = hits.get(best, 0.0)
        most = max(hits.get(e, 0.0) for e in endpoints)
        if most <= 0:
            reason = "load"
        elif hit >= most:
            reason = "cache_hit"
        else:
            reason = "cache_bypassed"
        return Decision(best, reason, hit, uncached[best])


POLICIES = {p.name: p for p in (RoundRobin, LeastLoaded, CacheAware)}


def make_policy(name: str, **options):
    """The policy ``name``; ``options`` are cache-aware's (score, prefix_weight, load_weight, fit),
    ignored by the others."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}") from None
    return cls(**options) if cls is CacheAware else cls()
