"""The TCP peer data plane over real sockets: a daemon's --peer-listen and the peer client.

Real daemons (in-process, and a child process SIGKILLed mid-transfer), a
real corrupting TCP proxy between client and daemon, real auth policy
files. The contract parts every transport shares run in
test_transport_contract.py (peer-tcp there); these are the peer's own.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import threading
import time

import pytest

from kvstore.block import BlockKey, BlockMeta, TierName, checksum
from kvstore.errors import (
    CorruptBlock, DeadlineExceeded, InvalidArgument, Overloaded, PermissionDenied, TierUnavailable, Unauthenticated,
    UnknownNamespace,
)
from kvstore.peer import PeerAddress, open_peer_transport, wire
from kvstore.peer.tcp import TcpPeerClient
from kvstore.remote.base import ReadStatus, WriteStatus
from kvstore.server.endpoints import DaemonError
from kvstore.transport import BlockPut, Deadline, open_transport
from tests.support.daemons import DaemonProcess
from tests.support.identities import TOKEN_A, TOKEN_ADMIN, policy_text
from tests.support.peer_listener import BIG, holds_nothing, put, raw_hello
from tests.support.wait import wait_until

MiB = 1 << 20
def blob(seed: int, size: int) -> bytes:
    return (seed.to_bytes(8, "big") + os.urandom(8)) * (size // 16) + b"x" * (size % 16)


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def peer(make_daemon):
    return make_daemon(**BIG)


def test_a_daemon_advertises_its_peer_address_and_serves_nothing_without_the_flag(make_daemon):
    quiet = make_daemon()
    assert quiet.peer_addresses() == {} and quiet.peer_server is None
    d = make_daemon(peer_listen="127.0.0.1:0", peer_advertise="10.1.2.3:7000")
    assert d.peer_addresses() == {"tcp": "tcp://10.1.2.3:7000"}
    d2 = make_daemon(peer_listen="127.0.0.1:0")
    address = PeerAddress.parse(d2.peer_addresses()["tcp"])
    assert address.host == "127.0.0.1" and address.port == d2.peer_server.port != 0


def test_protected_mode_refuses_a_peer_listener_beyond_loopback_without_auth(make_daemon, tmp_path):
    with pytest.raises(DaemonError, match="protected mode: --peer-listen 0.0.0.0:0 .*--peer-listen 127.0.0.1:PORT"):
        make_daemon(peer_listen="0.0.0.0:0")
    assert make_daemon(peer_listen="0.0.0.0:0", insecure=True).peer_server is not None
    policy = tmp_path / "policy.toml"
    policy.write_text(policy_text())
    assert make_daemon(peer_listen="0.0.0.0:0", auth_file=str(policy)).peer_server is not None


def test_reads_land_verified_in_placed_views_big_blocks_and_batches(peer):
    values = {b"k%d" % i: blob(i, size) for i, size in enumerate([16 * MiB, 1, 4 * MiB + 3, 70_000, 1 * MiB])}
    put(peer, "m", values)
    keys = [b"k0", b"absent", b"k2", b"k1", b"k3", b"k4"]
    arena = bytearray(40 * MiB)  # stands for the local store's reserved slots
    seen = []

    def place(i, meta):
        seen.append((i, meta.size, meta.layout))
        at = 17 * MiB + (i - 1) * 5 * MiB if i else 0
        return memoryview(arena)[at : at + meta.size]

    async def go():
        t = open_peer_transport("tcp")
        try:
            got = await t.read(peer.peer_addresses()["tcp"], "m", keys, place, time.monotonic() + 30)
            metas = await t.lookup(peer.peer_addresses()["tcp"], "m", keys, time.monotonic() + 30)
            return got, metas, t.stats()
        finally:
            await t.close()

    got, metas, stats = run(go())
    assert [r.status for r in got] == [ReadStatus.HIT, ReadStatus.MISS] + [ReadStatus.HIT] * 4
    for i, key in enumerate(keys):
        if key in values:
            at = 17 * MiB + (i - 1) * 5 * MiB if i else 0
            assert bytes(arena[at : at + len(values[key])]) == values[key]
            assert got[i].meta.checksum == checksum(values[key]) and metas[i] == got[i].meta
    assert metas[1] is None
    assert [s[0] for s in seen] == [0, 2, 3, 4, 5]  # placed in key order, misses never
    assert stats.hits == 5 and stats.misses == 2 and stats.read_bytes == sum(map(len, values.values()))
    wait_until(lambda: holds_nothing(peer), what="every read lease on the peer to be released")


def test_a_read_ends_whatever_its_last_key_is_and_the_connection_goes_on(peer):
    """Each block leaves in one sendmsg and the OK after it: a miss, a failed key or a block last
    (or a block before a failed last key) still ends the read, the holder has given back the lease
    and the byte budget before the reader sees the OK, and the next read on the same connection
    lines up."""
    values = {b"a": blob(1, 3 * MiB + 5), b"b": blob(2, 70_000)}
    put(peer, "m", values)
    client = TcpPeerClient(max_idle_per_peer=1)
    address = peer.peer_addresses()["tcp"]
    buffers = [bytearray(4 * MiB) for _ in range(3)]
    place = lambda i, meta: memoryview(buffers[i])[: meta.size]  # noqa: E731
    try:
        [got] = client.read(address, "m", [b"b"], place, Deadline.after(10))
        assert got.result.is_hit
        [first] = client._idle[PeerAddress.parse(address)]
        for keys, want in [
            ([b"a", b""], [ReadStatus.HIT, ReadStatus.FAILED]),
            ([b"a", b"absent"], [ReadStatus.HIT, ReadStatus.MISS]),
            ([b"", b"a", b"b"], [ReadStatus.FAILED, ReadStatus.HIT, ReadStatus.HIT]),
            ([b"b"], [ReadStatus.HIT]),
        ]:
            got = client.read(address, "m", keys, place, Deadline.after(10))
            assert [g.result.status for g in got] == want
            assert holds_nothing(peer) and peer.peer_server.in_flight_bytes == 0
            for i, key in enumerate(keys):
                if want[i] is ReadStatus.HIT:
                    assert bytes(buffers[i][: len(values[key])]) == values[key]
        assert client._idle[PeerAddress.parse(address)] == [first]  # never thrown away: every reply ended in step
    finally:
        client.close()
    wait_until(lambda: holds_nothing(peer), what="every read lease on the peer to be released")


def test_writes_go_into_the_peers_arena_verified_and_idempotent(peer):
    data = blob(9, 16 * MiB)
    meta = BlockMeta(len(data), checksum(data), b"parent", "bf16[8]")
    bad = BlockMeta(1000, checksum(b"y" * 1000) ^ 1)

    async def go():
        t = open_peer_transport("tcp")
        try:
            address = peer.peer_addresses()["tcp"]
            first = await t.write(address, "m", [(b"w", data, meta), (b"bad", b"y" * 1000, bad)], time.monotonic() + 30)
            again = await t.write(address, "m", [(b"w", data, meta)], time.monotonic() + 30)
            return first, again
        finally:
            await t.close()

    first, again = run(go())
    assert first[0].status is WriteStatus.STORED
    assert first[1].status is WriteStatus.FAILED and isinstance(first[1].error, CorruptBlock)
    assert again[0].status is WriteStatus.PRESENT
    found = peer.store.get(BlockKey("m", b"w"))
    assert found[0] == data and found[1].parent == b"parent" and found[1].layout == "bf16[8]"
    assert peer.store.exists("m", [b"bad"]) == []  # refused whole: nothing of it is visible
    wait_until(lambda: peer.store.stats().open_slots == 0, what="the write's slots to be closed")


def test_misses_refusals_and_deadlines_are_the_daemons_classes(peer):
    put(peer, "m", {b"x": b"v" * 100})
    client = TcpPeerClient()
    address = peer.peer_addresses()["tcp"]
    try:
        with pytest.raises(UnknownNamespace):
            client.read(address, "never-made", [b"x"], None, Deadline.after(10))
        with pytest.raises(DeadlineExceeded):
            client.read(address, "m", [b"x"], None, Deadline.after(-1))
        with pytest.raises(InvalidArgument, match="split the batch"):
            client.read(address, "m", [b"k%d" % i for i in range(peer.store.limits.max_batch_blocks + 1)], None,
                        Deadline.after(10))
        [got] = client.read(address, "m", [b""], None, Deadline.after(10))  # one bad key fails that key only
        assert got.result.status is ReadStatus.FAILED and isinstance(got.result.error, InvalidArgument)
        [got] = client.read(address, "m", [b"x"], None, Deadline.after(10))  # still usable
        assert got.result.status is ReadStatus.SKIPPED and got.tier is TierName.HOST
    finally:
        client.close()


def test_an_unreachable_peer_is_tier_unavailable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        client = TcpPeerClient()
        with pytest.raises(TierUnavailable, match="cannot reach peer"):
            client.read(f"tcp://127.0.0.1:{port}", "m", [b"x"], None, Deadline.after(5))
    with pytest.raises(InvalidArgument, match="scheme://host:port"):
        client.read("127.0.0.1", "m", [b"x"], None, Deadline.after(5))


# ---- authentication and authorization --------------------------------------------------


@pytest.fixture
def authed_peer(make_daemon, tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text(policy_text())
    d = make_daemon(auth_file=str(policy), **BIG)
    put(d, "a", {b"x": b"a" * 10}, token=TOKEN_ADMIN)
    put(d, "b", {b"x": b"b" * 10}, token=TOKEN_ADMIN)
    return d


def test_a_hello_without_a_known_token_is_unauthenticated(authed_peer):
    address = authed_peer.peer_addresses()["tcp"]
    for token in ("", "tok-not-one-of-ours-0123456789"):
        client = TcpPeerClient(token=token)
        with pytest.raises(Unauthenticated):
            client.read(address, "a", [b"x"], None, Deadline.after(10))
        client.close()


def test_a_forbidden_namespace_reads_the_same_whether_or_not_it_exists(authed_peer):
    address = authed_peer.peer_addresses()["tcp"]
    client = TcpPeerClient(token=TOKEN_A)
    try:
        [got] = client.read(address, "a", [b"x"], lambda i, m: bytearray(m.size), Deadline.after(10))
        assert got.result.is_hit
        answers = []
        for namespace in ("b", "never-made"):  # b exists, never-made does not; team-a may read neither
            with pytest.raises(PermissionDenied) as info:
                client.read(address, namespace, [b"x"], None, Deadline.after(10))
            answers.append(str(info.value).replace(repr(namespace), "NS"))
        assert answers[0] == answers[1]
        with pytest.raises(PermissionDenied):
            client.write(address, "b", [(b"y", b"z", BlockMeta(1, checksum(b"z")))], Deadline.after(10))
    finally:
        client.close()


# ---- limits ---------------------------------------------------------------------------


def test_one_connection_too_many_is_overloaded_with_a_retry_delay(make_daemon):
    d = make_daemon(peer_listen="127.0.0.1:0", peer_max_connections=1)
    put(d, "m", {b"x": b"v"})  # that client closed again
    wait_until(lambda: d.peer_server.connections == 0, what="the writer's connection to end")
    address = d.peer_addresses()["tcp"]
    first, second = TcpPeerClient(), TcpPeerClient()
    try:
        first.read(address, "m", [b"x"], None, Deadline.after(10))  # keeps its connection pooled
        wait_until(lambda: d.peer_server.connections == 1, what="the first connection to be served")
        with pytest.raises(Overloaded, match="--peer-max-connections") as info:
            second.read(address, "m", [b"x"], None, Deadline.after(10))
        assert info.value.retry_after_s > 0
        first.close()
        wait_until(lambda: d.peer_server.connections == 0, what="the first connection to end")
        [got] = second.read(address, "m", [b"x"], None, Deadline.after(10))
        assert got.result.status is ReadStatus.SKIPPED
    finally:
        first.close()
        second.close()


def test_an_oversize_frame_is_refused_with_an_error_frame_and_the_connection_closed(peer):
    sock = raw_hello(peer.peer_server.port)
    sock.sendall(struct.pack("<II", wire.MAX_META_BYTES + 1, 0))
    link = wire.Wire(sock)
    (rid, status, result), _ = link.read_meta()
    assert (rid, status, result[0]) == (0, wire.ERROR, "InvalidArgument") and "over the limit" in result[1]
    with pytest.raises(EOFError):
        link.read_meta()
    sock.close()


def test_a_write_over_the_request_limit_is_refused_before_any_byte_moves(make_daemon):
    d = make_daemon(peer_listen="127.0.0.1:0", peer_connection_in_flight_bytes="8MiB", max_block_bytes="8MiB")
    client = TcpPeerClient()
    data = b"z" * (3 * MiB)
    blocks = [(b"w%d" % i, data, BlockMeta(len(data), checksum(data))) for i in range(3)]
    try:
        with pytest.raises(InvalidArgument, match="split the batch"):
            client.write(d.peer_addresses()["tcp"], "m", blocks, Deadline.after(10))
        assert d.store.stats().open_slots == 0 and d.peer_server.in_flight_bytes == 0
    finally:
        client.close()


def test_bytes_in_flight_over_every_connection_are_bounded(make_daemon):
    """One reader holds the whole budget (it stops reading mid-block); the next is told to come back later."""
    d = make_daemon(**{**BIG, "peer_in_flight_bytes": "16MiB", "peer_connection_in_flight_bytes": "16MiB"})
    put(d, "m", {b"big": blob(1, 16 * MiB)})
    put(d, "m", {b"small": b"s" * 100})
    # A put is answered before its connection gives its bytes back to the budget.
    wait_until(lambda: d.peer_server.in_flight_bytes == 0, what="the puts' bytes to leave the budget")
    address = d.peer_addresses()["tcp"]
    placed, go_on = threading.Event(), threading.Event()
    slow, other = TcpPeerClient(), TcpPeerClient()

    def stall(i, meta):
        placed.set()
        go_on.wait(30)
        return bytearray(meta.size)

    reader = threading.Thread(target=lambda: slow.read(address, "m", [b"big"], stall, Deadline.after(60)))
    reader.start()
    try:
        assert placed.wait(30)
        with pytest.raises(Overloaded, match="--peer-in-flight-bytes") as info:
            other.read(address, "m", [b"small"], lambda i, m: bytearray(m.size), Deadline.after(10))
        assert info.value.retry_after_s > 0
    finally:
        go_on.set()
        reader.join(30)
    [got] = other.read(address, "m", [b"small"], lambda i, m: bytearray(m.size), Deadline.after(10))
    assert got.result.is_hit
    slow.close()
    other.close()


def test_a_write_gives_back_its_byte_budget_before_it_answers(make_daemon):
    """Writes that each take the whole in-flight budget, one after another over two connections:
    each is answered only once its bytes are given back, so the next one, on the other connection,
    is never refused (it was, now and then, when the answer went first)."""
    d = make_daemon(**{**BIG, "max_block_bytes": "1MiB", "peer_in_flight_bytes": "1MiB",
                       "peer_connection_in_flight_bytes": "1MiB"})
    address = d.peer_addresses()["tcp"]
    clients = [TcpPeerClient(), TcpPeerClient()]
    try:
        for i in range(60):
            data = blob(i, MiB)
            [(result, _)] = clients[i % 2].write(address, "m", [(b"w%d" % i, data, BlockMeta(MiB, checksum(data)))],
                                                 Deadline.after(30))
            assert result.status is WriteStatus.STORED, result
            assert d.peer_server.in_flight_bytes == 0
    finally:
        for c in clients:
            c.close()


def test_an_idle_connection_is_closed_and_the_pool_does_not_reuse_it(make_daemon):
    d = make_daemon(peer_listen="127.0.0.1:0", peer_idle_seconds=0.2)
    put(d, "m", {b"x": b"v"})
    wait_until(lambda: d.peer_server.connections == 0, what="the writer's connection to end")
    sock = raw_hello(d.peer_server.port)
    sock.settimeout(30)
    assert sock.recv(1) == b""  # the daemon closed it
    sock.close()
    client = TcpPeerClient()
    address = d.peer_addresses()["tcp"]
    client.read(address, "m", [b"x"], None, Deadline.after(10))
    wait_until(lambda: d.peer_server.connections == 0, what="the pooled connection to idle out")
    [got] = client.read(address, "m", [b"x"], None, Deadline.after(10))  # a fresh connection, not the dead one
    assert got.result.status is ReadStatus.SKIPPED
    client.close()


# ---- faults ---------------------------------------------------------------------------


def stalled_peer() -> tuple[socket.socket, list]:
    """A listener that answers Hello and then nothing."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    held = []

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)
            link = wire.Wire(conn)
            (op, rid, _), _ = link.read_meta()
            wire.send(conn, wire.encode([rid, wire.OK, [wire.MAX_META_BYTES, 16 * MiB, 4096, 64 * MiB]]))

    threading.Thread(target=serve, daemon=True).start()
    return listener, held


def test_a_stalled_peer_is_deadline_exceeded_and_a_cancelled_read_stops_at_once():
    listener, held = stalled_peer()
    address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    client = TcpPeerClient()
    try:
        with pytest.raises(DeadlineExceeded):
            client.read(address, "m", [b"x"], lambda i, m: bytearray(m.size), Deadline.after(0.3))

        async def cancelled():
            t = open_peer_transport("tcp")
            task = asyncio.ensure_future(t.read(address, "m", [b"x"], lambda i, m: None, time.monotonic() + 60))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert t.client.open_connections == 0  # the cancelled call's connection is not pooled
            await t.close()

        run(cancelled())
    finally:
        client.close()
        listener.close()
        for conn in held:
            conn.close()


class CorruptingProxy:
    """A TCP proxy that flips one byte of what the daemon sends, ``at`` bytes into the stream."""

    def __init__(self, port: int, at: int) -> None:
        self._target = port
        self._at = at
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        self.port = self.listener.getsockname()[1]
        self.flipped = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self._target))
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src, dst, corrupt):
        seen = 0
        try:
            while True:
                data = bytearray(src.recv(1 << 16))
                if not data:
                    break
                if corrupt and seen <= self._at < seen + len(data):
                    data[self._at - seen] ^= 0x40
                    self.flipped += 1
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.listener.close()


def test_a_byte_flipped_in_transit_is_reported_corrupt_and_never_delivered(peer):
    values = {b"c0": blob(1, 2 * MiB), b"c1": blob(2, 2 * MiB)}
    put(peer, "m", values)
    proxy = CorruptingProxy(peer.peer_server.port, at=3 * MiB)  # past Hello, inside the second block
    client = TcpPeerClient()
    buffers = {}
    try:
        got = client.read(f"tcp://127.0.0.1:{proxy.port}", "m", [b"c0", b"c1"],
                          lambda i, m: buffers.setdefault(i, bytearray(m.size)), Deadline.after(30))
        assert proxy.flipped == 1
        assert got[0].result.is_hit and bytes(buffers[0]) == values[b"c0"]
        assert got[1].result.status is ReadStatus.FAILED and isinstance(got[1].result.error, CorruptBlock)
        # The holder's copy is sound: read directly it arrives whole.
        [direct] = client.read(peer.peer_addresses()["tcp"], "m", [b"c1"], lambda i, m: bytearray(m.size),
                               Deadline.after(30))
        assert direct.result.is_hit
    finally:
        client.close()
        proxy.close()


@pytest.mark.system
def test_a_peer_killed_mid_transfer_fails_the_rest_and_never_reports_partial_bytes(tmp_path):
    d = DaemonProcess(tmp_path, "--ram-bytes", "160MiB", "--disk-bytes", "0", "--max-block-bytes", "16MiB",
                      "--peer-listen", "127.0.0.1:0", "--peer-advertise", "").start()
    try:
        port = _peer_port(d)
        values = {b"s%d" % i: blob(i, 16 * MiB) for i in range(6)}
        with open_transport("peer-tcp", target=f"127.0.0.1:{port}") as t:
            t.put("m", [BlockPut(k, v) for k, v in values.items()], Deadline.after(60))
        buffers = {}

        def place(i, meta):
            if i == 1:  # the first block is in; the holder dies before the second one arrives
                d.kill(signal.SIGKILL)
            return buffers.setdefault(i, bytearray(meta.size))

        client = TcpPeerClient()
        got = client.read(f"tcp://127.0.0.1:{port}", "m", list(values), place, Deadline.after(60))
        client.close()
        assert got[0].result.is_hit and bytes(buffers[0]) == values[b"s0"]
        for g in got[1:]:
            assert g.result.status is ReadStatus.FAILED and isinstance(g.result.error, TierUnavailable)
        assert "broke" in str(got[1].result.error)
    finally:
        if d.proc.poll() is None:
            d.kill()


def _peer_port(d: DaemonProcess) -> int:
    """The peer port a child daemon bound (it logs its peer addresses at start)."""
    import re

    found = re.findall(r"peer data plane on \S+ \(port (\d+)\)", d.log.read_text())
    assert found, d.log.read_text()
    return int(found[-1])
