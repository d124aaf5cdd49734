"""Progress of a ucxx worker on its event loop, and waits on UCX requests that do not spin.

ucxx's own wait on a request, outside its ``thread`` progress mode, is a
loop of ``asyncio.sleep(0)`` until the request completes: a receive posted
for a peer's next request (what a served connection always has) keeps the
UCX thread busy at 100% of a core for as long as the connection is open,
and takes the GIL from every other thread of the daemon. Its ``blocking``
mode arms the worker's event fd once and then relies on that spinning.

:class:`UcxProgress` progresses the worker on the loop it belongs to:
whenever its event fd is readable (``add_reader``: a message arrived), once
right after a request is made, and by timed polls while something is
waited on, because not every step of a transfer raises an event (a
rendezvous receive's copy, pulled by the receiver after the sender's
announcement, can complete only on a later progress call). After any
activity the next poll is :data:`MIN_POLL_S` away, and each idle one
doubles the gap up to :data:`MAX_POLL_S`; between them the worker is armed
and the UCX thread sleeps in ``epoll``. Measured on a busy 2-core host, a
burst of immediate polls after each event (what a spin does) was slower
than none: it holds the GIL the woken caller needs. So a transfer in
progress is driven within a millisecond, and a served connection waiting
for its next request costs a wakeup every :data:`MAX_POLL_S`, not a core.

:meth:`UcxProgress.wait` takes a request made through ucxx's low-level
endpoint (``tag_send``/``tag_recv``) and returns when it completed: its
error (``UCXCanceled`` for a request cancelled by an abort) is raised
there. A waiter cancelled before its request completed leaves the request
referenced here until UCX completes it, so the buffer UCX may still use is
never freed under it (at most :data:`MAX_ORPHANS` kept: a send that error
handling off lets wait for ever).
"""

from __future__ import annotations

import asyncio
import collections

__all__ = ["MAX_ORPHANS", "MAX_POLL_S", "MIN_POLL_S", "UcxProgress"]

MIN_POLL_S = 0.001
MAX_POLL_S = 0.05
MAX_ORPHANS = 1024


class UcxProgress:
    """Drives one ucxx worker from its event loop (made and used on that loop only)."""

    def __init__(self, worker, loop: asyncio.AbstractEventLoop) -> None:
        self._worker = worker
        self._loop = loop
        self._waits: dict[object, asyncio.Future] = {}  # request -> its waiter
        self._orphans: collections.deque = collections.deque(maxlen=MAX_ORPHANS)
        self._poll: asyncio.Handle | None = None
        self._gap = MIN_POLL_S
        loop.add_reader(worker.epoll_file_descriptor, self.drive)  # in place of ucxx's own reader
        self._poll_soon()

    async def wait(self, request) -> None:
        if not request.completed:
            future = self._loop.create_future()
            self._waits[request] = future
            self._gap = MIN_POLL_S
            self._poll_soon()
            try:
                await future
            except asyncio.CancelledError:
                if self._waits.pop(request, None) is not None and not request.completed:
                    self._orphans.append(request)
                raise
        request.check_error()

    def drive(self) -> None:
        """Progress until idle, resolve the waits that completed, arm the event fd, and keep a
        poll ahead while something is waited on."""
        active = False
        while self._worker.progress_once():
            active = True
        active |= self._resolve()
        if not self._worker.arm():  # events came in meanwhile: take them first
            self._poll_soon()
            return
        if not self._waits:
            return
        if active:  # the next step may follow at once: poll again soon, not at the backed-off gap
            self._gap = MIN_POLL_S
            if isinstance(self._poll, asyncio.TimerHandle):
                self._poll.cancel()
                self._poll = None
        if self._poll is None:
            self._poll = self._loop.call_later(self._gap, self._polled)
            self._gap = min(self._gap * 2, MAX_POLL_S)

    def _poll_soon(self) -> None:
        if isinstance(self._poll, asyncio.TimerHandle):
            self._poll.cancel()
            self._poll = None
        if self._poll is None:
            self._poll = self._loop.call_soon(self._polled)

    def _polled(self) -> None:
        self._poll = None
        self.drive()

    def _resolve(self) -> bool:
        done = [r for r in self._waits if r.completed]
        for request in done:
            future = self._waits.pop(request)
            if not future.done():
                future.set_result(None)
        if self._orphans:
            self._orphans = collections.deque((r for r in self._orphans if not r.completed), maxlen=MAX_ORPHANS)
        return bool(done)
