"""The router's estimate of a request's time to first token at each endpoint, learned from what it routed.

    estimate(e) = overhead + per_token * (uncached(e) + backlog(e)) + per_request * ahead(e)

    uncached(e)  the prompt's tokens the endpoint does not hold (prompt - its cached prefix, from the index)
    backlog(e)   the uncached prefill tokens of the requests the router sent to e whose first byte has not
                 come back yet: prefill queued or running ahead of this one
    ahead(e)     the requests in front of this one there: the router's outstanding ones, or the engine's
                 scraped queue where that is longer (other routers' requests waiting there)

A request waits for the work queued ahead of it and then for the prefill of
its own uncached tokens; that is what the three terms price, in seconds, so
a cached prefix and a queue are weighed in one unit instead of a cached
fraction against a queue fraction. ``per_request`` carries what a request
ahead costs beyond its prefill: decoding on an engine that serves one
request at a time, interference in a batching one (near 0 there).

The coefficients are fitted online (:class:`TtftFit`): each streamed
request's measured time to first byte (the router's own TTFT histogram
measures it) against the features the router saw when it sent the request.
The fit is exponentially weighted least squares (recent samples count most,
an engine that slows down is followed within a window of samples), with a
ridge pull toward the priors so a direction the traffic never exercises
(no request ever queued, so ``per_request`` is unobserved) keeps its prior
instead of drifting; until ``min_samples`` are in, the priors alone
decide. A sample far from the current fit (an engine stall, a GC pause) is
down-weighted by Huber's rule (its residual counted at most ``HUBER_K``
times the running mean absolute residual), and every coefficient is clamped
to ``BOUNDS``, so no sequence of observations can make the estimate negative
or absurd. Non-streamed responses give no sample: their first byte comes
after the whole generation.

``ahead`` is the larger of the two counts, not their sum (the endpoint's
``load``, which least-loaded uses): behind one router the engine's queue is
made of the router's own outstanding requests, and adding them would count
each waiting request twice.

One fit serves every endpoint: the engines behind one router serve one
model, usually on the same hardware, and a shared fit learns from all
their traffic instead of one endpoint's share of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.router.endpoint import Endpoint

KILO = 1000.0  # tokens are fitted in thousands: the normal equations stay well conditioned
HUBER_K = 3.0  # a residual beyond HUBER_K x the mean absolute residual is down-weighted
SCALE_RATE = 0.05  # how fast the mean absolute residual follows the samples
PRIOR_SAMPLES = 0.1  # the ridge toward the priors weighs as much as this many samples
# (low, high) of overhead (s), per token (s/token), per request ahead (s): 100 ns/token is a
# GPU far faster than any today, 100 ms/token a CPU far slower; a cached token is never free.
BOUNDS = ((0.0, 60.0), (1e-7, 0.1), (0.0, 600.0))
# The settings' default priors: 20 ms, 100 us per token (an 8B model on one current GPU), 50 ms per request ahead.
PRIOR = (0.02, 1e-4, 0.05)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """``a x = b`` for a small symmetric positive definite ``a`` (Gaussian elimination, partial pivoting)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


class TtftFit:
    """``ttft ≈ overhead + per_token * tokens + per_request * ahead``, fitted online and bounded."""

    def __init__(self, prior: Sequence[float], *, min_samples: int = 10, window: int = 256) -> None:
        if len(prior) != 3:
            raise ValueError("prior: (overhead_seconds, seconds_per_token, seconds_per_request_ahead)")
        self.prior = tuple(self._clamp(prior))
        self.min_samples = max(1, min_samples)
        self.decay = 1.0 - 1.0 / max(2, window)
        self.samples = 0  # observations taken (outliers included, down-weighted)
        self.outliers = 0  # of which down-weighted as outliers
        self.mean_abs_error = 0.0  # running mean |measured - estimated| at the time of each sample, seconds
        self._theta = self._scaled(self.prior)  # the fit in fitted units (tokens in thousands)
        self._xx = [[0.0] * 3 for _ in range(3)]  # decayed sum of w x x^T
        self._xy = [0.0] * 3  # decayed sum of w x y

    @staticmethod
    def _clamp(theta: Sequence[float]) -> list[float]:
        return [min(hi, max(lo, v)) for v, (lo, hi) in zip(theta, BOUNDS)]

    @staticmethod
    def _scaled(theta: Sequence[float]) -> list[float]:
        return [theta[0], theta[1] * KILO, theta[2]]

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(overhead s, s per token, s per request ahead) in use: the priors until ``min_samples``."""
        if self.samples < self.min_samples:
            return self.prior
        t = self._theta
        return t[0], t[1] / KILO, t[2]

    def estimate(self, tokens: float, ahead: float) -> float:
        c0, c1, c2 = self.coefficients
        return c0 + c1 * tokens + c2 * ahead

    def observe(self, tokens: float, ahead: float, ttft_s: float) -> bool:
        """Take one measured TTFT of a request sent with these features; True when it counted as an outlier."""
        if not math.isfinite(ttft_s) or ttft_s < 0 or tokens < 0 or ahead < 0:
            return False
        x = (1.0, tokens / KILO, float(ahead))
        predicted = sum(t * v for t, v in zip(self._theta, x))
        residual = ttft_s - predicted
        # The scale of "far": the running mean absolute residual, never below 10% of the estimate
        # (or 1 ms), so an exact fit does not turn the next honest sample into an outlier.
        scale = max(self.mean_abs_error, 0.1 * abs(predicted), 1e-3)
        weight, outlier = 1.0, False
        if self.samples >= self.min_samples and abs(residual) > HUBER_K * scale:
            weight, outlier = HUBER_K * scale / abs(residual), True
        self.mean_abs_error += SCALE_RATE * (min(abs(residual), HUBER_K * scale) - self.mean_abs_error)
        for i in range(3):
            self._xy[i] = self.decay * self._xy[i] + weight * x[i] * ttft_s
            for j in range(3):
                self._xx[i][j] = self.decay * self._xx[i][j] + weight * x[i] * x[j]
        self.samples += 1
        self.outliers += outlier
        self._refit()
        return outlier

    def _refit(self) -> None:
        prior = self._scaled(self.prior)
        a = [[self._xx[i][j] + (PRIOR_SAMPLES if i == j else 0.0) for j in range(3)] for i in range(3)]
        b = [self._xy[i] + PRIOR_SAMPLES * prior[i] for i in range(3)]
        theta = _solve(a, b)
        if all(math.isfinite(v) for v in theta):
            self._theta = self._scaled(self._clamp([theta[0], theta[1] / KILO, theta[2]]))


@dataclass(eq=False, slots=True)
class Ticket:
    """One request the router sent: what it predicted, until its first byte and its end."""

    endpoint: Endpoint
    uncached: float | None  # its prefill tokens at that endpoint; None when unknown (no index answer)
    tokens: float = 0.0  # the fit's features when it was sent: uncached + backlog ahead
    ahead: float = 0.0
    prefilling: bool = True


class TtftModel:
    """The fit, and each endpoint's backlog of uncached prefill the router sent there."""

    def __init__(self, fit: TtftFit) -> None:
        self.fit = fit
        self._backlog: dict[Endpoint, float] = {}  # endpoint -> prefill tokens sent, first byte not back

    def backlog(self, e: Endpoint) -> float:
        return self._backlog.get(e, 0.0)

    @staticmethod
    def ahead(e: Endpoint) -> float:
        return max(float(e.in_flight), e.queue_depth)

    def estimate(self, e: Endpoint, uncached: float) -> float:
        return self.fit.estimate(uncached + self.backlog(e), self.ahead(e))

    def sent(self, e: Endpoint, uncached: float | None) -> Ticket:
        """Before the request goes to ``e`` (before ``e.in_flight`` counts it)."""
        known = uncached is not None
        ticket = Ticket(e, uncached, tokens=(uncached or 0.0) + self.backlog(e), ahead=self.ahead(e))
        if known:
            self._backlog[e] = self.backlog(e) + uncached
        return ticket

    def first_byte(self, ticket: Ticket, ttft_s: float | None) -> bool | None:
        """The response began; ``ttft_s`` is its measured TTFT (None: not a stream, no sample).
        Returns whether the sample was an outlier (None: no sample taken)."""
        self._prefilled(ticket)
        if ttft_s is None or ticket.uncached is None:
            return None
        return self.fit.observe(ticket.tokens, ticket.ahead, ttft_s)

    def finished(self, ticket: Ticket) -> None:
        """The request ended (answered, or failed before any byte)."""
        self._prefilled(ticket)

    def _prefilled(self, ticket: Ticket) -> None:
        if not ticket.prefilling:
            return
        ticket.prefilling = False
        if ticket.uncached is not None:
            left = self.backlog(ticket.endpoint) - ticket.uncached
            if left <= 1e-9:
                self._backlog.pop(ticket.endpoint, None)
            else:
                self._backlog[ticket.endpoint] = left
