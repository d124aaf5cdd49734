"""Store events: what happened to a block, fanned out to subscribers outside the store lock.

The store says what it did, as small immutable values: a block was
:class:`Stored` in a tier, copied to another tier (:class:`Moved`: a
promotion or a demotion adds a copy), a copy left a tier (:class:`Evicted`),
or the block left the store (:class:`Removed`). Every event carries the
block's best tier *after* it (``None``: gone), so a subscriber that only
wants "where is the block now" (the prefix index) needs no store call.

Why a bus and not a callback: the store holds its lock when it learns what
changed, and a subscriber may be slow (a Redis round trip), fail, or need
batches. :meth:`EventBus.publish` only appends to each subscriber's bounded
queue, so it is safe under the store lock; each subscriber has its own
thread that calls its callback with batches, in publication order, outside
any store lock. One slow or failing subscriber never delays the store or
another subscriber.

Overflow rule. A subscriber's queue holds at most ``queue_events`` events.
An event that does not fit is not queued: the subscriber's pending events
are dropped too (counted in :attr:`Subscription.dropped_events`), and its
next delivery is ``[Resync()]``: "what you were told is incomplete; take a
snapshot" (the store's ``holdings()``: every visible block and its best
tier). Events published after the overflow follow the Resync. Some of them
may already be reflected in the snapshot; since each carries the best tier
after it, applying them in order still converges. A callback that raises is
logged with the subscriber's name and counted; it lost that batch, so its
next delivery is also ``[Resync()]`` (a failing Resync is not repeated until
the next failure or overflow, so a subscriber that always fails cannot spin).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvstore.block import BlockKey, TierName

log = logging.getLogger(__name__)

DEFAULT_QUEUE_EVENTS = 1 << 16
DEFAULT_BATCH_EVENTS = 1024
# How long a delivery thread lets events gather before it calls back (unless a
# full batch is waiting). Waking a thread per event costs every put two
# context switches and a GIL hand-off on a small machine; a few milliseconds
# of delay costs the index nothing (its agent coalesces for longer anyway).
DEFAULT_LINGER_S = 0.005
MAX_SUBSCRIBERS = 16
MAX_NAME_CHARS = 64


# ---- the events -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stored:
    """A new block was written into ``tier`` (a put or a committed slot)."""

    key: BlockKey
    tier: TierName
    size: int  # payload bytes (the block's BlockMeta.size)
    best: TierName | None
    kind: ClassVar[str] = "stored"


@dataclass(frozen=True, slots=True)
class Moved:
    """A copy of the block was added in ``target`` from ``source``: a promotion (read from a
    lower tier) or a demotion (evicted from a higher one). The source copy may stay; if it
    goes, an :class:`Evicted` follows."""

    key: BlockKey
    source: TierName
    target: TierName
    best: TierName | None
    kind: ClassVar[str] = "moved"


@dataclass(frozen=True, slots=True)
class Evicted:
    """The block's copy in ``tier`` is gone; the block lives on in ``best``. When the last
    copy goes the store publishes :class:`Removed` (``dropped``) instead; a subscriber that
    sees ``best`` None treats the block as gone either way."""

    key: BlockKey
    tier: TierName
    best: TierName | None
    kind: ClassVar[str] = "evicted"


@dataclass(frozen=True, slots=True)
class Removed:
    """The block left the store entirely: deleted by a client (``dropped`` False) or dropped
    by the store (room, a corrupt copy, a failed tier: ``dropped`` True)."""

    key: BlockKey
    dropped: bool = False
    best: ClassVar[None] = None
    kind: ClassVar[str] = "removed"


@dataclass(frozen=True, slots=True)
class Resync:
    """Not a block event: events were lost; rebuild your view from a store snapshot."""

    kind: ClassVar[str] = "resync"


BlockEvent = Stored | Moved | Evicted | Removed
Delivery = BlockEvent | Resync
Callback = Callable[[Sequence[Delivery]], None]

_RESYNC = Resync()


# ---- subscribers -------------------------------------------------------------------------


class Subscription:
    """One subscriber: its bounded queue, its delivery thread and its counters.

    Counters are plain ints read at scrape time (:mod:`kvstore.metrics`); they
    only grow, so they export as Prometheus counters.
    """

    def __init__(
        self, bus: EventBus, name: str, callback: Callback, queue_events: int, batch_events: int, linger_s: float,
    ) -> None:
        self.name = name
        self.queue_events = queue_events
        self.batch_events = batch_events
        self.linger_s = linger_s
        self._bus = bus
        self._callback = callback
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[Delivery] = deque()
        self._draining = False  # close(): deliver what is queued, then stop
        self._stopped = False  # unsubscribe(): stop now, drop what is queued
        self.delivered_events = 0
        self.dropped_events = 0
        self.overflows = 0
        self.resyncs = 0  # Resync deliveries (after overflows and failed callbacks)
        self.errors = 0  # callbacks that raised
        self._thread = threading.Thread(target=self._deliver_loop, name=f"strata-events-{name}", daemon=True)

    @property
    def pending(self) -> int:
        return len(self._queue)

    def unsubscribe(self, timeout: float = 5.0) -> None:
        """Stop delivering; queued events are dropped. Waits for a callback in progress
        (unless called from that callback)."""
        self._bus._forget(self)
        with self._cond:
            self._stopped = True
            self._queue.clear()
            self._cond.notify()
        self._join(timeout)

    # ---- publisher side (any thread, maybe under the store lock) ----

    def _offer(self, events: Sequence[Delivery]) -> None:
        with self._cond:
            if self._stopped or self._draining:
                return
            q = self._queue
            was_empty = not q
            if len(q) + len(events) > self.queue_events:
                self.dropped_events += sum(1 for e in q if not isinstance(e, Resync)) + len(events)
                self.overflows += 1
                q.clear()
                q.append(_RESYNC)
            else:
                q.extend(events)
            # The delivery thread waits untimed on an empty queue and lingers on a short one:
            # wake it for the first event, and again once a batch is full.
            if was_empty or len(q) >= self.batch_events or q[0] is _RESYNC:
                self._cond.notify()

    # ---- delivery thread ----

    def _start(self) -> None:
        self._thread.start()

    def _join(self, timeout: float) -> None:
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("store-event subscriber %r is still in its callback after %.1fs", self.name, timeout)

    def _drain(self) -> None:
        with self._cond:
            self._draining = True
            self._cond.notify()

    def _next_batch(self) -> list[Delivery] | None:
        with self._cond:
            while not self._queue and not self._stopped and not self._draining:
                self._cond.wait()
            if self.linger_s and not self._stopped and not self._draining and self._queue[0] is not _RESYNC:
                until = time.monotonic() + self.linger_s
                while len(self._queue) < self.batch_events and not self._stopped and not self._draining:
                    left = until - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            q = self._queue
            if self._stopped or not q:
                return None
            if isinstance(q[0], Resync):
                return [q.popleft()]
            batch = []
            while q and len(batch) < self.batch_events and not isinstance(q[0], Resync):
                batch.append(q.popleft())
            return batch

    def _deliver_loop(self) -> None:
        while (batch := self._next_batch()) is not None:
            resync = isinstance(batch[0], Resync)
            try:
                self._callback(batch)
            # A subscriber is third-party code to the bus: whatever it raises is its own
            # failure, reported under its name; it must not end delivery to it or anyone.
            except Exception:  # noqa: BLE001
                self.errors += 1
                log.exception("store-event subscriber %r failed on a batch of %d events", self.name, len(batch))
                if not resync:
                    with self._cond:
                        if not self._stopped and (not self._queue or not isinstance(self._queue[0], Resync)):
                            self._queue.appendleft(_RESYNC)
            else:
                if not resync:
                    self.delivered_events += len(batch)
            if resync:
                self.resyncs += 1


class EventBus:
    """Fans store events out to subscribers; see the module docstring for the rules."""

    def __init__(
        self, *, queue_events: int = DEFAULT_QUEUE_EVENTS, batch_events: int = DEFAULT_BATCH_EVENTS,
        linger_s: float = DEFAULT_LINGER_S,
    ) -> None:
        _check_limits(queue_events, batch_events)
        if not 0 <= linger_s <= 1:
            raise ValueError(f"linger_s is {linger_s}: give 0 (deliver at once) to 1 second")
        self._queue_events = queue_events
        self._batch_events = batch_events
        self._linger_s = linger_s
        self._lock = threading.Lock()  # guards subscribe/unsubscribe; publish reads a snapshot
        self._subs: tuple[Subscription, ...] = ()
        self._closed = False

    def subscribe(
        self,
        name: str,
        callback: Callback,
        *,
        queue_events: int | None = None,
        batch_events: int | None = None,
        resync_first: bool = False,
    ) -> Subscription:
        """Deliver every event published from now on to ``callback``, in batches, in order.

        ``name`` labels logs and metrics: a fixed word per subscriber ("index",
        "metrics"), never a key or an id. ``resync_first`` makes the first
        delivery ``[Resync()]``, for a subscriber that joins a store that
        already holds blocks.
        """
        queue_events = self._queue_events if queue_events is None else queue_events
        batch_events = self._batch_events if batch_events is None else batch_events
        _check_limits(queue_events, batch_events)
        if not name or len(name) > MAX_NAME_CHARS:
            raise ValueError(f"subscriber name {name!r}: give a short fixed word (1 to {MAX_NAME_CHARS} characters)")
        with self._lock:
            if self._closed:
                raise RuntimeError("the store-event bus is closed: subscribe before the store stops")
            if any(s.name == name for s in self._subs):
                raise ValueError(f"a store-event subscriber named {name!r} exists already: pick another name")
            if len(self._subs) >= MAX_SUBSCRIBERS:
                raise ValueError(f"the store-event bus has {MAX_SUBSCRIBERS} subscribers, its limit")
            sub = Subscription(self, name, callback, queue_events, batch_events, self._linger_s)
            if resync_first:
                sub._queue.append(_RESYNC)
            sub._start()
            self._subs = (*self._subs, sub)
        return sub

    def publish(self, event: Delivery) -> None:
        """Queue one event for every subscriber. Never blocks on a subscriber, never raises."""
        for sub in self._subs:
            sub._offer((event,))

    def publish_all(self, events: Sequence[Delivery]) -> None:
        """Queue a batch (one queue operation per subscriber): for a store that collects
        what changed under its lock and publishes after releasing it."""
        if events:
            for sub in self._subs:
                sub._offer(events)

    def subscriptions(self) -> tuple[Subscription, ...]:
        return self._subs

    def close(self, timeout: float = 5.0) -> None:
        """Deliver what is queued, stop every delivery thread; later publishes are ignored."""
        with self._lock:
            self._closed = True
            subs, self._subs = self._subs, ()
        for sub in subs:
            sub._drain()
        for sub in subs:
            sub._join(timeout)

    def _forget(self, sub: Subscription) -> None:
        with self._lock:
            self._subs = tuple(s for s in self._subs if s is not sub)


def _check_limits(queue_events: int, batch_events: int) -> None:
    if queue_events < 1 or batch_events < 1:
        raise ValueError(f"queue_events ({queue_events}) and batch_events ({batch_events}) must be at least 1")


__all__ = [
    "BlockEvent", "Callback", "Delivery", "EventBus", "Evicted", "Moved", "Removed", "Resync",
    "Stored", "Subscription",
]
