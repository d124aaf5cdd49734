"""The store's limits and the policy of each edge of its tier chain."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EdgePolicy:
    """What crosses one edge of the chain: from a tier to the next one down.

    ``demote``: a block evicted above goes down this edge instead of away.
    ``write_through``: every block stored above is also written below at
    once (eviction above is then free; writes cost the lower tier's latency
    in the background, never in the writer's call). ``promote``: a read served
    from below is copied up, so the next read is served from above.
    """

    demote: bool = True
    write_through: bool = False
    promote: bool = True


@dataclass(frozen=True, slots=True)
class StoreLimits:
    max_block_bytes: int = 64 << 20
    lease_s: float = 30.0  # default for reads in place and arena slots
    pin_lease_s: float = 300.0  # default for Pin
    max_lease_s: float = 3600.0
    max_leases: int = 65536
    max_batch_blocks: int = 4096
    demotion_queue_blocks: int = 256
    demotion_threads: int = 1  # 0: demote inline in the writer (deterministic tests)
    high_watermark: float = 0.95  # start demoting when the head tier is this full ...
    low_watermark: float = 0.85  # ... until it is this full
    tier_retry_s: float = 5.0  # after a lower tier fails a write, evict by dropping for this long
    verify_commits: bool = True  # verify checksums of blocks written through the arena
    put_wait_s: float = 5.0  # longest a writer waits for room when no deadline is given
    touch_batch_blocks: int = 4096  # recency written back to a persistent tier per pass
