"""Pinned copies: a pin that asks for k copies gets them, held on k - 1 other live nodes for its lease.

A Pin with ``replicas`` = k > 1 (KVService ``Pin``) is recorded here by the
daemon that took it, and that daemon keeps its copies. Why the pinning
daemon, and not the smallest-id holder that decides for replicated
namespaces: the pin is a lease on this daemon, so only this daemon knows
when it ends (Unpin, expiry) and can end the copies with it; the demand
never has to travel through the index or outlive its owner. The cost: a
pinning daemon that dies takes its pin with it (a client's lease id names
nothing after a restart), and the copies it had placed stay pinned until
the pin's deadline, then become cache.

Placement is per pin, not per block: the copies of one pinned prefix go to
the same k - 1 nodes, so each of them holds the whole prefix and can serve
it alone. The nodes are chosen among the live nodes with a writable peer
transport, those already holding most of the prefix first (no bytes to
move), then by rendezvous hash of the prefix's head key (spread, and the
same choice after a restart of the pinner). A chosen node stays chosen
while it lives at the same epoch and answers; it is replaced when it dies
(its heartbeats lapse in the index), restarts (a new epoch: its holds died
with it), or refuses a push or a hold (it is backed off and another is
taken).

At each chosen node the pinner asks for a *hold* (the peer data plane's
HOLD: a lease of kind ``replica`` there, bound to this node's principal,
for what is left of the pin's lease): first for the blocks the index says
it holds, then, for the others, after pushing their bytes (one block per
write, within the round's byte budget). A hold the peer grants for less
than the pin lasts is asked again shortly before it ends. A held block
the index stops showing at that node (for longer than ``settle_s``, the
time its agent takes to publish) is pushed and held again there.

Ending. Unpin ends the pin here at once; its holds are released (RELEASE)
in the next round, best effort, and end by themselves at the pin's
deadline when a release does not get through. An expired pin is simply
dropped: its holds end at the same time. Released or expired, the copies
stay where they are as ordinary cache, evictable like any other block.

Trimming. At most k copies are kept deliberately: this node's pinned one
and one held copy at each of at most k - 1 chosen nodes. A node dropped
from the choice while it still answers (it was backed off, another was
taken) has its holds released. Every hold this node keeps covers at least
one block it counts as held there; one that covers none any more is
released. Copies beyond k that exist anyway (peer reads, namespace
replication, an earlier pin) are not deleted: they are unpinned cache.

Limits: ``max_pin_replicas`` (a Pin asking more is refused: bad input),
``max_pins`` recorded at once (one more is ``Overloaded``), the round's
``blocks_per_round`` blocks checked and ``bytes_per_round`` pushed (pins
first, then namespaces), one push or hold in flight, ``push_s`` each, a
failing node backed off ``backoff_s`` (:mod:`kvstore.replication.pusher`), at
most :data:`MAX_RELEASE_TRIES` tries per release. A k beyond the live
nodes that can take a copy is reported under-replicated, round after
round, and costs nothing: no node to push to, no push tried.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from kvstore.block import BlockKey
from kvstore.replication.pusher import Pusher, rank
from kvstore.errors import InvalidArgument, Overloaded, StrataError
from kvstore.index.base import NodeInfo

log = logging.getLogger(__name__)

MAX_RELEASE_TRIES = 3
RELEASES_PER_ROUND = 64  # release calls one round makes at most; the rest wait for the next
RENEW_SLACK_S = 1.0  # a hold ending this close to the pin's deadline is not asked again

HoldersOf = Callable[[str, list[bytes]], Awaitable[list[set[str]]]]


@dataclass(frozen=True, slots=True)
class PinLimits:
    max_replicas: int = 4
    max_pins: int = 4096
    blocks_per_round: int = 256
    settle_s: float = 5.0  # a held block counts while the index has not shown it yet, this long
    renew_s: float = 3.0  # a hold that ends before the pin does is asked again this long before its end

    def __post_init__(self) -> None:
        if self.max_replicas < 1 or self.max_pins < 1 or self.blocks_per_round < 1:
            raise InvalidArgument("pin copy limits: max_replicas, max_pins and blocks_per_round must be at least 1")


@dataclass
class _Placement:
    """One chosen node of a pin: what this node holds there, under which of its leases."""

    node_id: str
    epoch: int
    held: dict[bytes, tuple[int, float]] = field(default_factory=dict)  # key -> (lease id, held at)
    leases: dict[int, float] = field(default_factory=dict)  # lease id there -> its end (this node's clock)


@dataclass
class _Pin:
    lease_id: int
    namespace: str
    keys: tuple[bytes, ...]
    k: int
    deadline: float  # this node's monotonic clock, as the store's lease
    placements: dict[str, _Placement] = field(default_factory=dict)
    under: int = 0  # keys with fewer than k copies at the latest check (before one: all)
    copies: int = 0  # copies held on other nodes at the latest check


@dataclass(frozen=True, slots=True)
class _Release:
    node_id: str
    epoch: int
    lease_ids: tuple[int, ...]
    until: float  # they end by themselves then
    tries: int = 0


@dataclass
class PinNamespaceReport:
    """This node's pins that ask for copies, in one namespace."""

    namespace: str
    pins: int = 0
    replicas: int = 0  # the largest k they ask for
    blocks: int = 0  # blocks they pin here
    under_replicated: int = 0  # of them, with fewer than k copies on distinct live nodes at their latest check
    copies_held: int = 0  # copies held (pinned) on other nodes for them
    copies_made: int = 0  # blocks pushed for pins in this namespace (since start)
    copies_failed: int = 0


class PinCopies:
    """Thread-safe to :meth:`add`, :meth:`end` and :meth:`report` from anywhere; the replicator's loop runs :meth:`round`."""

    def __init__(self, store, node_id: str, pusher: Pusher, limits: PinLimits, metrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self.node_id = node_id
        self._pusher = pusher
        self.limits = limits
        self._metrics = metrics
        self._clock = clock
        self._lock = threading.Lock()
        self._pins: dict[int, _Pin] = {}
        self._ended: list[_Pin] = []  # unpinned since the last round: their holds are to be released
        self._releases: list[_Release] = []
        self._made: Counter[str] = Counter()
        self._failed: Counter[str] = Counter()
        self._cursor = 0

    # ---- the Pin RPC's side (any thread) ------------------------------------------

    def check(self, k: int) -> None:
        """Refuse a k this daemon does not keep, or one pin too many, before the store pins anything."""
        if not 1 <= k <= self.limits.max_replicas:
            raise InvalidArgument(
                f"a pin asks for {k} replicas; this daemon keeps 1 to {self.limits.max_replicas} copies of a pin "
                "([replication] max_pin_replicas): ask for fewer, or raise the setting"
            )
        with self._lock:
            if len(self._pins) >= self.limits.max_pins:
                raise Overloaded(
                    f"{len(self._pins)} pins with replicas are kept, the limit ([replication] max_replicated_pins) "
                    f"is {self.limits.max_pins}: unpin what you no longer need, or retry shortly", retry_after_s=1.0,
                )

    def add(self, lease_id: int, namespace: str, keys: Sequence[bytes], k: int, deadline: float) -> None:
        """Keep k copies of the pinned ``keys`` until ``deadline`` (the pin's, on this node's monotonic clock)."""
        self.check(k)
        if k < 2 or not keys:
            return
        with self._lock:
            self._pins[lease_id] = _Pin(lease_id, namespace, tuple(keys), k, deadline, under=len(keys))

    def end(self, lease_id: int) -> None:
        """The pin ended (Unpin): its holds are released in the next round."""
        with self._lock:
            pin = self._pins.pop(lease_id, None)
            if pin is not None:
                self._ended.append(pin)

    # ---- the replicator's rounds (its loop) ------------------------------------------

    def busy(self) -> bool:
        """Whether a round has anything to do (a pin to keep, holds to release)."""
        with self._lock:
            return bool(self._pins or self._ended or self._releases)

    async def round(self, live: dict[str, NodeInfo], holders_of: HoldersOf, budget: int,
                    pushed_any: bool) -> tuple[int, bool]:
        """Release what ended, then keep the pins' copies (up to ``blocks_per_round`` blocks checked);
        returns (bytes pushed, whether any block was pushed this round)."""
        now = self._clock()
        with self._lock:
            for pin in [p for p in self._pins.values() if p.deadline <= now]:
                del self._pins[pin.lease_id]  # expired: its holds end now too
            ended, self._ended = self._ended, []
            for pin in ended:
                for placement in pin.placements.values():
                    self._release_locked(placement, list(placement.leases))
            pins = list(self._pins.values())
        await self._send_releases(live, now)
        spent, checked = 0, 0
        if pins:
            self._cursor %= len(pins)
            order = pins[self._cursor:] + pins[: self._cursor]
            for pin in order:
                if checked >= self.limits.blocks_per_round:
                    break
                checked += len(pin.keys)
                self._cursor += 1
                used, pushed_any = await self._keep(pin, live, holders_of, budget - spent, pushed_any)
                spent += used
        self._publish()
        return spent, pushed_any

    async def _keep(self, pin: _Pin, live: dict[str, NodeInfo], holders_of: HoldersOf, budget: int,
                    pushed_any: bool) -> tuple[int, bool]:
        holders = await holders_of(pin.namespace, list(pin.keys))
        now = self._clock()
        self._revise(pin, live, holders, now)
        self._choose(pin, live, holders, now)
        spent = 0
        for placement in list(pin.placements.values()):
            missing = [i for i, key in enumerate(pin.keys) if key not in placement.held]
            if not missing:
                continue
            node = live[placement.node_id]
            there = [pin.keys[i] for i in missing if placement.node_id in holders[i]]
            if there and not await self._hold(pin, placement, node, there):
                continue
            pushed: list[bytes] = []
            failed = False
            for key in (pin.keys[i] for i in missing if pin.keys[i] not in placement.held):
                if pushed_any and spent >= budget:
                    break  # the round's byte budget is spent; the next round goes on
                found = await asyncio.get_running_loop().run_in_executor(
                    None, lambda key=key: self._store.get(BlockKey(pin.namespace, key), local_only=True)
                )
                if found is None:
                    continue  # no longer here (deleted): nothing to copy
                data, meta, _ = found
                if pushed_any and meta.size > budget - spent:
                    break  # a block larger than what is left goes first in a later round
                ok, _why = await self._pusher.write(node, pin.namespace, key, data, meta)
                spent += meta.size
                pushed_any = True
                self._count(pin.namespace, ok, meta.size)
                if not ok:
                    failed = True
                    break
                pushed.append(key)
            if pushed:
                await self._hold(pin, placement, node, pushed)
            if failed:
                self._drop(pin, placement)
        self._tally(pin)
        return spent, pushed_any

    def _revise(self, pin: _Pin, live: dict[str, NodeInfo], holders: list[set[str]], now: float) -> None:
        """Forget chosen nodes that died or restarted, blocks lost there, holds about to end."""
        for node_id, placement in list(pin.placements.items()):
            node = live.get(node_id)
            if node is None or node.epoch != placement.epoch:
                del pin.placements[node_id]  # dead (its holds end at their deadline) or restarted (they died)
                continue
            ending = {lease for lease, until in placement.leases.items()
                      if until - now <= self.limits.renew_s and until < pin.deadline - RENEW_SLACK_S}
            for i, key in enumerate(pin.keys):
                held = placement.held.get(key)
                if held is None:
                    continue
                lease, at = held
                if lease in ending or (node_id not in holders[i] and now - at >= self.limits.settle_s):
                    del placement.held[key]
            self._release_uncovered(placement)

    def _choose(self, pin: _Pin, live: dict[str, NodeInfo], holders: list[set[str]], now: float) -> None:
        """Fill the pin's choice up to k - 1 nodes: holders of most of the prefix first, then rendezvous order."""
        need = pin.k - 1 - len(pin.placements)
        if need <= 0:
            return
        candidates = [n for n, node in live.items()
                      if n != self.node_id and n not in pin.placements and self._pusher.usable(node, now)]
        if not candidates:
            return
        have = Counter(n for held in holders for n in held)
        head = pin.namespace.encode() + b"\0" + pin.keys[0]
        for node_id in sorted(rank(head, candidates), key=lambda n: -have[n])[:need]:
            pin.placements[node_id] = _Placement(node_id, live[node_id].epoch)

    async def _hold(self, pin: _Pin, placement: _Placement, node: NodeInfo, keys: list[bytes]) -> bool:
        """Hold ``keys`` at the placement's node for what is left of the pin; False (and the node
        dropped from the choice) when it refused or could not be reached."""
        left = pin.deadline - self._clock()
        if left <= 0:
            return False
        try:
            answer = await self._pusher.hold(node, pin.namespace, keys, left)
        except StrataError:
            self._drop(pin, placement)
            return False
        if answer.lease_id:
            now = self._clock()
            placement.leases[answer.lease_id] = now + answer.lease_s
            for key, held in zip(keys, answer.held):
                if held:
                    placement.held[key] = (answer.lease_id, now)
        return True

    def _drop(self, pin: _Pin, placement: _Placement) -> None:
        """Take a node out of the pin's choice; what it holds for the pin is released."""
        pin.placements.pop(placement.node_id, None)
        with self._lock:
            self._release_locked(placement, list(placement.leases))

    def _release_uncovered(self, placement: _Placement) -> None:
        covering = {lease for lease, _ in placement.held.values()}
        stale = [lease for lease in placement.leases if lease not in covering]
        if stale:
            with self._lock:
                self._release_locked(placement, stale)

    def _release_locked(self, placement: _Placement, leases: list[int]) -> None:
        if not leases:
            return
        until = max(placement.leases[lease] for lease in leases)
        for lease in leases:
            del placement.leases[lease]
        self._releases.append(_Release(placement.node_id, placement.epoch, tuple(leases), until))

    async def _send_releases(self, live: dict[str, NodeInfo], now: float) -> None:
        with self._lock:
            pending, self._releases = self._releases, []
        keep: list[_Release] = []
        for i, release in enumerate(pending):
            node = live.get(release.node_id)
            if release.until <= now or node is None or node.epoch != release.epoch:
                continue  # ended by itself, or went with the node
            if i >= RELEASES_PER_ROUND:
                keep.append(release)
                continue
            try:
                await self._pusher.release(node, release.lease_ids)
            except StrataError as err:
                if release.tries + 1 < MAX_RELEASE_TRIES:
                    keep.append(_Release(release.node_id, release.epoch, release.lease_ids, release.until,
                                         release.tries + 1))
                else:
                    log.warning("could not release %d holds at %s (%s): they end by themselves in %.0fs",
                                len(release.lease_ids), release.node_id, err, release.until - now)
        with self._lock:
            self._releases = keep + self._releases

    # ---- counting ---------------------------------------------------------------------

    def _count(self, namespace: str, ok: bool, size: int) -> None:
        self._metrics.copies.labels("made" if ok else "failed").inc()
        if ok:
            self._metrics.pushed_bytes.inc(size)
        with self._lock:
            (self._made if ok else self._failed)[namespace] += 1

    def _tally(self, pin: _Pin) -> None:
        copies = [1 + sum(key in p.held for p in pin.placements.values()) for key in pin.keys]
        with self._lock:
            pin.under = sum(c < pin.k for c in copies)
            pin.copies = sum(copies) - len(copies)

    def _publish(self) -> None:
        with self._lock:
            under = sum(p.under for p in self._pins.values())
            held = sum(p.copies for p in self._pins.values())
        self._metrics.pinned_under.set(under)
        self._metrics.pinned_copies.set(held)

    def under_replicated(self) -> int:
        with self._lock:
            return sum(p.under for p in self._pins.values())

    def report(self) -> list[PinNamespaceReport]:
        with self._lock:
            out: dict[str, PinNamespaceReport] = {}
            for pin in self._pins.values():
                r = out.setdefault(pin.namespace, PinNamespaceReport(pin.namespace))
                r.pins += 1
                r.replicas = max(r.replicas, pin.k)
                r.blocks += len(pin.keys)
                r.under_replicated += pin.under
                r.copies_held += pin.copies
            for namespace in set(self._made) | set(self._failed):
                r = out.setdefault(namespace, PinNamespaceReport(namespace))
                r.copies_made, r.copies_failed = self._made[namespace], self._failed[namespace]
            return [out[n] for n in sorted(out)]
