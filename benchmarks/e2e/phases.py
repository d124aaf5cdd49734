"""The benchmark's phases: one policy's fleet serving its load points, the cold reference run, the fault
phases and the scale-up drill; each returns what it measured as a dict (its records among it), never raises
for a fleet that failed (``error`` says what)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp

from benchmarks.e2e import driver
from benchmarks.e2e.client import completion_body, monotonic_clock, stream_completion
from benchmarks.e2e.faults import DataFaultInjector, DataFaultPlan, FaultInjector
from benchmarks.e2e.fleet import BLOCK_SIZE, HASH_SEED, Engines, Fleet, Nodes, Phase, StartFailed
from benchmarks.e2e.report import engine_summary, router_summary
from benchmarks.e2e.stats import RequestRecord
from benchmarks.e2e.sweep import Reference, run_reference
from benchmarks.e2e.workload import Workload

log = logging.getLogger("benchmarks.e2e")


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


def warm_up(fleet: Fleet, vocab: int, rng: random.Random) -> None:
    """One short request per engine, straight to it: first-call costs stay out of the measurement."""
    for r in fleet.replicas:
        one_request(r.url, fleet.model, [rng.randrange(4, vocab) for _ in range(64)], 2)


def model_vocab(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


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
              reference: Reference | None, injector: Callable[..., FaultInjector] | None = None,
              spare_endpoints: list[tuple[str, str]] = ()) -> dict:
    """One policy on one fleet at each load point in turn (``points``: (index, load, workload)); with
    ``injector`` (``(fleet, clock, requests) -> FaultInjector``), its faults during the (single) point."""
    started = time.monotonic()
    out: dict = {"policy": phase.policy.name, "namespace": phase.namespace, "points": []}
    try:
        with Fleet(nodes, phase, engines, router_args=ttft_priors(reference), spare_endpoints=spare_endpoints) as fleet:
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
        through = {"--disk-write-policy": "through"}
        nodes.restart_daemons({i: {**through, "--peer-advertise": path.address} if i == plan.peer_replica else through
                               for i in range(len(nodes.serving))})
        workload = point[2]

        def last_answered(records: list[RequestRecord]) -> dict[int, int]:
            """Per session with a turn still to send, its last answered turn."""
            last: dict[int, int] = {}
            for r in records:
                if r.ok:
                    last[r.session] = max(last.get(r.session, -1), r.turn)
            return {s: t for s, t in last.items() if t < workload.spec.turns - 1}

        def next_chains(records: list[RequestRecord]) -> list[list[bytes]]:
            """Per session with a turn still to send, the pool keys of its last answered prompt."""
            from kvstore.index.keys import BlockHasher, event_key_bytes

            hasher = BlockHasher(BLOCK_SIZE, HASH_SEED)
            return [[event_key_bytes(h) for h in hasher.chain(workload.prompt(s, t))]
                    for s, t in sorted(last_answered(records).items())]

        def injector(fleet, clock, n):
            return DataFaultInjector(fleet, plan, clock, n, path, next_chains, lambda rs: set(last_answered(rs)))

        return run_phase(nodes, engines, phase, [point], reference, injector)
    except (StartFailed, OSError) as e:
        return {"policy": phase.policy.name, "error": f"{type(e).__name__}: {e}", "points": []}
    finally:
        path.close()


def run_drill(nodes: Nodes, engines: Engines, phases: list[Phase], point: tuple[int, float, Workload],
                     reference: Reference, model_dir: Path) -> dict:
    """The scale-up drill (:mod:`benchmarks.e2e.drill`), with Strata (policy e) then without (policy b)."""
    from benchmarks.e2e.drill import DrillPlan, ScaleUp, WeightOrigin
    from benchmarks.e2e.fleet import free_port, model_name

    out: dict = {"load": point[1], "sessions": point[2].spec.sessions}
    try:
        t = time.monotonic()
        origin = WeightOrigin(nodes, model_dir).wait_ready()
    except (StartFailed, RuntimeError, OSError) as e:
        log.error("the drill's weight origin failed: %s", e)
        return {**out, "error": f"{type(e).__name__}: {str(e)[-2000:]}"}
    try:
        # The fleet ran before the drill: its nodes' weight caches are warm (fetched at once, not timed).
        with ThreadPoolExecutor(len(nodes.serving)) as pool:
            list(pool.map(lambda i: origin.prefetch(i, DrillPlan.wait_deadline), range(len(nodes.serving))))
        out.update(model_bytes=origin.model_bytes, digest=origin.digest, setup_s=round(time.monotonic() - t, 1))
        spare = nodes.nodes[nodes.spec.replicas]
        for phase in phases:
            with_strata = phase.policy.pool
            url = f"http://{spare.host}:{free_port()}"
            engine_id = phase.engine_id(spare.index)
            holder: dict = {}

            def injector(fleet, clock, n, with_strata=with_strata, url=url, engine_id=engine_id, holder=holder):
                holder["scale"] = ScaleUp(fleet, origin, DrillPlan(), clock, n, with_strata=with_strata, url=url,
                                          engine_id=engine_id, model_name=model_name(fleet.url))
                return holder["scale"]

            log.info("the scale-up drill, %s Strata (%s)", "with" if with_strata else "without", phase.policy.name)
            result = run_phase(nodes, engines, phase, [point], reference, injector,
                               spare_endpoints=[(url, engine_id)])
            out[phase.name] = result
    finally:
        origin.close()
    return out
