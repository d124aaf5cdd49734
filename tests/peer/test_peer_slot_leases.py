"""A peer PUT's slots and their leases, over real sockets to a real daemon.

A peer PUT reserves arena slots under short slot leases, then receives the
DATA frame's bytes into them. A writer late with its bytes, whether slow or
hostile, must find its slot's lease expired and store nothing: an expired
slot's extent may already hold another tenant's block, and writing it would
destroy that acknowledged block. The late writer is told why (LeaseExpired,
put again), and its connection and the daemon go on serving.

The writer here speaks the protocol frame by frame (:mod:`kvstore.peer.wire`),
so it can stop where a real one might stall: before its DATA frame, after its
head, or (over TCP, a byte stream) in the middle of a block. The TCP and UCX
listeners share the PUT code; both are driven (UCX skipped where ucxx cannot
be imported). Tenant B writes and reads through the gRPC stream, which
takes no slot lease, so nothing of B's depends on timing. Nothing waits on
the clock: each test waits for the store's reaper to have ended the slot.
"""

from __future__ import annotations

import os

import pytest
from kvstore.block import checksum
from kvstore.client import Client
from kvstore.errors import InvalidArgument, LeaseExpired
from kvstore.peer import PeerAddress, wire
from kvstore.peer.ucx_link import ucx_available
from tests.support.peer_listener import raw_hello
from tests.support.wait import wait_until

pytestmark = pytest.mark.system

UCX, NO_UCX = ucx_available()

MiB = 1 << 20
CONFIG = dict(ram_bytes="32MiB", disk_bytes="0", max_block_bytes="4MiB", auto_create_namespaces=True,
              peer_listen="127.0.0.1:0", lease_seconds=5)
# A Put whose deadline is this close gets the shortest slot lease the peer server grants (1 s):
# short enough for a test to wait out, long enough for an honest retry to finish in.
SHORT_MS = 200
TENANT_B_BLOCKS = 8


class RawWriter:
    """One peer connection, spoken frame by frame: PUT, then its DATA frame in parts, when the test says.
    Over UCX each :meth:`send` is one message, so a block is sent whole."""

    def __init__(self, daemon, scheme: str = "tcp") -> None:
        if scheme == "tcp":
            self.sock = raw_hello(daemon.peer_server.port)
            self.link = wire.Wire(self.sock)
        else:
            from kvstore.peer.ucx import _UcxConnection

            self.sock, self.link = _UcxConnection._open(PeerAddress.parse(daemon.peer_addresses()["ucx"]), 10)
            self.sock.settimeout(30)
            wire.send(self.sock, wire.encode([wire.HELLO, 1, [wire.PROTOCOL_VERSION, ""]]))
            assert self.link.read_meta()[0][:2] == [1, wire.OK]
        self._rid = 1

    def reply(self, rid: int):
        (got, status, result), payload = self.link.read_meta()
        assert (got, payload) == (rid, 0), (got, status, result)
        return status, result

    def put(self, namespace: str, blocks: list[tuple[bytes, bytes]], timeout_ms: int, layout="L") -> int:
        self._rid += 1
        head = [[key, len(data), checksum(data), None, layout] for key, data in blocks]
        wire.send(self.sock, wire.encode([wire.PUT, self._rid, [namespace, timeout_ms, head]]))
        return self._rid

    def granted(self, rid: int) -> list[bool]:
        status, present = self.reply(rid)
        assert status == wire.OK, present
        return present

    def data_head(self, rid: int, total: int) -> None:
        wire.send(self.sock, wire.encode([wire.DATA, rid, []], total))

    def send(self, data: bytes | memoryview) -> None:
        self.sock.sendall(data)

    def stored(self, rid: int) -> list:
        status, out = self.reply(rid)
        assert status == wire.OK, out
        return out

    def close(self) -> None:
        self.sock.close()


def blob(seed: int, size: int) -> bytes:
    return (seed.to_bytes(8, "big") + os.urandom(8)) * (size // 16)


def lost_blocks(tenant: Client, values: dict[bytes, bytes]) -> list[bytes]:
    """Tenant B's keys that no longer read back as written (a miss, a checksum failure, other bytes)."""
    lost = []
    for key, value in values.items():
        try:
            if tenant.get("b", key) != value:
                lost.append(key)
        except Exception:  # noqa: BLE001 - DATA_LOSS or any other failure: the block is lost to B
            lost.append(key)
    return lost


def slot_ended(daemon) -> bool:
    """The reaper ended every open slot (what a lapsed lease leaves: nothing open)."""
    daemon.store.expire_leases()
    return daemon.store.stats().open_slots == 0


def assert_expired(result) -> None:
    stored, err = result
    assert stored is None and err[0] == "LeaseExpired", result
    assert "put" in err[1] and "again" in err[1], err  # says what to do


def assert_still_serves(writer: RawWriter, daemon) -> None:
    """The same connection takes a new put at once, and it is stored."""
    value = blob(99, MiB)
    rid = writer.put("a", [(b"again", value)], timeout_ms=30_000)
    assert writer.granted(rid) == [False]
    writer.data_head(rid, len(value))
    writer.send(value)
    [(stored, tier)] = writer.stored(rid)
    assert stored is True, tier
    with Client(daemon.target, use_shm=False) as c:
        assert c.get("a", b"again") == value


@pytest.fixture
def daemon(make_daemon):
    return make_daemon(**CONFIG)


@pytest.fixture(params=["tcp", pytest.param("ucx", marks=pytest.mark.skipif(not UCX, reason=NO_UCX))])
def scheme(request) -> str:
    return request.param


@pytest.fixture
def served(make_daemon, scheme):
    """A daemon serving peers over ``scheme``, and that scheme."""
    extra = {"peer_ucx_listen": "127.0.0.1:0", "insecure": True} if scheme == "ucx" else {}
    return make_daemon(**CONFIG, **extra), scheme


def test_a_put_whose_slot_lapsed_before_its_data_stores_nothing_and_no_other_block_is_touched(served):
    daemon, scheme = served
    writer = RawWriter(daemon, scheme)
    late = blob(1, MiB)
    try:
        rid = writer.put("a", [(b"late", late)], timeout_ms=SHORT_MS)
        assert writer.granted(rid) == [False]
        wait_until(lambda: slot_ended(daemon), what="the late writer's slot lease to be reaped")
        # Tenant B's blocks take the arena the slot gave back.
        values = {b"b%d" % i: blob(100 + i, MiB) for i in range(TENANT_B_BLOCKS)}
        with Client(daemon.target, use_shm=False) as tenant:
            for key, value in values.items():
                assert tenant.put("b", key, value)
            writer.data_head(rid, len(late))
            writer.send(late)
            [result] = writer.stored(rid)
            assert lost_blocks(tenant, values) == [], "the late write destroyed tenant B's acknowledged blocks"
            assert_expired(result)
            assert tenant.get("a", b"late") is None
        assert_still_serves(writer, daemon)
    finally:
        writer.close()
    wait_until(lambda: slot_ended(daemon) and daemon.peer_server.in_flight_bytes == 0, what="the slots to be given back")


def test_bytes_that_come_after_the_lease_lapsed_under_a_write_in_progress_land_in_no_other_block(served):
    """The DATA frame's head comes in time, so the daemon is already waiting to receive into the
    slot when the lease lapses; the bytes come only after tenant B wrote. The extent must still
    be the slot's when they land, and the block is not stored."""
    daemon, scheme = served
    writer = RawWriter(daemon, scheme)
    late = blob(6, 2 * MiB)
    try:
        rid = writer.put("a", [(b"stalled", late)], timeout_ms=SHORT_MS)
        assert writer.granted(rid) == [False]
        writer.data_head(rid, len(late))
        wait_until(lambda: slot_ended(daemon), what="the stalled writer's slot lease to be reaped")
        values = {b"b%d" % i: blob(300 + i, MiB) for i in range(TENANT_B_BLOCKS)}
        with Client(daemon.target, use_shm=False) as tenant:
            for key, value in values.items():
                assert tenant.put("b", key, value)
            writer.send(late)
            [result] = writer.stored(rid)
            assert lost_blocks(tenant, values) == [], "the late write destroyed tenant B's acknowledged blocks"
            assert_expired(result)
            assert tenant.get("a", b"stalled") is None
        assert_still_serves(writer, daemon)
    finally:
        writer.close()
    wait_until(lambda: slot_ended(daemon) and daemon.peer_server.in_flight_bytes == 0, what="the slots to be given back")


def test_a_lease_that_lapses_mid_block_stops_the_write_and_keeps_its_extent_from_reuse_meanwhile(daemon):
    """The writer stalls in the middle of a block until its lease has been reaped; the bytes it
    sends then must not land in an extent handed to tenant B meanwhile."""
    writer = RawWriter(daemon)
    late = memoryview(blob(2, 2 * MiB))
    first = 3 * wire.CHUNK_BYTES // 2  # the daemon is then waiting in the middle of its second chunk
    try:
        rid = writer.put("a", [(b"slow", bytes(late))], timeout_ms=SHORT_MS)
        assert writer.granted(rid) == [False]
        writer.data_head(rid, len(late))
        writer.send(late[:first])
        wait_until(lambda: slot_ended(daemon), what="the slow writer's slot lease to be reaped")
        values = {b"b%d" % i: blob(200 + i, MiB) for i in range(TENANT_B_BLOCKS)}
        with Client(daemon.target, use_shm=False) as tenant:
            for key, value in values.items():
                assert tenant.put("b", key, value)
            writer.send(late[first:])
            [result] = writer.stored(rid)
            assert lost_blocks(tenant, values) == [], "the late write destroyed tenant B's acknowledged blocks"
            assert_expired(result)
            assert tenant.get("a", b"slow") is None
        assert_still_serves(writer, daemon)
    finally:
        writer.close()
    wait_until(lambda: slot_ended(daemon) and daemon.peer_server.in_flight_bytes == 0, what="the slots to be given back")


def test_a_lease_that_lapses_between_blocks_fails_them_and_the_stream_stays_in_step(daemon):
    """The lease is checked again before each block's bytes land: a slot that lapsed after the
    first block came has the rest of its bytes read and thrown away, so the connection stays in
    step, and no block of the request is stored (each is committed only after the whole frame)."""
    writer = RawWriter(daemon)
    a, b = blob(3, MiB), blob(4, MiB)
    try:
        rid = writer.put("a", [(b"first", a), (b"second", b)], timeout_ms=SHORT_MS)
        assert writer.granted(rid) == [False, False]
        writer.data_head(rid, len(a) + len(b))
        writer.send(a)
        wait_until(lambda: slot_ended(daemon), what="the slot leases to be reaped")
        writer.send(b)
        for result in writer.stored(rid):
            assert_expired(result)
        assert_still_serves(writer, daemon)
    finally:
        writer.close()


@pytest.mark.parametrize("layout", [5, [b"x"], b"bytes"])
def test_a_put_with_a_layout_that_is_not_a_string_is_invalid_argument_and_the_connection_goes_on(daemon, layout):
    writer = RawWriter(daemon)
    try:
        rid = writer.put("a", [(b"k", b"v" * 10)], timeout_ms=30_000, layout=layout)
        status, err = writer.reply(rid)
        assert status == wire.ERROR and err[0] == "InvalidArgument" and "layout" in err[1], err
        assert_still_serves(writer, daemon)
    finally:
        writer.close()
    assert daemon.store.stats().open_slots == 0 and daemon.peer_server.in_flight_bytes == 0


@pytest.mark.parametrize("parent", [5, "text", [b"p"]])
def test_a_put_with_a_parent_that_is_not_a_key_is_invalid_argument(daemon, parent):
    writer = RawWriter(daemon)
    try:
        rid = writer._rid = writer._rid + 1
        head = [[b"k", 10, checksum(b"v" * 10), parent, "L"]]
        wire.send(writer.sock, wire.encode([wire.PUT, rid, ["a", 30_000, head]]))
        status, err = writer.reply(rid)
        assert status == wire.ERROR and err[0] in ("InvalidArgument", "InvalidKey") and "parent" in err[1], err
        assert_still_serves(writer, daemon)
    finally:
        writer.close()


# ---- the store's hold on a slot the daemon writes ---------------------------------------


def test_a_slot_being_written_keeps_its_extent_past_its_lease_until_the_write_ends(daemon):
    """What the peer server relies on, on the store itself: ``writing`` refuses a lapsed slot, and
    a slot that lapses while written stays reserved (no other block can be given its extent)
    until the write ends, then is freed; a commit meanwhile is refused."""
    store = daemon.store
    value = blob(5, MiB)
    free_before = store.head.used_bytes
    [grant] = store.allocate("a", [(b"held", MiB, None, "")], lease_s=30)
    with store.writing(grant.slot_id) as slot:
        slot.check()  # live
        with pytest.raises(InvalidArgument, match="still being written"):
            store.commit([(grant.slot_id, checksum(value))])
        view = store.head.view(slot.offset, MiB)
        view[:] = value
        view.release()
    [(_, stored, _)] = store.commit([(grant.slot_id, checksum(value))])
    assert stored is True

    [grant] = store.allocate("a", [(b"lapses", MiB, None, "")], lease_s=0.05)
    used = store.head.used_bytes
    with store.writing(grant.slot_id) as slot:
        wait_until(lambda: slot_ended(daemon), what="the slot lease to be reaped")
        assert store.head.used_bytes == used  # still reserved: the write in progress holds it
        with pytest.raises(LeaseExpired, match="put the block again"):
            slot.check()
    assert store.head.used_bytes == used - MiB  # the write's end gave it back
    with pytest.raises(LeaseExpired, match="put the block again"), store.writing(grant.slot_id):
        pass
    with pytest.raises(LeaseExpired):
        store.commit([(grant.slot_id, 0)])
    assert store.head.used_bytes == free_before + MiB  # only the committed block
