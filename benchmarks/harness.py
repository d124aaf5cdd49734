"""What every benchmark shares: alternating A/B rounds, results, the table, private servers.

Machines here are shared and noisy, so no absolute figure is trusted alone:
every candidate runs in the same rounds as its baseline, in a rotating order
(A B C, B C A, C A B …) after a warm-up, and a case reports the median of
each and their ratio (see shared BENCHMARKS.md). Rotating the order keeps
one measurement from always following the same neighbour (a put that leaves
dirty pages to write back, say).

Servers the benchmarks compare against run as private child processes on
free loopback ports and are stopped when the benchmark ends: a private
``redis-server`` (never the machine's 6379) and a Strata daemon in its own
process, as it is deployed, so the client and the daemon do not share a GIL.

Every benchmark has three plans: the full run, ``--quick`` (under a minute)
and ``--smoke``: every case once, at tiny sizes, in seconds, so that a test
can run each benchmark and a benchmark cannot rot unnoticed. A smoke run's
figures mean nothing (tiny blocks, the fewest rounds, a test runner beside
it), so it writes no results: ``benchmarks/results/`` keeps the last real
run's. A smoke run in which every case was skipped (each row says why) fails: it
proved nothing ran.

The benchmarks that drive a daemon (``kv_local``, ``kv_pool``) also charge each
case with the daemon's CPU seconds per GB moved and report what the daemon
burns idle (:mod:`benchmarks.daemon_cpu`): one more column and a line under
the table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import selectors
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from benchmarks import daemon_cpu
from benchmarks.daemon_cpu import CpuUse, IdleCpu
from kvstore.shm.arena import filesystem_of  # noqa: F401 - the benchmarks take it from here

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BENCH_DIR = Path(__file__).resolve().parent
# Where the daemons the benchmarks start keep their arenas (a folder of their own there, "bench-strata-…",
# which no test's /dev/shm guard takes for a leak), when it is a tmpfs with this much room.
SHM_DIR = "/dev/shm"
SHM_ROOM = 8 << 30

# One round of one measurement: (bytes moved, seconds the timed part took).
# Setup and cleanup (fresh keys, deletes) stay outside the timed part.
RoundFn = Callable[[], tuple[int, float]]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def size_label(n: int) -> str:
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit}{name}"
    return f"{n}B"


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (10^9 bytes per second)."""
    return nbytes / seconds / 1e9


SMOKE_HELP = ("every case once, at tiny sizes, in seconds: checks that the benchmark runs; its figures mean "
              "nothing and no results are written")


def smoke_line(name: str) -> str:
    """What a smoke run prints instead of writing ``results/<name>.json``."""
    return (f"smoke run: its figures mean nothing; no results written "
            f"(benchmarks/results/{name}.json left as it was)")


def _sig(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else float(f"{x:.{digits}g}")


# ---- measuring ---------------------------------------------------------------


def interleave(fns: dict[str, RoundFn], *, rounds: int, warmup: int) -> dict[str, list[float]]:
    """Run every measurement once per round, rotating the order; returns GB/s samples per name."""
    if rounds < 5:
        raise ValueError("BENCHMARKS.md asks for at least 5 rounds")
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            nbytes, seconds = fns[name]()
            samples[name].append(gbps(nbytes, seconds))
    return samples


@dataclass(frozen=True)
class Case:
    """One row of the results: a candidate's median against its baseline's, measured in the same rounds."""

    case: str
    value: float | None
    baseline: str
    baseline_value: float | None
    target_ratio: float | None = None
    higher_is_better: bool = True
    metric: str = "throughput"
    unit: str = "GB/s"
    note: str = ""
    daemon_cpu: CpuUse | None = None  # the candidate's daemon CPU, where a daemon moved its bytes

    @property
    def ratio(self) -> float | None:
        if self.value is None or not self.baseline_value:
            return None
        return self.value / self.baseline_value

    @property
    def meets_target(self) -> bool | None:
        ratio = self.ratio
        if self.target_ratio is None or ratio is None:
            return None
        return ratio >= self.target_ratio if self.higher_is_better else ratio <= self.target_ratio

    def to_json(self) -> dict:
        out = {
            "case": self.case,
            "metric": self.metric,
            "unit": self.unit,
            "value": _sig(self.value),
            "baseline": self.baseline,
            "baseline_value": _sig(self.baseline_value),
            "ratio": _sig(self.ratio, 3),
            "higher_is_better": self.higher_is_better,
            "target_ratio": self.target_ratio,
            "meets_target": self.meets_target,
        }
        if self.daemon_cpu is not None:
            out["daemon_cpu"] = self.daemon_cpu.to_json()
        if self.note:
            out["note"] = self.note
        return out

    @property
    def skipped(self) -> bool:
        """No figure: the case could not run here (its note says why)."""
        return self.value is None


def compare(
    samples: dict[str, list[float]], candidate: str, baseline: str, *, case: str | None = None,
    target_ratio: float | None = None, note: str = "", daemon_cpu: CpuUse | None = None,
) -> Case:
    """The case ``candidate`` vs ``baseline`` from samples of one :func:`interleave` run."""
    return Case(
        case=case or candidate,
        value=statistics.median(samples[candidate]),
        baseline=baseline,
        baseline_value=statistics.median(samples[baseline]),
        target_ratio=target_ratio,
        note=note,
        daemon_cpu=daemon_cpu,
    )


def skipped(case: str, baseline: str, reason: str, target_ratio: float | None = None) -> Case:
    """A row for a case that cannot run here: no figure, and the reason in its note (never a silent gap)."""
    return Case(case, None, baseline, None, target_ratio=target_ratio, note=f"skipped: {reason}")


# ---- reporting ---------------------------------------------------------------

_COLUMNS = (("case", 36), ("GB/s", 8), ("baseline", 26), ("GB/s", 8), ("ratio", 7), ("target", 7), ("met", 5))
# With the daemon's CPU: longer case names (the call and what it is measured against), and its CPU per GB.
_CPU_COLUMNS = (("case", 52), ("GB/s", 8), ("baseline", 34), ("GB/s", 8), ("ratio", 7), ("target", 7),
                ("met", 5), ("daemon CPU s/GB", 15))


class Benchmark:
    """Parses ``--quick`` and ``--smoke``, prints rows as cases finish, writes ``results/<name>.json``
    (except after ``--smoke``).

    ``daemon_cpu``: the table has a column for each case's daemon CPU per GB moved, and
    :meth:`add_idle` records what a daemon burns with no traffic.
    """

    def __init__(self, name: str, description: str, argv: list[str] | None = None, *,
                 daemon_cpu: bool = False) -> None:
        parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=description)
        size = parser.add_mutually_exclusive_group()
        size.add_argument("--quick", action="store_true", help="fewer, smaller rounds: finishes in under 60 s")
        size.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
        self.args = parser.parse_args(argv)
        self.name = name
        self.quick: bool = self.args.quick
        self.smoke: bool = self.args.smoke
        self.command = f"python -m benchmarks.{name}" + self.mode_flag
        self.when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.cases: list[Case] = []
        self.idle: list[IdleCpu] = []
        self._daemon_cpu = daemon_cpu
        self._started = time.monotonic()
        self._header_printed = False

    @property
    def _columns(self) -> tuple[tuple[str, int], ...]:
        """The table's (title, width) columns."""
        return _CPU_COLUMNS if self._daemon_cpu else _COLUMNS

    @property
    def mode_flag(self) -> str:
        """The size flag of this run as it appears in its command: " --quick", " --smoke" or ""."""
        return " --smoke" if self.smoke else " --quick" if self.quick else ""

    def plan(self, full, quick, smoke):
        """The plan this run asked for, of the benchmark's three."""
        return smoke if self.smoke else quick if self.quick else full

    def add(self, case: Case) -> None:
        if not self._header_printed:
            self._print_row([title for title, _ in self._columns])
            self._print_row(["-" * width for _, width in self._columns])
            self._header_printed = True
        self.cases.append(case)
        ratio = case.ratio
        met = {True: "yes", False: "NO", None: ""}[case.meets_target]
        self._print_row([
            case.case,
            "n/a" if case.value is None else f"{case.value:.3f}",
            case.baseline,
            "n/a" if case.baseline_value is None else f"{case.baseline_value:.3f}",
            "" if ratio is None else f"{ratio:.2f}",
            "" if case.target_ratio is None else f"{case.target_ratio:g}",
            "skip" if case.skipped else met,
            _cpu_cell(case.daemon_cpu),
        ])
        if case.skipped:
            print(f"    {case.note}", flush=True)

    def add_idle(self, idle: IdleCpu) -> None:
        """The daemon's CPU with no traffic: printed under the rows, and in the JSON."""
        self.idle.append(idle)
        print(f"{idle.daemon} idle: {idle.share_of_core:.3f} of a core ({idle.cpu_s:.3f} CPU s over "
              f"{idle.wall_s:.1f} s with its clients connected and no traffic)", flush=True)

    def _print_row(self, cells: list[str]) -> None:
        print("  ".join(cell.ljust(width) for cell, (_, width) in zip(cells, self._columns)).rstrip(), flush=True)

    def daemon_cpu_by_op(self) -> dict[str, dict]:
        """The daemon's CPU per GB over every case of each op (put, get, handoff) that has a figure."""
        totals: dict[str, list[float]] = {}
        counted = set()
        for case in self.cases:
            use = case.daemon_cpu
            if use is not None and use.nbytes and (use.measurement or id(use)) not in counted:
                counted.add(use.measurement or id(use))
                t = totals.setdefault(use.op, [0.0, 0, 0])
                t[0] += use.seconds
                t[1] += use.nbytes
                t[2] += 1
        return {op: CpuUse(op, s, n).to_json() | {"measurements": k} for op, (s, n, k) in totals.items()}

    def finish(self) -> Path | None:
        """Write the JSON results and print a summary; returns the results path (None after ``--smoke``,
        which writes nothing)."""
        judged = [c for c in self.cases if c.meets_target is not None]
        missed = [c.case for c in judged if not c.meets_target]
        skips = [c.case for c in self.cases if c.skipped]
        print(
            f"\n{len(self.cases)} cases in {time.monotonic() - self._started:.0f} s; "
            f"targets met {len(judged) - len(missed)} of {len(judged)}"
            + (f"; missed: {', '.join(missed)}" if missed else "")
            + (f"; skipped {len(skips)}: {', '.join(skips)}" if skips else ""),
            flush=True,
        )
        by_op = self.daemon_cpu_by_op()
        if by_op:
            totals = [f"{op} {t['cpu_s_per_gb']} s/GB ({t['measurements']} measurements, {t['gb']} GB)"
                      for op, t in by_op.items()]
            print("daemon CPU per GB moved, over all measurements of each op: " + "; ".join(totals), flush=True)
        if self.smoke:
            if self.cases and len(skips) == len(self.cases):
                raise SystemExit(f"smoke run of {self.name}: every case was skipped, so nothing was checked")
            print(smoke_line(self.name), flush=True)
            return None
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        path = RESULTS_DIR / f"{self.name}.json"
        doc = {
            "benchmark": self.name,
            "command": self.command,
            "when": self.when,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "cases": [c.to_json() for c in self.cases],
        }
        if by_op or self.idle:
            doc["daemon_cpu"] = {"by_op": by_op, "idle": [i.to_json() for i in self.idle]}
        path.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"results: {path}", flush=True)
        return path


def _cpu_cell(use: CpuUse | None) -> str:
    if use is None or use.s_per_gb is None:
        return ""
    return f"{use.s_per_gb:.3g}"


class UnitBenchmark(Benchmark):
    """The shared runner, with a table that shows each row's unit (for cases that are not all GB/s)."""

    baseline_width = 44

    @property
    def _columns(self) -> tuple[tuple[str, int], ...]:
        return (("case", 40), ("value", 10), ("unit", 9), ("baseline", self.baseline_width), ("value", 10),
                ("ratio", 7), ("target", 7), ("met", 4))

    def add(self, case: Case) -> None:
        if not self._header_printed:
            self._print_row([t for t, _ in self._columns])
            self._print_row(["-" * w for _, w in self._columns])
            self._header_printed = True
        self.cases.append(case)
        ratio = case.ratio
        self._print_row([
            case.case,
            "n/a" if case.value is None else f"{case.value:.4g}",
            case.unit,
            case.baseline,
            "n/a" if case.baseline_value is None else f"{case.baseline_value:.4g}",
            "" if ratio is None else f"{ratio:.3g}",
            "" if case.target_ratio is None else f"{case.target_ratio:.3g}",
            {True: "yes", False: "NO", None: ""}[case.meets_target],
        ])


# ---- private servers ---------------------------------------------------------


class ServerUnavailable(RuntimeError):
    """A baseline or candidate server could not be started here; the message says why."""


# Ports below the kernel's ephemeral range (net.ipv4.ip_local_port_range, 32768-60999 by default),
# one slice per pytest-xdist worker.
_PORTS = (20000, 32000)
_SLICE = 1500
_next_port: list[int] = []


def free_port() -> int:
    """A TCP port free on every loopback address now, for a server this process starts next.

    Why not bind port 0: that port comes from the ephemeral range, which every outgoing
    connection of every process also draws from, so in a parallel test run another process's
    connection (or its own "free" port) takes it between this check and the server's bind
    ("Address already in use"). The kernel never hands out ports below that range, so they
    are taken here in turn, each pytest-xdist worker (``PYTEST_XDIST_WORKER=gwN``) in a slice
    of its own, from a random start per process, skipping any port bound now.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    first = _PORTS[0] + (index * _SLICE) % (_PORTS[1] - _PORTS[0] - _SLICE)
    if not _next_port:
        import random

        _next_port.append(random.randrange(_SLICE))
    for _ in range(_SLICE):
        port = first + _next_port[0] % _SLICE
        _next_port[0] += 1
        if _bindable(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # every port of the slice is taken
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bindable(port: int) -> bool:
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0")):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def _redis_ping(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def private_redis(start_timeout_s: float = 10.0, bind: str = "127.0.0.1") -> Iterator[int]:
    """A throwaway ``redis-server`` on a free port of ``bind`` (loopback by default), no persistence;
    yields its port.

    Never the machine's own 6379: its contents belong to someone else, and
    another client's load would skew the figures. Bound to another address (a
    virtual network's gateway, where daemons in namespaces reach it), its
    protected mode is off: nothing outside the machine reaches that address.
    """
    exe = shutil.which("redis-server")
    if exe is None:
        raise ServerUnavailable("redis-server is not installed (apt-get install redis-server)")
    workdir = tempfile.mkdtemp(prefix="strata-bench-redis-")
    log_path = os.path.join(workdir, "redis.log")
    proc = None
    reason = ""
    try:
        for _attempt in range(3):  # the free port can be taken between the probe and the bind
            port = free_port()
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    [exe, "--port", str(port), "--bind", bind, "--save", "", "--appendonly", "no",
                     "--dir", workdir, "--daemonize", "no", "--loglevel", "warning",
                     *(["--protected-mode", "no"] if bind != "127.0.0.1" else [])],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                )
            deadline = time.monotonic() + start_timeout_s
            while time.monotonic() < deadline and proc.poll() is None and not _redis_ping(port, bind):
                time.sleep(0.05)
            if proc.poll() is None and _redis_ping(port, bind):
                break
            _stop(proc, 2.0)
            proc = None
            with open(log_path, "rb") as log:
                reason = log.read().decode(errors="replace").strip()[-500:]
        else:
            raise ServerUnavailable(f"redis-server did not start: {reason}")
        yield port
    finally:
        if proc is not None:
            _stop(proc, 5.0)
        shutil.rmtree(workdir, ignore_errors=True)


_DAEMON_MAIN = r"""
import json, sys
from kvstore.config import load_settings
from kvstore.server.daemon import Daemon

daemon = Daemon(load_settings(**json.loads(sys.argv[1]))).start()
print(daemon.port, flush=True)
sys.stdin.read()  # the benchmark closes our stdin, or dies: either way, stop
daemon.stop(0)
"""


@dataclass(frozen=True)
class DaemonProcess:
    """A daemon :func:`strata_daemon_process` started: where to reach it, and its process (for its CPU time)."""

    target: str  # host:port
    pid: int


@contextlib.contextmanager
def strata_daemon(start_timeout_s: float = 30.0, **settings) -> Iterator[str]:
    """A Strata daemon in its own process on a free loopback port; yields its ``host:port``
    (:func:`strata_daemon_process`)."""
    with strata_daemon_process(start_timeout_s, **settings) as daemon:
        yield daemon.target


# After a daemon's CPU falls idle at start, same-host round trips still cost 0.6-0.8 ms for about half a
# second (0.04-0.06 ms after it; measured with a 1 GiB arena, cause not identified): waited out as well.
QUIET_AFTER_S = 1.0


def settle(pids: Iterable[int] = (), timeout_s: float = 30.0, idle_share: float = 0.05) -> float:
    """Wait until start-up work is over, before anything is timed: this process's arena prefault
    threads (a same-host client faults its mapping of the arena in at attach) and the daemons' own
    (a daemon faults its arena in at start, about a second a GiB on these VMs), the latter seen as
    each daemon's CPU falling below ``idle_share`` of a core over a quarter second, then
    :data:`QUIET_AFTER_S` more. Returns the seconds waited; gives up, saying so, after ``timeout_s``."""
    start, pids = time.monotonic(), list(pids)
    deadline = start + timeout_s
    while time.monotonic() < deadline:
        busy = any(t.name == "strata-prefault" and t.is_alive() for t in threading.enumerate())
        if not busy and pids:
            before = {pid: daemon_cpu.read(pid) for pid in pids}
            time.sleep(0.25)
            busy = any(daemon_cpu.seconds_between(before[pid], daemon_cpu.read(pid)) > idle_share * 0.25
                       for pid in pids)
        if not busy:
            time.sleep(QUIET_AFTER_S if pids else 0)
            return time.monotonic() - start
        time.sleep(0.05)
    print(f"start-up work still running after {timeout_s:g} s; measuring anyway", file=sys.stderr)
    return time.monotonic() - start


def _roomy_tmpfs(path: str) -> bool:
    """Whether ``path`` is a tmpfs with room for the benchmarks' arenas (a container's default /dev/shm of
    64 MB is not)."""
    try:
        st = os.statvfs(path)
        free = st.f_bavail * st.f_frsize
    except OSError:
        return False
    return filesystem_of(path) == "tmpfs" and free >= SHM_ROOM


@contextlib.contextmanager
def strata_daemon_process(start_timeout_s: float = 30.0, **settings) -> Iterator[DaemonProcess]:
    """A Strata daemon in its own process on a free loopback port; yields its address and process id.

    ``settings`` are :func:`kvstore.config.load_settings` overrides: flag
    names of ``strata serve`` (``ram_bytes="1GiB"``; sizes as strings) or a
    config section as a dict (``store={"demotion_threads": 2}``). The daemon stops when its stdin closes, so
    it cannot outlive a benchmark killed with SIGKILL. Its arena goes with it (``ram_keep_on_exit`` off):
    a benchmark's cache is not worth keeping in the shared-memory directory, which is a folder of its
    own unless ``shm_dir`` names one: under /dev/shm when that is a tmpfs, as a production arena is
    (never /dev/shm itself: a daemon that has to be killed would leave its arena there among the
    host's), else a scratch folder.
    """
    scratch = shm = None
    if "disk_dir" not in settings:  # never the default ~/.cache/strata: another daemon may be using it
        scratch = tempfile.TemporaryDirectory(prefix="strata-bench-")
        settings["disk_dir"] = f"{scratch.name}/disk"
    if "shm_dir" not in settings:  # a tmpfs as in production (a folder of its own there), else a scratch folder
        shm = tempfile.TemporaryDirectory(prefix="bench-strata-", dir=SHM_DIR if _roomy_tmpfs(SHM_DIR) else None)
        settings["shm_dir"] = shm.name
    settings = {"listen": "127.0.0.1:0", "metrics_listen": "", "ram_keep_on_exit": False, **settings}
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in settings.items()}
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [sys.executable, "-c", _DAEMON_MAIN, json.dumps(settings)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
    )
    try:
        port = _read_port(proc, start_timeout_s)
        if port is None:
            _stop(proc, 2.0)
            log.seek(0)
            reason = log.read().decode(errors="replace").strip()[-2000:]
            raise ServerUnavailable(f"the Strata daemon did not start:\n{reason}")
        yield DaemonProcess(f"127.0.0.1:{port}", proc.pid)
    finally:
        if proc.stdin is not None and not proc.stdin.closed:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        try:
            proc.wait(15.0)
        except subprocess.TimeoutExpired:
            _stop(proc, 5.0)
        log.close()
        for folder in (scratch, shm):
            if folder is not None:
                folder.cleanup()


def _read_port(proc: subprocess.Popen, timeout_s: float, max_bytes: int = 1 << 16) -> int | None:
    """The port the daemon prints; lines before it that are not a port (a library's warning
    on stdout, e.g. UCX's) are skipped. Read from the descriptor itself, a line at a time, so
    nothing past the port's line is taken from the pipe."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    end = time.monotonic() + timeout_s
    line = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        for _ in range(max_bytes):
            if not sel.select(max(0.0, end - time.monotonic())):
                return None
            byte = os.read(fd, 1)
            if not byte:
                return None  # the daemon exited
            if byte != b"\n":
                line += byte
            elif line.strip().isdigit():
                return int(line.strip())
            else:
                line = b""
    return None


def _stop(proc: subprocess.Popen, timeout_s: float) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A temporary folder beside the benchmarks, on the repository's filesystem (not a tmpfs /tmp)."""
    path = Path(tempfile.mkdtemp(prefix=f".scratch-{prefix}-", dir=BENCH_DIR))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


