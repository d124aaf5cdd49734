"""The cache-aware policy's TTFT estimate: the online fit, and the picks it makes on crafted states.

No processes and no clock: the fit is fed synthetic (features, TTFT) samples
drawn from a seeded generator, and the policy picks among
:class:`~kvstore.router.endpoint.Endpoint` objects whose load and backlog
the test sets. tests/router/test_router.py shows the same choices through real
engine processes.
"""

from __future__ import annotations

import random

import pytest

from kvstore.router.endpoint import Endpoint
from kvstore.router.policy import CacheAware, PromptSize
from kvstore.router.ttft import BOUNDS, TtftFit

TRUE = (0.03, 7.5e-4, 0.9)  # overhead s, s/token, s per request ahead: the reference engine on a CPU
CPU = TRUE
GPU = (0.02, 2e-4, 0.01)  # a batching engine: a request ahead costs little beyond its prefill
PRIOR = (0.02, 1e-4, 0.05)


def synthetic(fit: TtftFit, n: int, truth=TRUE, *, seed: int = 1, noise: float = 0.02) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        tokens = rng.choice([250, 400, 1200, 1450, 2200]) + rng.randrange(0, 500)
        ahead = rng.choice([0, 0, 0, 1, 1, 2, 3])
        ttft = truth[0] + truth[1] * tokens + truth[2] * ahead
        fit.observe(tokens, ahead, ttft * (1 + rng.uniform(-noise, noise)))


def close(fit: TtftFit, truth, rel: float) -> bool:
    """The fit's slopes within ``rel`` of ``truth``'s, and its estimates too, over the workload's range
    (the intercept alone is extrapolated from prompts of 250 tokens and more: judged by the estimates)."""
    got = fit.coefficients
    slopes = all(abs(g - w) <= rel * w for g, w in zip(got[1:], truth[1:]))
    points = [(t, n) for t in (250, 1200, 2700) for n in (0, 1, 3)]
    estimates = all(abs(fit.estimate(t, n) - (truth[0] + truth[1] * t + truth[2] * n))
                    <= rel * (truth[0] + truth[1] * t + truth[2] * n) for t, n in points)
    return slopes and estimates


# ---- the fit ---------------------------------------------------------------------------


def test_the_priors_decide_until_enough_samples():
    fit = TtftFit(PRIOR, min_samples=20)
    assert fit.coefficients == PRIOR
    assert fit.estimate(1000, 2) == pytest.approx(0.02 + 0.1 + 0.1)
    synthetic(fit, 19)
    assert fit.coefficients == PRIOR  # 19 samples: not yet
    synthetic(fit, 1, seed=2)
    assert fit.coefficients != PRIOR and fit.samples == 20


def test_the_fit_converges_on_synthetic_observations():
    fit = TtftFit(PRIOR, min_samples=20, window=256)
    synthetic(fit, 400)
    assert close(fit, TRUE, 0.03), fit.coefficients
    assert fit.mean_abs_error < 0.05 * (TRUE[1] * 1200)


def test_the_fit_follows_an_engine_that_slows_down_within_its_window():
    fit = TtftFit(PRIOR, window=64)
    synthetic(fit, 300)
    slower = (0.03, 1.5e-3, 1.8)
    synthetic(fit, 400, slower, seed=3)
    assert close(fit, slower, 0.05), fit.coefficients


def test_a_direction_the_traffic_never_exercises_keeps_its_prior():
    """No request ever queued (ahead is always 0): per_request is unobserved and must not drift."""
    fit = TtftFit(PRIOR)
    rng = random.Random(4)
    for _ in range(500):
        tokens = rng.randrange(100, 3000)
        fit.observe(tokens, 0, TRUE[0] + TRUE[1] * tokens)
    overhead, per_token, per_request = fit.coefficients
    assert per_token == pytest.approx(TRUE[1], rel=0.02)
    assert per_request == pytest.approx(PRIOR[2], rel=0.01)


def test_outliers_are_down_weighted():
    clean, dirty = TtftFit(PRIOR), TtftFit(PRIOR)
    synthetic(clean, 300)
    synthetic(dirty, 300)
    rng = random.Random(5)
    for _ in range(10):  # stalls: 100 s for a request that takes one
        assert dirty.observe(1200, 0, 100.0) is True
        synthetic(clean, 5, seed=rng.randrange(1 << 30))
        synthetic(dirty, 5, seed=rng.randrange(1 << 30))
    assert dirty.outliers == 10
    # One sample in six a stall of 100 s: the estimate stays within 15% of the clean one.
    assert close(dirty, clean.coefficients, 0.15), (dirty.coefficients, clean.coefficients)
    # Taken at full weight, the same stalls would have pulled it up by seconds.
    unweighted = TtftFit(PRIOR, min_samples=1 << 20)  # never past its priors: Huber's rule never applies
    synthetic(unweighted, 300)
    for _ in range(10):
        unweighted.observe(1200, 0, 100.0)
    assert unweighted.outliers == 0
    unweighted.min_samples = 1
    assert unweighted.estimate(1200, 0) > 2 + dirty.estimate(1200, 0)


def test_no_sequence_of_observations_leaves_the_bounds():
    fit = TtftFit(PRIOR, min_samples=1)
    # TTFT falling with more tokens and more queue: a least-squares fit would go negative.
    for i in range(200):
        fit.observe(100 + 10 * i, i % 4, max(0.0, 5.0 - 0.01 * i - 0.5 * (i % 4)))
        for v, (lo, hi) in zip(fit.coefficients, BOUNDS):
            assert lo <= v <= hi
    assert fit.coefficients[1] >= BOUNDS[1][0] > 0  # a cached token is never free
    for bad in (float("nan"), float("inf"), -1.0):
        samples = fit.samples
        assert fit.observe(1000, 0, bad) is False and fit.samples == samples  # not taken
    fit = TtftFit((1e9, 1e9, -5), min_samples=1)  # priors out of range are clamped too
    assert fit.coefficients == (BOUNDS[0][1], BOUNDS[1][1], BOUNDS[2][0])


# ---- picking ---------------------------------------------------------------------------


def fleet(*loads: int) -> list[Endpoint]:
    return [Endpoint(i, f"http://127.0.0.1:{9000 + i}", (f"e{i}",), in_flight=n) for i, n in enumerate(loads)]


def policy(costs) -> CacheAware:
    """A cache-aware policy whose estimate uses ``costs`` (as priors, before any sample)."""
    return CacheAware(fit=TtftFit(costs))


def busy(p: CacheAware, e: Endpoint, *uncached: float) -> list:
    """Requests sent to ``e`` whose first byte has not come back, as the router counts them."""
    tickets = []
    for u in uncached:
        tickets.append(p.model.sent(e, u))
        e.in_flight += 1
    return tickets


def test_a_long_cached_prefix_on_a_busy_endpoint_wins_when_its_queue_costs_less_than_the_prefill():
    a, b = fleet(0, 0)
    p = policy(GPU)
    busy(p, a, 100)  # one short request ahead at a
    prompt = PromptSize(4000, 4000)  # a holds 40% of it, b nothing
    # a: 0.02 + 2e-4 x (2400 + 100) + 0.01 = 0.53 s   b: 0.02 + 2e-4 x 4000 = 0.82 s
    d = p.pick([a, b], {a: 0.4, b: 0.0}, prompt)
    assert (d.endpoint, d.reason, d.uncached, d.hit) == (a, "cache_hit", 2400, 0.4)
    # The weighted score sends it away: 2 x 0.4 - 1 (a is the busiest) = -0.2 < 0 at idle b.
    assert CacheAware(score="weighted").pick([a, b], {a: 0.4, b: 0.0}, prompt).endpoint is b


def test_an_idle_endpoint_wins_over_a_long_cached_prefix_behind_a_long_queue():
    a, b = fleet(0, 0)
    p = policy(CPU)
    queued = busy(p, a, 2200, 1450, 1200)  # three cold prompts queued at a, on an engine serving one at a time
    prompt = PromptSize(2200, 2192)  # a holds every full block, b nothing
    # a: 0.03 + 7.5e-4 x (8 + 4850) + 3 x 0.9 = 6.37 s   b: 0.03 + 7.5e-4 x 2200 = 1.68 s
    d = p.pick([a, b], {a: 1.0, b: 0.0}, prompt)
    assert (d.endpoint, d.reason, d.uncached, d.hit) == (b, "cache_bypassed", 2200, 0.0)
    # The weighted score keeps it at a: a full hit (2) outweighs being the busiest (1), at any queue.
    assert CacheAware(score="weighted").pick([a, b], {a: 1.0, b: 0.0}, prompt).endpoint is a
    # Two of them answered, the third past its prefill and decoding: 0.03 + 7.5e-4 x 8 + 0.9 = 0.94 s at a.
    for t in queued:
        p.model.first_byte(t, None)
    a.in_flight = 1
    assert p.model.backlog(a) == 0
    d = p.pick([a, b], {a: 1.0, b: 0.0}, prompt)
    assert (d.endpoint, d.reason) == (a, "cache_hit")


def test_the_scraped_queue_counts_as_requests_ahead():
    a, b = fleet(0, 0)
    p = policy(CPU)
    prompt = PromptSize(2200, 2192)
    assert p.pick([a, b], {a: 1.0, b: 0.0}, prompt).endpoint is a
    a.queue_depth = 2  # another router's requests waiting there: 2 x 0.9 s > 2192 x 7.5e-4 s
    assert p.pick([a, b], {a: 1.0, b: 0.0}, prompt).endpoint is b
    a.in_flight = 2  # the router's own two, which the scraped queue already shows: two ahead, not four
    assert p.model.ahead(a) == 2 and a.load == 4


def test_ties_go_to_the_more_cached_then_the_less_loaded_then_in_turn():
    a, b, c = fleet(0, 0, 0)
    p = CacheAware(fit=TtftFit((0.02, 1e-7, 0.0)))  # per token at its floor, requests ahead free: all tie
    prompt = PromptSize(64, 64)
    assert p.pick([a, b, c], {a: 0.0, b: 0.5, c: 0.25}, prompt).endpoint is b
    a.in_flight, b.in_flight = 2, 1
    assert p.pick([a, b, c], {}, prompt).endpoint is c
    c.in_flight = 1
    assert {p.pick([a, b, c], {}, prompt).endpoint for _ in range(3)} == {b, c}  # equals share the work


def test_the_backlog_is_what_was_sent_and_has_no_first_byte_yet():
    a, b = fleet(0, 0)
    p = policy(CPU)
    m = p.model
    t1, t2 = m.sent(a, 1200), m.sent(a, 250)
    assert (t1.tokens, t1.ahead, t2.tokens, t2.ahead) == (1200, 0, 1450, 0)  # in_flight is the caller's to count
    assert m.backlog(a) == 1450 and m.backlog(b) == 0
    assert m.first_byte(t1, None) is None  # not a stream: no sample, but its prefill is done
    assert m.backlog(a) == 250 and m.fit.samples == 0
    m.finished(t1)  # counted once
    assert m.backlog(a) == 250
    assert m.first_byte(t2, 1.2) is False and m.fit.samples == 1
    m.finished(t2)
    assert m.backlog(a) == 0
    unknown = m.sent(b, None)  # a retry or a fallback pick: nothing known of its prefill
    assert m.backlog(b) == 0 and m.first_byte(unknown, 0.5) is None and m.fit.samples == 1


def test_without_the_index_it_falls_back_to_least_loaded():
    a, b = fleet(3, 1)
    p = policy(CPU)
    d = p.pick([a, b], None, PromptSize(2200, 2192))
    assert (d.endpoint, d.reason, d.uncached) == (b, "fallback_index_down", None)


def test_a_prompt_shorter_than_a_block_is_all_uncached_everywhere():
    a, b = fleet(1, 0)
    p = policy(CPU)
    d = p.pick([a, b], {}, PromptSize(3, 0))
    assert (d.endpoint, d.reason, d.uncached) == (b, "load", 3)


def test_the_settings_defaults_are_the_estimates_priors():
    from kvstore.config.router import load_router_settings
    from kvstore.router.ttft import PRIOR

    s = load_router_settings(environ={}, endpoint=["http://127.0.0.1:1"], policy="round-robin")
    assert (s.ttft_overhead_seconds, s.ttft_prefill_seconds_per_token, s.ttft_seconds_per_request_ahead) == PRIOR
    assert s.cache_aware_score == "estimated-ttft" and s.ttft_min_samples == TtftFit(PRIOR).min_samples
