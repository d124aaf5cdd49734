"""The daemon serving the gpu tier: ``strata serve --gpu-memory host`` as a real process, clients in others.

The host stand-in runs with ``--gpu-host-addressable false``, so the daemon's
store copies in and out of the region as it does on a GPU; a same-host
client reads and writes the region through its handle, as it would through
a CUDA IPC handle. Each test drives real processes over real sockets.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from kvstore import BlockPut, Client, TierName
from kvstore.api.v1 import kv_pb2 as pb
from kvstore.api.v1 import kv_pb2_grpc
from kvstore.errors import ArenaUnusable, CorruptBlock
from kvstore.shm.arena import HEADER_BYTES
from kvstore.transport.attached import connect_attached
from kvstore.transport.base import Deadline
from kvstore.transport.samehost import frames
from kvstore.transport.samehost import regions
from kvstore.wire.unix import connect_unix
from tests.support.wait import wait_until

pytestmark = pytest.mark.system

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]
CHILD_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
GPU = ("--gpu-bytes", "8MiB", "--gpu-memory", "host", "--no-gpu-host-addressable", "--max-block-bytes", "2MiB")


def block(n: int, size: int) -> bytes:
    return (n.to_bytes(4, "little") * (size // 4 + 1))[:size]


class Raw:
    """A hand-driven same-host connection (found through Attach), for what a client does not show."""

    def __init__(self, target: str, version: int = frames.PROTOCOL_VERSION, caps=(regions.CAPABILITY,)) -> None:
        with grpc.insecure_channel(target) as ch:
            attach = kv_pb2_grpc.KVServiceStub(ch).Attach(pb.AttachRequest(), timeout=10)
        self.sock = connect_unix(attach.control_socket, 10)
        self.reader = frames.FrameReader(self.sock)
        args = [version, attach.arena_token] + ([list(caps)] if version >= 2 else [])
        _, status, self.hello = self.call(frames.HELLO, args)
        assert status == frames.OK, self.hello

    def call(self, op, args):
        frames.send(self.sock, frames.encode([op, 7, args]))
        return tuple(self.reader.read()[0])

    def lookup(self, keys, lease_ms=0):
        _, status, result = self.call(frames.LOOKUP, ["m", list(keys), lease_ms, 5000, []])
        assert status == frames.OK, result
        return result[1]

    def close(self) -> None:
        self.sock.close()


def put_from_another_process(target: str, items: dict[bytes, bytes]) -> None:
    """Process A: a client of its own puts ``items`` (the test process is B, the reader)."""
    script = (
        "import sys, pickle\nfrom kvstore import Client\n"
        "items = pickle.loads(sys.stdin.buffer.read())\n"
        f"with Client({target!r}) as c:\n"
        "    assert c.transport_name == 'same-host'\n"
        "    assert all(c.put_many('m', [__import__('kvstore').BlockPut(k, v) for k, v in items.items()]))\n"
    )
    import pickle

    proc = subprocess.run([sys.executable, "-c", script], input=pickle.dumps(items), capture_output=True,
                          env=CHILD_ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()


def same_host(target: str, **options):
    transport = connect_attached(target, "same-host", **options)
    return transport, transport.inner


def get(transport, keys):
    return transport.get_into("m", list(keys), None, Deadline.after(10))


# ---- reads and writes through the region's handle ----------------------------------------


def test_a_block_put_by_one_process_is_read_by_another_through_the_region_handle(daemon_process):
    d = daemon_process(*GPU)
    items = {b"small": block(1, 4096), b"large": block(2, MiB + 123)}  # inline, and written into a gpu slot
    put_from_another_process(d.target, items)
    transport, inner = same_host(d.target)
    try:
        got = get(transport, items)
        assert [bytes(b.data) for b in got] == list(items.values())
        assert [b.tier for b in got] == [TierName.GPU, TierName.GPU]
        assert inner.mapped_regions == 1  # one region, mapped once for every block in it
        assert get(transport, [b"large"])[0].data == items[b"large"] and inner.mapped_regions == 1
    finally:
        transport.close()
    with Client(d.target) as c:
        tiers = c.stats().tiers
    assert tiers["gpu"]["blocks"] == 2 and tiers["gpu"]["capacity_bytes"] == 8 * MiB
    assert tiers["gpu"]["used_bytes"] >= MiB + 4096 and tiers["host"]["blocks"] == 0
    shown = subprocess.run([sys.executable, "-m", "kvstore.cli.main", "stats", "--target", d.target],
                           capture_output=True, text=True, env=CHILD_ENV, timeout=60)
    assert shown.returncode == 0, shown.stderr
    [line] = [l for l in shown.stdout.splitlines() if l.split()[:1] == ["gpu"]]
    assert line.split()[1:5] == ["1.0", "/", "8.0", "MiB"] and line.endswith("2 blocks")  # used, capacity, units


def test_a_client_writes_a_gpu_slot_through_its_mapping_and_the_daemon_verifies_it(daemon_process):
    d = daemon_process(*GPU)
    transport, inner = same_host(d.target)
    try:
        value = block(3, 2 * MiB)
        assert transport.put("m", [BlockPut(b"k", value)], Deadline.after(10)) == [True]
        assert inner.mapped_regions == 1  # the slot was written through the region, not the arena
    finally:
        transport.close()
    raw = Raw(d.target)
    [entry] = raw.lookup([b"k"])
    assert entry[6] == TierName.GPU and entry[7] == 0 and entry[5]  # leased in region 0
    raw.close()
    with Client(d.target) as c:
        assert c.get("m", b"k") == value


def test_read_leases_on_gpu_extents_are_released_and_expire(daemon_process):
    d = daemon_process(*GPU)
    put_from_another_process(d.target, {b"a": block(4, 64 << 10)})
    raw = Raw(d.target)
    handles = regions.regions_from_wire(raw.hello[4]["regions"])
    assert raw.hello[4]["tier"] == TierName.GPU and [h.kind for h in handles] == ["host"]
    [entry] = raw.lookup([b"a"])
    size, sum_, _, _, offset, lease_id, tier, region = entry
    assert region == 0 and 0 <= offset < handles[0].size and lease_id
    assert raw.call(frames.RELEASE, [[lease_id]])[1:] == (frames.OK, [True])
    assert raw.call(frames.RELEASE, [[lease_id]])[1:] == (frames.OK, [False])  # released once
    [entry] = raw.lookup([b"a"], lease_ms=50)
    with Client(d.target) as c:
        wait_until(lambda: c.stats().active_leases == 0, what="the 50 ms read lease to expire")
    assert raw.call(frames.RELEASE, [[entry[5]]])[1:] == (frames.OK, [False])  # it had expired
    raw.close()


def test_clients_without_the_gpu_capability_get_correct_bytes_and_no_device_offsets(daemon_process):
    d = daemon_process(*GPU)
    items = {b"x": block(5, 300 << 10), b"y": block(6, 3 * MiB // 2)}
    put_from_another_process(d.target, items)
    transport, inner = same_host(d.target, gpu=False)  # declares no capability
    try:
        got = get(transport, items)
        assert [bytes(b.data) for b in got] == list(items.values()) and inner.mapped_regions == 0
        big = block(7, 3 * MiB // 2)  # over a frame's inline limit: streamed
        assert transport.put("m", [BlockPut(b"z", big), BlockPut(b"w", block(8, 100))], Deadline.after(10)) == [True, True]
    finally:
        transport.close()
    arena = connect_attached(d.target, "grpc-arena")  # gRPC never hands out device offsets
    try:
        assert arena.put("m", [BlockPut(b"v", block(9, MiB))], Deadline.after(10)) == [True]
        got = get(arena, [b"z", b"v"])
        assert [bytes(b.data) for b in got] == [big, block(9, MiB)]
    finally:
        arena.close()
    old = Raw(d.target, version=1)  # a protocol 1 client: found, never leased; no slots
    assert len(old.hello) == 4
    [entry] = old.lookup([b"x"])
    assert len(entry) == 7 and entry[5] == 0 and entry[0] == 300 << 10
    _, status, (name, message, _) = old.call(frames.ALLOCATE, ["m", 0, 5000, [[b"q", MiB, None, ""]]])
    assert status == frames.ERROR and name == ArenaUnusable.__name__ and "gpu" in message
    old.close()
    with Client(d.target) as c:
        assert c.stats().active_leases == 0  # the leases a protocol 1 client could not use were given back


def test_corrupt_bytes_in_the_region_are_detected_and_never_handed_out(daemon_process, tmp_path):
    d = daemon_process(*GPU)
    value = block(10, 512 << 10)
    put_from_another_process(d.target, {b"c": value})
    raw = Raw(d.target)
    [handle] = regions.regions_from_wire(raw.hello[4]["regions"])
    [entry] = raw.lookup([b"c"])
    raw.call(frames.RELEASE, [[entry[5]]])
    raw.close()
    path, _ = handle.payload
    assert Path(path).parent == tmp_path  # the stand-in's file sits in --shm-dir
    with open(path, "r+b") as f:  # a flipped byte in device memory
        f.seek(HEADER_BYTES + entry[4] + 1000)
        f.write(bytes([value[1000] ^ 0xFF]))
    transport, inner = same_host(d.target)
    try:
        # Read through the handle, failed its checksum there; read again through the stream, where the
        # daemon finds the same and says so: the bad bytes never come back as a block.
        with pytest.raises(CorruptBlock, match="failed its checksum in the gpu tier"):
            get(transport, [b"c"])
        assert inner.mapped_regions == 1
        assert get(transport, [b"c"]) == [None]  # the daemon dropped the corrupt copy
    finally:
        transport.close()
    with Client(d.target) as c:
        assert c.get("m", b"c") is None and c.stats().tiers["gpu"]["blocks"] == 0
        assert c.put("m", b"c", value) and c.get("m", b"c") == value  # written again, sound again


# ---- the edges: the tier fills, the daemon restarts -----------------------------------------


def test_a_full_gpu_tier_demotes_to_ram_and_a_read_promotes_back(daemon_process):
    d = daemon_process(*GPU)
    items = {f"b{i}".encode(): block(i, MiB) for i in range(14)}  # 14 MiB into 8 MiB of device memory
    transport, _ = same_host(d.target)
    try:
        for key, value in items.items():
            assert transport.put("m", [BlockPut(key, value)], Deadline.after(10)) == [True]
        with Client(d.target) as c:
            tiers = wait_until(lambda: (t := c.stats().tiers)["host"]["blocks"] >= 6 and t, what="demotion to RAM")
            assert tiers["gpu"]["blocks"] <= 8 and tiers["gpu"]["used_bytes"] <= 8 * MiB
        [first] = get(transport, [b"b0"])  # the oldest: demoted, read from RAM, promoted into the gpu tier
        assert bytes(first.data) == items[b"b0"] and first.tier == TierName.HOST
        [again] = get(transport, [b"b0"])
        assert again.tier == TierName.GPU and bytes(again.data) == items[b"b0"]
        got = get(transport, items)
        assert [bytes(b.data) for b in got] == list(items.values())
    finally:
        transport.close()


def test_after_a_daemon_restart_the_client_maps_the_new_region_and_never_the_old(daemon_process, tmp_path):
    d = daemon_process(*GPU)
    with Client(d.target) as c:
        assert c.put("m", b"before", block(11, MiB))
        assert c.get("m", b"before") == block(11, MiB)
        inner = c._data("m")
        [old] = inner._regions.handles()
        assert d.kill() == -9
        d.proc = None
        d.start()  # the same port, state directory and shm dir: a new region, a new handle
        assert c.put("m", b"after", block(12, MiB))
        assert c.get("m", b"after") == block(12, MiB)
        inner = c._data("m")
        [new] = inner._regions.handles()
        assert new != old and new.payload[0] != old.payload[0]
        with open(old.payload[0], "r+b") as f:  # the dead daemon's region: scribbled over
            f.seek(HEADER_BYTES)
            f.write(b"\0" * (8 * MiB))
        assert c.get("m", b"after") == block(12, MiB)
        assert c.get("m", b"before") in (None, block(11, MiB))  # device memory does not outlive its daemon
    os.unlink(old.payload[0])  # SIGKILL left the stand-in's file behind, as it would a RAM arena


def test_tensors_go_in_and_come_out_of_the_gpu_tier(daemon_process):
    torch = pytest.importorskip("torch")
    d = daemon_process(*GPU)
    src = torch.arange(512 * 1024, dtype=torch.float32)  # 2 MiB: written into a gpu slot
    with Client(d.target) as c:
        assert c.put("m", b"t", src, layout="f32[524288]")
        dst = torch.zeros_like(src)
        [got] = c.get_into("m", [b"t"], [dst])
        assert got.tier == TierName.GPU and torch.equal(dst, src) and got.layout == "f32[524288]"
        assert c._data("m").mapped_regions == 1


def test_the_peer_data_plane_reads_and_writes_a_gpu_head(make_daemon):
    """Another node's reads and writes reach the gpu tier through copies, never as RAM arena offsets."""
    import asyncio
    import time

    from kvstore.peer import open_peer_transport
    from kvstore.transport import open_transport

    d = make_daemon(gpu_bytes="8MiB", gpu_memory="host", gpu_host_addressable=False, max_block_bytes="2MiB",
                    peer_listen="127.0.0.1:0")
    address = d.peer_addresses()["tcp"]
    values = {b"p0": block(20, 2 * MiB), b"p1": block(21, 5000)}
    with open_transport("peer-tcp", target=address) as t:  # a peer's write: slots in device memory
        t.put("m", [BlockPut(k, v) for k, v in values.items()], Deadline.after(30))
    assert d.store.exists("m", [b"p0"]) == [TierName.GPU]
    out = bytearray(3 * MiB)

    async def read():
        t = open_peer_transport("tcp")
        try:
            return await t.read(address, "m", [b"p0", b"p1"], lambda i, meta: memoryview(out)[i * 2 * MiB:][:meta.size],
                                time.monotonic() + 30)
        finally:
            await t.close()

    got = asyncio.run(read())
    assert [r.meta.size for r in got] == [2 * MiB, 5000]
    assert bytes(out[:2 * MiB]) == values[b"p0"] and bytes(out[2 * MiB:2 * MiB + 5000]) == values[b"p1"]
    wait_until(lambda: d.store.stats().active_leases == 0, what="the peer read's leases to be given back")


def test_the_async_client_puts_and_reads_a_served_gpu_tier_through_the_handle(daemon_process):
    import asyncio

    from kvstore.client import AsyncClient

    d = daemon_process(*GPU)
    values = {b"s": block(30, 1000), b"l": block(31, 3 * MiB // 2)}  # inline, and into a gpu slot

    async def main():
        async with AsyncClient(d.target) as c:
            assert await c.put_many("m", [BlockPut(k, v) for k, v in values.items()]) == [True, True]
            got = await c.get_many("m", list(values))
            mapped = (await c._attached_for("m")).same_host.mapped_regions
            return [bytes(b.data) for b in got], [b.tier for b in got], mapped

    data, tiers, mapped = asyncio.run(main())
    assert data == list(values.values()) and tiers == [TierName.GPU, TierName.GPU] and mapped == 1
