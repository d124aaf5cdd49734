"""The daemon's side of the prefix index: membership, heartbeats, and its holdings.

The agent owns one asyncio loop in its own thread (the index clients are
asyncio; the store and the gRPC servicers are threads). It subscribes to the
store's events (:mod:`kvstore.events`, :meth:`on_events`): each carries
the block's best tier after it, so the agent needs no store call per change.
It coalesces those changes per key in a bounded buffer and publishes them in
batches. If the index is unreachable the daemon keeps serving local hits: the
agent marks itself degraded (metric, health), keeps coalescing, and when the
index answers again re-joins and re-publishes its full holdings (anything it
missed is then corrected). A buffer overflow, or a ``Resync`` from the event
bus (its queue overflowed), also triggers a full re-publish, so a burst never
leaves the index silently wrong.

The full re-publish takes a holdings snapshot: O(blocks) work under the
store lock. It runs in a worker thread, never on the loop, and the result is
sent in batches with a yield between them, so index queries (Score, Holders)
and heartbeats keep being served meanwhile. ``holdings`` may return an
iterator that takes the store lock one page at a time: it is consumed in
that worker thread, and a change to a block already read is not lost (the
change arrives as an event after the snapshot began, and is published after
it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvstore.block import BlockKey, TierName
from kvstore.errors import StrataError
from kvstore.index.base import IndexUnavailable, NodeInfo, PrefixIndex
from kvstore.events import Delivery, Resync

log = logging.getLogger(__name__)

T = TypeVar("T")


class IndexAgent:
    def __init__(
        self,
        index: PrefixIndex,
        node_id: str,
        epoch: int,
        holdings: Callable[[], Iterable[tuple[BlockKey, TierName]]],
        *,
        ttl_s: float = 10.0,
        flush_s: float = 0.05,
        batch_blocks: int = 1024,
        buffer_blocks: int = 1 << 18,
        registry: CollectorRegistry | None = None,
        on_degraded: Callable[[bool], None] | None = None,
        address: str = "",
        transports: Sequence[str] = (),
        served: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        """``address`` and ``transports``: what this node advertises to its peers in its node record;
        ``served``: the bytes its peer listeners served by transport, sent with every heartbeat."""
        self.index = index
        self.address = address
        self.transports = tuple(transports)
        self.node_id = node_id
        self.epoch = epoch
        self._holdings = holdings
        self._served = served
        self._ttl_s = ttl_s
        self._flush_s = flush_s
        self._batch = batch_blocks
        self._buffer_max = buffer_blocks
        self._on_degraded = on_degraded
        self._lock = threading.Lock()
        self._pending: dict[BlockKey, TierName | None] = {}
        self._resync = True  # the first publication is a full one
        self._degraded = False
        self._stop = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="strata-index", daemon=True)
        self._snapshots = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-index-snapshot")
        r = registry or CollectorRegistry()
        self._m_degraded = Gauge("strata_index_degraded", "1 while the prefix index cannot be reached", registry=r)
        self._m_published = Counter(
            "strata_index_published_blocks_total", "Block changes published to the prefix index", ["op"], registry=r
        )
        self._m_resyncs = Counter("strata_index_resyncs_total", "Full re-publications of this node's holdings", registry=r)
        self._m_overflows = Counter(
            "strata_index_buffer_overflows_total", "Times the change buffer overflowed (a resync follows)", registry=r
        )
        self._m_pending = Gauge("strata_index_pending_blocks", "Block changes waiting to be published", registry=r)
        self._m_pending.set_function(lambda: len(self._pending))
        self._task: asyncio.Future | None = None

    # ---- called from any thread ----------------------------------------------

    @property
    def degraded(self) -> bool:
        return self._degraded

    def on_events(self, batch: Sequence[Delivery]) -> None:
        """The agent's store-event subscriber (called by the bus's delivery thread)."""
        with self._lock:
            for event in batch:
                if isinstance(event, Resync):
                    self._pending.clear()
                    self._resync = True
                else:
                    self._record_locked(event.key, event.best)

    def _record_locked(self, key: BlockKey, tier: TierName | None) -> None:
        if self._resync:
            return  # a full re-publish is due; it will read the store as it is then
        if len(self._pending) >= self._buffer_max and key not in self._pending:
            self._pending.clear()
            self._resync = True
            self._m_overflows.inc()
            return
        self._pending[key] = tier

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run an index coroutine on the agent's loop from a worker thread."""
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self._loop).result(timeout + 1)

    def advertise(self, address: str, transports: Sequence[str]) -> None:
        """Change what this node's record advertises; a running agent joins again to publish it
        (with a full re-publish, as after any trouble: a join alone could start a new incarnation
        whose rows were never sent)."""
        with self._lock:
            if (address, tuple(transports)) == (self.address, self.transports):
                return
            self.address, self.transports = address, tuple(transports)
            self._pending.clear()
            self._resync = True

    def publish(self, namespace: str, blocks: Sequence[tuple[bytes, TierName]], timeout: float) -> bool:
        """Add ``blocks`` as this node's holdings in the index now, from a worker thread, without
        waiting for the next flush (a handoff's decode side is a holder when its pull returns).
        False when the index did not take them in time; the next flush or re-publish sends them."""
        async def add() -> None:
            for i in range(0, len(blocks), self._batch):
                await self.index.add(namespace, self.node_id, self.epoch, list(blocks[i : i + self._batch]))

        try:
            self.run(add(), timeout)
        except (StrataError, TimeoutError) as err:
            log.warning("could not publish %d blocks of %s to the index now: %s", len(blocks), namespace, err)
            return False
        self._m_published.labels("add").inc(len(blocks))
        return True

    def node(self, node_id: str, timeout: float) -> NodeInfo | None:
        """The index's record of ``node_id`` (None when it knows no such node), from a worker thread.
        IndexUnavailable when the index does not answer in time."""
        try:
            nodes = self.run(self.index.nodes(), timeout)
        except TimeoutError:
            raise IndexUnavailable(f"the prefix index did not list its nodes within {timeout:g} s: retry") from None
        return next((n for n in nodes if n.node_id == node_id), None)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop the index lives on: a coroutine of ``index`` runs there and nowhere else."""
        return self._loop

    def start(self) -> IndexAgent:
        self._thread.start()
        self._task = asyncio.run_coroutine_threadsafe(self._main(), self._loop)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Publish what is pending, leave the index (answers drop this node at once), stop."""
        self._stop.set()
        if self._task is not None:
            try:
                self._task.result(timeout)
            except Exception as err:  # noqa: BLE001 - stopping: report, do not raise
                log.warning("prefix index agent did not stop cleanly: %s", err)
        try:
            self.run(self.index.leave(self.node_id), timeout)
        except Exception as err:  # noqa: BLE001 - stopping: report, do not raise
            log.warning("could not leave the prefix index: %s", err)
        try:
            self.run(self.index.close(), timeout)
        except Exception as err:  # noqa: BLE001 - stopping: report, do not raise
            log.warning("could not close the prefix index connection cleanly: %s", err)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._snapshots.shutdown(wait=False, cancel_futures=True)

    # ---- the loop ----------------------------------------------------------------

    async def _main(self) -> None:
        heartbeat_every = self._ttl_s / 3
        next_beat = 0.0
        backoff = self._flush_s
        loop = asyncio.get_running_loop()
        while True:
            stopping = self._stop.is_set()
            try:
                if self._resync:
                    await self._republish()
                    next_beat = loop.time() + heartbeat_every
                elif loop.time() >= next_beat:
                    await self._heartbeat()
                    next_beat = loop.time() + heartbeat_every
                await self._flush()
                self._set_degraded(False)
                backoff = self._flush_s
            except IndexUnavailable as err:
                self._set_degraded(True, err)
                self._resync = True  # what changed meanwhile is re-sent whole
                backoff = min(backoff * 2, 2.0)
            except StrataError as err:
                log.error("prefix index refused an update, re-publishing: %s", err)
                self._resync = True
            if stopping:
                return
            await asyncio.sleep(backoff)

    async def _heartbeat(self) -> None:
        if self._served is None:
            await self.index.heartbeat(self.node_id, self.epoch, self._ttl_s)
        else:
            await self.index.heartbeat(self.node_id, self.epoch, self._ttl_s, served=self._served())

    async def _republish(self) -> None:
        with self._lock:
            self._pending.clear()
            self._resync = False
        try:
            await self.index.join(
                self.node_id, self.epoch, self._ttl_s, address=self.address, transports=self.transports
            )
            await self.index.clear(self.node_id)
            by_ns = await asyncio.get_running_loop().run_in_executor(self._snapshots, self._snapshot)
            for namespace, blocks in by_ns.items():
                for i in range(0, len(blocks), self._batch):
                    await self.index.add(namespace, self.node_id, self.epoch, blocks[i : i + self._batch])
                    self._m_published.labels("add").inc(len(blocks[i : i + self._batch]))
                    await asyncio.sleep(0)  # serve queries between batches, even if the index never suspends
        except BaseException:
            self._resync = True
            raise
        self._m_resyncs.inc()
        log.info("published %d blocks to the prefix index", sum(len(b) for b in by_ns.values()))

    def _snapshot(self) -> dict[str, list[tuple[bytes, TierName]]]:
        """The store's holdings grouped by namespace (a worker thread: it takes the store lock)."""
        by_ns: dict[str, list[tuple[bytes, TierName]]] = defaultdict(list)
        for key, tier in self._holdings():
            by_ns[key.namespace].append((key.key, tier))
        return by_ns

    async def _flush(self) -> None:
        with self._lock:
            if not self._pending:
                return
            pending, self._pending = self._pending, {}
        adds: dict[str, list[tuple[bytes, TierName]]] = defaultdict(list)
        removes: dict[str, list[bytes]] = defaultdict(list)
        for key, tier in pending.items():
            if tier is None:
                removes[key.namespace].append(key.key)
            else:
                adds[key.namespace].append((key.key, tier))
        try:
            for namespace, blocks in adds.items():
                for i in range(0, len(blocks), self._batch):
                    await self.index.add(namespace, self.node_id, self.epoch, blocks[i : i + self._batch])
                self._m_published.labels("add").inc(len(blocks))
            for namespace, keys in removes.items():
                for i in range(0, len(keys), self._batch):
                    await self.index.remove(namespace, self.node_id, self.epoch, keys[i : i + self._batch])
                self._m_published.labels("remove").inc(len(keys))
        except BaseException:
            with self._lock:  # keep what was not sent, unless newer changes replaced it
                for key, tier in pending.items():
                    self._pending.setdefault(key, tier)
            raise

    def _set_degraded(self, degraded: bool, err: Exception | None = None) -> None:
        if degraded == self._degraded:
            return
        self._degraded = degraded
        self._m_degraded.set(1 if degraded else 0)
        if degraded:
            log.warning("prefix index unreachable, serving local hits only: %s", err)
        else:
            log.info("prefix index reachable again; holdings re-published")
        if self._on_degraded is not None:
            self._on_degraded(degraded)
