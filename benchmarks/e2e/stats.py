"""What one request measured, and the figures a policy's requests add up to.

Percentiles interpolate linearly between the two nearest ranks (numpy's
default, "type 7"): with 32 turn-2+ requests per policy, the nearest-rank
p99 would simply be the maximum, and the interpolated one says so too but
moves smoothly as samples are added.

The TTFT figures are split as the issue asks: turn 1 (a new conversation:
only the shared system prompt can be cached) and turns 2+ (where the
previous turn's prompt can be). The cache hit ratio is tokens, not
requests: the engines' ``usage.prompt_tokens_details.cached_tokens`` over
their ``prompt_tokens``.

Goodput is the requests per second that were answered within the TTFT SLO,
over the span from the first request sent to the last one answered.

Confidence intervals are 95% percentile-bootstrap intervals
(:func:`bootstrap_ci`); hit fidelity (:class:`Fidelity`) is the share of
answered requests whose generated tokens equal a cold reference run's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linearly interpolated between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must lie in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Summary:
    """Mean and tail of one set of samples (seconds unless named otherwise)."""

    n: int
    mean: float | None
    p50: float | None
    p95: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, values: Iterable[float]) -> Summary:
        vals = list(values)
        if not vals:
            return cls(0, None, None, None, None, None)
        return cls(len(vals), sum(vals) / len(vals), percentile(vals, 50), percentile(vals, 95),
                   percentile(vals, 99), max(vals))

    def to_json(self, digits: int = 4) -> dict:
        return {k: (v if v is None or isinstance(v, int) else float(f"{v:.{digits}g}")) for k, v in asdict(self).items()}


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds since the run's start (monotonic)."""

    session: int
    turn: int  # 0-based
    sent_s: float
    prompt_tokens_sent: int
    first_token_s: float | None = None
    done_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_local: int = 0
    cached_pool: int = 0
    status: int | None = None  # HTTP status; None when no answer came
    error: str = ""  # empty when answered; else why it failed (a short reason, then detail)
    retries: int = 0  # 429 answers waited out before this one
    ended_s: float | None = None  # when the client was done with it, answered or not
    output_ids: list[int] | None = None  # the generated token ids, where the engine returned them
    engine_id: str = ""  # the engine that answered (its response says)
    point: int = 0  # the load point of a sweep it was sent in

    @property
    def ok(self) -> bool:
        return not self.error and self.first_token_s is not None and self.done_s is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if not self.ok or self.completion_tokens < 2:
            return None
        return (self.done_s - self.first_token_s) / (self.completion_tokens - 1)

    def to_json(self) -> dict:
        out = asdict(self)
        out["ttft_s"] = self.ttft_s
        out["tpot_s"] = self.tpot_s
        return out


@dataclass(frozen=True)
class PolicyStats:
    """The figures the issue asks for, from one policy's records."""

    ttft_turn1: Summary
    ttft_later: Summary  # turns 2+
    tpot: Summary
    hit_ratio: float | None  # cached / prompt tokens, all answered requests
    hit_ratio_later: float | None  # the same, turns 2+
    answered: int
    failed: int
    slo_s: float | None
    within_slo: int
    span_s: float
    goodput_rps: float | None
    ttft_later_mean_ci: tuple[float, float] | None = None  # 95% bootstrap intervals, turns 2+
    ttft_later_p95_ci: tuple[float, float] | None = None

    @classmethod
    def of(cls, records: Sequence[RequestRecord], slo_s: float | None) -> PolicyStats:
        ok = [r for r in records if r.ok]
        later = [r for r in ok if r.turn >= 1]

        def ratio(rs: list[RequestRecord]) -> float | None:
            prompt = sum(r.prompt_tokens for r in rs)
            return sum(r.cached_tokens for r in rs) / prompt if prompt else None

        span = 0.0
        if ok:
            span = max(r.done_s for r in ok) - min(r.sent_s for r in records)
        within = sum(1 for r in ok if slo_s is not None and r.ttft_s <= slo_s)
        return cls(
            ttft_turn1=Summary.of(r.ttft_s for r in ok if r.turn == 0),
            ttft_later=Summary.of(r.ttft_s for r in later),
            tpot=Summary.of(t for r in ok if (t := r.tpot_s) is not None),
            hit_ratio=ratio(ok),
            hit_ratio_later=ratio(later),
            answered=len(ok),
            failed=len(records) - len(ok),
            slo_s=slo_s,
            within_slo=within,
            span_s=span,
            goodput_rps=(within / span) if (span > 0 and slo_s is not None) else None,
            ttft_later_mean_ci=bootstrap_ci([r.ttft_s for r in later], "mean"),
            ttft_later_p95_ci=bootstrap_ci([r.ttft_s for r in later], "p95"),
        )

    def to_json(self) -> dict:
        def sig(x: float | None, d: int = 4) -> float | None:
            return None if x is None else float(f"{x:.{d}g}")

        return {
            "ttft_turn1_s": self.ttft_turn1.to_json(),
            "ttft_turns2plus_s": self.ttft_later.to_json(),
            "tpot_s": self.tpot.to_json(),
            "cache_hit_ratio": sig(self.hit_ratio, 3),
            "cache_hit_ratio_turns2plus": sig(self.hit_ratio_later, 3),
            "answered": self.answered,
            "failed": self.failed,
            "ttft_slo_s": sig(self.slo_s),
            "within_slo": self.within_slo,
            "span_s": sig(self.span_s),
            "goodput_rps": sig(self.goodput_rps),
            "ttft_turns2plus_mean_ci95_s": None if self.ttft_later_mean_ci is None
            else [sig(x) for x in self.ttft_later_mean_ci],
            "ttft_turns2plus_p95_ci95_s": None if self.ttft_later_p95_ci is None
            else [sig(x) for x in self.ttft_later_p95_ci],
        }


BOOTSTRAP_RESAMPLES = 2000
MIN_BOOTSTRAP_SAMPLES = 5  # below this an interval says nothing: none is given


def bootstrap_ci(values: Sequence[float], stat: str, *, level: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
                 seed: int = 0) -> tuple[float, float] | None:
    """The percentile-bootstrap confidence interval of ``stat`` ("mean" or "p95") of ``values``.

    ``resamples`` resamplings with replacement of the samples, the statistic of each, and the
    ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of those: no assumption about the
    distribution (TTFTs are skewed: a mixture of hits and cold prefills), seeded so a report is
    reproducible. None for fewer than :data:`MIN_BOOTSTRAP_SAMPLES` samples.
    """
    import numpy as np

    if stat not in ("mean", "p95"):
        raise ValueError(f"stat must be 'mean' or 'p95', got {stat!r}")
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    data = np.asarray(values, dtype=float)
    if data.size < MIN_BOOTSTRAP_SAMPLES:
        return None
    rng = np.random.default_rng(seed)
    draws = data[rng.integers(0, data.size, size=(resamples, data.size))]
    stats = draws.mean(axis=1) if stat == "mean" else np.percentile(draws, 95, axis=1)
    lo, hi = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


@dataclass(frozen=True)
class Fidelity:
    """How many answered requests generated exactly the tokens of the cold, cache-free reference run."""

    checked: int  # answered requests with a reference to compare with
    equal: int
    unchecked: int  # answered without a reference or without their token ids
    mismatches: tuple[dict, ...] = ()  # the first few: which request, where it first differs, what it hit

    @property
    def share(self) -> float | None:
        return self.equal / self.checked if self.checked else None

    @classmethod
    def of(cls, records: Iterable[RequestRecord], expected: dict[tuple[int, int, int], list[int]],
           keep: int = 10) -> Fidelity:
        """``expected``: (point, session, turn) -> the reference's token ids."""
        checked = equal = unchecked = 0
        bad: list[dict] = []
        for r in records:
            if not r.ok:
                continue
            want = expected.get((r.point, r.session, r.turn))
            if want is None or r.output_ids is None:
                unchecked += 1
                continue
            checked += 1
            if r.output_ids == want:
                equal += 1
            elif len(bad) < keep:
                at = next((i for i, (a, b) in enumerate(zip(r.output_ids, want)) if a != b),
                          min(len(r.output_ids), len(want)))
                bad.append({"point": r.point, "session": r.session, "turn": r.turn, "first_difference_at": at,
                            "cached_local": r.cached_local, "cached_pool": r.cached_pool})
        return cls(checked, equal, unchecked, tuple(bad))

    def to_json(self) -> dict:
        share = self.share
        return {"checked": self.checked, "equal": self.equal, "unchecked": self.unchecked,
                "share": None if share is None else round(share, 4), "mismatches": list(self.mismatches)}
