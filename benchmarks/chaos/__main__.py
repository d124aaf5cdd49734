"""Chaos with the number published: a small fleet under mixed traffic while its parts are broken one by one.

Run as ``python -m benchmarks.chaos [--quick | --smoke]``. A fleet of
``strata serve`` daemons (each in a network namespace of its own where the
run is root, else on loopback), one Redis index and moto's S3 server runs
mixed traffic (:mod:`benchmarks.chaos.traffic`) while the faults of
:mod:`benchmarks.chaos.faults` are injected one at a time: a daemon
stalled, a daemon killed, Redis killed, S3 stalled, the peer path
damaged, a daemon's disk filled, S3 killed, block files on a disk
overwritten. Afterwards every acknowledged block is read back
(:mod:`benchmarks.chaos.audit`).

It reports operations tried, acknowledged puts, acknowledged blocks lost
(target 0), wrong bytes served (target 0), refusals by reason, blocks the
run itself destroyed, and each fault's time to recover; it exits 1 when a
block was lost, wrong bytes were served, a fault never recovered or a
daemon exited on its own. The full run (three daemons, about two minutes
on two cores) writes ``benchmarks/results/chaos.json``; ``--quick`` is the
same with shorter faults; ``--smoke`` runs two daemons and three faults in
seconds and writes nothing. ``--keep`` keeps the scratch directory (every
daemon's log, Redis's and moto's) and prints where it is.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.chaos.audit import audit, settle
from benchmarks.chaos.faults import FAULTS, run_fault
from benchmarks.chaos.fleet import Fleet, FleetPlan
from benchmarks.chaos.ledger import WRONG, Ledger, Tally
from benchmarks.chaos.report import print_report, summary, write
from benchmarks.chaos.traffic import Traffic
from benchmarks.harness import KiB, Benchmark, smoke_line

NAME = "chaos"
ALL = tuple(FAULTS)
FULL = {"daemons": 3, "workers_per_daemon": 2, "put_share": 0.3, "sizes": (16 * KiB, 128 * KiB), "pace_s": 0.002,
        "warmup_s": 8.0, "hold_s": 4.0, "settle_s": 3.0, "corrupt_blocks": 12, "faults": ALL}
QUICK = {**FULL, "warmup_s": 4.0, "hold_s": 2.0, "settle_s": 1.5, "corrupt_blocks": 6}
SMOKE = {"daemons": 2, "workers_per_daemon": 1, "put_share": 0.5, "sizes": (64 * KiB, 256 * KiB), "pace_s": 0.002,
         "warmup_s": 1.0, "hold_s": 1.0, "settle_s": 0.3, "corrupt_blocks": 3,
         "faults": ("daemon_kill", "peer_path_corruption", "disk_corruption")}


def run(plan: dict, home: Path) -> tuple[dict, dict, Fleet]:
    t0 = time.monotonic()

    def clock() -> float:
        return time.monotonic() - t0

    ledger, tally = Ledger(), Tally()
    problems: list[str] = []
    with contextlib.ExitStack() as stack:
        fleet = Fleet(home, FleetPlan(plan["daemons"]), stack)
        print(f"fleet: {plan['daemons']} daemons; {fleet.net.note}; {fleet.small_disk_note}", flush=True)
        faults = [FAULTS[name](fleet, ledger, tally, clock, plan["hold_s"], plan["corrupt_blocks"])
                  for name in plan["faults"]]
        left_out = {f.name: why for f in faults if (why := f.available()) is not None}
        rows = []
        try:
            with Traffic(fleet, ledger, tally, clock, workers_per_daemon=plan["workers_per_daemon"],
                         put_share=plan["put_share"], sizes=plan["sizes"], pace_s=plan["pace_s"]):
                time.sleep(plan["warmup_s"])
                tally.window = "steady"
                for fault in faults:
                    if fault.name in left_out:
                        continue
                    problems += _restart_crashed(fleet)
                    print(f"  {fault.name} on {fault.target} ...", flush=True)
                    rows.append(run_fault(fault, plan["settle_s"]))
                    if not rows[-1]["recovered"]:
                        problems.append(f"{fault.name} did not recover")
            problems += _restart_crashed(fleet)
            queued = settle(fleet)
            checked = audit(fleet, ledger, tally)
            checked["still_queued_for_upload"] = queued
        except BaseException:
            print(fleet.log_tails(), file=sys.stderr)
            raise
        if checked["lost"]:
            problems.append(f"{checked['lost']} acknowledged blocks lost")
        if tally.total(outcome=WRONG):
            problems.append(f"{tally.total(outcome=WRONG)} wrong answers (bytes that are not the block's)")
        figures = summary(tally, len(ledger), rows, checked, left_out, problems)
        counters = fleet.counters.totals()
        if problems:
            print(fleet.log_tails(), file=sys.stderr)
    return figures, counters, fleet


def _restart_crashed(fleet: Fleet) -> list[str]:
    """A daemon that exited without being killed is a defect: say so, and start it again so the run goes on."""
    crashed = fleet.unexpected_exits()
    for node in fleet.nodes:
        if node.proc is not None and node.proc.poll() is not None:
            node.start()
    return [f"daemon crash: {c}" for c in crashed]


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds the fleet's ExitStack: namespaces, mounts, children


def main(argv: list[str] | None = None) -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--keep", action="store_true", help="keep the scratch directory (daemon logs) and say where")
    mine, rest = own.parse_known_args(argv)
    bench = Benchmark(NAME, __doc__.splitlines()[0], rest)
    signal.signal(signal.SIGTERM, _interrupt)
    plan = bench.plan(FULL, QUICK, SMOKE)
    started = time.monotonic()
    home = Path(tempfile.mkdtemp(prefix="strata-chaos-"))
    try:
        figures, counters, fleet = run(plan, home)
    finally:
        if mine.keep:
            print(f"kept: {home}", flush=True)
        else:
            shutil.rmtree(home, ignore_errors=True)
    print_report(figures, counters, fleet.net.note)
    print(f"\n{len(figures['faults'])} faults in {time.monotonic() - started:.0f} s", flush=True)
    if bench.smoke:
        print(smoke_line(NAME), flush=True)
    else:
        plan_json = {k: list(v) if isinstance(v, tuple) else v for k, v in plan.items()}
        path = write(NAME, bench.command, bench.when, time.monotonic() - started, plan_json, fleet.net.note,
                     fleet.small_disk_note, figures, counters)
        print(f"results: {path}", flush=True)
    return 0 if figures["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
