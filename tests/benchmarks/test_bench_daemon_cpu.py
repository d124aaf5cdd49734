"""What the benchmarks charge a daemon with: its CPU time read from outside it, per thread or, where a
thread exited, for the whole process; and the harness's rows for cases that could not run.

The child processes here burn a fixed amount of their own CPU time (they measure it themselves), so
the assertions hold however loaded the machine is; no wall-clock time is judged.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from benchmarks.daemon_cpu import DaemonCpu, DaemonMeter
from benchmarks.harness import Benchmark, Case, compare, skipped

BURN_S = 0.3

_CHILD = textwrap.dedent("""
    import os, sys, threading, time

    def burn():
        start = time.thread_time()
        while time.thread_time() - start < %r:
            pass

    in_thread = sys.argv[1] == "thread"
    go = threading.Event()
    worker = threading.Thread(target=lambda: (go.wait(), burn())) if in_thread else None
    if worker:
        worker.start()
    print("ready", flush=True)
    sys.stdin.readline()
    if worker:
        go.set()
        worker.join()
        while os.path.exists(f"/proc/self/task/{worker.native_id}"):  # gone from the kernel's list too
            time.sleep(0.001)
    else:
        burn()
    print("done", flush=True)
    sys.stdin.read()
""" % BURN_S)


@pytest.fixture
def child(request):
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, request.param], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.stdin.close()
    proc.wait(10)


def _burn(proc) -> None:
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "done"


@pytest.mark.parametrize("child", ["main"], indirect=True)
def test_a_process_that_burns_cpu_is_charged_with_it(child):
    cpu = DaemonCpu([child.pid])
    before = cpu.read()
    _burn(child)
    assert cpu.seconds(before, cpu.read()) >= BURN_S - 0.005


@pytest.mark.parametrize("child", ["thread"], indirect=True)
def test_a_thread_that_exits_keeps_its_time_through_the_process_counters(child):
    cpu = DaemonCpu([child.pid])
    before = cpu.read()
    _burn(child)
    after = cpu.read()
    assert not before[0].threads.keys() <= after[0].threads.keys()  # the burning thread is gone
    assert cpu.seconds(before, after) >= BURN_S - 0.05  # from stat: clock ticks, so one tick either side


@pytest.mark.parametrize("child", ["main"], indirect=True)
def test_a_waiting_process_is_idle(child):
    idle = DaemonCpu([child.pid], "waiting child").idle(0.2)
    assert idle.wall_s >= 0.2 and idle.cpu_s < 0.05 and idle.to_json()["daemon"] == "waiting child"


@pytest.mark.parametrize("child", ["main"], indirect=True)
def test_a_meter_charges_only_its_timed_parts(child):
    meter = DaemonMeter(DaemonCpu([child.pid]), "get")
    _burn(child)  # outside any timed part
    meter.start()
    meter.stop(10**9)
    use = meter.use()
    assert use.op == "get" and use.nbytes == 10**9 and use.seconds < 0.05


def test_a_smoke_run_that_skipped_every_case_fails(capsys):
    bench = Benchmark("unit", "unit", ["--smoke"], daemon_cpu=True)
    bench.add(skipped("get 1MiB peer-ucx", "plain socket 1MiB", "ucxx is not installed", 0.9))
    assert "    skipped: ucxx is not installed" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="every case was skipped"):
        bench.finish()


def test_a_smoke_run_with_one_measured_case_passes_and_a_skipped_row_says_why():
    bench = Benchmark("unit", "unit", ["--smoke"], daemon_cpu=True)
    bench.add(skipped("get 1MiB peer-ucx", "plain socket 1MiB", "ucxx is not installed", 0.9))
    bench.add(Case("get 1MiB peer-tcp", 1.0, "plain socket 1MiB", 2.0, target_ratio=0.8))
    assert bench.finish() is None
    row = bench.cases[0].to_json()
    assert row["value"] is None and row["meets_target"] is None and row["target_ratio"] == 0.9
    assert row["note"] == "skipped: ucxx is not installed"


def test_two_rows_of_one_measurement_count_once_in_the_totals():
    meter = DaemonMeter(op="get")
    meter.cpu_s, meter.nbytes, meter.daemon = 2.0, 10**9, object()  # as after its rounds
    use = meter.use()
    samples = {"get 1MiB shm": [1.0] * 5, "numpy copy 1MiB": [2.0] * 5, "redis GET 1MiB": [0.5] * 5}
    bench = Benchmark("unit", "unit", ["--smoke"], daemon_cpu=True)
    bench.add(compare(samples, "get 1MiB shm", "numpy copy 1MiB", daemon_cpu=use))
    bench.add(compare(samples, "get 1MiB shm", "redis GET 1MiB", case="get 1MiB shm vs redis", daemon_cpu=use))
    by_op = bench.daemon_cpu_by_op()
    assert by_op["get"]["measurements"] == 1 and by_op["get"]["cpu_s_per_gb"] == 2.0
    assert bench.cases[1].to_json()["daemon_cpu"]["cpu_s_per_gb"] == 2.0
