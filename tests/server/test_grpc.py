"""KVService over a real gRPC server on a free port: every RPC, both byte paths, bad input."""

from __future__ import annotations

import os
import threading
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status
from google.rpc import error_details_pb2

from kvstore import BlockPut, Client, TierName
from kvstore.api.v1 import kv_pb2 as pb
from kvstore.api.v1 import kv_pb2_grpc
from kvstore.block import checksum
from kvstore.errors import (
    BlockTooLarge,
    CorruptBlock,
    InvalidArgument,
    InvalidKey,
    InvalidNamespace,
    SlotAlreadyCommitted,
    TierFull,
    UnknownLease,
    UnknownNamespace,
)
from tests.support.wait import wait_until

pytestmark = pytest.mark.system

MiB = 1 << 20


def blob(seed: int, size: int) -> bytes:
    return (seed.to_bytes(8, "big") + os.urandom(8)) * (size // 16) + b"x" * (size % 16)


@pytest.fixture(params=[True, False], ids=["shm", "streamed"])
def client(request, daemon):
    with Client(daemon.target, use_shm=request.param, timeout=10) as c:
        assert c.shared_memory is request.param
        yield c


def stub(daemon) -> kv_pb2_grpc.KVServiceStub:
    return kv_pb2_grpc.KVServiceStub(grpc.insecure_channel(daemon.target))


@pytest.mark.parametrize("size", [1, 4096, 65536 + 3, 3 * MiB + 17, 8 * MiB])
def test_round_trip_sizes(client, size):
    data = blob(size, size)
    assert client.put("m", b"k", data, layout="bf16[2,16]") is True
    assert client.put("m", b"k", data) is False
    [block] = client.get_many("m", [b"k"])
    assert bytes(block.data) == data and block.layout == "bf16[2,16]" and block.tier is TierName.HOST


def test_batches_keep_order_and_report_misses(client):
    items = [BlockPut(b"b%d" % i, blob(i, 100_000 + i), layout=str(i)) for i in range(6)]
    assert client.put_many("m", items) == [True] * 6
    got = client.get_many("m", [b"b0", b"nope", b"b5", b"b3"])
    assert got[1] is None
    assert [bytes(b.data) for b in (got[0], got[2], got[3])] == [items[0].value, items[5].value, items[3].value]
    assert got[2].layout == "5"


def test_exists_counts_the_leading_chain(client):
    chain = [b"c0", b"c1", b"c2", b"c3"]
    parent = None
    for key in chain[:3]:
        client.put("m", key, blob(1, 5000), parent=parent)
        parent = key
    assert client.exists("m", chain) == [TierName.HOST] * 3
    assert client.exists("m", [b"c0", b"zz", b"c2"]) == [TierName.HOST]


def test_delete_and_pin(client):
    client.put("m", b"a", b"1" * 100)
    lease = client.pin("m", [b"a", b"missing"], lease_s=30)
    assert lease.pinned == 1 and lease.missing == [b"missing"]
    assert client.stats("m").pinned_blocks == 1
    assert client.unpin(lease.lease_id) is True
    assert client.unpin(lease.lease_id) is False
    assert client.delete("m", [b"a", b"missing"]) == 1
    assert client.get("m", b"a") is None


def test_place_moves_blocks_out_of_ram_and_back_and_refuses_without_a_where(client, daemon):
    values = [blob(i, 5000) for i in range(3)]
    for i, v in enumerate(values):
        client.put("m", b"p%d" % i, v)
    placed = client.place("m", [b"p0", b"p1", b"absent"], "below")
    assert (placed.placed, placed.missing, placed.pinned) == (2, [b"absent"], 0)
    assert {b.key: b.tier for b in client.list_blocks("m", prefix=b"p").blocks} == {
        b"p0": TierName.DISK, b"p1": TierName.DISK, b"p2": TierName.HOST}
    assert client.place("m", [b"p0"], "ram").placed == 1 and client.get("m", b"p0") == values[0]
    assert client.get("m", b"p1") == values[1]
    with pytest.raises(ValueError, match="'ram'.*'below'"):
        client.place("m", [b"p0"], "up")
    with pytest.raises(grpc.RpcError) as info:
        stub(daemon).Place(pb.PlaceRequest(namespace="m", keys=[b"p0"]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "WARM" in info.value.details()


def test_bad_input_gets_clear_errors_and_the_daemon_keeps_serving(client):
    with pytest.raises(BlockTooLarge, match="max-block-bytes"):
        client.put("m", b"big", b"x" * (8 * MiB + 1))
    with pytest.raises(InvalidKey, match="empty"):
        client.put("m", b"", b"x")
    with pytest.raises(InvalidKey, match="limit"):
        client.get("m", b"k" * 2000)
    with pytest.raises(InvalidNamespace):
        client.put("bad namespace!", b"k", b"x")
    with pytest.raises(UnknownNamespace, match="unknown to this daemon"):
        client.get("never-used", b"k")
    client.put("m", b"ok", b"still serving")
    assert client.get("m", b"ok") == b"still serving"


def test_server_checks_what_clients_skip(daemon):
    """A raw stub can send anything; the server still refuses it."""
    s = stub(daemon)
    with pytest.raises(grpc.RpcError) as info:
        s.Exists(pb.ExistsRequest(namespace="m", keys=[b""]))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:
        s.Put(iter([pb.PutRequest(namespace="m", chunk=b"abc")]))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "before any block header" in info.value.details()
    header = pb.BlockHeader(key=b"k", size=4, checksum=checksum(b"abcd"))
    with pytest.raises(grpc.RpcError) as info:  # more bytes than declared
        s.Put(iter([pb.PutRequest(namespace="m", header=header), pb.PutRequest(chunk=b"abcdef")]))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:  # stream ends early
        s.Put(iter([pb.PutRequest(namespace="m", header=header), pb.PutRequest(chunk=b"ab")]))
    assert "after 2 of its 4 bytes" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:  # bytes that do not match their checksum
        s.Put(iter([pb.PutRequest(namespace="m", header=header), pb.PutRequest(chunk=b"abce")]))
    assert info.value.code() is grpc.StatusCode.DATA_LOSS
    with pytest.raises(grpc.RpcError) as info:
        s.Get(pb.GetRequest(namespace="m", keys=[b"x"] * 5000)).next()
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert not Client(daemon.target).exists("m", [b"k"])  # nothing torn was stored


def test_commit_of_unknown_or_committed_slot(daemon):
    with Client(daemon.target, use_shm=True) as c:
        c.put("m", b"warm", b"w")
    s = stub(daemon)
    alloc = s.Allocate(pb.AllocateRequest(namespace="m", blocks=[pb.BlockHeader(key=b"s", size=10)]))
    [slot] = alloc.slots
    with Client(daemon.target, use_shm=True) as c:
        assert c.shared_memory
        view = c._mapped[0].view(slot.offset, 10)
        view[:] = b"0123456789"
        view.release()
    commit = pb.CommitRequest(items=[pb.CommitRequest.Item(slot_id=slot.slot_id, checksum=checksum(b"0123456789"))])
    assert s.Commit(commit).results[0].stored
    for request, cls in [
        (commit, SlotAlreadyCommitted),
        (pb.CommitRequest(items=[pb.CommitRequest.Item(slot_id=1, checksum=0)]), UnknownLease),
    ]:
        with pytest.raises(grpc.RpcError) as info:
            s.Commit(request)
        assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        from kvstore.rpc.status import from_rpc_error

        assert type(from_rpc_error(info.value)) is cls
    assert Client(daemon.target, use_shm=False).get("m", b"s") == b"0123456789"


def test_commit_of_bytes_not_matching_checksum_is_data_loss(daemon):
    with Client(daemon.target, use_shm=True) as c:
        c.put("m", b"warm", b"w")
        s = stub(daemon)  # one connection: slots belong to the connection that allocated them
        alloc = s.Allocate(pb.AllocateRequest(namespace="m", blocks=[pb.BlockHeader(key=b"s", size=10)]))
        with pytest.raises(grpc.RpcError) as info:
            s.Commit(pb.CommitRequest(items=[pb.CommitRequest.Item(slot_id=alloc.slots[0].slot_id, checksum=7)]))
        assert info.value.code() is grpc.StatusCode.DATA_LOSS
        assert c.get("m", b"s") is None


def test_read_through_an_expired_lease_is_discarded_and_refetched(make_daemon):
    daemon = make_daemon(lease_seconds=0.2)
    data = blob(3, 50_000)
    with Client(daemon.target, use_shm=True) as c:
        c.put("m", b"a", data)
        s = stub(daemon)
        looked = s.Lookup(pb.LookupRequest(namespace="m", keys=[b"a"], lease_ms=50))
        wait_until(lambda: c.stats().active_leases == 0, what="the read lease to expire")
        assert list(s.Release(pb.ReleaseRequest(lease_ids=[looked.blocks[0].lease_id])).valid) == [False]
        # The client itself treats such a read as void and fetches again.
        assert c.get("m", b"a") == data


def test_client_falls_back_to_streaming_when_the_arena_cannot_be_mapped(daemon, tmp_path):
    with Client(daemon.target) as c:
        c.put("m", b"x", b"y" * 1000)
    arena = Path(daemon.store.head.arena.path)
    hidden = arena.with_name("moved-away")
    arena.rename(hidden)  # as seen from another host: no such file
    try:
        with Client(daemon.target) as c:
            assert c.shared_memory is False
            assert c.get("m", b"x") == b"y" * 1000
            assert c.put("m", b"z", b"w" * 10)
    finally:
        hidden.rename(arena)


def test_overload_is_resource_exhausted_with_retry_delay(make_daemon):
    daemon = make_daemon(max_in_flight=1)
    release = threading.Event()
    entered = threading.Event()

    def slow_stream():
        yield pb.PutRequest(namespace="m", header=pb.BlockHeader(key=b"h", size=1, checksum=checksum(b"1")))
        entered.set()
        release.wait(30)
        yield pb.PutRequest(chunk=b"1")

    s = stub(daemon)
    holder = s.Put.future(slow_stream())
    entered.wait(10)
    wait_until(lambda: daemon.metrics.in_flight._value.get() == 1, what="the first RPC to occupy the only slot")
    with pytest.raises(grpc.RpcError) as info:
        s.Exists(pb.ExistsRequest(namespace="m", keys=[b"h"]))
    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    status = rpc_status.from_call(info.value)
    retry = [d for d in status.details if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR)]
    assert retry, "RESOURCE_EXHAUSTED must carry a RetryInfo delay"
    release.set()
    assert holder.result(timeout=10).results[0].stored
    with Client(daemon.target, retries=5) as c:  # the client waits out the delay and retries
        assert c.exists("m", [b"h"]) == [TierName.HOST]


def test_deadline_is_honoured_when_ram_is_pinned_full(make_daemon):
    daemon = make_daemon(ram_bytes="16MiB", disk_bytes=0, max_block_bytes="4MiB")
    values = [blob(i, 4 * MiB) for i in range(4)]
    with Client(daemon.target, use_shm=False, timeout=1.0, retries=0) as c:
        for i in range(4):
            c.put("m", b"k%d" % i, values[i])
        c.pin("m", [b"k%d" % i for i in range(4)])
        with pytest.raises(TierFull, match="retry later"):
            c.put("m", b"more", blob(9, 4 * MiB))
        assert c.get("m", b"k0") == values[0]


def test_corrupt_block_on_disk_is_data_loss_then_a_miss(make_daemon, tmp_path):
    daemon = make_daemon(ram_bytes="16MiB", max_block_bytes="4MiB")
    with Client(daemon.target, use_shm=False) as c:
        for i in range(8):
            c.put("m", b"k%d" % i, blob(i, 4 * MiB))
        wait_until(lambda: c.stats().tiers["disk"]["blocks"] >= 4, what="demotion to disk")
        disk_only = [i for i in range(8) if c.exists("m", [b"k%d" % i]) == [TierName.DISK]]
        assert disk_only
        for path in Path(daemon.settings.tiers.disk.dir).rglob("*"):
            if path.is_file() and path.stat().st_size > MiB:
                with open(path, "r+b") as f:
                    f.seek(-100, os.SEEK_END)
                    f.write(b"\0" * 8)
        key = b"k%d" % disk_only[0]
        with pytest.raises(CorruptBlock):
            c.get("m", key)
        assert c.get("m", key) is None
        c.put("m", b"fine", b"daemon still serving")
        assert c.get("m", b"fine") == b"daemon still serving"


def test_health_reflection_and_metrics(make_daemon):
    daemon = make_daemon(metrics_listen="127.0.0.1:0")
    ch = grpc.insecure_channel(daemon.target)
    for service in ("", "strata.kv.v1.KVService"):
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service))
        assert r.status == health_pb2.HealthCheckResponse.SERVING
    reply = next(
        reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
    )
    assert "strata.kv.v1.KVService" in [s.name for s in reply.list_services_response.service]
    with Client(daemon.target) as c:
        c.put("m", b"k", b"v" * 10000)
        c.get("m", b"k")
        c.get("m", b"absent")
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics").read().decode()
    for needle in [
        'strata_tier_used_bytes{tier="host"} 12288.0',
        'strata_tier_capacity_bytes{tier="disk"}',
        'strata_kv_hits_total{tier="host"} 1.0',
        "strata_kv_misses_total 1.0",
        'strata_kv_op_duration_seconds_bucket{le="0.005",op="Lookup"}',
        "strata_rpc_in_flight_requests",
        "strata_kv_demotion_queue_blocks",
    ]:
        assert needle in text, needle


def test_graceful_stop_turns_health_not_serving(make_daemon):
    daemon = make_daemon()
    ch = grpc.insecure_channel(daemon.target)
    daemon.stop(0)
    with pytest.raises(grpc.RpcError) as info:
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE


def test_invalid_argument_maps_to_the_right_status(daemon):
    with pytest.raises(grpc.RpcError) as info:
        stub(daemon).Pin(pb.PinRequest(namespace="m", keys=[b"k"], lease_ms=10**9))
    assert info.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
    with Client(daemon.target) as c:
        c.put("m", b"k", b"v")
        with pytest.raises(InvalidArgument, match="exceeds the limit"):
            c.pin("m", [b"k"], lease_s=10**6)


def test_get_into_fills_caller_buffers(client):
    import numpy as np

    values = [blob(i, 200_000 + i) for i in range(3)]
    client.put_many("m", [BlockPut(b"g%d" % i, v) for i, v in enumerate(values)])
    bufs = [bytearray(300_000), np.zeros(300_000, dtype=np.uint8), memoryview(bytearray(300_000))]
    got = client.get_into("m", [b"g0", b"g1", b"missing"], bufs)
    assert got[2] is None
    assert bytes(got[0].data) == values[0] and bytes(bufs[0][: len(values[0])]) == values[0]
    assert bufs[1][: len(values[1])].tobytes() == values[1]
    with pytest.raises(InvalidArgument, match="pass a larger buffer"):
        client.get_into("m", [b"g2"], [bytearray(10)])
    with pytest.raises(InvalidArgument, match="one buffer per key"):
        client.get_into("m", [b"g0", b"g1"], [bytearray(300_000)])
    with pytest.raises(InvalidArgument, match="read-only"):
        client.get_into("m", [b"g0"], [bytes(300_000)])


def test_get_into_places_each_block_by_what_the_daemon_says_of_it(client):
    """A placement function sees each found block's size and layout before its bytes
    are read, once per block; what it declines reads as a miss."""
    values = {b"p%d" % i: blob(i, 50_000 + 1000 * i) for i in range(4)}
    client.put_many("m", [BlockPut(k, v, layout=f"len={len(v)}") for k, v in values.items()])
    calls, placed = [], {}

    def place(i, info):
        calls.append((i, info.key, info.size, info.layout))
        if info.key == b"p2":
            return None
        placed[info.key] = bytearray(info.size)  # exactly the block's size
        return placed[info.key]

    keys = [b"p0", b"missing", b"p1", b"p2", b"p3"]
    got = client.get_into("m", keys, place)
    assert calls == [(i, k, len(values[k]), f"len={len(values[k])}") for i, k in enumerate(keys) if k in values]
    assert got[1] is None and got[3] is None
    for i in (0, 2, 4):
        assert bytes(got[i].data) == values[keys[i]]
        assert got[i].data.obj is placed[keys[i]]  # read into the placed buffer, not copied again
    with pytest.raises(InvalidArgument, match="pass a larger buffer"):
        client.get_into("m", [b"p0"], lambda i, info: bytearray(info.size - 1))
    # the refused read's leases are given back at once, not left to expire
    wait_until(lambda: client.stats().active_leases == 0, timeout=10, what="the refused read's leases to be released")


def test_list_pages_through_a_namespace_in_key_order(client):
    keys = [b"a/%02d" % i for i in range(23)] + [b"b/%02d" % i for i in range(5)]
    client.put_many("ls", [BlockPut(k, blob(i, 100 + i), layout="l%d" % i) for i, k in enumerate(keys)])
    client.delete("ls", [b"a/07"])
    live = sorted(k for k in keys if k != b"a/07")

    first = client.list_blocks("ls", page_size=10)
    assert [b.key for b in first.blocks] == live[:10] and first.next_page_token
    assert first.blocks[0].size == 100 and first.blocks[0].layout == "l0" and first.blocks[0].tier is TierName.HOST
    assert [b.key for b in client.iter_blocks("ls", page_size=10)] == live
    assert [b.key for b in client.iter_blocks("ls", b"b/", page_size=2)] == keys[23:]
    assert client.list_blocks("ls", b"a/2").next_page_token == b""
    assert [b.key for b in client.list_blocks("ls", b"a/2").blocks] == [b"a/20", b"a/21", b"a/22"]
    assert client.list_blocks("ls", b"zz").blocks == []

    with pytest.raises(InvalidArgument, match="page_token was not issued"):
        client.list_blocks("ls", b"b/", page_token=first.next_page_token)
    with pytest.raises(InvalidArgument, match="over the limit"):
        client.list_blocks("ls", page_size=10_001)
    with pytest.raises(UnknownNamespace):
        client.list_blocks("never-written")
    with pytest.raises(InvalidNamespace):
        client.list_blocks("bad namespace!")


def test_list_resumes_after_its_token_whatever_changed_in_between(client):
    client.put_many("lr", [BlockPut(b"k%d" % i, b"v") for i in (1, 3, 5, 7)])
    page = client.list_blocks("lr", page_size=2)
    assert [b.key for b in page.blocks] == [b"k1", b"k3"]
    client.put_many("lr", [BlockPut(b"k0", b"v"), BlockPut(b"k4", b"v")])  # one behind the token, one ahead
    client.delete("lr", [b"k3", b"k5"])  # the token's own key may go
    rest = client.list_blocks("lr", page_size=10, page_token=page.next_page_token)
    assert [b.key for b in rest.blocks] == [b"k4", b"k7"] and rest.next_page_token == b""


def test_in_place_reads_release_their_leases(make_daemon):
    daemon = make_daemon(lease_seconds=300)  # so only a release, not expiry, can end them in time
    with Client(daemon.target, use_shm=True) as c:
        c.put_many("m", [BlockPut(b"r%d" % i, blob(i, 70_000)) for i in range(8)])
        for _ in range(5):
            assert all(c.get_many("m", [b"r%d" % i for i in range(8)]))
        wait_until(lambda: c.stats().active_leases == 0, timeout=60, what="fire-and-forget releases to land")
        assert c.stats().pinned_blocks == 0


def test_a_daemon_that_cannot_start_says_why_and_leaves_nothing(make_daemon, tmp_path):
    from kvstore.server.endpoints import DaemonError

    first = make_daemon()
    with pytest.raises(DaemonError, match="pick a free address with --listen"):
        make_daemon(listen=first.target)
    arenas = sorted(p.name for p in tmp_path.glob("strata-*"))
    name = Path(first.store.head.arena.path).name
    assert arenas == [name, name + ".table"]  # the failed one's arena and block table are gone
    second = make_daemon(disk_dir=str(tmp_path / "d1"))  # and its directory lock was released
    assert second.port
