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
    """The store's limits. Defaults live in one place, the ``[store]`` config section:
    build with :meth:`from_settings` (tests pass overrides by field name)."""

    max_block_bytes: int
    lease_s: float  # default for reads in place and arena slots
    pin_lease_s: float  # default for Pin and generic leases
    max_lease_s: float
    max_leases: int
    max_batch_blocks: int
    demotion_queue_blocks: int
    demotion_threads: int  # 0: copies down run inline in the writer (deterministic tests)
    high_watermark: float  # start demoting when the head tier is this full ...
    low_watermark: float  # ... until it is this full
    tier_retry_s: float  # after a lower tier fails a write, evict above by dropping for this long
    verify_commits: bool  # verify checksums of blocks written through the arena
    put_wait_s: float  # longest a writer waits for room when no deadline is given
    max_leases_per_owner: int  # leases one owner (a tenant, a connection) may hold at once
    lapsed_slot_hold_s: float  # an expired slot's extent stays unused this long (a stalled writer's)

    @classmethod
    def from_settings(cls, store=None, **overrides) -> StoreLimits:
        """Limits from a ``StoreSettings`` section (defaults when None), with ``overrides`` by field name."""
        from kvstore.config.store import StoreSettings

        return cls(**{**(store or StoreSettings()).limits(), **overrides})
