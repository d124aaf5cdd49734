"""RemoteBridge: the threaded store's synchronous door to one asynchronous remote source.

The store runs on threads (RPC workers, demotion workers); a remote source is
a set of coroutines on one event loop. The bridge owns that loop, on a
thread of its own, and runs every call there. It exists to put limits
between the two:

- **Bounded work.** At most ``max_in_flight`` calls run on the source at
  once and at most ``max_queued`` more wait for a turn. A call beyond those
  is refused at once with ``Overloaded`` (RESOURCE_EXHAUSTED with
  ``retry_after_s``): a queue that is full says so; it never grows.
- **Bounded waiting.** A call waits for its turn no longer than its
  deadline. Once running, the source answers by the deadline (per key, see
  :mod:`kvstore.remote.base`); one that has not answered ``overrun_s``
  later is cancelled and the caller gets ``DeadlineExceeded``. The caller's
  thread stops waiting then even if the loop is stuck.
- **Buffers the caller can trust.** A read's ``place`` runs on the loop
  thread (so it must be quick, and must not take a lock the calling thread
  holds). Once a call is given up, ``place`` hands out no more buffers, and
  the caller is not answered until the call has really stopped, so a
  buffer it gets back is not written afterwards. Only if the loop itself is
  stuck past that does the caller get ``TierUnavailable`` saying that
  buffers placed by the call may still be written.
- **A clean close.** ``close`` refuses new calls, closes the source (which
  ends calls in flight: their unanswered keys fail ``TierUnavailable``),
  cancels whatever is left after ``close_timeout_s``, and joins the thread.

Calls made from the loop thread itself (from inside ``place``) would wait on
themselves forever; they are refused with ``InvalidArgument``.

Work the source's owner keeps going on the loop (the object tier's
write-back uploads) runs through :meth:`RemoteBridge.background`, outside
the call limits; ``close`` cancels whatever of it still runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from kvstore.block import BlockKey, BlockMeta, TierName
from kvstore.errors import DeadlineExceeded, InvalidArgument, Overloaded, StrataError, TierUnavailable
from kvstore.remote.base import MetaPlace, ReadResult, RemoteSource, RemoteStats, WriteResult, time_left


@dataclass(frozen=True, slots=True)
class BridgeLimits:
    max_in_flight: int = 32  # calls running on the source at once
    max_queued: int = 256  # calls waiting for a turn; one more is Overloaded
    overrun_s: float = 0.1  # how long past its deadline a source may take before it is cancelled
    retry_after_s: float = 0.05  # what Overloaded tells the caller
    close_timeout_s: float = 5.0  # how long close waits for calls in flight before cancelling them

    def __post_init__(self) -> None:
        if self.max_in_flight < 1 or self.max_queued < 0:
            raise InvalidArgument(
                f"remote bridge limits: max_in_flight={self.max_in_flight}, max_queued={self.max_queued}; "
                "need at least one call in flight and a queue of zero or more"
            )
        if min(self.overrun_s, self.retry_after_s, self.close_timeout_s) <= 0:
            raise InvalidArgument("remote bridge limits: overrun_s, retry_after_s and close_timeout_s must be positive")


@dataclass(frozen=True, slots=True)
class BridgeStats:
    running: int  # calls on the source now
    queued: int  # calls admitted and waiting for a turn
    overloaded: int  # calls refused with Overloaded, in total
    timed_out: int  # calls the bridge ended with DeadlineExceeded, in total
    source: RemoteStats


class _Call:
    """One call's life between the caller's thread and the loop."""

    __slots__ = ("make", "deadline", "result", "task", "given_up", "ended")

    def __init__(self, make: Callable[[], Awaitable], deadline: float) -> None:
        self.make = make
        self.deadline = deadline
        self.result: concurrent.futures.Future = concurrent.futures.Future()
        self.task: asyncio.Task | None = None
        self.given_up = False  # the caller stopped waiting: place hands out nothing more
        self.ended = threading.Event()  # the call no longer runs on the loop


class RemoteBridge:
    def __init__(
        self, source: RemoteSource | Callable[[], RemoteSource], limits: BridgeLimits = BridgeLimits()
    ) -> None:
        """Start the loop thread; ``source`` may be a zero-argument constructor to run on it."""
        self.limits = limits
        self._lock = threading.Condition()
        self._admitted = 0  # queued + running, counted from admission until the call has ended
        self._running = 0
        self._overloaded = 0
        self._timed_out = 0
        self._closing = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="strata-remote", daemon=True)
        self._thread.start()
        try:
            self._source: RemoteSource = asyncio.run_coroutine_threadsafe(self._setup(source), self._loop).result()
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
            raise
        self.tier: TierName = self._source.tier
        self.name: str = self._source.name
        self._thread.name = f"strata-remote {self.name}"

    @classmethod
    def open(cls, url: str, limits: BridgeLimits = BridgeLimits(), **options) -> RemoteBridge:
        from kvstore.remote import open_remote

        return cls(lambda: open_remote(url, **options), limits)

    async def _setup(self, source: RemoteSource | Callable[[], RemoteSource]) -> RemoteSource:
        self._turns = asyncio.Semaphore(self.limits.max_in_flight)
        return source if isinstance(source, RemoteSource) else source()

    # The contract's calls, from any thread.

    def lookup(self, keys: Sequence[BlockKey], deadline: float) -> list[BlockMeta | None]:
        return self._call("lookup", lambda call: self._source.lookup(keys, call.deadline), deadline)

    def read(self, keys: Sequence[BlockKey], place: MetaPlace, deadline: float) -> list[ReadResult]:
        def make(call: _Call) -> Awaitable:
            def guarded(i: int, meta: BlockMeta) -> memoryview | None:
                return None if call.given_up else place(i, meta)

            return self._source.read(keys, guarded, call.deadline)

        return self._call("read", make, deadline)

    def write(
        self, blocks: Sequence[tuple[BlockKey, bytes | bytearray | memoryview, BlockMeta]], deadline: float
    ) -> list[WriteResult]:
        return self._call("write", lambda call: self._source.write(blocks, call.deadline), deadline)

    def delete(self, keys: Sequence[BlockKey], deadline: float) -> int:
        return self._call("delete", lambda call: self._source.delete(keys, call.deadline), deadline)

    def call(self, op: str, make: Callable[[RemoteSource, float], Awaitable], deadline: float):
        """A call of the source's own, beyond the contract (``make(source, deadline)``), under the same
        admission, turns, deadline and cancellation as the contract's calls; its answer."""
        return self._call(op, lambda call: make(self._source, call.deadline), deadline)

    def background(self, make: Callable[[RemoteSource], Awaitable]) -> concurrent.futures.Future:
        """Run ``make(source)`` on the loop, outside the call limits (it bounds itself); close()
        cancels it if it still runs then."""
        with self._lock:
            if self._closing:
                raise TierUnavailable(f"{self.name}: the bridge is closed; no background work starts")
        return asyncio.run_coroutine_threadsafe(make(self._source), self._loop)

    def call_soon(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` on the loop thread soon (to wake background work); nothing once the loop is gone."""
        try:
            self._loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the loop closed: nothing is left to wake
            pass

    def stats(self) -> BridgeStats:
        with self._lock:
            running = self._running
            queued, overloaded, timed_out = self._admitted - running, self._overloaded, self._timed_out
        return BridgeStats(running, queued, overloaded, timed_out, self._source.stats())

    def close(self) -> None:
        """Refuse new calls, end those in flight, close the source, stop the thread. Idempotent."""
        if threading.get_ident() == self._thread.ident:
            raise InvalidArgument(f"{self.name}: close() called on the bridge's own loop thread; call it from another")
        with self._lock:
            closed_before, self._closing = self._closing, True
        if closed_before:
            self._thread.join()
            return
        limit = self.limits.close_timeout_s
        try:
            closing = asyncio.run_coroutine_threadsafe(asyncio.wait_for(self._source.close(), limit), self._loop)
            try:
                closing.result(limit + 1.0)
            except (TimeoutError, StrataError):
                closing.cancel()  # the source could not close cleanly; its calls are cancelled below
            with self._lock:
                self._lock.wait_for(lambda: self._admitted == 0, timeout=limit)
            asyncio.run_coroutine_threadsafe(self._cancel_all(), self._loop).result(limit)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    async def _cancel_all(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> RemoteBridge:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # Admission, deadlines and cancellation.

    def _call(self, op: str, make: Callable[[_Call], Awaitable], deadline: float):
        if threading.get_ident() == self._thread.ident:
            raise InvalidArgument(
                f"{self.name}: {op} called on the bridge's own loop thread (from inside place?): "
                "it would wait on itself; call the source's coroutine instead"
            )
        time_left(self._source, op, deadline)
        with self._lock:
            if self._closing:
                raise TierUnavailable(f"{self.name}: the bridge is closed; {op} refused")
            limit = self.limits.max_in_flight + self.limits.max_queued
            if self._admitted >= limit:
                self._overloaded += 1
                raise Overloaded(
                    f"{self.name}: {self._admitted} calls running or queued, the limit is {limit}: "
                    f"retry after {self.limits.retry_after_s}s or raise max_queued",
                    retry_after_s=self.limits.retry_after_s,
                )
            self._admitted += 1
        call = _Call(lambda: make(call), deadline)
        try:
            self._loop.call_soon_threadsafe(self._start, call)
        except RuntimeError:  # the loop closed under us
            self._ended(call)
            raise TierUnavailable(f"{self.name}: the bridge is closed; {op} refused") from None
        overrun = self.limits.overrun_s
        try:
            return call.result.result(timeout=max(0.0, deadline + 2 * overrun - time.monotonic()))
        except concurrent.futures.TimeoutError:
            pass
        call.given_up = True
        self._loop.call_soon_threadsafe(self._cancel, call)
        if not call.ended.wait(overrun):
            raise TierUnavailable(
                f"{self.name}: the bridge's event loop is stuck (a source blocking it?): {op} could not be "
                "stopped; buffers placed for it may still be written, do not reuse them"
            )
        return call.result.result()  # DeadlineExceeded, unless it finished as it was given up

    def _start(self, call: _Call) -> None:
        if self._closing:
            call.result.set_exception(TierUnavailable(f"{self.name}: the bridge closed before the call started"))
            self._ended(call)
            return
        call.task = self._loop.create_task(self._run(call))
        call.task.add_done_callback(lambda task: self._settle(call, task))

    @staticmethod
    def _cancel(call: _Call) -> None:
        if call.task is not None:
            call.task.cancel()

    def _settle(self, call: _Call, task: asyncio.Task) -> None:
        if not call.result.done():
            if task.cancelled() and call.given_up:
                with self._lock:
                    self._timed_out += 1
                call.result.set_exception(
                    DeadlineExceeded(f"{self.name}: the call did not answer by its deadline and was cancelled")
                )
            elif task.cancelled():
                call.result.set_exception(TierUnavailable(f"{self.name}: the call was cancelled by close()"))
            elif task.exception() is not None:
                call.result.set_exception(task.exception())
            else:
                call.result.set_result(task.result())
        self._ended(call)

    def _ended(self, call: _Call) -> None:
        call.ended.set()
        with self._lock:
            self._admitted -= 1
            self._lock.notify_all()

    async def _run(self, call: _Call):
        try:
            if self._turns.locked():  # wait for a turn, no longer than the deadline
                async with asyncio.timeout(call.deadline - time.monotonic()) as turn:
                    await self._turns.acquire()
            else:  # a turn is free: no timer needed
                await self._turns.acquire()
        except TimeoutError:
            if not turn.expired():
                raise
            with self._lock:
                self._timed_out += 1
            raise DeadlineExceeded(
                f"{self.name}: the deadline passed while waiting for a turn "
                f"({self.limits.max_in_flight} calls were running): give it more time or send fewer calls"
            ) from None
        with self._lock:
            self._running += 1
        try:
            async with asyncio.timeout(call.deadline + self.limits.overrun_s - time.monotonic()) as overrun:
                return await call.make()
        except TimeoutError:
            if not overrun.expired():
                raise
            with self._lock:
                self._timed_out += 1
            raise DeadlineExceeded(
                f"{self.name}: the source did not answer within {self.limits.overrun_s}s of the deadline "
                "and was cancelled"
            ) from None
        finally:
            with self._lock:
                self._running -= 1
            self._turns.release()
