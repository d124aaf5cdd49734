"""The node's block store: a chain of tiers under one policy (see :mod:`kvstore.store.tiered`)."""

from kvstore.store.chain import TierChain
from kvstore.store.leases import Lease, LeaseKind
from kvstore.store.limits import EdgePolicy, StoreLimits
from kvstore.store.holds import Located
from kvstore.store.tiered import Listed, SlotGrant, StoreStats, TieredStore

__all__ = [
    "EdgePolicy", "Lease", "LeaseKind", "Listed", "Located", "SlotGrant", "StoreLimits", "StoreStats", "TierChain",
    "TieredStore",
]
