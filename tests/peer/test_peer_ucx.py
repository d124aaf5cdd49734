"""The UCX peer data plane over real ucxx endpoints: a daemon's --peer-ucx-listen and the UCX client.

UCX here runs over TCP sockets (the listener API's wire-up, and the data
over UCX's tcp transport), between in-process daemons and real child
processes, one of them SIGKILLed mid-transfer. The contract parts every
transport shares run in test_transport_contract.py (peer-ucx there); the
request handling is the TCP server's, tested in test_peer_tcp.py. Skipped,
with the reason, where ucxx cannot be imported (the ``ucx`` extra).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import pytest

from benchmarks.harness import free_port
from kvstore.block import BlockMeta, TierName, checksum
from kvstore.errors import InvalidArgument, TierUnavailable, Unauthenticated
from kvstore.peer import open_peer_transport
from kvstore.peer.ucx_link import ucx_available
from kvstore.remote.base import ReadStatus, WriteStatus
from kvstore.server.endpoints import DaemonError
from kvstore.transport import BlockPut, Deadline, open_transport
from tests.support.daemons import DaemonProcess
from tests.support.identities import TOKEN_ADMIN, policy_text
from tests.support.peer_cluster import NS, held_by, keys_of, peers, value
from tests.support.wait import wait_until

UCX, NO_UCX = ucx_available()
pytestmark = [pytest.mark.system, pytest.mark.skipif(not UCX, reason=NO_UCX)]

MiB = 1 << 20
UCX_PEER = dict(ram_bytes="160MiB", disk_bytes="0", max_block_bytes="16MiB", auto_create_namespaces=True,
                peer_ucx_listen="127.0.0.1:0", insecure=True)


def blob(seed: int, size: int) -> bytes:
    return (seed.to_bytes(8, "big") + os.urandom(8)) * (size // 16) + b"x" * (size % 16)


def holds_nothing(daemon) -> bool:
    s = daemon.store.stats()
    return s.active_leases == 0 and s.open_slots == 0 and s.pinned_blocks == 0


def test_a_daemon_advertises_its_ucx_address_first_after_tcp(make_daemon):
    d = make_daemon(peer_listen="127.0.0.1:0", **UCX_PEER)
    addresses = d.peer_addresses()
    assert addresses["ucx"] == f"ucx://127.0.0.1:{d.ucx_server.port}"
    assert d.peer_transports() == [addresses["tcp"], addresses["ucx"], f"grpc://{d.advertised}"]
    plain = make_daemon()
    assert "ucx" not in plain.peer_addresses() and plain.ucx_server is None


def test_protected_mode_refuses_a_ucx_listener_without_auth_even_on_loopback(make_daemon):
    with pytest.raises(DaemonError, match="--peer-ucx-listen .* every interface"):
        make_daemon(peer_ucx_listen="127.0.0.1:0")


def test_reads_and_writes_between_two_daemons_land_verified(make_daemon):
    """The PeerTransport API (what one daemon's peer tier calls) over UCX: writes into the
    holder's arena, reads into placed views, metadata-only lookups, misses."""
    holder = make_daemon(**UCX_PEER)
    make_daemon(**UCX_PEER)  # a second daemon in the process: both share the one ucxx worker
    address = holder.peer_addresses()["ucx"]
    values = {b"k%d" % i: blob(i, size) for i, size in enumerate([1, 300_000, 5 * MiB, 16 * MiB])}

    async def go():
        t = open_peer_transport("ucx")
        try:
            wrote = await t.write(address, "m", [(k, v, BlockMeta(len(v), checksum(v), None, "L"))
                                                 for k, v in values.items()], time.monotonic() + 60)
            again = await t.write(address, "m", [(b"k0", values[b"k0"], BlockMeta(1, checksum(values[b"k0"])))],
                                  time.monotonic() + 60)
            views = {}
            keys = [*values, b"absent"]
            got = await t.read(address, "m", keys, lambda i, m: views.setdefault(i, bytearray(m.size)),
                               time.monotonic() + 60)
            metas = await t.lookup(address, "m", keys, time.monotonic() + 60)
            return wrote, again, views, got, metas, t.stats()
        finally:
            await t.close()

    wrote, again, views, got, metas, stats = asyncio.run(go())
    assert [w.status for w in wrote] == [WriteStatus.STORED] * 4
    assert again[0].status is WriteStatus.PRESENT
    for i, v in enumerate(values.values()):
        assert got[i].status is ReadStatus.HIT and bytes(views[i]) == v
        assert metas[i].size == len(v) and metas[i].layout == "L"
    assert got[4].status is ReadStatus.MISS and metas[4] is None
    assert stats.scheme == "ucx" and stats.hits == 4 and stats.read_bytes == sum(map(len, values.values()))
    assert holder.store.exists("m", list(values)) == [TierName.HOST] * 4
    wait_until(lambda: holds_nothing(holder), what="the holder to give back every lease and slot")


def test_a_hello_without_a_known_token_is_unauthenticated(make_daemon, tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text(policy_text())
    d = make_daemon(auth_file=str(policy), **{**UCX_PEER, "insecure": False})
    with open_transport("peer-ucx", target=d.peer_addresses()["ucx"], token="not-a-token") as t:
        with pytest.raises(Unauthenticated):
            t.get_into("a", [b"x"], None, Deadline.after(10))
    with open_transport("peer-ucx", target=d.peer_addresses()["ucx"], token=TOKEN_ADMIN) as t:
        t.put("a", [BlockPut(b"x", b"a" * 10)], Deadline.after(10))
        [block] = t.get_into("a", [b"x"], None, Deadline.after(10))
        assert bytes(block.data) == b"a" * 10


def test_an_unreachable_ucx_peer_is_tier_unavailable_and_a_tcp_address_is_refused():
    async def go(address):
        t = open_peer_transport("ucx")
        try:
            return await t.read(address, "m", [b"k"], lambda i, m: bytearray(m.size), time.monotonic() + 10)
        finally:
            await t.close()

    with pytest.raises(TierUnavailable, match="cannot reach UCX peer"):
        asyncio.run(go(f"ucx://127.0.0.1:{free_port()}"))
    with pytest.raises(InvalidArgument, match="ucx://host:port"):
        asyncio.run(go("tcp://127.0.0.1:1"))


def _ucx_port(d: DaemonProcess) -> int:
    found = re.findall(r"UCX peer data plane on \S+ \(port (\d+)\)", d.log.read_text())
    assert found, d.log.read_text()
    return int(found[-1])


def test_a_round_trip_between_two_daemon_processes(tmp_path):
    """Two real ``strata serve`` processes: blocks written into one over UCX are read back from
    it by the other's UCX client, then the second daemon serves them on its own UCX listener."""
    args = ("--ram-bytes", "96MiB", "--disk-bytes", "0", "--max-block-bytes", "8MiB", "--insecure",
            "--peer-ucx-listen", "127.0.0.1:0")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = DaemonProcess(tmp_path / "a", *args).start()
    b = DaemonProcess(tmp_path / "b", *args).start()
    try:
        values = {b"r%d" % i: blob(i, 8 * MiB) for i in range(4)}
        with open_transport("peer-ucx", target=f"127.0.0.1:{_ucx_port(a)}") as ta:
            assert ta.put("m", [BlockPut(k, v) for k, v in values.items()], Deadline.after(60)) == [True] * 4
            got = ta.get_into("m", list(values), None, Deadline.after(60))
        with open_transport("peer-ucx", target=f"127.0.0.1:{_ucx_port(b)}") as tb:
            tb.put("m", [BlockPut(blk.key, blk.data) for blk in got], Deadline.after(60))
            again = tb.get_into("m", list(values), None, Deadline.after(60))
        assert [bytes(blk.data) for blk in again] == list(values.values())
    finally:
        a.kill()
        b.kill()


def test_the_peer_tier_reads_a_holder_over_ucx_when_both_sides_have_it(nodes):
    """Daemon processes and a real Redis index: the holder advertises ucx:// (after tcp://); a
    reader whose transports put ucx first fetches over UCX, one that lacks it over TCP, and one
    that lists ucx before tcp takes tcp where UCX has no RDMA transport (this host), unless
    --peer-ucx-over-tcp keeps UCX."""
    from kvstore.client.sync import Client
    from kvstore.peer.ucx_link import UcxRuntime

    tcp_port = free_port()
    a = nodes("a", "--peer-listen", f"127.0.0.1:{tcp_port}", "--peer-ucx-listen", "127.0.0.1:0", "--insecure")
    b = nodes("b", "--peer-transports", "ucx,grpc")
    c = nodes("c", "--peer-transports", "tcp,grpc")
    d = nodes("d", "--peer-transports", "ucx,tcp,grpc")
    e = nodes("e", "--peer-transports", "ucx,tcp,grpc", "--peer-ucx-over-tcp")
    readers = [b, c, d, e]
    keys = keys_of("ucx", 3 * len(readers))  # each reader reads three blocks of its own: a is their only holder
    data = [value(f"ucx/{i}", 3 << 20) for i in range(len(keys))]
    with Client(a.target) as ca:
        for k, v in zip(keys, data):
            ca.put(NS, k, v)
        with Client(b.target, use_shm=False) as cb:
            wait_until(lambda: held_by(cb, keys, "a"), what="a to publish its blocks")
        transports = {n["node_id"]: n for n in peers(b.target)}["a"]["transports"]
        assert transports[0] == f"tcp://127.0.0.1:{tcp_port}" and transports[1].startswith("ucx://127.0.0.1:")
        for i, reader in enumerate(readers):
            with Client(reader.target, use_shm=False) as cr:
                for k, v in zip(keys[3 * i:3 * i + 3], data[3 * i:3 * i + 3]):
                    assert cr.get(NS, k) == v
    assert b.metric("strata_peer_fetched_bytes_total", transport="ucx") == 9 << 20
    assert not b.metric("strata_peer_fetched_bytes_total", transport="grpc")
    assert c.metric("strata_peer_fetched_bytes_total", transport="tcp") == 9 << 20
    assert e.metric("strata_peer_fetched_bytes_total", transport="ucx") == 9 << 20
    rdma = UcxRuntime.get().network_transports() - {"tcp"}
    assert d.metric("strata_peer_fetched_bytes_total", transport="ucx" if rdma else "tcp") == 9 << 20


def test_fabric_order_puts_tcp_first_only_where_ucx_has_no_fabric_of_its_own():
    """What the readers above act on, for each kind of host: UCX with tcp alone yields to the tcp
    scheme; UCX with an RDMA transport, an explicit ucx_over_tcp, or an order that already has
    tcp first, or no tcp, stay as they are. On this host the worker's network transports are real."""
    from kvstore.peer.registry import fabric_order
    from kvstore.peer.ucx_link import UcxRuntime

    tcp_only, rdma = (lambda: {"tcp"}), (lambda: {"tcp", "rc_mlx5"})
    assert fabric_order(["ucx", "tcp", "grpc"], network=tcp_only) == ("tcp", "ucx", "grpc")
    assert fabric_order(["ucx-shm", "ucx", "grpc", "tcp"], network=tcp_only) == ("ucx-shm", "tcp", "ucx", "grpc")
    assert fabric_order(["ucx", "tcp"], network=rdma) == ("ucx", "tcp")
    assert fabric_order(["ucx", "tcp"], ucx_over_tcp=True, network=tcp_only) == ("ucx", "tcp")
    assert fabric_order(["tcp", "ucx"], network=tcp_only) == ("tcp", "ucx")
    assert fabric_order(["ucx", "grpc"], network=tcp_only) == ("ucx", "grpc")
    found = UcxRuntime.get().network_transports()
    assert "tcp" in found and not found & {"self", "posix", "sysv", "cma"}


def test_a_peer_killed_mid_transfer_fails_the_rest_and_never_reports_partial_bytes(tmp_path):
    from kvstore.peer.ucx import UcxPeerClient

    d = DaemonProcess(tmp_path, "--ram-bytes", "160MiB", "--disk-bytes", "0", "--max-block-bytes", "16MiB",
                      "--insecure", "--peer-ucx-listen", "127.0.0.1:0").start()
    try:
        port = _ucx_port(d)
        values = {b"s%d" % i: blob(i, 16 * MiB) for i in range(6)}
        with open_transport("peer-ucx", target=f"127.0.0.1:{port}") as t:
            t.put("m", [BlockPut(k, v) for k, v in values.items()], Deadline.after(60))
        buffers = {}

        def place(i, meta):
            if i == 1:  # the first block is in; the holder dies before the second one arrives
                d.kill(signal.SIGKILL)
            return buffers.setdefault(i, bytearray(meta.size))

        client = UcxPeerClient()
        got = client.read(f"ucx://127.0.0.1:{port}", "m", list(values), place, Deadline.after(60))
        client.close()
        assert got[0].result.is_hit and bytes(buffers[0]) == values[b"s0"]
        for g in got[1:]:
            assert g.result.status is ReadStatus.FAILED and isinstance(g.result.error, TierUnavailable)
        assert "broke" in str(got[1].result.error)
    finally:
        if d.proc.poll() is None:
            d.kill()
