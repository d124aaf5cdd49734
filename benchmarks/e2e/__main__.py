"""End to end: multi-turn chat TTFT over a fleet of reference engines, per routing and caching policy.

Run as ``python -m benchmarks.e2e [--quick | --smoke] [--replicas N] [--policies a,b,...] [--no-faults]``.

A private Redis, one ``strata serve`` per replica (the prefix index and the
shared pool), one engine per replica (``benchmarks.e2e.engine``, one compute
thread each, started once and reconfigured with an empty cache for each
policy) and, per policy, ``strata route`` in front of them, all as child
processes on loopback (:mod:`benchmarks.e2e.fleet`). Each policy
(:mod:`benchmarks.e2e.policies`) serves the same seeded workload
(:mod:`benchmarks.e2e.workload`): 8 sessions × 5 turns, a 1,000-token
system prompt, 200 user tokens and 50 generated per turn, exponential think
times between turns. Then a fault phase (:mod:`benchmarks.e2e.faults`):
the cache-aware + shared-pool fleet with a daemon SIGKILLed and restarted
mid-run and later an engine SIGKILLed.

Before the first policy, one replica's idle engine is timed on cold
turn-1-sized prompts (fresh tokens, nothing to hit): the median is the
TTFT SLO (a returning user should wait no longer than a new conversation's
first answer on an idle replica: met by a turn whose history is cached,
missed by one that recomputes it or queues behind another's prefill), and
its service time (TTFT plus the decode of the answer) sets the think time:
``--think-factor`` × it, so the fleet runs at the same load on a fast
machine and a slow one.

Writes ``benchmarks/results/e2e.json`` (every request's timing included)
and ``benchmarks/results/e2e_ttft.png`` (:mod:`benchmarks.e2e.plot`).

``--smoke`` runs every code path once and writes nothing: the tiny model,
one session of two turns (the second finds the first's KV cached), policy
(a) (round robin, last prompt cached, no events, no pool) and the fault
phase, which runs (e) (cache-aware, block cache, KV events, the shared
pool) with a daemon down for a second, then the prefix-hit measurement on
a 256-token prompt.
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
from pathlib import Path

import aiohttp

from benchmarks.e2e import driver
from benchmarks.e2e.client import completion_body, monotonic_clock, stream_completion
from benchmarks.e2e.faults import FaultInjector, FaultPlan, fault_report
from benchmarks.e2e.fleet import Engines, Fleet, FleetSpec, Nodes, Phase, StartFailed
from benchmarks.e2e.policies import POLICIES, parse_policies
from benchmarks.e2e.report import engine_summary, router_summary, table, targets, targets_table
from benchmarks.e2e.stats import PolicyStats, RequestRecord
from benchmarks.e2e.workload import Workload, WorkloadSpec
from benchmarks.harness import RESULTS_DIR, smoke_line

log = logging.getLogger("benchmarks.e2e")

NAME = "e2e"
PREFIX_TOKENS = 4096
PREFIX_CACHED = 4032  # whole blocks: the prompt's last 64 tokens are prefilled over the cached KV
PREFIX_TIMEOUT_S = 600
PREFIX_4K = dict(prefix_tokens=PREFIX_TOKENS, prefix_cached=PREFIX_CACHED)
FULL = dict(sessions=8, turns=5, think_factor=3.0, calibration_prompts=3, prefix_rounds=3, model_size="bench",
            policies="all", faults={}, **PREFIX_4K)
QUICK = dict(sessions=4, turns=2, think_factor=1.0, calibration_prompts=1, prefix_rounds=1, model_size="bench",
             policies="all", faults={}, **PREFIX_4K)
# (a) and the fault phase's (e) between them take every branch: prefix cache last and blocks, KV events
# and the index off and on, the pool off and on, round robin and cache-aware routing.
SMOKE = dict(sessions=1, turns=2, think_factor=1.0, calibration_prompts=1, prefix_rounds=1, model_size="tiny",
             policies="a", faults=dict(daemon_down_s=1.0), prefix_tokens=256, prefix_cached=240)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=__doc__.split("\n\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="4 sessions × 2 turns, shorter think times, one round of the 4k measurement")
    size.add_argument("--smoke", action="store_true",
                      help="every code path once, in seconds, writing no results: the tiny model, 1 session × 2 "
                           "turns, policy a and the fault phase, a 256-token prefix measurement")
    p.add_argument("--replicas", type=int, default=2, help="engines (each with its own daemon); default 2")
    p.add_argument("--policies", help="which of a,b,c,d,e to run (default all; a with --smoke)")
    p.add_argument("--no-faults", action="store_true", help="leave out the fault phase")
    p.add_argument("--faults-only", action="store_true", help="run only the fault phase")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sessions", type=int, help="concurrent sessions (default 8; 4 with --quick)")
    p.add_argument("--turns", type=int, help="turns per session (default 5; 2 with --quick)")
    p.add_argument("--think-mean", type=float, help="mean think time in seconds (default: --think-factor × the "
                   "calibrated service time of a turn-1 request)")
    p.add_argument("--think-factor", type=float, help="think time mean / an idle turn-1 request's service time")
    p.add_argument("--slo", type=float, help="TTFT SLO in seconds (default: an idle engine's cold turn-1 TTFT)")
    p.add_argument("--load-weight", type=float, default=FleetSpec.load_weight,
                   help=f"the router's --load-weight for (c) and (e) (default {FleetSpec.load_weight})")
    p.add_argument("--model-dir", type=Path, help="an existing model directory (default: build the bench model)")
    p.add_argument("--model-size", choices=("tiny", "bench"),
                   help="the model built (default bench; tiny with --smoke)")
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


def calibrate(fleet: Fleet, spec: WorkloadSpec, n: int, rng: random.Random) -> dict:
    """Cold turn-1-sized requests on one idle engine: the SLO and the service time that paces think times."""
    url = fleet.replicas[0].url
    tokens = spec.system_tokens + spec.user_tokens
    runs = [one_request(url, fleet.model, [rng.randrange(spec.first_id, spec.vocab_size) for _ in range(tokens)],
                        spec.output_tokens) for _ in range(n)]
    ttft = statistics.median(r.ttft_s for r in runs)
    service = statistics.median(r.done_s - r.sent_s for r in runs)
    return {"prompt_tokens": tokens, "output_tokens": spec.output_tokens, "cold_ttft_s": round(ttft, 4),
            "service_s": round(service, 4), "runs": n}


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


def ttft_priors(calibration: dict | None) -> list[str]:
    """The router's TTFT priors from the calibration, as an operator sets them from a measurement of
    their hardware: a cold prompt's TTFT over its tokens per token; a request ahead costs its decode
    (service time less TTFT) beyond the prefill the backlog counts. None before the calibration ran."""
    if not calibration:
        return []
    per_token = calibration["cold_ttft_s"] / calibration["prompt_tokens"]
    ahead = max(0.0, calibration["service_s"] - calibration["cold_ttft_s"])
    return ["--ttft-prefill-seconds-per-token", f"{per_token:.3g}", "--ttft-seconds-per-request-ahead", f"{ahead:.3g}"]


def run_phase(nodes: Nodes, engines: Engines, phase: Phase, workload_for, state: dict,
              fault_plan: FaultPlan | None) -> dict:
    started = time.monotonic()
    out: dict = {"policy": phase.policy.name, "namespace": phase.namespace}
    try:
        with Fleet(nodes, phase, engines, router_args=ttft_priors(state["calibration"])) as fleet:
            # Set-up: engines started or reconfigured, the router started, every engine in rotation.
            out["setup_s"] = round(time.monotonic() - started, 1)
            out["engine_starts"] = fleet.engine_starts
            rng = random.Random(f"warm-{phase.name}")
            vocab = model_vocab(nodes.spec.model_dir)
            warm_up(fleet, vocab, rng)
            workload = workload_for(fleet)
            clock = monotonic_clock()
            if fault_plan is None:
                records = driver.run(workload, fleet.url, fleet.model, clock=clock)
            else:
                with FaultInjector(fleet, fault_plan, clock, workload.requests) as inj:
                    records = driver.run(workload, fleet.url, fleet.model, clock=clock, on_answer=inj.observe,
                                         before_last_turn=inj.hold)
                    after_rotation = inj.upstream_errors_since_rotation()
                out["faults"] = fault_report(records, inj.events, nodes.spec.health_interval_s, inj.errors,
                                             after_rotation)
            out["records"] = records
            out["router"] = router_summary(fleet.router_metrics())
            out["engines"] = engine_summary(fleet.engine_metrics())
    except (StartFailed, RuntimeError, OSError) as e:
        log.error("phase %s failed: %s", phase.name, e)
        out["error"] = f"{type(e).__name__}: {str(e)[-2000:]}"
    out["seconds"] = round(time.monotonic() - started, 1)
    return out


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


def _main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    t_start = time.monotonic()
    mode = SMOKE if args.smoke else QUICK if args.quick else FULL
    sessions = args.sessions or mode["sessions"]
    turns = args.turns or mode["turns"]
    think_factor = args.think_factor or mode["think_factor"]
    model_size = args.model_size or mode["model_size"]
    policies = [] if args.faults_only else parse_policies(args.policies or mode["policies"])
    phases = [Phase(p.key, p) for p in policies]
    if not args.no_faults:
        phases.append(Phase("faults", POLICIES["e"]))

    with contextlib.ExitStack() as stack:
        model_dir, build_model = args.model_dir, args.model_dir is None
        if build_model:
            home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="strata-e2e-model-")))
            model_dir = home / "model"
        spec = FleetSpec(model_dir=model_dir, replicas=args.replicas, load_weight=args.load_weight)
        nodes = stack.enter_context(Nodes(spec, phases))
        engines = stack.enter_context(Engines(nodes, reuse=not args.fresh_engines))
        if build_model:
            from benchmarks.e2e import model as model_builder

            if phases:  # the first phase's engines import torch and transformers while the model is built
                engines.prestart(phases[0], wait_for_model_s=MODEL_BUILD_TIMEOUT_S)
            t = time.monotonic()
            model_builder.build(model_dir, size=model_size)
            log.info("built the %s model in %.1f s", model_size, time.monotonic() - t)
        vocab = model_vocab(model_dir)
        state: dict = {"calibration": None, "workload": None}

        def workload_for(fleet: Fleet) -> Workload:
            if state["workload"] is None:
                base = WorkloadSpec(sessions=sessions, turns=turns, seed=args.seed, vocab_size=vocab)
                cal = calibrate(fleet, base, mode["calibration_prompts"], random.Random(f"calibrate-{args.seed}"))
                state["calibration"] = cal
                think = args.think_mean if args.think_mean is not None else think_factor * cal["service_s"]
                state["workload"] = Workload(WorkloadSpec(
                    sessions=sessions, turns=turns, seed=args.seed, vocab_size=vocab, think_mean_s=think,
                    think_min_s=0.1 * think, start_mean_s=think / 2))
                log.info("calibrated: cold turn-1 TTFT %.3f s, service %.3f s; think time mean %.2f s",
                         cal["cold_ttft_s"], cal["service_s"], think)
            return state["workload"]

        results = {}
        for phase in phases:
            log.info("phase %s: %s", phase.name, phase.policy.name)
            plan = FaultPlan(**mode["faults"]) if phase.name == "faults" else None
            results[phase.name] = run_phase(nodes, engines, phase, workload_for, state, plan)
            log.info("phase %s took %.0f s", phase.name, results[phase.name]["seconds"])
        engines.close()  # the 4k measurement has the machine to itself, as when each phase stopped its own
        if args.no_prefix_4k:
            prefix = None
        else:
            log.info("the %s-token prefix-hit measurement", f"{mode['prefix_tokens']:,}")
            prefix = prefix_4k(model_dir, mode["prefix_rounds"], spec.engine_threads, mode["prefix_tokens"],
                               mode["prefix_cached"])
        doc = build_document(args, results, state, prefix, spec, time.monotonic() - t_start)
    if args.smoke:
        print(smoke_line(NAME), flush=True)
    else:
        write(doc, results, args.results_dir, state)
    return 0


def build_document(args, results: dict, state: dict, prefix: dict | None, spec: FleetSpec, seconds: float) -> dict:
    cal = state["calibration"] or {}
    slo = args.slo if args.slo is not None else cal.get("cold_ttft_s")
    stats = {k: PolicyStats.of(v["records"], slo) for k, v in results.items() if "records" in v and k != "faults"}
    names = {k: v["policy"] for k, v in results.items()}
    rows = targets(stats, prefix)
    print()
    print(table(names, stats))
    print()
    print(targets_table(rows))
    if "faults" in results and "faults" in results["faults"]:
        f = results["faults"]["faults"]
        print(f"\nfaults: {f['answered']}/{f['sent']} answered; failed by reason {f['failed_by_reason'] or '{}'}; "
              f"for a cache reason: {f['failed_for_a_cache_reason']}")
    w = state["workload"]
    doc = {
        "benchmark": NAME,
        "command": "python -m benchmarks.e2e" + (" --smoke" if args.smoke else " --quick" if args.quick else ""),
        "argv": sys.argv[1:],
        "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
        "run_seconds": round(seconds, 1),
        "setup": setup_summary(results, args.fresh_engines),
        "replicas": spec.replicas,
        "workload": None if w is None else {**{k: v for k, v in vars(w.spec).items()}},
        "calibration": cal,
        "ttft_slo_s": slo,
        "ttft_slo_rule": "the median cold TTFT of a turn-1-sized prompt on an idle engine" if args.slo is None
        else "given with --slo",
        "targets": [t.to_json() for t in rows],
        "policies": {},
        "prefix_4k": prefix,
    }
    for key, res in results.items():
        entry = {k: v for k, v in res.items() if k != "records"}
        if key in stats:
            entry["stats"] = stats[key].to_json()
        if "records" in res:
            entry["requests"] = [r.to_json() for r in res["records"]]
        doc["policies"][key] = entry
    print(f"\nran in {seconds:.0f} s: " + ", ".join(f"{k} {v['seconds']:.0f} s" for k, v in results.items()))
    setup = doc["setup"]
    print(f"set-up: {setup['engine_starts']} engine start-ups, {setup['setup_s']:.0f} s in all "
          f"({', '.join(f'{k} {v:.0f} s' for k, v in setup['setup_s_by_phase'].items())})")
    return doc


def setup_summary(results: dict, fresh: bool) -> dict:
    """Each phase's set-up time (engines started or reconfigured, router ready) and engine start-ups."""
    by_phase = {k: v["setup_s"] for k, v in results.items() if "setup_s" in v}
    return {"engines": "fresh per phase" if fresh else "reused across phases",
            "engine_starts": sum(v.get("engine_starts", 0) for v in results.values()),
            "setup_s": round(sum(by_phase.values()), 1), "setup_s_by_phase": by_phase}


def write(doc: dict, results: dict, out_dir: Path, state: dict) -> None:
    from benchmarks.e2e.plot import plot_ttft

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{NAME}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    records = {v["policy"]: v["records"] for k, v in results.items() if "records" in v and k != "faults"}
    png = plot_ttft(records, out_dir / f"{NAME}_ttft.png", slo_s=doc["ttft_slo_s"],
                    title=f"{doc['command']} ({doc['when']}, load avg {doc['machine']['load_average_at_end'][0]})")
    print(f"results: {path}\nplot: {png}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
