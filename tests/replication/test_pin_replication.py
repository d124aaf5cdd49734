"""Pins that ask for replicas: k copies of the pinned prefix on distinct live nodes, held for the pin's lease.

The hold protocol runs against a real daemon's peer listener; the copies
across in-process daemons sharing a real Redis index (small RAM, to show
that a held copy survives eviction and an released one does not), and
across real ``strata serve`` processes, a holder killed with SIGKILL.
Waits are bounded polls; no assertion is about how long anything took.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import time

import pytest

from benchmarks.harness import free_port
from kvstore.block import TierName
from kvstore.client.sync import Client
from kvstore.config import SettingsError, load_settings
from kvstore.errors import InvalidArgument, Overloaded
from kvstore.peer import open_peer_transport
from kvstore.replication.pin_copies import PinCopies, PinLimits
from kvstore.replication.pusher import Pusher
from kvstore.replication.replicator import ReplicationMetrics
from tests.support import redis_servers
from tests.support.peer_cluster import PeerNode
from tests.support.wait import wait_until

NS = "pinned"
INTERVAL = "0.2"
MiB = 1 << 20


def keys_of(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(n)]


def value(key: bytes, size: int) -> bytes:
    return (key * (size // len(key) + 1))[:size]


def holders(client: Client, namespace: str, keys: list[bytes]) -> list[set[str]]:
    return [{h.node_id for h in held} for held in client.holders(namespace, keys=keys)]


def held_locally(client: Client, namespace: str, keys: list[bytes]) -> list[bool]:
    """Per key whether the node holds it in RAM or on disk (exists answers a prefix, so one key at a time)."""
    return [bool(t) and t[0] in (TierName.HOST, TierName.DISK) for t in (client.exists(namespace, [k]) for k in keys)]


def pinned(client: Client) -> int:
    return client.stats().pinned_blocks


def replication_cli(target: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore.cli.main", "replication", "--target", target, *flags],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def index_url(tmp_path):
    """A Redis of each test's own (a node killed before would linger in a shared index)."""
    if not redis_servers.available():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = redis_servers.start_standalone(tmp_path / "redis")
    yield server.url
    server.stop()


# ---- limits and settings -------------------------------------------------------------


def test_a_pin_asking_more_than_the_limit_or_one_pin_too_many_is_refused():
    copies = PinCopies(None, "a", Pusher("a", push_s=1, backoff_s=1), PinLimits(max_replicas=3, max_pins=1),
                       ReplicationMetrics())
    with pytest.raises(InvalidArgument, match=r"4 replicas.*1 to 3 copies.*max_pin_replicas"):
        copies.check(4)
    copies.add(1, NS, [b"k"], 3, time.monotonic() + 60)
    with pytest.raises(Overloaded, match="max_replicated_pins"):
        copies.add(2, NS, [b"k"], 2, time.monotonic() + 60)
    copies.end(1)
    copies.add(2, NS, [b"k"], 2, time.monotonic() + 60)  # room again once a pin ended


def test_pin_replica_settings_from_flags():
    s = load_settings(replication_max_pin_replicas="6", replication_max_replicated_pins="10")
    assert s.replication.max_pin_replicas == 6 and s.replication.max_replicated_pins == 10
    assert load_settings().replication.max_pin_replicas == 4
    with pytest.raises(SettingsError, match="max-pin-replicas"):
        load_settings(replication_max_pin_replicas="17")


def test_the_pin_rpc_refuses_replicas_it_does_not_keep(make_daemon):
    d = make_daemon(replication_max_pin_replicas="2")
    off = make_daemon(replication_max_pin_replicas="1")
    assert off.replicator is None
    for daemon, why in [(d, "1 to 2 copies"), (off, "keeps no copies of pins")]:
        with Client(daemon.target, use_shm=False) as c:
            c.put(NS, b"k", b"v")
            with pytest.raises(InvalidArgument, match=why):  # INVALID_ARGUMENT, as the client raises it
                c.pin(NS, [b"k"], replicas=3)
            assert pinned(c) == 0  # refused before anything was pinned
            lease = c.pin(NS, [b"k"], replicas=1)  # 1: this copy only, as before
            assert lease.pinned == 1 and c.unpin(lease.lease_id)


# ---- the hold protocol -------------------------------------------------------------------


def test_a_hold_pins_what_the_peer_holds_until_released(make_daemon):
    d = make_daemon(peer_listen="127.0.0.1:0")
    address = d.peer_addresses()["tcp"]
    with Client(d.target, use_shm=False) as c:
        c.put(NS, b"a", b"1" * 100)
        c.put(NS, b"b", b"2" * 100)

    async def scenario() -> None:
        t = open_peer_transport("tcp")
        try:
            deadline = time.monotonic() + 10
            held = await t.hold(address, NS, [b"a", b"missing", b"b"], 60, deadline)
            assert held.lease_id and held.held == [True, False, True] and 0 < held.lease_s <= 60
            assert d.store.stats().pinned_blocks == 2
            none = await t.hold(address, NS, [b"missing"], 60, deadline)
            assert none.lease_id == 0 and none.held == [False]  # nothing held, no lease left open
            assert await t.release(address, [held.lease_id, 12345], deadline) == [True, False]
            assert await t.release(address, [held.lease_id], deadline) == [False]  # already released
            assert await t.release(address, [], deadline) == []
        finally:
            await t.close()

    asyncio.run(scenario())
    assert d.store.stats().pinned_blocks == 0 and d.store.stats().active_leases == 0


def test_a_malformed_hold_is_refused_with_a_clear_error(make_daemon):
    from kvstore.peer import wire
    from kvstore.peer.tcp import TcpPeerClient
    from kvstore.transport import Deadline

    d = make_daemon(peer_listen="127.0.0.1:0")
    client = TcpPeerClient()
    try:
        def raw(args):
            return client._call(d.peer_addresses()["tcp"], Deadline.after(10),
                                lambda conn: conn.reply(conn.send(wire.HOLD, args)))

        for args, why in [([NS, [], 1000], "at least one key"), ([NS, [b"k"], 0], "at least 1 ms"),
                          ([NS, ["text"], 1000], "key must be bytes"), ([NS, [b"k"]], "expected 3 fields")]:
            with pytest.raises(InvalidArgument, match=why):
                raw(args)
    finally:
        client.close()
    assert d.store.stats().active_leases == 0


# ---- copies across daemons -------------------------------------------------------------


def test_copies_held_for_a_pin_survive_eviction_there_and_become_cache_at_unpin(index_url, make_daemon):
    common = dict(index_url=index_url, peer_listen="127.0.0.1:0", replication_interval_seconds="0.1",
                  disk_bytes="0", index_ttl_seconds="30")
    a = make_daemon(node_id="a", ram_bytes="32MiB", **common)
    b = make_daemon(node_id="b", ram_bytes="16MiB", **common)
    keys = keys_of("held", 4)
    with Client(a.target, use_shm=False) as ca, Client(b.target, use_shm=False) as cb:
        for k in keys:
            ca.put(NS, k, value(k, 2 * MiB))
        lease = ca.pin(NS, keys, lease_s=600, replicas=2)
        assert lease.pinned == 4
        wait_until(lambda: all(h == {"a", "b"} for h in holders(ca, NS, keys)), what="a copy of each block on b")
        wait_until(lambda: pinned(cb) == 4, what="b to hold the copies pinned")

        def fill(tag: str) -> None:  # twice b's RAM of other blocks: whatever is not pinned goes
            for f in keys_of(tag, 16):
                cb.put("filler", f, value(f, 2 * MiB))

        fill("first")
        assert held_locally(cb, NS, keys) == [True] * 4  # held: never evicted
        r = ca.replication()
        [p] = r.pins
        assert (p.namespace, p.pins, p.replicas, p.blocks, p.under_replicated, p.copies_held) == (NS, 1, 2, 4, 0, 4)
        assert p.copies_made == 4 and p.copies_failed == 0

        assert ca.unpin(lease.lease_id)
        wait_until(lambda: pinned(cb) == 0, what="b to release the copies once the pin ended")
        assert held_locally(cb, NS, keys) == [True] * 4  # still there: cache now
        wait_until(lambda: ca.replication().pins[0].pins == 0, what="a to forget the pin")
        fill("second")
        assert held_locally(cb, NS, keys) != [True] * 4  # ordinary cache: evicted like any other block
        for k in keys:
            assert ca.get(NS, k) == value(k, 2 * MiB)  # the pinner's copy is untouched


@pytest.fixture
def nodes(tmp_path, index_url):
    started: list[PeerNode] = []

    def start(name: str, *extra: str) -> PeerNode:
        node = PeerNode(tmp_path, name, index_url, "--peer-listen", f"127.0.0.1:{free_port()}",
                        "--replication-interval-seconds", INTERVAL, *extra)
        started.append(node)
        return node.start()

    yield start
    for node in started:
        node.kill()


def test_a_pin_with_two_replicas_keeps_two_copies_restored_after_sigkill_and_released_at_unpin(nodes):
    a, b, c = nodes("a"), nodes("b"), nodes("c")
    keys = keys_of("pin", 6)
    with Client(a.target, use_shm=False) as ca:
        for k in keys:
            ca.put(NS, k, value(k, 1 << 18))
        lease = ca.pin(NS, keys, lease_s=600, replicas=2)
        wait_until(lambda: all(len(h) == 2 and "a" in h for h in holders(ca, NS, keys)),
                   what="two holders of every pinned block")
        [first] = {n for h in holders(ca, NS, keys) for n in h} - {"a"}  # the whole prefix on one other node
        by_name = {"b": b, "c": c}
        holder, other = by_name[first], by_name[({"b", "c"} - {first}).pop()]
        with Client(holder.target, use_shm=False) as ch:
            wait_until(lambda: pinned(ch) == 6, what=f"{first} to hold the copies pinned")
        with Client(other.target, use_shm=False) as co:
            assert pinned(co) == 0
        start = a.metric("strata_replication_rounds_total", outcome="ok")
        wait_until(lambda: a.metric("strata_replication_rounds_total", outcome="ok") >= start + 3,
                   what="a few more rounds")
        assert all(len(h) == 2 for h in holders(ca, NS, keys))  # exactly k: nothing pushed twice
        assert a.metric("strata_replication_pinned_under_replicated_blocks") == 0
        assert a.metric("strata_replication_pinned_copies") == 6

        holder.kill()
        wait_until(lambda: all(h == {"a", other.name} for h in holders(ca, NS, keys)), timeout=60,
                   what="the killed holder's copies restored on the other node")
        with Client(other.target, use_shm=False) as co:
            wait_until(lambda: pinned(co) == 6, what=f"{other.name} to hold the restored copies pinned")
            for k in keys:
                assert co.get(NS, k) == value(k, 1 << 18)
            assert held_locally(co, NS, keys) == [True] * 6
        wait_until(lambda: a.metric("strata_replication_pinned_under_replicated_blocks") == 0,
                   what="nothing reported short")

        assert ca.unpin(lease.lease_id)
        with Client(other.target, use_shm=False) as co:
            wait_until(lambda: pinned(co) == 0, what="the copies released at unpin")
            assert held_locally(co, NS, keys) == [True] * 6  # left as evictable cache
        assert pinned(ca) == 0
    report = json.loads(replication_cli(a.target, "--json").stdout)
    assert report["pins"][0]["pins"] == 0 and report["pins"][0]["copies_made"] == 12


def test_more_replicas_than_live_nodes_are_reported_under_replicated_not_retried(nodes):
    a, _ = nodes("a"), nodes("b")
    keys = keys_of("wide", 4)
    with Client(a.target, use_shm=False) as ca:
        for k in keys:
            ca.put(NS, k, value(k, 1 << 16))
        lease = ca.pin(NS, keys, lease_s=600, replicas=3)
        wait_until(lambda: all(h == {"a", "b"} for h in holders(ca, NS, keys)), what="a copy of each on b")
        wait_until(lambda: a.metric("strata_replication_pinned_under_replicated_blocks") == 4,
                   what="the pinned blocks reported short of k=3")
        made = a.metric("strata_replication_copies_total", outcome="made")
        start = a.metric("strata_replication_rounds_total", outcome="ok")
        wait_until(lambda: a.metric("strata_replication_rounds_total", outcome="ok") >= start + 5,
                   what="five more rounds")
        assert a.metric("strata_replication_copies_total", outcome="made") == made == 4  # no push repeated
        assert a.metric("strata_replication_copies_total", outcome="failed") == 0
        assert a.metric("strata_replication_rounds_total", outcome="error") == 0
        assert a.metric("strata_replication_pinned_under_replicated_blocks") == 4
        check = replication_cli(a.target, "--check")
        assert check.returncode == 4, check.stdout + check.stderr
        assert "4 under-replicated" in check.stdout and f"{NS}\t1 pins" in check.stdout
        ca.unpin(lease.lease_id)
        wait_until(lambda: replication_cli(a.target, "--check").returncode == 0, what="nothing short once unpinned")
