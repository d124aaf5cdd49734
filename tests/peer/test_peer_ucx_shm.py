"""UCX shared memory between daemons of one host: --peer-ucx-shm, the ucx-shm:// transport, its lifeline.

Real daemons (in-process and ``strata serve`` child processes), real ucxx
workers, a real Redis index for the peer tier, network namespaces for "another
host". Proven here: the bytes move over UCX's shared-memory transports
(the worker has no other; UCX's own protocol report names them); a holder
or a reader SIGKILLed mid-transfer ends the other side's wait through the
lifeline, not through its deadline or idle limit; a holder on another host
is never tried over shared memory. The contract every transport shares runs
in test_transport_contract.py (peer-ucx-shm there). Skipped, with the
reason, where ucxx cannot be imported (the ``ucx`` extra).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from kvstore.block import BlockMeta, checksum
from kvstore.client.sync import Client
from kvstore.errors import TierUnavailable
from kvstore.peer import open_peer_transport
from kvstore.peer.ucx_link import ucx_available
from kvstore.remote.base import ReadStatus
from kvstore.transport import BlockPut, Deadline, open_transport
from tests.support import redis_servers
from tests.support.daemons import DaemonProcess
from tests.support.peer_cluster import NS, REPO, PeerNode, held_by, keys_of, value
from tests.support.wait import wait_until

UCX, NO_UCX = ucx_available()
pytestmark = [pytest.mark.system, pytest.mark.skipif(not UCX, reason=NO_UCX)]

MiB = 1 << 20
SHM = ("--ram-bytes", "160MiB", "--disk-bytes", "0", "--max-block-bytes", "16MiB", "--peer-ucx-shm")


def blob(seed: int, size: int) -> bytes:
    return (seed.to_bytes(8, "big") + os.urandom(8)) * (size // 16) + b"x" * (size % 16)


def holds_nothing(daemon) -> bool:
    s = daemon.store.stats()
    return s.active_leases == 0 and s.open_slots == 0 and s.pinned_blocks == 0


def shm_address(d: DaemonProcess) -> str:
    found = re.findall(r"UCX shared-memory peer data plane on (ucx-shm://\S+)", d.log.read_text())
    assert found, d.log.read_text()
    return found[-1]


def test_a_daemon_advertises_shared_memory_first_with_this_hosts_id(make_daemon):
    from kvstore.peer.ucx_shm import reaches
    from kvstore.peer.ucx_shm_link import host_id

    d = make_daemon(peer_listen="127.0.0.1:0", peer_ucx_shm=True)
    address = d.peer_addresses()["ucx-shm"]
    assert address == f"ucx-shm://{host_id()}:{d.ucx_shm_server.port}"
    assert d.peer_transports() == [address, d.peer_addresses()["tcp"], f"grpc://{d.advertised}"]
    assert reaches(address) and not reaches(f"ucx-shm://0123456789abcdef:{d.ucx_shm_server.port}")
    plain = make_daemon()
    assert "ucx-shm" not in plain.peer_addresses() and plain.ucx_shm_server is None


def test_an_address_of_another_host_is_refused_without_connecting(make_daemon):
    d = make_daemon(peer_ucx_shm=True, auto_create_namespaces=True)
    elsewhere = f"ucx-shm://0123456789abcdef:{d.ucx_shm_server.port}"  # the same port, another host's id

    async def go():
        t = open_peer_transport("ucx-shm")
        try:
            assert t.same_host_only and not t.reaches(elsewhere)
            return await t.read(elsewhere, "m", [b"k"], lambda i, m: bytearray(m.size), time.monotonic() + 10)
        finally:
            await t.close()

    with pytest.raises(TierUnavailable, match="another host"):
        asyncio.run(go())
    assert d.ucx_shm_server.connections == 0


def test_a_full_listener_refuses_the_handshake_with_overloaded_and_a_retry_delay(make_daemon):
    from kvstore.errors import Overloaded
    from kvstore.peer.ucx_shm import UcxShmPeerClient

    d = make_daemon(peer_ucx_shm=True, auto_create_namespaces=True, peer_max_connections=1)
    address = d.peer_addresses()["ucx-shm"]
    first, second = UcxShmPeerClient(), UcxShmPeerClient()
    try:
        first.write(address, "m", [(b"k", b"v", BlockMeta(1, checksum(b"v")))], Deadline.after(30))  # stays open
        wait_until(lambda: d.ucx_shm_server.connections == 1, what="the first connection to be served")
        with pytest.raises(Overloaded, match="--peer-max-connections") as refused:
            second.read(address, "m", [b"k"], lambda i, m: bytearray(m.size), Deadline.after(30))
        assert refused.value.retry_after_s > 0
        first.close()  # its lifeline ends: the holder frees the slot at once
        wait_until(lambda: d.ucx_shm_server.connections == 0, what="the closed connection to end")
        [got] = second.read(address, "m", [b"k"], lambda i, m: bytearray(m.size), Deadline.after(30))
        assert got.result.is_hit
    finally:
        first.close()
        second.close()


def test_the_shared_memory_worker_has_no_transport_but_shared_memory_whatever_UCX_TLS_says():
    """Its transports are set by config, over the environment: UCX_TLS=tcp still gives sm, self."""
    code = ("from kvstore.peer.ucx_shm_link import UcxShmRuntime; "
            "print(','.join(sorted(UcxShmRuntime.get().transports())))")
    env = {**os.environ, "UCX_TLS": "tcp", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    transports = set(out.stdout.strip().splitlines()[-1].split(","))
    assert transports & {"posix", "sysv", "cma"} and transports <= {"posix", "sysv", "cma", "knem", "xpmem", "self"}


def test_blocks_between_two_processes_move_over_shared_memory(tmp_path, monkeypatch):
    """A daemon process and this one: writes and reads land verified, and UCX's report of the
    protocols the holder's endpoint chose names shared-memory transports only (sysv/posix for
    messages, cma for the large ones), never tcp."""
    monkeypatch.setenv("UCX_PROTO_INFO", "y")  # the daemon prints each endpoint's protocol table
    d = DaemonProcess(tmp_path, *SHM, "--auto-create-namespaces").start()
    try:
        address = shm_address(d)
        values = {b"p%d" % i: blob(i, size) for i, size in enumerate([1, 5000, 300_000, 16 * MiB])}
        with open_transport("peer-ucx-shm", target=address) as t:
            assert t.put("m", [BlockPut(k, v) for k, v in values.items()], Deadline.after(60)) == [True] * 4
            got = t.get_into("m", [*values, b"absent"], None, Deadline.after(60))
        assert [bytes(b.data) for b in got[:4]] == list(values.values()) and got[4] is None
        log = d.log.read_text()
        assert "tagged message by ucp_tag_send" in log and "intra-node" in log, log[-3000:]
        used = set(re.findall(r"\b(\w+)/(?:memory|lo|eth\w*|ib\w*|mlx\w*)\b", log))
        assert used & {"sysv", "posix"} and "cma" in used, used  # messages, and the large blocks
        assert used <= {"sysv", "posix", "cma", "self"} and "tcp/" not in log, used
    finally:
        d.kill()


def test_a_holder_killed_mid_transfer_fails_the_rest_at_once_not_at_the_deadline(tmp_path):
    """The keys left fail TierUnavailable (broke), never DeadlineExceeded at the end of the deadline;
    the block that arrived before is a verified hit."""
    from kvstore.peer.ucx_shm import UcxShmPeerClient

    d = DaemonProcess(tmp_path, *SHM).start()
    try:
        address = shm_address(d)
        values = {b"s%d" % i: blob(i, 16 * MiB) for i in range(6)}
        with open_transport("peer-ucx-shm", target=address) as t:
            t.put("m", [BlockPut(k, v) for k, v in values.items()], Deadline.after(60))
        buffers = {}

        def place(i, meta):
            if i == 1:  # the first block is in; the holder dies before the second one arrives
                d.kill(signal.SIGKILL)
            return buffers.setdefault(i, bytearray(meta.size))

        client = UcxShmPeerClient()
        got = client.read(address, "m", list(values), place, Deadline.after(600))
        assert got[0].result.is_hit and bytes(buffers[0]) == values[b"s0"]
        for g in got[1:]:
            assert g.result.status is ReadStatus.FAILED and isinstance(g.result.error, TierUnavailable)
        assert "broke" in str(got[1].result.error)
        with pytest.raises(TierUnavailable, match="cannot reach"):  # and the next call is refused at once
            client.read(address, "m", [b"s0"], place, Deadline.after(600))
        client.close()
    finally:
        if d.proc.poll() is None:
            d.kill()


def test_a_holder_that_dies_while_a_reader_waits_on_it_ends_the_wait_through_the_lifeline(tmp_path):
    """Stopped (SIGSTOP), the holder answers nothing and UCX has nothing in flight that could fail;
    then SIGKILLed. Endpoint error handling is off, so UCX never reports it: only the lifeline
    ends the reader's wait, with TierUnavailable, long before its deadline."""
    from kvstore.peer.ucx_shm import UcxShmPeerClient

    d = DaemonProcess(tmp_path, *SHM, "--auto-create-namespaces").start()
    try:
        address = shm_address(d)
        client = UcxShmPeerClient()
        client.write(address, "m", [(b"w", b"v" * 100, BlockMeta(100, checksum(b"v" * 100)))], Deadline.after(60))
        d.proc.send_signal(signal.SIGSTOP)  # the pooled connection, Hello done, stays open
        # kill(2) returns before the stop lands: read only once every thread of the holder is stopped.
        wait_until(lambda: _stopped(d.proc.pid), what="the holder to be stopped")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            reading = pool.submit(client.read, address, "m", [b"w"], lambda i, m: bytearray(m.size),
                                  Deadline.after(90))
            time.sleep(0.2)  # (either way: the read is waiting on the holder, or about to)
            d.kill(signal.SIGKILL)
            try:
                [got] = reading.result(120)
                error = got.result.error
            except TierUnavailable as err:  # nothing answered: the whole call failed
                error = err
        assert isinstance(error, TierUnavailable), error
        assert "process ended" in str(error) or "cannot reach" in str(error), error
        client.close()
    finally:
        if d.proc.poll() is None:
            d.proc.send_signal(signal.SIGCONT)
            d.kill()


def _stopped(pid: int) -> bool:
    return all(open(f"/proc/{pid}/task/{tid}/stat").read().rpartition(")")[2].split()[0] == "T"
               for tid in os.listdir(f"/proc/{pid}/task"))


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_an_idle_connection_costs_the_holder_no_cpu(tmp_path):
    """The holder keeps a receive posted for an open connection's next request. ucxx's own wait
    spins on it (a core for as long as the connection is open); the progress driver sleeps in
    epoll between backed-off polls. A resource bound with a wide margin, not a timing."""
    from kvstore.peer.ucx_shm import UcxShmPeerClient

    d = DaemonProcess(tmp_path, *SHM, "--auto-create-namespaces").start()
    try:
        client = UcxShmPeerClient()
        client.write(shm_address(d), "m", [(b"i", b"v" * 10, BlockMeta(10, checksum(b"v" * 10)))], Deadline.after(60))
        time.sleep(0.5)  # past the connection's first polls
        before, t0 = _cpu_seconds(d.proc.pid), time.monotonic()
        time.sleep(3)
        used, elapsed = _cpu_seconds(d.proc.pid) - before, time.monotonic() - t0
        assert client.open_connections == 1
        assert used < 0.1 * elapsed, f"the holder used {used:.2f}s of CPU in {elapsed:.1f}s with one idle connection"
        client.close()
    finally:
        d.kill()


READER = """
import sys, time
from kvstore.peer.ucx_shm import UcxShmPeerClient
from kvstore.transport.base import Deadline

def place(i, meta):
    if i == 1:  # block 0 is in; the holder is sending block 1 under its lease when this process dies
        print("stalled", flush=True)
        time.sleep(3600)
    return bytearray(meta.size)

UcxShmPeerClient().read(sys.argv[1], "m", [b"r0", b"r1", b"r2"], place, Deadline.after(3000))
"""


def test_a_reader_killed_mid_transfer_gives_the_holders_leases_back_at_once(make_daemon):
    """Its leases last 20 minutes and the connection's idle limit as long: only the lifeline
    can end the holder's send in time."""
    d = make_daemon(peer_ucx_shm=True, auto_create_namespaces=True, ram_bytes="96MiB", max_block_bytes="16MiB",
                    lease_seconds=1200, peer_idle_seconds=1200)
    address = d.peer_addresses()["ucx-shm"]
    with open_transport("peer-ucx-shm", target=address) as t:
        t.put("m", [BlockPut(b"r%d" % i, blob(i, 16 * MiB)) for i in range(3)], Deadline.after(60))
    wait_until(lambda: holds_nothing(d), what="the writes' slots to be committed")
    reader = subprocess.Popen([sys.executable, "-c", READER, address], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert reader.stdout.readline().strip() == "stalled"
        assert d.store.stats().active_leases >= 1  # block 1 is being sent out of the arena, leased
        reader.send_signal(signal.SIGKILL)
        reader.wait(30)
        wait_until(lambda: holds_nothing(d) and d.ucx_shm_server.connections == 0, timeout=20,
                   what="the holder to notice the dead reader and give its lease back")
    finally:
        if reader.poll() is None:
            reader.kill()


def test_the_peer_tier_fetches_over_shared_memory_from_a_holder_on_this_host(nodes):
    """The holder advertises ucx-shm:// first; a reader listing ucx-shm anywhere in its transports
    takes it for a holder on this host; one without it fetches over TCP."""
    a = nodes("a", "--peer-listen", "127.0.0.1:0", "--peer-ucx-shm")
    b = nodes("b", "--peer-transports", "tcp,ucx-shm,grpc")
    c = nodes("c", "--peer-transports", "tcp,grpc")
    keys = keys_of("ucx-shm", 6)
    data = [value(f"ucx-shm/{i}", 3 << 20) for i in range(6)]
    with Client(a.target) as ca, Client(b.target, use_shm=False) as cb, Client(c.target, use_shm=False) as cc:
        for k, v in zip(keys, data):
            ca.put(NS, k, v)
        wait_until(lambda: held_by(cb, keys, "a"), what="a to publish its blocks")
        for k, v in zip(keys[:3], data[:3]):
            assert cb.get(NS, k) == v
        for k, v in zip(keys[3:], data[3:]):
            assert cc.get(NS, k) == v
        assert b.metric("strata_peer_fetched_bytes_total", transport="ucx-shm") == 9 << 20
        assert not b.metric("strata_peer_fetched_bytes_total", transport="tcp")
        assert c.metric("strata_peer_fetched_bytes_total", transport="tcp") == 9 << 20


def test_a_holder_on_another_host_is_fetched_from_over_tcp_never_shared_memory(network, tmp_path):
    """Two network namespaces stand for two hosts (their own network and mounts: another host id):
    the reader lists ucx-shm first, the holder advertises it first, and the fetch goes over TCP
    without a failed shared-memory attempt."""
    redis = redis_servers.RedisServer(tmp_path / "redis", "--protected-mode", "no", bind=network.gateway).wait_ready()
    url = f"redis://{network.gateway}:{redis.port}/0"
    started: list[PeerNode] = []
    try:
        holder = PeerNode(tmp_path, "h", url, "--insecure", "--peer-listen", f"{network.address(0)}:50061",
                          "--peer-ucx-shm", host=network.address(0), port=50051, netns=network.namespaces[0])
        started.append(holder.start())
        reader = PeerNode(tmp_path, "r", url, "--insecure", "--peer-transports", "ucx-shm,tcp,grpc",
                          host=network.address(1), port=50051, netns=network.namespaces[1])
        started.append(reader.start())
        keys = keys_of("elsewhere", 3)
        data = [value(f"elsewhere/{i}", 1 << 20) for i in range(3)]
        with Client(holder.target, use_shm=False) as ch, Client(reader.target, use_shm=False) as cr:
            for k, v in zip(keys, data):
                ch.put(NS, k, v)
            wait_until(lambda: held_by(cr, keys, "h"), timeout=60, what="h to publish its blocks")
            for k, v in zip(keys, data):
                assert cr.get(NS, k) == v
        assert reader.metric("strata_peer_fetched_bytes_total", transport="tcp") == 3 << 20
        assert not reader.metric("strata_peer_fetched_bytes_total", transport="ucx-shm")
        assert not any(reader.fallbacks().values())
    finally:
        for node in started:
            node.kill()
        redis.stop()
