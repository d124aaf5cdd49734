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
        }
