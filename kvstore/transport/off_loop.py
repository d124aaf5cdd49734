"""Copies and checksums for an event loop: inline when small, in a worker thread when large.

A 64 MiB memcpy (or its xxh3) on the loop's thread would stall every other
task for tens of milliseconds; a thread hop costs more than a small copy.
So a copy of more than ``threshold`` bytes runs in a worker thread
(``asyncio.to_thread``) and the rest inline. The asyncio transports share
one :class:`OffLoop` with their client, which must not unmap an arena while
a worker thread still holds a view of it: :attr:`OffLoop.busy` says whether
one does, :meth:`OffLoop.wait` waits for them to end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

OFF_LOOP_BYTES = 1 << 20

T = TypeVar("T")


class OffLoop:
    """Runs ``fn(*args)`` inline or in a worker thread by the bytes it moves; knows which threads still run."""

    def __init__(self, threshold: int = OFF_LOOP_BYTES) -> None:
        self.threshold = threshold
        self._running: set[asyncio.Future] = set()

    @property
    def busy(self) -> bool:
        """Whether a copy still runs in a worker thread."""
        return bool(self._running)

    async def wait(self) -> None:
        """Until every copy running in a worker thread has ended."""
        if self._running:
            await asyncio.wait(list(self._running))

    async def __call__(self, nbytes: int, fn: Callable[..., T], *args) -> T:
        """``fn(*args)``, inline when it moves at most ``threshold`` bytes, else in a worker thread.

        A thread cannot be stopped mid-copy, so when the awaiting task is
        cancelled this waits for the copy to end before letting the
        cancellation through: the caller then gives back slots and leases
        only once nothing writes into or reads from them any more.
        """
        if nbytes <= self.threshold:
            return fn(*args)
        copy = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        self._running.add(copy)
        copy.add_done_callback(self._running.discard)
        try:
            return await asyncio.shield(copy)
        except asyncio.CancelledError:
            while not copy.done():
                try:
                    await asyncio.wait([copy])
                except asyncio.CancelledError:
                    continue  # the copy ends within milliseconds
            raise
