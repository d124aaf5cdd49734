"""Write-behind: copies of blocks travelling down the chain, off the writer's path.

A :class:`Copy` names a block, the tier it is read from and the tier it is
written to, and whether the upper copy goes once the lower one is complete
(a demotion) or stays (write-through). The queue is bounded: when it is
full, :meth:`Demoter.offer` says so and the store evicts by other means or
tells the writer to retry; nothing waits in an unbounded queue. With zero
threads the store writes queued copies itself, in the thread that needs the
room (deterministic tests).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.block import BlockKey, TierName

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Copy:
    key: BlockKey
    src: TierName
    dst: TierName
    evict: bool  # drop the source copy once the destination holds it
    # Whether making room below may drop a block's last copy (at the bottom of the chain). A
    # writer waiting for room may; headroom kept ahead of writers may not: it never drops a
    # block below to move one down while the upper tier still has room.
    may_drop: bool = True


class Demoter:
    def __init__(self, work: Callable[[Copy], None], queue_blocks: int, threads: int) -> None:
        self._work = work
        self._q: queue.Queue[Copy | None] = queue.Queue(maxsize=queue_blocks)
        self._threads = [
            threading.Thread(target=self._loop, name=f"strata-demote-{i}", daemon=True) for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    @property
    def threaded(self) -> bool:
        return bool(self._threads)

    def offer(self, job: Copy) -> bool:
        """Queue a copy; False when the queue is full (the caller keeps the block where it is)."""
        try:
            self._q.put_nowait(job)
        except queue.Full:
            return False
        return True

    def depth(self) -> int:
        return self._q.qsize()

    def flush(self) -> None:
        """Write every queued copy now, in the calling thread."""
        while True:
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._work(job)

    def close(self, timeout: float = 5.0) -> None:
        for _ in self._threads:
            try:
                self._q.put_nowait(None)
            except queue.Full:
                break
        for t in self._threads:
            t.join(timeout=timeout)

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                self._work(job)
            except Exception:  # a bug in one copy: keep writing the rest rather than stall the head tier
                log.exception("copy of %s from %s to %s failed unexpectedly", job.key, job.src.label, job.dst.label)
