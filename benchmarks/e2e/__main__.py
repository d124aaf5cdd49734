"""End to end: multi-turn chat TTFT against offered load, per workload and per routing and caching policy.

Run as ``python -m benchmarks.e2e [--quick | --smoke] [--workloads w1,w2] [--loads 0.2,0.4,0.6,0.8]
[--policies a,b,...] [--no-faults]``.

A private Redis, one ``strata serve`` per replica (the prefix index and the
shared pool), one engine per replica (``benchmarks.e2e.engine``, one compute
thread each, started once and reconfigured with an empty cache for each
phase) and, per phase, ``strata route`` in front of them, all as child
processes (:mod:`benchmarks.e2e.fleet`): each replica a host of its own (a
network namespace with its own address, so pool hits cross a network path
over the peer transport), Redis and the router on a third; ``--loopback``
puts everything on 127.0.0.1.

For each workload (:mod:`benchmarks.e2e.workload`; W1: each session its own
1,000-token context, nothing shared; W2: one shared 1,000-token system
prompt) the sweep (:mod:`benchmarks.e2e.sweep`) first sends every prompt
of every load point once to engines with no cache (the cold reference: the
tokens every later answer must equal, the fleet's capacity, the TTFT SLO),
then runs each policy (:mod:`benchmarks.e2e.policies`: five colocated, one
prefill/decode disaggregated through Strata's handoff) at each load point:
offered load 0.2, 0.4, 0.6 and 0.8 of the capacity, sessions of 4 turns
(200 user tokens and 16 generated per turn) arriving as a Poisson process,
each turn after a think time. Every answer is checked token for token
against the reference (hit fidelity). Then a fault phase
(:mod:`benchmarks.e2e.faults`): the cache-aware + shared-pool fleet at the
middle load with a daemon SIGKILLed and restarted mid-run and later an
engine SIGKILLed, and the data-fault phase (:class:`~benchmarks.e2e.faults.DataFaultPlan`:
a damaged peer path, a host rebooted with a damaged disk), their answers
checked too. Between the sweep and the faults, the scale-up drill
(:mod:`benchmarks.e2e.drill`): a third replica added at load 0.8, its
weights through the nodes' weight caches and its KV from the pool, then the
same without Strata.

Writes ``benchmarks/results/e2e.json`` (every request's timing included),
``benchmarks/results/e2e_load.png`` (TTFT p50/p95 and goodput against load,
:mod:`benchmarks.e2e.plot`) and ``benchmarks/results/e2e_ttft.png`` (the
TTFT distributions at one load point).

``--smoke`` runs every code path once and writes nothing: the tiny model,
both workloads at one load point, one session of two turns, their cold
references, policy (a) (round robin, last prompt cached, no events, no
pool), the scale-up drill both ways, the fault phase, which runs (e)
(cache-aware, block cache, KV events, the shared pool; the second turn
finds the first's KV) with a daemon down for a second, the data-fault
phase, then the prefix-hit measurement on a 256-token prompt. It fails
unless every phase answered, the drill's replica joined the router, and
every answer equals the reference's tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.e2e.document import NAME, build_document, check_smoke, write
from benchmarks.e2e.faults import DataFaultPlan, FaultInjector, FaultPlan
from benchmarks.e2e.fleet import Engines, FleetSpec, Nodes, Phase
from benchmarks.e2e.phases import data_fault_phase, model_vocab, reference_phase, run_drill, run_phase
from benchmarks.e2e.policies import POLICIES, parse_policies
from benchmarks.e2e.sweep import REFERENCE, WORKLOADS, SweepSpec, parse_loads, parse_workloads
from benchmarks.harness import RESULTS_DIR, smoke_line

log = logging.getLogger("benchmarks.e2e")

PREFIX_TOKENS = 4096
PREFIX_CACHED = 4032  # whole blocks: the prompt's last 64 tokens are prefilled over the cached KV
PREFIX_TIMEOUT_S = 600
PREFIX_4K = dict(prefix_tokens=PREFIX_TOKENS, prefix_cached=PREFIX_CACHED)
FULL = dict(sweep=SweepSpec(), prefix_rounds=3, model_size="small", policies="all", faults={}, data_faults={},
            drill_sessions=48, **PREFIX_4K)
QUICK = dict(sweep=SweepSpec(workloads=("w1",), loads=(0.6,), sessions=4, turns=2), prefix_rounds=1,
             model_size="small", policies="all", faults={}, data_faults={}, drill_sessions=8, **PREFIX_4K)
# (a) and the fault phase's (e) between them take every branch: prefix cache last and blocks, KV events
# and the index off and on, the pool off and on, round robin and cache-aware routing.
SMOKE = dict(sweep=SweepSpec(loads=(0.5,), sessions=1, turns=2, system_tokens=200, user_tokens=40, output_tokens=4),
             prefix_rounds=1, model_size="tiny", policies="a", faults=dict(daemon_down_s=1.0),
             data_faults=dict(disk_blocks=2, peer_every=4099), drill_sessions=2, prefix_tokens=256, prefix_cached=240)
DRILL_LOAD = 0.8  # of the two replicas' capacity, when the third is added
FAULT_LOAD = 0.6  # the fault phase runs at the sweep's load point nearest this
MODEL_BUILD_TIMEOUT_S = 300.0  # how long prestarted engines wait for the model being built


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=__doc__.split("\n\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="W1 only, one load point (0.6), 4 sessions × 2 turns, one round of the 4k "
                           "measurement: the shape of the full run in minutes")
    size.add_argument("--smoke", action="store_true",
                      help="every code path once, in seconds, writing no results: the tiny model, 1 session × 2 "
                           "turns per workload, policy a, the scale-up drill, the fault phases, a 256-token "
                           "prefix measurement")
    p.add_argument("--replicas", type=int, default=2, help="engines (each with its own daemon); default 2")
    p.add_argument("--loopback", action="store_true",
                   help="every part on 127.0.0.1 (by default each replica is a host of its own: a network "
                        "namespace with its own address, which needs root; without it, loopback is used)")
    p.add_argument("--policies", help="which of a,b,c,d,e,f to run (default all; a with --smoke): "
                   + "; ".join(f"{k} {v.label}" for k, v in POLICIES.items()))
    p.add_argument("--workloads", help=f"which of {', '.join(f'{k} ({v})' for k, v in WORKLOADS.items())} "
                                       "to run (default both)")
    p.add_argument("--loads", help="offered loads, as shares of the fleet's cold capacity (default 0.2,0.4,0.6,0.8)")
    p.add_argument("--no-faults", action="store_true", help="leave out the fault phases")
    p.add_argument("--no-data-faults", action="store_true",
                   help="of the fault phases, run only the crashes (no damaged peer path or disk)")
    p.add_argument("--no-drill", action="store_true", help="leave out the scale-up drill")
    p.add_argument("--faults-only", action="store_true", help="run only the fault phase (and its reference)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sessions", type=int, help="sessions per load point (default 16; 4 with --quick)")
    p.add_argument("--turns", type=int, help="turns per session (default 4; 2 with --quick)")
    p.add_argument("--think-factor", type=float,
                   help="mean think time / the mean cold service time of a request (default 2)")
    p.add_argument("--slo", type=float, help="TTFT SLO in seconds (default: the median cold TTFT of a turn-1 "
                                             "prompt in the reference run)")
    p.add_argument("--load-weight", type=float, default=FleetSpec.load_weight,
                   help=f"the router's --load-weight for (c) and (e) (default {FleetSpec.load_weight})")
    p.add_argument("--model-dir", type=Path, help="an existing model directory (default: build the small model)")
    p.add_argument("--model-size", choices=("tiny", "small", "bench"),
                   help="the model built (default small; tiny with --smoke)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--fresh-engines", action="store_true",
                   help="start new engines for every phase instead of reconfiguring the running ones "
                        "(the set-up cost that reuse saves)")
    p.add_argument("--no-prefix-4k", action="store_true", help="leave out the 4,096-token prefix-hit measurement")
    args = p.parse_args(argv)
    if args.replicas < 1:
        p.error("--replicas must be at least 1")
    if args.faults_only and args.no_faults:
        p.error("--faults-only and --no-faults exclude each other")
    if not args.no_faults and args.replicas < 2:
        p.error("the fault phase needs --replicas 2 or more (or --no-faults)")
    for name in ("sessions", "turns"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.think_factor is not None and args.think_factor <= 0:
        p.error("--think-factor must be > 0: turns never arrive back to back")
    try:
        args.loads = parse_loads(args.loads) if args.loads else None
        args.workloads = parse_workloads(args.workloads) if args.workloads else None
        args.policies = parse_policies(args.policies) if args.policies else None
    except ValueError as e:
        p.error(str(e))
    return args


def prefix_4k(model_dir: Path, rounds: int, threads: int, prompt_tokens: int = PREFIX_TOKENS,
              cached_tokens: int = PREFIX_CACHED) -> dict:
    """The engine's own single-prompt measurement (:mod:`benchmarks.e2e.ttft`): a 4,096-token prompt cold,
    then one sharing its first 4,032 tokens with them cached (by default); in a process of its own, on
    ``threads`` torch threads (those of one replica)."""
    with tempfile.TemporaryDirectory(prefix="strata-e2e-ttft-") as tmp:
        out = Path(tmp) / "ttft.json"
        argv = [sys.executable, "-m", "benchmarks.e2e.ttft", "--model", str(model_dir), "--prompt-tokens",
                str(prompt_tokens), "--cached-tokens", str(cached_tokens), "--rounds", str(rounds),
                "--threads", str(threads), "--out", str(out)]
        started = time.monotonic()
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=PREFIX_TIMEOUT_S)
        if not out.exists():
            return {"error": f"benchmarks.e2e.ttft exited with {proc.returncode}: {proc.stderr[-1500:]}"}
        doc = json.loads(out.read_text())
    r = doc.get("detail", doc)  # the harness's format keeps the measurement under "detail"
    keep = ("prompt_tokens", "cached_tokens", "rounds", "threads", "ratio", "cpu_ratio", "first_token_equal",
            "cold_s", "hit_s", "cold_cpu_median_s", "hit_cpu_median_s")
    return {"cold_ttft_s": r["cold_median_s"], "hit_ttft_s": r["hit_median_s"],
            **{k: r[k] for k in keep if k in r}, "seconds": round(time.monotonic() - started, 1)}


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds the fleet's teardown: scratch directories in /dev/shm go too


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if threading.current_thread() is not threading.main_thread():
        return _main(args)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _main(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def sweep_of(args: argparse.Namespace, mode: dict) -> SweepSpec:
    sweep: SweepSpec = mode["sweep"]
    changes = {k: v for k, v in (("workloads", args.workloads), ("loads", args.loads), ("sessions", args.sessions),
                                 ("turns", args.turns), ("think_factor", args.think_factor), ("seed", args.seed))
               if v is not None}
    return replace(sweep, **changes)


def fault_point(sweep: SweepSpec) -> int:
    """The load point the fault phase runs at: the one nearest :data:`FAULT_LOAD`."""
    return min(range(len(sweep.loads)), key=lambda i: abs(sweep.loads[i] - FAULT_LOAD))


def _main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    t_start = time.monotonic()
    mode = SMOKE if args.smoke else QUICK if args.quick else FULL
    sweep = sweep_of(args, mode)
    model_size = args.model_size or mode["model_size"]
    policies = [] if args.faults_only else (args.policies or parse_policies(mode["policies"]))
    faults = not args.no_faults
    workloads = sweep.workloads[:1] if args.faults_only else sweep.workloads
    refs = {w: Phase(f"{w}-ref", REFERENCE) for w in workloads}
    phases = {(w, p.key): Phase(f"{w}-{p.key}", p) for w in workloads for p in policies}
    fault_phases = [Phase("faults", POLICIES["e"])] if faults else []
    if faults and not args.no_data_faults:
        fault_phases.append(Phase("data-faults", POLICIES["d"]))
    drill = not args.no_drill and not args.faults_only
    drill_phases = [Phase("drill-strata", POLICIES["e"]), Phase("drill-origin", POLICIES["b"])] if drill else []
    every = [*refs.values(), *phases.values(), *drill_phases, *fault_phases]

    with contextlib.ExitStack() as stack:
        model_dir, build_model = args.model_dir, args.model_dir is None
        if build_model:
            home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="strata-e2e-model-")))
            model_dir = home / "model"
        spec = FleetSpec(model_dir=model_dir, replicas=args.replicas, load_weight=args.load_weight,
                         loopback=args.loopback, spare=1 if drill else 0)
        nodes = stack.enter_context(Nodes(spec, every))
        engines = stack.enter_context(Engines(nodes, reuse=not args.fresh_engines))
        if build_model:
            from benchmarks.e2e import model as model_builder

            engines.prestart(every[0], wait_for_model_s=MODEL_BUILD_TIMEOUT_S)  # imports overlap the build
            t = time.monotonic()
            model_builder.build(model_dir, size=model_size)
            log.info("built the %s model in %.1f s", model_size, time.monotonic() - t)
        vocab = model_vocab(model_dir)
        results: dict = {"workloads": {}, "faults": None, "data_faults": None, "drill": None}
        fault_points = None
        drill_point = len(sweep.loads)  # the drill's sessions: a point of their own, in W1's reference
        for w in workloads:
            log.info("workload %s: the cold reference run", w)
            tokens_only = [(i, sweep.workload(w, i, vocab)) for i in range(len(sweep.loads))]
            if args.faults_only:
                tokens_only = [tokens_only[fault_point(sweep)]]
            if drill and w == "w1":
                tokens_only.append((drill_point, sweep.workload(w, drill_point, vocab, sessions=mode["drill_sessions"])))
            ref, ref_out = reference_phase(nodes, engines, refs[w], w, tokens_only)
            entry = results["workloads"][w] = {"reference": ref_out, "policies": {}, "ref": ref}
            if ref is None:
                continue
            think = sweep.think_factor * ref.service_s
            entry["think_mean_s"] = round(think, 4)
            points = [(i, u, sweep.workload(w, i, vocab, arrival_rate_per_s=ref.arrival_rate(u, sweep.turns),
                                            think_mean_s=think)) for i, u in enumerate(sweep.loads)]
            entry["points"] = [{"point": i, "load": u, "arrival_rate_per_s": round(wl.spec.arrival_rate_per_s, 5),
                                "offered_rps": round(u * ref.capacity_rps, 4)} for i, u, wl in points]
            log.info("%s: cold service %.3f s, capacity %.2f requests/s, SLO %.3f s, think time mean %.2f s",
                     w, ref.service_s, ref.capacity_rps, ref.slo_s, think)
            for p in policies:
                phase = phases[(w, p.key)]
                log.info("phase %s: %s", phase.name, p.name)
                entry["policies"][p.key] = run_phase(nodes, engines, phase, points, ref)
                log.info("phase %s took %.0f s", phase.name, entry["policies"][p.key]["seconds"])
            if w == workloads[0]:
                fault_points = (w, ref, points[fault_point(sweep)])
            if drill and w == "w1":
                point = (drill_point, DRILL_LOAD, sweep.workload(
                    w, drill_point, vocab, arrival_rate_per_s=ref.arrival_rate(DRILL_LOAD, sweep.turns),
                    think_mean_s=think, sessions=mode["drill_sessions"]))
                results["drill"] = run_drill(nodes, engines, drill_phases, point, ref, model_dir)
        if fault_phases and fault_points is not None:
            # Last: a daemon the fault threads restart lives only as long as its thread (PR_SET_PDEATHSIG).
            w, ref, point = fault_points
            log.info("the fault phase (%s, load %.2f)", w, point[1])
            plan = FaultPlan(**mode["faults"])
            results["faults"] = run_phase(nodes, engines, fault_phases[0], [point], ref,
                                          lambda fleet, clock, n: FaultInjector(fleet, plan, clock, n))
            results["faults"]["workload"] = w
            if len(fault_phases) > 1:
                log.info("the data-fault phase (%s, load %.2f)", w, point[1])
                results["data_faults"] = data_fault_phase(nodes, engines, fault_phases[1], point, ref,
                                                          DataFaultPlan(**mode["data_faults"]))
                results["data_faults"]["workload"] = w
        engines.close()  # the 4k measurement has the machine to itself, as when each phase stopped its own
        if args.no_prefix_4k:
            prefix = None
        else:
            log.info("the %s-token prefix-hit measurement", f"{mode['prefix_tokens']:,}")
            prefix = prefix_4k(model_dir, mode["prefix_rounds"], spec.engine_threads, mode["prefix_tokens"],
                               mode["prefix_cached"])
        results["network"] = nodes.network_note
        doc = build_document(args, sweep, results, prefix, spec, time.monotonic() - t_start)
    if args.smoke:
        failed = check_smoke(doc)
        if failed:
            print("smoke run failed: " + "; ".join(failed), file=sys.stderr, flush=True)
            return 1
        print(smoke_line(NAME), flush=True)
    else:
        write(doc, results, args.results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
