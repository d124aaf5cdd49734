"""Streams that stop making progress are ended, and give back everything they held.

Real daemons on real sockets. The idle limit is small; every wait here is
"eventually, within a generous bound", never a timing claim.
"""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import wait_until
from kvstore import Client
from kvstore.api.v1 import kv_pb2 as pb
from kvstore.api.v1 import kv_pb2_grpc
from kvstore.block import checksum
from store_blocks import MiB, value

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
    daemon = _idle_daemon(make_daemon, workers=6, put_budget_bytes="16MiB", max_block_bytes="8MiB")
    admitted = daemon.settings.server.admitted_rpcs
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


def test_a_get_whose_client_stops_reading_is_ended(make_daemon):
    daemon = _idle_daemon(make_daemon, workers=4)
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
    from kvstore.transport import frames

    daemon = make_daemon(same_host_idle_seconds=IDLE_S)
    server = daemon._same_host
    with Client(daemon.target, use_shm=False) as kv:
        kv.put("m", b"kept", value(7, 4096))
    with grpc.insecure_channel(daemon.target) as channel:
        attach = kv_pb2_grpc.KVServiceStub(channel).Attach(pb.AttachRequest(), timeout=10)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(server.path)
        sock.settimeout(30)
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
    assert codes == {"CANCELLED"}
    assert "failed unexpectedly" not in caplog.text
