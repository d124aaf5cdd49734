"""vLLM's KV events as vLLM puts them on the wire, and a test engine that publishes them.

The events are dicts in the structure vLLM's msgspec encoder writes, packed with msgpack
(tests/index/test_kv_events.py checks them against msgspec itself where it is installed).
:class:`TestEngine` is vLLM's ``ZmqEventPublisher`` minus the engine: multipart
``(topic, seq 8-byte big-endian, msgpack payload)`` on a real PUB socket bound to a free
127.0.0.1 port, and a real ROUTER replay socket serving its buffer the way
``ZmqEventPublisher._service_replay`` does.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import msgpack
import zmq

from kvstore.index.event_format import REPLAY_END

BIND_WAIT_S = 15.0  # a restarted engine's wait for its port


# ---- what vLLM puts on the wire ---------------------------------------------------------------


def stored(hashes, parent=None, tokens=None, block_size=16, lora_id=None, medium="GPU", lora_name=None, **extra):
    return dict(
        type="BlockStored",
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(tokens if tokens is not None else range(block_size * len(hashes))),
        block_size=block_size,
        lora_id=lora_id,
        medium=medium,
        lora_name=lora_name,
        **extra,
    )


def removed(hashes, medium="GPU", **extra):
    return dict(type="BlockRemoved", block_hashes=list(hashes), medium=medium, **extra)


def cleared():
    return dict(type="AllBlocksCleared")


def wire_event(event: dict, encoding: str) -> Any:
    """One event as msgspec encodes it.

    ``array``: ``KVCacheEvent(array_like=True, omit_defaults=True, tag=True)`` -- the tag
    (the class name) first, then every field in declaration order (msgspec writes the
    trailing defaults too). ``map``: ``tag=True`` without ``array_like`` -- a map with
    ``"type"`` first and fields equal to their default (``None`` after the required ones)
    left out.
    """
    fields = {k: v for k, v in event.items() if k != "type"}
    if encoding == "array":
        return [event["type"], *fields.values()]
    required = {"BlockStored": 7, "BlockRemoved": 2, "AllBlocksCleared": 0}[event["type"]]  # no default in vLLM
    kept = {k: v for i, (k, v) in enumerate(fields.items()) if i < required or v is not None}
    return {"type": event["type"], **kept}


def wire_batch(events: list[dict], encoding: str, ts: float = 1722000000.25, dp_rank: int | None = 0) -> bytes:
    """``array``: ``EventBatch(array_like=True)`` of tagged arrays; ``map``: the newest vLLM,
    a map batch of tagged maps; ``mixed``: an array batch of tagged maps (the releases
    between)."""
    ev_encoding = "array" if encoding == "array" else "map"
    evs = [wire_event(e, ev_encoding) for e in events]
    if encoding == "map":
        obj: Any = {"ts": ts, "events": evs, "data_parallel_rank": dp_rank}
    else:
        obj = [ts, evs, dp_rank]
    return msgpack.packb(obj, use_bin_type=True)


# ---- a test engine: vLLM's ZmqEventPublisher, minus the engine --------------------------------


class TestEngine:
    __test__ = False

    def __init__(self, ctx: zmq.Context, *, replay: bool = False, buffer_steps: int = 10_000, topic: bytes = b"",
                 port: int | None = None, replay_port: int | None = None) -> None:
        """``port``, ``replay_port``: given ones (a subscriber already waits there), else free ones."""
        self.ctx = ctx
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if port is None:
            self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        else:
            self.port = port
            self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.topic = topic
        self.seq = 0
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self.replay_endpoint: str | None = None
        self.replay_requests: list[int] = []
        self._stop = threading.Event()
        self.replay_gate = threading.Event()  # cleared: a replay request waits (after it is recorded)
        self.replay_gate.set()
        self._thread: threading.Thread | None = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            if replay_port is None:
                rport = self.router.bind_to_random_port("tcp://127.0.0.1")
            else:
                rport = replay_port
                self.router.bind(f"tcp://127.0.0.1:{rport}")
            self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def _serve_replay(self) -> None:
        # vLLM ZmqEventPublisher._service_replay, as published.
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            frame = self.router.recv_multipart()
            if len(frame) != 3:
                continue
            client_id, _, start_seq_bytes = frame
            start_seq = int.from_bytes(start_seq_bytes, "big")
            self.replay_requests.append(start_seq)
            while not self.replay_gate.wait(0.02):
                if self._stop.is_set():
                    return
            with self._lock:
                buffered = list(self.buffer)
            for seq, buf in buffered:
                if seq >= start_seq:
                    self.router.send_multipart((client_id, b"", seq.to_bytes(8, "big"), buf))
            self.router.send_multipart((client_id, b"", REPLAY_END, b""))

    def publish_payload(self, payload: bytes, *, send: bool = True) -> int:
        """Publish one batch under the next seq; ``send=False`` loses it on the way (as at a
        full high-water mark) while it stays in the replay buffer."""
        seq = self.seq
        self.seq += 1
        with self._lock:
            self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        return seq

    def publish(self, events: list[dict], encoding: str = "array", *, send: bool = True) -> int:
        return self.publish_payload(wire_batch(events, encoding), send=send)

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def restart(self) -> None:
        """A new engine process on the same address: seq starts again at 0, nothing buffered."""
        self.seq = 0
        with self._lock:
            self.buffer.clear()

    def restart_process(self, *published: list[dict]) -> None:
        """:meth:`restart`, its PUB socket closed and bound again, so subscribers see a disconnect
        and connect anew (as to a new process); ``published``: the new process's first batches,
        sent before any subscriber is back (so only its replay buffer has them)."""
        self.pub.close(linger=0)
        self.restart()
        for events in published:
            self.publish(events, send=False)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        end = time.monotonic() + BIND_WAIT_S
        while True:
            try:
                self.pub.bind(self.endpoint)
                return
            except zmq.ZMQError:  # the closed socket's port, released by ZMQ's I/O thread shortly
                if time.monotonic() > end:
                    raise
                time.sleep(0.01)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self.router.close(linger=0)
        self.pub.close(linger=0)
