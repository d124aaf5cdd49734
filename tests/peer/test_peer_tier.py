"""The peer tier across real daemons: separate ``strata serve`` processes, one real Redis index.

On loopback each daemon has its own ports and directories; across network
namespaces each has an address of its own on a virtual network, and peers
authenticate with a bearer token. Holders are killed with SIGKILL,
restarted (a new epoch), left with stale index entries, or put behind a
proxy that damages their bytes. What must hold every time: a block served
is the block that was put (never corrupt), a stale entry is removed the
first time it is found and never tried again, and an older epoch's
entries are never used. No test asserts a timing; waits are bounded polls.

Ordering between holders is pinned where a test needs it by the "same host
first" rule: a holder advertised as ``localhost:PORT`` is on another host
than ``127.0.0.1`` as far as the peer tier can tell, so it comes second.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from benchmarks.harness import free_port
from kvstore.api.v1 import kv_pb2 as pb
from kvstore.api.v1 import kv_pb2_grpc
from kvstore.auth.credentials import ChannelSecurity
from kvstore.block import TierName, checksum
from kvstore.client.codec import BlockPut
from kvstore.client.sync import Client
from kvstore.transport.grpc.blocks import CHANNEL_OPTIONS
from tests.support import redis_servers
from tests.support.peer_cluster import NS, FlipProxy, PeerNode, held_by, holders_of, keys_of, peers, value
from tests.support.wait import wait_until

pytestmark = pytest.mark.system

MARKER = b"STRATA-FLIP-HERE"


# ---- loopback ------------------------------------------------------------------------


def test_a_block_put_on_a_is_served_by_b_verified_and_then_local(nodes):
    a, b = nodes("a"), nodes("b")
    keys = keys_of("served", 4)
    data = [value(f"served/{i}", 1 << 20) for i in range(4)]
    with Client(a.target) as ca, Client(b.target, use_shm=False) as cb:
        for k, v in zip(keys, data):
            ca.put(NS, k, v)
        wait_until(lambda: held_by(cb, keys, "a"), what="a to publish its blocks")
        assert cb.exists(NS, keys) == []  # nothing local on b yet
        for k, v in zip(keys, data):
            assert cb.get(NS, k) == v
        assert cb.exists(NS, keys) == [TierName.HOST] * 4  # promoted into b's RAM
        wait_until(lambda: held_by(cb, keys, "a", "b"), what="b's index agent to publish the fetched blocks")
        fetched = b.metric("strata_peer_fetched_bytes_total", transport="grpc")
        assert fetched == 4 << 20
        assert b.metric("strata_peer_reads_total", outcome="hit") == 4
        for k, v in zip(keys, data):  # now from b's own RAM: no more peer reads
            assert cb.get(NS, k) == v
        assert b.metric("strata_peer_fetched_bytes_total", transport="grpc") == fetched
        assert cb.get(NS, b"never-put") is None
        assert b.metric("strata_peer_reads_total", outcome="no_holder") == 1
    listed = {n["node_id"]: n for n in peers(b.target)}
    assert listed["a"]["alive"] and listed["a"]["address"] == a.target
    assert listed["a"]["transports"] == [f"grpc://{a.target}"]
    assert listed["b"]["transports"] == [f"grpc://{b.target}"] and listed["b"]["epoch"] > 0


def test_a_batch_held_by_one_peer_is_fetched_in_one_request_per_64_blocks(nodes):
    """A prefix's blocks are mostly held together: the peer tier asks their holder for all of them in
    one request (at most FETCH_BATCH_KEYS each), not one round trip per block; through a streamed Get
    and through a same-host lookup alike."""
    from kvstore.peer.source import FETCH_BATCH_KEYS

    a, b = nodes("a"), nodes("b")
    n = FETCH_BATCH_KEYS + 16
    chains = {"stream": keys_of("stream", n), "shm": keys_of("shm", n)}
    data = {name: [value(f"{name}/{i}", 64 << 10) for i in range(n)] for name in chains}
    with Client(a.target) as ca, Client(b.target, use_shm=False) as streamed, Client(b.target) as same_host:
        for name, keys in chains.items():
            ca.put_many(NS, [BlockPut(k, v, keys[i - 1] if i else None) for i, (k, v) in enumerate(zip(keys, data[name]))])
            wait_until(lambda keys=keys: held_by(streamed, keys, "a"), what="a to publish its blocks")
        for requests, (name, client) in enumerate((("stream", streamed), ("shm", same_host)), 1):
            got = client.get_many(NS, chains[name])
            assert [g.data for g in got] == data[name]
            assert b.metric("strata_peer_reads_total", outcome="hit") == n * requests
            assert b.metric("strata_peer_fetch_duration_seconds_count", transport="grpc") == 2 * requests  # 64 + 16
        assert b.fallbacks() == {reason: 0.0 for reason in b.fallbacks()}


def test_a_holder_with_a_peer_listener_is_read_over_tcp(nodes):
    """A holder that serves --peer-listen advertises tcp:// first, and the peer tier reads it over TCP."""
    from benchmarks.harness import free_port

    peer_port = free_port()
    a = nodes("a", "--peer-listen", f"127.0.0.1:{peer_port}")
    b = nodes("b")
    keys = keys_of("tcp", 3)
    data = [value(f"tcp/{i}", 3 << 20) for i in range(3)]
    with Client(a.target) as ca, Client(b.target, use_shm=False) as cb:
        for k, v in zip(keys, data):
            ca.put(NS, k, v)
        wait_until(lambda: held_by(cb, keys, "a"), what="a to publish its blocks")
        listed = {n["node_id"]: n for n in peers(b.target)}
        assert listed["a"]["transports"] == [f"tcp://127.0.0.1:{peer_port}", f"grpc://{a.target}"]
        for k, v in zip(keys, data):
            assert cb.get(NS, k) == v
        assert b.metric("strata_peer_fetched_bytes_total", transport="tcp") == 9 << 20
        assert not b.metric("strata_peer_fetched_bytes_total", transport="grpc")


def test_a_holder_killed_mid_batch_falls_back_to_the_next_holder(nodes):
    """b reads a batch through from a, READ_THROUGH_BATCH blocks at a time; a dies once the first block
    reached the caller, before b asks it for the next blocks: c serves them."""
    from kvstore.store.reads import READ_THROUGH_BATCH

    a = nodes("a")
    c = nodes("c", advertise="localhost:{port}")  # another host as far as b can tell: tried after a
    b = nodes("b")
    n, size = READ_THROUGH_BATCH + 16, 1 << 20
    keys = keys_of("batch", n)
    data = [value(f"batch/{i}", size) for i in range(n)]
    with Client(a.target) as ca, Client(c.target) as cc, Client(b.target, use_shm=False) as cb:
        for k, v in zip(keys, data):
            ca.put(NS, k, v)
            cc.put(NS, k, v)
        wait_until(lambda: held_by(cb, keys, "a", "c"), what="a and c to publish")
        got: dict[int, bytes] = {}
        header, buf, index = None, bytearray(), -1
        with grpc.insecure_channel(b.target, options=CHANNEL_OPTIONS) as channel:
            stream = kv_pb2_grpc.KVServiceStub(channel).Get(pb.GetRequest(namespace=NS, keys=keys), timeout=120)
            for msg in stream:  # read as it comes: gRPC's flow control keeps b from running far ahead
                if msg.WhichOneof("part") == "header":
                    index += 1
                    header, buf = msg.header, bytearray()
                    assert header.found, f"block {index} was a miss although c holds it"
                    continue
                buf += msg.chunk
                if len(buf) == header.block.size:
                    assert checksum(buf) == header.block.checksum
                    got[index] = bytes(buf)
                    if index == 0:
                        a.kill()  # the first block arrived; the rest are still to come
        assert sorted(got) == list(range(n))
        assert all(got[i] == data[i] for i in range(n)), "a block served differs from the one put"
        passed_over = b.fallbacks()
        assert passed_over["unavailable"] + passed_over["deadline"] >= 1, passed_over
        assert passed_over["corrupt"] == 0


def test_a_restarted_holder_s_old_epoch_entries_are_not_used(nodes):
    a, b = nodes("a", "--no-ram-crash-safe"), nodes("b")  # a's RAM does not outlive its process
    k = keys_of("epoch", 1)
    with Client(a.target) as ca, Client(b.target, use_shm=False) as cb:
        ca.put(NS, k[0], value("epoch", 1 << 16))  # in a's RAM only: lost with the process
        wait_until(lambda: held_by(cb, k, "a"), what="a to publish")
        before = {n["node_id"]: n["epoch"] for n in peers(b.target)}["a"]
    a.restart()
    wait_until(lambda: {n["node_id"]: n["epoch"] for n in peers(b.target)}.get("a", 0) > before,
               what="a to join again at a new epoch")
    with Client(a.target) as ca, Client(b.target, use_shm=False) as cb:
        assert ca.exists(NS, k) == []  # the restarted a does not hold it
        assert holders_of(cb, k) == [set()]
        assert cb.get(NS, k[0]) is None
    assert b.metric("strata_peer_reads_total", outcome="no_holder") == 1
    assert sum(b.fallbacks().values()) == 0  # a was never asked: its old entry did not count
    assert b.metric("strata_peer_index_repairs_total", outcome="removed") == 0


def _add_entry(url: str, node: str, epoch: int, key: bytes) -> None:
    from kvstore.index.redis import RedisIndex

    async def main():
        ix = RedisIndex.from_url(url)
        try:
            await ix.add(NS, node, epoch, [(key, TierName.HOST)])
        finally:
            await ix.close()

    asyncio.run(main())


@pytest.mark.parametrize("a_serves", ["grpc", "tcp"])
def test_a_stale_entry_is_repaired_at_once_and_never_tried_twice(nodes, index_url, a_serves):
    # Over either data plane a answers from its own tiers: a TCP listener that read the block
    # through from c (its own peer tier) would serve it, the entry would stay, c would count
    # a's fetch as bytes it served, and b's counters would not show the stale entry at all.
    a = nodes("a", *(["--peer-listen", f"127.0.0.1:{free_port()}"] if a_serves == "tcp" else []))
    c = nodes("c", advertise="localhost:{port}")  # tried after a
    b = nodes("b")
    held, gone = keys_of("stale", 2)
    with Client(a.target) as ca, Client(c.target) as cc, Client(b.target, use_shm=False) as cb:
        epoch = {n["node_id"]: n["epoch"] for n in peers(b.target)}["a"]
        ca.put(NS, b"published", b"x")  # a's agent has joined and published before the entries below
        wait_until(lambda: held_by(cb, [b"published"], "a"), what="a to publish")
        # What an eviction whose removal never reached the index leaves: a names blocks it lacks.
        _add_entry(index_url, "a", epoch, held)
        _add_entry(index_url, "a", epoch, gone)
        cc.put(NS, held, value("held", 1 << 18))
        wait_until(lambda: held_by(cb, [held], "a", "c"), what="c to publish")

        assert cb.get(NS, held) == value("held", 1 << 18)  # a (same host, first) said miss; c served it
        assert b.fallbacks()["miss"] == 1
        assert b.metric("strata_peer_index_repairs_total", outcome="removed") == 1
        assert "a" not in holders_of(cb, [held])[0]
        assert c.metric("strata_peer_served_bytes_total", transport="grpc") == 1 << 18  # b's fetch alone
        assert a.metric("strata_peer_reads_total", outcome="hit") == 0  # a fetched nothing for b

        assert cb.get(NS, gone) is None  # a alone names it: asked once, repaired
        assert cb.get(NS, gone) is None  # and not asked again
        assert b.fallbacks()["miss"] == 2
        assert b.metric("strata_peer_index_repairs_total", outcome="removed") == 2
        assert b.metric("strata_peer_reads_total", outcome="no_holder") == 1
        assert holders_of(cb, [gone]) == [set()]


def test_a_peer_whose_bytes_are_damaged_in_transit_is_passed_over(nodes, tmp_path):
    from benchmarks.harness import free_port

    port = free_port()
    proxy = FlipProxy(("127.0.0.1", port), MARKER)
    try:
        a = nodes("a", port=port, advertise=proxy.address)  # peers reach a through the proxy
        c = nodes("c", advertise="localhost:{port}")  # tried after a
        b = nodes("b")
        k = keys_of("flip", 1)[0]
        v = value("flip", 1 << 20, prefix=MARKER)
        with Client(a.target) as ca, Client(c.target) as cc, Client(b.target, use_shm=False) as cb:
            ca.put(NS, k, v)
            cc.put(NS, k, v)
            wait_until(lambda: held_by(cb, [k], "a", "c"), what="a and c to publish")
            assert cb.get(NS, k) == v
        assert proxy.flipped >= 1  # a's copy was damaged on the way ...
        assert b.fallbacks()["corrupt"] == 1  # ... refused, and c's copy served
        assert b.metric("strata_peer_index_repairs_total", outcome="removed") == 0  # a does hold it
    finally:
        proxy.close()


# ---- across network namespaces --------------------------------------------------------

PEER_TOKEN = "peer-token-0123456789abcdef"
ADMIN_TOKEN = "admin-token-0123456789abcdef"


def test_fetch_across_network_namespaces_with_peer_auth(network, tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text(
        f'[[token]]\nname = "peer"\ntoken = "{PEER_TOKEN}"\nnamespaces = ["{NS}"]\nactions = ["read"]\n\n'
        f'[[token]]\nname = "admin"\ntoken = "{ADMIN_TOKEN}"\nnamespaces = ["*"]\n'
    )
    token_file = tmp_path / "peer.token"
    token_file.write_text(PEER_TOKEN + "\n")
    redis = redis_servers.RedisServer(tmp_path / "redis", "--protected-mode", "no", bind=network.gateway).wait_ready()
    url = f"redis://{network.gateway}:{redis.port}/0"
    started: list[PeerNode] = []
    try:
        for i in range(3):
            node = PeerNode(
                tmp_path, f"n{i}", url, "--auth-file", str(policy), "--peer-token-file", str(token_file),
                host=network.address(i), port=50051, netns=network.namespaces[i],
            )
            started.append(node)
            node.start()
        n0, n1, n2 = started
        keys = keys_of("netns", 6)
        data = [value(f"netns/{i}", 1 << 20) for i in range(6)]
        secret = b"secret-key"
        connect = dict(use_shm=False, token=ADMIN_TOKEN)
        with Client(n0.target, **connect) as c0, Client(n1.target, **connect) as c1, \
                Client(n2.target, **connect) as c2:
            for k, v in zip(keys, data):
                c0.put(NS, k, v)
                c2.put(NS, k, v)
            c0.put("secret", secret, b"s" * 4096)  # the peer token may not read this namespace
            wait_until(lambda: held_by(c1, keys, "n0", "n2"), timeout=60, what="n0 and n2 to publish")
            wait_until(lambda: {h.node_id for h in c1.holders("secret", keys=[secret])[0]} == {"n0"},
                       timeout=60, what="n0 to publish the secret block")
            (tmp_path / "admin.token").write_text(ADMIN_TOKEN)
            listed = {n["node_id"]: n for n in peers(n1.target, "--token-file", str(tmp_path / "admin.token"))}
            assert listed["n0"]["transports"] == [f"grpc://{n0.target}"]

            for k, v in zip(keys[:3], data[:3]):  # over the virtual network, from n0 or n2
                assert c1.get(NS, k) == v
            assert n1.metric("strata_peer_fetched_bytes_total", transport="grpc") == 3 << 20

            assert c1.get("secret", secret) is None  # n0 refused n1's token for it: a miss, not an error
            assert n1.fallbacks()["refused"] == 1
            assert n1.metric("strata_peer_index_repairs_total", outcome="removed") == 0

            n0.kill()
            for k, v in zip(keys[3:], data[3:]):  # n0 is gone: whatever n1 tries, n2 serves
                assert c1.get(NS, k) == v
            assert c1.exists(NS, keys) == [TierName.HOST] * 6
        with pytest.raises(grpc.RpcError) as refused:  # peers authenticate: no token, no blocks
            stub = kv_pb2_grpc.KVServiceStub(ChannelSecurity.build().channel(n2.target, CHANNEL_OPTIONS))
            list(stub.Get(pb.GetRequest(namespace=NS, keys=keys[:1], local_only=True), timeout=10))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        for node in started:
            node.kill()
        redis.stop()
