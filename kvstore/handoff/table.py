"""The prefill side: the handoffs open on this daemon, each a lease on a request's blocks.

Opening a handoff takes a store lease of kind ``handoff`` on the blocks
(:meth:`~kvstore.store.tiered.TieredStore.lease`): they cannot be evicted
while it lasts. The handoff id handed out is random (128 bits, URL-safe)
and is the only capability the decode side needs; it is bound to its
namespace, so an id presented with another namespace reads as one never
issued. The lease is the one source of truth for time: a heartbeat extends
it (never beyond ``max_total_s`` after the open), completion ends it, and
when it runs out the store's reaper ends it, whatever this table does. The
table only keeps the bookkeeping in step (its sweep, every
``SWEEP_S``): the expired count, and why an id no longer works.

Limits: ``max_open`` handoffs at once (beyond it RESOURCE_EXHAUSTED with a
retry delay), ``max_blocks`` per handoff, ``max_lease_s`` per lease asked.
Thread-safe.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.errors import (
    HandoffEnded, InvalidArgument, LeaseError, Overloaded, UnknownHandoff,
)
from kvstore.handoff.metrics import HandoffMetrics
from kvstore.handoff.params import HandoffBlock, HandoffParams
from kvstore.shares import Shares
from kvstore.store.leases import LeaseKind

log = logging.getLogger(__name__)

HANDOFF = LeaseKind("handoff")
SWEEP_S = 0.1
MAX_REMEMBERED = 4096  # ended ids kept to say "completed" or "expired" rather than "unknown"


@dataclass(frozen=True, slots=True)
class HandoffLimits:
    lease_s: float = 30.0
    max_lease_s: float = 120.0
    max_total_s: float = 600.0
    max_open: int = 256
    max_blocks: int = 4096
    max_open_per_identity: int = 64


@dataclass(slots=True)
class _Open:
    handoff_id: str
    namespace: str
    lease_id: int
    keys: list[bytes]
    keep_as_cache: bool
    lease_s: float
    deadline: float  # time.monotonic(), as the store's lease
    last_deadline: float  # opened + max_total_s: heartbeats stop there
    owner: str = ""  # who opened it: its share (kvstore.shares) is given back when it ends


def _unix_ms(deadline: float) -> int:
    return int((time.time() + (deadline - time.monotonic())) * 1000)


class HandoffTable:
    """``store``: a :class:`~kvstore.store.group.StoreGroup` (lease, extend_lease, end_lease, delete, exists).
    ``describe``: the node's id, epoch, data-plane addresses and gRPC address, read at each open."""

    def __init__(self, store, describe: Callable[[], tuple[str, int, list[str], str]], limits: HandoffLimits,
                 metrics: HandoffMetrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._describe = describe
        self.limits = limits
        self.metrics = metrics or HandoffMetrics()
        self._clock = clock
        self._lock = threading.Lock()
        self._open: dict[str, _Open] = {}
        self._shares = Shares(min(limits.max_open_per_identity, limits.max_open), "open handoffs",
                              "--handoff-max-open-per-identity", retry_after_s=0.1)
        self._ended: OrderedDict[str, str] = OrderedDict()  # id -> "completed" | "expired"
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="strata-handoff-sweep", daemon=True)

    def start(self) -> HandoffTable:
        self._sweeper.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    # ---- the RPCs' work -----------------------------------------------------------

    def open(self, namespace: str, keys: list[bytes], lease_s: float | None, keep_as_cache: bool,
             owner: str = "") -> tuple[HandoffParams, list[bytes]]:
        """``owner``: who opens it (:func:`kvstore.auth.owner_of`); it holds one of its share of
        open handoffs until the handoff completes or expires."""
        lim = self.limits
        if not keys:
            raise InvalidArgument("a handoff needs at least one key: name the request's blocks")
        if len(keys) > lim.max_blocks:
            raise InvalidArgument(
                f"{len(keys)} blocks in one handoff; this daemon takes at most {lim.max_blocks} "
                "(--handoff-max-blocks): split the request's blocks over several handoffs"
            )
        lease_s = lease_s or lim.lease_s
        if lease_s > lim.max_lease_s:
            raise InvalidArgument(
                f"a handoff lease of {lease_s:g}s is longer than this daemon allows ({lim.max_lease_s:g}s, "
                "--handoff-max-lease-seconds): ask for less; the decode side's heartbeats extend it"
            )
        with self._lock:
            if len(self._open) >= lim.max_open:
                raise Overloaded(
                    f"{len(self._open)} handoffs are open, the limit (--handoff-max-open) is {lim.max_open}: "
                    "retry after the delay, or complete handoffs sooner", retry_after_s=0.1,
                )
            self._shares.take(owner)
            try:
                lease, missing = self._store.lease(namespace, list(keys), HANDOFF, lease_s)
            except BaseException:
                self._shares.give(owner)
                raise
            handoff_id = secrets.token_urlsafe(16)
            now = self._clock()
            held = [k.key for k in lease.keys]
            self._open[handoff_id] = _Open(handoff_id, namespace, lease.id, held, keep_as_cache, lease_s,
                                           lease.deadline, now + lim.max_total_s, owner)
        self.metrics.opened()
        blocks = []
        for key in held:
            found = self._store.meta(namespace, key)
            if found is not None:
                blocks.append(HandoffBlock(key, found))
        node_id, epoch, addresses, control = self._describe()
        params = HandoffParams(handoff_id, namespace, node_id, epoch, tuple(addresses), control, tuple(blocks),
                               _unix_ms(lease.deadline), int(lease_s * 1000))
        log.debug("handoff %s opened: %d blocks of %s held for %.1fs", handoff_id[:8], len(held), namespace, lease_s)
        return params, missing

    def heartbeat(self, namespace: str, handoff_id: str) -> int:
        """Extend the lease by its length again (up to the handoff's maximum total); the new deadline (unix ms)."""
        with self._lock:
            h = self._live(namespace, handoff_id)
            want = min(self._clock() + h.lease_s, h.last_deadline)
            try:
                h.deadline = self._store.extend_lease(h.lease_id, HANDOFF, max(0.0, want - self._clock()))
            except LeaseError:
                self._end_locked(h, "expired")
                raise self._ended_error(handoff_id, "expired") from None
            return _unix_ms(h.deadline)

    def complete(self, namespace: str, handoff_id: str) -> tuple[int, int]:
        """End the handoff: its lease ends; its blocks are deleted or kept as cache. (deleted, kept)."""
        with self._lock:
            h = self._live(namespace, handoff_id)
            ended = self._store.end_lease(h.lease_id, HANDOFF)
            if not ended:  # the reaper was first
                self._end_locked(h, "expired")
                raise self._ended_error(handoff_id, "expired")
            self._end_locked(h, "completed")
        if h.keep_as_cache:
            return 0, len(h.keys)
        return self._store.delete(namespace, h.keys), 0

    # ---- bookkeeping -----------------------------------------------------------------

    def _live(self, namespace: str, handoff_id: str) -> _Open:
        h = self._open.get(handoff_id)
        if h is None or h.namespace != namespace:
            why = self._ended.get(handoff_id) if h is None else None
            if why is not None:
                raise self._ended_error(handoff_id, why)
            raise UnknownHandoff(
                f"no handoff {handoff_id[:8]}… in namespace {namespace!r} on this daemon: it was never issued "
                "here (the prefill daemon may have restarted); open a new handoff"
            )
        if h.deadline <= self._clock():
            self._end_locked(h, "expired")
            raise self._ended_error(handoff_id, "expired")
        return h

    @staticmethod
    def _ended_error(handoff_id: str, why: str) -> HandoffEnded:
        if why == "completed":
            return HandoffEnded(f"handoff {handoff_id[:8]}… was already completed: its blocks were released")
        return HandoffEnded(
            f"handoff {handoff_id[:8]}… expired: its lease ran out before the decode side completed it and its "
            "blocks were released; open a new handoff (heartbeat sooner, or ask for a longer lease_ms)"
        )

    def _end_locked(self, h: _Open, why: str) -> None:
        if self._open.pop(h.handoff_id, None) is None:
            return
        self._shares.give(h.owner)
        self._ended[h.handoff_id] = why
        while len(self._ended) > MAX_REMEMBERED:
            self._ended.popitem(last=False)
        self.metrics.ended(why)
        if why == "expired":
            log.info("handoff %s expired: its %d blocks of %s are no longer held", h.handoff_id[:8], len(h.keys),
                     h.namespace)

    def open_in(self, namespace: str) -> int:
        """Handoffs open in ``namespace``: what Stats shows an identity that is not the node's admin."""
        with self._lock:
            return sum(1 for h in self._open.values() if h.namespace == namespace)

    def sweep(self) -> int:
        """Count handoffs whose lease ran out (the store's reaper ended the lease); how many."""
        now = self._clock()
        with self._lock:
            gone = [h for h in self._open.values() if h.deadline <= now]
            for h in gone:
                self._store.end_lease(h.lease_id, HANDOFF)  # False: the reaper already did
                self._end_locked(h, "expired")
        return len(gone)

    def _sweep_loop(self) -> None:
        while not self._stop.wait(SWEEP_S):
            self.sweep()
