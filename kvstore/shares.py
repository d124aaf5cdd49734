"""Per-identity shares of a daemon-wide limit.

A daemon-wide limit (256 open handoffs, 8 pulls at once) keeps the daemon
from promising more than it has; it does not keep one caller from taking
all of it, after which every other tenant is refused. So each such limit
also has a share: no one holder may hold more than ``share`` units at once.
The holder is whom the call's resources belong to (:func:`kvstore.auth.owner_of`):
the authenticated principal (a tenant's token or certificate, all its
connections together), else the gRPC connection or the same-host process.

Why a fixed share and not fair queueing: a cache answers at once or not
at all (a refused caller recomputes, or retries after the delay it is
given), it never queues; and a fixed share is a number an operator can
size. Beyond the share the caller gets RESOURCE_EXHAUSTED naming the
share and its setting, with a retry delay; the daemon-wide limit is the
caller's to check, beside the share (:meth:`Shares.take` counts shares only).

The table holds one entry per holder that holds something: at most as
many entries as units are held, so it is bounded by the daemon-wide limit.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from kvstore.errors import Overloaded


class Shares:
    """``share``: units one holder may hold at once; ``what``: the units' name in refusals
    ("open handoffs"); ``setting``: the flag that sizes the share."""

    def __init__(self, share: int, what: str, setting: str, retry_after_s: float = 0.2) -> None:
        if share < 1:
            raise ValueError(f"a share of {share} {what} admits nobody: give at least 1 ({setting})")
        self.share = share
        self._what = what
        self._setting = setting
        self._retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}

    def held(self, holder: str) -> int:
        with self._lock:
            return self._held.get(holder, 0)

    def take(self, holder: str, n: int = 1) -> None:
        """Hold ``n`` more units for ``holder``, or raise Overloaded when that passes its share."""
        with self._lock:
            now = self._held.get(holder, 0)
            if now + n > self.share:
                raise Overloaded(
                    f"{holder} holds {now} {self._what}, its share of this daemon's limit is {self.share} "
                    f"({self._setting}): finish or release some, retry after the delay, or ask the operator "
                    "for a larger share", retry_after_s=self._retry_after_s,
                )
            self._held[holder] = now + n

    def give(self, holder: str, n: int = 1) -> None:
        """Give back ``n`` units ``holder`` took (never below zero)."""
        with self._lock:
            left = self._held.get(holder, 0) - n
            if left > 0:
                self._held[holder] = left
            else:
                self._held.pop(holder, None)

    @contextlib.contextmanager
    def hold(self, holder: str, n: int = 1) -> Iterator[None]:
        self.take(holder, n)
        try:
            yield
        finally:
            self.give(holder, n)

    def __len__(self) -> int:
        """Holders that hold something."""
        with self._lock:
            return len(self._held)
