"""The Redis index's Cluster client under concurrency from its first call (kvstore/index/redis_calls.py)."""

from __future__ import annotations

import asyncio

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
