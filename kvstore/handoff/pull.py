"""The decode side: pull a handoff's blocks into this daemon's arena, store them, publish, complete.

:class:`HandoffPuller` runs in the gRPC worker thread of a PullHandoff:

1. checks the params against this daemon's limits (blocks per handoff,
   block size, pulls at once: beyond ``max_pulls`` RESOURCE_EXHAUSTED);
2. opens a writer per block not held here yet
   (:meth:`~kvstore.store.group.StoreGroup.open_write`): an extent reserved
   in the head, so the bytes land in the arena slot that will hold the
   block, with no buffer in between;
3. reads them from the prefill node's TCP peer listener (the first
   ``tcp://`` address of the params) in batches: the transport
   ``recv_into`` s each block straight into its writer's extent and
   verifies its checksum on arrival; a block whose size or checksum is not
   the one the params announced is refused before its bytes move;
4. while it reads, heartbeats the prefill daemon every third of the lease,
   so a long pull keeps its blocks held; a heartbeat refused as ended
   (expired) cancels the read at once;
5. commits each writer (its bytes were verified as they landed in the
   extent: a corrupt byte is never stored) or, on any failure, aborts them
   all: nothing of a failed pull is stored;
6. publishes this node as a holder of the blocks in the index before it
   answers (``publish``), so the decode node is a holder when PullHandoff
   returns, then completes the handoff at the prefill daemon.

What the prefill side is called with (HeartbeatHandoff, CompleteHandoff)
goes to its gRPC address with this daemon's peer token.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.block import BlockKey, BlockMeta, TierName
from kvstore.errors import (
    CorruptBlock, DeadlineExceeded, HandoffEnded, InvalidArgument, Overloaded, StrataError, TierUnavailable,
    UnknownHandoff,
)
from kvstore.handoff.metrics import HandoffMetrics
from kvstore.handoff.params import HandoffParams
from kvstore.remote.base import ReadStatus

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


@dataclass(frozen=True, slots=True)
class PullResult:
    stored: int
    present: int
    pulled_bytes: int
    completed: bool
    complete_error: str
    published: bool


class HandoffPuller:
    """``store``: the StoreGroup; ``peer``: a :class:`~kvstore.peer.tcp.TcpPeerClient` (with the peer
    token); ``control(address)``: a client of the prefill daemon's gRPC with ``heartbeat_handoff`` and
    ``complete_handoff`` (the caller closes it); ``publish(namespace, [(key, tier)], timeout_s)``: adds
    this node's holdings to the index now, True when the index took them."""

    def __init__(self, store, peer, control: Callable, publish: Callable[[str, list, float], bool],
                 limits: PullLimits, metrics: HandoffMetrics | None = None) -> None:
        self._store = store
        self._peer = peer
        self._control = control
        self._publish = publish
        self.limits = limits
        self.metrics = metrics or HandoffMetrics()
        self._slots = threading.BoundedSemaphore(limits.max_pulls)

    def pull(self, params: HandoffParams, timeout_s: float | None = None) -> PullResult:
        self._check(params)
        if not self._slots.acquire(blocking=False):
            raise Overloaded(
                f"{self.limits.max_pulls} pulls are running on this daemon (--handoff-max-pulls): retry after "
                "the delay, or pull on another decode node", retry_after_s=0.2,
            )
        started = time.monotonic()
        try:
            result = self._pull(params, started + (timeout_s or self.limits.pull_s))
        except BaseException:
            self.metrics.pulls.labels("failed").inc()
            raise
        finally:
            self._slots.release()
        self.metrics.pulls.labels("ok").inc()
        self.metrics.pulled_bytes.inc(result.pulled_bytes)
        self.metrics.pull_seconds.observe(time.monotonic() - started)
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

    def _pull(self, params: HandoffParams, deadline_at: float) -> PullResult:
        from kvstore.transport.base import Deadline

        ns = params.namespace
        address = next((a for a in params.addresses if a.startswith("tcp://")), None)
        if params.blocks and address is None:
            raise InvalidArgument(
                f"prefill node {params.node_id} offers no tcp:// data-plane address ({list(params.addresses)}): "
                "start it with --peer-listen"
            )
        control = self._control(params.control_address)
        try:
            deadline = Deadline(deadline_at)
            beat = _Heartbeat(control, params, deadline)
            writers = []
            try:
                for b in params.blocks:
                    writers.append(self._store.open_write(BlockKey(ns, b.key), b.meta))
                wanted = [i for i, w in enumerate(writers) if not w.present]
                beat.start()
                try:
                    for batch in _batches(wanted, params):
                        self._read(address, params, writers, batch, deadline)
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
            try:
                control.complete_handoff(ns, params.handoff_id)
            except StrataError as err:
                completed, why = False, str(err)
                log.warning("handoff %s: pulled and stored, but the prefill node %s did not confirm the "
                            "completion (%s); its lease ends the handoff", params.handoff_id[:8], params.node_id, err)
            return PullResult(len(stored), present, sum(params.blocks[i].meta.size for i in wanted), completed, why,
                              published)
        finally:
            control.close()

    def _tiers(self, ns: str, params: HandoffParams) -> list[TierName]:
        tiers = []
        for b in params.blocks:
            got = self._store.exists(ns, [b.key])
            tiers.append(got[0] if got else TierName.HOST)
        return tiers

    def _read(self, address: str, params: HandoffParams, writers, batch: list[int], deadline) -> None:
        def place(j: int, meta: BlockMeta) -> memoryview:
            want = params.blocks[batch[j]].meta
            if meta.size != want.size or meta.checksum != want.checksum:
                raise CorruptBlock(
                    f"handoff block {params.blocks[batch[j]].key.hex()[:16]} at the prefill node is not the one "
                    f"the handoff announced (size {meta.size} vs {want.size}, checksum {meta.checksum:#x} vs "
                    f"{want.checksum:#x}): nothing was stored"
                )
            return writers[batch[j]].landing()

        got = self._peer.read(address, params.namespace, [params.blocks[i].key for i in batch], place, deadline)
        for j, g in enumerate(got):
            r = g.result
            key = params.blocks[batch[j]].key.hex()[:16]
            if r.status is ReadStatus.HIT:
                # The TCP client hashed the bytes as they landed in the slot and they matched the
                # checksum the params announced (place checked): no second pass over them.
                writers[batch[j]].landed(verified=True)
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
            if isinstance(err, (CorruptBlock, DeadlineExceeded, TierUnavailable)):
                raise type(err)(f"pulling handoff block {key} from {params.node_id}: {err}; nothing was stored")
            raise err


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

    def __init__(self, control, params: HandoffParams, deadline) -> None:
        self._control = control
        self._params = params
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
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self._control.heartbeat_handoff(self._params.namespace, self._params.handoff_id)
                self.beats += 1
            except (HandoffEnded, UnknownHandoff) as err:
                self.ended = err
                self._deadline.cancel()
                return
            except StrataError as err:  # the prefill daemon is slow or away: the lease tells
                log.warning("handoff %s: heartbeat to %s failed: %s", self._params.handoff_id[:8],
                            self._params.control_address, err)
