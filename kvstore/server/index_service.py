"""IndexService: translates routing queries to prefix-index lookups; no policy beyond scoring."""

from __future__ import annotations

from collections.abc import Mapping

from kvstore.api.v1 import index_pb2 as pb
from kvstore.api.v1 import index_pb2_grpc
from kvstore.block import TierName, validate_key, validate_namespace
from kvstore.errors import InvalidArgument
from kvstore.index.agent import IndexAgent
from kvstore.index.base import MAX_CHAIN_BLOCKS, NodeMatch
from kvstore.index.keys import BlockHasher, event_key_bytes

DEFAULT_TIER_WEIGHTS: dict[TierName, float] = {
    TierName.GPU: 1.0,
    TierName.HOST: 0.8,
    TierName.DISK: 0.5,
    TierName.PEER: 0.3,
    TierName.OBJECT: 0.1,
}


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


def rank(
    matches: list[NodeMatch], candidates: list[str], weights: Mapping[TierName, float]
) -> list[pb.EndpointScore]:
    scored = [
        pb.EndpointScore(node_id=m.node_id, blocks=m.blocks, tier=int(m.tier), score=m.blocks * weights[m.tier])
        for m in matches
    ]
    seen = {m.node_id for m in matches}
    scored += [pb.EndpointScore(node_id=c, score=0.0) for c in candidates if c not in seen]
    return sorted(scored, key=lambda e: (-e.score, -e.blocks, e.node_id))


class IndexServicer(index_pb2_grpc.IndexServiceServicer):
    def __init__(self, agent: IndexAgent, weights: Mapping[TierName, float], timeout_s: float = 5.0) -> None:
        self._agent = agent
        self._weights = dict(weights)
        self._timeout = timeout_s

    def _deadline(self, context) -> float:
        remaining = context.time_remaining()
        return self._timeout if remaining is None else max(0.001, min(remaining, self._timeout))

    def Score(self, request: pb.ScoreRequest, context) -> pb.ScoreResponse:
        keys = chain_keys(request.namespace, request)
        weights = dict(self._weights)
        for tw in request.tier_weights:
            if tw.weight < 0:
                raise InvalidArgument("tier weights must be non-negative")
            weights[TierName(tw.tier)] = tw.weight
        candidates = list(request.candidates)
        matches = self._agent.run(
            self._agent.index.lookup(request.namespace, keys, candidates or None), self._deadline(context)
        )
        return pb.ScoreResponse(endpoints=rank(matches, candidates, weights), chain_blocks=len(keys))

    def Holders(self, request: pb.HoldersRequest, context) -> pb.HoldersResponse:
        keys = chain_keys(request.namespace, request)
        found = self._agent.run(self._agent.index.holders(request.namespace, keys), self._deadline(context))
        return pb.HoldersResponse(
            blocks=[
                pb.BlockHolders(
                    key=key,
                    holders=[pb.Holder(node_id=h.node_id, tier=int(h.tier), epoch=h.epoch) for h in holders],
                )
                for key, holders in zip(keys, found)
            ]
        )
