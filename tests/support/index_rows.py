"""White-box looks at a prefix index backend, for the contract and churn suites: the rows a backend
still stores for a namespace (leaks the API cannot see), and sweeping until nothing is left."""

from __future__ import annotations

import pytest

from kvstore.index.base import PrefixIndex
from kvstore.index.memory import MemoryIndex


async def stored_rows(ix: PrefixIndex, namespace: str) -> list:
    """What the backend still stores for a namespace's rows (white box: finds leaks the API cannot see)."""
    if isinstance(ix, MemoryIndex):
        return [(k, h) for k, holders in ix._rows.get(namespace, {}).items() for h in holders]
    meta = ix._ns_key(namespace, "meta")
    keys = await ix._redis.eval("return redis.call('KEYS', ARGV[1])", 1, meta, meta[: -len("meta")] + "*")
    return sorted(k for k in keys if not k.endswith((b":meta", b":m", b":i")))


async def sweep_all(ix: PrefixIndex, max_entries: int) -> list[int]:
    """Sweep until a call deletes nothing; every call must respect its bound."""
    counts = []
    for _ in range(10_000):
        n = await ix.sweep(max_entries)
        assert 0 <= n <= max_entries
        if n == 0:
            return counts
        counts.append(n)
    pytest.fail("sweep never reached 0")
