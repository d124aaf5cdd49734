"""Regression tests for defects a hostile test found (issue: hardening). Each fails on the code before its fix."""

from __future__ import annotations

import time

import pytest

from kvstore.block import MAX_LAYOUT_CHARS, BlockKey, BlockMeta, TierName, checksum
from kvstore.errors import InvalidArgument, InvalidKey
from kvstore.store import StoreLimits, TieredStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.ram import HostRamTier
from tests.support.store_blocks import Clock, MiB, value
from tests.support.wait import wait_until

HOST, DISK = TierName.HOST, TierName.DISK


@pytest.fixture
def make(tmp_path):
    made: list[TieredStore] = []

    def build(ram_mib: int = 4, disk_mib: int = 32, **limits) -> TieredStore:
        limits.setdefault("max_block_bytes", 2 * MiB)
        limits.setdefault("demotion_threads", 0)
        n = len(made)
        tiers = [HostRamTier(ram_mib * MiB, shm_dir=str(tmp_path), arena_name=f"h{n}"),
                 DiskTier(tmp_path / f"disk{n}", disk_mib * MiB)]
        store = TieredStore(tiers, limits=StoreLimits.from_settings(**limits), clock=Clock())
        made.append(store)
        return store

    yield build
    for s in made:
        s.close()


def put(store, ns, key, data, parent=None, layout=""):
    return store.put(BlockKey(ns, key), data, BlockMeta(len(data), checksum(data), parent, layout))


def test_every_block_limit_is_enforced_at_the_boundary(make):
    store = make()
    with pytest.raises(InvalidArgument, match=f"layout of 70000 characters; the limit is {MAX_LAYOUT_CHARS}"):
        put(store, "m", b"k", value(1, 4096), layout="x" * 70_000)
    with pytest.raises(InvalidKey, match="bad parent key"):
        put(store, "m", b"k", value(1, 4096), parent=b"")
    with pytest.raises(InvalidKey, match="bad parent key"):
        put(store, "m", b"k", value(1, 4096), parent=b"p" * 5000)
    with pytest.raises(InvalidArgument, match="layout"):
        store.allocate("m", [(b"k", 4096, None, "y" * 2000)])
    assert store.stats().tiers[0].used_bytes == 0, "a refused block takes no room"


def test_a_block_the_disk_refuses_is_its_own_problem_not_the_tiers(make):
    """A block no disk copy can hold stays in RAM (or is dropped like a RAM-only block); the disk
    stays healthy, and every block of another namespace still goes down and is kept."""
    store = make(ram_mib=4, disk_mib=1)  # a 1.5 MiB block can never fit the disk tier
    put(store, "big", b"b", value(99, 3 * MiB // 2))
    acknowledged = []
    for i in range(40):  # 2.5 MiB: RAM must send some of them down
        put(store, "other", b"k%d" % i, value(i, 64 << 10))
        acknowledged.append(i)
        store.flush_demotions()
    lost = [i for i in acknowledged if not store.exists("other", [b"k%d" % i])]
    assert lost == [], f"blocks of another namespace were dropped: {lost}"
    assert store.tier_stats()[1].blocks > 0, "the disk kept taking blocks"
    assert store.metrics.demotions.labels("refused")._value.get() == 1, "refused once, then never demoted again"
    assert store.metrics.demotions.labels("failed")._value.get() == 0


def test_pin_with_no_keys_is_refused(make):
    store = make()
    with pytest.raises(InvalidArgument, match="at least one key"):
        store.pin("m", [])
    assert store.stats().active_leases == 0


def test_a_damaged_epoch_file_never_makes_the_epoch_go_back(tmp_path):
    from kvstore.node import NodeIdentity

    epochs = [NodeIdentity.start("n", tmp_path).epoch for _ in range(3)]
    assert epochs == sorted(set(epochs)), "each start above the last"
    (tmp_path / "epoch").write_bytes(b"\x00garbage\xff")
    before_ms = int(time.time() * 1000)
    damaged = NodeIdentity.start("n", tmp_path).epoch
    assert damaged >= before_ms, "a damaged file: the clock, above every epoch a start took before now"
    assert NodeIdentity.start("n", tmp_path).epoch > damaged


def test_a_restart_with_a_smaller_disk_evicts_down_to_it(tmp_path):
    ram = lambda name: HostRamTier(4 * MiB, shm_dir=str(tmp_path), arena_name=name)  # noqa: E731
    limits = StoreLimits.from_settings(max_block_bytes=2 * MiB, demotion_threads=0)
    store = TieredStore([ram("a"), DiskTier(tmp_path / "disk", 16 * MiB)], limits=limits, clock=Clock())
    for i in range(10):
        put(store, "m", b"k%d" % i, value(i))
    store.persist_ram(float("inf"))
    store.close()
    smaller = TieredStore([ram("b"), DiskTier(tmp_path / "disk", 4 * MiB)], limits=limits, clock=Clock())
    try:
        disk = smaller.tier_stats()[1]
        assert disk.used_bytes <= disk.capacity_bytes
        kept = [i for i in range(10) if smaller.exists("m", [b"k%d" % i])]
        assert 0 < len(kept) < 10
        for i in kept:
            assert smaller.get(BlockKey("m", b"k%d" % i))[0] == value(i)
    finally:
        smaller.close()


def test_the_default_block_limit_fits_an_lmcache_chunk_of_a_large_model():
    from kvstore.config import load_settings

    chunk_70b = 256 * 80 * 2 * 8 * 128 * 2  # tokens x layers x (K, V) x KV heads x head size x bf16, TP=1
    assert chunk_70b == 80 * MiB
    assert load_settings(environ={}).store.max_block_bytes >= chunk_70b
    assert load_settings(environ={}, ram_bytes="64MiB").store.max_block_bytes == 16 * MiB, "a small RAM tier lowers it"


def test_a_block_over_the_limit_is_refused_naming_the_setting(make):
    from kvstore.errors import BlockTooLarge

    store = make()
    with pytest.raises(BlockTooLarge, match="--max-block-bytes"):
        put(store, "m", b"big", value(1, 3 * MiB))


def test_bytes_that_are_not_a_request_are_invalid_argument_on_every_method(daemon):
    import grpc

    from kvstore.api.v1 import handoff_pb2, index_pb2, kv_pb2

    garbage = b"\xff\xff\xff\xff\x0f"  # a varint that never ends: no message parses from it
    methods = [
        (svc.full_name, m) for svc in (kv_pb2.DESCRIPTOR.services_by_name["KVService"],
                                       index_pb2.DESCRIPTOR.services_by_name["IndexService"],
                                       handoff_pb2.DESCRIPTOR.services_by_name["HandoffService"])
        for m in svc.methods
    ]
    assert len(methods) == 23  # 15 KV, 4 index (Score, Holders, Nodes, Replication), 4 handoff
    with grpc.insecure_channel(daemon.target) as channel:
        for service, m in methods:
            path = f"/{service}/{m.name}"
            if m.client_streaming:
                call = channel.stream_unary(path)
                request = iter([garbage])
            elif m.server_streaming:
                call = channel.unary_stream(path)
                request = garbage
            else:
                call = channel.unary_unary(path)
                request = garbage
            with pytest.raises(grpc.RpcError) as info:
                result = call(request, timeout=10)
                if m.server_streaming:
                    list(result)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (m.name, info.value.code(), info.value.details())
            assert "not a valid protobuf message" in info.value.details()


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), -1.0])
def test_a_tier_weight_that_is_not_a_finite_non_negative_number_is_refused(weight):
    from kvstore.index.scoring import ScoringPolicy

    with pytest.raises(InvalidArgument, match="finite and non-negative"):
        ScoringPolicy({TierName.HOST: weight})


def test_idle_streams_cannot_stall_health_or_queue_work(make_daemon):
    """Streams that open and send nothing hold at most the streams' share of the workers: health
    and unary calls answer at once, and streams beyond it are refused with a retry delay instead
    of queueing."""
    import threading

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvstore.api.v1 import kv_pb2, kv_pb2_grpc
    from kvstore.rpc.status import from_rpc_error
    from kvstore.errors import Overloaded

    daemon = make_daemon(workers=4, max_in_flight=64)
    release = threading.Event()

    def idle():  # a stream that opens and sends nothing until released
        release.wait(30)
        yield from ()

    with grpc.insecure_channel(daemon.target) as channel:
        stub = kv_pb2_grpc.KVServiceStub(channel)
        calls = [stub.Put.future(idle(), timeout=30) for _ in range(4)]
        try:
            refused = []
            for call in calls:
                try:
                    call.result(timeout=0.5)
                except grpc.FutureTimeoutError:
                    continue  # still open: admitted and idle
                except grpc.RpcError as err:
                    refused.append(from_rpc_error(err))
            streams = daemon.settings.server.admitted_streams  # 1 of the 2 admitted RPCs
            assert len(refused) == len(calls) - streams
            assert all(isinstance(e, Overloaded) and e.retry_after_s > 0 for e in refused)
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as info:  # a unary call finds its worker: the namespace is unknown
                stub.Exists(kv_pb2.ExistsRequest(namespace="m", keys=[b"k"]), timeout=5)
            assert info.value.code() is grpc.StatusCode.NOT_FOUND
        finally:
            release.set()


def test_lease_and_slot_ids_cannot_be_guessed_from_ones_own(make):
    store = make()
    put(store, "m", b"a", value(1, 4096))
    ids = [store.pin("m", [b"a"])[0].id for _ in range(50)]
    ids += [g.slot_id for g in store.allocate("m", [(b"s%d" % i, 4096, None, "") for i in range(50)])]
    steps = {abs(a - b) for a, b in zip(ids, ids[1:])}
    assert min(steps) > 1 << 20, "ids are not a counter a stranger could walk"
    assert len(set(ids)) == len(ids)


def test_a_commit_without_the_writers_checksum_stores_nothing(daemon):
    """A slot half written and committed without a checksum used to be stored as a valid block."""
    import grpc

    from kvstore.api.v1 import kv_pb2 as pb
    from kvstore.api.v1 import kv_pb2_grpc
    from kvstore.shm.arena import ShmArena

    data = value(7, 64 << 10)
    with grpc.insecure_channel(daemon.target) as channel:
        stub = kv_pb2_grpc.KVServiceStub(channel)
        attach = stub.Attach(pb.AttachRequest())
        arena = ShmArena.attach(attach.arena_path, attach.arena_token)
        try:
            [slot] = stub.Allocate(pb.AllocateRequest(namespace="m", blocks=[pb.BlockHeader(key=b"k", size=len(data))])).slots
            view = arena.view(slot.offset, slot.size)
            view[: len(data) // 2] = data[: len(data) // 2]  # half written
            view.release()
            with pytest.raises(grpc.RpcError) as info:
                stub.Commit(pb.CommitRequest(items=[pb.CommitRequest.Item(slot_id=slot.slot_id)]))
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "writer's checksum" in info.value.details()
            with pytest.raises(grpc.RpcError) as info:  # the checksum of the whole value: the slot does not match it
                stub.Commit(pb.CommitRequest(items=[pb.CommitRequest.Item(slot_id=slot.slot_id, checksum=checksum(data))]))
            assert info.value.code() is grpc.StatusCode.DATA_LOSS
            assert stub.Exists(pb.ExistsRequest(namespace="m", keys=[b"k"])).prefix_blocks == 0
        finally:
            arena.close()


def test_streamed_puts_promise_memory_only_within_a_budget(make_daemon):
    """Streams that declare big blocks and send nothing more hold at most --put-budget-bytes; past it
    a new one is refused with a retry delay, and the budget comes back when the streams end."""
    import threading

    import grpc

    from kvstore import Client
    from kvstore.api.v1 import kv_pb2, kv_pb2_grpc
    from kvstore.errors import Overloaded
    from kvstore.rpc.status import from_rpc_error

    daemon = make_daemon(put_budget_bytes="16MiB", max_block_bytes="8MiB")
    release = threading.Event()
    opened = threading.Semaphore(0)

    def declare_and_stall():
        yield kv_pb2.PutRequest(namespace="m", header=kv_pb2.BlockHeader(key=b"big", size=8 << 20, checksum=1))
        opened.release()
        release.wait(30)

    with grpc.insecure_channel(daemon.target) as channel:
        stub = kv_pb2_grpc.KVServiceStub(channel)
        holding = [stub.Put.future(declare_and_stall(), timeout=30) for _ in range(2)]
        for _ in holding:
            assert opened.acquire(timeout=10)
        # the daemon has read both headers (the client sending them is not enough)
        wait_until(lambda: daemon.put_budget.used_bytes == 16 << 20, what="both streams to hold their budget")
        try:
            with pytest.raises(grpc.RpcError) as info:
                stub.Put(declare_and_stall(), timeout=10)
            err = from_rpc_error(info.value)
            assert isinstance(err, Overloaded) and err.retry_after_s > 0 and "--put-budget-bytes" in str(err)
        finally:
            release.set()
        for call in holding:  # each ends with its block incomplete: nothing stored, its budget given back
            with pytest.raises(grpc.RpcError):
                call.result(timeout=10)
    with Client(daemon.target, use_shm=False) as kv:
        assert kv.put("m", b"after", value(3, 8 << 20)) is True
