"""The transport contract (kvstore/transport/base.py), one suite over every transport.

Each transport talks to the same real daemon: in-process through its store,
the others through its gRPC port, its arena, its same-host socket and its
peer data plane (peer-tcp, over its --peer-listen TCP port; peer-ucx, over
its --peer-ucx-listen UCX port; peer-ucx-shm, over UCX shared memory with
--peer-ucx-shm; the UCX ones skipped where ucxx cannot be imported). The
asyncio twins of grpc, grpc-arena and same-host (``*-asyncio``) run the same
suite, each driven on a loop of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading

import pytest

from kvstore.block import TierName
from kvstore.errors import Cancelled, CorruptBlock, DeadlineExceeded, InvalidArgument, InvalidKey, UnknownNamespace
from kvstore.peer.ucx_link import ucx_available
from kvstore.transport import (
    ASYNC_TRANSPORTS, TRANSPORTS, BlockPut, Deadline, open_async_transport, open_transport, placement,
)
from kvstore.transport.base import BlockInfo, Transport
from tests.support.wait import wait_until

MiB = 1 << 20
ASYNCIO = ["grpc-asyncio", "grpc-arena-asyncio", "same-host-asyncio"]  # the asyncio twins (ASYNC_TRANSPORTS)
NAMES = ["in-process", "grpc", "grpc-arena", "same-host", *ASYNCIO, "peer-tcp", "peer-ucx", "peer-ucx-shm"]
UCX, NO_UCX = ucx_available()


def blob(seed: int, size: int) -> bytes:
    return (seed.to_bytes(8, "big") + os.urandom(8)) * (size // 16) + b"x" * (size % 16)


def deadline(seconds: float = 10.0) -> Deadline:
    return Deadline.after(seconds)


@pytest.fixture(scope="module", params=NAMES)
def name(request):
    return request.param


@pytest.fixture
def daemon(make_daemon, name):
    if name not in ("peer-ucx", "peer-ucx-shm"):
        return make_daemon(auto_create_namespaces=True, namespaces="m", peer_listen="127.0.0.1:0")
    if not UCX:
        pytest.skip(NO_UCX)
    if name == "peer-ucx-shm":
        return make_daemon(auto_create_namespaces=True, namespaces="m", peer_listen="127.0.0.1:0", peer_ucx_shm=True)
    # ucxx's listener binds every interface: protected mode wants authentication or --insecure
    return make_daemon(auto_create_namespaces=True, namespaces="m", peer_listen="127.0.0.1:0",
                       peer_ucx_listen="127.0.0.1:0", insecure=True)


class OnItsLoop(Transport):
    """An asyncio transport (kvstore.transport.ASYNC_TRANSPORTS) driven from this thread, its loop in
    another: the same suite then runs over it. The Deadline goes through as it is; a cancellation of it
    also cancels the call's task, as a caller's cancellation of its own task would."""

    def __init__(self, name: str, daemon) -> None:
        self.name = name
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._inner = self._run(open_async_transport(name.removesuffix("-asyncio"), target=daemon.target), None)
        self.shared_memory = self._inner.shared_memory

    def _run(self, coro, deadline: Deadline | None):
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        forget = deadline.on_cancel(future.cancel) if deadline is not None else (lambda: None)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            deadline.check()
            raise
        finally:
            forget()

    def put(self, namespace, blocks, deadline):
        return self._run(self._inner.put(namespace, blocks, deadline), deadline)

    def get_into(self, namespace, keys, place, deadline):
        return self._run(self._inner.get_into(namespace, keys, place, deadline), deadline)

    def close(self):
        self._run(self._inner.close(), None)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()


@pytest.fixture
def transport(daemon, name):
    if name in ASYNCIO:
        t = OnItsLoop(name, daemon)
    elif name in ("peer-tcp", "peer-ucx", "peer-ucx-shm"):
        t = open_transport(name, target=daemon.peer_addresses()[name.removeprefix("peer-")])
    else:
        t = open_transport(name, **({"store": daemon.store} if name == "in-process" else {"target": daemon.target}))
    assert t.name == name
    yield t
    t.close()


def holds_nothing(daemon) -> bool:
    s = daemon.store.stats()
    return s.active_leases == 0 and s.open_slots == 0 and s.pinned_blocks == 0


def test_every_transport_is_registered():
    assert set(NAMES) - set(ASYNCIO) <= set(TRANSPORTS)
    assert {name.removesuffix("-asyncio") for name in ASYNCIO} == set(ASYNC_TRANSPORTS)


def test_an_unknown_transport_names_the_known_ones():
    with pytest.raises(InvalidArgument, match="known: .*grpc.*in-process.*same-host"):
        open_transport("carrier-pigeon")


@pytest.mark.parametrize("size", [1, 4096, 65536 + 3, 300_000, 3 * MiB + 17])
def test_round_trip_into_new_buffers(transport, size):
    data = blob(size, size)
    assert transport.put("m", [BlockPut(b"k", data, layout="bf16[2]")], deadline()) == [True]
    assert transport.put("m", [BlockPut(b"k", data)], deadline()) == [False]
    [block] = transport.get_into("m", [b"k"], None, deadline())
    assert bytes(block.data) == data and block.layout == "bf16[2]" and block.tier is TierName.HOST
    assert block.key == b"k" and block.parent is None


def test_batches_keep_order_mix_sizes_and_report_misses(transport, daemon):
    items = [BlockPut(b"b%d" % i, blob(i, size), parent=b"b%d" % (i - 1) if i else None, layout=str(i))
             for i, size in enumerate([10, 200_000, 2 * MiB, 70_000, 1])]
    assert transport.put("m", items, deadline()) == [True] * 5
    got = transport.get_into("m", [b"b4", b"nope", b"b2", b"b0", b"b1"], None, deadline())
    assert got[1] is None
    assert [bytes(b.data) for b in (got[0], got[2], got[3], got[4])] == [
        items[4].value, items[2].value, items[0].value, items[1].value]
    assert got[2].layout == "2" and got[2].parent == b"b1"
    wait_until(lambda: holds_nothing(daemon), what="every read lease to be released")


def test_reads_land_in_the_callers_buffers(transport):
    values = [blob(i, 50_000 + i) for i in range(3)]
    transport.put("m", [BlockPut(b"c%d" % i, v) for i, v in enumerate(values)], deadline())
    buffers = [bytearray(60_000) for _ in values]
    got = transport.get_into("m", [b"c0", b"c1", b"c2"], placement([b"c0", b"c1", b"c2"], buffers), deadline())
    for block, buf, value in zip(got, buffers, values):
        assert bytes(buf[: len(value)]) == value
        assert len(block.data) == len(value)
        block.data[0] ^= 0xFF  # a view of the caller's buffer, not a copy
        assert buf[0] == value[0] ^ 0xFF


def test_a_placement_sees_each_block_first_and_may_decline_it(transport, daemon):
    transport.put("m", [BlockPut(b"p%d" % i, blob(i, 30_000 * (i + 1)), layout="L%d" % i) for i in range(3)], deadline())
    seen: list[tuple[int, BlockInfo]] = []
    buf = bytearray(300_000)

    def place(i, info):
        seen.append((i, info))
        return None if i == 1 else memoryview(buf)[i * 90_000 : i * 90_000 + info.size]

    keys = [b"p0", b"p1", b"p2", b"absent"]
    got = transport.get_into("m", keys, placement(keys, place), deadline())
    assert [(i, info.size, info.layout) for i, info in seen] == [(0, 30_000, "L0"), (1, 60_000, "L1"), (2, 90_000, "L2")]
    assert got[1] is None and got[3] is None
    assert bytes(got[2].data) == bytes(buf[180_000:270_000])
    wait_until(lambda: holds_nothing(daemon), what="declined blocks' leases to be released")


def test_a_placement_that_raises_gives_the_read_back(transport, daemon):
    transport.put("m", [BlockPut(b"r", blob(1, 40_000))], deadline())

    def refuse(i, info):
        raise InvalidArgument("no room for it")

    with pytest.raises(InvalidArgument, match="no room"):
        transport.get_into("m", [b"r"], placement([b"r"], refuse), deadline())
    wait_until(lambda: holds_nothing(daemon), what="the refused read's lease to be released")
    [block] = transport.get_into("m", [b"r"], None, deadline())  # still usable
    assert block is not None


def test_a_buffer_too_small_is_invalid_argument(transport):
    transport.put("m", [BlockPut(b"big", blob(2, 10_000))], deadline())
    with pytest.raises(InvalidArgument, match="pass a larger buffer"):
        transport.get_into("m", [b"big"], placement([b"big"], [bytearray(100)]), deadline())


def test_errors_are_the_daemons_classes(transport):
    with pytest.raises(UnknownNamespace):
        transport.get_into("never-used", [b"k"], None, deadline())
    with pytest.raises(InvalidKey):
        transport.get_into("m", [b""], None, deadline())
    with pytest.raises(InvalidKey):
        transport.put("m", [BlockPut(b"", b"x")], deadline())


def test_a_passed_deadline_is_deadline_exceeded_and_the_transport_goes_on(transport, daemon):
    transport.put("m", [BlockPut(b"d", blob(3, 1000))], deadline())
    with pytest.raises(DeadlineExceeded):
        transport.get_into("m", [b"d"], None, Deadline.after(-1))
    with pytest.raises(DeadlineExceeded):
        transport.put("m", [BlockPut(b"e", blob(4, 1000))], Deadline.after(-1))
    [block] = transport.get_into("m", [b"d"], None, deadline())
    assert block is not None
    wait_until(lambda: holds_nothing(daemon), what="the read's lease to be released")


def test_a_cancelled_call_raises_cancelled_and_holds_nothing(transport, daemon):
    transport.put("m", [BlockPut(b"x", blob(5, 1000))], deadline())
    cancelled = deadline()
    cancelled.cancel()
    with pytest.raises(Cancelled):
        transport.get_into("m", [b"x"], None, cancelled)
    with pytest.raises(Cancelled):
        transport.put("m", [BlockPut(b"y", blob(6, 3 * MiB))], cancelled)
    wait_until(lambda: holds_nothing(daemon), what="the cancelled calls to hold nothing")
    assert transport.get_into("m", [b"y"], None, deadline()) == [None]


def test_a_cancellation_from_another_thread_stops_a_placed_read(transport, daemon):
    """Cancelled while the placement runs (as a caller's other thread would): the read stops there."""
    transport.put("m", [BlockPut(b"t%d" % i, blob(i, 20_000)) for i in range(3)], deadline())
    call = deadline()

    def place(i, info):
        if i == 0:
            t = threading.Thread(target=call.cancel)
            t.start()
            t.join()
        call.check()
        return bytearray(info.size)

    keys = [b"t0", b"t1", b"t2"]
    with pytest.raises(Cancelled):
        transport.get_into("m", keys, placement(keys, place), call)
    wait_until(lambda: holds_nothing(daemon), what="the cancelled read's leases to be released")


def test_bytes_that_fail_their_checksum_are_never_delivered(transport, daemon):
    data = blob(7, 100_000)
    transport.put("m", [BlockPut(b"bad", data)], deadline())
    [loc] = daemon.store.lookup("m", [b"bad"])
    view = daemon.store.head.arena.view(loc.offset + 500, 1)
    view[0] ^= 0x01  # a flipped bit in RAM
    view.release()
    daemon.store.release([loc.lease_id])
    try:
        got = transport.get_into("m", [b"bad"], None, deadline())
    except CorruptBlock:
        got = [None]
    assert got == [None] or bytes(got[0].data) == data
    assert transport.get_into("m", [b"bad"], None, deadline()) == [None]  # the corrupt copy was dropped


def test_the_clients_own_deadlines_take_the_fast_path_and_refuse_cancel(transport, daemon):
    own = Deadline.after(10, cancellable=False)
    assert transport.put("m", [BlockPut(b"own", b"v" * 5000)], own) == [True]
    [block] = transport.get_into("m", [b"own"], None, own)
    assert bytes(block.data) == b"v" * 5000
    with pytest.raises(InvalidArgument, match="not cancellable"):
        own.cancel()
