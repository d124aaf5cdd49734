"""The clients' control answers (Exists, Pin, List, Stats, Score...) and their result types.

Block bytes are the transports' job (:mod:`kvstore.transport`); their value
types and the gRPC block messages are re-exported here, and so are the
retry policy and the request builders of :mod:`kvstore.client.base`, so
older imports see one set of names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from kvstore.api.v1 import kv_pb2 as pb
from kvstore.block import TierName
from kvstore.client.base import (  # noqa: F401 - the retry policy and request builders' old home
    DEFAULT_TIMEOUT_S, REATTACH, RETRY_ON_UNAVAILABLE, Retries, chain_request, list_request, retry_delay,
)
from kvstore.errors import StrataError
from kvstore.rpc.status import from_rpc_error
from kvstore.transport.arena_io import LEASE_MARGIN_MS, MAX_COMMIT_GROUPS, MIN_COMMIT_GROUP_BYTES, lease_held, now_ms  # noqa: F401
from kvstore.transport.base import Block, BlockInfo, BlockPut, Place, Placement, fit, placement, writable  # noqa: F401
from kvstore.transport.grpc.blocks import (  # noqa: F401
    CHANNEL_OPTIONS, DEFAULT_CHUNK, MAX_MESSAGE_BYTES, ArenaRead, GetAssembler, allocate_request, arena_batch_bytes,
    batches_by_bytes, check_gets, check_puts, copy_into_slots, drop_expired, info_of, leased_bytes, lookup_lease_ids,
    open_arena, place_lookup, put_requests, put_results, read_located, read_lookup, refetch_placement, replaced,
    slot_groups, slot_ids, stream_put_results,
)


@dataclass(frozen=True, slots=True)
class Listed:
    """One block of a listing."""

    key: bytes
    size: int
    layout: str
    parent: bytes | None
    tier: TierName


@dataclass(frozen=True, slots=True)
class ListPage:
    blocks: list[Listed]
    next_page_token: bytes  # empty after the last page


@dataclass(frozen=True, slots=True)
class PinLease:
    lease_id: int
    pinned: int
    missing: list[bytes]
    deadline_unix_ms: int


@dataclass(frozen=True, slots=True)
class Placed:
    """What a :meth:`~kvstore.client.sync.Client.place` did: blocks now where asked, keys the daemon does not
    hold, and (when demoting) blocks kept in RAM because they are pinned."""

    placed: int
    missing: list[bytes]
    pinned: int


@dataclass(frozen=True, slots=True)
class Stats:
    tiers: dict[str, dict[str, int]]
    blocks: int
    pinned_blocks: int
    active_leases: int
    open_slots: int
    demotion_queue_depth: int
    namespaces: list[str]
    node_id: str
    epoch: int
    open_handoffs: int = 0
    handoffs: HandoffSummary | None = None  # node-wide: None for an identity not allowed on every namespace
    replication: ReplicationSummary | None = None


@dataclass(frozen=True, slots=True)
class HandoffSummary:
    """The daemon's handoffs since it started: as a prefill side, then as a decode side."""

    open: int
    opened: int
    completed: int
    expired: int
    pulls_ok: int
    pulls_failed: int
    pulled_bytes: int
    pull_fallbacks: int


@dataclass(frozen=True, slots=True)
class ReplicationSummary:
    """The daemon's replication over every replicated namespace (``strata replication`` has them one by one)."""

    enabled: bool
    under_replicated: int
    copies_made: int
    copies_failed: int
    rounds: int
    last_round_unix_seconds: float
    last_error: str


def parse_exists(r: pb.ExistsResponse) -> list[TierName]:
    return [TierName(t) for t in r.tiers]


def parse_pin(r: pb.PinResponse) -> PinLease:
    return PinLease(r.lease_id, r.pinned, list(r.missing), r.lease_deadline_unix_ms)


PLACES = {"ram": pb.PlaceRequest.WARM, "below": pb.PlaceRequest.DEMOTE}


def place_request(namespace: str, keys, where: str) -> pb.PlaceRequest:
    if where not in PLACES:
        raise ValueError(f"where is {where!r}: use 'ram' (warm the blocks into host RAM) or 'below' (demote them)")
    return pb.PlaceRequest(namespace=namespace, keys=list(keys), where=PLACES[where])


def parse_place(r: pb.PlaceResponse) -> Placed:
    return Placed(r.placed, list(r.missing), r.pinned)


@dataclass(frozen=True, slots=True)
class EndpointScore:
    node_id: str
    blocks: int
    tier: TierName | None
    score: float


@dataclass(frozen=True, slots=True)
class Holder:
    node_id: str
    tier: TierName
    epoch: int


def parse_scores(r) -> list[EndpointScore]:
    return [EndpointScore(e.node_id, e.blocks, tier_name(e.tier), e.score) for e in r.endpoints]


def parse_holders(r) -> list[list[Holder]]:
    return [[Holder(h.node_id, TierName(h.tier), h.epoch) for h in b.holders] for b in r.blocks]


@dataclass(frozen=True, slots=True)
class PeerNode:
    """A node of the fleet as the daemon's index knows it (the Nodes RPC)."""

    node_id: str
    epoch: int
    alive: bool
    address: str  # its gRPC service, host:port
    transports: list[str]  # data-plane endpoints, scheme://host:port, preferred first
    # Block bytes its peer listeners served to other nodes this epoch, by transport (its latest heartbeat).
    served_bytes: dict[str, int] = field(default_factory=dict)


def parse_nodes(r) -> list[PeerNode]:
    return [PeerNode(n.node_id, n.epoch, n.alive, n.address, list(n.transports), dict(sorted(n.served_bytes.items())))
            for n in r.nodes]


@dataclass(frozen=True, slots=True)
class NamespaceReplication:
    """One replicated namespace as the answering node sees it (the Replication RPC)."""

    namespace: str
    rule: str
    replicas: int  # k
    blocks: int  # held by the answering node
    under_replicated: int  # of them, with fewer than k live holders at their latest check
    copies_made: int
    copies_failed: int


@dataclass(frozen=True, slots=True)
class PinReplication:
    """The answering node's pins that ask for replicas, in one namespace (the Replication RPC)."""

    namespace: str
    pins: int
    replicas: int  # the largest k they ask for
    blocks: int  # blocks they pin there
    under_replicated: int  # of them, with fewer than k copies on distinct live nodes at their latest check
    copies_held: int  # copies held (pinned) on other nodes for them
    copies_made: int
    copies_failed: int


@dataclass(frozen=True, slots=True)
class Replication:
    node_id: str
    enabled: bool  # whether it replicates namespaces ([replication] namespaces)
    rounds: int
    passes: int
    last_round_unix_seconds: float
    last_error: str
    namespaces: list[NamespaceReplication]
    pins: list[PinReplication] = field(default_factory=list)
    max_pin_replicas: int = 0  # the most replicas a Pin may ask for there; 0 or 1: none

    @property
    def under_replicated(self) -> int:
        """Blocks found short of their k, namespaces and pins together."""
        return sum(n.under_replicated for n in self.namespaces) + sum(p.under_replicated for p in self.pins)


def parse_replication(r) -> Replication:
    return Replication(
        r.node_id, r.enabled, r.rounds, r.passes, r.last_round_unix_seconds, r.last_error,
        [NamespaceReplication(n.namespace, n.rule, n.replicas, n.blocks, n.under_replicated, n.copies_made,
                              n.copies_failed) for n in r.namespaces],
        [PinReplication(p.namespace, p.pins, p.replicas, p.blocks, p.under_replicated, p.copies_held, p.copies_made,
                        p.copies_failed) for p in r.pins],
        r.max_pin_replicas,
    )


def tier_name(value: int) -> TierName | None:
    return TierName(value) if value else None


def parse_list(r: pb.ListResponse) -> ListPage:
    return ListPage(
        [Listed(x.block.key, x.block.size, x.block.layout, x.block.parent_key or None, TierName(x.tier)) for x in r.blocks],
        r.next_page_token,
    )


def parse_stats(r: pb.StatsResponse) -> Stats:
    return Stats(
        tiers={
            TierName(t.tier).label: {
                "used_bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes, "blocks": t.blocks,
                "degraded": t.degraded,
            }
            for t in r.tiers
        },
        blocks=r.blocks,
        pinned_blocks=r.pinned_blocks,
        active_leases=r.active_leases,
        open_slots=r.open_slots,
        demotion_queue_depth=r.demotion_queue_depth,
        namespaces=list(r.namespaces),
        node_id=r.node_id,
        epoch=r.epoch,
        open_handoffs=r.open_handoffs,
        handoffs=_handoffs(r.handoffs) if r.HasField("handoffs") else None,
        replication=_replication(r.replication) if r.HasField("replication") else None,
    )


def _handoffs(h: pb.HandoffStats) -> HandoffSummary:
    return HandoffSummary(h.open, h.opened, h.completed, h.expired, h.pulls_ok, h.pulls_failed, h.pulled_bytes,
                          h.pull_fallbacks)


def _replication(r: pb.ReplicationStats) -> ReplicationSummary:
    return ReplicationSummary(r.enabled, r.under_replicated, r.copies_made, r.copies_failed, r.rounds,
                              r.last_round_unix_seconds, r.last_error)


# ---- errors -------------------------------------------------------------------


def translate(err: grpc.RpcError) -> StrataError:
    return from_rpc_error(err)
