"""Whether the daemon is worth calling: a dead sidecar costs one failed call per back-off period."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvstore.errors import (
    CorruptBlock,
    DaemonUnavailable,
    DeadlineExceeded,
    PermissionDenied,
    ResourceExhausted,
    StrataError,
    UnknownNamespace,
)

log = logging.getLogger(__name__)

DAEMON_DOWN = (DaemonUnavailable, DeadlineExceeded)  # the daemon is away or stuck: back off, answer misses
MAX_KEYS_PER_CALL = 1024  # block keys per daemon call, under the daemon's default batch limit (4096)


def failure_reason(err: BaseException) -> str:
    """What an engine's counters and logs call a failed daemon call: down (away or stuck), missing (nothing
    stored in that namespace yet: a plain miss), corrupt, full (the daemon's limits), denied, else refused."""
    if isinstance(err, DAEMON_DOWN):
        return "down"
    if isinstance(err, UnknownNamespace):
        return "missing"
    if isinstance(err, CorruptBlock):
        return "corrupt"
    if isinstance(err, ResourceExhausted):
        return "full"
    if isinstance(err, PermissionDenied):
        return "denied"
    return "refused"


class DaemonHealth:
    """Whether to call the daemon at all.

    After a call finds the daemon unreachable or stuck, every call in the
    next ``backoff_s`` answers a miss at once: a dead sidecar must not cost
    the engine a deadline per chunk, nor the daemon a retry storm when it
    comes back. ``engine`` names who sees the misses, for the log.
    """

    def __init__(self, backoff_s: float, clock: Callable[[], float] = time.monotonic, engine: str = "LMCache") -> None:
        self._backoff = backoff_s
        self._engine = engine
        self._clock = clock
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.down = False

    def usable(self) -> bool:
        return self._clock() >= self._down_until

    def failed(self, err: StrataError, target: str) -> None:
        with self._lock:
            self._down_until = self._clock() + self._backoff
            if not self.down:
                log.warning("Strata daemon %s unreachable (%s); %s sees misses for the next %.1fs",
                            target, type(err).__name__, self._engine, self._backoff)
            self.down = True

    def ok(self, target: str) -> None:
        if self.down:
            with self._lock:
                if self.down:
                    log.info("Strata daemon %s reachable again", target)
                self.down = False
