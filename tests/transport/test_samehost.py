"""The same-host socket under abuse: bad frames, too many clients, dead clients, stalls, errors by class."""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading

import pytest

from kvstore import BlockPut, Client, TierName
from kvstore.block import checksum
from kvstore.errors import (
    Cancelled, DaemonUnavailable, DeadlineExceeded, InvalidArgument, InvalidKey, Overloaded, TierFull,
    UnknownNamespace,
)
from kvstore.shm.arena import ShmArena
from kvstore.transport.base import Deadline
from kvstore.transport.samehost import frames
from kvstore.transport.samehost.client import SameHostTransport
from kvstore.wire.unix import bind_unix, connect_unix
from tests.support.wait import wait_until

MiB = 1 << 20


def path_of(daemon) -> str:
    return daemon._same_host.path


def token_of(daemon) -> bytes:
    return daemon.store.head.arena.token


class Raw:
    """A hand-driven connection: frames as a misbehaving client would send them."""

    def __init__(self, daemon, hello: bool = True) -> None:
        self.sock = connect_unix(path_of(daemon), 10)
        self.reader = frames.FrameReader(self.sock)
        if hello:
            assert self.call(frames.HELLO, [frames.PROTOCOL_VERSION, token_of(daemon)], rid=1)[1] == frames.OK

    def send(self, op, args, rid=7, payload=b""):
        frames.send(self.sock, frames.encode([op, rid, args], len(payload)), [payload] if payload else ())

    def call(self, op, args, rid=7, payload=b""):
        self.send(op, args, rid, payload)
        return self.read()

    def read(self):
        rid, status, result = self.reader.read()[0]
        return rid, status, result

    def closed_by_peer(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionError:
            return True

    def close(self):
        self.sock.close()


def served(daemon) -> bool:
    """The daemon still answers same-host clients."""
    with Client(daemon.target, transport="same-host") as c:
        c.put("m", b"alive", b"yes")
        return c.get("m", b"alive") == b"yes"


def test_clients_on_the_host_use_the_socket_and_its_file_is_private(daemon):
    with Client(daemon.target) as c:
        assert c.transport_name == "same-host" and c.shared_memory
    mode = os.stat(path_of(daemon)).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


def test_without_the_socket_clients_keep_the_arena_over_grpc(make_daemon):
    daemon = make_daemon(same_host_socket="off")
    with Client(daemon.target) as c:
        assert c.transport_name == "grpc-arena"
        c.put("m", b"k", b"v" * 1000)
        assert c.get("m", b"k") == b"v" * 1000
    with pytest.raises(Exception, match="no same-host socket"):
        Client(daemon.target, transport="same-host").get("m", b"k")


def test_an_oversized_frame_gets_an_error_and_the_connection_closes(daemon):
    raw = Raw(daemon)
    raw.sock.sendall(struct.pack("<II", frames.MAX_META_BYTES + 1, 0))
    rid, status, (name, message, _) = raw.read()
    assert (status, name) == (frames.ERROR, "InvalidArgument") and "over this connection's limits" in message
    assert raw.closed_by_peer()
    assert served(daemon)


def test_garbage_and_malformed_requests_get_clear_errors(daemon):
    raw = Raw(daemon)
    raw.sock.sendall(struct.pack("<II", 3, 0) + b"\xc1\xc1\xc1")  # 0xc1 is never valid msgpack
    rid, status, (name, message, _) = raw.read()
    assert status == frames.ERROR and "not valid msgpack" in message
    raw.close()
    raw = Raw(daemon)
    for args, needle in [
        ("nonsense", "expected 5 fields"),
        (["m", "not-a-list", 0, 0, []], "keys is not a list"),
        (["m", [b"k"], -1, 0, []], "lease_ms is not a non-negative integer"),
    ]:
        rid, status, (name, message, _) = raw.call(frames.LOOKUP, args)
        assert (rid, status, name) == (7, frames.ERROR, "InvalidArgument") and needle in message
    rid, status, (name, message, _) = raw.call(99, [])
    assert name == "InvalidArgument" and "unknown same-host operation" in message
    rid, status, (name, _, _) = raw.call(frames.PUT, ["m", 0, [[b"k", 10, 0, None, ""]]], payload=b"abc")
    assert name == "InvalidArgument"
    rid, status, (name, _, _) = raw.call(frames.PUT, ["m", 0, [[b"k", 3, checksum(b"abd"), None, ""]]], payload=b"abc")
    assert name == "CorruptBlock"
    assert raw.call(frames.RELEASE, [[1, 2]])[1:] == (frames.OK, [False, False])  # the same connection goes on
    assert served(daemon)


def test_the_first_frame_must_be_hello_with_this_daemons_token(daemon):
    raw = Raw(daemon, hello=False)
    rid, status, (name, message, _) = raw.call(frames.LOOKUP, ["m", [b"k"], 0, 0, []])
    assert name == "InvalidArgument" and "must be Hello" in message
    assert raw.closed_by_peer()
    raw = Raw(daemon, hello=False)
    rid, status, (name, message, _) = raw.call(frames.HELLO, [frames.PROTOCOL_VERSION, b"\0" * 16])
    assert "token does not match" in message and raw.closed_by_peer()
    arena = ShmArena.attach(daemon.store.head.arena.path, token_of(daemon))
    try:
        with pytest.raises(InvalidArgument, match="token does not match"):
            SameHostTransport(arena, path_of(daemon), b"\1" * 16)
    finally:
        arena.close()


def test_connections_over_the_limit_are_told_overloaded_with_a_retry_delay(make_daemon):
    daemon = make_daemon(same_host_max_connections=2, same_host_max_connections_per_uid=2)
    held = [Raw(daemon), Raw(daemon)]
    wait_until(lambda: daemon._same_host.connections == 2, what="two connections to be served")
    third = Raw(daemon, hello=False)
    rid, status, (name, message, retry) = third.read()
    assert name == "Overloaded" and retry > 0 and "at most 2 connections" in message
    assert third.closed_by_peer()
    with pytest.raises(Overloaded) as info:
        frames.raise_error([name, message, retry])
    assert info.value.retry_after_s == retry
    held[0].close()
    wait_until(lambda: daemon._same_host.connections == 1, what="a closed connection to be freed")
    assert served(daemon)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def test_one_uid_holds_at_most_its_share_of_the_connections_and_another_uid_still_gets_in(make_daemon, tmp_path):
    import pwd
    import tempfile

    from tests.support.identities import as_uid

    shared = tempfile.mkdtemp(prefix="strata-uids-")  # a directory the other uid can reach
    os.chmod(shared, 0o755)
    daemon = make_daemon(same_host_max_connections=4, unix_socket_mode="0666",
                         same_host_socket=f"{shared}/samehost.sock")  # a share of 2 per uid (half)
    held = [Raw(daemon), Raw(daemon)]
    wait_until(lambda: daemon._same_host.connections == 2, what="two connections to be served")
    third = Raw(daemon, hello=False)
    rid, status, (name, message, retry) = third.read()
    assert (rid, name) == (0, "Overloaded") and retry > 0, message
    assert "share of this daemon's limit is 2" in message and "--same-host-max-connections-per-uid" in message
    assert third.closed_by_peer()

    def hello() -> str:
        other = Raw(daemon)  # its Hello is taken (asserted inside), or the child reports why not
        other.close()
        return "ok"

    assert as_uid(pwd.getpwnam("nobody").pw_uid, hello) == "ok"
    held[0].close()
    wait_until(lambda: daemon._same_host.connections == 1, what="a closed connection to be freed")
    Raw(daemon).close()  # the uid's share has room again


def test_a_hello_that_trickles_in_is_cut_off_at_its_deadline(make_daemon, monkeypatch):
    """Each byte restarting a socket timeout would hold the connection for ever: the Hello's deadline
    runs from the accept, whatever comes meanwhile."""
    import kvstore.transport.samehost.server as samehost

    monkeypatch.setattr(samehost, "HELLO_TIMEOUT_S", 1.0)
    daemon = make_daemon()
    hello = frames.encode([frames.HELLO, 1, [frames.PROTOCOL_VERSION, token_of(daemon)]])
    sock = connect_unix(path_of(daemon), 10)
    try:
        sent = 0
        for byte in hello[:-1]:  # never the whole Hello; a byte every 0.3 s, under the 1 s timeout
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += 1
            sock.settimeout(0.3)
            try:
                sock.recv(1 << 16)  # an error frame or the end of the stream: cut off
                break
            except TimeoutError:
                continue
        assert sent < len(hello) - 1, "the daemon kept a Hello that never came whole"
    finally:
        sock.close()
    assert served(daemon)


def test_a_hello_larger_than_a_hello_is_refused_from_its_header(daemon):
    raw = Raw(daemon, hello=False)
    raw.sock.sendall(frames.HEADER.pack(frames.MAX_HELLO_BYTES + 1, 0))
    rid, status, (name, message, _) = raw.read()
    assert (rid, status, name) == (0, frames.ERROR, "InvalidArgument") and "limits" in message
    assert raw.closed_by_peer()


def test_a_dead_clients_leases_and_slots_expire(make_daemon):
    daemon = make_daemon(lease_seconds=0.3)
    with Client(daemon.target) as c:
        c.put("m", b"k", b"v" * 5000)
    raw = Raw(daemon)
    rid, status, (deadline_ms, [entry]) = raw.call(frames.LOOKUP, ["m", [b"k"], 0, 0, []])
    assert status == frames.OK and entry[5]  # leased
    rid, status, (_, grants) = raw.call(frames.ALLOCATE, ["m", 0, 0, [[b"new", 4096, None, ""]]])
    assert status == frames.OK and not grants[0][0]
    assert daemon.store.stats().active_leases >= 2
    raw.sock.close()  # dies without a word
    wait_until(lambda: daemon.store.stats().active_leases == 0, what="the dead client's leases to expire")
    assert daemon.store.stats().open_slots == 0 and daemon.store.stats().pinned_blocks == 0


def test_an_idle_connection_is_closed_and_the_client_reconnects(make_daemon):
    daemon = make_daemon(same_host_idle_seconds=0.2)
    with Client(daemon.target) as c:
        c.put("m", b"k", b"v" * 100)
        wait_until(lambda: daemon._same_host.connections == 0, what="the idle connection to be closed")
        assert c.get("m", b"k") == b"v" * 100
        assert c.put("m", b"k2", b"w" * 100)


def test_errors_cross_the_socket_as_the_daemons_classes(make_daemon):
    daemon = make_daemon(ram_bytes="16MiB", disk_bytes=0, max_block_bytes="4MiB")
    with Client(daemon.target, transport="same-host", retries=0, timeout=1.0) as c:
        with pytest.raises(UnknownNamespace):
            c.get("never-used", b"k")
        with pytest.raises(InvalidKey):
            c.put("m", b"k" * 2000, b"v")
        for i in range(4):
            c.put("m", b"k%d" % i, bytes(4 * MiB))
        c.pin("m", [b"k%d" % i for i in range(4)])
        with pytest.raises(TierFull) as info:
            c.put("m", b"more", bytes(4 * MiB))  # in place: Allocate is refused
        assert info.value.retry_after_s > 0
        with pytest.raises(TierFull):
            c.put("m", b"small", bytes(1000))  # inline: the daemon's put is refused
        assert c.exists("m", [b"k0"]) == [TierName.HOST]


class Stalled:
    """A same-host server that answers Hello and then nothing: a daemon stuck under load."""

    def __init__(self, path: str, token: bytes) -> None:
        self.listener = bind_unix(path)
        self.listener.listen(4)
        self.token = token
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            meta, _ = frames.FrameReader(conn).read()
            frames.send(conn, frames.encode([meta[1], frames.OK, [1 << 20, 1 << 20, 64, ""]]))

    def close(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept, so the socket really closes
        except OSError:
            pass
        self.listener.close()
        for c in self.conns:
            c.close()


def test_a_stalled_daemon_hits_the_deadline_or_the_cancellation(tmp_path):
    arena = ShmArena.create(1 << 20, str(tmp_path), "arena")
    server = Stalled(str(tmp_path / "s.sock"), arena.token)
    transport = SameHostTransport(arena, str(tmp_path / "s.sock"), arena.token)
    try:
        with pytest.raises(DeadlineExceeded):
            transport.get_into("m", [b"k"], None, Deadline.after(0.2))
        call = Deadline.after(30)
        threading.Timer(0.2, call.cancel).start()
        with pytest.raises(Cancelled):
            transport.put("m", [BlockPut(b"k", b"v")], call)
        server.close()
        with pytest.raises(DaemonUnavailable):  # a fresh connection finds nobody
            transport.get_into("m", [b"k"], None, Deadline.after(1))
    finally:
        transport.close()
        server.close()
        arena.close(unlink=True)


def test_a_long_socket_path_works(make_daemon, tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    daemon = make_daemon(same_host_socket=str(deep / "strata.sock"))
    assert len(str(deep / "strata.sock")) > 108
    with Client(daemon.target) as c:
        assert c.transport_name == "same-host"
        c.put_many("m", [BlockPut(b"a", b"1" * 10), BlockPut(b"b", b"2" * (2 * MiB))])
        assert [bytes(b.data) for b in c.get_many("m", [b"a", b"b"])] == [b"1" * 10, b"2" * (2 * MiB)]


def test_the_async_client_takes_the_socket_and_cancelled_reads_give_their_leases_back(make_daemon):
    import asyncio

    from kvstore import AsyncClient

    daemon = make_daemon(lease_seconds=300)  # only a release, not expiry, ends a lease in time

    async def body():
        async with AsyncClient(daemon.target) as c:
            assert await c.transport_name() == "same-host"
            items = [BlockPut(b"a%d" % i, os.urandom(size)) for i, size in enumerate([100, 300_000, 2 * MiB])]
            assert await c.put_many("m", items) == [True, True, True]
            got = await asyncio.gather(*(c.get_many("m", [b"a0", b"a1", b"a2", b"no"]) for _ in range(20)))
            for blocks in got:
                assert [bytes(b.data) for b in blocks[:3]] == [bytes(i.value) for i in items] and blocks[3] is None
            for _ in range(20):  # cancelled at every point of the read
                task = asyncio.ensure_future(c.get_many("m", [b"a0", b"a1", b"a2"]))
                await asyncio.sleep(0)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            assert (await c.get("m", b"a1")) == items[1].value

    asyncio.run(body())
    wait_until(lambda: daemon.store.stats().active_leases == 0, what="every read lease to be released")


def ops(daemon, op: str) -> float:
    for metric in daemon.metrics.op_latency.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count") and sample.labels.get("op") == op:
                return sample.value
    return 0.0


def test_repeat_reads_skip_the_round_trip_until_a_delete(daemon):
    value = os.urandom(70_000)
    with Client(daemon.target) as reader, Client(daemon.target) as other:
        reader.put("m", b"k", value)
        before = ops(daemon, "Lookup")
        for _ in range(5):
            assert reader.get("m", b"k") == value
        assert ops(daemon, "Lookup") == before + 1  # only the first read asked the daemon
        wait_until(lambda: ops(daemon, "Touch") >= 1, what="the reads to be reported for recency")
        assert other.delete("m", [b"k"]) == 1  # another client's delete ...
        assert reader.get("m", b"k") is None  # ... is seen at once, the bytes still intact in RAM


def test_a_delete_leaves_the_other_remembered_blocks_read_without_a_round_trip(daemon):
    from kvstore.transport.samehost.locations import bucket

    values = {b"k%d" % i: os.urandom(70_000) for i in range(8)}
    gone = b"k0"
    kept = [k for k in values if bucket("m", k) != bucket("m", gone)]
    with Client(daemon.target) as reader, Client(daemon.target) as other:
        reader.put_many("m", [BlockPut(k, v) for k, v in values.items()])
        assert [b.data for b in reader.get_many("m", list(values))] == list(values.values())
        assert other.delete("m", [gone]) == 1
        before = ops(daemon, "Lookup")
        assert [reader.get("m", k) for k in kept] == [values[k] for k in kept]
        assert ops(daemon, "Lookup") == before  # every one read from where it was seen
        assert reader.get("m", gone) is None


def test_an_extent_given_to_another_block_is_noticed_and_the_block_read_again(make_daemon):
    daemon = make_daemon(ram_bytes="16MiB", disk_bytes="64MiB", max_block_bytes="4MiB")
    first = os.urandom(3 * MiB)
    with Client(daemon.target) as c:
        c.put("m", b"first", first)
        assert c.get("m", b"first") == first  # its extent is now known to this client
        for i in range(8):  # RAM fills: "first" goes down to disk and its extent is reused
            c.put("m", b"fill%d" % i, os.urandom(3 * MiB))
        wait_until(lambda: c.exists("m", [b"first"]) == [TierName.DISK], what="the first block to be demoted")
        before = ops(daemon, "Lookup")
        assert c.get("m", b"first") == first
        assert ops(daemon, "Lookup") == before + 1


def test_an_unusable_socket_path_stops_the_daemon_saying_what_to_change(make_daemon, tmp_path):
    from kvstore.server.endpoints import DaemonError

    with pytest.raises(DaemonError, match="set --same-host-socket"):
        make_daemon(same_host_socket=str(tmp_path / "no-such-dir" / "s.sock"))
    assert not list(tmp_path.glob("samehost-*"))  # nothing left behind


def test_a_restarted_daemon_voids_what_a_client_remembers(make_daemon, tmp_path):
    """Even after SIGKILL a client must not serve a dead daemon's arena: the new daemon marks the page it
    replaces as dead before it makes its own, another file under the same name."""
    from kvstore.transport.samehost.locations import Locations, RemovalPage

    page = RemovalPage(str(tmp_path / "page"), b"t" * 16)
    seen = Locations(str(tmp_path / "page"), b"t" * 16)
    seen.check()
    seen.learn(seen.stamp("m", b"k"), "m", b"k", (0, 10, 1, None, ""))
    assert seen.get("m", b"k") is not None
    RemovalPage(str(tmp_path / "page"), b"u" * 16)  # a restart: same name, new file, count from 0
    seen.check()
    assert seen.get("m", b"k") is None
    seen.learn(seen.stamp("m", b"k"), "m", b"k", (0, 10, 1, None, ""))
    assert seen.get("m", b"k") is None  # and nothing is learned about the old arena any more
    seen.close()
    page.close()


def test_a_delete_voids_only_the_locations_of_its_keys_buckets(tmp_path):
    from kvstore.transport.samehost.locations import Locations, RemovalPage, bucket

    page = RemovalPage(str(tmp_path / "page"), b"t" * 16)
    seen = Locations(str(tmp_path / "page"), b"t" * 16)
    keys = [b"k%d" % i for i in range(64)]
    for key in keys:
        seen.learn(seen.stamp("m", key), "m", key, (0, 10, 1, None, ""))
    gone = keys[0]
    shares = {k for k in keys if bucket("m", k) == bucket("m", gone)}
    page.bump("m", [gone])
    seen.check()
    assert [k for k in keys if seen.get("m", k) is None] == sorted(shares, key=keys.index)
    assert len(shares) < len(keys) // 2  # most of what the client remembers outlives the Delete
    assert seen.get("other", keys[1]) is None  # never learned in that namespace
    page.bump()  # the whole arena (the daemon stopping): everything goes
    seen.check()
    assert all(seen.get("m", k) is None for k in keys)
    seen.learn(seen.stamp("m", gone), "m", gone, (0, 10, 1, None, ""))
    stamp = seen.stamp("m", gone)
    page.bump("m", [gone])  # a Delete answered between a Lookup and what it taught
    seen.learn(stamp, "m", gone, (0, 10, 1, None, ""))
    assert seen.get("m", gone) is None
    seen.close()
    page.close()


def test_an_older_daemons_page_without_buckets_voids_everything_on_each_delete(tmp_path):
    """A daemon of the first page layout (4096 bytes: the token and one count) bumps that count on every
    Delete: a client stamps every key with it."""
    import mmap

    from kvstore.transport.samehost.locations import Locations

    path = tmp_path / "page"
    path.write_bytes(b"t" * 16 + struct.pack("<Q", 7) + bytes(4096 - 24))
    seen = Locations(str(path), b"t" * 16)
    seen.check()
    for key in (b"a", b"b"):
        seen.learn(seen.stamp("m", key), "m", key, (0, 10, 1, None, ""))
    assert seen.get("m", b"a") is not None
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 4096) as old_daemon:
        struct.pack_into("<Q", old_daemon, 16, 8)  # its Delete of "a"
    seen.check()
    assert seen.get("m", b"a") is None and seen.get("m", b"b") is None
    seen.learn(seen.stamp("m", b"b"), "m", b"b", (0, 10, 1, None, ""))
    path.unlink()  # it restarts: a new page under the same name, the old one unmarked
    path.write_bytes(b"u" * 16 + bytes(4096 - 16))
    seen.check()  # one stat tells
    assert seen.get("m", b"b") is None
    seen.close()


def test_async_repeat_reads_skip_the_round_trip_until_a_delete(daemon):
    import asyncio

    from kvstore import AsyncClient

    value = os.urandom(3 * MiB)

    async def body():
        async with AsyncClient(daemon.target) as reader:
            await reader.put("m", b"k", value)
            before = ops(daemon, "Lookup")
            for _ in range(4):
                assert await reader.get("m", b"k") == value
            assert ops(daemon, "Lookup") == before + 1
            with Client(daemon.target) as other:
                assert other.delete("m", [b"k"]) == 1
            assert await reader.get("m", b"k") is None

    asyncio.run(body())


def test_a_client_attached_before_a_daemon_restart_attaches_again(daemon_process):
    """The restarted daemon refuses the arena token the client attached with; the client
    attaches the new arena (StaleAttachment) and the call goes through, not InvalidArgument."""
    import signal

    d = daemon_process()
    with Client(d.target) as c:
        assert c.put("ns", b"a", b"x" * (2 * MiB)) and c.transport_name == "same-host"
        d.kill(signal.SIGTERM)
        d.start()
        assert c.put("ns", b"b", b"y" * (2 * MiB))
        assert c.get("ns", b"b") == b"y" * (2 * MiB)
        assert c.get("ns", b"a") == b"x" * (2 * MiB)  # kept across the clean stop
        assert c.transport_name == "same-host"


def mapped_kib(path: str) -> int:
    """Resident KiB of every mapping of ``path`` in this process (its smaps' Rss lines)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
                inside = fields[-1] == path
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


def test_a_client_maps_every_page_of_an_arena_the_daemon_faulted_in(make_daemon, tmp_path):
    """The Hello says the daemon faults its arena in: the client's mapping of it is populated too, so no copy
    of the client's pays a page fault per 4 KiB. Daemon and client share this process, each with a mapping."""
    from tests.support.small_filesystem import tmpfs

    with tmpfs(tmp_path / "shm", "96m") as shm:
        daemon = make_daemon(shm_dir=str(shm), ram_bytes="32MiB")
        with Client(daemon.target) as c:
            assert c.transport_name == "same-host"
            [arena] = c._mapped
            path = arena.path
            wait_until(lambda: mapped_kib(path) >= 2 * 32 * 1024, what="the daemon's and the client's mappings")
            c.put("m", b"k", b"v" * 300_000)
            assert c.get("m", b"k") == b"v" * 300_000
        daemon.stop(0)
        cold = make_daemon(shm_dir=str(shm), ram_bytes="32MiB", ram_prefault=False)
        with Client(cold.target) as c:
            c.put("m", b"k", b"v" * 300_000)
            [arena] = c._mapped
            path = arena.path
            assert mapped_kib(path) < 32 * 1024  # neither side faulted in what no block touched


def test_exists_is_one_message_on_the_socket_and_answers_as_the_rpc(daemon, monkeypatch):
    """A prefix chain's leading hits over the same-host socket (what LMCache asks before every
    retrieve), the same answer the gRPC Exists gives; a malformed Exists is refused and the
    connection goes on."""
    keys = [b"e%d" % i for i in range(5)]
    asked = []
    real = SameHostTransport.exists

    def counted(self, namespace, keys, deadline):
        asked.append(list(keys))
        return real(self, namespace, keys, deadline)

    monkeypatch.setattr(SameHostTransport, "exists", counted)
    with Client(daemon.target, transport="same-host") as c, Client(daemon.target, transport="grpc") as g:
        for k in keys[:3] + keys[4:]:  # a gap at keys[3]: the chain's leading run is three
            c.put("m", k, b"v" * 1000)
        before = ops(daemon, "Exists")
        assert c.exists("m", keys) == [TierName.HOST] * 3 == g.exists("m", keys)
        assert asked == [keys]  # the same-host client asked on the socket, once
        assert ops(daemon, "Exists") == before + 2  # one over the socket, one RPC
        assert c.exists("m", [b"absent"]) == [] and c.exists("m", []) == []
    raw = Raw(daemon)
    try:
        assert raw.call(frames.EXISTS, ["m", keys])[1:] == (frames.OK, [int(TierName.HOST)] * 3)
        rid, status, result = raw.call(frames.EXISTS, ["m", "not a list"])
        assert status == frames.ERROR and "keys is not a list" in str(result)
        rid, status, result = raw.call(frames.EXISTS, ["m"])
        assert status == frames.ERROR
        assert raw.call(frames.EXISTS, ["m", keys[:1]])[1:] == (frames.OK, [int(TierName.HOST)])
    finally:
        raw.close()
    assert served(daemon)
