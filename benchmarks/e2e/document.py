"""The results document of a run (``benchmarks/results/e2e.json``), its printed tables, its plots, and the
smoke run's verdict."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path

from benchmarks.e2e.fleet import FleetSpec
from benchmarks.e2e.report import sweep_targets, table, targets_table
from benchmarks.e2e.stats import Fidelity, PolicyStats
from benchmarks.e2e.sweep import WORKLOADS, Reference, SweepSpec

NAME = "e2e"


def check_smoke(doc: dict) -> list[str]:
    """What a smoke run must show whatever the machine's speed: every phase ran and answered, every
    answer equals the reference's tokens, and the reboot damaged blocks on its host's disk."""
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
    drill = doc.get("drill") or {}
    if "error" in drill:
        problems.append(f"drill: {drill['error']}")
    for name, ph in drill.items():
        if isinstance(ph, dict):
            if "error" in ph:
                problems.append(f"drill {name}: {ph['error']}")
            scale = ph.get("scale_up") or {}
            if scale.get("errors"):
                problems.append(f"drill {name}: {scale['errors']}")
            elif "in_rotation" not in scale.get("steps_s", {}):  # served: as the router chose (not every run)
                problems.append(f"drill {name}: the new replica never joined the router's rotation")
            for pt in ph.get("points", []):
                if pt["fidelity"]["checked"] != pt["fidelity"]["equal"]:
                    problems.append(f"drill {name}: fidelity {pt['fidelity']}")
    for name in ("faults", "data_faults"):
        f = doc.get(name)
        if f is not None and "error" in f:
            problems.append(f"{name}: {f['error']}")
        for pt in (f or {}).get("points", []):
            if pt["fidelity"]["checked"] != pt["fidelity"]["equal"]:
                problems.append(f"{name}: fidelity {pt['fidelity']}")
        if f is not None and (f.get("faults") or {}).get("injection_errors"):
            problems.append(f"{name}: {f['faults']['injection_errors']}")
    damage = (doc.get("data_faults") or {}).get("faults")
    if damage is not None and not damage.get("disk_block_files_damaged"):
        problems.append("data faults: the rebooted host's disk held no block of the sessions still running")
    if damage is not None and (damage.get("damaged_blocks_read_back") or {}).get("served"):
        problems.append(f"data faults: a damaged block was served: {damage['damaged_blocks_read_back']}")
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
        "drill": None,
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
    d = results.get("drill")
    if d is not None:
        ref = results["workloads"]["w1"]["ref"]
        slo = args.slo if args.slo is not None else (ref.slo_s if ref else None)
        doc["drill"] = {k: v for k, v in d.items() if not isinstance(v, dict)}
        for name, ph in d.items():
            if isinstance(ph, dict):
                doc["drill"][name] = {**{k: v for k, v in ph.items() if k not in ("points", "faults")},
                                      "scale_up": ph.get("faults"),
                                      "points": [_point_json(pt, ref, slo) for pt in ph.get("points", [])]}
                phases_setup[name] = ph
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
              f"the peer path, {ff['disk_block_files_damaged']} disk blocks damaged on the rebooted replica "
              f"{ff.get('rebooted_replica')} (read back after the phase: {ff.get('damaged_blocks_read_back')}); "
              f"the daemons met {ff['damage_met_by_daemon']}")
    for name, ph in (doc.get("drill") or {}).items():
        if isinstance(ph, dict) and ph.get("scale_up"):
            u = ph["scale_up"]
            ttft = u["first_requests_ttft_s"]
            print(f"drill {name}: ready in {u['time_to_ready_s']} s ({u['steps_s']}), origin bytes "
                  f"{u['origin_bytes']} of {u['model_bytes']}; its first {ttft['n']} requests: TTFT mean "
                  f"{ttft['mean']} s, p95 {ttft['p95']} s, hit ratio {u['first_requests_hit_ratio']}"
                  + (f"; errors {u['errors']}" if u["errors"] else ""))
        elif isinstance(ph, dict) and "error" in ph:
            print(f"drill {name}: {ph['error'][:300]}")
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
