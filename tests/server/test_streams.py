"""Streams that stop making progress are ended, and give back everything they held.

Real daemons on real sockets. The idle limit is small; every wait here is
"eventually, within a generous bound", never a timing claim.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore import Client
from kvstore.api.v1 import kv_pb2 as pb
from kvstore.api.v1 import kv_pb2_grpc
from kvstore.block import checksum
from kvstore.errors import Overloaded
from kvstore.wire.unix import connect_unix
from tests.support.store_blocks import MiB, value
from tests.support.wait import wait_until

IDLE_S = 0.5


def _idle_daemon(make_daemon, **overrides):
    overrides.setdefault("stream_idle_seconds", IDLE_S)
    return make_daemon(**overrides)


def _stats(stub) -> pb.StatsResponse:
    return stub.Stats(pb.StatsRequest(), timeout=10)


def _host_used(stub) -> int:
    return next(t.used_bytes for t in _stats(stub).tiers if t.tier == pb.TIER_HOST)


def test_put_streams_that_send_nothing_or_stall_after_a_header_are_ended(make_daemon):
    """Idle Put streams fill every admitted slot and the put budget; each is ended with
    DEADLINE_EXCEEDED naming the setting, and then new work is admitted, the budget is whole
    again and nothing of the stalled blocks was stored."""
    daemon = _idle_daemon(make_daemon, workers=6, put_budget_bytes="16MiB", max_block_bytes="8MiB",
                          max_streams=4, max_streams_per_identity=4)  # streams may take every slot here
    admitted = daemon.settings.server.admitted_rpcs
    assert daemon.settings.server.admitted_streams == admitted
    release = threading.Event()
    headers_sent = threading.Semaphore(0)

    def silent():
        release.wait(60)
        yield from ()

    def header_then_stall(key: bytes, sent: int):
        data = value(1, 8 * MiB)
        yield pb.PutRequest(namespace="m", header=pb.BlockHeader(key=key, size=len(data), checksum=checksum(data)))
        if sent:
            yield pb.PutRequest(chunk=data[:sent])
        headers_sent.release()
        release.wait(60)

    with Client(daemon.target, use_shm=False) as kv:
        kv.put("m", b"kept", value(7, MiB))
    with grpc.insecure_channel(daemon.target) as channel:
        stub = kv_pb2_grpc.KVServiceStub(channel)
        before = _host_used(stub)
        calls = [stub.Put.future(header_then_stall(b"stall-a", 0), timeout=60),
                 stub.Put.future(header_then_stall(b"stall-b", MiB), timeout=60)]
        for _ in range(2):
            assert headers_sent.acquire(timeout=30)
        calls += [stub.Put.future(silent(), timeout=60) for _ in range(admitted - 2)]
        try:
            for call in calls:
                with pytest.raises(grpc.RpcError) as info:
                    call.result(timeout=30)
                assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED, info.value.details()
                assert "stream_idle_seconds" in info.value.details()
        finally:
            release.set()
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert stub.Exists(pb.ExistsRequest(namespace="m", keys=[b"stall-a"]), timeout=10).prefix_blocks == 0
        assert stub.Exists(pb.ExistsRequest(namespace="m", keys=[b"stall-b"]), timeout=10).prefix_blocks == 0
        wait_until(lambda: _host_used(stub) == before, timeout=30, what="the stalled blocks' arena extents to come back")
        assert _stats(stub).open_slots == 0
    assert daemon._watchdog.watched == 0
    with Client(daemon.target, use_shm=False) as kv:  # admission slots and the whole budget are free again
        assert all(kv.put("m", b"after-%d" % i, value(i, 8 * MiB)) for i in range(2))
        assert kv.get("m", b"after-1") == value(1, 8 * MiB)
        assert kv.get("m", b"kept") == value(7, MiB)
    families = {m.name: m for m in daemon.metrics.registry.collect()}
    ended = sum(s.value for s in families["strata_rpc_idle_streams_ended"].samples if s.name.endswith("_total"))
    assert ended == len(calls)


def test_idle_streams_never_take_the_workers_of_unary_calls_nor_another_tenants_streams(make_daemon, policy_file):
    """By default streams may hold half the admitted RPCs and one identity half of those: a tenant
    that opens idle Put streams is refused beyond its share by name, another tenant still opens
    streams until the daemon's stream limit, and unary calls are answered all along."""
    from tests.support.identities import TOKEN_A, TOKEN_ADMIN, TOKEN_B, raw_stub

    daemon = make_daemon(auth_file=str(policy_file))  # the default limits, and the default 30 s watchdog
    with Client(daemon.target, use_shm=False, token=TOKEN_ADMIN) as kv:
        kv.put("a", b"kept", value(7, 4096))
    server = daemon.settings.server
    streams, share = server.admitted_streams, server.streams_per_identity
    assert 1 <= share < streams < server.admitted_rpcs
    release = threading.Event()

    def silent():
        release.wait(60)
        yield from ()

    greedy, other, admin = raw_stub(daemon.target, TOKEN_A), raw_stub(daemon.target, TOKEN_B), raw_stub(daemon.target, TOKEN_ADMIN)
    try:
        held = [greedy.Put.future(silent(), timeout=60) for _ in range(share)]
        wait_until(lambda: daemon._watchdog.watched == share, timeout=30, what="the greedy tenant's streams")
        with pytest.raises(grpc.RpcError) as info:
            greedy.Put(silent(), timeout=30)
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-streams-per-identity" in info.value.details()
        for i in range(streams - share):  # another tenant's share, then the admin's, up to the daemon's limit
            held.append((other if i < share else admin).Put.future(silent(), timeout=60))
        wait_until(lambda: daemon._watchdog.watched == streams, timeout=30, what="the other tenants' streams")
        with pytest.raises(grpc.RpcError) as info:
            admin.Put(silent(), timeout=30)
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-streams)" in info.value.details()
        for stub, ns in ((greedy, "a"), (admin, "a")):  # every stream is taken: unary calls still find a worker
            assert stub.Exists(pb.ExistsRequest(namespace=ns, keys=[b"kept"]), timeout=10).prefix_blocks == 1
        assert _stats(admin).node_id
        release.set()
        for call in held:
            call.result(timeout=30)  # an empty Put stream ends well once its client lets it
    finally:
        release.set()
    with Client(daemon.target, use_shm=False, token=TOKEN_A) as kv:  # every stream and share was given back
        assert all(kv.put("a", b"after-%d" % i, value(i, MiB)) for i in range(share + 1))


def test_one_tenant_holds_at_most_its_share_of_the_rpcs_in_flight(make_daemon, policy_file):
    """Every call takes one of its identity's share of the admitted RPCs (a stream for as long as it
    lasts): a tenant at its share is refused by name, another tenant's calls are answered."""
    from tests.support.identities import TOKEN_A, TOKEN_B, raw_stub

    daemon = make_daemon(auth_file=str(policy_file), max_in_flight_per_identity=2, namespaces="a,b")
    release = threading.Event()

    def silent():
        release.wait(60)
        yield from ()

    greedy, other = raw_stub(daemon.target, TOKEN_A), raw_stub(daemon.target, TOKEN_B)
    held = [greedy.Put.future(silent(), timeout=60) for _ in range(2)]
    try:
        wait_until(lambda: daemon._watchdog.watched == 2, timeout=30, what="the greedy tenant's streams")
        with pytest.raises(grpc.RpcError) as info:
            greedy.Exists(pb.ExistsRequest(namespace="a", keys=[b"k"]), timeout=10)
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-in-flight-per-identity" in info.value.details()
        assert other.Exists(pb.ExistsRequest(namespace="b", keys=[b"k"]), timeout=10).prefix_blocks == 0
    finally:
        release.set()
        for call in held:
            call.result(timeout=30)
    assert greedy.Exists(pb.ExistsRequest(namespace="a", keys=[b"k"]), timeout=10).prefix_blocks == 0


def test_one_tenants_streamed_puts_hold_at_most_its_share_of_the_put_budget(make_daemon, policy_file):
    """A Put holds its block's declared size from its header on: a tenant whose stalled Puts hold its
    share is refused by name, while another tenant's puts are stored."""
    from tests.support.identities import TOKEN_A, TOKEN_B, raw_stub

    daemon = make_daemon(auth_file=str(policy_file), put_budget_bytes="16MiB", max_block_bytes="4MiB",
                         put_budget_bytes_per_identity="4MiB")
    release, header_sent = threading.Event(), threading.Event()

    def header_then_stall():
        data = value(1, 4 * MiB)
        yield pb.PutRequest(namespace="a", header=pb.BlockHeader(key=b"stall", size=len(data), checksum=checksum(data)))
        header_sent.set()
        release.wait(60)

    greedy = raw_stub(daemon.target, TOKEN_A)
    stalled = greedy.Put.future(header_then_stall(), timeout=60)
    try:
        assert header_sent.wait(30)
        wait_until(lambda: daemon.put_budget.used_bytes == 4 * MiB, timeout=30, what="the stalled put's bytes to be held")
        with Client(daemon.target, use_shm=False, token=TOKEN_A) as kv:
            with pytest.raises(Overloaded, match="--put-budget-bytes-per-identity"):
                kv.put("a", b"more", value(2, MiB))
        with Client(daemon.target, use_shm=False, token=TOKEN_B) as kv:
            assert kv.put("b", b"theirs", value(3, MiB))
    finally:
        release.set()
        with pytest.raises(grpc.RpcError):
            stalled.result(timeout=30)  # its stream ended without the block's bytes
    assert daemon.put_budget.used_bytes == 0


def test_without_authentication_streams_are_bounded_daemon_wide_only(make_daemon):
    """One trust domain on loopback: one client may multiplex every stream on its connection; the
    daemon-wide stream limit still leaves unary calls their workers."""
    daemon = make_daemon()
    with Client(daemon.target, use_shm=False) as kv:
        kv.put("m", b"kept", value(7, 4096))
    streams = daemon.settings.server.admitted_streams
    release = threading.Event()

    def silent():
        release.wait(60)
        yield from ()

    with grpc.insecure_channel(daemon.target) as channel:
        stub = kv_pb2_grpc.KVServiceStub(channel)
        try:
            held = [stub.Put.future(silent(), timeout=60) for _ in range(streams)]
            wait_until(lambda: daemon._watchdog.watched == streams, timeout=30, what="one client's streams")
            with pytest.raises(grpc.RpcError) as info:
                stub.Put(silent(), timeout=30)
            assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-streams)" in info.value.details()
            assert stub.Exists(pb.ExistsRequest(namespace="m", keys=[b"kept"]), timeout=10).prefix_blocks == 1
            release.set()
            for call in held:
                call.result(timeout=30)
        finally:
            release.set()


def test_a_get_whose_client_stops_reading_is_ended(make_daemon):
    daemon = _idle_daemon(make_daemon, workers=4, max_streams=2, max_streams_per_identity=2)
    data = value(5, 8 * MiB)
    with Client(daemon.target, use_shm=False) as kv:
        kv.put("m", b"big", data)
    with grpc.insecure_channel(daemon.target) as channel:
        stub = kv_pb2_grpc.KVServiceStub(channel)
        held = [stub.Get(pb.GetRequest(namespace="m", keys=[b"big"]), timeout=60) for _ in range(2)]
        try:
            wait_until(lambda: daemon._watchdog.watched == 2, timeout=30, what="both Get streams to start")
            wait_until(lambda: daemon._watchdog.watched == 0 and daemon.metrics.in_flight._value.get() == 0,
                       timeout=30, what="the unread Get streams to be ended")
        finally:
            for call in held:
                call.cancel()
        for call in held:
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            assert info.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
        families = {m.name: m for m in daemon.metrics.registry.collect()}
        ended = {s.labels["op"]: s.value for s in families["strata_rpc_idle_streams_ended"].samples
                 if s.name.endswith("_total")}
        assert ended == {"Get": 2}
    with Client(daemon.target, use_shm=False) as kv:  # the slots came back
        assert [kv.get("m", b"big") for _ in range(3)] == [data] * 3


def test_a_get_that_is_read_to_the_end_is_not_ended(make_daemon):
    daemon = _idle_daemon(make_daemon)
    data = value(6, 8 * MiB)
    with Client(daemon.target, use_shm=False) as kv:
        kv.put("m", b"big", data)
        assert kv.get("m", b"big") == data


def test_a_slow_put_that_keeps_sending_is_not_ended(make_daemon):
    """Progress is any message: a stream much slower than the limit, but never silent for it, finishes."""
    daemon = make_daemon(stream_idle_seconds=2.0)
    data = value(9, 64 << 10)
    step = len(data) // 64

    def slowly():
        yield pb.PutRequest(namespace="m", header=pb.BlockHeader(key=b"slow", size=len(data), checksum=checksum(data)))
        for off in range(0, len(data), step):
            time.sleep(0.04)  # 64 gaps: together longer than the limit, each far shorter
            yield pb.PutRequest(chunk=data[off : off + step])

    with grpc.insecure_channel(daemon.target) as channel:
        stub = kv_pb2_grpc.KVServiceStub(channel)
        [result] = stub.Put(slowly(), timeout=60).results
        assert result.stored
    with Client(daemon.target, use_shm=False) as kv:
        assert kv.get("m", b"slow") == data


def test_a_same_host_connection_that_stalls_in_a_partial_frame_is_closed(make_daemon):
    """The same-host socket's kernel timeouts cover a frame cut short: the connection is dropped,
    and since a request is served only once its frame is whole, it held no slot or lease."""
    from kvstore.transport.samehost import frames

    daemon = make_daemon(same_host_idle_seconds=IDLE_S)
    server = daemon._same_host
    with Client(daemon.target, use_shm=False) as kv:
        kv.put("m", b"kept", value(7, 4096))
    with grpc.insecure_channel(daemon.target) as channel:
        attach = kv_pb2_grpc.KVServiceStub(channel).Attach(pb.AttachRequest(), timeout=10)
    with connect_unix(server.path, 30) as sock:  # the path may pass sun_path's 107 bytes
        reader = frames.FrameReader(sock)
        frames.send(sock, frames.encode([frames.HELLO, 1, [frames.PROTOCOL_VERSION, attach.arena_token]]))
        assert reader.read()[0][1] == frames.OK
        data = value(3, 64 << 10)
        head = frames.encode([frames.PUT, 2, ["m", 0, [[b"k", len(data), checksum(data), None, ""]]]], len(data))
        sock.sendall(head + data[: len(data) // 2])  # half the payload, then nothing
        wait_until(lambda: server.connections == 0, timeout=30, what="the stalled connection to be closed")
        with pytest.raises((EOFError, ConnectionError)):
            while True:
                reader.read()
    with Client(daemon.target, use_shm=False) as kv:
        assert kv.exists("m", [b"k"]) == []
        assert kv.stats().open_slots == 0
        assert kv.get("m", b"kept") == value(7, 4096)


def test_a_put_the_client_cancels_is_not_an_internal_error(make_daemon, caplog):
    """A client that cancels mid-stream used to be logged as an unexpected failure and counted INTERNAL."""
    daemon = _idle_daemon(make_daemon, stream_idle_seconds=60)
    started = threading.Event()

    def header_then_wait():
        yield pb.PutRequest(namespace="m", header=pb.BlockHeader(key=b"k", size=MiB, checksum=1))
        started.set()
        time.sleep(30)

    with grpc.insecure_channel(daemon.target) as channel:
        call = kv_pb2_grpc.KVServiceStub(channel).Put.future(header_then_wait(), timeout=60)
        assert started.wait(30)
        wait_until(lambda: daemon._watchdog.watched == 1, timeout=30, what="the Put to start")
        call.cancel()
        wait_until(lambda: daemon._watchdog.watched == 0 and daemon.metrics.in_flight._value.get() == 0,
                   timeout=30, what="the cancelled Put to end")
    families = {m.name: m for m in daemon.metrics.registry.collect()}
    codes = {s.labels["code"] for s in families["strata_rpc_errors"].samples if s.name.endswith("_total")}
    # CANCELLED, or (gRPC's sync server may see a cancel as the end of the stream) the block's
    # incompleteness: never an internal error.
    assert codes and codes <= {"CANCELLED", "INVALID_ARGUMENT"}, codes
    assert "failed unexpectedly" not in caplog.text


def _memory_kib(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {name: int(fields[name].split()[0]) for name in ("RssAnon", "RssFile", "RssShmem")}


def test_slow_streams_write_their_chunks_into_the_arena_not_into_buffers(daemon_process):
    """Chunks land in their final place as they arrive: streams that each declared a big block
    and sent most of it hold those bytes in the arena only; the daemon's private memory stays
    flat instead of holding a buffer per stream."""
    n, size, chunk = 6, 16 * MiB, 256 << 10
    sent = size - MiB
    proc = daemon_process("--ram-bytes", "256MiB", "--max-block-bytes", "16MiB", "--put-budget-bytes", "96MiB",
                          "--stream-idle-seconds", "120", "--max-streams", str(n), "--max-streams-per-identity", str(n))
    with Client(proc.target, use_shm=False) as kv:
        kv.put("m", b"warm", value(1, 64 << 10))
    pid = proc.proc.pid
    before = _memory_kib(pid)
    release = threading.Event()

    def most_then_stall(i: int):
        data = value(i, size)
        yield pb.PutRequest(namespace="m", header=pb.BlockHeader(key=b"slow-%d" % i, size=size, checksum=checksum(data)))
        for off in range(0, sent, chunk):
            yield pb.PutRequest(chunk=data[off : off + chunk])
            time.sleep(0.005)  # slowly: what gRPC's own flow-control windows hold stays small
        release.wait(120)

    with grpc.insecure_channel(proc.target) as channel:
        stub = kv_pb2_grpc.KVServiceStub(channel)
        calls = [stub.Put.future(most_then_stall(i), timeout=120) for i in range(n)]
        try:
            def grown() -> dict[str, int]:
                now = _memory_kib(pid)
                return {k: (now[k] - before[k]) << 10 for k in now}

            wait_until(lambda: sum(grown().values()) >= 0.9 * n * sent, timeout=60,
                       what="the daemon to receive most of every stream's bytes")
            growth = grown()
            # Before: a buffer per stream, all n * sent of it. Now what stays private is gRPC's own
            # receive windows, which grow on a loaded machine: half of n * sent still tells the two apart.
            assert growth["RssAnon"] < n * sent // 2, growth
            assert growth["RssFile"] + growth["RssShmem"] >= n * sent // 2, growth  # the arena's pages
        finally:
            release.set()
            for call in calls:
                call.cancel()


# ---- the store's writer: chunks straight into the head ------------------------------------------


@pytest.fixture
def store(tmp_path):
    from kvstore.store import StoreLimits, TieredStore
    from kvstore.tiers.disk import DiskTier
    from kvstore.tiers.ram import HostRamTier
    from tests.support.store_blocks import Clock

    tiers = [HostRamTier(4 * MiB, shm_dir=str(tmp_path), arena_name="w"), DiskTier(tmp_path / "disk", 32 * MiB)]
    s = TieredStore(tiers, limits=StoreLimits.from_settings(max_block_bytes=2 * MiB, demotion_threads=0), clock=Clock())
    yield s
    s.close()


def _meta(data: bytes, parent: bytes | None = None):
    from kvstore.block import BlockMeta

    return BlockMeta(len(data), checksum(data), parent, "")


def _write_all(writer, data: bytes, step: int = 100_000) -> None:
    for off in range(0, len(data), step):
        writer.write(data[off : off + step])


def test_a_streamed_block_is_written_in_place_and_committed(store):
    from kvstore.block import BlockKey, TierName

    data = value(1, MiB + 123)
    used = store.head.stats().used_bytes
    writer = store.open_write(BlockKey("m", b"k"), _meta(data))
    assert writer.in_place and not writer.present
    assert store.head.stats().used_bytes > used  # its extent is taken at the header
    _write_all(writer, data)
    assert writer.commit(None) == (True, TierName.HOST)
    writer.abort()  # after a commit: nothing to give back
    assert store.get(BlockKey("m", b"k"))[0] == data


def test_an_aborted_or_mismatched_streamed_block_gives_its_extent_back_and_stores_nothing(store):
    from kvstore.block import BlockKey, BlockMeta
    from kvstore.errors import CorruptBlock, InvalidArgument

    store.put(BlockKey("m", b"seed"), value(0, 4096), _meta(value(0, 4096)))
    used = store.head.stats().used_bytes
    data = value(2, MiB)
    half = store.open_write(BlockKey("m", b"half"), _meta(data))
    half.write(data[: len(data) // 2])
    with pytest.raises(InvalidArgument, match="after 524288 of its 1048576 bytes"):
        half.commit(None)
    half.abort()
    wrong = store.open_write(BlockKey("m", b"wrong"), BlockMeta(len(data), checksum(data) ^ 1))
    _write_all(wrong, data)
    with pytest.raises(CorruptBlock, match="nothing was stored"):
        wrong.commit(None)
    wrong.abort()
    over = store.open_write(BlockKey("m", b"over"), _meta(data))
    with pytest.raises(InvalidArgument, match="declared 1048576 bytes"):
        over.write(data + b"x")
    over.abort()
    assert store.head.stats().used_bytes == used
    assert store.exists("m", [b"half"]) == store.exists("m", [b"wrong"]) == store.exists("m", [b"over"]) == []


def test_a_streamed_block_already_stored_is_dropped_as_it_arrives(store):
    from kvstore.block import BlockKey, TierName

    data = value(3, MiB)
    store.put(BlockKey("m", b"k"), data, _meta(data))
    used = store.head.stats().used_bytes
    writer = store.open_write(BlockKey("m", b"k"), _meta(data))
    assert writer.present and not writer.in_place
    _write_all(writer, data)
    assert store.head.stats().used_bytes == used
    assert writer.commit(None) == (False, TierName.HOST)


def test_a_streamed_block_finds_no_room_at_once_then_is_buffered_and_stored_at_commit(store):
    """The head full of pinned blocks at the header: the writer buffers instead of waiting there,
    and its commit is an ordinary put, which finds room once the pins end."""
    from kvstore.block import BlockKey, TierName

    keys = [b"p%d" % i for i in range(4)]
    for i, k in enumerate(keys):
        store.put(BlockKey("m", k), value(10 + i, MiB - 4096), _meta(value(10 + i, MiB - 4096)))
    lease, _ = store.pin("m", keys)
    data = value(4, MiB)
    writer = store.open_write(BlockKey("m", b"late"), _meta(data))
    assert not writer.in_place and not writer.present
    _write_all(writer, data)
    store.unpin(lease.id)
    assert writer.commit(None)[0] is True
    assert store.get(BlockKey("m", b"late"))[0] == data
    assert all(store.get(BlockKey("m", k)) is not None for k in keys)  # demoted, not lost
    assert TierName.DISK in {t for k in keys for t in store.exists("m", [k])}


def test_a_streamed_blocks_parent_is_pinned_while_it_is_written(store):
    from kvstore.block import BlockKey

    parent = value(5, 4096)
    store.put(BlockKey("m", b"parent"), parent, _meta(parent))
    child = value(6, 8192)
    writer = store.open_write(BlockKey("m", b"child"), _meta(child, parent=b"parent"))
    assert store.stats().pinned_blocks == 1
    writer.abort()
    assert store.stats().pinned_blocks == 0
