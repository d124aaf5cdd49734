"""KV events out of the reference engine, on vLLM's wire (what :mod:`kvstore.index.event_format` reads).

The engine tells the fleet which prefix blocks its own cache holds, as vLLM does: a ZMQ PUB
socket sends ``(topic, seq, payload)`` per batch, ``seq`` 8 bytes big-endian counting from 0,
``payload`` msgpack of ``[ts, [event, ...], data_parallel_rank]`` with positional events tagged
by type name (``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name, extra_keys, group_idx]``, ``["BlockRemoved", block_hashes, medium, group_idx]``,
``["AllBlocksCleared"]``). Block hashes are the 64-bit event form of the vLLM chain keys.

An optional ROUTER replay socket answers ``(b"", start_seq)`` with every buffered batch from
``start_seq`` and then the end marker, so a subscriber that connects late (or lost messages at
its high-water mark) catches up rather than waiting for the blocks to be stored again.

Why a thread: ZMQ sockets belong to one thread, and the engine's compute thread must never wait
on a slow subscriber. The compute thread hands batches to a bounded queue; the publisher thread
owns both sockets. When the queue is full a batch is dropped and counted; subscribers then see
a ``seq`` gap (seq is assigned on send, so the gap shows as lost history: the replay buffer
cannot have it, and the index drops the engine's entries instead of keeping wrong ones).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import zmq

log = logging.getLogger(__name__)

SEQ_BYTES = 8
REPLAY_END = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
MEDIUM = "GPU"  # the engine's own KV memory, vLLM's name for the primary cache
MAX_QUEUED_BATCHES = 10_000
REPLAY_BUFFER_BATCHES = 10_000  # vLLM's default buffer_steps
MAX_REPLAY_REQUESTS_PER_POLL = 16


@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: tuple[int, ...]  # 64-bit event keys, parent first
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int

    def wire(self) -> list:
        return ["BlockStored", list(self.block_hashes), self.parent_block_hash, list(self.token_ids),
                self.block_size, None, MEDIUM, None, None, 0]


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: tuple[int, ...]

    def wire(self) -> list:
        return ["BlockRemoved", list(self.block_hashes), MEDIUM, 0]


@dataclass(frozen=True, slots=True)
class Cleared:
    def wire(self) -> list:
        return ["AllBlocksCleared"]


Event = Stored | Removed | Cleared


class EventSink:
    """Where the block cache reports changes; the in-process default keeps nothing."""

    def publish(self, events: Sequence[Event]) -> None:
        pass

    def close(self) -> None:
        pass

    @property
    def dropped_batches(self) -> int:
        return 0


class ZmqEventPublisher(EventSink):
    """Publishes event batches on ``endpoint`` (bound here), with replay on ``replay_endpoint``."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "",
                 max_queued: int = MAX_QUEUED_BATCHES, replay_batches: int = REPLAY_BUFFER_BATCHES) -> None:
        self._topic = topic.encode()
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=max_queued)
        self._replay: deque[tuple[int, bytes]] = deque(maxlen=replay_batches)
        self._seq = 0
        self._dropped = 0
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._router = None
        if replay_endpoint:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(replay_endpoint)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        log.info("KV events on %s (replay %s)", endpoint, replay_endpoint or "off")

    @property
    def dropped_batches(self) -> int:
        return self._dropped

    def publish(self, events: Sequence[Event]) -> None:
        if not events:
            return
        payload = msgpack.packb([time.time(), [e.wire() for e in events], 0], use_bin_type=True)
        try:
            self._queue.put_nowait(payload)
        except queue.Full:
            self._dropped += 1
            log.warning("KV-event queue full (%s batches): a batch of %s events is dropped",
                        self._queue.maxsize, len(events))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            while True:
                try:
                    payload = self._queue.get(timeout=0.05)
                except queue.Empty:
                    payload = b""
                if payload is None:
                    return
                if payload:
                    self._send(payload)
                self._serve_replays()
        finally:
            self._pub.close(linger=0)
            if self._router is not None:
                self._router.close(linger=0)

    def _send(self, payload: bytes) -> None:
        seq = self._seq.to_bytes(SEQ_BYTES, "big")
        self._replay.append((self._seq, payload))
        self._seq += 1
        self._pub.send_multipart([self._topic, seq, payload])

    def _serve_replays(self) -> None:
        if self._router is None:
            return
        for _ in range(MAX_REPLAY_REQUESTS_PER_POLL):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, rest = frames[0], [f for f in frames[1:] if f]
            if len(rest) != 1 or len(rest[0]) != SEQ_BYTES:
                log.warning("a replay request that is not (start_seq) is ignored")
                continue
            start = int.from_bytes(rest[0], "big")
            for seq, payload in list(self._replay):
                if seq >= start:
                    self._router.send_multipart([identity, b"", seq.to_bytes(SEQ_BYTES, "big"), payload])
            self._router.send_multipart([identity, b"", REPLAY_END, b""])
