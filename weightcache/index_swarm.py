"""A swarm found through Strata's prefix index: who fetches a model, who holds each chunk, who is alive.

:class:`~weightcache.peers.Swarm` needs the same ``--peer`` list on every
node. :class:`IndexSwarm` needs only the index every daemon already uses
(:mod:`kvstore.index`: memory, Redis, Redis Cluster). Each weight node
joins the index as a node (its gRPC address advertised, an epoch that grows
at every start, heartbeats every ``ttl_s / 3``), and per model revision it
fetches writes, in the namespace ``weights:<manifest digest>``:

- the *member* key (``MEMBER_KEY``): this node is fetching or holds the model;
- one key per verified chunk, ``(file, chunk)`` as two big-endian u32: this
  node holds the chunk (it can serve it to peers from its node cache).

The index answers only with live holders at their current epoch, so a node
that is killed drops out of every answer once its heartbeats stop (at most
``ttl_s``), and one that restarts drops its old entries at once.

For each chunk a node needs, it asks, in order:

1. the chunk's current holders (read from the index every ``refresh_s``),
   spread over them by a hash of (this node, the chunk);
2. the chunk's *owner*: a hash partition of the chunk's digest over the live
   members (as the static swarm does, with no coordination): a chunk no one
   holds yet is fetched from the origin by its owner alone, and the others
   wait on the owner (``wait_s``). When the owner does not answer
   (UNAVAILABLE: killed, partitioned), this node suspects it at once, the
   partition is taken again without it, and the chunk goes to its new owner,
   possibly this node, which then takes it from the origin. Every survivor
   computes the same new owner, so a dead node's share is still fetched from
   the origin about once, not once per survivor;
3. the origin (which the reader always adds last).

The fetch plan puts this node's own chunks first, then the rest rarest
first (fewest holders when the model was opened), so chunks spread through
the swarm as early as they can.

The index client runs on a loop thread of this object's own (the planner
runs on each reader's loop; the answers it needs are read from the last
refresh, never awaited on its path). An index that cannot be reached keeps
the last view (logged); with no view at all a node fetches from the origin.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvstore.auth.credentials import NONE, ChannelSecurity
from kvstore.block import TierName
from kvstore.errors import IndexUnavailable, InvalidArgument, StrataError
from kvstore.index.base import MAX_CHAIN_BLOCKS, PrefixIndex
from weightcache.errors import OriginThrottled, OriginUnavailable
from weightcache.manifest import Manifest, digest_of
from weightcache.peers import DEFAULT_READ_TIMEOUT_S, PeerChunkSource
from weightcache.sources import AdaptiveLimit, ChunkRef, ChunkSource

log = logging.getLogger(__name__)

MEMBER_KEY = b"\xffmember"  # chunk keys are 8 bytes: this one never collides
_CHUNK_KEY = struct.Struct(">II")


def namespace_of(digest: str) -> str:
    return f"weights:{digest}"


def chunk_key(file: int, chunk: int) -> bytes:
    return _CHUNK_KEY.pack(file, chunk)


@dataclass
class _Model:
    manifest: Manifest
    keys: list[bytes]  # every chunk's key, in (file, chunk) order
    items: list[tuple[int, int]]
    announced: set[tuple[int, int]] = field(default_factory=set)
    joined: bool = False  # the member key is written
    members: tuple[str, ...] = ()  # live node ids fetching or holding it, sorted
    holders: dict[tuple[int, int], tuple[str, ...]] = field(default_factory=dict)
    refreshed: threading.Event = field(default_factory=threading.Event)


class IndexSwarm:
    def __init__(self, index: PrefixIndex, node_id: str, address: str, *, ttl_s: float = 10.0,
                 refresh_s: float = 0.25, settle_s: float = 1.0, wait_s: float = 120.0, concurrency: int = 4,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S, security: ChannelSecurity = NONE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0.5 <= ttl_s <= 3600 or not 0.01 <= refresh_s <= ttl_s:
            raise InvalidArgument("the index swarm's ttl_s must be 0.5..3600 s and refresh_s 0.01 s..ttl_s")
        if not 0 < read_timeout_s:
            raise InvalidArgument("the index swarm's peer read timeout must be > 0 s (--peer-read-timeout)")
        self.index = index
        self.node_id = node_id
        self.me = node_id  # members are node ids
        self.address = address
        self.epoch = time.time_ns()  # grows at every start: the index drops this node's older entries
        self.ttl_s = ttl_s
        self.refresh_s = refresh_s
        self.settle_s = settle_s  # how long a new model's members are given to show up before planning
        self.wait_s = wait_s
        self.concurrency = concurrency
        self.read_timeout_s = read_timeout_s  # one ReadChunk's deadline beyond its wait (weightcache.peers)
        self.security = security
        self._clock = clock
        self._models: dict[str, _Model] = {}
        self._addresses: dict[str, str] = {}  # node id -> gRPC address, live nodes
        self._suspects: dict[str, float] = {}  # node id -> when it stopped answering
        self._holdings: Callable[[str], Iterable[tuple[int, int]]] = lambda digest: ()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._thread = threading.Thread(target=self._loop.run_forever, name="weights-index", daemon=True)
        self._thread.start()
        self._call(self.index.join(node_id, self.epoch, ttl_s, address=address), 30)
        self._task = asyncio.run_coroutine_threadsafe(self._run(), self._loop)

    def attach(self, holdings: Callable[[str], Iterable[tuple[int, int]]]) -> None:
        """Where this node's verified chunks of a model are read from (the prefetcher's node cache)."""
        self._holdings = holdings

    def _call(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ---- what the planner asks (reader loop threads) ------------------------------------

    def route(self, manifest: Manifest):
        """(sources for a chunk, a plan sort key) for one model: what ``open_model``'s ``route`` asks for."""
        model = self._track(manifest)
        # The first view of members and holders, then time for the members that start with us to join:
        # a chunk is owned by one member only once every member sees the same members.
        model.refreshed.wait(min(5.0, self.ttl_s))
        time.sleep(self.settle_s)
        peers: dict[str, PeerChunkSource] = {}

        def peer(node: str) -> PeerChunkSource | None:
            address = self._addresses.get(node)
            if address is None:
                return None
            if node not in peers:
                peers[node] = PeerChunkSource(address, manifest.digest, concurrency=self.concurrency, wait_s=self.wait_s,
                                         read_timeout_s=self.read_timeout_s, security=self.security)
            return peers[node]

        owner_source = _OwnerSource(self, model, peer)

        def sources(ref: ChunkRef) -> list[ChunkSource]:
            owner = self.owner(model, ref.digest)
            held = [h for h in model.holders.get((ref.file, ref.chunk), ()) if h != self.me and h != owner
                    and h not in self._suspects]
            held.sort(key=lambda h: digest_of(f"{self.me}/{h}/{ref.file}/{ref.chunk}".encode()))
            found = [p for p in map(peer, held) if p is not None]
            return [*found, owner_source]

        counts = {item: len(model.holders.get(item, ())) for item in model.items}

        def order(item: tuple[int, int]) -> tuple[int, int]:
            mine = self.owner(model, manifest.files[item[0]].chunks[item[1]]) == self.me
            return (0 if mine else 1, counts.get(item, 0))  # own chunks first, then the rarest

        return sources, order

    def owner(self, model: _Model, digest: bytes) -> str:
        members = [m for m in model.members if m not in self._suspects or m == self.me] or [self.me]
        if self.me not in members:
            members = sorted([*members, self.me])
        return members[int.from_bytes(digest[:8], "little") % len(members)]

    def suspect(self, node: str) -> None:
        if node != self.me:
            with self._lock:
                if node not in self._suspects:
                    log.warning("weight node %s does not answer: its chunks go to the other members", node)
                self._suspects[node] = self._clock()

    async def holders_now(self, model: _Model, ref: ChunkRef) -> list[str]:
        """The chunk's live holders other than this node, asked of the index now (from any loop)."""
        ns = namespace_of(model.manifest.digest)
        future = asyncio.run_coroutine_threadsafe(self.index.holders(ns, [chunk_key(ref.file, ref.chunk)]), self._loop)
        answer = await asyncio.wait_for(asyncio.wrap_future(future), self.ttl_s)
        return [h.node_id for h in answer[0] if h.node_id != self.me and h.node_id not in self._suspects]

    async def announce_now(self, model: _Model, ref: ChunkRef) -> None:
        """Register this node as the chunk's holder before it has it: ``ReadChunk`` waits while a
        prefetch here is bringing it, so a member that asks meanwhile waits instead of fetching it too."""
        ns = namespace_of(model.manifest.digest)
        add = self.index.add(ns, self.node_id, self.epoch, [(chunk_key(ref.file, ref.chunk), TierName.DISK)])
        await asyncio.wait_for(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(add, self._loop)), self.ttl_s)
        model.announced.add((ref.file, ref.chunk))

    # ---- the index (this object's loop thread) ----------------------------------------

    def _track(self, manifest: Manifest) -> _Model:
        with self._lock:
            model = self._models.get(manifest.digest)
            if model is None:
                items = [(f, c) for f, entry in enumerate(manifest.files) for c in range(len(entry.chunks))]
                model = self._models[manifest.digest] = _Model(manifest, [chunk_key(*i) for i in items], items)
                self._loop.call_soon_threadsafe(self._wake.set)
        return model

    async def _run(self) -> None:
        beat = 0.0
        while not self._stop.is_set():
            try:
                if self._clock() >= beat:
                    await self._heartbeat()
                    beat = self._clock() + self.ttl_s / 3
                for model in list(self._models.values()):
                    whole = await self._announce(model)
                    if not whole or not model.refreshed.is_set():  # a node holding it all asks no one
                        await self._refresh(model)
            except IndexUnavailable as err:
                log.warning("the prefix index cannot be reached; the swarm keeps its last view: %s", err)
            except StrataError as err:
                log.error("the weight swarm's index update failed: %s", err)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.refresh_s)
            except TimeoutError:
                pass

    async def _heartbeat(self) -> None:
        try:
            await self.index.heartbeat(self.node_id, self.epoch, self.ttl_s)
        except StrataError as err:  # expired (a long pause) or evicted: join again, then re-announce
            log.warning("re-joining the prefix index: %s", err)
            await self.index.join(self.node_id, self.epoch, self.ttl_s, address=self.address)
            for model in self._models.values():
                model.announced.clear()
                model.joined = False

    async def _announce(self, model: _Model) -> bool:
        """Write what this node verified since the last time; True when it holds every chunk."""
        ns = namespace_of(model.manifest.digest)
        if not model.joined:
            await self.index.add(ns, self.node_id, self.epoch, [(MEMBER_KEY, TierName.DISK)])
            model.joined = True
        held = set(await asyncio.to_thread(self._holdings, model.manifest.digest))  # reads the node cache
        new = sorted(held - model.announced)
        for i in range(0, len(new), MAX_CHAIN_BLOCKS):
            batch = new[i:i + MAX_CHAIN_BLOCKS]
            await self.index.add(ns, self.node_id, self.epoch, [(chunk_key(*item), TierName.DISK) for item in batch])
            model.announced.update(batch)
        return len(held) == len(model.items)

    async def _refresh(self, model: _Model) -> None:
        ns = namespace_of(model.manifest.digest)
        members = await self.index.holders(ns, [MEMBER_KEY])
        holders: dict[tuple[int, int], tuple[str, ...]] = {}
        for i in range(0, len(model.keys), MAX_CHAIN_BLOCKS):
            answer = await self.index.holders(ns, model.keys[i:i + MAX_CHAIN_BLOCKS])
            for item, hs in zip(model.items[i:i + MAX_CHAIN_BLOCKS], answer):
                if hs:
                    holders[item] = tuple(sorted(h.node_id for h in hs))
        live = {n.node_id: n.address for n in await self.index.nodes() if n.alive and n.address}
        self._addresses = live
        model.members = tuple(sorted({h.node_id for h in members[0]} | {self.me}))
        model.holders = holders
        now = self._clock()
        with self._lock:  # a suspect the index dropped is gone from every answer; one quiet long ago is retried
            for node, since in list(self._suspects.items()):
                if node not in live or now - since > self.ttl_s * 3:
                    self._suspects.pop(node, None)
        model.refreshed.set()

    def close(self) -> None:
        async def stop() -> None:
            self._stop.set()
            self._wake.set()
            await asyncio.wrap_future(self._task)
            try:
                await self.index.leave(self.node_id)
            except StrataError as err:
                log.warning("could not leave the prefix index (its entries expire with the ttl): %s", err)
            await self.index.close()

        if self._loop.is_running():
            try:
                self._call(stop(), 30)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=30)
        self._loop.close()


class _OwnerSource(ChunkSource):
    """The chunk's owner among the live members, resolved at each read: a silent owner is suspected
    and the chunk goes to the next owner; None (not here) when the owner is this node, so the
    planner takes the chunk from the origin: it is this node's share now."""

    kind = "peer"

    def __init__(self, swarm: IndexSwarm, model: _Model, peer: Callable[[str], PeerChunkSource | None]) -> None:
        self.swarm = swarm
        self.model = model
        self.peer = peer
        self.name = f"the owner in swarm {model.manifest.digest[:12]}"
        self.limit = AdaptiveLimit(max(1, swarm.concurrency * 4))

    async def read(self, ref: ChunkRef, into: memoryview) -> memoryview | None:
        for _ in range(len(self.model.members) + 1):
            owner = self.swarm.owner(self.model, ref.digest)
            if owner == self.swarm.me:
                return await self._from_a_holder(ref, into)
            source = self.peer(owner)
            if source is None:  # the index lists it as a member, not as a live node with an address
                self.swarm.suspect(owner)
                continue
            try:
                async with source.limit:
                    return await source.read(ref, into)
            except OriginUnavailable:
                self.swarm.suspect(owner)
        return None

    async def _from_a_holder(self, ref: ChunkRef, into: memoryview) -> memoryview | None:
        """Before this node takes its own chunk from the origin: ask the index once more who holds it
        (a member that joined late may have fetched it meanwhile, and the last refresh is up to
        ``refresh_s`` old). None when no one else does: the origin it is."""
        try:
            holders = await self.swarm.holders_now(self.model, ref)
        except StrataError as err:
            log.warning("the prefix index did not answer for chunk %d of %s: %s", ref.chunk, ref.path, err)
            return None
        for node in holders:
            source = self.peer(node)
            if source is None:
                continue
            try:
                async with source.limit:
                    found = await source.read(ref, into)
            except (OriginUnavailable, OriginThrottled):
                continue
            if found is not None:
                return found
        try:  # this node fetches it now: whoever asks meanwhile waits on it instead of the origin
            await self.swarm.announce_now(self.model, ref)
        except StrataError as err:
            log.warning("could not announce chunk %d of %s: %s", ref.chunk, ref.path, err)
        return None
