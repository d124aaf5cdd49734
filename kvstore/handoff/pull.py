"""The decode side: pull a handoff's blocks into this daemon's arena, store them, publish, complete.

:class:`HandoffPuller` runs in the gRPC worker thread of a PullHandoff:

1. checks the params against this daemon's limits (blocks per handoff,
   block size, pulls at once: beyond ``max_pulls`` RESOURCE_EXHAUSTED);
2. opens a writer per block not held here yet
   (:meth:`~kvstore.store.group.StoreGroup.open_write`): an extent reserved
   in the head, so the bytes land in the arena slot that will hold the
   block, with no buffer in between;
3. reads them over the best data plane both sides have (:meth:`routes`):
   this daemon's transports in its order of preference
   (``--handoff-transports``, tcp then grpc by default), each taken where
   the params offer an address of its scheme (the prefill daemon's TCP
   peer listener, ``--peer-listen``; its UCX one; its gRPC service, which
   every daemon has). The peer client lands each block straight in its
   writer's extent and verifies its checksum there (``recv_into`` over TCP
   and UCX, a copy per gRPC message); a block whose size or checksum is not
   the one the params announced is refused before its bytes move;
4. **falls back** to the next route when one cannot be reached, or breaks
   off mid-pull (``TierUnavailable``): the keys it had not delivered are
   read again over the next, the verified ones stay, and the pull keeps to
   that route for its remaining batches
   (``strata_handoff_pull_fallbacks_total`` by the transport left). A
   corrupt block, a deadline or the prefill side's refusal is not a reason
   to fall back: the pull fails, as it would over any route;
5. while it reads, heartbeats the prefill daemon every third of the lease,
   so a long pull keeps its blocks held; a heartbeat refused as ended
   (expired) cancels the read at once;
6. commits each writer (its bytes were verified as they landed in the
   extent: a corrupt byte is never stored) or, on any failure, aborts them
   all: nothing of a failed pull is stored;
7. publishes this node as a holder of the blocks in the index before it
   answers (``publish``), so the decode node is a holder when PullHandoff
   returns, then completes the handoff at the prefill daemon.

Where the prefill side is, and over what, comes from this daemon's prefix
index, never from the caller: the params name the prefill node (``node_id``,
``epoch``), and the node's index record gives its gRPC address and
data-plane endpoints. The params' own ``addresses`` and ``control_address``
are not used to connect. A pull authenticates with this daemon's peer token,
so an address the caller chose would hand that token (and every tenant's
blocks with it) to whoever listens there, and would make PullHandoff a port
scanner. A node the index does not know as live, or knows at another epoch,
is refused before anything is connected to.

What the prefill side is called with (HeartbeatHandoff, CompleteHandoff)
goes to its gRPC address with this daemon's peer token.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.block import BlockKey, BlockMeta, TierName
from kvstore.errors import (
    CorruptBlock, DeadlineExceeded, HandoffEnded, InvalidArgument, Overloaded, StrataError, TierUnavailable,
    UnknownHandoff,
)
from kvstore.handoff.metrics import HandoffMetrics
from kvstore.handoff.params import HandoffParams
from kvstore.peer.directory import PeerDirectory
from kvstore.remote.base import ReadStatus
from kvstore.shares import Shares

if TYPE_CHECKING:  # the settings import this module's limits; they never load the index
    from kvstore.index.base import NodeInfo

log = logging.getLogger(__name__)

BATCH_BLOCKS = 64
BATCH_BYTES = 128 << 20  # within the prefill listener's per-request limit (--peer-connection-in-flight-bytes)
MIN_HEARTBEAT_S = 0.05


@dataclass(frozen=True, slots=True)
class PullLimits:
    max_pulls: int = 8
    max_blocks: int = 4096
    max_block_bytes: int = 64 << 20
    pull_s: float = 120.0
    max_pulls_per_identity: int = 4


@dataclass(frozen=True, slots=True)
class PullResult:
    stored: int
    present: int
    pulled_bytes: int
    completed: bool
    complete_error: str
    published: bool


class HandoffPuller:
    """``store``: the StoreGroup; ``peers``: scheme -> a blocking peer client
    (:func:`kvstore.peer.registry.open_peer_client`, with the peer token), in this daemon's order of
    preference; ``control(address)``: a client of the prefill daemon's gRPC with
    ``heartbeat_handoff`` and ``complete_handoff`` (the caller closes it); ``publish(namespace,
    [(key, tier)], timeout_s)``: adds this node's holdings to the index now, True when the index
    took them; ``resolve(node_id, timeout_s)``: the index's record of a node (None when the index
    does not know it), where the prefill side is reached."""

    def __init__(self, store, peers: Mapping[str, object], control: Callable,
                 publish: Callable[[str, list, float], bool], limits: PullLimits,
                 resolve: Callable[[str, float], NodeInfo | None],
                 metrics: HandoffMetrics | None = None) -> None:
        if not peers:
            raise InvalidArgument("a handoff puller needs at least one peer transport (e.g. tcp, grpc)")
        self._store = store
        self._peers = dict(peers)
        # Only its order of schemes: a pull falls back over every route itself, with no back-off.
        self._directory = PeerDirectory(list(self._peers), backoff_s=0, what="handoff pull")
        self._control = control
        self._publish = publish
        self._resolve = resolve
        self.limits = limits
        self.metrics = metrics or HandoffMetrics()
        self._slots = threading.BoundedSemaphore(limits.max_pulls)
        self._shares = Shares(min(limits.max_pulls_per_identity, limits.max_pulls), "pulls",
                              "--handoff-max-pulls-per-identity")

    @property
    def transports(self) -> list[str]:
        """The schemes this daemon pulls over, preferred first."""
        return list(self._peers)

    def routes(self, node: NodeInfo) -> list[tuple[str, str]]:
        """(scheme, address) of every transport both sides have: this daemon's order, each with the
        first endpoint of its scheme the prefill node's index record advertises."""
        return [(r.scheme, r.address) for r in self._directory.routes(node)]

    def prefill_node(self, params: HandoffParams, timeout_s: float) -> NodeInfo:
        """The index's record of the node the params name, alive and at the params' epoch."""
        node = self._resolve(params.node_id, timeout_s)
        if node is None:
            raise InvalidArgument(
                f"the handoff names prefill node {params.node_id!r}, which this daemon's prefix index does not "
                "know: a handoff is pulled only from nodes of the index (start both daemons with the same "
                "--index-url), never from an address the caller gives"
            )
        if not node.alive or node.epoch != params.epoch:
            raise HandoffEnded(
                f"prefill node {params.node_id} is {'not alive' if not node.alive else 'at another epoch'} in the "
                f"index (epoch {node.epoch}, the handoff's {params.epoch}): it stopped or restarted since it opened "
                "the handoff, which ended there; nothing was stored"
            )
        if not node.address:
            raise InvalidArgument(f"prefill node {params.node_id} advertises no gRPC address in the index: "
                                  "nothing to pull from")
        return node

    def pull(self, params: HandoffParams, timeout_s: float | None = None,
             on_cancel: Callable[[Callable[[], None]], object] | None = None, owner: str = "") -> PullResult:
        """``timeout_s`` is capped at ``limits.pull_s`` (--handoff-pull-seconds): a caller cannot hold
        a pull slot longer. ``on_cancel(callback)``: registers what ends the pull at once when the
        caller goes away (a cancelled RPC's ``context.add_callback``), so its slot is given back then.
        ``owner``: who asks (:func:`kvstore.auth.owner_of`): no one runs more than its share of pulls."""
        self._check(params)
        self._shares.take(owner)
        if not self._slots.acquire(blocking=False):
            self._shares.give(owner)
            raise Overloaded(
                f"{self.limits.max_pulls} pulls are running on this daemon (--handoff-max-pulls): retry after "
                "the delay, or pull on another decode node", retry_after_s=0.2,
            )
        started = time.monotonic()
        self.metrics.running.inc()
        try:
            pull_s = min(timeout_s or self.limits.pull_s, self.limits.pull_s)
            result, by_transport = self._pull(params, started + pull_s, on_cancel)
        except BaseException:
            self.metrics.pull_failed()
            raise
        finally:
            self.metrics.running.dec()
            self._slots.release()
            self._shares.give(owner)
        self.metrics.pulled(by_transport, time.monotonic() - started)
        return result

    def _check(self, params: HandoffParams) -> None:
        lim = self.limits
        if len(params.blocks) > lim.max_blocks:
            raise InvalidArgument(
                f"the handoff names {len(params.blocks)} blocks; this daemon pulls at most {lim.max_blocks} "
                "(--handoff-max-blocks)"
            )
        for b in params.blocks:
            if not 0 < b.meta.size <= lim.max_block_bytes:
                raise InvalidArgument(
                    f"handoff block {b.key.hex()[:16]} is {b.meta.size} bytes, outside this daemon's limit of "
                    f"{lim.max_block_bytes} (--max-block-bytes)"
                )

    def _pull(self, params: HandoffParams, deadline_at: float,
              on_cancel: Callable[[Callable[[], None]], object] | None) -> tuple[PullResult, dict[str, int]]:
        from kvstore.transport.base import Deadline

        ns = params.namespace
        node = self.prefill_node(params, max(0.5, min(5.0, deadline_at - time.monotonic())))
        route = _Route(self.routes(node), params, self.metrics)
        if params.blocks and not route.left:
            raise InvalidArgument(
                f"prefill node {params.node_id} offers the data planes {list(node.transports)} and this daemon "
                f"pulls over {self.transports} (--handoff-transports): none in common; add grpc here, or "
                "start the prefill node with --peer-listen"
            )
        control = self._control(node.address)
        try:
            deadline = Deadline(deadline_at)
            if on_cancel is not None:
                on_cancel(deadline.cancel)
            beat = _Heartbeat(control, params, node.address, deadline)
            writers = []
            try:
                for b in params.blocks:
                    writers.append(self._store.open_write(BlockKey(ns, b.key), b.meta))
                wanted = [i for i, w in enumerate(writers) if not w.present]
                beat.start()
                try:
                    for batch in _batches(wanted, params):
                        self._read(route, params, writers, batch, deadline)
                except StrataError:
                    if beat.ended is not None:  # the heartbeat learned the handoff ended and cancelled the read
                        raise beat.ended from None
                    raise
                finally:
                    beat.stop()
                if beat.ended is not None:
                    raise beat.ended
                stored = []
                for i in wanted:
                    done, tier = writers[i].commit(deadline_at)
                    stored.append((params.blocks[i].key, tier))
            finally:
                for w in writers:
                    w.abort()  # a no-op for a committed writer
            present = len(params.blocks) - len(wanted)
            held = [(b.key, tier) for b, tier in zip(params.blocks, self._tiers(ns, params))]
            published = bool(held) and self._publish(ns, held, max(0.5, deadline_at - time.monotonic()))
            completed, why = True, ""
            try:  # bounded by the pull's deadline: a prefill daemon that stopped answering costs no more
                control.complete_handoff(ns, params.handoff_id, timeout=_call_s(deadline_at))
            except StrataError as err:
                completed, why = False, str(err)
                log.warning("handoff %s: pulled and stored, but the prefill node %s did not confirm the "
                            "completion (%s); its lease ends the handoff", params.handoff_id[:8], params.node_id, err)
            result = PullResult(len(stored), present, sum(params.blocks[i].meta.size for i in wanted), completed,
                                why, published)
            return result, dict(route.delivered)
        finally:
            control.close()

    def _tiers(self, ns: str, params: HandoffParams) -> list[TierName]:
        tiers = []
        for b in params.blocks:
            got = self._store.exists(ns, [b.key])
            tiers.append(got[0] if got else TierName.HOST)
        return tiers

    def _read(self, route: _Route, params: HandoffParams, writers, batch: list[int], deadline) -> None:
        """One batch over the current route; what it did not deliver, again over the next one."""
        todo = batch
        while True:
            scheme, address = route.current

            def place(j: int, meta: BlockMeta, todo=todo) -> memoryview:
                want = params.blocks[todo[j]].meta
                if meta.size != want.size or meta.checksum != want.checksum:
                    raise CorruptBlock(
                        f"handoff block {params.blocks[todo[j]].key.hex()[:16]} at the prefill node is not the one "
                        f"the handoff announced (size {meta.size} vs {want.size}, checksum {meta.checksum:#x} vs "
                        f"{want.checksum:#x}): nothing was stored"
                    )
                return writers[todo[j]].landing()

            keys = [params.blocks[i].key for i in todo]
            try:
                got = self._peers[scheme].read(address, params.namespace, keys, place, deadline)
            except TierUnavailable as err:  # nothing answered: unreachable, or broke before the first block
                if deadline.cancelled:
                    raise
                route.fall_back(err)
                continue
            left, why = [], None
            for j, g in enumerate(got):
                i, r = todo[j], g.result
                key = params.blocks[i].key.hex()[:16]
                if r.status is ReadStatus.HIT:
                    # The peer client hashed the bytes as they landed in the slot and they matched the
                    # checksum the params announced (place checked): no second pass over them.
                    writers[i].landed(verified=True)
                    route.delivered[scheme] += r.meta.size
                    continue
                if r.status is ReadStatus.MISS:
                    raise HandoffEnded(
                        f"the prefill node {params.node_id} no longer holds handoff block {key}: the handoff ended "
                        "there (expired, or its daemon restarted); nothing was stored"
                    )
                err = r.error or TierUnavailable(f"handoff block {key} was not delivered")
                if deadline.cancelled:
                    raise HandoffEnded(f"handoff {params.handoff_id[:8]}… ended at the prefill node while pulling; "
                                       "nothing was stored")
                if isinstance(err, TierUnavailable):  # the route broke off mid-batch: the next one takes the rest
                    left.append(i)
                    why = why or err
                    continue
                if isinstance(err, (CorruptBlock, DeadlineExceeded)):
                    raise type(err)(f"pulling handoff block {key} from {params.node_id}: {err}; nothing was stored")
                raise err
            if not left:
                return
            route.fall_back(why)
            todo = left


class _Route:
    """The routes a pull may take, the one it is on, and the verified bytes each delivered."""

    def __init__(self, routes: list[tuple[str, str]], params: HandoffParams, metrics: HandoffMetrics) -> None:
        self._routes = routes
        self._params = params
        self._metrics = metrics
        self._at = 0
        self.delivered: defaultdict[str, int] = defaultdict(int)

    @property
    def left(self) -> bool:
        return self._at < len(self._routes)

    @property
    def current(self) -> tuple[str, str]:
        return self._routes[self._at]

    def fall_back(self, err: TierUnavailable) -> None:
        """Leave the current route for the next; raise ``err`` (named) when none is left."""
        scheme, address = self.current
        self._metrics.fell_back(scheme, "unavailable")
        self._at += 1
        p = self._params
        if not self.left:
            tried = ", ".join(a for _, a in self._routes)
            raise TierUnavailable(
                f"pulling handoff {p.handoff_id[:8]}… from {p.node_id}: no data plane left ({tried}); the last "
                f"one, {address}, failed: {err}; nothing was stored"
            )
        log.warning("handoff %s: %s cannot serve the pull from %s (%s); falling back to %s", p.handoff_id[:8],
                    address, p.node_id, err, self.current[1])


def _call_s(deadline_at: float | None) -> float:
    """A call's timeout within a pull's deadline: what is left of it, at least a moment."""
    left = 10.0 if deadline_at is None else deadline_at - time.monotonic()
    return max(0.25, min(10.0, left))


def _batches(wanted: list[int], params: HandoffParams):
    batch, size = [], 0
    for i in wanted:
        n = params.blocks[i].meta.size
        if batch and (len(batch) >= BATCH_BLOCKS or size + n > BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(i)
        size += n
    if batch:
        yield batch


class _Heartbeat:
    """Extends the handoff's lease every third of it while a pull runs; an ended handoff cancels the pull."""

    def __init__(self, control, params: HandoffParams, address: str, deadline) -> None:
        self._control = control
        self._params = params
        self._address = address
        self._deadline = deadline
        self._every = max(MIN_HEARTBEAT_S, (params.lease_ms or 30_000) / 3000)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="strata-handoff-heartbeat", daemon=True)
        self.ended: StrataError | None = None
        self.beats = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():  # a beat in flight ends within its own bound
            self._thread.join(self._every + 1.0)

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:  # each beat bounded by the beat period and the pull's deadline, never the client's default
                self._control.heartbeat_handoff(self._params.namespace, self._params.handoff_id,
                                                timeout=min(self._every, _call_s(self._deadline.at)))
                self.beats += 1
            except (HandoffEnded, UnknownHandoff) as err:
                self.ended = err
                self._deadline.cancel()
                return
            except StrataError as err:  # the prefill daemon is slow or away: the lease tells
                log.warning("handoff %s: heartbeat to %s failed: %s", self._params.handoff_id[:8],
                            self._address, err)
