"""Weights at fleet scale: N nodes fetch one 140 GB model through the swarm's own planning code, in virtual time.

What runs of Strata, unchanged: :meth:`weightcache.index_swarm.IndexSwarm.route`
(its ``sources`` closure: the chunk's holders other than this node and the
owner, spread by a hash of (node, holder, chunk), then the owner source; its
``order`` key: this node's own chunks first, then the rarest),
:meth:`IndexSwarm.owner` (the hash partition of a chunk's digest over the
live members), the :class:`~weightcache.peers.PeerChunkSource` objects
``route`` makes for each holder, and each node's origin
:class:`~weightcache.sources.AdaptiveLimit` (halved when the origin
throttles, grown back by one per streak), built from the planner's own
:class:`~weightcache.fetch.FetchLimits` defaults (8 chunks in flight, 8
origin requests). The manifest is a real :class:`~weightcache.manifest.Manifest`
(28 files of 5 GB, chunks of its chunk size).

What is modelled, because it is I/O: what each source's ``read`` does. A
node works its plan with ``max_in_flight`` workers; for each chunk it walks
the list ``sources`` returned, as :meth:`weightcache.fetch.Planner._fetch`
does: a holder that has the chunk and a free upload place (the prefetcher's
``max_uploads``, 8) serves it; one at its bound is passed over (throttled);
one that announced the chunk but is still fetching it is waited on, as
``ReadChunk`` waits; the owner source reads from the owner (waiting while the
owner fetches it), or, when the owner is this node, from a holder the index
names now (``holders_now``) or else announces the chunk and reads it from
the origin, under the fleet-wide request limit (beyond it: throttled, the
node's origin limit halved, a jittered back-off as the planner's). Nothing
fails: no node dies, no byte is corrupt.

The index is the sim's own shared view (:attr:`_Model.holders` as
``_refresh`` writes it, a holder's node id sorted in), current at once: the
real swarm reads it every ``refresh_s`` (0.25 s), which this leaves out.
At 1,000 nodes ``holders_view`` keeps each chunk's newest holders only
(``sources`` sorts every holder by a BLAKE3 of (node, holder, chunk) for
every chunk it plans: at 1,000 nodes that is hundreds of hashes per chunk,
which the simulation cannot afford a million times over; the real planner
pays it too, see the docs).

Links, per transfer of L bytes: each link (a node's uplink, a node's
downlink, the origin's aggregate) serves bytes in order at its capacity; a
transfer ends when every link on its path has carried its L bytes (the
uplink's and downlink's finish times, the later one). Disk writes, the
verify, and latency are not modelled: they are well below a 25 Gb/s NIC on
the hosts the weights benchmark ran on, which the docs say where it is not.
"""

from __future__ import annotations

import heapq
import random
import threading
from collections import deque
from dataclasses import asdict, dataclass, field

from kvstore.auth.credentials import NONE
from weightcache.fetch import FetchLimits
from weightcache.index_swarm import IndexSwarm, _Model, _OwnerSource, chunk_key
from weightcache.manifest import DEFAULT_CHUNK_BYTES, FileEntry, Manifest, digest_of
from weightcache.peers import DEFAULT_READ_TIMEOUT_S, PeerChunkSource
from weightcache.sources import AdaptiveLimit, ChunkRef

GB = 10**9
MODEL_BYTES = 140 * GB
FILE_BYTES = 5 * GB  # a 70B-class checkpoint in bf16: 28 safetensors files of 5 GB
MAX_UPLOADS = 8  # weightcache.prefetch.Prefetcher's default max_uploads


@dataclass(frozen=True)
class WeightLinks:
    node_up_bps: float = 3.125e9  # a 25 Gb/s NIC, each way
    node_down_bps: float = 3.125e9
    origin_bps: float = 10e9  # the bucket's aggregate to this fleet (80 Gb/s)
    origin_requests: int = 64  # requests the origin serves at once; beyond it answers SlowDown

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class WeightsConfig:
    nodes: int
    chunk_scale: int = 1  # chunks of chunk_scale x the manifest's default chunk size
    model_bytes: int = MODEL_BYTES
    links: WeightLinks = WeightLinks()
    holders_view: int | None = None  # None: every holder, as _refresh stores them; n: the n newest
    seed: int = 0

    @property
    def chunk_bytes(self) -> int:
        return DEFAULT_CHUNK_BYTES * self.chunk_scale


def manifest_of(model_bytes: int, chunk_bytes: int) -> Manifest:
    files = []
    left, i = model_bytes, 0
    while left > 0:
        size = min(FILE_BYTES, left)
        n = -(-size // chunk_bytes)
        files.append(FileEntry(f"model-{i:05d}.safetensors", size,
                               tuple(digest_of(f"{i}/{c}".encode()) for c in range(n))))
        left -= size
        i += 1
    return Manifest("fleet/140g", "sim", chunk_bytes, tuple(files))


def lower_bound_s(nodes: int, model_bytes: int, links: WeightLinks) -> dict:
    """T >= max(F/u_origin, F/d_node, N F/(u_origin + N u_node)), each term, and every node from the origin."""
    f = model_bytes
    terms = {"origin_s": f / links.origin_bps, "downlink_s": f / links.node_down_bps,
             "aggregate_s": nodes * f / (links.origin_bps + nodes * links.node_up_bps)}
    return {**terms, "bound_s": max(terms.values()),
            "origin_only_s": max(nodes * f / links.origin_bps, f / links.node_down_bps)}


class _PlanningSwarm(IndexSwarm):
    """An :class:`IndexSwarm` with its planning state and none of its index half: no loop thread, no
    join, no heartbeats, no refresh. The simulation writes ``members`` and ``holders`` as ``_refresh``
    would; :meth:`route` and :meth:`owner` are the class's own."""

    def __init__(self, node_id: str, addresses: dict[str, str]) -> None:  # noqa: super().__init__ joins an index
        self.node_id = self.me = self.address = node_id
        self.ttl_s, self.refresh_s, self.settle_s, self.wait_s = 10.0, 0.25, 0.0, 120.0
        self.concurrency, self.read_timeout_s, self.security = 4, DEFAULT_READ_TIMEOUT_S, NONE
        self._models, self._addresses, self._suspects = {}, addresses, {}
        self._lock = threading.Lock()

    def adopt(self, model: _Model) -> None:
        self._models[model.manifest.digest] = model


@dataclass
class _Node:
    name: str
    sources: object
    plan: deque
    origin: AdaptiveLimit
    present: set = field(default_factory=set)
    free: int = 0  # workers not busy
    uploads: int = 0
    origin_queue: deque = field(default_factory=deque)  # (item, tries) waiting for a place under the origin limit
    ready_s: float | None = None


@dataclass
class WeightsResult:
    config: WeightsConfig
    ready_s: float
    first_ready_s: float
    origin_bytes: int
    peer_bytes: int
    origin_throttled: int
    peer_throttled: int
    origin_out_of_tries: int
    chunks: int

    def row(self) -> dict:
        b = lower_bound_s(self.config.nodes, self.config.model_bytes, self.config.links)
        return {"nodes": self.config.nodes, "chunks": self.chunks, "chunk_mib": self.config.chunk_bytes >> 20,
                "holders_view": self.config.holders_view, "all_ready_s": round(self.ready_s, 2),
                "first_ready_s": round(self.first_ready_s, 2), "bound_s": round(b["bound_s"], 2),
                "over_bound": round(self.ready_s / b["bound_s"], 3),
                "binding_term": max(("origin_s", "downlink_s", "aggregate_s"), key=lambda k: b[k]),
                "origin_only_s": round(b["origin_only_s"], 2),
                "speedup_over_origin_only": round(b["origin_only_s"] / self.ready_s, 2),
                "origin_bytes_over_model": round(self.origin_bytes / self.config.model_bytes, 4),
                "origin_throttled": self.origin_throttled, "peer_throttled": self.peer_throttled,
                "origin_out_of_tries": self.origin_out_of_tries}


class WeightsFleet:
    def __init__(self, config: WeightsConfig) -> None:
        self.config = config
        self.links = config.links
        self.limits = FetchLimits()
        self.rng = random.Random(config.seed)
        self.manifest = manifest_of(config.model_bytes, config.chunk_bytes)
        items = [(f, c) for f, e in enumerate(self.manifest.files) for c in range(len(e.chunks))]
        self.refs = {i: ChunkRef.of(self.manifest, *i) for i in items}
        names = [f"n{i:04d}" for i in range(config.nodes)]
        addresses = {n: n for n in names}
        self.holders: dict[tuple[int, int], tuple[str, ...]] = {}  # the index's view: every node's model.holders
        self.nodes: dict[str, _Node] = {}
        self.swarms: dict[str, _PlanningSwarm] = {}
        keys = [chunk_key(*i) for i in items]
        for name in names:
            swarm = _PlanningSwarm(name, addresses)
            model = _Model(self.manifest, keys, items, joined=True, members=tuple(names), holders=self.holders)
            model.refreshed.set()
            swarm.adopt(model)
            sources, order = swarm.route(self.manifest)
            self.swarms[name] = swarm
            self.nodes[name] = _Node(name, sources, deque(sorted(items, key=order)),
                                     AdaptiveLimit(self.limits.origin_concurrency), free=self.limits.max_in_flight)
        self.up_free = dict.fromkeys(names, 0.0)
        self.down_free = dict.fromkeys(names, 0.0)
        self.origin_free = 0.0
        self.origin_in_flight = 0
        self.pending: dict[tuple[str, tuple[int, int]], list] = {}  # (holder, item) -> readers waiting on it
        self.events: list = []
        self.seq = 0
        self.now = 0.0
        self.origin_bytes = self.peer_bytes = 0
        self.origin_throttled = self.peer_throttled = self.origin_out_of_tries = 0

    # ---- events ----------------------------------------------------------------------

    def at(self, t: float, fn, *args) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, fn, args))

    def run(self) -> WeightsResult:
        for node in self.nodes.values():
            self.next_chunks(node)
        while self.events:
            self.now, _, fn, args = heapq.heappop(self.events)
            fn(*args)
        ready = [n.ready_s for n in self.nodes.values()]
        if any(r is None for r in ready):
            raise RuntimeError("a node never got every chunk: the simulation is stuck")
        return WeightsResult(self.config, max(ready), min(ready), self.origin_bytes, self.peer_bytes,
                             self.origin_throttled, self.peer_throttled, self.origin_out_of_tries, len(self.refs))

    def next_chunks(self, node: _Node) -> None:
        while node.free and node.plan:
            item = node.plan.popleft()
            if item not in node.present:
                node.free -= 1
                self.attempt(node, item, 1)

    # ---- one chunk: the planner's walk over the sources route gave -------------------------------

    def attempt(self, node: _Node, item: tuple[int, int], tries: int) -> None:
        ref = self.refs[item]
        for source in node.sources(ref):
            if isinstance(source, PeerChunkSource):
                if self.read_peer(node, source.address, item, tries, owner=False):
                    return
            elif isinstance(source, _OwnerSource):
                swarm = self.swarms[node.name]
                owner = swarm.owner(source.model, ref.digest)
                if owner != node.name:
                    if self.read_peer(node, owner, item, tries, owner=True):
                        return
                    continue
                for holder in self.holders.get(item, ()):  # holders_now: asked of the index at this moment
                    if holder != node.name and self.read_peer(node, holder, item, tries, owner=False):
                        return
                self.hold(node, item)  # announce_now: who asks meanwhile waits on this node
                self.read_origin(node, item, tries)
                return
        self.at(self.now + self.backoff(tries), self.attempt, node, item, tries + 1)

    def read_peer(self, node: _Node, holder: str, item, tries: int, owner: bool) -> bool:
        """True when the read is on its way (now, or once the holder has the chunk); False: passed over."""
        peer = self.nodes[holder]
        if item not in peer.present:
            self.pending.setdefault((holder, item), []).append(node)  # ReadChunk waits while it comes
            return True
        if peer.uploads >= MAX_UPLOADS:  # RESOURCE_EXHAUSTED: throttled, the next source, else a back-off
            self.peer_throttled += 1
            return False
        self.transfer(peer, node, item)
        return True

    def read_origin(self, node: _Node, item, tries: int) -> None:
        limit = node.origin
        if limit.in_flight >= limit.current:  # `async with source.limit` waits for one of this node's places
            node.origin_queue.append((item, tries))
            return
        if self.origin_in_flight >= self.links.origin_requests:  # SlowDown: halve, back off, another round
            limit.throttled()
            self.origin_throttled += 1
            if tries >= self.limits.max_attempts:
                self.origin_out_of_tries += 1  # the planner would fail this chunk here; the sim tries on
            self.at(self.now + self.backoff(tries), self.read_origin, node, item, tries + 1)
            return
        limit.in_flight += 1
        self.origin_in_flight += 1
        length = self.refs[item].length
        up = self.origin_free = max(self.now, self.origin_free) + length / self.links.origin_bps
        down = self.down_free[node.name] = max(self.now, self.down_free[node.name]) + length / self.links.node_down_bps
        self.origin_bytes += length
        self.at(max(up, down), self.origin_done, node, item)

    def origin_done(self, node: _Node, item) -> None:
        node.origin.in_flight -= 1
        node.origin.succeeded()
        self.origin_in_flight -= 1
        if node.origin_queue:
            self.read_origin(node, *node.origin_queue.popleft())
        self.land(node, item)

    def transfer(self, peer: _Node, node: _Node, item) -> None:
        peer.uploads += 1
        length = self.refs[item].length
        up = self.up_free[peer.name] = max(self.now, self.up_free[peer.name]) + length / self.links.node_up_bps
        down = self.down_free[node.name] = max(self.now, self.down_free[node.name]) + length / self.links.node_down_bps
        self.peer_bytes += length
        self.at(max(up, down), self.transfer_done, peer, node, item)

    def transfer_done(self, peer: _Node, node: _Node, item) -> None:
        peer.uploads -= 1
        self.land(node, item)

    def land(self, node: _Node, item) -> None:
        node.present.add(item)
        self.hold(node, item)
        for reader in self.pending.pop((node.name, item), ()):
            if not self.read_peer(reader, node.name, item, 1, owner=True):
                self.at(self.now + self.backoff(1), self.attempt, reader, item, 2)
        node.free += 1
        if len(node.present) == len(self.refs):
            node.ready_s = self.now
        self.next_chunks(node)

    def hold(self, node: _Node, item) -> None:
        """The index names this node as the chunk's holder (newest last; ``sources`` sorts them its own way)."""
        held = self.holders.get(item, ())
        if node.name not in held:
            held = (*held, node.name)
            view = self.config.holders_view
            self.holders[item] = held[-view:] if view and len(held) > view else held

    def backoff(self, tries: int) -> float:
        """The planner's back-off (weightcache.fetch.Planner._backoff), from this run's seeded generator."""
        ceiling = min(self.limits.backoff_max_s, self.limits.backoff_base_s * 2 ** (tries - 1))
        return ceiling * self.rng.uniform(0.5, 1.0)


def run(config: WeightsConfig) -> WeightsResult:
    return WeightsFleet(config).run()
