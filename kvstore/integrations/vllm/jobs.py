"""The tier's own threads: every call to the daemon runs here, never on vLLM's scheduler thread.

vLLM calls a secondary tier in its scheduler process and requires each
call to return at once; a transfer is a job whose result the tier hands
back later from ``get_finished_jobs``. The runner keeps three queues and
takes loads first (a request waits on them), then stores, then chores
(unpins, recency hints: no result, dropped when the queue is full).

Limits: at most ``max_queued`` jobs waiting or running (a job beyond it is
refused at once: the caller drops the store or fails the load); a job that
waited past its deadline is given up without calling the daemon. So a load
is answered within its queue deadline plus its own calls' deadlines, and
``drain`` returns within the same bound.

Every submitted job reports exactly once: vLLM keeps primary-tier slots
pinned until it does. A job that raises an unexpected error (a bug, not a
daemon failure: those are results) still reports, as given up with reason
``error``, and says so in the log; it does not change what the tier thinks
of the daemon's health.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from vllm.v1.kv_offload.tiering.base import JobResult

log = logging.getLogger(__name__)

MAX_CHORES = 1024


class Kind(enum.IntEnum):
    LOAD = 0  # taken first
    STORE = 1
    CHORE = 2


@dataclass(frozen=True, slots=True)
class Job:
    run: Callable[[], JobResult]
    give_up: Callable[[str], JobResult]  # the result when the job is not run: reason "expired" or "error"
    deadline: float  # monotonic: past it, the job is given up unrun


class JobRunner:
    """A bounded pool of threads running jobs in priority order (see the module docstring)."""

    def __init__(self, threads: int, max_queued: int, name: str = "strata-vllm",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._max = max_queued
        self._clock = clock
        self._cond = threading.Condition()
        self._queues: dict[Kind, deque] = {kind: deque() for kind in Kind}
        self._running = 0  # jobs (not chores) being run
        self._finished: list[JobResult] = []
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, kind: Kind, job: Job) -> bool:
        """Queue a load or a store; False (nothing queued) when ``max_queued`` are waiting or running."""
        assert kind is not Kind.CHORE
        with self._cond:
            if self._closed or self._pending_locked() >= self._max:
                return False
            self._queues[kind].append(job)
            self._cond.notify()
            return True

    def chore(self, fn: Callable[[], None]) -> bool:
        """Best effort, after every load and store already queued; dropped (False) when too many wait."""
        with self._cond:
            if not self._closed and len(self._queues[Kind.CHORE]) < MAX_CHORES:
                self._queues[Kind.CHORE].append(fn)
                self._cond.notify()
                return True
            return False

    def finished(self) -> list[JobResult]:
        """Results since the last call."""
        with self._cond:
            done, self._finished = self._finished, []
            return done

    def pending(self) -> int:
        """Loads and stores waiting or running."""
        with self._cond:
            return self._pending_locked()

    def _pending_locked(self) -> int:
        return self._running + len(self._queues[Kind.LOAD]) + len(self._queues[Kind.STORE])

    def drain(self) -> None:
        """Wait until every submitted load and store has run (or been given up) and reported."""
        with self._cond:
            while self._pending_locked():
                self._cond.wait(0.1)

    def shutdown(self) -> None:
        """Give up what still waits (each reports), wait for what runs, stop the threads."""
        with self._cond:
            self._closed = True
            waiting = [j for kind in (Kind.LOAD, Kind.STORE) for j in self._queues[kind]]
            for kind in Kind:
                self._queues[kind].clear()
            self._finished += [self._given_up(job, "expired") for job in waiting]
            self._cond.notify_all()
        for t in self._threads:
            t.join()

    # ---- the threads ----------------------------------------------------------

    def _take(self) -> tuple[Kind, object] | None:
        with self._cond:
            while True:
                for kind in Kind:
                    if self._queues[kind]:
                        if kind is not Kind.CHORE:
                            self._running += 1
                        return kind, self._queues[kind].popleft()
                if self._closed:
                    return None
                self._cond.wait()

    def _work(self) -> None:
        while (taken := self._take()) is not None:
            kind, item = taken
            if kind is Kind.CHORE:
                self._chore(item)
                continue
            result = self._run(item)
            with self._cond:
                self._finished.append(result)
                self._running -= 1
                self._cond.notify_all()

    def _run(self, job: Job) -> JobResult:
        if self._clock() > job.deadline:
            return self._given_up(job, "expired")
        try:
            return job.run()
        except Exception:  # noqa: BLE001 - a bug in one job must still report it, or vLLM leaks its slots
            log.exception("a Strata tier job failed unexpectedly; it reports as failed")
            return self._given_up(job, "error")

    @staticmethod
    def _given_up(job: Job, reason: str) -> JobResult:
        return job.give_up(reason)

    @staticmethod
    def _chore(fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - chores are hints (unpin, touch); a bug in one is logged, not fatal
            log.exception("a Strata tier background task failed")
