"""AsyncClient against a real daemon over a real port, with and without shared memory.

Each test runs its coroutine with ``asyncio.run`` (no pytest plugin) and uses
its own namespace, so the tests share one daemon.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import threading

import pytest

from kvstore import errors
from kvstore.block import TierName
from kvstore.client import AsyncClient, BlockPut, Client, codec
from kvstore.client.aio import OFF_LOOP_BYTES
from kvstore.config import load_settings
from kvstore.server.daemon import Daemon
from tests.support.wait import wait_until

pytestmark = pytest.mark.system

MiB = 1 << 20


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    state = tmp_path_factory.mktemp("daemon")
    settings = load_settings(
        listen="127.0.0.1:0",
        metrics_listen="",
        disk_dir=str(state),
        shm_dir=str(state),
        ram_bytes="64MiB",
        disk_bytes="256MiB",
        max_block_bytes="16MiB",
    )
    daemon = Daemon(settings).start()
    try:
        yield f"127.0.0.1:{daemon.port}"
    finally:
        daemon.stop(0)


@pytest.fixture(params=[True, False], ids=["shm", "stream"])
def use_shm(request) -> bool:
    return request.param


@pytest.fixture
def namespace(request) -> str:
    """A namespace of this test alone."""
    return "t-" + hashlib.blake2b(request.node.nodeid.encode(), digest_size=8).hexdigest()


def key(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


def run(target: str, use_shm: bool, body, **options):
    async def main():
        async with AsyncClient(target, use_shm=use_shm, **options) as client:
            return await body(client)

    return asyncio.run(main())


@pytest.mark.parametrize(
    "size", [1, 4095, 4096, 100_000, OFF_LOOP_BYTES, OFF_LOOP_BYTES + 1, 3 * MiB + 17, 16 * MiB]
)
def test_round_trip(target, use_shm, namespace, size):
    value = os.urandom(size)

    async def body(c: AsyncClient):
        assert await c.uses_shared_memory() is use_shm
        assert await c.put(namespace, key("a"), value, layout="f16[2,8]") is True
        assert await c.put(namespace, key("a"), value) is False  # already stored
        got = await c.get(namespace, key("a"))
        [block] = await c.get_many(namespace, [key("a")])
        return got, block

    got, block = run(target, use_shm, body)
    assert bytes(got) == value
    assert block.key == key("a")
    assert bytes(block.data) == value
    assert block.layout == "f16[2,8]"
    assert block.parent is None
    assert block.tier is TierName.HOST


def test_batch_with_a_miss_in_the_middle(target, use_shm, namespace):
    values = {f"b{i}": os.urandom(1000 * (i + 1)) for i in range(4)}
    values["big"] = os.urandom(2 * MiB)

    async def body(c: AsyncClient):
        stored = await c.put_many(namespace, [BlockPut(key(n), v) for n, v in values.items()])
        assert stored == [True] * len(values)
        again = await c.put_many(namespace, [BlockPut(key("b0"), values["b0"]), BlockPut(key("new"), b"n")])
        assert again == [False, True]
        asked = ["b0", "b1", "missing", "big", "b3"]
        return asked, await c.get_many(namespace, [key(n) for n in asked])

    asked, blocks = run(target, use_shm, body)
    assert blocks[2] is None
    for name, block in zip(asked, blocks):
        if name != "missing":
            assert block.key == key(name)
            assert bytes(block.data) == values[name]


def test_empty_batches(target, use_shm, namespace):
    async def body(c: AsyncClient):
        return await c.put_many(namespace, []), await c.get_many(namespace, [])

    assert run(target, use_shm, body) == ([], [])


def test_exists_over_a_chain(target, use_shm, namespace):
    chain = [key(f"c{i}") for i in range(4)]

    async def body(c: AsyncClient):
        parents = [None] + chain[:-1]
        await c.put_many(namespace, [BlockPut(k, b"x" * 64, parent=p) for k, p in zip(chain[:3], parents)])
        full = await c.exists(namespace, chain)
        headless = await c.exists(namespace, [key("nope")] + chain)
        blocks = await c.get_many(namespace, chain[:2])
        return full, headless, blocks

    full, headless, blocks = run(target, use_shm, body)
    assert full == [TierName.HOST] * 3  # stops at the first absent block
    assert headless == []
    assert blocks[0].parent is None
    assert blocks[1].parent == chain[0]


def test_delete(target, use_shm, namespace):
    async def body(c: AsyncClient):
        await c.put_many(namespace, [BlockPut(key("d1"), b"1"), BlockPut(key("d2"), b"2")])
        deleted = await c.delete(namespace, [key("d1"), key("absent")])
        return deleted, await c.get_many(namespace, [key("d1"), key("d2")])

    deleted, (d1, d2) = run(target, use_shm, body)
    assert deleted == 1
    assert d1 is None
    assert bytes(d2.data) == b"2"


def test_pin_and_unpin(target, use_shm, namespace):
    async def body(c: AsyncClient):
        await c.put(namespace, key("p"), b"pinned")
        lease = await c.pin(namespace, [key("p"), key("absent")], lease_s=30)
        during = await c.stats(namespace)
        first, second = await c.unpin(lease.lease_id), await c.unpin(lease.lease_id)
        return lease, during, first, second

    lease, during, first, second = run(target, use_shm, body)
    assert lease.lease_id > 0
    assert lease.pinned == 1
    assert lease.missing == [key("absent")]
    assert lease.deadline_unix_ms > 0
    assert during.pinned_blocks >= 1
    assert (first, second) == (True, False)  # a lease ends once


def test_stats(target, use_shm, namespace):
    async def body(c: AsyncClient):
        await c.put_many(namespace, [BlockPut(key(f"s{i}"), b"v" * 100) for i in range(3)])
        return await c.stats(), await c.stats(namespace)

    everything, mine = run(target, use_shm, body)
    assert namespace in everything.namespaces
    assert everything.epoch >= 1 and everything.node_id
    assert everything.tiers["host"]["capacity_bytes"] == 64 * MiB
    assert everything.tiers["disk"]["capacity_bytes"] == 256 * MiB
    assert mine.blocks == 3
    assert everything.blocks >= mine.blocks


def test_unknown_namespace(target, use_shm):
    async def body(c: AsyncClient):
        with pytest.raises(errors.UnknownNamespace):
            await c.get("never-written", key("k"))
        with pytest.raises(errors.UnknownNamespace):
            await c.exists("never-written", [key("k")])

    run(target, use_shm, body)


def test_invalid_input_is_refused_before_any_call(target, use_shm):
    async def body(c: AsyncClient):
        with pytest.raises(errors.InvalidNamespace):
            await c.put("", key("k"), b"v")
        with pytest.raises(errors.InvalidKey):
            await c.get_many("ns", [b""])

    run(target, use_shm, body)


def test_oversized_block(target, use_shm, namespace):
    async def body(c: AsyncClient):
        await c.put(namespace, key("small"), b"s")
        with pytest.raises(errors.BlockTooLarge):
            await c.put(namespace, key("huge"), bytes(16 * MiB + 1))
        assert await c.get(namespace, key("huge")) is None  # nothing of it was stored

    run(target, use_shm, body)


def test_refusals_of_a_streamed_put_keep_their_status(target, namespace):
    """grpc.aio turns some of these into INTERNAL (grpc/grpc#36066); the client must not."""

    async def body(c: AsyncClient):
        await c.put(namespace, key("small"), b"s")
        for i in range(100):
            with pytest.raises(errors.BlockTooLarge):
                await c.put_many(namespace, [BlockPut(key(f"ok{i}"), b"v"), BlockPut(key("huge"), bytes(17 * MiB))])

    run(target, False, body)


def test_many_concurrent_puts(target, use_shm, namespace):
    values = {key(f"p{i}"): os.urandom(1000 + i + (2 * MiB if i % 5 == 0 else 0)) for i in range(20)}

    async def body(c: AsyncClient):
        stored = await asyncio.gather(*(c.put(namespace, k, v) for k, v in values.items()))
        return stored, await c.get_many(namespace, list(values))

    stored, blocks = run(target, use_shm, body)
    assert stored == [True] * len(values)
    assert [bytes(b.data) for b in blocks] == list(values.values())


def test_many_concurrent_gets(target, use_shm, namespace):
    values = {key(f"g{i}"): os.urandom(37 * (i + 1) + (2 * MiB if i % 8 == 0 else 0)) for i in range(24)}

    async def body(c: AsyncClient):
        await c.put_many(namespace, [BlockPut(k, v) for k, v in values.items()])
        order = list(values) * 4
        singles = await asyncio.gather(*(c.get(namespace, k) for k in order))
        batches = await asyncio.gather(*(c.get_many(namespace, list(values)[i::3]) for i in range(3)))
        return order, singles, batches

    order, singles, batches = run(target, use_shm, body)
    assert [bytes(v) for v in singles] == [values[k] for k in order]
    for i, batch in enumerate(batches):
        assert [(b.key, bytes(b.data)) for b in batch] == [(k, values[k]) for k in list(values)[i::3]]


def test_cancelled_put_leaves_the_client_usable(target, use_shm, namespace):
    value = os.urandom(8 * MiB)

    async def body(c: AsyncClient):
        task = asyncio.ensure_future(c.put_many(namespace, [BlockPut(key(f"x{i}"), value) for i in range(4)]))
        await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        assert await c.put(namespace, key("after"), b"still works")
        return await c.get(namespace, key("after"))

    assert bytes(run(target, use_shm, body)) == b"still works"  # and close() did not fail


def test_sync_and_async_clients_read_each_other(target, use_shm, namespace):
    value = os.urandom(3 * MiB)
    with Client(target, use_shm=use_shm) as sync:
        sync.put(namespace, key("from-sync"), value)

    async def body(c: AsyncClient):
        await c.put(namespace, key("from-async"), value[::-1])
        return await c.get(namespace, key("from-sync"))

    assert bytes(run(target, use_shm, body)) == value
    with Client(target, use_shm=use_shm) as sync:
        assert bytes(sync.get(namespace, key("from-async"))) == value[::-1]


def test_get_into_placement_runs_on_the_loop_and_takes_the_bytes(target, use_shm, namespace):
    """Large blocks are copied in a worker thread, but the placement (an engine's
    allocator, often not thread-safe) is always called on the event loop."""
    sizes = {key("small"): 1000, key("large"): 3 * MiB + 5}
    values = {k: os.urandom(n) for k, n in sizes.items()}

    async def body(c: AsyncClient):
        await c.put_many(namespace, [BlockPut(k, v, layout=str(len(v))) for k, v in values.items()])
        loop_thread, threads, buffers = threading.get_ident(), [], {}

        def place(i, info):
            threads.append(threading.get_ident())
            assert info.layout == str(info.size)
            buffers[info.key] = bytearray(info.size)
            return buffers[info.key]

        got = await c.get_into(namespace, [key("large"), key("nope"), key("small")], place)
        assert threads == [loop_thread, loop_thread]
        return got, buffers

    got, buffers = run(target, use_shm, body)
    assert got[1] is None
    for block in (got[0], got[2]):
        assert bytes(block.data) == values[block.key] and block.data.obj is buffers[block.key]


def test_list_blocks_page_by_page(target, use_shm, namespace):
    names = [key(f"l{i}") for i in range(7)]

    async def body(c: AsyncClient):
        await c.put_many(namespace, [BlockPut(k, b"x" * (i + 1)) for i, k in enumerate(names)])
        page = await c.list_blocks(namespace, page_size=3)
        return page, [b async for b in c.iter_blocks(namespace, page_size=3)]

    page, listed = run(target, use_shm, body)
    assert [b.key for b in page.blocks] == sorted(names)[:3] and page.next_page_token
    assert [b.key for b in listed] == sorted(names)
    assert {b.key: b.size for b in listed} == {k: i + 1 for i, k in enumerate(names)}


def test_streamed_reads_go_where_they_are_placed():
    """GetAssembler with a placement: bytes land in the placed buffers (under the caller's
    indices), a declined block's chunks are consumed and dropped, a refetch reuses the buffer
    its arena read was placed in."""
    from kvstore.api.v1 import kv_pb2 as pb
    from kvstore.block import checksum

    a, b = os.urandom(5000), os.urandom(3000)

    def stream(*blocks):
        for name, data in blocks:
            header = pb.BlockHeader(key=key(name), size=len(data), checksum=checksum(data), layout=name)
            yield pb.GetResponse(header=pb.GetHeader(found=True, block=header, tier=int(TierName.DISK)))
            for off in range(0, len(data), 1024):
                yield pb.GetResponse(chunk=data[off : off + 1024])

    buffers, seen = {}, []

    def place(i, info):
        seen.append(i)
        if info.layout == "b":
            return None
        buffers[i] = memoryview(bytearray(info.size + 10))
        return buffers[i]

    assembler = codec.GetAssembler(place, indices=[4, 9])
    for msg in stream(("a", a), ("b", b)):
        assembler.feed(msg)
    got = assembler.finish()
    assert seen == [4, 9] and got[1] is None
    assert bytes(got[0].data) == a and got[0].data.obj is buffers[4].obj and got[0].tier is TierName.DISK

    placed = [None, memoryview(bytearray(5000)), None]
    again = codec.refetch_placement(place, placed)
    assert again(1, codec.BlockInfo(key("a"), 5000, "a", None)) is placed[1]
    assert again(2, codec.BlockInfo(key("a"), 5000, "a", None)).obj is buffers[2].obj
    with pytest.raises(errors.CorruptBlock):
        bad = codec.GetAssembler(place)
        for msg in stream(("a", a)):
            if msg.WhichOneof("part") == "chunk":
                msg = pb.GetResponse(chunk=bytes(len(msg.chunk)))
            bad.feed(msg)
        bad.finish()


def test_no_daemon_raises_unavailable_after_retries(monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from kvstore.client import base

    delays = []
    real_retry_delay = base.retry_delay

    def recording(err, method, attempt, retries):
        delay = real_retry_delay(err, method, attempt, retries)
        delays.append(delay)
        return delay

    monkeypatch.setattr(base, "retry_delay", recording)  # the retry policy's home (codec re-exports it)

    async def body(c: AsyncClient):
        with pytest.raises(errors.DaemonUnavailable):
            await c.stats()

    run(f"127.0.0.1:{port}", False, body, timeout=1.0, retries=2)
    assert len(delays) == 3 and delays[-1] is None  # two retries, then it gave up
    assert all(d is not None and d > 0 for d in delays[:-1])


def test_arena_read_refetches_unplaced_torn_and_expired_blocks(tmp_path):
    """The Lookup handling both clients share: what is read in place, what is streamed again."""
    from kvstore.api.v1 import kv_pb2 as pb
    from kvstore.block import checksum
    from kvstore.shm.arena import ShmArena

    arena = ShmArena.create(1 << 16, str(tmp_path), "arena")
    try:
        good, torn, late = b"good" * 10, b"torn" * 10, b"late" * 10
        for offset, data in [(0, good), (4096, torn), (8192, late)]:
            view = arena.view(offset, len(data))
            view[:] = data
            view.release()

        def located(name, data, offset, lease_id, sum_=None):
            header = pb.BlockHeader(key=key(name), size=len(data), checksum=sum_ if sum_ is not None else checksum(data))
            return pb.Located(found=True, block=header, offset=offset, lease_id=lease_id, tier=TierName.HOST)

        response = pb.LookupResponse(
            blocks=[
                located("good", good, 0, 11),
                pb.Located(found=False, block=pb.BlockHeader(key=key("miss"))),
                located("unplaced", good, 0, 0),  # found, but not leased in the arena
                located("torn", torn, 4096, 12, sum_=checksum(torn) ^ 1),
                located("late", late, 8192, 13),
            ]
        )
        assert codec.leased_bytes(response) == len(good) + len(torn) + len(late)
        read = codec.read_lookup(arena, response)
        assert read.lease_ids() == [11, 12, 13]
        assert read.refetch == [2, 3]
        assert bytes(read.blocks[0].data) == good and read.blocks[0].tier is TierName.HOST
        assert bytes(read.blocks[4].data) == late
        codec.drop_expired(read, [True, False, False])  # "late" expired while it was copied
        assert read.refetch == [2, 3, 4]
        assert read.blocks[1:] == [None] * 4
        assert bytes(read.blocks[0].data) == good
    finally:
        arena.close(unlink=True)


def test_the_methods_both_clients_share_answer_alike(target, use_shm, namespace):
    """The index, handoff and attachment methods the asyncio client once lacked, against the blocking client's."""
    chain = [key(f"h{i}") for i in range(3)]
    values = [os.urandom(2000) for _ in chain]
    with Client(target, use_shm=use_shm) as sync:
        sync.put_many(namespace, [BlockPut(k, v, parent=p) for k, v, p in zip(chain, values, [None] + chain[:-1])])
        wait_until(lambda: [s.blocks for s in sync.score(namespace, keys=chain)] == [3], what="the chain's publication")
        expected = (sync.score(namespace, keys=chain), sync.holders(namespace, keys=chain), sync.nodes(),
                    sync.replication().enabled, sync.transport_for(namespace), sync.shared_memory, sync.transport_name)
        sync_local = [bytes(b.data) for b in sync.get_many(namespace, chain, local_only=True)]

    async def body(c: AsyncClient):
        got = (await c.score(namespace, keys=chain), await c.holders(namespace, keys=chain), await c.nodes(),
               (await c.replication()).enabled, await c.transport_for(namespace), await c.shared_memory(),
               await c.transport_name())
        assert await c.uses_shared_memory() is got[5]  # the old name
        await c.touch(namespace, chain)  # best effort, no answer
        local = [bytes(b.data) for b in await c.get_many(namespace, chain, local_only=True)]
        params, missing = await c.open_handoff(namespace, chain + [key("absent")], lease_s=30)
        held = await c.stats(namespace)
        deadline = await c.heartbeat_handoff(namespace, params.handoff_id)
        done = await c.complete_handoff(namespace, params.handoff_id)
        return got, local, params, missing, held, deadline, done

    got, local, params, missing, held, deadline, done = run(target, use_shm, body)
    assert got == expected and got[4] == ("same-host" if use_shm else "grpc") and got[5] is use_shm
    assert [s.blocks for s in got[0]] == [3] and [len(h) for h in got[1]] == [1, 1, 1]
    assert local == sync_local == values
    assert [b.key for b in params.blocks] == chain and missing == [key("absent")]
    assert held.open_handoffs == 1 and deadline > 0 and done == (0, 3)  # kept as cache
