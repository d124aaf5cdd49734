"""A byte budget: how much memory requests in flight may hold at once.

A streamed Put declares its block's size before the bytes come; the buffer
for it is taken from this budget at the header, so forty streams that each
declare 64 MiB cannot make the daemon promise 2.5 GiB it does not have.
Beyond the budget a request is refused with RESOURCE_EXHAUSTED and a retry
delay, never queued.
"""

from __future__ import annotations

import threading

from kvstore.errors import Overloaded


class ByteBudget:
    def __init__(self, capacity_bytes: int, what: str, setting: str, retry_after_s: float = 0.05) -> None:
        self.capacity_bytes = capacity_bytes
        self._what = what
        self._setting = setting
        self._retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._used = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    def take(self, n: int) -> None:
        """Hold ``n`` bytes, or raise Overloaded when they would exceed the budget."""
        with self._lock:
            if self._used + n > self.capacity_bytes:
                raise Overloaded(
                    f"{self._what} already hold {self._used} of {self.capacity_bytes} bytes ({self._setting}); "
                    f"{n} more do not fit: retry after the delay, or raise {self._setting}",
                    retry_after_s=self._retry_after_s,
                )
            self._used += n

    def give(self, n: int) -> None:
        with self._lock:
            self._used -= n
