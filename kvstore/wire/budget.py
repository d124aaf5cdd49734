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
    """``capacity_bytes`` in all; with ``share_bytes``, at most that much for one holder (a tenant, a
    peer node) at once, so no one caller takes the whole budget (``share_setting`` sizes it)."""

    def __init__(self, capacity_bytes: int, what: str, setting: str, retry_after_s: float = 0.05, *,
                 share_bytes: int | None = None, share_setting: str = "") -> None:
        self.capacity_bytes = capacity_bytes
        self.share_bytes = share_bytes
        self._what = what
        self._setting = setting
        self._share_setting = share_setting
        self._retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._used = 0
        self._held: dict[str, int] = {}  # holder -> bytes it holds now (only holders that hold some)

    @property
    def used_bytes(self) -> int:
        return self._used

    def held_by(self, holder: str) -> int:
        with self._lock:
            return self._held.get(holder, 0)

    def take(self, n: int, holder: str = "") -> None:
        """Hold ``n`` bytes (for ``holder``: within its share too), or raise Overloaded when they would
        exceed the budget or the share."""
        with self._lock:
            if self._used + n > self.capacity_bytes:
                raise Overloaded(
                    f"{self._what} already hold {self._used} of {self.capacity_bytes} bytes ({self._setting}); "
                    f"{n} more do not fit: retry after the delay, or raise {self._setting}",
                    retry_after_s=self._retry_after_s,
                )
            mine = self._held.get(holder, 0) if holder else 0
            if holder and self.share_bytes is not None and mine + n > self.share_bytes:
                raise Overloaded(
                    f"{holder} holds {mine} bytes of {self._what}, its share of this daemon's {self.capacity_bytes} "
                    f"is {self.share_bytes} ({self._share_setting}); {n} more do not fit: finish some, retry after "
                    "the delay, or send smaller batches", retry_after_s=self._retry_after_s,
                )
            self._used += n
            if holder:
                self._held[holder] = mine + n

    def give(self, n: int, holder: str = "") -> None:
        with self._lock:
            self._used -= n
            if holder:
                left = self._held.get(holder, 0) - n
                if left > 0:
                    self._held[holder] = left
                else:
                    self._held.pop(holder, None)
