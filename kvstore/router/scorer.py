"""Each endpoint's cached prefix of a prompt, from the prefix index (a daemon's Score RPC).

The router computes the prompt's vLLM block keys itself
(:class:`kvstore.index.keys.BlockHasher`, the engines' ``--block-size`` and
``PYTHONHASHSEED``) and asks the daemon which of the endpoints' index ids
hold the longest prefix of them, under a short deadline: the answer is worth
less than the time a slow index would add to every request.

The same prefix is held under two names, and both count:

- what an engine holds itself (GPU, and its own CPU/disk offload), as its KV
  events report it: the events' 8-byte form of each key, in the events'
  namespace (``--namespace``), the engine's id as holder;
- what the engine's node daemon holds through vLLM's Strata tier (host RAM,
  disk): the tier's 32-byte keys, one per chunk (the hash of the chunk's last
  block, as vLLM's offloading names a chunk), in the tier's namespace
  (``--tier-namespace``, ``vllm/<model>@<layout>/g0``), the daemon's node id as
  holder. The namespace carries the KV layout, so blocks another layout
  wrote, which this engine could not load, are never credited.

Both questions go to the daemon at once (two Score calls in flight, one
deadline); a chunk counts as its blocks, at its tier's weight. An endpoint is
credited as vLLM would use what it finds: its engine's own prefix (the best
of its ids in the events' answer), then, beyond it, the node daemon's blocks
(the best of its ids in the tier's answer) at their tier's weight — or the
node's prefix alone when that is worth more. The index stores each block once,
in its holder's own form: asking in two forms costs one more lookup per
request, where storing a second form would cost a second row per block in Redis.

When a Score fails (the daemon is down, refuses, or misses the deadline) the
index counts as unavailable: :meth:`PrefixScorer.credits` returns None, and the
router routes by load for ``retry_s`` without asking again, so a dead index
costs one deadline per ``retry_s``, not one per request. The first Score that
answers afterwards makes it available again. Both transitions are logged
once; the failures in between are counted, and logged at most once per
``LOG_EVERY_S``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc
import grpc.aio

from kvstore.api.v1 import index_pb2, index_pb2_grpc
from kvstore.auth.credentials import ChannelSecurity
from kvstore.client import codec
from kvstore.index.base import MAX_CHAIN_BLOCKS
from kvstore.index.keys import BlockHasher, event_key_bytes
from kvstore.router.metrics import RouterMetrics

log = logging.getLogger(__name__)

LOG_EVERY_S = 30.0


@dataclass(frozen=True, slots=True)
class HeldPrefix:
    """What one holder has of a prompt: its leading blocks, and their tier-weighted worth in blocks."""

    blocks: int = 0
    score: float = 0.0


NOTHING = HeldPrefix()


def credit(engine: HeldPrefix, node: HeldPrefix) -> float:
    """An endpoint's cached blocks, tier-weighted: the engine's prefix, then the node's blocks beyond it
    (vLLM asks its offload tiers for what its own cache lacks), or the node's prefix alone if worth more."""
    beyond = node.score * (node.blocks - engine.blocks) / node.blocks if node.blocks > engine.blocks else 0.0
    return max(engine.score + beyond, node.score)


def best(answer: Mapping[str, HeldPrefix], ids: Sequence[str]) -> HeldPrefix:
    return max((answer.get(i, NOTHING) for i in ids), key=lambda h: (h.score, h.blocks), default=NOTHING)


class PrefixScorer:
    def __init__(self, target: str, namespace: str, hasher: BlockHasher, metrics: RouterMetrics, *,
                 timeout_s: float, retry_s: float, token_file: str = "", tier_namespace: str = "",
                 blocks_per_chunk: int = 1) -> None:
        """``namespace``: the engines' KV-event namespace ("": not asked); ``tier_namespace``: the
        namespace of their vLLM Strata tier's group 0 ("": not asked), whose chunks are
        ``blocks_per_chunk`` blocks each."""
        if not (namespace or tier_namespace):
            raise ValueError("a prefix scorer needs the engines' event namespace, their tier namespace, or both")
        if blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk is {blocks_per_chunk}; a chunk holds at least one block")
        self._target = target
        self._namespace = namespace
        self._tier_namespace = tier_namespace
        self._blocks_per_chunk = blocks_per_chunk
        self._hasher = hasher
        self._lora_hashers: dict[str, BlockHasher] = {}  # bounded by --lora-adapter's list
        self._metrics = metrics
        self._timeout = timeout_s
        self._retry_s = retry_s
        security = ChannelSecurity.build(token_file=token_file or None)
        # gRPC's reconnect backoff grows to two minutes by default: a daemon back after a
        # restart would stay unused that long. Cap it near the router's own retry period.
        backoff_ms = max(100, int(retry_s * 1000))
        options = [*codec.CHANNEL_OPTIONS, ("grpc.initial_reconnect_backoff_ms", min(100, backoff_ms)),
                   ("grpc.min_reconnect_backoff_ms", min(100, backoff_ms)), ("grpc.max_reconnect_backoff_ms", backoff_ms)]
        self._channel = security.aio_channel(target, options)
        self._stub = index_pb2_grpc.IndexServiceStub(self._channel)
        self.available = True
        self._down_until = 0.0
        self._failures = 0
        self._last_log = 0.0
        metrics.index_available.set(1)

    async def close(self) -> None:
        await self._channel.close()

    def keys(self, tokens: Sequence[int], *, lora_name: str | None = None, cache_salt: str | None = None) -> list[bytes]:
        """The 32-byte keys of the prompt's full blocks (at most the index's chain limit), hashed
        as vLLM hashes them for a request of this LoRA adapter (None: the base model) and cache salt."""
        hasher = self._hasher
        if lora_name:
            hasher = self._lora_hashers.get(lora_name)
            if hasher is None:
                hasher = self._lora_hashers[lora_name] = dataclasses.replace(self._hasher, lora_name=lora_name)
        full = min(len(tokens) // hasher.block_size, MAX_CHAIN_BLOCKS) * hasher.block_size
        return hasher.chain(list(tokens[:full]), cache_salt=cache_salt or None)

    def resting(self) -> bool:
        """True while the index failed lately and is not to be asked yet (the prompt need not be tokenized)."""
        return not self.available and time.monotonic() < self._down_until

    async def credits(self, chain: list[bytes], endpoints: Sequence[Sequence[str]]) -> list[float] | None:
        """Per endpoint (its index ids), its tier-weighted cached blocks of ``chain`` (:meth:`keys`),
        engine and node together (:func:`credit`); None while the index is unavailable."""
        if self.resting():
            return None
        ids = sorted({i for e in endpoints for i in e})
        roles, queries = [], []
        if self._namespace:
            roles.append("engine")
            queries.append(self._score(self._namespace, [event_key_bytes(h) for h in chain], ids, 1))
        per_chunk = self._blocks_per_chunk
        chunks = chain[per_chunk - 1 :: per_chunk]
        if self._tier_namespace and chunks:
            roles.append("node")
            queries.append(self._score(self._tier_namespace, chunks, ids, per_chunk))
        if not ids or not queries:
            return [0.0 for _ in endpoints]
        start = time.perf_counter()
        answers = await asyncio.gather(*queries, return_exceptions=True)
        failed = next((a for a in answers if isinstance(a, BaseException)), None)
        if failed is not None:
            self._metrics.index_latency.labels("error").observe(time.perf_counter() - start)
            if not isinstance(failed, grpc.aio.AioRpcError):
                raise failed
            self._failed(failed)
            return None
        self._metrics.index_latency.labels("ok").observe(time.perf_counter() - start)
        if not self.available:
            log.info("prefix index %s answers again after %d failed queries; routing cache-aware",
                     self._target, self._failures)
            self.available = True
            self._failures = 0
            self._metrics.index_available.set(1)
        by_role = dict(zip(roles, answers))
        engines, nodes = by_role.get("engine", {}), by_role.get("node", {})
        return [credit(best(engines, e), best(nodes, e)) for e in endpoints]

    async def _score(self, namespace: str, keys: list[bytes], ids: Sequence[str], blocks_per_key: int) -> dict[str, HeldPrefix]:
        """One Score call: per id, its leading keys of ``keys`` as blocks of the prompt, and their worth."""
        request = index_pb2.ScoreRequest(namespace=namespace, candidates=ids)
        request.keys.keys.extend(keys)
        response = await self._stub.Score(request, timeout=self._timeout)
        return {e.node_id: HeldPrefix(e.blocks * blocks_per_key, e.score * blocks_per_key) for e in response.endpoints}

    def _failed(self, err: grpc.aio.AioRpcError) -> None:
        now = time.monotonic()
        self._failures += 1
        self._down_until = now + self._retry_s
        if self.available or now - self._last_log >= LOG_EVERY_S:
            log.warning(
                "prefix index %s unavailable (%s: %s); routing least-loaded, asking again every %.1fs "
                "(%d failed queries)", self._target, err.code().name, err.details(), self._retry_s, self._failures,
            )
            self._last_log = now
        self.available = False
        self._metrics.index_available.set(0)
