"""The end-to-end benchmark's own parts: the seeded workload, the statistics, the fault attribution,
the verdict on the targets; a small run of the whole orchestration (real daemons, engines, router
and Redis as processes) and a prefix shared across replicas through the pool, where torch and
transformers are installed.

No timings are judged here: the figures live in ``benchmarks/results/e2e.json``.
"""

from __future__ import annotations

import json
import math
import statistics

import pytest

from benchmarks.e2e.faults import FaultEvent, classify, fault_report
from benchmarks.e2e.policies import POLICIES, parse_policies
from benchmarks.e2e.report import sweep_targets
from benchmarks.e2e.stats import Fidelity, PolicyStats, RequestRecord, Summary, bootstrap_ci, percentile
from benchmarks.e2e.sweep import Reference, SweepSpec, parse_loads, parse_workloads
from benchmarks.e2e.workload import Workload, WorkloadSpec

# ---- workload ------------------------------------------------------------------


def test_the_same_seed_gives_the_same_workload_and_another_seed_another():
    a, b = Workload(WorkloadSpec(seed=7)), Workload(WorkloadSpec(seed=7))
    assert a.system == b.system
    assert a.sessions == b.sessions
    assert [a.prompt(s, 4) for s in range(8)] == [b.prompt(s, 4) for s in range(8)]
    c = Workload(WorkloadSpec(seed=8))
    assert c.system != a.system
    assert [t.think_s for t in c.sessions[0].turns] != [t.think_s for t in a.sessions[0].turns]


def test_token_counts_follow_the_spec_turn_by_turn():
    w = Workload(WorkloadSpec())
    assert w.requests == 40 and len(w.sessions) == 8
    assert len(w.system) == 1000
    for s in w.sessions:
        assert len(s.turns) == 5
        for t in s.turns:
            assert len(t.user) == 200 and len(t.reply) == 50
            assert len(w.prompt(s.index, t.index)) == w.prompt_tokens(t.index) == 1000 + 250 * t.index + 200
    assert [w.prompt_tokens(t) for t in range(5)] == [1200, 1450, 1700, 1950, 2200]


def test_each_turn_extends_the_previous_turns_prompt_and_reply():
    w = Workload(WorkloadSpec())
    for s in range(8):
        for t in range(1, 5):
            prev, this = w.prompt(s, t - 1), w.prompt(s, t)
            turn = w.sessions[s].turns[t - 1]
            assert this[: len(prev)] == prev
            assert this[len(prev): len(prev) + 50] == list(turn.reply)
            assert this[-200:] == list(w.sessions[s].turns[t].user)


def test_sessions_share_the_system_prompt_and_nothing_after_it():
    w = Workload(WorkloadSpec())
    prompts = [w.prompt(s, 0) for s in range(8)]
    assert all(p[:1000] == list(w.system) for p in prompts)
    firsts = {tuple(p[1000:1016]) for p in prompts}  # the first block after the system prompt
    assert len(firsts) == 8


def test_token_ids_stay_inside_the_vocabulary_and_above_the_special_tokens():
    spec = WorkloadSpec(vocab_size=300, first_id=10, seed=3)
    w = Workload(spec)
    ids = [i for s in range(8) for i in w.prompt(s, 4)]
    assert min(ids) >= 10 and max(ids) < 300


def test_think_times_are_exponential_above_a_floor_never_back_to_back():
    spec = WorkloadSpec(sessions=400, turns=6, think_mean_s=2.0, think_min_s=0.25, seed=11, system_tokens=1,
                        user_tokens=1, output_tokens=1)
    w = Workload(spec)
    thinks = [t.think_s for s in w.sessions for t in s.turns[1:]]
    assert len(thinks) == 2000
    assert min(thinks) >= 0.25
    assert all(s.turns[0].think_s == 0.0 for s in w.sessions)
    excess = [x - 0.25 for x in thinks]
    # An exponential's mean equals its standard deviation; 2000 draws put both within ~10% of 2.0.
    assert statistics.mean(excess) == pytest.approx(2.0, rel=0.1)
    assert statistics.pstdev(excess) == pytest.approx(2.0, rel=0.15)
    # Its median is mean·ln 2.
    assert statistics.median(excess) == pytest.approx(2.0 * math.log(2), rel=0.12)
    starts = [s.start_s for s in w.sessions]
    assert min(starts) >= 0 and len(set(starts)) == len(starts)


def test_think_times_scale_with_the_mean_and_keep_the_tokens():
    slow, fast = Workload(WorkloadSpec(think_mean_s=4.0, seed=2)), Workload(WorkloadSpec(think_mean_s=1.0, seed=2))
    assert slow.prompt(3, 4) == fast.prompt(3, 4)
    for s_slow, s_fast in zip(slow.sessions, fast.sessions):
        for a, b in zip(s_slow.turns[1:], s_fast.turns[1:]):
            assert a.think_s - 0.25 == pytest.approx(4 * (b.think_s - 0.25))


def test_a_workload_that_would_arrive_back_to_back_is_refused():
    with pytest.raises(ValueError, match="back to back"):
        WorkloadSpec(think_mean_s=0, think_min_s=0)
    with pytest.raises(ValueError, match="turns must be at least 1"):
        WorkloadSpec(turns=0)


# ---- statistics ----------------------------------------------------------------


def test_percentiles_interpolate_between_ranks_as_numpy_does():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 95) == pytest.approx(4.8)
    assert percentile(values, 99) == pytest.approx(4.96)
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0], 25) == pytest.approx(1.25)
    numpy = pytest.importorskip("numpy")
    data = [0.31, 0.05, 2.2, 1.7, 0.9, 0.4, 0.41, 3.3, 0.07, 1.1, 0.6]
    for q in (1, 10, 50, 90, 95, 99):
        assert percentile(data, q) == pytest.approx(float(numpy.percentile(data, q)))
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summary_of_nothing_is_empty_not_an_error():
    s = Summary.of([])
    assert s.n == 0 and s.mean is None and s.p99 is None
    assert Summary.of([1.0, 3.0]).mean == 2.0


def _rec(session, turn, sent, ttft, *, total=2.0, prompt=1000, cached=0, tokens=50, error=""):
    r = RequestRecord(session=session, turn=turn, sent_s=sent, prompt_tokens_sent=prompt)
    if error:
        r.error = error
        r.ended_s = sent + 0.1
        return r
    r.first_token_s = sent + ttft
    r.done_s = r.ended_s = sent + total
    r.prompt_tokens, r.completion_tokens, r.cached_tokens = prompt, tokens, cached
    return r


def test_policy_stats_split_turn_one_and_count_hits_tpot_and_goodput():
    records = [
        _rec(0, 0, 0.0, 1.0, prompt=1200, cached=992),
        _rec(0, 1, 3.0, 0.2, prompt=1450, cached=1184),
        _rec(1, 0, 0.5, 1.5, prompt=1200, cached=0),
        _rec(1, 1, 4.0, 0.6, prompt=1450, cached=1200, total=2.6),  # done at 6.6 s: the last answer
        _rec(1, 2, 7.0, 0.0, error="http_500: boom"),
    ]
    s = PolicyStats.of(records, slo_s=0.5)
    assert s.ttft_turn1.n == 2 and s.ttft_turn1.mean == pytest.approx(1.25)
    assert s.ttft_later.n == 2 and s.ttft_later.mean == pytest.approx(0.4)
    assert s.answered == 4 and s.failed == 1
    assert s.hit_ratio_later == pytest.approx((1184 + 1200) / 2900)
    assert s.hit_ratio == pytest.approx((992 + 1184 + 1200) / 5300)
    assert s.tpot.mean == pytest.approx(statistics.mean([1.0 / 49, 1.8 / 49, 0.5 / 49, 2.0 / 49]))
    assert s.within_slo == 1
    assert s.span_s == pytest.approx(6.6)
    assert s.goodput_rps == pytest.approx(1 / 6.6)
    json.dumps(s.to_json())


def test_a_request_without_its_first_token_is_not_answered():
    r = RequestRecord(session=0, turn=0, sent_s=1.0, prompt_tokens_sent=10)
    assert not r.ok and r.ttft_s is None and r.tpot_s is None


# ---- fault attribution -----------------------------------------------------------


def test_failures_are_put_down_to_the_fault_they_met():
    events = [FaultEvent("daemon_killed", 0, 10.0), FaultEvent("daemon_ready", 0, 12.0),
              FaultEvent("engine_killed", 1, 20.0)]
    in_flight = _rec(0, 2, 19.0, 0, error="stream_broken: the stream ended before [DONE]")
    within = _rec(1, 2, 20.5, 0, error="http_502: upstream refused")
    late = _rec(2, 2, 25.0, 0, error="connect: refused")
    outage = _rec(3, 1, 11.0, 0, error="http_500: strata unavailable")
    other = _rec(4, 0, 1.0, 0, error="bad_stream: no token in the stream")
    reasons = [classify(r, events, health_interval_s=1.0) for r in (in_flight, within, late, outage, other)]
    assert reasons == ["engine_killed_in_flight", "sent_to_dead_engine_within_health_interval",
                       "sent_to_dead_engine_after_health_interval", "during_daemon_outage", "other"]
    ok = [_rec(5, t, 5.0 * t, 0.3, prompt=1200, cached=600) for t in range(5)]
    report = fault_report([in_flight, within, late, outage, other, *ok], events, 1.0, [])
    assert report["sent"] == 10 and report["answered"] == 5 and report["failed"] == 5
    assert report["failed_for_a_cache_reason"] == 1 and report["late_to_dead_engine"] == 1
    assert report["windows"]["before_faults"]["answered"] == 2  # sent at 0 and 5 s
    assert report["windows"]["after_engine_kill"]["sent"] == 3  # within, late, and the answer sent at 20 s
    json.dumps(report)


# ---- targets -----------------------------------------------------------------------


def _pt(load, mean, p95=None, goodput=0.5, equal=10, checked=10):
    return {"load": load, "stats": {"ttft_turns2plus_s": {"mean": mean, "p95": p95 or mean}, "goodput_rps": goodput},
            "fidelity": {"checked": checked, "equal": equal, "unchecked": 0}}


def _doc(by_policy: dict, loads=(0.2, 0.8), prefix=None, faults=None):
    """A results document with W1 only: ``by_policy`` key -> [(mean, goodput)] per load."""
    pols = {k: {"policy": k, "points": [_pt(u, m, goodput=g) for u, (m, g) in zip(loads, v)]}
            for k, v in by_policy.items()}
    return {"workloads": {"w1": {"points": [{"load": u} for u in loads], "policies": pols}},
            "faults": faults, "prefix_4k": prefix}


def test_targets_are_judged_from_the_figures_and_unmeasured_ones_are_not_judged():
    good = {"a": [(1.2, 0.2), (2.0, 0.1)], "b": [(0.5, 0.3), (1.0, 0.2)], "c": [(0.3, 0.4), (0.5, 0.5)],
            "d": [(0.32, 0.4), (0.52, 0.6)], "e": [(0.28, 0.4), (0.45, 0.7)]}
    rows = {t.name: t for t in sweep_targets(_doc(good, prefix={"cold_ttft_s": 2.0, "hit_ttft_s": 0.08}))}
    assert rows["w1 load 0.2: (c) vs (a) mean TTFT t2+, speedup"].met is True
    assert rows["w1 load 0.2: (c) vs (b) mean TTFT t2+, speedup"].measured == pytest.approx(0.5 / 0.3)
    assert "w1 load 0.8: (c) vs (a) mean TTFT t2+, speedup" not in rows  # above the low-load limit
    assert rows["w1 load 0.2: (d) vs (c) mean TTFT t2+, ratio"].met is True
    assert rows["w1 load 0.8: (d) vs (c) mean TTFT t2+, ratio"].measured == pytest.approx(0.52 / 0.5)
    assert rows["w1 load 0.8: best goodput at the SLO is a pool policy"].met is True
    assert rows["w1 (a): hit fidelity, answers equal to the reference"].met is True
    assert rows["4k prompt: cold / prefix-hit TTFT"].measured == pytest.approx(25.0)

    worse = {**good, "b": [(0.4, 0.3), (1.0, 0.9)], "d": [(0.4, 0.4), (0.6, 0.6)]}
    worse_doc = _doc(worse)
    worse_doc["workloads"]["w1"]["policies"]["e"]["points"][1]["fidelity"]["equal"] = 9
    rows = {t.name: t for t in sweep_targets(worse_doc)}
    assert rows["w1 load 0.2: (c) vs (b) mean TTFT t2+, speedup"].met is False
    assert rows["w1 load 0.2: (d) vs (c) mean TTFT t2+, ratio"].met is False
    assert rows["w1 load 0.8: best goodput at the SLO is a pool policy"].met is False  # b has the best
    assert rows["w1 (e): hit fidelity, answers equal to the reference"].met is False
    assert rows["w1 (e): hit fidelity, answers equal to the reference"].measured == pytest.approx(19 / 20)
    assert rows["4k prompt: cold / prefix-hit TTFT"].met is None

    del good["a"]
    rows = {t.name: t for t in sweep_targets(_doc(good))}
    assert rows["w1 load 0.2: (c) vs (a) mean TTFT t2+, speedup"].met is None
    assert rows["w1 load 0.8: best goodput at the SLO is a pool policy"].met is None


def test_a_fault_phase_whose_answers_differ_from_the_reference_misses_its_fidelity_target():
    faults = {"points": [_pt(0.6, 0.4, equal=7, checked=8)]}
    rows = {t.name: t for t in sweep_targets(_doc({"a": [(1.0, 0.1), (1.0, 0.1)]}, faults=faults))}
    assert rows["faults (e): hit fidelity, answers equal to the reference"].met is False
    assert rows["faults (e): hit fidelity, answers equal to the reference"].detail == "7/8 equal"
    faults = {"points": [_pt(0.6, 0.4, equal=0, checked=0)]}
    rows = {t.name: t for t in sweep_targets(_doc({"a": [(1.0, 0.1), (1.0, 0.1)]}, faults=faults))}
    assert rows["faults (e): hit fidelity, answers equal to the reference"].met is None


# ---- the sweep's parts ----------------------------------------------------------------


def test_w1_gives_each_session_a_context_of_its_own_and_w2_one_shared_prompt():
    w1 = Workload(WorkloadSpec(shared=False, seed=4))
    w2 = Workload(WorkloadSpec(shared=True, seed=4))
    assert w1.spec.name == "w1" and w2.spec.name == "w2"
    firsts = [w1.prompt(s, 0) for s in range(8)]
    assert len({tuple(p[:16]) for p in firsts}) == 8  # no session shares even a first block
    assert all(len(p) == 1200 for p in firsts) and len(w1.prompt(3, 4)) == 2200
    assert all(w1.prompt(s, 0)[:1000] == list(w1.context(s)) for s in range(8))
    assert len({tuple(w2.prompt(s, 0)[:1000]) for s in range(8)}) == 1


def test_sessions_arrive_as_a_poisson_process_of_the_rate_and_keep_their_tokens():
    spec = dict(sessions=2000, turns=2, system_tokens=1, user_tokens=1, output_tokens=1, seed=9)
    w = Workload(WorkloadSpec(arrival_rate_per_s=4.0, **spec))
    starts = [s.start_s for s in w.sessions]
    assert starts == sorted(starts) and starts[0] > 0
    gaps = [b - a for a, b in zip([0.0] + starts, starts)]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.1)  # 1 / rate
    assert statistics.pstdev(gaps) == pytest.approx(0.25, rel=0.15)  # exponential: sd = mean
    slower = Workload(WorkloadSpec(arrival_rate_per_s=1.0, think_mean_s=5.0, **spec))
    assert [slower.prompt(s, 1) for s in range(50)] == [w.prompt(s, 1) for s in range(50)]
    assert slower.sessions[10].start_s == pytest.approx(4 * w.sessions[10].start_s)
    with pytest.raises(ValueError):
        WorkloadSpec(arrival_rate_per_s=-1.0)


def test_every_load_point_of_a_sweep_has_prompts_of_its_own():
    sweep = SweepSpec(sessions=4, turns=3)
    p0, p1 = sweep.workload("w1", 0, 4096), sweep.workload("w1", 1, 4096)
    assert not {tuple(p[:16]) for _, _, p in p0.prompts()} & {tuple(p[:16]) for _, _, p in p1.prompts()}
    timed = sweep.workload("w1", 1, 4096, arrival_rate_per_s=0.5, think_mean_s=3.0)
    assert list(timed.prompts()) == list(p1.prompts())
    assert len(list(p0.prompts())) == 12
    assert parse_loads("0.8,0.2,0.4") == (0.2, 0.4, 0.8)
    for bad in ("0", "2", "x", ""):
        with pytest.raises(ValueError):
            parse_loads(bad)
    assert parse_workloads("W2,w1,w2") == ("w2", "w1")
    with pytest.raises(ValueError, match="choose from w1, w2"):
        parse_workloads("w3")


def _answered(point, session, turn, sent, ttft, total, ids):
    r = _rec(session, turn, sent, ttft, total=total)
    r.point, r.output_ids = point, ids
    return r


def test_the_reference_sets_capacity_slo_and_arrival_rate_from_cold_service_times():
    recs = [_answered(0, 0, 0, 0.0, 0.5, 1.0, [1]), _answered(0, 0, 1, 1.0, 0.9, 2.0, [2]),
            _answered(0, 1, 0, 0.0, 0.7, 1.5, [3]), _answered(1, 0, 0, 3.0, 0.6, 1.5, [4])]
    ref = Reference("w1", replicas=2, records=recs, expected={(r.point, r.session, r.turn): r.output_ids for r in recs})
    assert ref.service_s == pytest.approx(1.5)
    assert ref.capacity_rps == pytest.approx(2 / 1.5)
    assert ref.slo_s == pytest.approx(0.6)  # the median turn-1 TTFT
    assert ref.arrival_rate(0.6, turns=4) == pytest.approx(0.6 * (2 / 1.5) / 4)
    doc = ref.to_json()
    assert doc["prefill_share_of_service"] == pytest.approx(0.675 / 1.5, abs=1e-3)
    assert doc["cold_ttft_by_turn_s"] == {0: 0.6, 1: 0.9} and doc["failed"] == 0


def test_fidelity_counts_answers_equal_to_the_reference_and_says_where_one_differs():
    expected = {(0, 0, 0): [5, 6, 7], (0, 0, 1): [1, 2, 3], (0, 1, 0): [9, 9, 9]}
    recs = [_answered(0, 0, 0, 0.0, 0.1, 0.2, [5, 6, 7]), _answered(0, 0, 1, 1.0, 0.1, 0.2, [1, 2, 4]),
            _answered(0, 2, 0, 0.0, 0.1, 0.2, [1, 1, 1]), _rec(0, 1, 0.0, 0.0, error="http_500: x")]
    recs[1].cached_pool = 32
    f = Fidelity.of(recs, expected)
    assert (f.checked, f.equal, f.unchecked) == (2, 1, 1) and f.share == 0.5
    assert f.mismatches == ({"point": 0, "session": 0, "turn": 1, "first_difference_at": 2, "cached_local": 0,
                             "cached_pool": 32},)
    assert Fidelity.of([], expected).share is None
    json.dumps(f.to_json())


def test_bootstrap_intervals_cover_the_statistic_and_narrow_with_more_samples():
    import random as _random

    rng = _random.Random(1)
    few = [rng.expovariate(1.0) for _ in range(40)]
    many = [rng.expovariate(1.0) for _ in range(4000)]
    lo, hi = bootstrap_ci(few, "mean")
    assert lo < statistics.mean(few) < hi
    lo_m, hi_m = bootstrap_ci(many, "mean")
    assert lo_m < 1.0 < hi_m  # the true mean of Exp(1)
    assert hi_m - lo_m < (hi - lo) / 4
    plo, phi = bootstrap_ci(many, "p95")
    assert plo < math.log(20) < phi  # Exp(1)'s 95th percentile is ln 20
    assert bootstrap_ci(few, "p95") == bootstrap_ci(few, "p95")  # seeded
    assert bootstrap_ci([1.0, 2.0], "mean") is None
    with pytest.raises(ValueError):
        bootstrap_ci(few, "median")


def test_policies_are_chosen_by_letter():
    assert [p.key for p in parse_policies("all")] == list("abcdef")
    assert [p.key for p in parse_policies("e,a")] == ["e", "a"]
    assert POLICIES["c"].kv_events and not POLICIES["c"].pool and POLICIES["d"].pool
    with pytest.raises(ValueError, match="choose from a, b, c, d, e, f"):
        parse_policies("g")


# ---- the whole orchestration, small ------------------------------------------------


@pytest.mark.system
def test_a_small_run_starts_the_fleet_measures_every_request_and_survives_the_faults(tmp_path):
    """Real processes end to end: Redis, two daemons, two engines on the tiny model, the router, in the
    fault phase (cache-aware + shared pool; a daemon SIGKILLed and restarted, then an engine SIGKILLed).
    Checks what must hold whatever the machine's speed: every request accounted for, cached prefixes
    found, no failure for a cache reason, the dead engine out of rotation and sent nothing after."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    from tests.support import redis_servers

    if not redis_servers.available():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    from benchmarks.e2e.__main__ import main

    out = tmp_path / "results"
    # The data-fault phase runs in the smoke run (tests/benchmarks/test_bench_smoke.py), which checks its answers.
    assert main(["--model-size", "tiny", "--faults-only", "--no-data-faults", "--sessions", "3", "--turns", "3",
                 "--no-prefix-4k", "--results-dir", str(out)]) == 0
    doc = json.loads((out / "e2e.json").read_text())
    assert (out / "e2e_load.png").stat().st_size > 0
    assert "error" not in doc["workloads"]["w1"]["reference"]
    assert doc["workloads"]["w1"]["reference"]["requests"] == 9  # the fault point's prompts, once each, cold
    phase = doc["faults"]
    assert "error" not in phase, phase.get("error")
    [point] = phase["points"]
    requests = point["requests"]
    assert len(requests) == 9
    answered = [r for r in requests if not r["error"]]
    assert all(r["prompt_tokens"] == r["prompt_tokens_sent"] for r in answered)  # the engines saw our tokens
    assert sum(r["cached_tokens"] for r in answered if r["turn"] >= 1) > 0  # and found cached prefixes
    # Every answer, through the crash and restart of a daemon, equals the cold reference's tokens.
    assert point["fidelity"]["checked"] == len(answered) and point["fidelity"]["equal"] == len(answered)
    faults = phase["faults"]
    assert faults["injection_errors"] == []
    assert [ev["what"] for ev in faults["events"]] == ["daemon_killed", "daemon_ready", "engine_killed",
                                                        "engine_out_of_rotation"]
    assert faults["sent"] == 9 and faults["answered"] + faults["failed"] == 9
    assert faults["failed_for_a_cache_reason"] == 0 and faults["late_to_dead_engine"] == 0
    assert set(faults["failed_by_reason"]) <= {"engine_killed_in_flight", "sent_to_dead_engine_within_health_interval"}
    assert faults["router_upstream_errors_after_rotation"] == 0
    assert phase["router"]["decisions_by_reason"]


@pytest.mark.system
def test_a_prefix_computed_on_one_replica_is_loaded_on_the_other_through_its_own_daemon(tmp_path):
    """Policy (d)'s fleet: two daemons on one Redis index, each with the peer tier; engine 0 computes a
    prompt and stores its blocks to daemon 0; engine 1, asked the same prompt, loads them from daemon 1,
    which fetches them from daemon 0 (its Exists alone would have said "absent"). Then the next phase's
    fleet on the same engines, reconfigured rather than restarted: nothing the first phase cached is a
    hit there, in an engine's own cache or through the pool (a namespace of its own)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import random

    from tests.support import redis_servers

    if not redis_servers.available():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    from benchmarks.e2e import model
    from benchmarks.e2e.phases import one_request
    from benchmarks.e2e.fleet import Engines, Fleet, FleetSpec, Nodes, Phase
    from kvstore.client.sync import Client

    from tests.support.wait import wait_until

    model_dir = model.build(tmp_path / "model", size="tiny")
    # The next phase: (d) again, under a name of its own (its namespace and engine ids); round robin, so
    # its router starts without loading a tokenizer.
    phase, then = Phase("d", POLICIES["d"]), Phase("d2", POLICIES["d"])
    rng = random.Random(5)
    prompt = [rng.randrange(8, 500) for _ in range(320)]  # 20 full blocks
    with Nodes(FleetSpec(model_dir=model_dir), [phase, then]) as nodes, Engines(nodes) as engines:
        with Fleet(nodes, phase, engines) as fleet:
            first = one_request(fleet.replicas[0].url, fleet.model, prompt, 2)
            assert first.cached_tokens == 0

            def stored() -> bool:
                samples = fleet.engine_metrics()[fleet.replicas[0].engine_id]
                key = ("e2e_engine_pool_blocks_total", (("op", "store"), ("outcome", "stored")))
                return (samples.get(key) or 0) >= 20  # no sample before the first store

            wait_until(stored, what="engine 0's blocks stored to daemon 0")
            with Client(nodes.nodes[1].target) as kv:  # the index names node-0 as their holder

                def indexed() -> bool:
                    scores = kv.score(phase.namespace, tokens=prompt, block_size=16, hash_seed="0")
                    return any(s.node_id == "node-0" and s.blocks == 20 for s in scores)

                wait_until(indexed, what="node-0's blocks in the shared index")
            second = one_request(fleet.replicas[1].url, fleet.model, prompt + [7] * 16, 2)
            assert second.cached_pool == 320 and second.cached_local == 0

        with Fleet(nodes, then, engines) as fleet:
            assert fleet.engine_starts == 0 and engines.starts == 2
            # Engine 1 first: its own cache held the prompt, and the pool did under the first namespace.
            again = one_request(fleet.replicas[1].url, fleet.model, prompt + [7] * 16, 2)
            assert again.cached_tokens == 0
            # Engine 0 computed it in the first phase: its own cache is empty now (what engine 1 just
            # stored may reach it through the pool: that is this phase's own).
            again = one_request(fleet.replicas[0].url, fleet.model, prompt, 2)
            assert again.cached_local == 0


# ---- the data faults' tools ---------------------------------------------------------------


def test_the_damaged_path_flips_one_byte_every_n_and_mends_itself_after_its_limit():
    import socket
    import threading

    from tests.support.peer_cluster import FlipProxy

    payload = bytes(range(256)) * 4000  # 1,024,000 bytes
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(16)
            conn.sendall(payload)

    threading.Thread(target=serve, daemon=True).start()
    proxy = FlipProxy(server.getsockname(), b"", every=100_003, limit=4)
    try:
        host, port = proxy.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as c:
            c.sendall(b"hello")
            got = bytearray()
            while len(got) < len(payload):
                chunk = c.recv(1 << 16)
                assert chunk
                got += chunk
        diffs = [i for i, (a, b) in enumerate(zip(got, payload)) if a != b]
        assert diffs == [100_003, 200_006, 300_009, 400_012]  # the first 100,003 bytes whole; then mended
        assert all(got[i] == payload[i] ^ 0xFF for i in diffs)
        assert proxy.flipped == 4 and not proxy.enabled
    finally:
        proxy.close()
        server.close()


def test_a_reboot_damages_per_chain_the_block_nearest_the_middle_that_the_disk_holds(tmp_path):
    from benchmarks.e2e.faults import damage_block_files
    from kvstore.block import BlockKey
    from kvstore.tiers.block_file import block_name

    def file_of(key: bytes):
        name = block_name(BlockKey("ns", key))
        return tmp_path / "blocks" / name[:2] / name

    chains = [[bytes([c, i]) * 4 for i in range(5)] for c in range(4)]
    held = {0: range(5), 1: range(5), 3: range(2)}  # chain 2 is not on this disk; chain 3's first turn only
    for c, blocks in held.items():
        for i in blocks:
            file_of(chains[c][i]).parent.mkdir(parents=True, exist_ok=True)
            file_of(chains[c][i]).write_bytes(bytes([i]) * 1000)
    damaged = damage_block_files(tmp_path, "ns", chains, 5, 64)
    hit = {0: 2, 1: 2, 3: 1}  # the middle where held, else the held block nearest it
    assert damaged == [block_name(BlockKey("ns", chains[c][i])) for c, i in hit.items()]
    for c, blocks in held.items():
        for i in blocks:
            data = file_of(chains[c][i]).read_bytes()
            assert data[:936] == bytes([i]) * 936
            assert data[936:] == (bytes([i ^ 0x5A]) * 64 if hit[c] == i else bytes([i]) * 64)
    assert damage_block_files(tmp_path, "ns", chains, 1, 64) == damaged[:1]  # at most n
    # A block another node's disk holds too would be read there instead: the next one nearest the middle.
    other = tmp_path / "other"
    copy = other / "blocks" / block_name(BlockKey("ns", chains[0][2]))[:2] / block_name(BlockKey("ns", chains[0][2]))
    copy.parent.mkdir(parents=True)
    copy.write_bytes(b"x" * 1000)
    assert damage_block_files(tmp_path, "ns", chains[:1], 1, 64, [other]) in (
        [block_name(BlockKey("ns", chains[0][1]))], [block_name(BlockKey("ns", chains[0][3]))])


@pytest.mark.system
def test_disaggregated_serving_hands_the_prompt_s_kv_from_the_prefill_replica_to_the_decode_one(tmp_path):
    """Policy (f)'s fleet: the router prefills on replica 0, whose engine stores the prompt's blocks and
    opens a handoff on its daemon; replica 1's engine pulls them through its own daemon (Strata's handoff
    over the peer data plane), loads them instead of computing them, and decodes: the same tokens as a
    cold engine with no cache at all."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import random

    from tests.support import redis_servers

    if not redis_servers.available():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    from benchmarks.e2e import model
    from benchmarks.e2e.client import completion_body
    from benchmarks.e2e.engine import Engine, EngineConfig
    from benchmarks.e2e.fleet import Engines, Fleet, FleetSpec, Nodes, Phase, scrape
    from tests.support.router_stand_in import http

    model_dir = model.build(tmp_path / "model", size="tiny")
    phase = Phase("f", POLICIES["f"])
    rng = random.Random(9)
    prompt = [rng.randrange(8, 500) for _ in range(330)]  # 20 full blocks and 10 tokens
    cold = Engine(EngineConfig(model=str(model_dir), prefix_cache="none", threads=1))
    try:
        expected = cold.generate(prompt, 6, ignore_eos=True).tokens
    finally:
        cold.close()
    with Nodes(FleetSpec(model_dir=model_dir), [phase]) as nodes, Engines(nodes) as engines:
        with Fleet(nodes, phase, engines) as fleet:
            body = {**completion_body(fleet.model, prompt, 6), "stream": False}
            body.pop("stream_options")
            status, _, raw = http("POST", fleet.url + "/v1/completions", body, timeout=120)
            assert status == 200, raw
            answer = json.loads(raw)
            assert answer["choices"][0]["token_ids"] == expected
            assert answer["strata"]["engine_id"] == fleet.replicas[1].engine_id  # decoded on replica 1
            assert answer["strata"]["pulled_blocks"] == 20
            assert answer["strata"]["cached_pool"] == 320  # what it loaded rather than computed
            router = fleet.router_metrics()
            assert router[("strata_router_disaggregated_requests_total", (("outcome", "handoff"),))] == 1
            prefill = scrape(fleet.replicas[0].url)
            assert prefill[("e2e_engine_pool_blocks_total", (("op", "handoff"), ("outcome", "opened")))] == 20


def test_the_drill_reports_time_to_ready_origin_bytes_and_the_new_replica_s_first_requests():
    from benchmarks.e2e.drill import DrillPlan, ScaleUp

    class Origin:
        model_bytes = 1000
        digest = "d" * 64

    class Fleet:
        class spec:
            replicas = 2

        class nodes:
            nodes = [None, None, "spare"]

    scale = ScaleUp(Fleet, Origin, DrillPlan(first_requests=2), lambda: 0.0, 10, with_strata=True,
                    url="http://10.0.0.3:1", engine_id="engine-2-drill", model_name="model")
    scale.events = {"started": 10.0, "weights_warm": 11.5, "engine_ready": 14.0}
    scale.detail["weights"] = {"bytes_by_source": {"origin": 40, "peer:10.0.0.1:7460": 960}}
    recs = []
    for i, (engine, sent) in enumerate([("engine-0-drill", 12.0), ("engine-2-drill", 14.5), ("engine-2-drill", 15.0),
                                        ("engine-2-drill", 16.0)]):
        r = _rec(i, 1, sent, 0.2 + i / 10, cached=600 if i == 1 else 0, prompt=1000)
        r.engine_id = engine
        recs.append(r)
    u = scale.report(recs)
    assert u["time_to_ready_s"] == pytest.approx(14.5 + 0.3 - 10.0)  # its first token served
    assert u["steps_s"] == {"started": 0.0, "weights_warm": 1.5, "engine_ready": 4.0}
    assert u["origin_bytes"] == 40 and u["model_bytes"] == 1000
    assert u["requests_served"] == 3 and u["first_requests_ttft_s"]["n"] == 2
    assert u["first_requests_ttft_s"]["mean"] == pytest.approx(0.35)
    assert u["first_requests_hit_ratio"] == pytest.approx(0.3)
    scale.detail = {"origin_bytes": 1000}  # without Strata: the download's bytes
    assert scale.report(recs)["origin_bytes"] == 1000


def test_the_docs_tables_are_rendered_from_a_run_s_json():
    from benchmarks.e2e.markdown import render
    from benchmarks.harness import RESULTS_DIR

    doc = json.loads((RESULTS_DIR / "e2e.json").read_text())
    text = render(doc)
    for name, entry in doc["workloads"].items():
        assert f"### {entry['name']}" in text
        for pol in entry["policies"].values():
            assert f"| {pol['policy']} |" in text
    assert text.count("| w1 ") + text.count("| w2 ") >= len([t for t in doc["targets"] if t["name"][:2] in ("w1", "w2")])
    assert "### The scale-up drill" in text and "### Faults" in text
