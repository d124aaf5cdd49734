"""The Redis index's Cluster client under concurrency from its first call (kvstore/index/redis_calls.py)."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.index.redis import RedisIndex


def test_many_first_calls_at_once_on_a_fresh_cluster_client_all_answer(redis_cluster_url):
    """A daemon's first calls may come together (joins, heartbeats, publishes, Score): each of 64 at once
    on a client that has not called yet answers, trial after trial."""

    async def first_calls(prefix: str) -> int:
        index = RedisIndex.from_url(redis_cluster_url, prefix=prefix)
        try:
            await asyncio.gather(*(index.join(f"node-{i}", 1, 30.0) for i in range(64)))
            return sum(n.alive for n in await index.nodes())
        finally:
            await index.close()

    for trial in range(8):
        assert asyncio.run(first_calls(f"first-calls-{trial}")) == 64


def test_calls_through_a_failover_answer_or_say_the_index_is_unavailable(tmp_path):
    """A master SIGKILLed under 64 callers writing to every shard: each call answers or raises the index's
    own error (the daemon retries it), never an error from inside the Redis client; and once the replica
    has taken over every caller's writes go through again."""
    import time

    from kvstore.block import TierName
    from kvstore.errors import PrefixIndexError
    from tests.support import redis_servers

    if not redis_servers.available():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    servers = redis_servers.start_cluster(tmp_path, 3, replicas=1, node_timeout_ms=1000)
    outcomes: dict[str, int] = {}
    after: dict[int, bool] = {}

    async def run() -> None:
        index = RedisIndex.from_url(f"redis+cluster://127.0.0.1:{servers[1].port}")
        await index.join("writer", 1, 60.0)
        killed_at = time.monotonic() + 0.5
        end = killed_at + 8.0

        async def caller(i: int) -> None:
            n = 0
            while time.monotonic() < end:
                n += 1
                try:
                    await index.add(f"ns-{i % 16}", "writer", 1, [(f"k{i}-{n}".encode(), TierName.HOST)])
                    outcomes["ok"] = outcomes.get("ok", 0) + 1
                    after[i] = time.monotonic() > killed_at + 5.0 or after.get(i, False)
                except PrefixIndexError:
                    outcomes["unavailable"] = outcomes.get("unavailable", 0) + 1
                    await asyncio.sleep(0.05)
                except Exception as e:  # noqa: BLE001 - what the test looks for
                    outcomes[type(e).__name__] = outcomes.get(type(e).__name__, 0) + 1
                    await asyncio.sleep(0.05)

        async def kill() -> None:
            await asyncio.sleep(killed_at - time.monotonic())
            servers[0].proc.kill()

        try:
            await asyncio.gather(kill(), *(caller(i) for i in range(64)))
        finally:
            await index.close()

    try:
        asyncio.run(run())
    finally:
        for s in servers:
            s.stop()
    assert set(outcomes) <= {"ok", "unavailable"}, outcomes
    assert outcomes.get("unavailable", 0) > 0  # the kill was felt
    assert all(after.get(i) for i in range(64)), "a caller's writes never went through after the failover"
