"""IndexService: translates routing queries to prefix-index lookups and back; the ranking
is :mod:`kvstore.index.scoring`'s.

Index RPCs get their own bounded capacity. They wait on the index (a Redis
round trip, or a Redis that stopped answering) while holding a gRPC worker
thread, and they share those threads with the KV RPCs: without a bound, a
slow index would take every worker and stall local hits. At most
``max_in_flight`` index RPCs wait at once; beyond that they are refused at
once with RESOURCE_EXHAUSTED and a retry delay, so the rest of the workers
stay free for the cache.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from kvstore.api.v1 import index_pb2 as pb
from kvstore.api.v1 import index_pb2_grpc
from kvstore.block import TierName, validate_key, validate_namespace
from kvstore.errors import DeadlineExceeded, InvalidArgument, Overloaded
from kvstore.replication.replicator import ReplicationReport
from kvstore.index.agent import IndexAgent
from kvstore.index.base import MAX_CHAIN_BLOCKS
from kvstore.index.keys import BlockHasher, event_key_bytes
from kvstore.index.scoring import NodeScore, ScoringPolicy

T = TypeVar("T")

DEFAULT_MAX_IN_FLIGHT = 8


def chain_keys(namespace: str, request) -> list[bytes]:
    """The block keys a Score or Holders request asks about (token ids are hashed as vLLM does)."""
    validate_namespace(namespace)
    which = request.WhichOneof("chain")
    if which == "tokens":
        t = request.tokens
        if not t.block_size:
            raise InvalidArgument("tokens need block_size (the engines' --block-size)")
        if not t.hash_seed:
            raise InvalidArgument("tokens need hash_seed: the PYTHONHASHSEED value the engines run with")
        if len(t.token_ids) > MAX_CHAIN_BLOCKS * t.block_size:
            raise InvalidArgument(
                f"{len(t.token_ids)} tokens make more than {MAX_CHAIN_BLOCKS} blocks: send a shorter prefix"
            )
        hasher = BlockHasher(t.block_size, t.hash_seed, t.lora_name or None)
        keys = [event_key_bytes(h) for h in hasher.chain(list(t.token_ids), cache_salt=t.cache_salt or None)]
    elif which == "keys":
        keys = [validate_key(k) for k in request.keys.keys]
    else:
        raise InvalidArgument("give the chain as tokens or as keys")
    if not keys:
        raise InvalidArgument(
            "the chain is empty: give at least one key, or at least block_size tokens (only full blocks have keys)"
        )
    if len(keys) > MAX_CHAIN_BLOCKS:
        raise InvalidArgument(f"{len(keys)} blocks in one chain; the limit is {MAX_CHAIN_BLOCKS}: send a shorter prefix")
    return keys


def tier_weights(request: pb.ScoreRequest) -> dict[TierName, float]:
    """A Score request's own tier weights (they override the daemon's)."""
    weights = {}
    for tw in request.tier_weights:
        try:
            tier = TierName(tw.tier)
        except ValueError:
            raise InvalidArgument(f"a tier weight names tier {tw.tier}: use one of gpu, host, disk, peer, object") from None
        if not tw.weight >= 0:
            raise InvalidArgument("tier weights must be non-negative")
        weights[tier] = tw.weight
    return weights


def endpoint(s: NodeScore) -> pb.EndpointScore:
    return pb.EndpointScore(node_id=s.node_id, blocks=s.blocks, tier=int(s.tier or 0), score=s.score)


class IndexServicer(index_pb2_grpc.IndexServiceServicer):
    def __init__(
        self,
        agent: IndexAgent,
        policy: ScoringPolicy,
        timeout_s: float = 5.0,
        *,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        retry_after_s: float = 0.05,
        replication: Callable[[], ReplicationReport] | None = None,
    ) -> None:
        """``replication``: this node's replication report (None: it replicates nothing, pins included)."""
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight is {max_in_flight}; allow at least one index RPC at a time")
        self._agent = agent
        self._policy = policy
        self._timeout = timeout_s
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._max = max_in_flight
        self._retry_after_s = retry_after_s
        self._replication = replication

    def _deadline(self, context) -> float:
        remaining = context.time_remaining()
        return self._timeout if remaining is None else max(0.001, min(remaining, self._timeout))

    def _bounded(self, op: str, call: Callable[[], T]) -> T:
        if not self._slots.acquire(blocking=False):
            raise Overloaded(
                f"{op}: {self._max} index queries are already waiting on the prefix index; retry after the delay",
                retry_after_s=self._retry_after_s,
            )
        try:
            return call()
        except TimeoutError:
            raise DeadlineExceeded(f"{op}: the prefix index did not answer in time") from None
        finally:
            self._slots.release()

    def Score(self, request: pb.ScoreRequest, context) -> pb.ScoreResponse:
        keys = chain_keys(request.namespace, request)
        policy = self._policy.with_weights(tier_weights(request))
        candidates = list(request.candidates)
        matches = self._bounded(
            "Score",
            lambda: self._agent.run(
                self._agent.index.lookup(request.namespace, keys, candidates or None), self._deadline(context)
            ),
        )
        return pb.ScoreResponse(endpoints=[endpoint(s) for s in policy.rank(matches, candidates)], chain_blocks=len(keys))

    def Nodes(self, request: pb.NodesRequest, context) -> pb.NodesResponse:
        nodes = self._bounded("Nodes", lambda: self._agent.run(self._agent.index.nodes(), self._deadline(context)))
        return pb.NodesResponse(
            nodes=[
                pb.Node(node_id=n.node_id, epoch=n.epoch, alive=n.alive, address=n.address, transports=n.transports,
                        served_bytes=n.served_bytes)
                for n in nodes
            ],
            node_id=self._agent.node_id,
        )

    def Holders(self, request: pb.HoldersRequest, context) -> pb.HoldersResponse:
        keys = chain_keys(request.namespace, request)
        found = self._bounded(
            "Holders",
            lambda: self._agent.run(self._agent.index.holders(request.namespace, keys), self._deadline(context)),
        )
        return pb.HoldersResponse(
            blocks=[
                pb.BlockHolders(
                    key=key,
                    holders=[pb.Holder(node_id=h.node_id, tier=int(h.tier), epoch=h.epoch) for h in holders],
                )
                for key, holders in zip(keys, found)
            ]
        )

    def Replication(self, request: pb.ReplicationRequest, context) -> pb.ReplicationResponse:
        if self._replication is None:
            return pb.ReplicationResponse(node_id=self._agent.node_id, enabled=False)
        r = self._replication()  # in memory: no index call, no slot taken
        return pb.ReplicationResponse(
            node_id=r.node_id, enabled=r.namespaces_enabled, rounds=r.rounds, passes=r.passes,
            last_round_unix_seconds=r.last_round_at, last_error=r.last_error,
            namespaces=[
                pb.NamespaceReplication(
                    namespace=n.namespace, rule=n.rule, replicas=n.replicas, blocks=n.blocks,
                    under_replicated=n.under_replicated, copies_made=n.copies_made, copies_failed=n.copies_failed,
                )
                for n in r.namespaces
            ],
            pins=[
                pb.PinReplication(
                    namespace=p.namespace, pins=p.pins, replicas=p.replicas, blocks=p.blocks,
                    under_replicated=p.under_replicated, copies_held=p.copies_held, copies_made=p.copies_made,
                    copies_failed=p.copies_failed,
                )
                for p in r.pins
            ],
            max_pin_replicas=r.max_pin_replicas,
        )
