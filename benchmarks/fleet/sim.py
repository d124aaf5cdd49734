"""The fleet: a trace replayed in virtual time through the router's policies, the index and each node's store.

What runs of Strata, unchanged:

- the router's policies (:func:`kvstore.router.policy.make_policy`: round
  robin, least loaded, cache-aware with its :class:`~kvstore.router.ttft.TtftModel`
  fitted online from the simulated TTFTs) over the router's own
  :class:`~kvstore.router.endpoint.Endpoint` records;
- what the router is told: :class:`kvstore.index.memory.MemoryIndex`'s
  ``lookup`` (the longest prefix per node) ranked by
  :class:`kvstore.index.scoring.ScoringPolicy` (blocks × tier weight), as the
  daemon's Score RPC answers it, turned into the cached fraction the router
  compares;
- the pool: a block the node misses is looked up with the index's
  ``holders`` and read from a holder in a local tier (the peer tier's rule,
  :data:`kvstore.peer.source.LOCAL_TIERS`, itself excluded), else from the
  object tier when a node's eviction wrote it there;
- each node's cache (:mod:`benchmarks.fleet.node`: the store's catalogue,
  recency and eviction plan), whose changes are published to the index after
  each request, as the index agent publishes the store's events.

What is modelled (:class:`Links`): time. Requests arrive at their trace
timestamps; each node prefills one request at a time, first come first
served; a request's prefill takes ``overhead + uncached tokens / prefill
rate`` plus the time to load its cached blocks over the link of the tier
each came from (no overlap of loads with compute: an upper bound on the
load's cost). Blocks are written, evicted and published when the request is
routed (not when its prefill ends), so a block is reusable by the next
request in the trace whatever the queueing: with unlimited capacity and the
pool every block any earlier request had is found, the trace's theoretical
maximum (``tests/benchmarks/test_fleet.py`` checks it is reached exactly).
"""

from __future__ import annotations

import asyncio
import heapq
import random
import statistics
from dataclasses import dataclass, field

from kvstore.block import BlockKey, BlockMeta, TierName
from kvstore.index.base import MAX_CHAIN_BLOCKS, MAX_TTL_S
from kvstore.index.memory import MemoryIndex
from kvstore.index.scoring import ScoringPolicy
from kvstore.peer.source import LOCAL_TIERS
from kvstore.router.endpoint import Endpoint
from kvstore.router.policy import PromptSize, make_policy
from benchmarks.fleet.node import DISK, HOST, OBJECT, PEER, NodeStore
from benchmarks.fleet.trace import BLOCK_TOKENS, Trace

NAMESPACE = "llama3-70b"
KV_BYTES_PER_TOKEN = 327_680  # LLaMA3-70B: 80 layers x 8 KV heads x 128 x (K, V) x 2 bytes = 320 KiB
TIERS = (HOST, DISK, PEER, OBJECT)
GB = 1e9


@dataclass(frozen=True)
class Links:
    """The modelled speeds (defaults: a prefill node of 8 GPUs serving LLaMA3-70B, a 200 Gb/s NIC)."""

    prefill_tokens_per_s: float = 10_000.0  # the router's prior (100 us per token)
    overhead_s: float = 0.02
    gbps: tuple[tuple[TierName, float], ...] = ((HOST, 25.0), (DISK, 6.0), (PEER, 25.0), (OBJECT, 2.5))

    def load_s(self, tier: TierName, nbytes: int) -> float:
        return nbytes / (dict(self.gbps)[tier] * GB)

    def to_json(self) -> dict:
        return {"prefill_tokens_per_s": self.prefill_tokens_per_s, "overhead_s": self.overhead_s,
                "load_GB_per_s": {t.label: v for t, v in self.gbps}}


@dataclass(frozen=True)
class FleetConfig:
    nodes: int
    ram_tokens: int | None  # per node; None: unlimited
    disk_tokens: int = 0  # per node; 0: no disk tier
    pool: bool = False  # the peer tier: a miss is read from the node the index names
    bucket: bool = False  # the object tier: evictions at the bottom go to a bucket every node reads
    policy: str = "cache-aware"
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN
    seed: int = 1
    links: Links = field(default_factory=Links)

    @property
    def caching(self) -> str:
        parts = ["ram"] + (["disk"] if self.disk_tokens else []) + (["peer"] if self.pool else []) + \
            (["object"] if self.bucket else [])
        return "+".join(parts)


@dataclass
class Result:
    config: FleetConfig
    trace: str
    requests: int = 0
    input_tokens: int = 0
    hit_tokens: dict[TierName, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    load_bytes: dict[TierName, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    ttft_s: list[float] = field(default_factory=list, repr=False)
    refused_blocks: int = 0
    stale_holders: int = 0  # holders the index named that no longer had the block (0: the index was exact)
    index_rows: int = 0  # holder rows in the index at the end

    @property
    def hits(self) -> int:
        return sum(self.hit_tokens.values())

    @property
    def hit_rate(self) -> float:
        return self.hits / self.input_tokens if self.input_tokens else 0.0

    def share(self, tier: TierName) -> float:
        return self.hit_tokens[tier] / self.hits if self.hits else 0.0

    def to_json(self) -> dict:
        c = self.config
        q = statistics.quantiles(self.ttft_s, n=100) if len(self.ttft_s) > 1 else [0.0] * 99
        return {
            "trace": self.trace, "nodes": c.nodes, "policy": c.policy, "caching": c.caching,
            "ram_tokens_per_node": c.ram_tokens, "disk_tokens_per_node": c.disk_tokens,
            "requests": self.requests, "input_tokens": self.input_tokens, "hit_tokens": self.hits,
            "hit_rate": round(self.hit_rate, 6), "prefill_tokens_saved": self.hits,
            "hit_share": {t.label: round(self.share(t), 6) for t in TIERS},
            "peer_bytes_per_request": round(self.load_bytes[PEER] / max(1, self.requests)),
            "object_bytes_per_request": round(self.load_bytes[OBJECT] / max(1, self.requests)),
            "ttft_p50_s": round(q[49], 4), "ttft_p99_s": round(q[98], 4),
            "refused_blocks": self.refused_blocks, "stale_holders": self.stale_holders,
            "index_rows": self.index_rows,
        }


def run(trace: Trace, config: FleetConfig) -> Result:
    """Replay ``trace`` through a fleet built as ``config`` says; the same inputs give the same result."""
    return asyncio.run(Fleet(trace, config).replay())


class Fleet:
    """One replay's state: the index, a :class:`~benchmarks.fleet.node.NodeStore` per node (``stores``),
    the router's endpoints and policy, the bucket's keys."""

    def __init__(self, trace: Trace, config: FleetConfig) -> None:
        self.trace = trace
        self.c = config
        self.now = 0.0
        self.index = MemoryIndex(clock=lambda: self.now)
        bytes_of = (lambda tokens: None if tokens is None else tokens * config.kv_bytes_per_token)
        self.stores = [NodeStore(bytes_of(config.ram_tokens), bytes_of(config.disk_tokens) or 0,
                                 peer=config.pool, bucket=config.bucket) for _ in range(config.nodes)]
        self.ids = [f"node-{i}" for i in range(config.nodes)]
        self.by_id = {node_id: i for i, node_id in enumerate(self.ids)}
        self.endpoints = [Endpoint(i, f"sim://{node_id}", (node_id,)) for i, node_id in enumerate(self.ids)]
        self.policy = make_policy(config.policy)
        self.scoring = ScoringPolicy()
        self.bucket: set[BlockKey] = set()
        self.rng = random.Random(config.seed)
        self.free_at = [0.0] * config.nodes
        self.result = Result(config, trace.name)

    async def replay(self) -> Result:
        for node_id in self.ids:
            await self.index.join(node_id, 1, MAX_TTL_S)
        done: list[tuple[float, int, int, object, float]] = []  # (end, seq, node, ticket, ttft)
        model = self.policy.model
        for seq, req in enumerate(self.trace.requests):
            self.now = req.arrival_s
            while done and done[0][0] <= self.now:
                _, _, node, ticket, ttft = heapq.heappop(done)
                self.endpoints[node].in_flight -= 1
                if ticket is not None:
                    model.first_byte(ticket, ttft)
            keys = [BlockKey(NAMESPACE, h.to_bytes(8, "big")) for h in req.blocks[:MAX_CHAIN_BLOCKS]]
            hits, prompt = await self._scores(req.input_tokens, keys)
            decision = self.policy.pick(self.endpoints, hits, prompt)
            e = decision.endpoint
            service_s = await self._serve(e.index, req, keys)
            ticket = model.sent(e, decision.uncached) if model is not None else None
            e.in_flight += 1
            end = max(self.now, self.free_at[e.index]) + service_s
            self.free_at[e.index] = end
            heapq.heappush(done, (end, seq, e.index, ticket, end - self.now))
            self.result.ttft_s.append(end - self.now)
        r = self.result
        r.requests = len(self.trace.requests)
        r.input_tokens = self.trace.input_tokens
        r.refused_blocks = sum(s.refused for s in self.stores)
        r.index_rows = sum(len(inc.rows.get(NAMESPACE, ())) for inc in self.index._incarnations.values())
        return r

    async def _scores(self, tokens: int, keys: list[BlockKey]) -> tuple[dict[Endpoint, float] | None, PromptSize | None]:
        """Each endpoint's cached fraction of the prompt's full blocks, as the daemon's Score ranks them."""
        if self.policy.model is None:
            return None, None  # round robin and least loaded ask nothing
        full = min(tokens // BLOCK_TOKENS, len(keys))
        prompt = PromptSize(tokens, full * BLOCK_TOKENS)
        if full == 0:
            return {}, prompt
        matches = await self.index.lookup(NAMESPACE, [k.key for k in keys[:full]])
        ranked = self.scoring.rank(matches)
        return {self.endpoints[self.by_id[s.node_id]]: s.score / full for s in ranked if s.score > 0}, prompt

    async def _serve(self, node: int, req, keys: list[BlockKey]) -> float:
        """Load what the fleet holds of the prompt's prefix, compute and store the rest; the prefill's seconds."""
        store, r, links = self.stores[node], self.result, self.c.links
        load_s = 0.0
        metas = []
        parent = None
        for i, key in enumerate(keys):
            metas.append(BlockMeta(req.block_tokens(i) * self.c.kv_bytes_per_token, 0, parent))
            parent = key.key

        def hit(i: int, tier: TierName) -> None:
            nonlocal load_s
            r.hit_tokens[tier] += req.block_tokens(i)
            r.load_bytes[tier] += metas[i].size
            load_s += links.load_s(tier, metas[i].size)

        j = 0
        while j < len(keys):  # the node's own tiers
            tier = store.find(keys[j])
            if tier is None:
                break
            hit(j, tier)
            if tier is DISK:
                store.promote(keys[j], metas[j], DISK)
            j += 1
        if j < len(keys) and (self.c.pool or self.c.bucket):  # the pool: peers the index names, then the bucket
            first = j
            holders = await self.index.holders(NAMESPACE, [k.key for k in keys[first:]]) if self.c.pool else None
            while j < len(keys):
                source = self._peer(node, keys[j], holders[j - first]) if holders is not None else None
                if source is not None:
                    hit(j, PEER)
                    store.promote(keys[j], metas[j], PEER)
                elif keys[j] in self.bucket:
                    hit(j, OBJECT)
                    store.promote(keys[j], metas[j], OBJECT)
                else:
                    break
                j += 1
        computed = sum(req.block_tokens(i) for i in range(j, len(keys)))
        for i in range(j, len(keys)):
            store.store(keys[i], metas[i])
        await self._publish(node)
        return links.overhead_s + load_s + computed / links.prefill_tokens_per_s

    def _peer(self, node: int, key: BlockKey, holders) -> int | None:
        """A holder of ``key`` in a local tier, not ``node`` (a seeded choice among them, as the peer tier
        shuffles its candidates); its read is a use there."""
        usable = [h.node_id for h in holders if h.tier in LOCAL_TIERS and h.node_id != self.ids[node]]
        while usable:
            source = self.by_id[usable.pop(self.rng.randrange(len(usable)))]
            if self.stores[source].find(key) is not None:
                return source
            self.result.stale_holders += 1
        return None

    async def _publish(self, node: int) -> None:
        """The node's changes, as its index agent publishes them: adds at the best tier, removes."""
        store = self.stores[node]
        self.bucket.update(store.bucket_writes)
        store.bucket_writes.clear()
        changes = store.take_changes()
        adds = [(k.key, t) for k, t in changes.items() if t is not None]
        removes = [k.key for k, t in changes.items() if t is None]
        for i in range(0, len(adds), MAX_CHAIN_BLOCKS):
            await self.index.add(NAMESPACE, self.ids[node], 1, adds[i:i + MAX_CHAIN_BLOCKS])
        for i in range(0, len(removes), MAX_CHAIN_BLOCKS):
            await self.index.remove(NAMESPACE, self.ids[node], 1, removes[i:i + MAX_CHAIN_BLOCKS])
