"""The CPU time a daemon process spends: per byte a case moves through it, and while nothing moves.

A speed-up that burns a core is no speed-up on a node that also runs an
engine, so the benchmarks charge each case with the daemon's CPU seconds
per GB moved, read from outside the daemon (it is another process: the
benchmark cannot ask it). A daemon that spins while idle (a busy-polling
progress thread) shows as its idle share of a core.

Why per-thread ``schedstat`` and not the process's ``stat``: ``/proc/<pid>/stat``
counts clock ticks (10 ms at the usual ``CLK_TCK`` of 100), as coarse as a
whole round of a small case; ``/proc/<pid>/task/<tid>/schedstat`` gives each
thread's time on a CPU in nanoseconds. A thread that exits during an interval
takes its nanoseconds with it, so an interval in which a thread went away is
read from ``stat`` instead (the process's ``utime + stime``, which keeps
exited threads' time), in ticks. No psutil: it is not a dependency, and
these two files are all it would read.

Reading a daemon costs this process one file per daemon thread; it is done
just outside each timed part, never inside it.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

CLK_TCK = os.sysconf("SC_CLK_TCK")
_measurements = itertools.count(1)


@dataclass(frozen=True)
class Reading:
    """One process's CPU time at one moment."""

    threads: dict[int, int]  # thread id -> nanoseconds on a CPU
    ticks: int  # utime + stime of the whole process, exited threads included


def read(pid: int) -> Reading:
    """The CPU time of process ``pid`` now (Linux ``/proc``)."""
    threads = {}
    task = f"/proc/{pid}/task"
    for tid in os.listdir(task):
        try:
            with open(f"{task}/{tid}/schedstat") as f:
                threads[int(tid)] = int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # exited between the listing and the read
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
    return Reading(threads, int(fields[11]) + int(fields[12]))


def seconds_between(before: Reading, after: Reading) -> float:
    """CPU seconds the process spent from ``before`` to ``after``."""
    if before.threads.keys() <= after.threads.keys():
        return sum(ns - before.threads.get(tid, 0) for tid, ns in after.threads.items()) / 1e9
    return (after.ticks - before.ticks) / CLK_TCK  # a thread exited: only stat kept its time


@dataclass(frozen=True)
class CpuUse:
    """The daemon CPU a case took: ``seconds`` over ``nbytes`` moved by ``op`` (put, get, handoff).

    ``measurement``: which :class:`DaemonMeter` measured it (two rows comparing the same rounds
    with two baselines share one figure, and a total counts it once).
    """

    op: str
    seconds: float
    nbytes: int
    measurement: int = 0

    @property
    def s_per_gb(self) -> float | None:
        return self.seconds / (self.nbytes / 1e9) if self.nbytes else None

    def to_json(self) -> dict:
        return {"op": self.op, "cpu_s": round(self.seconds, 4), "gb": round(self.nbytes / 1e9, 4),
                "cpu_s_per_gb": None if self.s_per_gb is None else float(f"{self.s_per_gb:.4g}")}


@dataclass(frozen=True)
class IdleCpu:
    """A daemon's CPU over ``wall_s`` of no traffic, as a share of one core."""

    daemon: str
    wall_s: float
    cpu_s: float

    @property
    def share_of_core(self) -> float:
        return self.cpu_s / self.wall_s

    def to_json(self) -> dict:
        return {"daemon": self.daemon, "wall_s": round(self.wall_s, 3), "cpu_s": round(self.cpu_s, 4),
                "share_of_core": float(f"{self.share_of_core:.3g}")}


class DaemonCpu:
    """The CPU time of one or more daemon processes, summed (a handoff runs on two)."""

    def __init__(self, pids: Iterable[int], name: str = "daemon") -> None:
        self.pids = tuple(pids)
        self.name = name

    def read(self) -> tuple[Reading, ...]:
        return tuple(read(pid) for pid in self.pids)

    def seconds(self, before: tuple[Reading, ...], after: tuple[Reading, ...]) -> float:
        return sum(seconds_between(b, a) for b, a in zip(before, after))

    def idle(self, wall_s: float) -> IdleCpu:
        """Sleep ``wall_s`` while nothing is asked of the daemon; its CPU in that time."""
        before, t0 = self.read(), time.monotonic()
        time.sleep(wall_s)
        after, t1 = self.read(), time.monotonic()
        return IdleCpu(self.name, t1 - t0, self.seconds(before, after))


class DaemonMeter:
    """Times the measured part of rounds and charges the daemon's CPU in it to one case.

    ``start()`` just before the timed part, ``stop(nbytes)`` just after it (it returns the
    seconds); ``use()`` is the case's total over all its rounds, warm-up included. Without a
    daemon (a baseline's rounds) it only times.
    """

    def __init__(self, daemon: DaemonCpu | None = None, op: str = "") -> None:
        self.daemon = daemon
        self.op = op
        self.measurement = next(_measurements)
        self.cpu_s = 0.0
        self.nbytes = 0
        self._before: tuple[Reading, ...] = ()
        self._t0 = 0.0

    def start(self) -> None:
        if self.daemon is not None:
            self._before = self.daemon.read()
        self._t0 = time.perf_counter()

    def stop(self, nbytes: int) -> float:
        seconds = time.perf_counter() - self._t0
        if self.daemon is not None:
            self.cpu_s += self.daemon.seconds(self._before, self.daemon.read())
        self.nbytes += nbytes
        return seconds

    def use(self) -> CpuUse | None:
        return None if self.daemon is None else CpuUse(self.op, self.cpu_s, self.nbytes, self.measurement)
