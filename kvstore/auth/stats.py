"""What Stats shows an identity: node-wide figures only to one allowed on every namespace.

Tier usage, leases, open slots and the demotion queue sum over every
namespace, so they would tell a tenant how much the others store and how
busy they are. An identity allowed on only some namespaces gets its
namespace's block counts and zeros for the node-wide figures (Stats of the
whole node is refused to it before the store is asked; see the interceptor).
"""

from __future__ import annotations

import dataclasses

from kvstore.auth.identity import Identity


def visible_stats(identity: Identity, stats):
    """``stats`` (a store's StoreStats) as ``identity`` may see it."""
    if identity.grant.admin:
        return stats
    return dataclasses.replace(stats, tiers=[], active_leases=0, open_slots=0, demotion_queue_depth=0)
