"""The contract every prefix index keeps (kvstore/index/base.py), run against each backend.

One suite, one ``backend`` fixture parametrized over the in-memory index, a
private ``redis-server`` and a private 3-master Redis Cluster (fixtures in
conftest.py, servers from redis_servers.py). Each test runs its coroutine with
``asyncio.run`` and gets a key prefix of its own, so tests share the servers
without flushing them. Time-dependent tests move the memory index's injected
clock, and poll the Redis backends with a bounded wait: nothing asserts how
long anything took.

Backend-specific checks (round trips, script cache, unreachable servers,
bytes per entry) follow the contract suite.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pytest

from kvstore.block import TierName
from kvstore.errors import InvalidArgument
from kvstore.index.base import MAX_CHAIN_BLOCKS, Holder, IndexUnavailable, NodeInfo, NodeMatch, PrefixIndex, StaleEpoch
from kvstore.index.memory import MemoryIndex
from tests.support.index_rows import stored_rows, sweep_all

GPU, HOST, DISK, PEER, OBJECT = TierName.GPU, TierName.HOST, TierName.DISK, TierName.PEER, TierName.OBJECT
NS = "model-a"
LONG_TTL = 120.0
WAIT_LIMIT_S = 30.0  # bound on polling for an expiry (simulated seconds for the memory index)
REDIS = [pytest.param(name, marks=pytest.mark.system) for name in ("redis", "redis-cluster")]  # real redis-servers


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Backend:
    name: str
    make: Callable[[], PrefixIndex]
    advance: Callable[[float], Awaitable[None]]  # let time pass (real sleep, or move the fake clock)
    url: str = ""


def _prefix(request) -> str:
    return "t" + hashlib.blake2b(request.node.nodeid.encode(), digest_size=8).hexdigest()


@pytest.fixture(params=["memory", *REDIS])
def backend(request) -> Backend:
    if request.param == "memory":
        clock = FakeClock()

        async def advance(seconds: float) -> None:
            clock.now += seconds

        return Backend("memory", lambda: MemoryIndex(clock=clock), advance)
    from kvstore.index.redis import RedisIndex

    url = request.getfixturevalue("redis_url" if request.param == "redis" else "redis_cluster_url")
    prefix = _prefix(request)
    return Backend(request.param, lambda: RedisIndex.from_url(url, prefix=prefix), asyncio.sleep)


def run(backend: Backend, body: Callable[[PrefixIndex], Awaitable[None]]) -> None:
    async def main() -> None:
        ix = backend.make()
        try:
            await body(ix)
        finally:
            await ix.close()

    asyncio.run(main())


def chain(n: int, tag: str = "c") -> list[bytes]:
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=32).digest() for i in range(n)]


def held(keys: list[bytes], tier: TierName = HOST) -> list[tuple[bytes, TierName]]:
    return [(k, tier) for k in keys]


def as_dict(matches: list[NodeMatch]) -> dict[str, tuple[int, TierName]]:
    return {m.node_id: (m.blocks, m.tier) for m in matches}


async def join_all(ix: PrefixIndex, *nodes: str, epoch: int = 1) -> None:
    for n in nodes:
        await ix.join(n, epoch, LONG_TTL)


async def wait_until(backend: Backend, predicate: Callable[[], Awaitable[bool]], what: str) -> None:
    waited = 0.0
    while not await predicate():
        if waited > WAIT_LIMIT_S:
            pytest.fail(f"{backend.name}: gave up waiting for {what}")
        await backend.advance(0.05)
        waited += 0.05


# ---- lookups --------------------------------------------------------------------


def test_lookup_counts_leading_blocks_longest_first(backend):
    keys = chain(8)

    async def body(ix):
        await join_all(ix, "a", "b", "c")
        await ix.add(NS, "b", 1, held(keys[:3]))
        await ix.add(NS, "a", 1, held(keys[:5]))
        await ix.add(NS, "c", 1, held(keys[1:6]))  # no first block: no prefix
        got = await ix.lookup(NS, keys)
        assert got == [NodeMatch("a", 5, HOST), NodeMatch("b", 3, HOST)]
        assert await ix.lookup(NS, keys[:2]) == [NodeMatch("a", 2, HOST), NodeMatch("b", 2, HOST)]

    run(backend, body)


def test_lookup_stops_at_first_miss(backend):
    keys = chain(6)

    async def body(ix):
        await join_all(ix, "a")
        await ix.add(NS, "a", 1, held([keys[0], keys[1], keys[3], keys[4]]))
        assert await ix.lookup(NS, keys) == [NodeMatch("a", 2, HOST)]
        assert await ix.lookup(NS, keys[2:]) == []
        assert await ix.lookup(NS, chain(3, "nobody")) == []

    run(backend, body)


def test_tier_is_the_slowest_of_the_leading_blocks(backend):
    k = chain(6)

    async def body(ix):
        await join_all(ix, "a", "b")
        await ix.add(NS, "a", 1, [(k[0], GPU), (k[1], DISK), (k[2], HOST), (k[4], OBJECT)])  # k[3] missing
        await ix.add(NS, "b", 1, [(k[0], GPU), (k[1], GPU)])
        assert await ix.lookup(NS, k) == [NodeMatch("a", 3, DISK), NodeMatch("b", 2, GPU)]
        assert await ix.lookup(NS, k[:1]) == [NodeMatch("a", 1, GPU), NodeMatch("b", 1, GPU)]

    run(backend, body)


def test_readd_updates_the_tier(backend):
    k = chain(2)

    async def body(ix):
        await join_all(ix, "a")
        await ix.add(NS, "a", 1, held(k, HOST))
        await ix.add(NS, "a", 1, [(k[1], OBJECT)])
        assert await ix.lookup(NS, k) == [NodeMatch("a", 2, OBJECT)]
        await ix.add(NS, "a", 1, [(k[1], GPU)])
        assert await ix.lookup(NS, k) == [NodeMatch("a", 2, HOST)]
        assert await ix.holders(NS, k) == [[Holder("a", HOST, 1)], [Holder("a", GPU, 1)]]

    run(backend, body)


def test_candidates_filter_the_answer(backend):
    k = chain(4)

    async def body(ix):
        await join_all(ix, "a", "b", "c")
        for n in ("a", "b", "c"):
            await ix.add(NS, n, 1, held(k))
        assert as_dict(await ix.lookup(NS, k, candidates=["b", "not-a-node"])) == {"b": (4, HOST)}
        assert await ix.lookup(NS, k, candidates=[]) == []
        assert len(await ix.lookup(NS, k, candidates=None)) == 3

    run(backend, body)


def test_candidate_that_misses_early_does_not_stop_the_others(backend):
    k = chain(5)

    async def body(ix):
        await join_all(ix, "a", "b")
        await ix.add(NS, "a", 1, held(k[:1]))
        await ix.add(NS, "b", 1, held(k))
        assert await ix.lookup(NS, k) == [NodeMatch("b", 5, HOST), NodeMatch("a", 1, HOST)]

    run(backend, body)


def test_a_full_chain_of_max_blocks(backend):
    k = chain(MAX_CHAIN_BLOCKS, "long")

    async def body(ix):
        await join_all(ix, "a", "b")
        await ix.add(NS, "a", 1, held(k))
        await ix.add(NS, "b", 1, held(k[: MAX_CHAIN_BLOCKS // 2], DISK))
        assert await ix.lookup(NS, k) == [NodeMatch("a", MAX_CHAIN_BLOCKS, HOST), NodeMatch("b", 2048, DISK)]

    run(backend, body)


# ---- holders, remove, clear, leave ------------------------------------------------


def test_keys_of_mixed_lengths_in_one_call(backend):
    """A chain may mix key lengths (the 8-byte event form beside 32-byte hashes, client keys up
    to the limit); every call takes such a chain in one batch."""
    keys = [b"k", b"e" * 8, b"h" * 32, b"x" * 60, b"y" * 61, b"z" * 1024]

    async def body(ix):
        await join_all(ix, "a", "b")
        await ix.add(NS, "a", 1, held(keys))
        await ix.add(NS, "b", 1, [(k, DISK) for k in keys[:3]])
        assert await ix.lookup(NS, keys) == [NodeMatch("a", 6, HOST), NodeMatch("b", 3, DISK)]
        assert [[h.node_id for h in hs] for hs in await ix.holders(NS, keys)] == [["a", "b"]] * 3 + [["a"]] * 3
        await ix.remove(NS, "a", 1, [keys[1], keys[4]])
        assert await ix.lookup(NS, keys) == [NodeMatch("b", 3, DISK), NodeMatch("a", 1, HOST)]
        assert [len(hs) for hs in await ix.holders(NS, keys)] == [2, 1, 2, 1, 0, 1]

    run(backend, body)


def test_holders_per_key(backend):
    k = chain(3)

    async def body(ix):
        await ix.join("b", 7, LONG_TTL)
        await ix.join("a", 3, LONG_TTL)
        await ix.add(NS, "b", 7, [(k[0], DISK), (k[2], GPU)])
        await ix.add(NS, "a", 3, [(k[0], HOST)])
        assert await ix.holders(NS, k) == [
            [Holder("a", HOST, 3), Holder("b", DISK, 7)],
            [],
            [Holder("b", GPU, 7)],
        ]
        assert await ix.holders(NS, [k[2], k[2]]) == [[Holder("b", GPU, 7)]] * 2
        assert await ix.holders(NS, []) == []

    run(backend, body)


def test_remove(backend):
    k = chain(4)

    async def body(ix):
        await join_all(ix, "a", "b")
        await ix.add(NS, "a", 1, held(k))
        await ix.add(NS, "b", 1, held(k))
        await ix.remove(NS, "a", 1, [k[1], chain(1, "never-added")[0]])
        assert await ix.lookup(NS, k) == [NodeMatch("b", 4, HOST), NodeMatch("a", 1, HOST)]
        assert await ix.holders(NS, k[1:2]) == [[Holder("b", HOST, 1)]]
        await ix.remove(NS, "b", 1, k)
        assert await ix.holders(NS, k) == [[Holder("a", HOST, 1)], [], [Holder("a", HOST, 1)], [Holder("a", HOST, 1)]]
        await ix.remove(NS, "a", 1, [])
        assert await ix.sweep(1000) == 0  # removals leave nothing to sweep

    run(backend, body)


def test_clear_one_namespace_then_all(backend):
    k = chain(3)

    async def body(ix):
        await join_all(ix, "a", "b")
        for ns in ("ns-1", "ns-2", "ns-3"):
            await ix.add(ns, "a", 1, held(k))
            await ix.add(ns, "b", 1, held(k))
        await ix.clear("a", "ns-1")
        assert as_dict(await ix.lookup("ns-1", k)) == {"b": (3, HOST)}
        assert as_dict(await ix.lookup("ns-2", k)) == {"a": (3, HOST), "b": (3, HOST)}
        await ix.clear("a")
        for ns in ("ns-1", "ns-2", "ns-3"):
            assert as_dict(await ix.lookup(ns, k)) == {"b": (3, HOST)}
        assert await ix.sweep(1000) == 0  # clear deleted the rows itself
        await ix.add("ns-2", "a", 1, held(k[:2]))  # a cleared node keeps writing
        assert as_dict(await ix.lookup("ns-2", k)) == {"a": (2, HOST), "b": (3, HOST)}
        await ix.clear("not-a-node")
        await ix.clear("b", "never-used")

    run(backend, body)


def test_leave(backend):
    k = chain(3)

    async def body(ix):
        await join_all(ix, "a", "b")
        await ix.add(NS, "a", 1, held(k))
        await ix.add("other", "a", 1, held(k))
        await ix.add(NS, "b", 1, held(k[:1]))
        await ix.leave("a")
        assert await ix.lookup(NS, k) == [NodeMatch("b", 1, HOST)]
        assert await ix.lookup("other", k) == []
        assert [n.node_id for n in await ix.nodes()] == ["b"]
        with pytest.raises(StaleEpoch, match="join"):
            await ix.add(NS, "a", 1, held(k))
        with pytest.raises(StaleEpoch):
            await ix.heartbeat("a", 1, LONG_TTL)
        assert await ix.sweep(1000) == 0  # leave deleted the rows itself
        await ix.leave("a")  # twice is fine
        await ix.join("a", 1, LONG_TTL)  # and it may come back
        assert await ix.lookup(NS, k) == [NodeMatch("b", 1, HOST)]
        await ix.add(NS, "a", 1, held(k[:2]))
        assert as_dict(await ix.lookup(NS, k)) == {"a": (2, HOST), "b": (1, HOST)}

    run(backend, body)


# ---- membership: heartbeats, epochs ----------------------------------------------


def test_nodes_and_idempotent_join(backend):
    k = chain(2)

    async def body(ix):
        await ix.join("b", 7, LONG_TTL)
        await ix.join("a", 3, LONG_TTL)
        await ix.add(NS, "a", 3, held(k))
        await ix.join("a", 3, LONG_TTL)  # the same epoch while alive: a refresh, entries stay
        assert await ix.lookup(NS, k) == [NodeMatch("a", 2, HOST)]
        assert await ix.nodes() == [NodeInfo("a", 3, True), NodeInfo("b", 7, True)]
        big = (1 << 63) - 1
        await ix.join("c", big, LONG_TTL)
        await ix.add(NS, "c", big, held(k[:1]))
        assert await ix.holders(NS, k[:1]) == [[Holder("a", HOST, 3), Holder("c", HOST, big)]]
        with pytest.raises(StaleEpoch):
            await ix.add(NS, "c", big - 1, held(k))

    run(backend, body)


def test_node_records_carry_addresses(backend):
    """What a peer needs to reach a node: its advertised address and transports, replaced at every join."""
    grpc_a, tcp_a = "grpc://10.0.0.2:50051", "tcp://10.0.0.2:50061"

    async def body(ix):
        await ix.join("a", 3, LONG_TTL, address="10.0.0.2:50051", transports=[grpc_a, tcp_a])
        await ix.join("b", 1, LONG_TTL)  # advertises nothing
        await ix.join("v6", 1, LONG_TTL, address="[fd00::7]:50051", transports=["grpc://[fd00::7]:50051"])
        nodes = {n.node_id: n for n in await ix.nodes()}
        assert nodes["a"] == NodeInfo("a", 3, True, "10.0.0.2:50051", (grpc_a, tcp_a))
        assert nodes["a"].host == "10.0.0.2" and nodes["a"].endpoint("tcp") == "10.0.0.2:50061"
        assert nodes["a"].endpoint("ucx") is None
        assert nodes["b"] == NodeInfo("b", 1, True)
        assert nodes["v6"].host == "fd00::7"
        await ix.join("a", 3, LONG_TTL, address="10.0.0.9:50051", transports=["grpc://10.0.0.9:50051"])  # refresh
        await ix.join("b", 2, LONG_TTL, address="10.0.0.3:7000")  # restart at a new epoch
        nodes = {n.node_id: n for n in await ix.nodes()}
        assert nodes["a"] == NodeInfo("a", 3, True, "10.0.0.9:50051", ("grpc://10.0.0.9:50051",))
        assert nodes["b"] == NodeInfo("b", 2, True, "10.0.0.3:7000", ())
        with pytest.raises(StaleEpoch):  # an older process may not overwrite the new one's record
            await ix.join("b", 1, LONG_TTL, address="10.0.0.66:1")
        await ix.leave("a")
        await ix.join("a", 4, LONG_TTL)  # back, advertising nothing: the old record is gone
        nodes = {n.node_id: n for n in await ix.nodes()}
        assert nodes["a"] == NodeInfo("a", 4, True) and nodes["b"].address == "10.0.0.3:7000"

    run(backend, body)


def test_heartbeats_carry_served_bytes(backend):
    """A heartbeat may carry the node's served-bytes counters (by transport): they replace what its
    record reports; a heartbeat without them leaves them; a new incarnation and a leave drop them."""

    async def body(ix):
        await ix.join("a", 3, LONG_TTL, address="10.0.0.2:50051")
        await ix.join("b", 1, LONG_TTL)
        assert {n.node_id: n.served for n in await ix.nodes()} == {"a": (), "b": ()}
        await ix.heartbeat("a", 3, LONG_TTL, served={"tcp": 7 << 30, "grpc": 0, "ucx": (1 << 63) - 1})
        await ix.heartbeat("b", 1, LONG_TTL)  # an older daemon's heartbeat: no counters
        nodes = {n.node_id: n for n in await ix.nodes()}
        assert nodes["a"] == NodeInfo("a", 3, True, "10.0.0.2:50051", (),
                                      (("grpc", 0), ("tcp", 7 << 30), ("ucx", (1 << 63) - 1)))
        assert nodes["a"].served_bytes == {"grpc": 0, "tcp": 7 << 30, "ucx": (1 << 63) - 1}
        assert nodes["b"] == NodeInfo("b", 1, True)
        await ix.heartbeat("a", 3, LONG_TTL)  # no counters this time: the last ones stay
        await ix.join("a", 3, LONG_TTL, address="10.0.0.2:50051")  # a refresh of the same incarnation
        assert (await ix.nodes())[0].served_bytes == {"grpc": 0, "tcp": 7 << 30, "ucx": (1 << 63) - 1}
        await ix.heartbeat("a", 3, LONG_TTL, served={"tcp": 8 << 30})
        assert (await ix.nodes())[0].served == (("tcp", 8 << 30),)
        with pytest.raises(StaleEpoch):  # an older process may not overwrite the new one's counters
            await ix.heartbeat("a", 2, LONG_TTL, served={"tcp": 1})
        await ix.join("a", 4, LONG_TTL)  # restarted: its new epoch has served nothing yet
        assert (await ix.nodes())[0] == NodeInfo("a", 4, True)
        await ix.heartbeat("b", 1, LONG_TTL, served={"grpc": 5})
        await ix.leave("b")
        await ix.join("b", 1, LONG_TTL)
        assert {n.node_id: n.served for n in await ix.nodes()} == {"a": (), "b": ()}

    run(backend, body)


def test_heartbeat_expiry(backend):
    k = chain(4)

    async def body(ix):
        await join_all(ix, "a", "b")
        await ix.add(NS, "a", 1, held(k))
        await ix.add("other", "a", 1, held(k[:2]))
        await ix.add(NS, "b", 1, held(k[:2]))
        assert as_dict(await ix.lookup(NS, k)) == {"a": (4, HOST), "b": (2, HOST)}
        await ix.heartbeat("a", 1, 0.3)  # shorten a's lease, then stop beating

        async def a_gone() -> bool:
            return "a" not in as_dict(await ix.lookup(NS, k))

        await wait_until(backend, a_gone, "node a to expire")
        assert as_dict(await ix.lookup(NS, k)) == {"b": (2, HOST)}
        assert await ix.holders(NS, k[:1]) == [[Holder("b", HOST, 1)]]

        async def a_dead() -> bool:
            return NodeInfo("a", 1, False) in await ix.nodes()

        await wait_until(backend, a_dead, "nodes() to report a dead")
        with pytest.raises(StaleEpoch, match="expired"):
            await ix.heartbeat("a", 1, LONG_TTL)
        with pytest.raises(StaleEpoch):
            await ix.add(NS, "a", 1, held(k))
        # joining again starts over: the old rows never come back, the sweep deletes them
        await ix.join("a", 1, LONG_TTL)
        assert as_dict(await ix.lookup(NS, k)) == {"b": (2, HOST)}
        assert sum(await sweep_all(ix, 1000)) == 6
        await ix.add(NS, "a", 1, held(k[:1]))
        assert as_dict(await ix.lookup(NS, k)) == {"a": (1, HOST), "b": (2, HOST)}

    run(backend, body)


def test_expired_rows_are_swept_without_a_rejoin(backend):
    k = chain(5)

    async def body(ix):
        await join_all(ix, "a", "b")
        await ix.add(NS, "a", 1, held(k))
        await ix.add(NS, "b", 1, held(k))
        await ix.heartbeat("a", 1, 0.3)

        async def a_dead() -> bool:
            return NodeInfo("a", 1, False) in await ix.nodes()

        await wait_until(backend, a_dead, "node a to expire")
        assert sum(await sweep_all(ix, 2)) == 5
        assert await ix.lookup(NS, k) == [NodeMatch("b", 5, HOST)]

    run(backend, body)


def test_epoch_restart(backend):
    k = chain(10)

    async def body(ix):
        await ix.join("a", 5, LONG_TTL)
        await ix.join("b", 1, LONG_TTL)
        await ix.add(NS, "a", 5, held(k))
        await ix.add(NS, "b", 1, held(k[:3]))
        await ix.join("a", 6, LONG_TTL)  # restarted: its old entries stop counting now
        assert await ix.lookup(NS, k) == [NodeMatch("b", 3, HOST)]
        assert await ix.holders(NS, k[:1]) == [[Holder("b", HOST, 1)]]
        for write in (
            ix.add(NS, "a", 5, held(k[:1])),
            ix.remove(NS, "a", 5, k[:1]),
            ix.heartbeat("a", 5, LONG_TTL),
            ix.join("a", 4, LONG_TTL),
        ):
            with pytest.raises(StaleEpoch, match="older"):
                await write
        with pytest.raises(StaleEpoch, match="join"):
            await ix.add(NS, "a", 7, held(k[:1]))  # newer than joined
        assert NodeInfo("a", 6, True) in await ix.nodes()
        await ix.add(NS, "a", 6, held(k[:4], DISK))
        assert await ix.lookup(NS, k) == [NodeMatch("a", 4, DISK), NodeMatch("b", 3, HOST)]
        assert await ix.holders(NS, k[:1]) == [[Holder("a", DISK, 6), Holder("b", HOST, 1)]]
        assert sum(await sweep_all(ix, 3)) == 10  # the rows of epoch 5 were still there
        assert await ix.lookup(NS, k) == [NodeMatch("a", 4, DISK), NodeMatch("b", 3, HOST)]

    run(backend, body)


def test_sweep_is_bounded(backend):
    k = chain(40)

    async def body(ix):
        await join_all(ix, "a", "b")
        await ix.add("ns-1", "a", 1, held(k[:25]))
        await ix.add("ns-2", "a", 1, held(k[:10]))
        await ix.add("ns-1", "b", 1, held(k))
        await ix.join("a", 2, LONG_TTL)
        counts = await sweep_all(ix, 7)
        assert sum(counts) == 35
        assert len(counts) >= 5  # 35 rows, at most 7 a call
        assert await ix.lookup("ns-1", k) == [NodeMatch("b", 40, HOST)]
        assert await ix.sweep(1) == 0

    run(backend, body)


def test_namespaces_are_isolated(backend):
    k = chain(4)

    async def body(ix):
        await join_all(ix, "a", "b")
        await ix.add("ns-a", "a", 1, held(k))
        await ix.add("ns-b", "b", 1, held(k[:2], DISK))
        assert await ix.lookup("ns-a", k) == [NodeMatch("a", 4, HOST)]
        assert await ix.lookup("ns-b", k) == [NodeMatch("b", 2, DISK)]
        assert await ix.lookup("ns-c", k) == []
        assert await ix.holders("ns-b", k[2:]) == [[], []]
        await ix.remove("ns-b", "a", 1, k)  # a holds nothing in ns-b: no effect on ns-a
        assert await ix.lookup("ns-a", k) == [NodeMatch("a", 4, HOST)]

    run(backend, body)


def test_writes_need_membership(backend):
    async def body(ix):
        with pytest.raises(StaleEpoch, match="join"):
            await ix.add(NS, "ghost", 1, held(chain(1)))
        with pytest.raises(StaleEpoch, match="join"):
            await ix.heartbeat("ghost", 1, LONG_TTL)
        await ix.leave("ghost")
        assert await ix.nodes() == []

    run(backend, body)


def expected_lookup(model: dict[bytes, dict[str, TierName]], keys: list[bytes]) -> list[NodeMatch]:
    out = []
    for node in {n for holders in model.values() for n in holders}:
        n = 0
        while n < len(keys) and node in model.get(keys[n], {}):
            n += 1
        if n:
            out.append(NodeMatch(node, n, max(model[k][node] for k in keys[:n])))
    return sorted(out, key=lambda m: (-m.blocks, m.node_id))


def test_many_blocks_and_holders_agree_with_a_model(backend):
    """Random adds, removes, restarts and clears across bucket splits; holders() must match a plain model."""
    rnd = random.Random(7)
    keys = chain(1500, "model")
    nodes = ["n0", "n1", "n2", "n3"]

    async def body(ix):
        epochs = {n: 1 for n in nodes}
        model: dict[bytes, dict[str, TierName]] = {}
        stale = swept = 0  # rows a restart left for the sweep; rows the sweep deleted
        for n in nodes:
            await ix.join(n, 1, LONG_TTL)
        for step in range(40):
            n = rnd.choice(nodes)
            roll = rnd.random()
            if roll < 0.6:
                batch = [(k, rnd.choice(list(TierName))) for k in rnd.sample(keys, rnd.randint(1, 300))]
                await ix.add(NS, n, epochs[n], batch)
                for key, tier in batch:
                    model.setdefault(key, {})[n] = tier
            elif roll < 0.85:
                batch = rnd.sample(keys, rnd.randint(1, 300))
                await ix.remove(NS, n, epochs[n], batch)
                for key in batch:
                    model.get(key, {}).pop(n, None)
            elif roll < 0.95:
                epochs[n] += 1
                await ix.join(n, epochs[n], LONG_TTL)
                for holders in model.values():
                    stale += holders.pop(n, None) is not None
            else:
                await ix.clear(n, NS)
                for holders in model.values():
                    holders.pop(n, None)
            if step % 10 == 9:
                swept += await ix.sweep(rnd.randint(1, 500))
            probe = rnd.sample(keys, 200)
            got = await ix.holders(NS, probe)
            want = [[Holder(h, t, epochs[h]) for h, t in sorted(model.get(key, {}).items())] for key in probe]
            assert got == want, f"step {step}"
            mine = sorted(key for key, holders in model.items() if n in holders)[:60]  # a chain n holds...
            mine.insert(rnd.randint(0, len(mine)), rnd.choice(keys))  # ...up to a random key
            assert await ix.lookup(NS, mine) == expected_lookup(model, mine), f"step {step}"
        assert swept + sum(await sweep_all(ix, 300)) == stale
        await ix.join("n0", epochs["n0"] + 1, LONG_TTL)  # stale rows again, swept by the bounded sweep
        await ix.leave("n1")  # rows deleted by leave
        await ix.clear("n2")  # rows deleted by clear
        await ix.remove(NS, "n3", epochs["n3"], keys)  # rows deleted one by one
        assert sum(await sweep_all(ix, 300)) == sum("n0" in holders for holders in model.values())
        assert await stored_rows(ix, NS) == []

    run(backend, body)


def test_shared_prefixes_agree_with_a_model(backend):
    """Prefixes many nodes share, tiers changing part-way, holders stopping at different depths,
    holes, a restarted node's leftover rows and candidate filters: the runs of blocks with equal
    holders that a lookup passes over without decoding, and every place such a run ends."""
    rnd = random.Random(11)
    nodes = [f"s{i:02d}" for i in range(20)]  # more than 16 holders: some buckets outgrow listpack
    prefixes = [chain(48, f"shared-{p}") for p in range(3)]

    async def body(ix):
        model: dict[bytes, dict[str, TierName]] = {}
        for n in nodes:
            await ix.join(n, 1, LONG_TTL)
        for n in nodes:
            for prefix in rnd.sample(prefixes, rnd.randint(1, 3)):
                depth = rnd.randint(1, len(prefix))
                slower = sorted(rnd.sample(range(depth + 1), 2))  # GPU, then HOST, then DISK
                blocks = [(k, GPU if i < slower[0] else HOST if i < slower[1] else DISK)
                          for i, k in enumerate(prefix[:depth])]
                for i in rnd.sample(range(depth), depth // 8):  # a few blocks faster than the ones before
                    blocks[i] = (blocks[i][0], GPU)
                if rnd.random() < 0.3:  # a hole part-way
                    del blocks[rnd.randrange(len(blocks))]
                rnd.shuffle(blocks)  # adds arrive in any order; equal holders must still encode equally
                for i in range(0, len(blocks), 7):
                    await ix.add(NS, n, 1, blocks[i : i + 7])
                for key, tier in blocks:
                    model.setdefault(key, {})[n] = tier
        await ix.join("s03", 2, LONG_TTL)  # restarted: its rows stay in the values until swept
        for holders in model.values():
            holders.pop("s03", None)
        for _ in range(40):
            prefix = rnd.choice(prefixes)
            keys = prefix[: rnd.randint(1, len(prefix))] + [rnd.randbytes(8)] * rnd.randint(0, 1)
            assert await ix.lookup(NS, keys) == expected_lookup(model, keys)
            wanted = rnd.sample(nodes, rnd.randint(1, 6))
            sub = {k: {n: t for n, t in h.items() if n in wanted} for k, h in model.items()}
            assert await ix.lookup(NS, keys, candidates=wanted) == expected_lookup(sub, keys)

    run(backend, body)


# ---- bad input ----------------------------------------------------------------------

BAD_CALLS: dict[str, Callable[[PrefixIndex], Awaitable]] = {
    "empty chain": lambda ix: ix.lookup(NS, []),
    "empty key": lambda ix: ix.lookup(NS, [b"k", b""]),
    "str key": lambda ix: ix.lookup(NS, ["k"]),
    "one key, not a list": lambda ix: ix.lookup(NS, b"key"),
    "chain too long": lambda ix: ix.lookup(NS, chain(MAX_CHAIN_BLOCKS + 1)),
    "empty namespace": lambda ix: ix.lookup("", [b"k"]),
    "bad namespace": lambda ix: ix.lookup("no spaces", [b"k"]),
    "candidate not a list": lambda ix: ix.lookup(NS, [b"k"], candidates="a"),
    "holders empty key": lambda ix: ix.holders(NS, [b""]),
    "holders too many": lambda ix: ix.holders(NS, chain(MAX_CHAIN_BLOCKS + 1)),
    "add empty key": lambda ix: ix.add(NS, "a", 1, [(b"", HOST)]),
    "add too many": lambda ix: ix.add(NS, "a", 1, held(chain(MAX_CHAIN_BLOCKS + 1))),
    "add bad tier": lambda ix: ix.add(NS, "a", 1, [(b"k", 9)]),
    "remove oversized key": lambda ix: ix.remove(NS, "a", 1, [b"x" * 5000]),
    "empty node id": lambda ix: ix.join("", 1, 10),
    "negative epoch": lambda ix: ix.join("a", -1, 10),
    "epoch too big": lambda ix: ix.heartbeat("a", 1 << 63, 10),
    "bool epoch": lambda ix: ix.join("a", True, 10),
    "zero ttl": lambda ix: ix.join("a", 1, 0),
    "nan ttl": lambda ix: ix.heartbeat("a", 1, float("nan")),
    "sweep zero": lambda ix: ix.sweep(0),
    "clear bad namespace": lambda ix: ix.clear("a", "bad namespace"),
    "address with a space": lambda ix: ix.join("a", 1, 10, address="10.0.0.1 :5"),
    "address without a port": lambda ix: ix.join("a", 1, 10, address="10.0.0.1"),
    "address too long": lambda ix: ix.join("a", 1, 10, address="h" * 300 + ":1"),
    "transport without scheme": lambda ix: ix.join("a", 1, 10, transports=["10.0.0.1:5"]),
    "transports as one string": lambda ix: ix.join("a", 1, 10, transports="grpc://h:1"),
    "too many transports": lambda ix: ix.join("a", 1, 10, transports=[f"tcp://h:{i}" for i in range(17)]),
    "served not a mapping": lambda ix: ix.heartbeat("a", 1, 10, served=[("tcp", 1)]),
    "served negative": lambda ix: ix.heartbeat("a", 1, 10, served={"tcp": -1}),
    "served too big": lambda ix: ix.heartbeat("a", 1, 10, served={"tcp": 1 << 63}),
    "served bool": lambda ix: ix.heartbeat("a", 1, 10, served={"tcp": True}),
    "served bad scheme": lambda ix: ix.heartbeat("a", 1, 10, served={"TCP ": 1}),
    "served too many": lambda ix: ix.heartbeat("a", 1, 10, served={f"t{i}": 1 for i in range(17)}),
}


@pytest.mark.parametrize("call", list(BAD_CALLS), ids=list(BAD_CALLS))
def test_bad_input_is_invalid_argument(backend, call):
    async def body(ix):
        with pytest.raises(InvalidArgument) as info:
            await BAD_CALLS[call](ix)
        assert str(info.value)  # says what is wrong

    run(backend, body)


# ---- Redis only ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
def test_unreachable_redis_is_index_unavailable(scheme):
    from kvstore.index.redis import RedisIndex

    url = f"{scheme}://127.0.0.1:{_free_port()}/0" if scheme == "redis" else f"{scheme}://127.0.0.1:{_free_port()}"

    async def body():
        ix = RedisIndex.from_url(url, connect_timeout_s=1.0, retries=1)
        try:
            for call in (ix.join("a", 1, 10), ix.lookup(NS, [b"k"]), ix.sweep(10), ix.nodes()):
                with pytest.raises(IndexUnavailable) as info:
                    await call
                assert url in str(info.value) and "index_url" in str(info.value)
        finally:
            await ix.close()

    asyncio.run(body())


def test_a_server_that_stops_answering_is_index_unavailable():
    """Reads have a deadline even where they skip redis-py's socket timeout (the read lane)."""
    from kvstore.index.redis import RedisIndex

    async def body():
        accepted = []

        async def silent(reader, writer):  # accepts, reads, never answers
            accepted.append(writer)
            await reader.read(1 << 16)

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        ix = RedisIndex.from_url(f"redis://127.0.0.1:{port}/0", timeout_s=0.2, retries=0)
        try:
            for call in (ix.lookup(NS, [b"k"]), ix.holders(NS, [b"k"])):
                with pytest.raises(IndexUnavailable):
                    await asyncio.wait_for(call, WAIT_LIMIT_S)  # a hang fails the test instead of stalling it
        finally:
            await ix.close()
            for w in accepted:
                w.close()
            server.close()
            await server.wait_closed()

    asyncio.run(body())


def test_reads_survive_killed_connections(redis_url, request):
    """A read whose connection the server closed (restart, CLIENT KILL, a proxy's idle cut)
    reconnects and answers instead of failing."""
    import redis as sync_redis

    from kvstore.index.redis import RedisIndex

    k = chain(4)

    async def body():
        ix = RedisIndex.from_url(redis_url, prefix=_prefix(request))
        try:
            await join_all(ix, "a")
            await ix.add(NS, "a", 1, held(k))
            for _ in range(3):
                assert await ix.lookup(NS, k) == [NodeMatch("a", 4, HOST)]
                assert [len(h) for h in await ix.holders(NS, k)] == [1, 1, 1, 1]
                with sync_redis.Redis.from_url(redis_url) as r:  # this index's connections: their last command was a script
                    ours = [c["id"] for c in r.client_list() if c["cmd"] == "evalsha"]
                    assert ours
                    for client_id in ours:
                        r.client_kill_filter(_id=client_id)
        finally:
            await ix.close()

    asyncio.run(body())


def test_from_url_rejects_other_schemes():
    from kvstore.index.redis import RedisIndex

    with pytest.raises(InvalidArgument, match="redis://"):
        RedisIndex.from_url("http://127.0.0.1:6379")


@pytest.fixture(params=REDIS)
def redis_backend(request) -> Backend:
    from kvstore.index.redis import RedisIndex

    url = request.getfixturevalue("redis_url" if request.param == "redis" else "redis_cluster_url")
    prefix = _prefix(request)
    return Backend(request.param, lambda: RedisIndex.from_url(url, prefix=prefix), asyncio.sleep, url)


def test_lookup_and_holders_are_one_round_trip(redis_backend, monkeypatch):
    from redis.asyncio.connection import Connection

    k = chain(64)

    async def body(ix):
        await join_all(ix, "a", "b")
        await ix.add(NS, "a", 1, held(k))
        await ix.add(NS, "b", 1, held(k[:10]))
        await ix.lookup(NS, k)
        await ix.holders(NS, k)  # scripts are cached now
        sent = []
        original = Connection.send_packed_command

        async def counting(self, command, check_health=True):  # every connection, pooled or not
            packed = b"".join(command) if isinstance(command, list) else command
            sent.append(packed.split(b"\r\n", 3)[2].decode())  # *N, $len, then the command's name
            return await original(self, command, check_health)

        monkeypatch.setattr(Connection, "send_packed_command", counting)
        assert await ix.lookup(NS, k, candidates=["a", "b"]) == [NodeMatch("a", 64, HOST), NodeMatch("b", 10, HOST)]
        assert len(await ix.holders(NS, k)) == 64
        assert sent == ["EVALSHA", "EVALSHA"]

    run(redis_backend, body)


def test_script_cache_flush_is_survived(redis_backend):
    import redis as sync_redis
    from redis.cluster import RedisCluster

    url = redis_backend.url
    k = chain(3)

    def flush_scripts() -> None:
        if url.startswith("redis+cluster://"):
            rc = RedisCluster.from_url(url.replace("redis+cluster://", "redis://"))
            try:
                for node in rc.get_primaries():
                    rc.get_redis_connection(node).script_flush()
            finally:
                rc.close()
        else:
            with sync_redis.Redis.from_url(url) as r:
                r.script_flush()

    async def body(ix):
        await join_all(ix, "a")
        await ix.add(NS, "a", 1, held(k))
        await asyncio.to_thread(flush_scripts)
        assert await ix.lookup(NS, k) == [NodeMatch("a", 3, HOST)]  # NOSCRIPT, then EVAL
        await asyncio.to_thread(flush_scripts)
        await ix.heartbeat("a", 1, LONG_TTL)
        await ix.add(NS, "a", 1, held(chain(2, "more")))

    run(redis_backend, body)


def test_bytes_per_entry(redis_url, request):
    """Redis memory per (block, holder) entry: 20k 32-byte keys, one holder each."""
    import redis as sync_redis

    from kvstore.index.redis import RedisIndex

    blocks = 20_000
    rnd = random.Random(12)
    keys = [rnd.randbytes(32) for _ in range(blocks)]
    prefix = _prefix(request)

    async def fill() -> None:
        ix = RedisIndex.from_url(redis_url, prefix=prefix)
        try:
            for i in range(0, blocks, 2000):
                await ix.add("mem", "node-0", 1, held(keys[i : i + 2000]))
        finally:
            await ix.close()

    async def setup() -> None:
        ix = RedisIndex.from_url(redis_url, prefix=prefix)
        try:
            await ix.join("node-0", 1, LONG_TTL)
            await ix.add("mem", "node-0", 1, held([b"warm-up"]))  # namespace, mirror, scripts in place
            await ix.remove("mem", "node-0", 1, [b"warm-up"])
        finally:
            await ix.close()

    with sync_redis.Redis.from_url(redis_url) as r:
        asyncio.run(setup())
        before = r.info("memory")["used_memory"]
        asyncio.run(fill())
        after = r.info("memory")["used_memory"]
    per_entry = (after - before) / blocks
    request.node.user_properties.append(("redis_bytes_per_entry", per_entry))
    print(f"\nredis bytes per (block, holder) entry: {per_entry:.1f}")
    assert per_entry <= 100, f"{per_entry:.1f} bytes per entry"
