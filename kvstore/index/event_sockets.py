"""One vLLM engine's KV-event sockets: its SUB socket, the monitor beside it, the tasks that read
them, and the requests to its replay socket.

The wire format is :mod:`kvstore.index.event_format`; what is done with each message, each
connection and each replayed batch is :mod:`kvstore.index.events`, through the callbacks
:class:`EngineSockets` is given.

ZMQ's receive high-water mark is the only queue: what overflows it is dropped, and so is a
connection that brings a message over the payload limit; either is seen as a ``seq`` gap. ZMTP
heartbeats make a dead peer a disconnect. The monitor reports each handshake and each
disconnect: that is whether the engine counts as connected, and each handshake starts a
catch-up (why, in :mod:`kvstore.index.events`).

A replay request takes a DEALER socket of its own for one exchange, bounded by
``replay_timeout_s`` and ``max_replay_batches``; a REQ socket would take only the first reply.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio
from prometheus_client import Gauge
from zmq.utils.monitor import parse_monitor_message

from kvstore.index.event_format import R_FRAMES, REPLAY_END, SEQ_BYTES, EventBatch, MalformedEvent, decode_batch

if TYPE_CHECKING:  # the subscriber's module imports this one
    from kvstore.index.events import EngineSource, SubscriberConfig

log = logging.getLogger(__name__)

Spawn = Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]]  # starts a task the subscriber watches


def _digest(payload: bytes) -> bytes:
    """A batch's identity: its seq alone cannot tell a restarted engine's batch from the one
    replay already gave (the payload carries the batch's timestamp)."""
    return hashlib.blake2b(payload, digest_size=16).digest()


@dataclass(frozen=True, slots=True)
class _Replayed:
    batch: EventBatch
    digest: bytes


class EngineSockets:
    """One engine's SUB socket and its monitor, the two tasks reading them, and its replay
    requests; ``connected`` is what the monitor last said (False while closed)."""

    def __init__(
        self,
        source: EngineSource,
        config: SubscriberConfig,
        connected_gauge: Gauge,
        *,
        on_open: Callable[[], Awaitable[None]],
        on_message: Callable[[list[bytes]], Awaitable[None]],
        on_connect: Callable[[], Awaitable[None]],
        on_malformed: Callable[[MalformedEvent], None],
    ) -> None:
        """``on_open`` runs before the first message is read, ``on_message`` for each one,
        ``on_connect`` at each handshake; ``on_malformed`` hears of each replay reply that
        cannot be read."""
        self._source = source
        self._config = config
        self._gauge = connected_gauge  # of all engines: those whose event socket is connected
        self._on_open = on_open
        self._on_message = on_message
        self._on_connect = on_connect
        self._on_malformed = on_malformed
        self.connected = False
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._sockets: list[zmq.asyncio.Socket] = []

    def open(self, ctx: zmq.asyncio.Context, spawn: Spawn) -> None:
        """Connect the SUB socket and its monitor, and start their tasks through ``spawn``."""
        self._ctx = ctx
        cfg = self._config
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, cfg.rcvhwm)
        # A message over the limit makes ZMQ drop the connection; the seq gap that
        # follows is handled like any other loss.
        sub.setsockopt(zmq.MAXMSGSIZE, cfg.max_payload_bytes + 4096)
        ivl_ms = int(cfg.zmq_heartbeat_s * 1000)
        sub.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ivl_ms)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, int(cfg.reconnect_max_s * 1000))
        sub.setsockopt(zmq.SUBSCRIBE, self._source.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sub.connect(self._source.endpoint)
        self._sockets += [sub, monitor]
        self._tasks.append(spawn(self._receive(sub), f"kv-events-{self._source.engine_id}"))
        self._tasks.append(spawn(self._watch(monitor), f"kv-events-monitor-{self._source.engine_id}"))

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        sockets, self._sockets = self._sockets, []
        for s in sockets:
            s.close(linger=0)
        if self.connected:
            self.connected = False
            self._gauge.dec()

    # -- the loops ----------------------------------------------------------------------------

    async def _receive(self, sub: zmq.asyncio.Socket) -> None:
        await self._on_open()
        while True:
            frames = await sub.recv_multipart()
            await self._on_message(frames)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            connected = event == zmq.EVENT_HANDSHAKE_SUCCEEDED
            if connected != self.connected:
                self.connected = connected
                self._gauge.inc(1 if connected else -1)
                log.info("KV events of engine %s: %s", self._source.engine_id, "connected" if connected else "disconnected")
            if connected:
                await self._on_connect()

    # -- replay -------------------------------------------------------------------------------

    async def fetch_replay(self, endpoint: str, start: int, end: int | None) -> dict[int, _Replayed]:
        """Batches ``start .. end-1`` (``end`` None: all from ``start``) the engine's replay
        socket still has (maybe none), at most ``max_replay_batches``."""
        assert self._ctx is not None
        cfg = self._config
        got: dict[int, _Replayed] = {}
        sock = self._ctx.socket(zmq.DEALER)  # a REQ socket would take only the first reply
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, cfg.max_replay_batches + 1)
        sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_payload_bytes + 4096)
        deadline = time.monotonic() + cfg.replay_timeout_s
        try:
            sock.connect(endpoint)
            await sock.send_multipart([b"", start.to_bytes(SEQ_BYTES, "big")])
            for _ in range(cfg.max_replay_batches + 1):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not await sock.poll(remaining * 1000):
                    break
                frames = await sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) != 2 or len(frames[0]) != SEQ_BYTES:
                    self._on_malformed(MalformedEvent(R_FRAMES, "a replay reply is not (seq, payload)"))
                    break
                if frames[0] == REPLAY_END:
                    break
                seq = int.from_bytes(frames[0], "big")
                if start <= seq and (end is None or seq < end) and len(got) < cfg.max_replay_batches:
                    try:
                        batch = decode_batch(frames[1], max_bytes=cfg.max_payload_bytes)
                        got[seq] = _Replayed(batch, _digest(frames[1]))
                    except MalformedEvent as e:
                        self._on_malformed(e)
                if end is not None and seq >= end - 1:
                    break  # the rest is what the live socket brings
        finally:
            sock.close(linger=0)
        return got
