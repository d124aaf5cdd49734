"""Both clients against a daemon serving the gpu tier, on the host stand-in (tests/server/test_gpu_daemon.py).

``--gpu-memory host --no-gpu-host-addressable``: the daemon copies in and out
of its region as it does on a GPU, and a same-host client reads and writes
the region through its handle as it would through a CUDA IPC handle. Each
case runs over the blocking client (or transport) and its asyncio twin, so
the device path of both is the same path: tensors into a gpu slot through
the mapping, read back into a tensor; and, for a client that declares no gpu
capability, blocks put inline or through the stream and read through it.
An in-process daemon, real sockets.
"""

from __future__ import annotations

import asyncio

import pytest

from kvstore import AsyncClient, BlockPut, Client, TierName
from kvstore.transport.attached import connect_attached
from kvstore.transport.attached_aio import connect_attached_async
from kvstore.transport.base import Deadline

pytestmark = pytest.mark.system

MiB = 1 << 20
GPU = dict(gpu_bytes="8MiB", gpu_memory="host", gpu_host_addressable=False, max_block_bytes="2MiB")


def block(n: int, size: int) -> bytes:
    return (n.to_bytes(4, "little") * (size // 4 + 1))[:size]


@pytest.mark.parametrize("kind", ["sync", "asyncio"])
def test_tensors_go_into_a_gpu_slot_through_the_region_and_come_back(make_daemon, kind):
    torch = pytest.importorskip("torch")
    d = make_daemon(**GPU)
    src = torch.arange(512 * 1024, dtype=torch.float32)  # 2 MiB: written into a gpu slot
    small = torch.arange(1000, dtype=torch.int32)  # inline
    dst, dst_small = torch.zeros_like(src), torch.zeros_like(small)

    def sync():
        with Client(d.target) as c:
            assert c.put_many("m", [BlockPut(b"t", src, layout="f32"), BlockPut(b"s", small)]) == [True, True]
            got = c.get_into("m", [b"t", b"s", b"absent"], [dst, dst_small, bytearray(8)])
            return got, c._data("m").mapped_regions, c.transport_for("m")

    async def aio():
        async with AsyncClient(d.target) as c:
            assert await c.put_many("m", [BlockPut(b"t", src, layout="f32"), BlockPut(b"s", small)]) == [True, True]
            got = await c.get_into("m", [b"t", b"s", b"absent"], [dst, dst_small, bytearray(8)])
            return got, (await c._data("m")).mapped_regions, await c.transport_for("m")

    got, mapped, transport = sync() if kind == "sync" else asyncio.run(aio())
    assert transport == "same-host" and mapped == 1  # one region, mapped once, written and read through it
    assert [b.tier if b else None for b in got] == [TierName.GPU, TierName.GPU, None]
    assert torch.equal(dst, src) and torch.equal(dst_small, small) and got[0].layout == "f32"
    assert d.store.exists("m", [b"t"]) == [TierName.GPU]


@pytest.mark.parametrize("kind", ["sync", "asyncio"])
def test_without_the_gpu_capability_blocks_go_inline_or_through_the_stream(make_daemon, kind):
    d = make_daemon(**GPU)
    items = [BlockPut(b"big", block(1, 3 * MiB // 2)), BlockPut(b"small", block(2, 100))]  # streamed; inline

    def sync():
        transport = connect_attached(d.target, "same-host", gpu=False)
        try:
            stored = transport.put("m", items, Deadline.after(10))
            got = transport.get_into("m", [b"big", b"small"], None, Deadline.after(10))
            return stored, got, transport.inner.mapped_regions, transport.inner.writes_in_place
        finally:
            transport.close()

    async def aio():
        transport = await connect_attached_async(d.target, "same-host", gpu=False)
        try:
            stored = await transport.put("m", items, Deadline.after(10))
            got = await transport.get_into("m", [b"big", b"small"], None, Deadline.after(10))
            return stored, got, transport.inner.mapped_regions, transport.inner.writes_in_place
        finally:
            await transport.close()

    stored, got, mapped, in_place = sync() if kind == "sync" else asyncio.run(aio())
    assert stored == [True, True] and not in_place and mapped == 0  # no device offsets, no mapping
    assert [bytes(b.data) for b in got] == [item.value for item in items]
    assert d.store.stats().active_leases == 0
