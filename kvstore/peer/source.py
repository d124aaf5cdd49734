"""PeerSource: the peer tier, blocks that other daemons of the fleet hold.

A remote source (:mod:`kvstore.remote.base`) with no storage of its own: on
a local miss the store reads through to it, and it

1. asks the prefix index who holds the key (``holders``), leaving out this
   node and holders that only list it in a remote tier (a node whose copy
   is itself "on a peer" holds no bytes);
2. finds each holder's node record (advertised address and transports,
   cached for ``nodes_refresh_s``; a holder whose record is missing or of
   another epoch refreshes it) and the first transport scheme in this
   node's preference order that the holder advertises;
3. orders the holders: **same host first** (the holder's advertised host
   equals this node's, or a same-host-only transport — UCX shared memory —
   reaches it, which is then the scheme used: loopback or shared-memory-fast,
   and no network hop), **then least loaded**, the load being the blocks this node is
   fetching from that holder now. It is the one signal every node has
   without asking anyone; ties are broken at random, once per read (the
   blocks of one read that have the same holders go to the same one), so
   that a hot block's readers spread over its holders;
4. fetches from the first, verified against the block's checksum by the
   transport, into the buffer the store placed: **one request per holder
   for all the keys of a batch it comes first for** (at most
   ``FETCH_BATCH_KEYS`` a request; requests to different holders run at
   once), as a prefix's blocks are mostly held together; a holder that no longer
   has the block (miss), dies or breaks off (unavailable), stalls past the
   per-fetch deadline (deadline), refuses this node (refused: its policy
   does not let this node's token read the namespace), is overloaded, or
   sends bytes that fail their checksum (corrupt) is passed over for the
   next, up to ``max_holders`` (the keys it failed go, together, to each
   one's next holder); then the key is a miss;
5. **repairs the index at once** for every holder that answered miss: its
   entry is removed for that node and epoch (``index.remove``), so neither
   this node nor a router is sent there again for it. Only a miss is proof
   that an entry is stale; a holder that is down keeps its entries until
   its heartbeats lapse, but is skipped here for ``backoff_s``.

The store's chain does the rest: a block found here is copied up into RAM
when ``[tiers.peer] promote`` allows, and published to the index as this
node's by its index agent. The tier is read-through only: ``write`` refuses
every block with ``InvalidArgument`` (the store's "refused" outcome: the
block stays above, the tier is not marked failed), and ``delete`` removes
nothing from other nodes.

The index lives on the index agent's event loop (its clients are bound to
it); this source runs on its bridge's loop and hops over for each index
call, without blocking either loop.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvstore.block import BlockKey, BlockMeta, TierName
from kvstore.errors import (
    AuthError, CorruptBlock, DeadlineExceeded, InvalidArgument, Overloaded, PrefixIndexError, StaleEpoch,
    StrataError, TierUnavailable, UnknownNamespace,
)
from kvstore.index.base import Holder, NodeInfo, PrefixIndex
from kvstore.peer.base import PeerTransport
from kvstore.peer.directory import PeerDirectory
from kvstore.remote.base import (
    MISS, MetaPlace, ReadResult, ReadStatus, RemoteSource, RemoteStats, WriteResult, check_batch, time_left,
)

log = logging.getLogger(__name__)

# Tiers whose holders have the bytes on that node; a holder listed in a remote tier has none.
LOCAL_TIERS = frozenset({TierName.GPU, TierName.HOST, TierName.DISK})
MIN_REFRESH_S = 0.1  # node records are fetched again at most this often for a holder not yet known
REPAIR_TIMEOUT_S = 2.0
FETCH_BATCH_KEYS = 64  # keys one fetch request asks one holder for: a prefix's blocks in a few round trips
FALLBACK_REASONS = ("miss", "unavailable", "deadline", "corrupt", "refused", "overloaded", "invalid", "error")
_FETCH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True, slots=True)
class PeerLimits:
    fetch_s: float = 2.0  # one holder's fetch; past it the next holder is tried
    max_holders: int = 3  # holders tried per key before it is a miss
    backoff_s: float = 1.0  # a holder that could not be reached or stalled is skipped this long
    nodes_refresh_s: float = 2.0  # node records (addresses) are re-read from the index this often
    max_block_bytes: int = 64 << 20  # a holder announcing a larger block is passed over

    def __post_init__(self) -> None:
        if not (self.fetch_s > 0 and self.backoff_s >= 0 and self.nodes_refresh_s > 0):
            raise InvalidArgument("peer limits: fetch_s and nodes_refresh_s must be positive, backoff_s not negative")
        if self.max_holders < 1 or self.max_block_bytes < 1:
            raise InvalidArgument("peer limits: try at least one holder, and allow blocks of at least one byte")


class PeerMetrics:
    """The peer tier's Prometheus metrics; one object per daemon, shared by every arena's peer tier."""

    def __init__(self, registry: CollectorRegistry | None = None, transports: Sequence[str] = ("tcp", "grpc")) -> None:
        """``transports``: the schemes this node fetches with, whose series exist (at 0) from the start."""
        r = registry if registry is not None else CollectorRegistry()
        self.fetched_bytes = Counter(
            "strata_peer_fetched_bytes_total",
            "Verified block bytes fetched from peers, by transport (bytes served from local tiers: "
            "strata_kv_bytes_out_total by tier)", ["transport"], registry=r,
        )
        self.fetch_seconds = Histogram(
            "strata_peer_fetch_duration_seconds",
            "Duration of a fetch request to one holder (one or more blocks) that delivered blocks, by transport",
            ["transport"], buckets=_FETCH_BUCKETS, registry=r,
        )
        self.fallbacks = Counter(
            "strata_peer_fallbacks_total",
            "Holders passed over for the next one, by reason: miss (it no longer had the block), unavailable "
            "(unreachable, or died mid-transfer), deadline (stalled past the per-fetch deadline), corrupt "
            "(bytes failed their checksum), refused (its policy refused this node), overloaded, invalid "
            "(a block outside this daemon's limits), error", ["reason"], registry=r,
        )
        self.repairs = Counter(
            "strata_peer_index_repairs_total",
            "Stale index entries found on fetch (the holder answered miss), by outcome: removed, gone (the "
            "holder's epoch had already ended), failed (the index could not be written)", ["outcome"], registry=r,
        )
        self.reads = Counter(
            "strata_peer_reads_total",
            "Peer tier reads of one block, by outcome: hit, miss (no holder delivered it), no_holder (the "
            "index named no usable holder)", ["outcome"], registry=r,
        )
        self.in_flight = Gauge("strata_peer_fetches_in_flight", "Fetch requests to peers running now", registry=r)
        for transport in transports:
            self.fetched_bytes.labels(transport)
            self.fetch_seconds.labels(transport)
        for reason in FALLBACK_REASONS:
            self.fallbacks.labels(reason)
        for outcome in ("removed", "gone", "failed"):
            self.repairs.labels(outcome)
        for outcome in ("hit", "miss", "no_holder"):
            self.reads.labels(outcome)


@dataclass(frozen=True, slots=True)
class _Candidate:
    holder: Holder
    record: NodeInfo
    scheme: str
    address: str  # scheme://host:port
    near: bool = False  # reached over a same-host-only transport: on this host

    @property
    def node_id(self) -> str:
        return self.holder.node_id


class PeerSource(RemoteSource):
    tier = TierName.PEER

    def __init__(
        self,
        index: PrefixIndex,
        node_id: str,
        *,
        host: str = "",
        schemes: Sequence[str] = ("grpc",),
        transports: Mapping[str, PeerTransport] | None = None,
        transport_options: Mapping[str, Mapping[str, object]] | None = None,
        limits: PeerLimits = PeerLimits(),
        metrics: PeerMetrics | None = None,
        index_loop: asyncio.AbstractEventLoop | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``index``: the prefix index, living on ``index_loop`` (None: this source's own loop).
        ``node_id``: this node (never its own peer). ``host``: this node's advertised host, for
        "same host first". ``schemes``: the transports this node fetches with, preferred first;
        each is built by :func:`kvstore.peer.registry.open_peer_transport` with its entry of
        ``transport_options`` (scheme -> keyword options: the token) unless ``transports`` gives it."""
        if not schemes:
            raise InvalidArgument("the peer tier needs at least one transport scheme (e.g. grpc)")
        self.name = "peer"
        self._index = index
        self._index_loop = index_loop
        self.node_id = node_id
        self.host = host
        self.directory = PeerDirectory(schemes, backoff_s=limits.backoff_s, transports=transports,
                                       options=transport_options, what="peer read", clock=clock)
        self.limits = limits
        self.metrics = metrics or PeerMetrics()
        self._clock = clock
        self._records: dict[str, NodeInfo] = {}
        self._records_at = float("-inf")
        self._not_nodes: set[str] = set()  # holders without a record at the last refresh
        self._records_lock: asyncio.Lock | None = None
        self._in_flight: dict[str, int] = defaultdict(int)  # node id -> blocks this node is fetching from it now
        self._closed = False
        self._hits = self._misses = self._read_bytes = self._errors = 0

    @classmethod
    def from_options(
        cls, rest: str = "", *, index: PrefixIndex | None = None, node_id: str = "", token_file: str = "",
        tls_ca: str = "", fetch_s: float = PeerLimits.fetch_s, max_holders: int = PeerLimits.max_holders,
        backoff_s: float = PeerLimits.backoff_s, max_block_bytes: int = PeerLimits.max_block_bytes,
        ucx_over_tcp: bool = False, **options,
    ) -> PeerSource:
        """``open_remote("peer://", index=..., node_id=..., ...)``: plain values (as the ``[tiers.peer]``
        section gives them, plus what the daemon adds: its index, node id, host, metrics); the other
        keywords go to the constructor."""
        if rest:
            raise InvalidArgument(f"peer://{rest}: the peer tier takes no address; its holders come from the index")
        if index is None or not node_id:
            raise InvalidArgument(
                "the peer tier needs the daemon's prefix index and node id: it is built by `strata serve` "
                "with [tiers] chain = [..., \"peer\"] and a shared [index] url (redis://...)"
            )
        from kvstore.auth.credentials import read_token_file

        from kvstore.peer.registry import fabric_order

        if "schemes" in options:
            options["schemes"] = fabric_order(options["schemes"], ucx_over_tcp=ucx_over_tcp)
        common: dict[str, object] = {"token": read_token_file(token_file)} if token_file else {}
        transport_options = {scheme: dict(common) for scheme in options.get("schemes", ("grpc",))}
        if tls_ca:  # the gRPC transport's channel verifies the peers' certificates with it
            transport_options.setdefault("grpc", {})["tls_ca"] = tls_ca
        limits = PeerLimits(fetch_s=fetch_s, max_holders=max_holders, backoff_s=backoff_s,
                            max_block_bytes=max_block_bytes)
        return cls(index, node_id, limits=limits, transport_options=transport_options, **options)

    # ---- the contract ------------------------------------------------------------

    async def read(self, keys: Sequence[BlockKey], place: MetaPlace, deadline: float) -> list[ReadResult]:
        self._check_open("read")
        check_batch(self, "read", len(keys))
        time_left(self, "read", deadline)
        try:
            holders = await self._holders(keys, deadline)
        except (PrefixIndexError, TimeoutError) as err:
            self._errors += len(keys)
            why = TierUnavailable(f"peer tier: the prefix index did not answer who holds the blocks ({err})")
            return [ReadResult.failed(why)] * len(keys)
        return await self._read_all(keys, holders, place, deadline)

    async def lookup(self, keys: Sequence[BlockKey], deadline: float) -> list[BlockMeta | None]:
        self._check_open("lookup")
        check_batch(self, "lookup", len(keys))
        time_left(self, "lookup", deadline)
        scratch: list[bytearray] = []

        def place(_i: int, meta: BlockMeta) -> memoryview:
            scratch.append(bytearray(meta.size))
            return memoryview(scratch[-1])

        try:
            holders = await self._holders(keys, deadline)
        except (PrefixIndexError, TimeoutError) as err:
            raise TierUnavailable(f"peer tier: the prefix index did not answer who holds the blocks ({err})") from None
        out: list[BlockMeta | None] = []
        for key, held in zip(keys, holders):  # one at a time: the bytes read are dropped before the next
            [result] = await self._read_all([key], [held], place, deadline)
            out.append(result.meta if result.is_hit else None)
            scratch.clear()
        return out

    async def write(self, blocks, deadline: float) -> list[WriteResult]:
        self._check_open("write")
        refused = InvalidArgument(
            "the peer tier is read-through only: blocks reach peers when they read them; "
            "set [tiers.peer] write_policy = \"off\""
        )
        return [WriteResult.failed(refused)] * len(blocks)

    async def delete(self, keys: Sequence[BlockKey], deadline: float) -> int:
        """Other nodes' copies are theirs: nothing is deleted there."""
        self._check_open("delete")
        return 0

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.directory.close()

    def stats(self) -> RemoteStats:
        return RemoteStats(self.tier, self.name, self._hits, self._misses, self._read_bytes, 0, 0, self._errors)

    # ---- fetching -----------------------------------------------------------------

    async def _read_all(self, keys: Sequence[BlockKey], holders: list[list[Holder]], place: MetaPlace,
                        deadline: float) -> list[ReadResult]:
        """Each key from its holders in order: per round, the keys still unread grouped by the holder next
        in their order, one request per group (all groups at once); a key a holder failed goes on to
        its next holder with the others it failed, until ``max_holders`` were tried."""
        tiebreak: dict[str, float] = {}  # one random order of equal holders per read: a chain stays together
        queues = [await self._candidates(held, deadline, tiebreak) for held in holders]
        results: list[ReadResult] = [MISS] * len(keys)
        pending = []
        for i, queue in enumerate(queues):
            if queue:
                pending.append(i)
            else:
                self.metrics.reads.labels("no_holder").inc()
                self._misses += 1
        while pending and self._clock() < deadline:
            groups: dict[tuple[str, str], list[int]] = defaultdict(list)
            for i in pending:
                groups[queues[i][0].node_id, keys[i].namespace].append(i)
            batches = [(queues[g[0]][0], g[k:k + FETCH_BATCH_KEYS])
                       for g in groups.values() for k in range(0, len(g), FETCH_BATCH_KEYS)]
            fetch_deadline = min(deadline, self._clock() + self.limits.fetch_s)
            outcomes = await asyncio.gather(*(self._fetch(c, [keys[i] for i in batch], place, batch, fetch_deadline)
                                              for c, batch in batches))
            pending = []
            for (c, batch), outcome in zip(batches, outcomes):
                for i, (reason, result) in zip(batch, outcome):
                    if result is not None:
                        results[i] = result
                        continue
                    self.metrics.fallbacks.labels(reason).inc()
                    log.debug("peer %s could not serve %s (%s); trying the next holder", c.node_id, keys[i], reason)
                    queues[i].pop(0)
                    if queues[i]:
                        pending.append(i)
                    else:
                        self._missed()
        for _ in pending:  # out of time
            self._missed()
        return results

    def _missed(self) -> None:
        self.metrics.reads.labels("miss").inc()
        self._misses += 1

    async def _fetch(
        self, c: _Candidate, keys: list[BlockKey], place: MetaPlace, positions: list[int], deadline: float
    ) -> list[tuple[str, ReadResult | None]]:
        """One request to one holder for ``keys`` (of one namespace; ``positions``: their indices in the
        read, which ``place`` is called with): per key ("", the result to report) or (why it failed, None)."""
        oversized: set[int] = set()

        def guarded(j: int, meta: BlockMeta) -> memoryview | None:
            if meta.size > self.limits.max_block_bytes:
                oversized.add(j)
                return None
            return place(positions[j], meta)

        def every(reason: str) -> list[tuple[str, ReadResult | None]]:
            return [(reason, None)] * len(keys)

        try:
            transport = self.directory.transport(c.scheme)
        except StrataError as err:
            log.warning("peer transport %s cannot be used: %s", c.scheme, err)
            return every("error")
        self._in_flight[c.node_id] += len(keys)
        self.metrics.in_flight.inc()
        started = self._clock()
        try:
            results = await transport.read(c.address, keys[0].namespace, [k.key for k in keys], guarded, deadline)
        except (TierUnavailable, DeadlineExceeded) as err:
            self.directory.back_off(c.node_id, err, c.address)
            return every("deadline" if isinstance(err, DeadlineExceeded) else "unavailable")
        except UnknownNamespace:  # it never had anything of that namespace: stale entries
            await self._repair(c, keys)
            return every("miss")
        except AuthError as err:
            log.warning("peer %s refused this node's token for namespace %r: %s; give this node's "
                        "[tiers.peer] token_file a token the peers' policy lets read it", c.node_id,
                        keys[0].namespace, err)
            return every("refused")
        except Overloaded:
            return every("overloaded")
        except StrataError as err:
            log.warning("peer %s failed a fetch of %d blocks (%s...): %s", c.node_id, len(keys), keys[0], err)
            return every("error")
        finally:
            self._in_flight[c.node_id] -= len(keys)
            if not self._in_flight[c.node_id]:
                del self._in_flight[c.node_id]
            self.metrics.in_flight.dec()
        out: list[tuple[str, ReadResult | None]] = []
        stale: list[BlockKey] = []
        delivered = False
        for j, (key, result) in enumerate(zip(keys, results)):
            if result.is_hit:
                self.metrics.fetched_bytes.labels(c.scheme).inc(result.meta.size)
                self.metrics.reads.labels("hit").inc()
                self._hits += 1
                self._read_bytes += result.meta.size
                delivered = True
                out.append(("", result))
            elif result.status is ReadStatus.SKIPPED:
                out.append(("invalid", None) if j in oversized else ("", result))
            elif result.status is ReadStatus.MISS:
                stale.append(key)
                out.append(("miss", None))
            elif isinstance(result.error, CorruptBlock):
                log.error("peer %s sent a corrupt copy of %s: %s; trying the next holder", c.node_id, key, result.error)
                out.append(("corrupt", None))
            elif isinstance(result.error, (TierUnavailable, DeadlineExceeded)):
                self.directory.back_off(c.node_id, result.error, c.address)
                out.append(("deadline" if isinstance(result.error, DeadlineExceeded) else "unavailable", None))
            elif isinstance(result.error, InvalidArgument):  # the caller's buffer was too small: not the holder's fault
                out.append(("", result))
            else:
                out.append(("error", None))
        if delivered:
            self.metrics.fetch_seconds.labels(c.scheme).observe(self._clock() - started)
            self.directory.succeeded(c.node_id)
        if stale:
            await self._repair(c, stale)
        return out

    async def _repair(self, c: _Candidate, keys: list[BlockKey]) -> None:
        """The holder said it does not have the blocks (of one namespace): drop its entries for that epoch now."""
        try:
            await self._on_index(
                lambda: self._index.remove(keys[0].namespace, c.node_id, c.holder.epoch, [k.key for k in keys]),
                REPAIR_TIMEOUT_S,
            )
        except StaleEpoch:  # that incarnation already ended: its entries no longer count anywhere
            self.metrics.repairs.labels("gone").inc(len(keys))
        except (PrefixIndexError, TimeoutError) as err:
            self.metrics.repairs.labels("failed").inc(len(keys))
            log.warning("could not remove the stale index entries of %d blocks (%s...) on %s: %s",
                        len(keys), keys[0], c.node_id, err)
        else:
            self.metrics.repairs.labels("removed").inc(len(keys))
            log.info("index repaired: %s no longer holds %d blocks (%s...; epoch %d)", c.node_id, len(keys), keys[0],
                     c.holder.epoch)

    # ---- holders, records, order --------------------------------------------------

    async def _holders(self, keys: Sequence[BlockKey], deadline: float) -> list[list[Holder]]:
        """Each key's holders, one index call per namespace of the batch."""
        by_ns: dict[str, list[int]] = defaultdict(list)
        for i, key in enumerate(keys):
            by_ns[key.namespace].append(i)
        out: list[list[Holder]] = [[] for _ in keys]
        for namespace, positions in by_ns.items():
            found = await self._on_index(
                lambda: self._index.holders(namespace, [keys[i].key for i in positions]), deadline - self._clock()
            )
            for i, held in zip(positions, found):
                out[i] = held
        return out

    async def _candidates(self, holders: list[Holder], deadline: float,
                          tiebreak: dict[str, float]) -> list[_Candidate]:
        usable = [h for h in holders if h.node_id != self.node_id and h.tier in LOCAL_TIERS]
        if not usable:
            return []
        try:
            records = await self._node_records(usable, deadline)
        except (PrefixIndexError, TimeoutError) as err:
            log.warning("peer tier: the index did not answer with node records: %s", err)
            return []
        now = self._clock()
        out = []
        for h in usable:
            record = records.get(h.node_id)
            if record is None or record.epoch != h.epoch or not self.directory.usable(h.node_id, now):
                continue
            route = self.directory.route(record)
            if route is not None:
                out.append(_Candidate(h, record, route.scheme, route.address, route.near))
        for c in out:
            tiebreak.setdefault(c.node_id, random.random())
        out.sort(key=lambda c: (not c.near and c.record.host != self.host, self._in_flight.get(c.node_id, 0),
                                tiebreak[c.node_id]))
        return out[: self.limits.max_holders]

    async def _node_records(self, holders: list[Holder], deadline: float) -> dict[str, NodeInfo]:
        if self._records_lock is None:
            self._records_lock = asyncio.Lock()
        async with self._records_lock:
            age = self._clock() - self._records_at
            # A holder with no record at the last refresh is no daemon (an engine publishing KV events
            # into the same namespace), or not one yet: only the regular refresh looks for it again.
            unknown = any(
                (h.node_id not in self._records and h.node_id not in self._not_nodes)
                or (h.node_id in self._records and self._records[h.node_id].epoch != h.epoch) for h in holders
            )
            if age >= self.limits.nodes_refresh_s or (unknown and age >= MIN_REFRESH_S):
                nodes = await self._on_index(self._index.nodes, deadline - self._clock())
                self._records = {n.node_id: n for n in nodes if n.alive}
                self._records_at = self._clock()
                self._not_nodes = {h.node_id for h in holders if h.node_id not in self._records}
            return self._records

    # ---- plumbing -------------------------------------------------------------------

    async def _on_index(self, call: Callable[[], Awaitable], timeout_s: float):
        """Run an index coroutine where the index lives, bounded by ``timeout_s``."""
        if timeout_s <= 0:
            raise TimeoutError("no time left to ask the prefix index")
        loop = asyncio.get_running_loop()
        if self._index_loop is None or self._index_loop is loop:
            async with asyncio.timeout(timeout_s):
                return await call()

        async def bounded():
            async with asyncio.timeout(timeout_s):
                return await call()

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(bounded(), self._index_loop))

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise TierUnavailable(f"peer tier: closed; {op} refused")
