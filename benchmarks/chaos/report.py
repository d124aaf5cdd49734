"""The run's figures: a table on stdout, and ``results/chaos.json`` after a full or quick run.

The headline figures and their targets: acknowledged blocks lost (0) and
wrong bytes served (0). Beside them: operations tried, acknowledged puts,
misses, refusals by reason, blocks the run itself destroyed, and per fault
the time to recover and what the traffic met while it lasted.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from benchmarks.chaos.ledger import MISS, OK, WRONG, Tally
from benchmarks.harness import RESULTS_DIR

_COLUMNS = (("fault", 22), ("target", 14), ("held s", 7), ("recover s", 10), ("puts", 6), ("acked", 6),
            ("gets", 6), ("served", 7), ("miss", 5), ("refused", 8), ("wrong", 5), ("slowest s", 9))


_ROW_KEYS = {"fault", "target", "what", "started_s", "held_s", "recovery_s", "recovered", "puts", "acknowledged",
             "gets", "served", "misses", "wrong_bytes", "refused", "slowest_op_s"}


def _row(cells: list[str]) -> str:
    return "  ".join(str(c).ljust(w) for c, (_, w) in zip(cells, _COLUMNS)).rstrip()


def summary(tally: Tally, acknowledged: int, faults: list[dict], audit: dict, left_out: dict[str, str],
            problems: list[str]) -> dict:
    """The figures every run reports (the JSON document's body, less the run's identity)."""
    traffic_puts = tally.total("put")
    traffic_gets = tally.total("get")
    return {
        "operations_tried": {"puts": traffic_puts, "gets": traffic_gets, "probes": tally.total("probe"),
                             "audit_reads": tally.total("audit")},
        "acknowledged_puts": acknowledged,  # the traffic's and the probes'
        "acknowledged_traffic_puts": tally.total("put", OK),
        "acknowledged_blocks_lost": audit["lost"],
        "wrong_bytes_served": tally.total(outcome=WRONG),
        "destroyed_by_injected_corruption": audit["destroyed_by_injected_corruption"],
        "misses": {"traffic_gets": tally.total("get", MISS), "audit_reads": tally.total("audit", MISS),
                   "traffic_gets_at_own_daemon": sum(n for w, n in tally.owner_misses.items() if w != "audit"),
                   "traffic_gets_by_block_age": dict(tally.miss_ages)},
        "refusals_by_reason": tally.refusals(),
        "recovery_s": {f["fault"]: f["recovery_s"] for f in faults},
        "faults": faults,
        "faults_left_out": left_out,
        "steady": tally.window_summary("steady"),
        "warm_up": tally.window_summary("warm-up"),
        "audit": audit,
        "wrong_examples": tally.wrong,
        "miss_examples": tally.misses,
        "problems": problems,
        "passed": not problems,
    }


def print_report(figures: dict, counters: dict, network: str) -> None:
    print(_row([t for t, _ in _COLUMNS]))
    print(_row(["-" * w for _, w in _COLUMNS]))
    for f in figures["faults"]:
        refused = sum(f["refused"].values())
        recover = "NEVER" if f["recovery_s"] is None else f"{f['recovery_s']:.2f}"
        print(_row([f["fault"], f["target"], f"{f['held_s']:.1f}", recover, f["puts"], f["acknowledged"], f["gets"],
                    f["served"], f["misses"], refused, f["wrong_bytes"], f"{f['slowest_op_s']:.2f}"]))
    for name, why in figures["faults_left_out"].items():
        print(_row([name, "left out", why]))
    for f in figures["faults"]:
        shown = {k: v for k, v in f.items() if k not in _ROW_KEYS}
        if shown:
            print(f"  {f['fault']}: " + ", ".join(f"{k} {v}" for k, v in shown.items()))
    ops = figures["operations_tried"]
    audit = figures["audit"]
    print(f"\nnetwork: {network}")
    print(f"operations tried: {ops['puts']} puts, {ops['gets']} gets (+{ops['probes']} probe calls, "
          f"{ops['audit_reads']} audit reads)")
    print(f"acknowledged puts: {figures['acknowledged_puts']}; every acknowledged block read back at the end: "
          f"{audit['served_by_own_daemon']} by its own daemon, {audit['served_by_another_daemon']} by another")
    print(f"acknowledged blocks lost: {figures['acknowledged_blocks_lost']} (target 0)")
    print(f"wrong bytes served: {figures['wrong_bytes_served']} (target 0)")
    print(f"destroyed by injected corruption (detected, served as a miss): "
          f"{figures['destroyed_by_injected_corruption']} ({audit['destroyed_whose_bucket_copy_died_with_s3']} "
          "of them had their bucket copy in the killed S3 server)")
    print(f"only copy was in the killed S3 server (evicted to the bucket before): "
          f"{audit['only_copy_was_in_the_killed_s3']}")
    print(f"own daemon's copy gone without injected cause: {audit['own_copy_gone']}; its daemon names each block "
          + ", ".join(f"{k} {v}" for k, v in audit["own_daemon_names_tier"].items()))
    print(f"misses: {figures['misses']['traffic_gets']} of the traffic's gets "
          f"({figures['misses']['traffic_gets_at_own_daemon']} at the block's own daemon; by the block's age: "
          + ", ".join(f"{k} {v}" for k, v in figures["misses"]["traffic_gets_by_block_age"].items()) + ")")
    refusals = ", ".join(f"{k} {v}" for k, v in figures["refusals_by_reason"].items()) or "none"
    print(f"refusals by reason: {refusals}")
    for node, values in counters.items():
        shown = {k: v for k, v in values.items() if "fallbacks" in k or "corrupt" in k or "evictions" in k
                 or "dropped" in k or "resyncs" in k}
        print(f"{node} counters: " + (", ".join(f"{k} {v}" for k, v in shown.items()) or "none of note"))
    for problem in figures["problems"]:
        print(f"PROBLEM: {problem}")


def write(name: str, command: str, when: str, run_s: float, plan: dict, network: str, small_disk: str,
          figures: dict, counters: dict) -> Path:
    doc = {
        "benchmark": name,
        "command": command,
        "when": when,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release(),
                    "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
        "run_seconds": round(run_s, 1),
        "network": network,
        "small_disk": small_disk,
        "plan": plan,
        **figures,
        "daemon_counters": counters,
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return path
