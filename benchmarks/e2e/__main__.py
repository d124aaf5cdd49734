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
then runs each policy (:mod:`benchmarks.e2e.policies`) at each load point:
offered load 0.2, 0.4, 0.6 and 0.8 of the capacity, sessions of 4 turns
(200 user tokens and 16 generated per turn) arriving as a Poisson process,
each turn after a think time. Every answer is checked token for token
against the reference (hit fidelity). Then a fault phase
(:mod:`benchmarks.e2e.faults`): the cache-aware + shared-pool fleet at the
middle load with a daemon SIGKILLed and restarted mid-run and later an
engine SIGKILLed, its answers checked too.

Writes ``benchmarks/results/e2e.json`` (every request's timing included),
``benchmarks/results/e2e_load.png`` (TTFT p50/p95 and goodput against load,
:mod:`benchmarks.e2e.plot`) and ``benchmarks/results/e2e_ttft.png`` (the
TTFT distributions at one load point).

``--smoke`` runs every code path once and writes nothing: the tiny model,
both workloads at one load point, one session of two turns, their cold
references, policy (a) (round robin, last prompt cached, no events, no
pool) and the fault phase, which runs (e) (cache-aware, block cache, KV
events, the shared pool; the second turn finds the first's KV) with a
daemon down for a second, then the prefix-hit measurement on a 256-token
prompt. It fails unless every phase answered and every answer equals the
reference's tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import aiohttp

from benchmarks.e2e import driver
from benchmarks.e2e.client import completion_body, monotonic_clock, stream_completion
from benchmarks.e2e.faults import DataFaultInjector, DataFaultPlan, FaultInjector, FaultPlan
from benchmarks.e2e.fleet import BLOCK_SIZE, HASH_SEED, Engines, Fleet, FleetSpec, Nodes, Phase, StartFailed
from benchmarks.e2e.policies import POLICIES, parse_policies
from benchmarks.e2e.report import engine_summary, router_summary, sweep_targets, table, targets_table
from benchmarks.e2e.stats import Fidelity, PolicyStats, RequestRecord
from benchmarks.e2e.sweep import REFERENCE, WORKLOADS, Reference, SweepSpec, parse_loads, parse_workloads, run_reference
from benchmarks.e2e.workload import Workload
from benchmarks.harness import RESULTS_DIR, smoke_line

log = logging.getLogger("benchmarks.e2e")

NAME = "e2e"
PREFIX_TOKENS = 4096
PREFIX_CACHED = 4032  # whole blocks: the prompt's last 64 tokens are prefilled over the cached KV
PREFIX_TIMEOUT_S = 600
PREFIX_4K = dict(prefix_tokens=PREFIX_TOKENS, prefix_cached=PREFIX_CACHED)
FULL = dict(sweep=SweepSpec(), prefix_rounds=3, model_size="small", policies="all", faults={}, data_faults={},
            **PREFIX_4K)
QUICK = dict(sweep=SweepSpec(workloads=("w1",), loads=(0.6,), sessions=4, turns=2), prefix_rounds=1,
             model_size="small", policies="all", faults={}, data_faults={}, **PREFIX_4K)
# (a) and the fault phase's (e) between them take every branch: prefix cache last and blocks, KV events
# and the index off and on, the pool off and on, round robin and cache-aware routing.
SMOKE = dict(sweep=SweepSpec(loads=(0.5,), sessions=1, turns=2, system_tokens=200, user_tokens=40, output_tokens=4),
             prefix_rounds=1, model_size="tiny", policies="a", faults=dict(daemon_down_s=1.0),
             data_faults=dict(disk_blocks=2, peer_every=4099), prefix_tokens=256, prefix_cached=240)
FAULT_LOAD = 0.6  # the fault phase runs at the sweep's load point nearest this


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=__doc__.split("\n\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="W1 only, one load point (0.6), 4 sessions × 2 turns, one round of the 4k "
                           "measurement: the shape of the full run in minutes")
    size.add_argument("--smoke", action="store_true",
                      help="every code path once, in seconds, writing no results: the tiny model, 1 session × 2 "
                           "turns per workload, policy a and the fault phase, a 256-token prefix measurement")
    p.add_argument("--replicas", type=int, default=2, help="engines (each with its own daemon); default 2")
    p.add_argument("--loopback", action="store_true",
                   help="every part on 127.0.0.1 (by default each replica is a host of its own: a network "
                        "namespace with its own address, which needs root; without it, loopback is used)")
    p.add_argument("--policies", help="which of a,b,c,d,e to run (default all; a with --smoke)")
    p.add_argument("--workloads", help=f"which of {', '.join(f'{k} ({v})' for k, v in WORKLOADS.items())} "
                                       "to run (default both)")
    p.add_argument("--loads", help="offered loads, as shares of the fleet's cold capacity (default 0.2,0.4,0.6,0.8)")
    p.add_argument("--no-faults", action="store_true", help="leave out the fault phase")
    p.add_argument("--faults-only", action="store_true", help="run only the fault phase (and its reference)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sessions", type=int, help="sessions per load point (default 24; 4 with --quick)")
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


async def _one(url: str, model: str, prompt: list[int], max_tokens: int) -> RequestRecord:
    async with aiohttp.ClientSession() as http:
        clock = monotonic_clock()
        record = RequestRecord(session=-1, turn=0, sent_s=0.0, prompt_tokens_sent=len(prompt))
        return await stream_completion(http, url.rstrip("/") + "/v1/completions",
                                       completion_body(model, prompt, max_tokens), record, clock)


def one_request(url: str, model: str, prompt: list[int], max_tokens: int) -> RequestRecord:
    r = asyncio.run(_one(url, model, prompt, max_tokens))
    if not r.ok:
        raise RuntimeError(f"request to {url} failed: {r.error}")
    return r


MODEL_BUILD_TIMEOUT_S = 300.0  # how long prestarted engines wait for the model being built


def warm_up(fleet: Fleet, vocab: int, rng: random.Random) -> None:
    """One short request per engine, straight to it: first-call costs stay out of the measurement."""
    for r in fleet.replicas:
        one_request(r.url, fleet.model, [rng.randrange(4, vocab) for _ in range(64)], 2)


def model_vocab(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


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


def ttft_priors(reference: Reference | None) -> list[str]:
    """The router's TTFT priors from the reference run, as an operator sets them from a measurement of
    their hardware: a cold prompt's TTFT over its tokens per token; a request ahead costs its decode
    (service time less TTFT) beyond the prefill the backlog counts. None before a reference ran."""
    if reference is None:
        return []
    ok = [r for r in reference.records if r.ok]
    per_token = sum(r.ttft_s for r in ok) / sum(r.prompt_tokens for r in ok)
    ahead = max(0.0, reference.service_s - statistics.fmean(r.ttft_s for r in ok))
    return ["--ttft-prefill-seconds-per-token", f"{per_token:.3g}", "--ttft-seconds-per-request-ahead", f"{ahead:.3g}"]


def run_phase(nodes: Nodes, engines: Engines, phase: Phase, points: list[tuple[int, float, Workload]],
              reference: Reference | None, injector: Callable[..., FaultInjector] | None = None) -> dict:
    """One policy on one fleet at each load point in turn (``points``: (index, load, workload)); with
    ``injector`` (``(fleet, clock, requests) -> FaultInjector``), its faults during the (single) point."""
    started = time.monotonic()
    out: dict = {"policy": phase.policy.name, "namespace": phase.namespace, "points": []}
    try:
        with Fleet(nodes, phase, engines, router_args=ttft_priors(reference)) as fleet:
            # Set-up: engines started or reconfigured, the router started, every engine in rotation.
            out["setup_s"] = round(time.monotonic() - started, 1)
            out["engine_starts"] = fleet.engine_starts
            warm_up(fleet, model_vocab(nodes.spec.model_dir), random.Random(f"warm-{phase.name}"))
            for index, load, workload in points:
                t = time.monotonic()
                clock = monotonic_clock()
                point: dict = {"point": index, "load": load, "arrival_rate_per_s": workload.spec.arrival_rate_per_s}
                if injector is None:
                    records = driver.run(workload, fleet.url, fleet.model, clock=clock)
                else:
                    with injector(fleet, clock, workload.requests) as inj:
                        records = driver.run(workload, fleet.url, fleet.model, clock=clock, on_answer=inj.observe,
                                             before_last_turn=inj.hold)
                        out["faults"] = inj.report(records)
                for r in records:
                    r.point = index
                point["records"] = records
                point["seconds"] = round(time.monotonic() - t, 1)
                out["points"].append(point)
                log.info("phase %s, load %.2f: %d requests in %.0f s", phase.name, load, len(records),
                         point["seconds"])
            out["router"] = router_summary(fleet.router_metrics())
            out["engines"] = engine_summary(fleet.engine_metrics())
    except (StartFailed, RuntimeError, OSError) as e:
        log.error("phase %s failed: %s", phase.name, e)
        out["error"] = f"{type(e).__name__}: {str(e)[-2000:]}"
    out["seconds"] = round(time.monotonic() - started, 1)
    return out


def reference_phase(nodes: Nodes, engines: Engines, phase: Phase, name: str,
                    workloads: list[tuple[int, Workload]]) -> tuple[Reference | None, dict]:
    """The cold reference run of workload ``name`` (:func:`benchmarks.e2e.sweep.run_reference`)."""
    started = time.monotonic()
    out: dict = {"policy": phase.policy.name}
    ref = None
    try:
        with Fleet(nodes, phase, engines) as fleet:
            out["setup_s"] = round(time.monotonic() - started, 1)
            out["engine_starts"] = fleet.engine_starts
            warm_up(fleet, model_vocab(nodes.spec.model_dir), random.Random(f"warm-{phase.name}"))
            ref = run_reference(name, [r.url for r in fleet.replicas], fleet.model, workloads)
        if ref.failed:
            raise RuntimeError(f"{len(ref.failed)} of {len(ref.records)} reference requests failed: "
                               f"{ref.failed[0].error or 'no token ids returned'}")
        out.update(ref.to_json())
    except (StartFailed, RuntimeError, OSError) as e:
        log.error("the reference run of %s failed: %s", name, e)
        out["error"] = f"{type(e).__name__}: {str(e)[-2000:]}"
        ref = None
    out["seconds"] = round(time.monotonic() - started, 1)
    return ref, out


def data_fault_phase(nodes: Nodes, engines: Engines, phase: Phase, point: tuple[int, float, Workload],
                     reference: Reference, plan: DataFaultPlan) -> dict:
    """Policy (d) with the peer path to one daemon damaged and another's host rebooted with a damaged disk
    (:class:`~benchmarks.e2e.faults.DataFaultPlan`). Both daemons start again first, writing every block
    through to disk (so a reboot leaves them there) and the damaged one advertising the proxy."""
    from benchmarks.chaos.path import PeerPath

    host, port = nodes.nodes[plan.peer_replica].peer_listen.rsplit(":", 1)
    path = PeerPath((host, int(port)), nodes.net.gateway, every=plan.peer_every, limit=plan.peer_flips)
    try:
        nodes.restart_daemon(plan.peer_replica, flags={"--peer-advertise": path.address,
                                                       "--disk-write-policy": "through"})
        nodes.restart_daemon(plan.reboot_replica, flags={"--disk-write-policy": "through"})
        workload = point[2]

        def next_chains(records: list[RequestRecord]) -> list[list[bytes]]:
            """Per session with a turn still to send, the pool keys of its last answered prompt."""
            from kvstore.index.keys import BlockHasher, event_key_bytes

            hasher = BlockHasher(BLOCK_SIZE, HASH_SEED)
            last: dict[int, int] = {}
            for r in records:
                if r.ok:
                    last[r.session] = max(last.get(r.session, -1), r.turn)
            return [[event_key_bytes(h) for h in hasher.chain(workload.prompt(s, t))]
                    for s, t in sorted(last.items()) if t < workload.spec.turns - 1]

        def injector(fleet, clock, n):
            return DataFaultInjector(fleet, plan, clock, n, path, next_chains)

        return run_phase(nodes, engines, phase, [point], reference, injector)
    except (StartFailed, OSError) as e:
        return {"policy": phase.policy.name, "error": f"{type(e).__name__}: {e}", "points": []}
    finally:
        path.close()


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
    fault_phases = [Phase("faults", POLICIES["e"]), Phase("data-faults", POLICIES["d"])] if faults else []
    every = [*refs.values(), *phases.values(), *fault_phases]

    with contextlib.ExitStack() as stack:
        model_dir, build_model = args.model_dir, args.model_dir is None
        if build_model:
            home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="strata-e2e-model-")))
            model_dir = home / "model"
        spec = FleetSpec(model_dir=model_dir, replicas=args.replicas, load_weight=args.load_weight,
                         loopback=args.loopback)
        nodes = stack.enter_context(Nodes(spec, every))
        engines = stack.enter_context(Engines(nodes, reuse=not args.fresh_engines))
        if build_model:
            from benchmarks.e2e import model as model_builder

            engines.prestart(every[0], wait_for_model_s=MODEL_BUILD_TIMEOUT_S)  # imports overlap the build
            t = time.monotonic()
            model_builder.build(model_dir, size=model_size)
            log.info("built the %s model in %.1f s", model_size, time.monotonic() - t)
        vocab = model_vocab(model_dir)
        results: dict = {"workloads": {}, "faults": None, "data_faults": None}
        fault_points = None
        for w in workloads:
            log.info("workload %s: the cold reference run", w)
            tokens_only = [(i, sweep.workload(w, i, vocab)) for i in range(len(sweep.loads))]
            if args.faults_only:
                tokens_only = [tokens_only[fault_point(sweep)]]
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
        if fault_phases and fault_points is not None:
            # Last: a daemon the fault threads restart lives only as long as its thread (PR_SET_PDEATHSIG).
            w, ref, point = fault_points
            log.info("the fault phase (%s, load %.2f)", w, point[1])
            plan = FaultPlan(**mode["faults"])
            results["faults"] = run_phase(nodes, engines, fault_phases[0], [point], ref,
                                          lambda fleet, clock, n: FaultInjector(fleet, plan, clock, n))
            results["faults"]["workload"] = w
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


def check_smoke(doc: dict) -> list[str]:
    """What a smoke run must show whatever the machine's speed: every phase ran and answered, and every
    answer equals the reference's tokens."""
    problems = []
    for w, entry in doc["workloads"].items():
        if "error" in entry["reference"]:
            problems.append(f"{w} reference: {entry['reference']['error']}")
        for key, pol in entry["policies"].items():
            if "error" in pol:
                problems.append(f"{w}-{key}: {pol['error']}")
            for pt in pol.get("points", []):
                if pt["stats"]["answered"] == 0:
                    problems.append(f"{w}-{key} at load {pt['load']}: nothing answered")
                if pt["fidelity"]["share"] != 1.0:
                    problems.append(f"{w}-{key} at load {pt['load']}: fidelity {pt['fidelity']}")
    for name in ("faults", "data_faults"):
        f = doc.get(name)
        if f is not None and "error" in f:
            problems.append(f"{name}: {f['error']}")
        for pt in (f or {}).get("points", []):
            if pt["fidelity"]["checked"] != pt["fidelity"]["equal"]:
                problems.append(f"{name}: fidelity {pt['fidelity']}")
        if f is not None and (f.get("faults") or {}).get("injection_errors"):
            problems.append(f"{name}: {f['faults']['injection_errors']}")
    return problems


def _point_json(pt: dict, ref: Reference | None, slo: float | None) -> dict:
    records = pt["records"]
    out = {k: v for k, v in pt.items() if k != "records"}
    out["stats"] = PolicyStats.of(records, slo).to_json()
    out["fidelity"] = Fidelity.of(records, ref.expected if ref else {}).to_json()
    out["requests"] = [{k: v for k, v in r.to_json().items() if k != "output_ids"} for r in records]
    return out


def build_document(args, sweep: SweepSpec, results: dict, prefix: dict | None, spec: FleetSpec,
                   seconds: float) -> dict:
    doc = {
        "benchmark": NAME,
        "command": "python -m benchmarks.e2e" + (" --smoke" if args.smoke else " --quick" if args.quick else ""),
        "argv": sys.argv[1:],
        "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
        "run_seconds": round(seconds, 1),
        "replicas": spec.replicas,
        "network": results.get("network", ""),
        "sweep": {k: v for k, v in vars(sweep).items()},
        "ttft_slo_rule": "the median cold TTFT of a turn-1 prompt in the workload's reference run"
        if args.slo is None else "given with --slo",
        "load_rule": "offered requests/s = load × replicas / the mean cold service time of the workload's "
                     "requests in the reference run",
        "workloads": {},
        "faults": None,
        "data_faults": None,
        "prefix_4k": prefix,
    }
    phases_setup = {}
    for w, entry in results["workloads"].items():
        ref = entry["ref"]
        slo = args.slo if args.slo is not None else (ref.slo_s if ref else None)
        phases_setup[f"{w}-ref"] = entry["reference"]
        out = {"name": WORKLOADS[w], "reference": entry["reference"], "ttft_slo_s": slo,
               "think_mean_s": entry.get("think_mean_s"), "points": entry.get("points", []), "policies": {}}
        for key, pol in entry["policies"].items():
            out["policies"][key] = {**{k: v for k, v in pol.items() if k != "points"},
                                    "points": [_point_json(pt, ref, slo) for pt in pol["points"]]}
            phases_setup[f"{w}-{key}"] = pol
        doc["workloads"][w] = out
    f = results.get("faults")
    if f is not None:
        ref = results["workloads"][f["workload"]]["ref"]
        slo = args.slo if args.slo is not None else (ref.slo_s if ref else None)
        doc["faults"] = {**{k: v for k, v in f.items() if k != "points"},
                         "points": [_point_json(pt, ref, slo) for pt in f["points"]]}
        phases_setup["faults"] = f
    f = results.get("data_faults")
    if f is not None:
        ref = results["workloads"][f["workload"]]["ref"]
        slo = args.slo if args.slo is not None else (ref.slo_s if ref else None)
        doc["data_faults"] = {**{k: v for k, v in f.items() if k != "points"},
                              "points": [_point_json(pt, ref, slo) for pt in f.get("points", [])]}
        phases_setup["data-faults"] = f
    doc["setup"] = setup_summary(phases_setup, args.fresh_engines)
    rows = sweep_targets(doc)
    doc["targets"] = [t.to_json() for t in rows]
    for w, out in doc["workloads"].items():
        names = {k: v["policy"] for k, v in out["policies"].items()}
        for i, pt in enumerate(out["points"]):
            stats = {k: PolicyStats.of(v["points"][i]["records"], out["ttft_slo_s"])
                     for k, v in results["workloads"][w]["policies"].items() if len(v.get("points", [])) > i}
            print(f"\n{out['name']}, load {pt['load']:.2f} ({pt['offered_rps']:.2f} requests/s offered)")
            print(table(names, stats))
    print()
    print(targets_table(rows))
    if doc["faults"] is not None and "faults" in doc["faults"]:
        ff = doc["faults"]["faults"]
        print(f"\nfaults: {ff['answered']}/{ff['sent']} answered; failed by reason {ff['failed_by_reason'] or '{}'}; "
              f"for a cache reason: {ff['failed_for_a_cache_reason']}")
    if doc["data_faults"] is not None and "faults" in doc["data_faults"]:
        ff = doc["data_faults"]["faults"]
        print(f"data faults: {ff['answered']}/{ff['sent']} answered; {ff['peer_path_bytes_flipped']} bytes flipped on "
              f"the peer path, {ff['disk_block_files_damaged']} disk blocks damaged; the daemons met "
              f"{ff['damage_met_by_daemon']}")
    print(f"\nran in {seconds:.0f} s")
    setup = doc["setup"]
    print(f"set-up: {setup['engine_starts']} engine start-ups, {setup['setup_s']:.0f} s in all")
    return doc


def setup_summary(phases: dict, fresh: bool) -> dict:
    """Each phase's set-up time (engines started or reconfigured, router ready) and engine start-ups."""
    by_phase = {k: v["setup_s"] for k, v in phases.items() if "setup_s" in v}
    return {"engines": "fresh per phase" if fresh else "reused across phases",
            "engine_starts": sum(v.get("engine_starts", 0) for v in phases.values()),
            "setup_s": round(sum(by_phase.values()), 1), "setup_s_by_phase": by_phase}


def write(doc: dict, results: dict, out_dir: Path) -> None:
    from benchmarks.e2e.plot import plot_load, plot_ttft

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{NAME}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    title = f"{doc['command']} ({doc['when']}, load avg {doc['machine']['load_average_at_end'][0]})"
    load_png = plot_load(doc, out_dir / f"{NAME}_load.png", title=title)
    # The distributions at the load point nearest 0.4 of the first workload: where the policies differ most.
    w = next(iter(results["workloads"]), None)
    pngs = [load_png]
    if w is not None and results["workloads"][w]["policies"]:
        pols = results["workloads"][w]["policies"]
        loads = [pt["load"] for pt in next(iter(pols.values()))["points"]]
        if loads:
            i = min(range(len(loads)), key=lambda j: abs(loads[j] - 0.4))
            records = {v["policy"]: v["points"][i]["records"] for v in pols.values() if len(v["points"]) > i}
            pngs.append(plot_ttft(records, out_dir / f"{NAME}_ttft.png", slo_s=doc["workloads"][w]["ttft_slo_s"],
                                  title=f"{WORKLOADS[w]}, load {loads[i]:.2f}: {title}"))
    print(f"results: {path}\nplots: {', '.join(str(p) for p in pngs)}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
