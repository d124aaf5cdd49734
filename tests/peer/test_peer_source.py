"""The peer source's choices, in one process: which holders it tries, in what order, what it repairs.

The index is a real :class:`MemoryIndex`; the holders are served by
:class:`DictTransport`, an in-process :class:`PeerTransport` over each
node's own blocks (a real transport of the contract, as MemoryRemote is a
real remote source) that records whom it was asked and can answer as a
holder that lost the block, died, or damaged it. The multi-process tests
(``test_peer_tier.py``) run the same rules over real daemons.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from kvstore.block import BlockKey, BlockMeta, TierName, checksum
from kvstore.errors import CorruptBlock, InvalidArgument, TierUnavailable
from kvstore.index.memory import MemoryIndex
from kvstore.peer.base import PeerStats, PeerTransport
from kvstore.remote.base import MISS, ReadResult
from kvstore.remote.bridge import RemoteBridge
from kvstore.remote.memory import MemoryRemote
from kvstore.peer.source import PeerLimits, PeerSource
from kvstore.tiers.remote import RemoteTier

NS = "ns"
TTL = 60.0


class DictTransport(PeerTransport):
    scheme = "mem"

    def __init__(self) -> None:
        self.blocks: dict[str, dict[bytes, bytes]] = {}  # address -> its blocks
        self.dead: set[str] = set()
        self.corrupting: set[str] = set()
        self.asked: list[str] = []

    async def read(self, address, namespace, keys, place, deadline):
        self.asked.append(address)
        if address in self.dead:
            raise TierUnavailable(f"{address}: connection refused")
        out = []
        for i, key in enumerate(keys):
            data = self.blocks.get(address, {}).get(key)
            if data is None:
                out.append(MISS)
                continue
            meta = BlockMeta(len(data), checksum(data))
            view = place(i, meta)
            if view is None:
                out.append(ReadResult.skipped(meta))
                continue
            view[: len(data)] = data
            if address in self.corrupting:
                view[0] ^= 0xFF
                out.append(ReadResult.failed(CorruptBlock(f"{address}: checksum mismatch")))
                continue
            out.append(ReadResult.hit(meta))
        return out

    async def lookup(self, address, namespace, keys, deadline):
        return [None] * len(keys)

    async def close(self) -> None:
        pass

    def stats(self) -> PeerStats:
        return PeerStats(self.scheme, 0, 0, 0, 0, 0, 0, 0, 0, 0)


async def fleet(*nodes: tuple[str, str], blocks: dict[str, bytes] | None = None):
    """An index with nodes (id, host) at epoch 1, each advertising mem://HOST:PORT; ``blocks``:
    node id -> the value it holds under key b"k" (and publishes)."""
    ix, transport = MemoryIndex(), DictTransport()
    for n, (node, host) in enumerate(nodes):
        address = f"mem://{host}:{7000 + n}"
        await ix.join(node, 1, TTL, address=f"{host}:{7000 + n}", transports=[address])
        if blocks and node in blocks:
            transport.blocks[address] = {b"k": blocks[node]}
    return ix, transport


def source(ix, transport, **limits) -> PeerSource:
    return PeerSource(ix, "me", host="10.0.0.1", schemes=("mem",), transports={"mem": transport},
                      limits=PeerLimits(backoff_s=30.0, **limits))


async def read(src: PeerSource, key: bytes = b"k") -> tuple[ReadResult, bytes | None]:
    bufs: list[bytearray] = []

    def place(_i, meta):
        bufs.append(bytearray(meta.size))
        return memoryview(bufs[-1])

    [result] = await src.read([BlockKey(NS, key)], place, time.monotonic() + 5)
    return result, (bytes(bufs[-1]) if result.is_hit else None)


def test_same_host_first_then_the_next_holders_in_turn():
    async def main():
        ix, t = await fleet(("far", "10.0.0.9"), ("near", "10.0.0.1"), ("me", "10.0.0.1"),
                            blocks={"far": b"F" * 10, "near": b"N" * 10, "me": b"M" * 10})
        for node in ("far", "near", "me"):
            await ix.add(NS, node, 1, [(b"k", TierName.HOST)])
        src = source(ix, t)
        result, data = await read(src)
        assert result.is_hit and data == b"N" * 10 and t.asked == ["mem://10.0.0.1:7001"]  # never itself
        t.dead.add("mem://10.0.0.1:7001")
        result, data = await read(src)
        assert data == b"F" * 10 and t.asked[1:] == ["mem://10.0.0.1:7001", "mem://10.0.0.9:7000"]
        assert src.metrics.fallbacks.labels("unavailable")._value.get() == 1
        result, data = await read(src)  # the dead holder is skipped while it is backed off
        assert data == b"F" * 10 and t.asked[3:] == ["mem://10.0.0.9:7000"]

    asyncio.run(main())


def test_least_loaded_holder_first_among_equals():
    async def main():
        ix, t = await fleet(("x", "10.0.0.5"), ("y", "10.0.0.6"), blocks={"x": b"x", "y": b"y"})
        for node in ("x", "y"):
            await ix.add(NS, node, 1, [(b"k", TierName.HOST)])
        src = source(ix, t)
        src._in_flight["x"] = 2  # two fetches from x running now
        for _ in range(5):
            _, data = await read(src)
            assert data == b"y"

    asyncio.run(main())


def test_misses_are_repaired_once_and_holders_are_bounded():
    async def main():
        nodes = [(f"n{i}", f"10.0.1.{i}") for i in range(5)]
        ix, t = await fleet(*nodes)  # every one of them lost the block
        for node, _ in nodes:
            await ix.add(NS, node, 1, [(b"k", TierName.HOST)])
        src = source(ix, t, max_holders=3)
        result, _ = await read(src)
        assert result.status.value == "miss" and len(t.asked) == 3  # at most max_holders
        assert src.metrics.repairs.labels("removed")._value.get() == 3
        assert len((await ix.holders(NS, [b"k"]))[0]) == 2  # the three asked are gone from the index
        await read(src)
        await read(src)
        assert len(t.asked) == 5 and len(set(t.asked)) == 5  # no holder was asked twice
        assert (await ix.holders(NS, [b"k"])) == [[]]

    asyncio.run(main())


def test_corrupt_copies_remote_tier_holders_and_oversized_blocks_are_passed_over():
    async def main():
        ix, t = await fleet(("bad", "10.0.0.1"), ("relay", "10.0.0.1"), ("big", "10.0.0.1"), ("good", "10.0.0.9"),
                            blocks={"bad": b"B" * 64, "big": b"G" * 4096, "good": b"ok" * 32})
        t.corrupting.add("mem://10.0.0.1:7000")
        await ix.add(NS, "bad", 1, [(b"k", TierName.HOST)])
        await ix.add(NS, "relay", 1, [(b"k", TierName.PEER)])  # it only has it "on a peer": no bytes there
        await ix.add(NS, "big", 1, [(b"k", TierName.DISK)])
        await ix.add(NS, "good", 1, [(b"k", TierName.DISK)])
        src = source(ix, t, max_holders=4, max_block_bytes=1024)
        result, data = await read(src)
        assert data == b"ok" * 32
        assert "mem://10.0.0.1:7001" not in t.asked
        assert src.metrics.fallbacks.labels("corrupt")._value.get() == 1
        assert src.metrics.fallbacks.labels("invalid")._value.get() == 1
        assert src.metrics.repairs.labels("removed")._value.get() == 0  # they do hold it

    asyncio.run(main())


def test_the_peer_tier_refuses_writes_as_refused_not_failed():
    """A refused write is InvalidArgument (the store keeps the block above, the tier stays healthy)."""
    ix = MemoryIndex()
    tier = RemoteTier(RemoteBridge(lambda: PeerSource(ix, "me", transports={"grpc": DictTransport()})))
    try:
        data = b"v" * 100
        with pytest.raises(InvalidArgument, match="read-through only"):
            tier.put(BlockKey(NS, b"k"), data, BlockMeta(len(data), checksum(data)))
        assert tier.delete(BlockKey(NS, b"k")) is False
    finally:
        tier.close()


def test_a_remote_tier_refusing_a_too_large_block_raises_invalid_argument():
    tier = RemoteTier(RemoteBridge(MemoryRemote(capacity_bytes=1 << 10)))
    try:
        data = b"v" * (4 << 10)
        with pytest.raises(InvalidArgument):  # BlockTooLarge: this block's problem, not the tier's
            tier.put(BlockKey(NS, b"big"), data, BlockMeta(len(data), checksum(data)))
    finally:
        tier.close()


def test_a_local_only_get_is_never_read_through(make_daemon, redis_url):
    """What a peer asks: the holder answers from its own tiers, so a fetch is never sent on."""
    from kvstore.client.aio import AsyncClient
    from kvstore.client.sync import Client

    common = dict(index_url=redis_url, tiers="ram,disk,peer")
    a = make_daemon(node_id="local-only-a", **common)
    b = make_daemon(node_id="local-only-b", **common)
    key = b"only-on-a-" + str(time.monotonic_ns()).encode()
    with Client(a.target) as ca:
        ca.put(NS, key, b"payload")

    def published() -> bool:
        return any(h.node_id == "local-only-a" for h in b.index_agent.run(b.index_agent.index.holders(NS, [key]), 5)[0])

    from tests.support.wait import wait_until

    wait_until(published, what="a to publish")

    async def main():
        async with AsyncClient(b.target, use_shm=False) as cb:
            assert await cb.get_many(NS, [key], local_only=True) == [None]
            [block] = await cb.get_many(NS, [key])
            assert bytes(block.data) == b"payload"
            [block] = await cb.get_many(NS, [key], local_only=True)  # now b's own
            assert bytes(block.data) == b"payload"

    asyncio.run(main())
