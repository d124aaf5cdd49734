"""TieredStore: an ordered chain of tiers with leases and prefix-aware eviction.

Policy lives here; the tiers only hold bytes. The store composes its parts:

- :mod:`~kvstore.store.chain`: the tiers in order, a mappable head first, and
  the policy of each edge (demote on eviction, write-through, promote on read);
- :mod:`~kvstore.store.entries`: every block, where its copies are, its children;
- :mod:`~kvstore.store.recency`: the one least-recently-used order per tier,
  written back to persistent tiers in batches;
- :mod:`~kvstore.store.eviction`: which blocks leave a tier, and how;
- :mod:`~kvstore.store.demotion`: the bounded write-behind queue and its workers;
- :mod:`~kvstore.store.recovery`: what persistent tiers kept from the last run;
- :mod:`~kvstore.store.leases`: pins, reads in place, arena slots, and any kind
  a component defines; :mod:`~kvstore.store.holds`: reads in place and the
  leases of any kind on stored blocks; :mod:`~kvstore.store.slots`: the slot protocol of
  same-host writers; :mod:`~kvstore.store.writer`: streamed blocks written in
  place as they arrive; :mod:`~kvstore.store.checks`: every input limit;
- :mod:`~kvstore.store.state`: the facts all parts decide on, under one lock,
  and the bookkeeping on them; :mod:`~kvstore.store.placement` (room in the
  head, adoption, promotion), :mod:`~kvstore.store.reads` (reads down the
  chain and through to remote tiers) and :mod:`~kvstore.store.copies` (the
  write-behind work) each do one job on it; :mod:`~kvstore.store.upkeep`: the
  reaper's rounds (recency written back, tier health checked again).

This class is the facade: the public operations (the streamed and the slot
data paths, reads in place, leases, listing, stats, lifecycle), each a short
composition of those parts.

The rules:

- Writes land in the head (the shared arena), so a same-host reader can map
  them at once; with write-through on an edge a copy also goes down at once.
- Reads fall through the chain; a hit below the head is copied up into it
  (promotion) and keeps its lower copy, so evicting it later is free.
- When the head runs short, its least recently used blocks move down
  through the bounded write-behind queue; a block stays readable above until
  its lower copy is complete. A lower tier that is full evicts the same way,
  down to the bottom of the chain, where eviction drops.
- A block that is the parent of a cached block is never dropped, and a chain
  leaves a tier from its deepest cached block up, so a prefix always outlives
  its descendants.
- Pinned, leased and in-flight blocks are never evicted. Every lease expires
  by itself, so a client that dies gives its space back.

Thread model: one lock (``self._cond``) guards all metadata; byte copies and
tier I/O happen outside it, protected by pin counts and the ``demoting``
mark. The head's extents are freed under the lock (a waiting writer must see
the room at once); every other tier's deletes (an unlink on disk) are queued
under the lock and run after it is released (:meth:`_run_deletes`), and a
copy down to a tier never races a queued delete of the same block there.
Lock order is store → tier; tiers never call back.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from kvstore.block import (
    MAX_KEY_BYTES,
    BlockKey,
    BlockMeta,
    TierName,
    validate_key,
    validate_namespace,
)
from kvstore.errors import CorruptBlock, InvalidArgument, StrataError
from kvstore.metrics import StoreMetrics
from kvstore.store.chain import TierChain
from kvstore.store.copies import CopyDown
from kvstore.store.demotion import Copy, Demoter
from kvstore.store.leases import Lease, LeaseKind
from kvstore.store.limits import EdgePolicy, StoreLimits
from kvstore.store.moves import BlockMoves, Placed  # noqa: F401 (Placed: what place returns)
from kvstore.store.placement import HeadPlacement
from kvstore.store.reads import READ_THROUGH_BATCH, ChainReader
from kvstore.store.recovery import recover
from kvstore.events import Removed
from kvstore.store.holds import BlockHolds, Located
from kvstore.store.slots import SlotGrant, SlotProtocol, SlotWrite
from kvstore.store.state import EventSink, StorePart, StoreState
from kvstore.store.upkeep import Upkeep
from kvstore.store.writer import BlockWriter, StreamedWrites
from kvstore.tiers.base import Tier, TierStats

log = logging.getLogger(__name__)

DEFAULT_LIST_PAGE = 1000
EXISTS_THROUGH_KEYS = 64  # keys past a local miss that Exists asks a remote tier about, in one lookup
MAX_LIST_PAGE = 10000

__all__ = ["Located", "Listed", "SlotGrant", "SlotWrite", "StoreLimits", "StoreStats", "TieredStore"]


@dataclass(frozen=True, slots=True)
class Listed:
    key: bytes
    meta: BlockMeta
    tier: TierName


@dataclass(frozen=True, slots=True)
class StoreStats:
    tiers: list[TierStats]
    blocks: int
    pinned_blocks: int
    active_leases: int
    open_slots: int
    demotion_queue_depth: int
    namespaces: list[str]


class TieredStore(StorePart):
    def __init__(
        self,
        tiers: TierChain | Sequence[Tier],
        *,
        edges: Sequence[EdgePolicy] = (),
        limits: StoreLimits | None = None,
        namespaces: Iterable[str] = (),
        auto_create_namespaces: bool = True,
        metrics: StoreMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        events: EventSink | None = None,
        id_tag: int | None = None,
        watch_tiers: bool = True,
    ) -> None:
        """``id_tag``: put in every lease and slot id (see :class:`~kvstore.store.leases.LeaseTable`),
        so a :class:`~kvstore.store.group.StoreGroup` routes an id to its store. ``watch_tiers``
        False: the caller reports this store's tier gauges itself (a group sums its stores')."""
        chain = tiers if isinstance(tiers, TierChain) else TierChain(list(tiers), edges)
        limits = limits or StoreLimits.from_settings()
        if limits.max_block_bytes > chain.head.capacity_bytes:
            raise ValueError(
                f"max block size {limits.max_block_bytes} exceeds the {chain.head.name.label} tier's "
                f"{chain.head.capacity_bytes} bytes: raise its size or lower --max-block-bytes"
            )
        self.limits = limits
        self.metrics = metrics or StoreMetrics()
        state = StoreState(chain, limits, self.metrics, clock, namespaces, auto_create_namespaces, events, id_tag)
        super().__init__(state)
        self._leases = state.leases
        self._closed = threading.Event()
        state.namespaces |= recover(chain, state.catalog, state.recency)
        self._copies = CopyDown(state)
        threads = limits.demotion_threads if len(chain) > 1 else 0
        self._demoter = Demoter(self._copies.copy_down, limits.demotion_queue_blocks, threads)
        self._copies.offer = self._demoter.offer
        self._place = HeadPlacement(state, self._demoter)
        self._reader = ChainReader(state, self._place)
        self._slots = SlotProtocol(state, self._place)
        self._writes = StreamedWrites(state, self._place, self.put)
        self._holds = BlockHolds(state, self._place, self._reader)
        self._moves = BlockMoves(state, self._copies, self.get_many)
        self._copies.fit_capacity()
        self._upkeep = Upkeep(state)
        if watch_tiers:
            self.metrics.watch_tiers(self.tier_stats, self.demotion_queue_depth)
        for level in chain.remote():
            if hasattr(level.tier, "on_gone"):
                level.tier.on_gone(lambda keys, name=level.name: self.forget_remote(keys, name))
        self._reaper = threading.Thread(target=self._reap_loop, name="strata-lease-reaper", daemon=True)
        self._reaper.start()

    @property
    def chain(self) -> TierChain:
        return self._chain

    @property
    def head(self):
        """The mappable tier at the top of the chain (the shared arena)."""
        return self._head

    def create_namespace(self, namespace: str) -> None:
        with self._cond:
            self._s.namespaces.add(validate_namespace(namespace))

    def namespaces(self) -> list[str]:
        with self._cond:
            return sorted(self._s.namespaces)

    def put(self, key: BlockKey, data: bytes | bytearray | memoryview, meta: BlockMeta, deadline: float | None = None) -> tuple[bool, TierName]:
        """Store a block; returns (stored, tier). ``stored`` is False for a repeated put."""
        self._s.checks.check_block(key, meta)
        data = memoryview(data).cast("B")
        if len(data) != meta.size:
            raise InvalidArgument(f"block {key} declares {meta.size} bytes but {len(data)} were sent")
        with self._cond:
            self._s.known_namespace(key.namespace, write=True)
            entry = self._catalog.live(key)
            if entry is not None:
                self._s.touch_locked(key, entry)
                return False, self._s.best(entry)
            parent = self._s.pin_parent_locked(key, meta)
        try:
            return self._put_new(key, data, meta, deadline)
        finally:
            if parent:
                with self._s.locked():
                    for p in parent:
                        self._s.unpin_locked(p, self._catalog.entries[p])

    def _put_new(self, key: BlockKey, data: memoryview, meta: BlockMeta, deadline: float | None) -> tuple[bool, TierName]:
        offset = self._place.reserve(meta.size, deadline)
        try:
            got = self._head.write_extent(offset, data)
        except BaseException:
            with self._cond:
                self._head.unreserve(offset)
            raise
        if got != meta.checksum:
            with self._cond:
                self._head.unreserve(offset)
                self._cond.notify_all()
            self.metrics.corrupt.labels(self._head.name.label).inc()
            raise CorruptBlock(
                f"block {key}: the bytes received do not match the checksum the writer declared "
                f"({got:#018x} != {meta.checksum:#018x}); nothing was stored: send it again"
            )
        return self._place.adopt(key, offset, meta, verify=False)

    def open_write(self, key: BlockKey, meta: BlockMeta) -> BlockWriter:
        """A writer that puts a streamed block's chunks straight into the head as they arrive
        (see :mod:`kvstore.store.writer`); commit or abort it."""
        return self._writes.open(key, meta)

    def get(self, key: BlockKey, *, local_only: bool = False) -> tuple[bytes, BlockMeta, TierName] | None:
        """A verified copy of the block, or None on a miss. Hits below the head are promoted.

        ``local_only``: only this node's own tiers answer, never a remote one (what a peer
        asks: a fetch it sends here must not be sent on to a third node, or back to it)."""
        with self._cond:
            self._s.expire_locked()
            self._s.readable_namespace(key.namespace)
            entry = self._catalog.live(key)
            if entry is not None:
                entry.pins += 1
                self._s.touch_locked(key, entry)
        if entry is None:
            got = None if local_only else self._reader.read_through(key, self._clock() + self.limits.put_wait_s)
            if got is None:
                self.metrics.misses.inc()
            return got
        with self._cond:
            listed = frozenset(entry.tiers)
        corrupt: CorruptBlock | None = None
        try:
            found = self._reader.read_best(key, entry, local_only=local_only)
        except CorruptBlock as err:  # no sound copy was left where the store listed one
            found, corrupt = None, err
        finally:
            with self._s.locked():
                self._s.unpin_locked(key, entry)
        if found is None:
            got = None if local_only else self._reader.read_through(key, self._clock() + self.limits.put_wait_s,
                                                                    skip=listed)
            if got is not None:
                return got
            if corrupt is not None:
                raise corrupt
            self.metrics.misses.inc()
            return None
        data, tier = found
        self.metrics.hits.labels(tier.label).inc()
        self.metrics.bytes_out.labels(tier.label).inc(len(data))
        if self._chain.promotes(tier):
            self._place.promote(key, data, entry.meta, self._clock(), tier)
        return data, entry.meta, tier

    def get_many(self, namespace: str, keys: Sequence[bytes], *, local_only: bool = False
                 ) -> Iterator[tuple[bytes, BlockMeta, TierName] | None]:
        """:meth:`get` of each key, in order, as each is read; the blocks no local tier holds are read
        through together, :data:`~kvstore.store.reads.READ_THROUGH_BATCH` at a time."""
        for start in range(0, len(keys), READ_THROUGH_BATCH):
            window = [BlockKey.checked(namespace, k) for k in keys[start:start + READ_THROUGH_BATCH]]
            fetched = {}
            if not local_only:
                with self._cond:
                    self._s.expire_locked()
                    self._s.readable_namespace(namespace)
                fetched = self._reader.read_through_absent(window, self._clock() + self.limits.put_wait_s)
            for key in window:
                if key in fetched:
                    got = fetched.pop(key)
                    if got is None:
                        self.metrics.misses.inc()
                    yield got
                else:
                    yield self.get(key, local_only=local_only)

    def allocate(
        self, namespace: str, blocks: list[tuple[bytes, int, bytes | None, str]], lease_s: float | None = None,
        deadline: float | None = None, owner: str = "",
    ) -> list[SlotGrant]:
        """Reserve head extents for blocks a same-host client writes itself (see :mod:`kvstore.store.slots`)."""
        return self._slots.allocate(namespace, blocks, lease_s, deadline, owner)

    def writing(self, slot_id: int, owner: str = "") -> AbstractContextManager[SlotWrite]:
        """Around the daemon's own write into a slot: only while its lease is live, and the extent
        is kept until the write ends (see :mod:`kvstore.store.slots`)."""
        return self._slots.writing(slot_id, owner)

    def commit(self, items: list[tuple[int, int]], owner: str = "") -> list[tuple[BlockKey, bool, TierName]]:
        """Turn written slots into blocks; ``items`` holds (slot_id, the writer's checksum)."""
        return self._slots.commit(items, owner)

    def abort(self, slot_ids: Iterable[int], owner: str = "") -> None:
        self._slots.abort(slot_ids, owner)

    def check_batch(self, items) -> None:
        self._s.checks.check_batch(items)

    def lookup(
        self, namespace: str, keys: list[bytes], lease_s: float | None = None, deadline: float | None = None,
        owner: str = "", *, local_only: bool = False,
    ) -> list[Located | None]:
        """Lease each present block in place in the head (None for a miss; see :mod:`kvstore.store.holds`).
        ``local_only`` as for :meth:`get` (a peer's read over the peer data plane)."""
        return self._holds.lookup(namespace, keys, lease_s, deadline, owner, local_only=local_only)

    def release(self, lease_ids: Iterable[int], owner: str = "") -> list[bool]:
        """End read leases; per lease, whether it was still valid (the bytes read were stable)."""
        return self._holds.release(lease_ids, owner)

    def exists(self, namespace: str, keys: list[bytes]) -> list[TierName]:
        """Tiers of the leading present keys of a chain (stops at the first miss).

        Keys past the first local miss are asked of the remote tiers that answer existence
        (``answers_exists``: the object tier, whose bucket a fresh node has not read yet), at
        most ``EXISTS_THROUGH_KEYS`` of them in one lookup within the tier's call deadline; a
        tier that fails or is slow answers nothing more. Nothing is read or cached by this."""
        self.check_batch(keys)
        keys = [validate_key(k) for k in keys]
        with self._cond:
            self._s.readable_namespace(namespace)
            tiers = []
            for k in keys:
                entry = self._catalog.live(BlockKey(namespace, k))
                if entry is None or not entry.tiers:
                    break
                tiers.append(self._s.best(entry))
        rest = [BlockKey(namespace, k) for k in keys[len(tiers):len(tiers) + EXISTS_THROUGH_KEYS]]
        for level in self._chain.remote() if rest else ():
            if not getattr(level.tier, "answers_exists", False):
                continue
            try:
                found = level.tier.lookup_many(rest)
            except StrataError as err:
                log.warning("the %s tier could not answer exists: %s", level.name.label, err)
                continue
            for meta in found:
                if meta is None:
                    break
                tiers.append(level.name)
            break
        return tiers

    def forget_remote(self, keys: Iterable[BlockKey], tier: TierName) -> int:
        """Forget copies a remote tier says it no longer has (a lifecycle sweep deleted them), so
        this store, and the index through its events, stop offering them. Returns how many."""
        forgotten = 0
        with self._s.locked():
            for key in keys:
                entry = self._catalog.get(key)
                if entry is not None and tier in entry.tiers:
                    self._s.forget_copy_locked(key, entry, tier)
                    forgotten += 1
        return forgotten

    def touch(self, namespace: str, keys: list[bytes]) -> int:
        """Mark blocks used (a client read them without asking); returns how many are present."""
        self.check_batch(keys)
        keys = [validate_key(k) for k in keys]
        touched = 0
        with self._cond:
            self._s.readable_namespace(namespace)
            for k in keys:
                entry = self._catalog.live(BlockKey(namespace, k))
                if entry is not None:
                    self._s.touch_locked(BlockKey(namespace, k), entry)
                    touched += 1
        return touched

    def delete(self, namespace: str, keys: list[bytes]) -> int:
        self.check_batch(keys)
        keys = [validate_key(k) for k in keys]
        deleted = 0
        with self._s.locked():
            self._s.known_namespace(namespace)
            for k in keys:
                key = BlockKey(namespace, k)
                entry = self._catalog.live(key)
                if entry is None:
                    continue
                entry.deleted = True
                deleted += 1
                self._s.emit_locked(Removed(key, dropped=False))
                self._s.maybe_remove_locked(key, entry)
            self._cond.notify_all()
        return deleted

    def list_keys(self, namespace: str, prefix: bytes = b"", page_size: int = 0, page_token: bytes = b"") -> tuple[list[Listed], bytes]:
        """One page of a namespace's keys that start with ``prefix``, in byte order.

        Returns the page and the token of the next one (empty after the last
        page). The token is the last key returned, so a listing resumes where
        it stopped whatever was stored or evicted in between.
        """
        if len(prefix) > MAX_KEY_BYTES:
            raise InvalidArgument(f"list prefix is {len(prefix)} bytes; keys have at most {MAX_KEY_BYTES}")
        if page_size > MAX_LIST_PAGE:
            raise InvalidArgument(f"list page_size {page_size} is over the limit of {MAX_LIST_PAGE}: ask for smaller pages")
        if page_token and (len(page_token) > MAX_KEY_BYTES or not page_token.startswith(prefix)):
            raise InvalidArgument(
                "page_token was not issued for this listing's prefix: pass back next_page_token unchanged, "
                "with the same prefix, or none to start over"
            )
        with self._cond:
            self._s.known_namespace(namespace)
            page, token = self._catalog.page(namespace, prefix, page_size or DEFAULT_LIST_PAGE, page_token)
            return [Listed(k, e.meta, self._s.best(e)) for k, e in page], token

    def lease(
        self, namespace: str, keys: list[bytes], kind: LeaseKind, lease_s: float | None = None, owner: str = "",
    ) -> tuple[Lease, list[bytes]]:
        """Hold present blocks under a lease of ``kind`` (never evicted until it ends); returns (lease, missing keys).
        Any component defines its own kind and ends it with :meth:`end_lease`."""
        return self._holds.lease(namespace, keys, kind, lease_s, owner)

    def end_lease(self, lease_id: int, kind: LeaseKind, owner: str = "") -> bool:
        """End a lease early; False when it already ended (expired or released)."""
        return self._holds.end_lease(lease_id, kind, owner)

    def meta(self, namespace: str, key: bytes) -> BlockMeta | None:
        """A stored block's metadata (size, checksum, parent, layout); None when it is not stored."""
        with self._s.locked():
            entry = self._catalog.live(BlockKey(namespace, key))
            return None if entry is None else entry.meta

    def extend_lease(self, lease_id: int, kind: LeaseKind, lease_s: float) -> float:
        """Move a live lease's deadline to ``lease_s`` from now (never earlier); returns the deadline.
        Raises LeaseExpired or UnknownLease when it already ended."""
        return self._holds.extend_lease(lease_id, kind, lease_s)

    def pin(self, namespace: str, keys: list[bytes], lease_s: float | None = None, owner: str = "") -> tuple[Lease, list[bytes]]:
        """Protect present blocks from eviction until the lease ends; returns (lease, missing keys)."""
        return self.lease(namespace, keys, LeaseKind.PIN, lease_s, owner)

    def unpin(self, lease_id: int, owner: str = "") -> bool:
        return self.end_lease(lease_id, LeaseKind.PIN, owner)

    def tier_stats(self) -> list[TierStats]:
        """Each tier's occupancy; ``degraded`` says why a tier cannot do its job now (see :mod:`kvstore.store.upkeep`)."""
        return self._upkeep.tier_stats()

    def upkeep(self) -> None:
        """Let every tier check its device again (the reaper does this every second)."""
        self._upkeep.upkeep()

    def demotion_queue_depth(self) -> int:
        return self._demoter.depth()

    def stats(self, namespace: str = "") -> StoreStats:
        with self._s.locked():
            self._s.expire_locked()
            entries = self._catalog.entries
            if namespace:
                self._s.known_namespace(namespace)
                pinned = sum(1 for k, e in entries.items() if e.pins and k.namespace == namespace)
                blocks = self._catalog.count(namespace)
                namespaces = [namespace]
            else:
                pinned = sum(1 for e in entries.values() if e.pins)
                blocks = len(entries)
                namespaces = sorted(self._s.namespaces)
            return StoreStats(
                tiers=self.tier_stats(),
                blocks=blocks,
                pinned_blocks=pinned,
                active_leases=len(self._leases),
                open_slots=self._leases.count(LeaseKind.SLOT),
                demotion_queue_depth=self._demoter.depth(),
                namespaces=namespaces,
            )

    def holdings(self, page_blocks: int = 4096) -> Iterator[tuple[BlockKey, TierName]]:
        """Every visible block and its best tier: what a full re-publish to the index sends.

        Read a page at a time, so the store lock is never held for O(blocks):
        a block changed after its page was read is told by an event instead.
        """
        with self._cond:
            namespaces = self._catalog.namespaces()
        for namespace in namespaces:
            token = b""
            while True:
                with self._cond:
                    page, token = self._catalog.page(namespace, b"", page_blocks, token)
                    found = [(BlockKey(namespace, k), self._s.best(e)) for k, e in page]
                yield from found
                if not token:
                    break

    def expire_leases(self) -> None:
        """Reclaim leases past their deadline now (the reaper does this every 100 ms)."""
        with self._s.locked():
            self._s.expire_locked()

    def flush_demotions(self) -> None:
        """Write every queued copy now, in the calling thread."""
        self._demoter.flush()

    def flush_recency(self) -> int:
        """Write the recency of persistent tiers back to them now (the reaper does this every second)."""
        return self._upkeep.flush_recency()

    def place(self, namespace: str, keys: list[bytes], warm: bool) -> Placed:
        """Move held blocks into the head tier (``warm``) or out of it, for an engine's hint
        (:class:`~kvstore.store.moves.BlockMoves`)."""
        self.check_batch(keys)
        return self._moves.place(namespace, [validate_key(k) for k in keys], warm)

    def persist_ram(self, deadline: float, evict: bool = True) -> int:
        """Write blocks held only in the head down the chain, most recent first, until ``deadline``.

        Called on a graceful stop so a restarted daemon finds its cache warm.
        ``evict`` False keeps the head's copies too (its arena outlives the
        process and the next start re-adopts it). Returns the number of
        blocks written.
        """
        below = self._chain.below(self._head.name)
        if below is None:
            return 0
        head = self._head.name
        written = 0
        with self._cond:
            keys = [k for k in self._recency.newest(head) if self._catalog.entries[k].tiers == {head}]
        for key in keys:
            if self._clock() >= deadline:
                break
            with self._cond:
                entry = self._catalog.live(key)
                if entry is None or entry.tiers != {head} or not self._s.mark_copy_locked(key, below.name):
                    continue
            self._copies.copy_down(Copy(key, head, below.name, evict=evict))
            written += below.name in entry.tiers
        self.flush_recency()
        return written

    def close(self) -> None:
        self._closed.set()
        self._demoter.close()
        self._reaper.join(timeout=5)
        self._s.run_deletes()
        try:
            self.flush_recency()
        except Exception as err:  # noqa: BLE001 - closing: the order is a hint, report and go on
            log.warning("recency not written back at close: %s", err)
        for level in self._chain:
            try:
                level.tier.close()
            except BufferError:
                # A view still held somewhere (an RPC past its grace period, an
                # exception's traceback): collect cycles and try once more. The
                # file is already unlinked (or kept for the next start); the
                # mapping goes with the process.
                gc.collect()
                try:
                    level.tier.close()
                except BufferError:
                    log.warning("%s tier still mapped at close; the mapping is freed at exit", level.name.label)

    def _reap_loop(self) -> None:
        ticks = 0
        while not self._closed.wait(0.1):
            self.expire_leases()
            ticks += 1
            if ticks % 10 == 0:
                try:
                    self.flush_recency()
                except Exception:  # a bug: the order is a hint; keep reaping leases
                    log.exception("writing recency back failed unexpectedly")
                try:
                    self.upkeep()
                except Exception:  # a bug in a tier's upkeep: keep reaping leases
                    log.exception("tier upkeep failed unexpectedly")
