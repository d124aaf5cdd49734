"""Which peer connections may wait for their Hello: a bounded share of the listener, the oldest closed first.

A connection that has not said Hello yet holds a slot of
``--peer-max-connections`` and a thread, and costs whoever opened it one TCP
handshake and no token. Without a share of their own, 64 of them trickling a
Hello byte every few seconds held the whole listener, and a real peer's Hello
was refused. So at most ``limit`` connections wait for their Hello at once
(the server gives them half its connections: the other half is only ever
held by peers that authenticated), at most ``per_host`` of them from one
address; the server also gives each a fixed deadline from its accept, however
its bytes trickle in.

Why one more closes the oldest waiting rather than being refused itself: a
refusal lets whoever holds the share keep it to the deadline and take it
again at once, so a real peer gets in only by winning a race for a freed
slot. Closing the oldest lets a real peer in unless the flood refills the
whole share within the one round trip its Hello takes. The oldest of the
newcomer's own address goes first when that address is at its ``per_host``,
so a flood from one address only ever closes its own connections. The gate
only wakes the connection it closes (``wake``, on the thread of the one that
came in); its own thread sees :attr:`Waiting.closed` and answers it
Overloaded with a retry delay. ``wake`` runs under the gate's lock, which
the woken thread must take to leave the gate, so its socket cannot have been
closed, and its descriptor given to a new connection, when the wake lands.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager


class Waiting:
    """One connection waiting for its Hello. ``closed``: the gate closed it to make room (final once it left)."""

    __slots__ = ("closed", "host", "wake")

    def __init__(self, host: Hashable | None, wake: Callable[[], None]) -> None:
        self.host = host
        self.wake = wake
        self.closed = False


class HelloGate:
    """At most ``limit`` connections waiting for their Hello, at most ``per_host`` from one address."""

    def __init__(self, limit: int, per_host: int) -> None:
        if limit < 1 or per_host < 1:
            raise ValueError(f"a Hello gate needs room for one connection (limit {limit}, per host {per_host})")
        self.limit = limit
        self.per_host = per_host
        self._lock = threading.Lock()
        self._waiting: dict[Waiting, None] = {}  # oldest first (insertion order)
        self._per_host: dict[Hashable, int] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._waiting)

    @contextmanager
    def waiting(self, host: Hashable | None, wake: Callable[[], None]) -> Iterator[Waiting]:
        """Wait for a Hello inside the block; ``host`` None: counted only against ``limit``.
        After the block, the ticket's ``closed`` says whether the gate closed it meanwhile."""
        ticket = self._enter(host, wake)
        try:
            yield ticket
        finally:
            self._leave(ticket)

    def _enter(self, host: Hashable | None, wake: Callable[[], None]) -> Waiting:
        ticket = Waiting(host, wake)
        with self._lock:
            victim = None
            if host is not None and self._per_host.get(host, 0) >= self.per_host:
                victim = next(w for w in self._waiting if w.host == host)
            elif len(self._waiting) >= self.limit:
                victim = next(iter(self._waiting))
            if victim is not None:
                self._remove(victim)
                victim.closed = True
            self._waiting[ticket] = None
            if host is not None:
                self._per_host[host] = self._per_host.get(host, 0) + 1
            if victim is not None:
                victim.wake()
        return ticket

    def _leave(self, ticket: Waiting) -> None:
        with self._lock:
            if not ticket.closed:
                self._remove(ticket)

    def _remove(self, ticket: Waiting) -> None:
        del self._waiting[ticket]
        if ticket.host is not None:
            left = self._per_host[ticket.host] - 1
            if left:
                self._per_host[ticket.host] = left
            else:
                del self._per_host[ticket.host]
