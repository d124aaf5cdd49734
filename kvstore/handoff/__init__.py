"""The prefill/decode handoff: one request's KV blocks moved from the node that computed them to the node that decodes.

    params.py   HandoffParams: what the decode side needs to pull (a dict or JSON for a router)
    table.py    the prefill side: handoffs open on this daemon, each a lease on its blocks
    pull.py     the decode side: pull the blocks into this daemon's arena, store, publish, complete
    metrics.py  their Prometheus metrics

The flow (vLLM's NIXL connector's, on Strata's store and peer data plane)::

    prefill engine ──OpenHandoff──▶ prefill daemon P: blocks held under a "handoff" lease
                   ◀── HandoffParams (id, node, epoch, addresses, blocks, deadline)
    router passes the params to the decode engine (kv_transfer_params)
    decode engine ──PullHandoff──▶ decode daemon D ──peer read──▶ P (bytes land in D's arena slots)
                                     │  HeartbeatHandoff to P every lease/3 while it pulls
                                     │  verify, store, publish D as a holder in the index
                                     └─ CompleteHandoff to P: lease ended; blocks deleted or kept as cache

A decode side that dies or never comes leaves nothing pinned: the lease
expires and the store's reaper ends it; the handoff id is then refused
(FAILED_PRECONDITION, "expired").
"""

from kvstore.handoff.params import HandoffParams

__all__ = ["HandoffParams"]
