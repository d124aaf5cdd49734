"""vLLM KV events into the prefix index, over real ZMQ sockets, byte for byte as vLLM sends them.

A test engine publishes on a real PUB socket bound to a free 127.0.0.1 port: multipart
``(topic, seq 8-byte big-endian, msgpack payload)``, the payload built with msgpack in the
exact structure vLLM's msgspec encoder writes (checked against msgspec itself where it is
installed). Its replay socket is a real ROUTER serving its buffer the way
``ZmqEventPublisher._service_replay`` does. The index is the real MemoryIndex (the
KV-cache group tests run against a real redis-server too).

Each test runs its coroutine with ``asyncio.run``. Waits are bounded polls, never timing
assertions; the ZMQ slow joiner is handled by publishing empty probe batches until the
subscriber has applied one.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from prometheus_client import CollectorRegistry

from kvstore.block import TierName
from kvstore.errors import IndexUnavailable
from kvstore.index.base import Holder, NodeMatch
from kvstore.index.event_format import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    MalformedEvent,
    block_key,
    decode_batch,
    medium_tier,
    split_message,
)
from kvstore.index.events import EngineSource, KVEventSubscriber, SubscriberConfig
from kvstore.index.keys import BlockHasher, event_key_bytes
from kvstore.index.memory import MemoryIndex
from tests.support.vllm_events import TestEngine, cleared, removed, stored, wire_batch

VECTOR_PATH = Path(__file__).resolve().parents[1] / "data" / "vllm_kv_events" / "base_seed42_block16.json"
NS = "llama-3-8b"
ENGINE = "engine-a"
WAIT_S = 15.0


# ---------------------------------------------------------------------------------------------
# Hashes and keys (the events and the engine that publishes them: tests/support/vllm_events.py)


def h(i: int) -> int:
    """A 64-bit event hash, spread over the whole range (some above 2**63)."""
    return (i * 0x9E3779B97F4A7C15 + 0x1234567) & ((1 << 64) - 1)


def k(i: int) -> bytes:
    return h(i).to_bytes(8, "big")


async def eventually(predicate, what: str, timeout: float = WAIT_S):
    """Poll ``predicate`` (sync or async) until truthy; fail, never assert a duration."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > end:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


async def sync(engine: TestEngine, sub: KVEventSubscriber, engine_id: str = ENGINE) -> None:
    """Beat the ZMQ slow joiner: publish empty batches until the subscriber applied one."""
    end = time.monotonic() + WAIT_S
    while True:
        seq = engine.publish([])
        for _ in range(20):
            await asyncio.sleep(0.01)
            if sub.status(engine_id).last_seq == seq and sub.status(engine_id).batches:
                return
        if time.monotonic() > end:
            pytest.fail("the subscriber never received a probe batch")


async def flush(engine: TestEngine, sub: KVEventSubscriber, engine_id: str = ENGINE) -> None:
    """Wait until everything published so far has been applied (ZMQ keeps per-peer order)."""
    seq = engine.publish([])
    if sub.status(engine_id).last_seq == seq:  # the engine's previous incarnation ended at this seq
        seq = engine.publish([])
    await eventually(lambda: sub.status(engine_id).last_seq == seq, f"seq {seq} applied")


class Harness:
    def __init__(
        self,
        *,
        replay: bool = False,
        buffer_steps: int = 10_000,
        config: SubscriberConfig | None = None,
        index: MemoryIndex | None = None,
    ):
        self.ctx = zmq.Context()
        self.engine = TestEngine(self.ctx, replay=replay, buffer_steps=buffer_steps)
        self.index = index if index is not None else MemoryIndex()
        self.registry = CollectorRegistry()
        self.source = EngineSource(self.engine.endpoint, ENGINE, NS, replay_endpoint=self.engine.replay_endpoint)
        self.sub = KVEventSubscriber(
            self.index, [self.source], config or SubscriberConfig(replay_timeout_s=5.0), registry=self.registry
        )

    async def __aenter__(self) -> Harness:
        await self.sub.start()
        await sync(self.engine, self.sub)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.sub.stop()
        assert self.sub.failure is None, self.sub.failure
        self.engine.close()
        self.ctx.term()

    async def blocks(self, keys: list[bytes]) -> int:
        """Leading blocks of ``keys`` the engine holds, per the index."""
        matches = await self.index.lookup(NS, keys)
        return next((m.blocks for m in matches if m.node_id == ENGINE), 0)

    def metric(self, name: str, **labels) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


# ---------------------------------------------------------------------------------------------
# The parser


@pytest.mark.parametrize("encoding", ["array", "map", "mixed"])
def test_decode_every_encoding_to_the_same_batch(encoding):
    payload = wire_batch(
        [
            stored([h(1), h(2)], parent=h(0), tokens=range(32), lora_id=3, lora_name="ad", extra_keys=[None, ["ad"]]),
            removed([h(1)], medium="CPU"),
            cleared(),
        ],
        encoding,
        dp_rank=2,
    )
    batch = decode_batch(payload)
    assert batch == EventBatch(
        ts=1722000000.25,
        events=(
            BlockStored((h(1), h(2)), h(0), tuple(range(32)), 16, 3, "GPU", "ad", (None, ["ad"])),
            BlockRemoved((h(1),), "CPU"),
            AllBlocksCleared(),
        ),
        data_parallel_rank=2,
    )


def test_decode_oldest_release_and_unknown_trailing_fields():
    # vLLM's first release: [ts, events], BlockStored without medium, BlockRemoved bare.
    old = msgpack.packb(
        [1.5, [["BlockStored", [h(1)], None, [1, 2], 2, None], ["BlockRemoved", [h(1)]], ["AllBlocksCleared"]]]
    )
    batch = decode_batch(old)
    assert batch.data_parallel_rank is None
    assert batch.events == (BlockStored((h(1),), None, (1, 2), 2), BlockRemoved((h(1),)), AllBlocksCleared())
    # A future release: more trailing fields, more map keys, more batch fields.
    future = msgpack.packb(
        [
            2.0,
            [
                ["BlockStored", [h(1)], None, [1], 1, None, "GPU", None, None, 0, "full", None, "new"],
                {"type": "BlockRemoved", "block_hashes": [h(1)], "medium": "GPU", "group_idx": 1, "new": [1]},
            ],
            0,
            "something new",
        ]
    )
    batch = decode_batch(future)
    assert batch.events == (BlockStored((h(1),), None, (1,), 1, None, "GPU", group_idx=0), BlockRemoved((h(1),), "GPU", 1))


def test_decode_counts_and_skips_unknown_event_types():
    payload = msgpack.packb(
        [0.0, [["BlockAccessed", [h(1)], "req"], {"type": "SomethingNew"}, ["BlockRemoved", [h(2)], "GPU"]], 0]
    )
    batch = decode_batch(payload)
    assert batch.unknown_events == 2
    assert batch.events == (BlockRemoved((h(2),), "GPU"),)


def test_decode_digest_bytes_and_signed_hashes():
    digest = bytes(range(32))
    batch = decode_batch(wire_batch([stored([digest, -1])], "map"))
    assert batch.events[0].block_hashes == (digest, (1 << 64) - 1)
    assert block_key(digest) == event_key_bytes(digest) == digest[-8:]
    assert block_key(h(7)) == event_key_bytes(h(7)) == k(7)


GOOD = wire_batch([stored([h(1)])], "array")


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b"", "msgpack"),
        (b"\xc1", "msgpack"),  # a byte msgpack never uses
        (GOOD[:-3], "msgpack"),  # truncated
        (GOOD + b"\x00", "msgpack"),  # trailing bytes
        (b"\x93\xcb\x41", "msgpack"),  # truncated inside a float
        (msgpack.packb(7), "batch"),
        (msgpack.packb([1.0]), "batch"),
        (msgpack.packb(["ts", []]), "batch"),
        (msgpack.packb([1.0, {"a": 1}]), "batch"),
        (msgpack.packb([1.0, [], "rank"]), "batch"),
        (msgpack.packb({"ts": 1.0}), "batch"),
        (msgpack.packb([1.0, [5]]), "event"),
        (msgpack.packb([1.0, [[]]]), "event"),
        (msgpack.packb([1.0, [[7, [1]]]]), "event"),
        (msgpack.packb([1.0, [["BlockStored", [h(1)], None, [1]]]]), "event"),  # block_size missing
        (msgpack.packb([1.0, [["BlockRemoved"]]]), "event"),
        (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]), "event"),
        (msgpack.packb([1.0, [{"block_hashes": [1]}]]), "event"),
        (msgpack.packb([1.0, [["BlockRemoved", h(1)]]]), "event"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, [1], "16"]]]), "event"),
        (msgpack.packb([1.0, [["BlockRemoved", [1], 5]]]), "event"),
        (msgpack.packb([1.0, [["BlockRemoved", ["abc"]]]]), "hash"),
        (msgpack.packb([1.0, [["BlockRemoved", [True]]]]), "hash"),
        (msgpack.packb([1.0, [["BlockRemoved", [1.5]]]]), "hash"),
        (msgpack.packb([1.0, [["BlockRemoved", [b""]]]], use_bin_type=True), "hash"),
        (msgpack.packb([1.0, [["BlockStored", [1], 1.5, [1], 1]]]), "hash"),
    ],
)
def test_decode_rejects_malformed_payloads(payload, reason):
    with pytest.raises(MalformedEvent) as e:
        decode_batch(payload)
    assert e.value.reason == reason


def test_decode_rejects_oversized_payload():
    with pytest.raises(MalformedEvent) as e:
        decode_batch(GOOD, max_bytes=len(GOOD) - 1)
    assert e.value.reason == "too_large"


def test_split_message():
    assert split_message([b"kv", (5).to_bytes(8, "big"), b"x"]) == (b"kv", 5, b"x")
    with pytest.raises(MalformedEvent) as e:
        split_message([b"", b"x"])
    assert e.value.reason == "frames"
    with pytest.raises(MalformedEvent) as e:
        split_message([b"", b"\x00\x01", b"x"])
    assert e.value.reason == "seq"


def test_medium_tiers():
    assert medium_tier(None) is TierName.GPU
    assert medium_tier("GPU") is TierName.GPU
    assert medium_tier("CPU") is TierName.HOST
    assert medium_tier("Disk") is TierName.DISK  # vllm/v1/kv_offload/mediums.py spells it so
    assert medium_tier("NVLINK_PEER") is None


def test_wire_bytes_equal_msgspec_encoder():
    """The payloads these tests publish are the bytes vLLM's own structs encode to."""
    msgspec = pytest.importorskip("msgspec")

    # vllm/distributed/kv_events.py, array_like release (with medium, lora_name, data_parallel_rank).
    class EventBatchA(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class EventA(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStoredA(EventA, tag="BlockStored"):
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class BlockRemovedA(EventA, tag="BlockRemoved"):
        block_hashes: list[int | bytes]
        medium: str | None

    class AllBlocksClearedA(EventA, tag="AllBlocksCleared"):
        pass

    # The newest release: a map batch, tagged-map events, extra_keys and group_idx defaulted.
    class EventBatchM(msgspec.Struct, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class EventM(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStoredM(EventM, tag="BlockStored"):
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[Any] | None = None
        group_idx: int | None = None

    class BlockRemovedM(EventM, tag="BlockRemoved"):
        block_hashes: list[int | bytes]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksClearedM(EventM, tag="AllBlocksCleared"):
        pass

    enc = msgspec.msgpack.Encoder()
    ours = [stored([h(1), h(2), b"\x07" * 32], parent=h(0), tokens=range(32)), removed([h(1)]), cleared()]
    a = EventBatchA(
        ts=1722000000.25,
        events=[
            BlockStoredA([h(1), h(2), b"\x07" * 32], h(0), list(range(32)), 16, None, "GPU", None),
            BlockRemovedA([h(1)], "GPU"),
            AllBlocksClearedA(),
        ],
        data_parallel_rank=0,
    )
    assert enc.encode(a) == wire_batch(ours, "array")
    m = EventBatchM(
        ts=1722000000.25,
        events=[
            BlockStoredM([h(1), h(2), b"\x07" * 32], h(0), list(range(32)), 16, None, "GPU", None),
            BlockRemovedM([h(1)], "GPU"),
            AllBlocksClearedM(),
        ],
        data_parallel_rank=0,
    )
    assert enc.encode(m) == wire_batch(ours, "map")
    assert decode_batch(enc.encode(a)) == decode_batch(enc.encode(m))


# ---------------------------------------------------------------------------------------------
# The subscriber, over real sockets, into the real index


@pytest.mark.parametrize("encoding", ["array", "map", "mixed"])
def test_stored_removed_cleared_reach_the_index(encoding):
    async def main():
        async with Harness() as t:
            e, epoch = t.engine, t.sub.epoch(ENGINE)
            chain = [k(i) for i in range(4)]
            e.publish([stored([h(0), h(1), h(2)]), stored([h(3)], parent=h(2))], encoding)
            await flush(e, t.sub)
            assert await t.index.lookup(NS, chain) == [NodeMatch(ENGINE, 4, TierName.GPU)]
            assert await t.index.holders(NS, chain[:1]) == [[Holder(ENGINE, TierName.GPU, epoch)]]

            e.publish([removed([h(2)])], encoding)
            await flush(e, t.sub)
            assert await t.blocks(chain) == 2

            e.publish([cleared()], encoding)
            await flush(e, t.sub)
            assert await t.index.lookup(NS, chain) == []
            assert await t.index.holders(NS, chain) == [[], [], [], []]

            e.publish([stored([h(9)])], encoding)
            await flush(e, t.sub)
            assert await t.blocks([k(9)]) == 1
            assert t.sub.epoch(ENGINE) == epoch  # nothing was lost
            assert t.sub.events["BlockStored"] == 3 and t.sub.events["BlockRemoved"] == 1
            assert t.sub.events["AllBlocksCleared"] == 1
            assert t.metric("strata_kv_events_total", type="BlockStored") == 3

    run(main())


def test_real_vllm_event_matches_router_keys():
    """A BlockStored captured from a real vLLM engine, published as vLLM does, is found under
    the keys a router computes from the prompt's tokens."""
    vector = json.loads(VECTOR_PATH.read_text())

    async def main():
        async with Harness() as t:
            event = stored(
                vector["block_hashes"],
                parent=vector["parent_block_hash"],
                tokens=vector["token_ids"],
                block_size=vector["block_size"],
                medium=vector["medium"],
            )
            t.engine.publish([event], "map")
            await flush(t.engine, t.sub)
            hasher = BlockHasher(block_size=vector["block_size"], hash_seed=vector["hash_seed"])
            keys = [event_key_bytes(x) for x in hasher.chain(vector["token_ids"])]
            assert await t.index.lookup(NS, keys) == [NodeMatch(ENGINE, 25, TierName.GPU)]

    run(main())


def test_mediums_map_to_tiers_and_removal_from_one_medium_keeps_the_others():
    async def main():
        async with Harness() as t:
            e = t.engine
            e.publish([stored([h(1), h(2)], medium="CPU"), stored([h(3)], medium="Disk")], "map")
            await flush(e, t.sub)
            holders = await t.index.holders(NS, [k(1), k(3)])
            assert [[x.tier for x in hs] for hs in holders] == [[TierName.HOST], [TierName.DISK]]

            e.publish([stored([h(1)], medium="GPU")], "map")  # on GPU again: its fastest copy
            await flush(e, t.sub)
            assert [x.tier for x in (await t.index.holders(NS, [k(1)]))[0]] == [TierName.GPU]

            e.publish([removed([h(1)], medium="GPU")], "map")  # the CPU copy remains
            await flush(e, t.sub)
            assert [x.tier for x in (await t.index.holders(NS, [k(1)]))[0]] == [TierName.HOST]

            e.publish([removed([h(1), h(2)], medium="CPU")], "map")
            await flush(e, t.sub)
            assert await t.index.holders(NS, [k(1), k(2)]) == [[], []]

            e.publish([stored([h(5)], medium="HBM-of-the-future")], "map")  # unknown: recorded at GPU
            await flush(e, t.sub)
            assert [x.tier for x in (await t.index.holders(NS, [k(5)]))[0]] == [TierName.GPU]
            assert t.sub.events["unknown_medium"] == 1

    run(main())


def test_seq_gap_without_replay_bumps_the_epoch():
    async def main():
        async with Harness() as t:
            e, epoch = t.engine, t.sub.epoch(ENGINE)
            e.publish([stored([h(1), h(2)])])
            await flush(e, t.sub)
            assert await t.blocks([k(1), k(2)]) == 2

            e.publish([removed([h(1)])], send=False)  # lost on the way: the index would lie
            e.publish([stored([h(7)])])
            await flush(e, t.sub)
            assert t.sub.resyncs["gap"] == 1
            assert t.sub.epoch(ENGINE) > epoch
            assert await t.index.holders(NS, [k(1), k(2)]) == [[], []]  # old entries gone at once
            assert await t.index.holders(NS, [k(7)]) == [[Holder(ENGINE, TierName.GPU, t.sub.epoch(ENGINE))]]
            assert t.metric("strata_kv_events_epoch_bumps_total", reason="loss") == 1

    run(main())


@pytest.mark.parametrize("first_seq_seen", [0, 2])
def test_seq_reset_means_a_restart_and_bumps_the_epoch(first_seq_seen):
    async def main():
        async with Harness() as t:
            e, epoch = t.engine, t.sub.epoch(ENGINE)
            e.publish([stored([h(i) for i in range(5)])])
            await flush(e, t.sub)
            assert await t.blocks([k(i) for i in range(5)]) == 5

            e.restart()
            for _ in range(first_seq_seen):
                e.publish([stored([h(50)])], send=False)
            e.publish([stored([h(100)])])
            await eventually(lambda: t.sub.resyncs["reset"] == 1, "the reset seen")
            await flush(e, t.sub)
            assert t.sub.epoch(ENGINE) > epoch
            assert await t.blocks([k(0)]) == 0
            assert await t.blocks([k(100)]) == 1
            assert await t.blocks([k(50)]) == 0  # lost with no replay socket: a miss, not a lie

    run(main())


def test_replay_fills_a_gap_without_an_epoch_bump():
    async def main():
        async with Harness(replay=True) as t:
            e, epoch = t.engine, t.sub.epoch(ENGINE)
            filled = t.sub.replays["filled"]
            e.publish([stored([h(1), h(2), h(3)])])
            await flush(e, t.sub)

            start = e.publish([removed([h(3)]), stored([h(10)])], send=False)
            e.publish([stored([h(11)]), removed([h(1)])], "map", send=False)
            e.publish([stored([h(12)])])
            await flush(e, t.sub)

            assert t.sub.resyncs["gap"] == 1
            assert t.sub.replays["filled"] == filled + 1
            assert start in e.replay_requests
            assert t.sub.epoch(ENGINE) == epoch  # nothing was dropped
            assert [len(x) for x in await t.index.holders(NS, [k(i) for i in (1, 2, 3, 10, 11, 12)])] == [0, 1, 0, 1, 1, 1]
            assert t.sub.status(ENGINE).batches >= 5

    run(main())


def test_short_replay_falls_back_to_an_epoch_bump_and_keeps_the_tail():
    async def main():
        async with Harness(replay=True, buffer_steps=3) as t:
            e, epoch = t.engine, t.sub.epoch(ENGINE)
            e.publish([stored([h(1)])])
            await flush(e, t.sub)
            # Four batches lost; the engine's replay buffer keeps the last three (with the live one).
            e.publish([stored([h(20)])], send=False)
            e.publish([removed([h(1)])], send=False)
            e.publish([stored([h(22)])], send=False)
            e.publish([stored([h(23)])], send=False)
            live = e.publish([stored([h(24)])])
            # No more publishing until the gap is handled, so the buffer stays as described.
            await eventually(lambda: t.sub.status(ENGINE).last_seq == live, "the gap handled")
            assert t.sub.replays["short"] == 1
            assert t.sub.epoch(ENGINE) > epoch
            # h(1) was removed in a batch nobody can replay: dropped by the bump, not kept as a lie.
            assert [len(x) for x in await t.index.holders(NS, [k(i) for i in (1, 20, 22, 23, 24)])] == [0, 0, 1, 1, 1]

    run(main())


def test_replay_after_a_restart_recovers_the_new_engines_first_batches():
    async def main():
        async with Harness(replay=True) as t:
            e, epoch = t.engine, t.sub.epoch(ENGINE)
            e.publish([stored([h(1)])])
            await flush(e, t.sub)
            e.restart()
            e.publish([stored([h(30)])], send=False)  # the new engine's seq 0, lost
            e.publish([stored([h(31)])])
            await flush(e, t.sub)
            assert t.sub.resyncs["reset"] == 1
            assert t.sub.epoch(ENGINE) > epoch
            assert [len(x) for x in await t.index.holders(NS, [k(1), k(30), k(31)])] == [0, 1, 1]

    run(main())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_what_an_engine_published_before_its_subscriber_joined_reaches_every_daemons_index(redis_url, request):
    """The slow joiner. A daemon usually starts before its engine, so its SUB socket joins after
    the engine bound its PUB, and a PUB sends only to the subscriptions it has seen: the
    engine's first batch (a first request's prompt) never arrives, and no later message need
    come to reveal it. The subscriber asks the engine's replay socket when it connects; the
    blocks are then in Redis for another daemon's index (the one a router's Score asks)."""
    from kvstore.index.redis import RedisIndex

    async def main():
        prefix = "t" + hashlib.blake2b(request.node.nodeid.encode(), digest_size=8).hexdigest()
        writer, reader = RedisIndex.from_url(redis_url, prefix=prefix), RedisIndex.from_url(redis_url, prefix=prefix)
        ctx = zmq.Context()
        port, replay_port = free_port(), free_port()
        source = EngineSource(f"tcp://127.0.0.1:{port}", ENGINE, NS, replay_endpoint=f"tcp://127.0.0.1:{replay_port}")
        sub = KVEventSubscriber(writer, [source], registry=CollectorRegistry())
        await sub.start()  # nothing listens there yet: its SUB socket retries
        engine = TestEngine(ctx, replay=True, port=port, replay_port=replay_port)
        try:
            engine.publish([stored([h(i) for i in range(4)])], send=False)  # dropped: no subscription yet
            chain = [k(i) for i in range(4)]  # and then the engine idles: no later batch shows the gap

            async def indexed():
                return await reader.lookup(NS, chain) == [NodeMatch(ENGINE, 4, TierName.GPU)]

            await eventually(indexed, "the blocks the engine published before the subscriber joined")
            assert sub.replays["filled"] == 1
            assert sub.epoch_bumps["loss"] == 0 and not sub.resyncs
        finally:
            await sub.stop()
            engine.close()
            ctx.term()
            await writer.close()
            await reader.close()
        assert sub.failure is None

    run(main())


def test_a_batch_both_replayed_at_connect_and_received_live_is_applied_once():
    async def main():
        t = Harness(replay=True)
        e = t.engine
        e.replay_gate.clear()  # the catch-up's request waits, with the lock held, while ...
        e.publish([stored([h(1)])], send=False)  # (published before the subscriber joined)
        await t.sub.start()
        try:
            await eventually(lambda: e.replay_requests == [0], "the catch-up's replay request")
            epoch = t.sub.epoch(ENGINE)

            def subscribed():  # unreadable frames consume no seq; they are only counted
                e.send_raw([b"", b"probe"])
                return t.sub.malformed["frames"] > 0

            await eventually(subscribed, "the subscription to reach the engine")
            e.publish([stored([h(2)])])  # ... this batch is sent live and buffered for the replay
            e.replay_gate.set()
            await flush(e, t.sub)
            assert t.sub.status(ENGINE).batches == 3  # h(1) and h(2) from the replay, the probe live
            assert not t.sub.resyncs and not t.sub.epoch_bumps  # the live copy is no restart
            assert t.sub.epoch(ENGINE) == epoch
            assert await t.blocks([k(1)]) == 1 and await t.blocks([k(2)]) == 1
        finally:
            await t.__aexit__(None, None, None)

    run(main())


def test_a_restart_seen_at_reconnect_drops_the_old_engines_blocks():
    """A new engine process that published past the old one's last seq before the subscriber
    connected again: its replay continues where the old stream stopped, seq for seq. The batch
    at the old last seq, asked again, differs from the one applied: the old blocks go."""

    async def main():
        async with Harness(replay=True) as t:
            e = t.engine
            e.publish([stored([h(1), h(2)])])
            await flush(e, t.sub)
            last, epoch = t.sub.status(ENGINE).last_seq, t.sub.epoch(ENGINE)
            e.restart_process(*([stored([h(100 + i)])] for i in range(last + 2)))
            await eventually(lambda: t.sub.resyncs["reset"] == 1, "the restart seen at the reconnect")
            await flush(e, t.sub)
            assert t.sub.epoch(ENGINE) > epoch
            assert await t.blocks([k(1)]) == 0
            # The new process's batches from the old last seq on are indexed; those before, a miss.
            assert [len(x) for x in await t.index.holders(NS, [k(100 + i) for i in range(last + 2)])] == (
                [0] * last + [1, 1]
            )

    run(main())


def test_malformed_messages_are_counted_and_later_events_still_apply():
    async def main():
        async with Harness() as t:
            e = t.engine
            epoch = t.sub.epoch(ENGINE)
            e.publish([stored([h(1)])])
            await flush(e, t.sub)

            # Unattributable garbage: no seq is consumed, nothing is lost, nothing bumps.
            e.send_raw([b"", b"not a seq"])  # two frames
            e.send_raw([b"", b"\x00\x01", GOOD])  # a 2-byte seq
            e.send_raw([b"", (1).to_bytes(8, "big"), b"x", b"y"])  # four frames
            # Unknown event types are skipped, the known ones in the same batch applied.
            mixed = [["BlockAccessed", [h(1)]], ["BlockStored", [h(2)], None, [], 16, None, "GPU"]]
            e.publish_payload(msgpack.packb([0.0, mixed, 0]))
            await flush(e, t.sub)
            assert dict(t.sub.malformed) == {"frames": 2, "seq": 1}
            assert t.sub.events["unknown"] == 1
            assert t.sub.epoch(ENGINE) == epoch
            assert await t.blocks([k(1)]) == 1 and await t.blocks([k(2)]) == 1

            # A batch with a seq but an unreadable payload is lost content: what it removed
            # could still be listed, so the engine's epoch moves on; later batches apply.
            e.publish_payload(GOOD[:-3])  # truncated
            e.publish_payload(b"\xc1\xc1garbage")
            e.publish_payload(msgpack.packb([1.0, [["BlockRemoved", ["not a hash"]]], 0]))
            e.publish([stored([h(3)])])
            await flush(e, t.sub)
            assert dict(t.sub.malformed) == {"frames": 2, "seq": 1, "msgpack": 2, "hash": 1}
            assert t.sub.epoch(ENGINE) > epoch
            assert await t.blocks([k(1)]) == 0
            assert await t.blocks([k(3)]) == 1
            assert t.metric("strata_kv_events_malformed_total", reason="msgpack") == 2
            assert t.metric("strata_kv_events_malformed_total", reason="frames") == 2
            assert t.sub.failure is None

    run(main())


def test_two_engines_one_subscriber():
    async def main():
        ctx = zmq.Context()
        a, b = TestEngine(ctx), TestEngine(ctx)
        index = MemoryIndex()
        sub = KVEventSubscriber(
            index, [EngineSource(a.endpoint, "a", NS), EngineSource(b.endpoint, "b", NS)], registry=CollectorRegistry()
        )
        await sub.start()
        try:
            await sync(a, sub, "a")
            await sync(b, sub, "b")
            a.publish([stored([h(1), h(2)])])
            b.publish([stored([h(1)])], "map")
            await flush(a, sub, "a")
            await flush(b, sub, "b")
            assert await index.lookup(NS, [k(1), k(2)]) == [NodeMatch("a", 2, TierName.GPU), NodeMatch("b", 1, TierName.GPU)]
            b.publish([removed([h(5)])], send=False)
            b.publish([])
            await flush(b, sub, "b")
            assert await index.lookup(NS, [k(1), k(2)]) == [NodeMatch("a", 2, TierName.GPU)]  # only b lost its entries
        finally:
            await sub.stop()
            a.close()
            b.close()
            ctx.term()
        assert sub.failure is None

    run(main())


@pytest.mark.slow  # waits out a real liveness timeout
def test_engine_stays_alive_while_connected_and_expires_once_gone():
    async def main():
        cfg = SubscriberConfig(ttl_s=1.0, heartbeat_interval_s=0.1, zmq_heartbeat_s=0.2)
        async with Harness(config=cfg) as t:
            e = t.engine
            e.publish([stored([h(1)])])
            await flush(e, t.sub)
            await eventually(lambda: t.sub.status(ENGINE).connected, "the monitor to report the connection")
            await asyncio.sleep(2.5 * cfg.ttl_s)  # no messages for longer than the TTL
            assert await t.blocks([k(1)]) == 1  # still connected: still heartbeated
            e.pub.close(linger=0)  # the engine goes away
            await eventually(lambda: not t.sub.status(ENGINE).connected, "the disconnect")

            async def gone():
                return await t.blocks([k(1)]) == 0

            await eventually(gone, "the engine's entries to expire")

    run(main())


def test_start_takes_a_fresh_epoch_and_stop_leave_drops_the_engine():
    async def main():
        ctx = zmq.Context()
        e = TestEngine(ctx)
        index = MemoryIndex()
        await index.join(ENGINE, 7, 30.0)
        await index.add(NS, ENGINE, 7, [(k(1), TierName.GPU)])  # left by an earlier subscriber
        sub = KVEventSubscriber(index, [EngineSource(e.endpoint, ENGINE, NS)], registry=CollectorRegistry())
        await sub.start()
        try:
            await sync(e, sub)
            assert sub.epoch(ENGINE) == 8
            assert await index.lookup(NS, [k(1)]) == []  # nobody vouches for it any more
        finally:
            await sub.stop(leave=True)
            e.close()
            ctx.term()
        assert [n for n in await index.nodes() if n.node_id == ENGINE and n.alive] == []
        await sub.stop()  # twice is harmless

    run(main())


def test_config_is_validated():
    from kvstore.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="half of ttl_s"):
        SubscriberConfig(ttl_s=1.0, heartbeat_interval_s=0.9)
    with pytest.raises(InvalidArgument, match="rcvhwm"):
        SubscriberConfig(rcvhwm=0)
    with pytest.raises(InvalidArgument, match="twice"):
        KVEventSubscriber(MemoryIndex(), [EngineSource("tcp://x:1", "e", NS)] * 2)


class FlakyIndex(MemoryIndex):
    """The real MemoryIndex, unreachable while ``down`` (as a Redis outage looks to a client)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise IndexUnavailable("index is down (test)")

    async def join(self, *a):
        self._check()
        return await super().join(*a)

    async def heartbeat(self, *a):
        self._check()
        return await super().heartbeat(*a)

    async def nodes(self):
        self._check()
        return await super().nodes()

    async def add(self, *a):
        self._check()
        return await super().add(*a)

    async def remove(self, *a):
        self._check()
        return await super().remove(*a)

    async def clear(self, *a):
        self._check()
        return await super().clear(*a)


def test_index_outage_is_repaired_from_the_events_without_losing_the_engine():
    async def main():
        index = FlakyIndex()
        cfg = SubscriberConfig(heartbeat_interval_s=0.05)
        async with Harness(index=index, config=cfg) as t:
            e = t.engine
            e.publish([stored([h(1), h(2)])])
            await flush(e, t.sub)
            index.down = True
            e.publish([removed([h(1)]), stored([h(3)])])  # events keep coming while the index is down
            e.publish([stored([h(4)], medium="CPU")])
            await flush(e, t.sub)
            assert t.metric("strata_kv_events_index_errors_total", op="write") >= 1
            index.down = False  # no new event needed: the heartbeat loop re-joins and re-publishes

            async def repaired():
                return [len(x) for x in await index.holders(NS, [k(i) for i in (1, 2, 3, 4)])] == [0, 1, 1, 1]

            await eventually(repaired, "the engine re-published after the outage")
            assert t.sub.epoch_bumps["index"] >= 1 and t.sub.epoch_bumps["loss"] == 0
            assert [x.tier for x in (await index.holders(NS, [k(4)]))[0]] == [TierName.HOST]

    run(main())


def test_an_engine_that_expired_while_quiet_is_re_published_on_its_next_event():
    async def main():
        now = [1000.0]
        index = MemoryIndex(clock=lambda: now[0])
        cfg = SubscriberConfig(ttl_s=30.0, heartbeat_interval_s=10.0)
        async with Harness(index=index, config=cfg) as t:
            e, epoch = t.engine, t.sub.epoch(ENGINE)
            e.publish([stored([h(1)])])
            await flush(e, t.sub)
            now[0] += 100  # past the TTL: the index drops the engine from answers
            assert await t.blocks([k(1)]) == 0
            e.publish([stored([h(2)])])  # the write meets StaleEpoch: re-join, re-publish, apply
            await flush(e, t.sub)
            assert t.sub.epoch(ENGINE) > epoch
            assert await t.blocks([k(1)]) == 1 and await t.blocks([k(2)]) == 1

    run(main())


def test_beyond_the_tracking_cap_a_removal_from_any_medium_drops_the_key():
    async def main():
        async with Harness(config=SubscriberConfig(max_tracked_blocks=2)) as t:
            e = t.engine
            e.publish([stored([h(1), h(2), h(3)]), stored([h(1), h(2), h(3)], medium="CPU")], "map")
            e.publish([removed([h(1), h(2), h(3)], medium="GPU")], "map")
            await flush(e, t.sub)
            tiers = [[x.tier for x in hs] for hs in await t.index.holders(NS, [k(1), k(2), k(3)])]
            assert tiers == [[TierName.HOST], [TierName.HOST], []]  # h(3) untracked: a miss, not a lie

    run(main())


# ---------------------------------------------------------------------------------------------
# Hybrid models: KV-cache groups (group_idx), in the embedded index and in Redis


def stored_in(group: int, hashes, **kw):
    """A BlockStored of one KV-cache group (extra_keys, the field before group_idx, unset)."""
    return stored(hashes, extra_keys=None, group_idx=group, **kw)


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.system)])
def make_index(request):
    """A factory of the index backend under test; call it inside the test's event loop."""
    if request.param == "memory":
        return MemoryIndex
    import hashlib

    from kvstore.index.redis import RedisIndex

    url = request.getfixturevalue("redis_url")
    prefix = "t" + hashlib.blake2b(request.node.nodeid.encode(), digest_size=8).hexdigest()
    return lambda: RedisIndex.from_url(url, prefix=prefix)


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_a_block_removed_from_one_group_stays_while_another_group_holds_it(make_index, encoding):
    """A hybrid model (full attention in group 0, a sliding window in group 1) stores each block
    for both groups; the window later drops old blocks from group 1 only."""

    async def main():
        index = make_index()
        try:
            async with Harness(index=index) as t:
                e, chain = t.engine, [k(i) for i in range(4)]
                e.publish([stored_in(g, [h(i) for i in range(4)]) for g in (0, 1)], encoding)
                await flush(e, t.sub)
                assert await t.blocks(chain) == 4

                e.publish([removed([h(0), h(1)], group_idx=1)], encoding)  # out of the window
                await flush(e, t.sub)
                assert await t.blocks(chain) == 4  # the full-attention group still holds them

                e.publish([removed([h(0)], group_idx=0)], encoding)  # gone from every group
                await flush(e, t.sub)
                assert await t.blocks(chain) == 0
                assert [len(x) for x in await t.index.holders(NS, chain)] == [0, 1, 1, 1]

                e.publish([removed([h(2)], group_idx=1)], encoding)
                e.publish([removed([h(2)], group_idx=0)], encoding)
                await flush(e, t.sub)
                assert [len(x) for x in await t.index.holders(NS, chain)] == [0, 1, 0, 1]

                # AllBlocksCleared empties every group: nothing is left to a later removal
                e.publish([stored_in(0, [h(5)]), stored_in(1, [h(5)]), cleared()], encoding)
                e.publish([stored_in(1, [h(6)])], encoding)
                await flush(e, t.sub)
                assert [len(x) for x in await t.index.holders(NS, [k(1), k(3), k(5), k(6)])] == [0, 0, 0, 1]
                assert t.sub.epoch_bumps["loss"] == 0
        finally:
            await index.close()

    run(main())


def test_groups_and_mediums_together_keep_the_fastest_copy(make_index):
    async def main():
        index = make_index()
        try:
            async with Harness(index=index) as t:
                e = t.engine
                e.publish([stored_in(1, [h(1)], medium="GPU"), stored_in(0, [h(1)], medium="CPU")], "map")
                await flush(e, t.sub)
                assert [x.tier for x in (await t.index.holders(NS, [k(1)]))[0]] == [TierName.GPU]
                e.publish([removed([h(1)], medium="GPU", group_idx=0)], "map")  # no such copy: nothing changes
                await flush(e, t.sub)
                assert [x.tier for x in (await t.index.holders(NS, [k(1)]))[0]] == [TierName.GPU]
                e.publish([removed([h(1)], medium="GPU", group_idx=1)], "map")
                await flush(e, t.sub)
                assert [x.tier for x in (await t.index.holders(NS, [k(1)]))[0]] == [TierName.HOST]
                e.publish([removed([h(1)], medium="CPU", group_idx=0)], "map")
                await flush(e, t.sub)
                assert await t.index.holders(NS, [k(1)]) == [[]]
        finally:
            await index.close()

    run(main())


def test_two_copies_of_one_hash_in_one_group_need_two_removals():
    """vLLM's block pool can cache two physical blocks under one hash; it sends a BlockStored
    for each and a BlockRemoved for each (its kv-events wire tests say so)."""

    async def main():
        async with Harness() as t:
            e = t.engine
            e.publish([stored([h(1), h(2)])], "map")
            e.publish([stored([h(1), h(2)])], "map")  # second copy, same group and medium
            e.publish([removed([h(1), h(2)])], "map")
            await flush(e, t.sub)
            assert await t.blocks([k(1), k(2)]) == 2
            e.publish([removed([h(1)])], "map")
            await flush(e, t.sub)
            assert await t.blocks([k(1), k(2)]) == 0 and await t.blocks([k(2)]) == 1
            e.publish([removed([h(1)])], "map")  # one removal too many: nothing to drop, no error
            await flush(e, t.sub)
            assert t.sub.epoch_bumps["loss"] == 0

    run(main())


def test_events_without_group_idx_are_one_group():
    async def main():
        async with Harness() as t:
            e = t.engine
            e.publish([stored([h(1)])], "array")  # no group_idx at all (older releases)
            e.publish([removed([h(1)], group_idx=0)], "map")
            await flush(e, t.sub)
            assert await t.blocks([k(1)]) == 0

    run(main())


@pytest.mark.parametrize("group", [-1, 256, 1 << 40, True, "1"])
def test_decode_rejects_a_group_idx_out_of_range(group):
    payload = wire_batch([removed([h(1)], group_idx=group)], "map")
    with pytest.raises(MalformedEvent, match="group_idx") as err:
        decode_batch(payload)
    assert err.value.reason == "event"


def test_beyond_the_tracking_cap_a_removal_from_any_group_drops_the_key():
    async def main():
        async with Harness(config=SubscriberConfig(max_tracked_blocks=2)) as t:
            e = t.engine
            e.publish([stored_in(g, [h(1), h(2), h(3)]) for g in (0, 1)], "map")
            e.publish([removed([h(1), h(2), h(3)], group_idx=1)], "map")
            await flush(e, t.sub)
            assert [len(x) for x in await t.index.holders(NS, [k(1), k(2), k(3)])] == [1, 1, 0]  # a miss, not a lie

    run(main())
