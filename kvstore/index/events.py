"""vLLM KV events into the prefix index: what each engine's GPU cache holds, as it changes.

The wire format and its parser are :mod:`kvstore.index.event_format`; which copies an engine
holds is :mod:`kvstore.index.holdings`; each engine's ZMQ sockets and the tasks reading them are
:mod:`kvstore.index.event_sockets`.

:class:`KVEventSubscriber` follows one or more
engines and keeps the index equal to a subset of what each engine holds: a ``seq`` gap or
reset (engine restarted, messages dropped at a high-water mark) is filled from the replay
socket when it can be, and otherwise the engine's epoch is bumped, which drops all of its
entries from answers at once. A message that cannot be read is a loss of the same kind.

What an engine published before its SUB socket joined never arrives on that socket (ZMQ's
slow joiner: a PUB sends only to subscriptions it has seen), and no later message need come
to reveal it: an engine that computed one prefix and then idles would stay unindexed. So at
every connection the subscriber asks the replay socket for what it missed, at once.

Errors, beyond :mod:`kvstore.errors`::

    InvalidArgument
    └── MalformedEvent        (kvstore.index.event_format) a message that cannot be read
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvstore.block import TierName, validate_namespace
from kvstore.errors import InvalidArgument
from kvstore.index.base import PrefixIndex, PrefixIndexError, StaleEpoch
from kvstore.index.event_format import (
    MAX_PAYLOAD_BYTES,
    AllBlocksCleared,
    BlockStored,
    EventBatch,
    MalformedEvent,
    block_key,
    decode_batch,
    medium_tier,
    split_message,
)
from kvstore.index.event_sockets import EngineSockets, _digest
from kvstore.index.holdings import EngineHoldings

log = logging.getLogger(__name__)

INDEX_BATCH_BLOCKS = 1024  # keys per index call (the index bounds what it accepts)
MAX_ENGINES = 1024  # engines one subscriber follows (as many as [index] kv_events may list)


@dataclass(frozen=True, slots=True)
class EngineSource:
    """One engine's event stream: where to read it and whom it describes in the index."""

    endpoint: str  # the engine's PUB socket, e.g. "tcp://10.0.0.5:5557"
    engine_id: str  # the engine's node id in the index
    namespace: str  # the namespace its blocks are recorded in (the model)
    replay_endpoint: str | None = None  # its ROUTER replay socket, e.g. "tcp://10.0.0.5:5558"
    topic: str = ""  # vLLM KVEventsConfig.topic


@dataclass(frozen=True, slots=True)
class SubscriberConfig:
    ttl_s: float = 30.0  # the engine's liveness in the index without messages or a connection
    heartbeat_interval_s: float = 5.0
    rcvhwm: int = 10_000  # messages ZMQ buffers per engine; beyond it they drop (seen as a gap)
    max_payload_bytes: int = MAX_PAYLOAD_BYTES
    replay_timeout_s: float = 2.0  # one whole replay exchange
    max_replay_batches: int = 10_000  # vLLM's default buffer_steps; a longer gap is not asked for
    max_tracked_blocks: int = 1 << 20  # per engine: keys (and further copies) whose holdings are remembered
    zmq_heartbeat_s: float = 5.0  # ZMTP pings, so a dead peer is seen as a disconnect
    # ZMQ's reconnect backoff doubles up to this. A daemon usually starts before its engine, so
    # this bounds how long after the engine binds it is followed (a failed connect is cheap).
    reconnect_max_s: float = 1.0

    def __post_init__(self) -> None:
        positive = ("ttl_s", "heartbeat_interval_s", "replay_timeout_s", "zmq_heartbeat_s", "reconnect_max_s")
        for name in positive:
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise InvalidArgument(f"SubscriberConfig.{name} is {v!r}; give a positive number of seconds")
        if self.heartbeat_interval_s * 2 > self.ttl_s:
            raise InvalidArgument(
                f"heartbeat_interval_s ({self.heartbeat_interval_s}) must be at most half of ttl_s ({self.ttl_s})"
            )
        for name in ("rcvhwm", "max_payload_bytes", "max_replay_batches", "max_tracked_blocks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgument(f"SubscriberConfig.{name} is {v!r}; give a positive int")


class KVEventMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.batches = Counter("strata_kv_events_batches_total", "Event batches applied", ["source"], registry=r)
        self.events = Counter("strata_kv_events_total", "KV events read, by type", ["type"], registry=r)
        self.malformed = Counter(
            "strata_kv_events_malformed_total", "Messages that could not be read, skipped", ["reason"], registry=r
        )
        self.resyncs = Counter(
            "strata_kv_events_resyncs_total", "Seq gaps and resets (lost messages, engine restarts)", ["kind"], registry=r
        )
        self.replays = Counter(
            "strata_kv_events_replays_total", "Replay requests, by whether they filled the gap", ["outcome"], registry=r
        )
        self.epoch_bumps = Counter(
            "strata_kv_events_epoch_bumps_total",
            "Engine epochs raised: after lost events (loss) or index trouble (index)",
            ["reason"],
            registry=r,
        )
        self.index_errors = Counter("strata_kv_events_index_errors_total", "Index calls that failed", ["op"], registry=r)
        self.connected = Gauge("strata_kv_events_engines_connected", "Engines whose event socket is connected", registry=r)


@dataclass(frozen=True, slots=True)
class EngineStatus:
    engine_id: str
    epoch: int
    last_seq: int | None  # the last seq applied
    connected: bool
    batches: int


_Op = tuple[str, Any]  # ("add", [(key, tier)]) | ("remove", [key]) | ("clear", None)


@dataclass(eq=False)
class _Engine:
    source: EngineSource
    holdings: EngineHoldings
    sockets: EngineSockets = field(init=False)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one writer to the index per engine
    epoch: int = 0
    joined: bool = False
    dirty: bool = False  # the index may lack what holdings say: re-join and re-publish
    last_seq: int | None = None
    last_digest: bytes | None = None  # of the batch at last_seq
    # seq -> digest of what a catch-up applied that the live socket may bring again; emptied
    # by the first live message past them (ZMQ delivers in order)
    replayed: dict[int, bytes] = field(default_factory=dict)
    last_message_at: float = -math.inf
    batches: int = 0
    followed: bool = True  # False once unfollowed: nothing may write for it again


class KVEventSubscriber:
    """Follows vLLM engines' KV events and records each engine as a holder in the index.

    One SUB socket and one task per engine (:class:`~kvstore.index.event_sockets.EngineSockets`):
    messages are applied in ``seq`` order; ZMQ's receive high-water mark is the only queue, and
    what overflows it is seen as a gap. At each connection the engine's replay socket (when it
    has one) is asked for what was published while the socket was not there, under the same
    per-engine lock.
    The engine is joined to the index under an epoch this subscriber owns (one more than
    any the index knew at start) and heartbeated while its socket is connected or its
    messages arrive; otherwise its entries leave answers after ``ttl_s``.

    Two kinds of trouble, two remedies. Lost events (a gap replay cannot fill, a restart,
    an unreadable batch) mean the engine's state is unknown: a new epoch, starting empty.
    Index trouble (a failed write, an expired or displaced membership) leaves the event
    stream intact: a new epoch, re-published from the holdings the events describe.

    Engines can be followed and unfollowed while it runs (:meth:`follow`, :meth:`unfollow`,
    what the indexer API's ``/register`` and ``/unregister`` call), up to ``max_engines``;
    ``sources`` may then start empty (``allow_empty``).
    """

    def __init__(
        self,
        index: PrefixIndex,
        sources: Iterable[EngineSource],
        config: SubscriberConfig | None = None,
        *,
        registry: CollectorRegistry | None = None,
        allow_empty: bool = False,
        max_engines: int = MAX_ENGINES,
    ) -> None:
        self._index = index
        self._config = config or SubscriberConfig()
        self.metrics = KVEventMetrics(registry)
        self._max_engines = max_engines
        self._engines: dict[str, _Engine] = {}
        for src in sources:
            self._add_engine(src)
        if not self._engines and not allow_empty:
            raise InvalidArgument("no engine sources given; configure at least one (endpoint, engine_id, namespace)")
        # Plain counters for tests and status pages, mirroring the Prometheus ones.
        self.malformed: collections.Counter[str] = collections.Counter()
        self.events: collections.Counter[str] = collections.Counter()
        self.resyncs: collections.Counter[str] = collections.Counter()
        self.replays: collections.Counter[str] = collections.Counter()
        self.epoch_bumps: collections.Counter[str] = collections.Counter()
        self.failure: BaseException | None = None  # an unexpected error that ended a task
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- life cycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._ctx is not None:
            raise RuntimeError("KVEventSubscriber.start() called twice")
        self._ctx = zmq.asyncio.Context()
        for eng in self._engines.values():
            self._open(eng)
        self._spawn(self._heartbeats(), "kv-events-heartbeat")

    def _add_engine(self, src: EngineSource) -> _Engine:
        validate_namespace(src.namespace)
        if src.engine_id in self._engines:
            raise InvalidArgument(f"engine {src.engine_id!r} is configured twice; give each engine one source")
        if len(self._engines) >= self._max_engines:
            raise InvalidArgument(f"{self._max_engines} engines are followed already; unregister one first")
        eng = self._engines[src.engine_id] = _Engine(src, EngineHoldings(self._config.max_tracked_blocks))
        eng.sockets = EngineSockets(
            src,
            self._config,
            self.metrics.connected,
            on_open=partial(self._join, eng),
            on_message=partial(self._on_message, eng),
            on_connect=partial(self._catch_up, eng),
            on_malformed=partial(self._count_malformed, eng),
        )
        return eng

    def _open(self, eng: _Engine) -> None:
        """The engine's sockets and their tasks (the context is running)."""
        assert self._ctx is not None
        eng.sockets.open(self._ctx, self._spawn)

    async def follow(self, source: EngineSource) -> None:
        """Start following one more engine (InvalidArgument: its id is followed already, or
        ``max_engines`` are). Before :meth:`start` it is opened with the others."""
        eng = self._add_engine(source)
        if self._ctx is None:
            return
        try:
            self._open(eng)
        except zmq.ZMQError as e:  # an endpoint ZMQ cannot connect to (bad address, unknown transport)
            del self._engines[source.engine_id]
            await eng.sockets.close()
            raise InvalidArgument(f"cannot follow {source.endpoint!r}: {e}; give tcp://HOST:PORT") from None

    async def unfollow(self, engine_id: str) -> bool:
        """Stop following an engine and drop its entries from the index now; False if it was not followed."""
        eng = self._engines.pop(engine_id, None)
        if eng is None:
            return False
        eng.followed = False
        await eng.sockets.close()
        async with eng.lock:
            if eng.joined:
                eng.joined = False
                try:
                    await self._index.leave(engine_id)
                except PrefixIndexError as e:
                    self._index_error("leave", eng, e)  # its entries leave answers after ttl_s
        return True

    def sources(self) -> list[EngineSource]:
        """The engines followed now, in the order they were added."""
        return [eng.source for eng in self._engines.values()]

    async def stop(self, *, leave: bool = False) -> None:
        """Stop reading; with ``leave`` also drop the engines from the index now.

        Without it their entries stay until the TTL runs out: nobody follows the engines
        any more, so the index should not vouch for them for long.
        """
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for eng in list(self._engines.values()):
            await eng.sockets.close()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        for eng in list(self._engines.values()):
            if leave and eng.joined:
                eng.joined = False
                try:
                    await self._index.leave(eng.source.engine_id)
                except PrefixIndexError as e:
                    self._index_error("leave", eng, e)

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        task.add_done_callback(self._task_done)
        self._tasks.append(task)
        task.add_done_callback(self._forget)
        return task

    def _forget(self, task: asyncio.Task[None]) -> None:
        if task in self._tasks:
            self._tasks.remove(task)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.failure = task.exception()
            log.error("KV-event task %s failed", task.get_name(), exc_info=task.exception())

    # -- status -------------------------------------------------------------------------------

    def status(self, engine_id: str) -> EngineStatus:
        eng = self._engines[engine_id]
        return EngineStatus(engine_id, eng.epoch, eng.last_seq, eng.sockets.connected, eng.batches)

    def epoch(self, engine_id: str) -> int:
        return self._engines[engine_id].epoch

    # -- liveness in the index ----------------------------------------------------------------

    async def _heartbeats(self) -> None:
        cfg = self._config
        while True:
            await asyncio.sleep(cfg.heartbeat_interval_s)
            now = time.monotonic()
            for eng in list(self._engines.values()):  # follow/unfollow may change the dict meanwhile
                if not (eng.sockets.connected or now - eng.last_message_at < cfg.ttl_s):
                    continue  # neither connected nor heard from: let the engine expire
                async with eng.lock:
                    if not eng.followed:
                        continue
                    if eng.dirty or not eng.joined:
                        await self._new_epoch(eng, republish=True)
                        continue
                    try:
                        await self._index.heartbeat(eng.source.engine_id, eng.epoch, cfg.ttl_s)
                    except StaleEpoch:
                        await self._new_epoch(eng, republish=True)  # expired while quiet, or displaced
                    except PrefixIndexError as e:
                        self._index_error("heartbeat", eng, e)

    # -- what the sockets bring ----------------------------------------------------------------

    async def _join(self, eng: _Engine) -> None:
        """Before the engine's first message is read: join it under a fresh epoch."""
        async with eng.lock:
            await self._new_epoch(eng, republish=True)

    async def _on_message(self, eng: _Engine, frames: list[bytes]) -> None:
        try:
            _, seq, payload = split_message(frames)
        except MalformedEvent as e:
            self._count_malformed(eng, e)
            return  # no seq to account for; the next message's seq shows whether anything was lost
        eng.last_message_at = time.monotonic()
        digest = _digest(payload)
        async with eng.lock:
            last = eng.last_seq
            if last is not None and seq <= last and eng.replayed.get(seq) == digest:
                for s in [s for s in eng.replayed if s <= seq]:
                    del eng.replayed[s]
                return  # a catch-up applied it already
            eng.replayed.clear()
            try:
                batch: EventBatch | None = decode_batch(payload, max_bytes=self._config.max_payload_bytes)
            except MalformedEvent as e:
                self._count_malformed(eng, e)
                batch = None
            if last is None:
                # What the engine did before we listened is unknown (the index holds nothing
                # for it at our fresh epoch): take whatever recent history replay still has.
                await self._resync(eng, 0, seq, lost=False)
            elif seq > last + 1:
                self._count_resync("gap")
                await self._resync(eng, last + 1, seq, lost=True)
            elif seq <= last:
                self._count_resync("reset")  # a new publisher: the engine restarted
                await self._new_epoch(eng, republish=False)
                await self._resync(eng, 0, seq, lost=False)
            if batch is None:
                # The batch at ``seq`` is lost to us: whatever it removed could still be listed.
                await self._new_epoch(eng, republish=False)
            else:
                await self._apply(eng, batch, "live")
            eng.last_seq, eng.last_digest = seq, digest  # applied through ``seq``

    async def _catch_up(self, eng: _Engine) -> None:
        """On a connection: apply what the engine published while this SUB was not there.

        Asked from ``last_seq`` itself, not the one after: its echo, the batch already applied,
        shows the engine is the same publisher. Without it (a restart, or a buffer that rolled
        past) the engine's state since is unknown: a new, empty epoch. Then the newest
        contiguous run is applied, which onto a subset of the engine's state keeps a subset.
        The live socket may bring some of the run again; those are recognized and skipped.
        """
        src = eng.source
        if src.replay_endpoint is None:
            return
        async with eng.lock:
            last = eng.last_seq
            start = 0 if last is None else last
            got = await eng.sockets.fetch_replay(src.replay_endpoint, start, None)
            if not got:
                return
            first = newest = max(got)
            while first - 1 in got:
                first -= 1
            outcome = "filled" if first == 0 else "short"  # short: its early history is gone
            if last is not None:
                if first == last and got[last].digest == eng.last_digest:
                    first += 1  # the same publisher
                    if first > newest:
                        return  # nothing published since
                    outcome = "filled"
                else:
                    self._count_resync("reset" if first == last else "gap")
                    await self._new_epoch(eng, republish=False)
                    outcome = "short"
            self.replays[outcome] += 1
            self.metrics.replays.labels(outcome).inc()
            eng.replayed.clear()  # at most one run's worth: what this connection may bring again
            for s in range(first, newest + 1):
                await self._apply(eng, got[s].batch, "replay")
                eng.replayed[s] = got[s].digest
            eng.last_seq, eng.last_digest = newest, got[newest].digest

    async def _resync(self, eng: _Engine, start: int, end: int, *, lost: bool) -> None:
        """Account for batches ``start .. end-1`` that never arrived.

        Applying any contiguous run that ends at ``end - 1`` onto a state that is a subset
        of the engine's keeps it a subset. So a replay covering the whole range is applied
        as is; a short one (or none) after starting a new, empty epoch if ``lost`` says the
        current state depends on the missing batches.
        """
        if start >= end:
            return
        run: list[EventBatch] = []
        covered = False
        src = eng.source
        if src.replay_endpoint is not None and end - start <= self._config.max_replay_batches:
            got = await eng.sockets.fetch_replay(src.replay_endpoint, start, end)
            s = end - 1
            while s >= start and s in got:
                run.append(got[s].batch)
                s -= 1
            run.reverse()
            covered = s < start
            outcome = "filled" if covered else ("short" if run else "failed")
            self.replays[outcome] += 1
            self.metrics.replays.labels(outcome).inc()
        if lost and not covered:
            await self._new_epoch(eng, republish=False)
        for batch in run:
            await self._apply(eng, batch, "replay")

    # -- the index (callers hold eng.lock) -----------------------------------------------------

    async def _new_epoch(self, eng: _Engine, *, republish: bool) -> bool:
        """Join the engine under a greater epoch: every entry recorded for it so far stops
        counting at once. ``republish`` re-adds what its holdings say it has; otherwise the
        holdings are forgotten too (events were lost, nobody knows what it has)."""
        engine_id, first = eng.source.engine_id, not eng.joined and eng.epoch == 0
        if not republish:
            eng.holdings.clear()
        eng.dirty = True  # until the join and the re-publication both went through
        try:
            known = max((n.epoch for n in await self._index.nodes() if n.node_id == engine_id), default=0)
            epoch = max(known, eng.epoch) + 1
            await self._index.join(engine_id, epoch, self._config.ttl_s)
            eng.epoch, eng.joined = epoch, True
            blocks = eng.holdings.snapshot()
            for i in range(0, len(blocks), INDEX_BATCH_BLOCKS):
                await self._index.add(eng.source.namespace, engine_id, epoch, blocks[i : i + INDEX_BATCH_BLOCKS])
        except PrefixIndexError as e:
            self._index_error("join", eng, e)
            return False
        eng.dirty = False
        if not first:
            reason = "index" if republish else "loss"
            self.epoch_bumps[reason] += 1
            self.metrics.epoch_bumps.labels(reason).inc()
            log.info("engine %s: epoch %d after %s (%d blocks re-published)", engine_id, epoch, reason, len(blocks))
        return True

    async def _apply(self, eng: _Engine, batch: EventBatch, source: str) -> None:
        self._count_events(batch)
        ops = self._plan(eng, batch)  # the holdings change even when the index cannot be written
        if eng.joined and not eng.dirty:
            try:
                await self._write(eng, ops)
            except StaleEpoch:
                eng.dirty = True  # the engine expired while quiet, or another writer displaced it
            except PrefixIndexError as e:
                eng.dirty = True
                self._index_error("write", eng, e)
        if eng.dirty and not await self._new_epoch(eng, republish=True):
            return  # the index is down; the heartbeat loop re-publishes once it answers
        eng.batches += 1
        self.metrics.batches.labels(source).inc()

    @staticmethod
    def _plan(eng: _Engine, batch: EventBatch) -> list[_Op]:
        ops: list[_Op] = []
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                eng.holdings.clear()
                ops.append(("clear", None))
                continue
            tier = medium_tier(event.medium) or TierName.GPU  # a medium newer than this code: vLLM's default
            group = event.group_idx or 0  # no group_idx: an engine with one KV-cache group
            keys = [block_key(h) for h in event.block_hashes]
            if isinstance(event, BlockStored):
                ops.append(("add", [(k, eng.holdings.store(k, tier, group)) for k in keys]))
                continue
            gone: list[bytes] = []
            kept: list[tuple[bytes, TierName]] = []  # still held in another medium, group or copy
            for k in keys:
                left = eng.holdings.remove(k, tier, group)
                if left is None:
                    gone.append(k)
                else:
                    kept.append((k, left))
            ops += [("remove", gone), ("add", kept)]
        return _coalesce(ops)

    async def _write(self, eng: _Engine, ops: list[_Op]) -> None:
        src, index, epoch = eng.source, self._index, eng.epoch
        for op, arg in ops:
            if op == "clear":
                await index.clear(src.engine_id, src.namespace)
                continue
            for i in range(0, len(arg), INDEX_BATCH_BLOCKS):
                chunk = arg[i : i + INDEX_BATCH_BLOCKS]
                if op == "add":
                    await index.add(src.namespace, src.engine_id, epoch, chunk)
                else:
                    await index.remove(src.namespace, src.engine_id, epoch, chunk)

    # -- counting -----------------------------------------------------------------------------

    def _count_events(self, batch: EventBatch) -> None:
        if batch.unknown_events:
            self.events["unknown"] += batch.unknown_events
            self.metrics.events.labels("unknown").inc(batch.unknown_events)
        for event in batch.events:
            kind = type(event).__name__
            self.events[kind] += 1
            self.metrics.events.labels(kind).inc()
            if not isinstance(event, AllBlocksCleared) and medium_tier(event.medium) is None:
                self.events["unknown_medium"] += 1
                self.metrics.events.labels("unknown_medium").inc()

    def _count_malformed(self, eng: _Engine, e: MalformedEvent) -> None:
        self.malformed[e.reason] += 1
        self.metrics.malformed.labels(e.reason).inc()
        log.warning("engine %s: skipped a message: %s", eng.source.engine_id, e)

    def _count_resync(self, kind: str) -> None:
        self.resyncs[kind] += 1
        self.metrics.resyncs.labels(kind).inc()

    def _index_error(self, op: str, eng: _Engine, e: PrefixIndexError) -> None:
        self.metrics.index_errors.labels(op).inc()
        log.warning("engine %s: index %s failed: %s", eng.source.engine_id, op, e)


def _coalesce(ops: list[_Op]) -> list[_Op]:
    """Merge runs of adds (or of removes) into one index call each, keeping their order.

    A batch of decode steps is many one-block BlockStored events: one index
    round trip for the run instead of one per event.
    """
    merged: list[_Op] = []
    for op, arg in ops:
        if op != "clear" and not arg:
            continue
        if op != "clear" and merged and merged[-1][0] == op:
            merged[-1] = (op, [*merged[-1][1], *arg])
        else:
            merged.append((op, arg))
    return merged
