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
  a component defines.

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
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from kvstore.block import (
    MAX_KEY_BYTES,
    BlockKey,
    BlockMeta,
    TierName,
    checksum,
    copy_and_checksum,
    validate_key,
    validate_namespace,
)
from kvstore.errors import (
    BlockTooLarge,
    CorruptBlock,
    InvalidArgument,
    LeaseError,
    LeaseOwnedElsewhere,
    TierFull,
    TierUnavailable,
    UnknownNamespace,
)
from kvstore.metrics import StoreMetrics
from kvstore.store.chain import Level, TierChain
from kvstore.store.demotion import Copy, Demoter
from kvstore.store.entries import Catalog, Entry
from kvstore.store.eviction import plan_eviction
from kvstore.store.leases import Lease, LeaseKind, LeaseTable
from kvstore.store.limits import EdgePolicy, StoreLimits
from kvstore.store.recency import Recency
from kvstore.store.recovery import recover
from kvstore.tiers.base import Tier, TierStats

log = logging.getLogger(__name__)

DEFAULT_LIST_PAGE = 1000
MAX_LIST_PAGE = 10000

__all__ = ["Located", "Listed", "SlotGrant", "StoreLimits", "StoreStats", "TieredStore"]


@dataclass(frozen=True, slots=True)
class Located:
    """A block found by :meth:`TieredStore.lookup`.

    ``lease_id`` 0 means the block exists but could not be brought into the
    head (it is full of pinned blocks): read it with :meth:`TieredStore.get`.
    """

    key: BlockKey
    meta: BlockMeta
    tier: TierName
    offset: int = 0
    lease_id: int = 0


@dataclass(frozen=True, slots=True)
class SlotGrant:
    key: BlockKey
    present: bool
    slot_id: int = 0
    offset: int = 0
    size: int = 0


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


class TieredStore:
    def __init__(
        self,
        tiers: TierChain | Sequence[Tier],
        *,
        edges: Sequence[EdgePolicy] = (),
        limits: StoreLimits = StoreLimits(),
        namespaces: Iterable[str] = (),
        auto_create_namespaces: bool = True,
        metrics: StoreMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        listener: Callable[[BlockKey, TierName | None], None] | None = None,
    ) -> None:
        self._chain = tiers if isinstance(tiers, TierChain) else TierChain(list(tiers), edges)
        self._head = self._chain.head
        if limits.max_block_bytes > self._head.capacity_bytes:
            raise ValueError(
                f"max block size {limits.max_block_bytes} exceeds the {self._head.name.label} tier's "
                f"{self._head.capacity_bytes} bytes: raise its size or lower --max-block-bytes"
            )
        self.limits = limits
        self.metrics = metrics or StoreMetrics()
        self._clock = clock
        # Told (under the store lock: it must not block) whenever a block's
        # best tier changes or the block goes (None): the prefix index's feed.
        self._listener = listener
        self._auto_create = auto_create_namespaces
        self._namespaces = {validate_namespace(ns) for ns in namespaces}
        self._cond = threading.Condition(threading.Lock())
        self._catalog = Catalog()
        self._recency = Recency(self._chain.names, self._chain.persistent())
        self._leases = LeaseTable(limits.max_leases)
        self._unhealthy_until: dict[TierName, float] = {}
        self._demoting = 0  # blocks marked for a copy down, queued or being written
        # Deletes of copies in tiers other than the head, run outside the lock.
        self._deletes: list[tuple[Tier, BlockKey]] = []
        self._deleting: dict[tuple[TierName, BlockKey], int] = {}
        self._closed = threading.Event()
        self._namespaces |= recover(self._chain, self._catalog, self._recency)
        threads = limits.demotion_threads if len(self._chain) > 1 else 0
        self._demoter = Demoter(self._copy_down, limits.demotion_queue_blocks, threads)
        self.metrics.watch_tiers(self.tier_stats, self.demotion_queue_depth)
        self._reaper = threading.Thread(target=self._reap_loop, name="strata-lease-reaper", daemon=True)
        self._reaper.start()

    @property
    def chain(self) -> TierChain:
        return self._chain

    @property
    def head(self):
        """The mappable tier at the top of the chain (the shared arena)."""
        return self._head

    # ---- namespaces -------------------------------------------------------

    def create_namespace(self, namespace: str) -> None:
        with self._cond:
            self._namespaces.add(validate_namespace(namespace))

    def namespaces(self) -> list[str]:
        with self._cond:
            return sorted(self._namespaces)

    def _known_namespace(self, namespace: str, *, write: bool = False) -> None:
        validate_namespace(namespace)
        if namespace in self._namespaces:
            return
        if write and self._auto_create:
            self._namespaces.add(namespace)
            return
        raise UnknownNamespace(
            f"namespace {namespace!r} is unknown to this daemon: nothing was ever stored in it "
            "(check the model or tenant name), or declare it with --namespaces"
        )

    def _readable_namespace(self, namespace: str) -> None:
        """Reads of a namespace this node never saw are errors, unless a remote tier may hold it."""
        try:
            self._known_namespace(namespace)
        except UnknownNamespace:
            if not self._chain.remote():
                raise

    def _read_through(self, key: BlockKey, deadline: float | None) -> tuple[bytes, BlockMeta, TierName] | None:
        """A block no local tier holds, read from the first remote tier that has it, verified.

        The block joins the catalogue as held by that remote tier, and is
        promoted into the head when the edges allow. A remote tier that is
        down, slow or answers with a corrupt block is a miss here: local
        serving never waits on it beyond its call deadline.
        """
        for level in self._chain.remote():
            try:
                found = level.tier.fetch(key)
            except CorruptBlock as err:
                self.metrics.corrupt.labels(level.name.label).inc()
                log.error("remote tier %s sent a corrupt copy of %s: %s", level.name.label, key, err)
                continue
            except TierUnavailable as err:
                self.metrics.tier_errors.labels(level.name.label).inc()
                log.warning("remote tier %s could not be read for %s: %s", level.name.label, key, err)
                continue
            if found is None:
                continue
            data, meta = found
            if meta.size <= 0 or meta.size > self.limits.max_block_bytes:
                log.warning("remote tier %s holds %s of %d bytes, outside this daemon's limits: ignored",
                            level.name.label, key, meta.size)
                continue
            with self._locked():
                self._namespaces.add(key.namespace)
                if self._catalog.get(key) is None:
                    entry = Entry(meta, {level.name})
                    self._catalog.add(key, entry)
                    self._recency.add(level.name, key)
                    self._publish_locked(key, entry)
            self.metrics.hits.labels(level.name.label).inc()
            self.metrics.bytes_out.labels(level.name.label).inc(meta.size)
            if self._chain.promotes(level.name):
                self._promote(key, data, meta, deadline)
            return bytes(data), meta, level.name
        return None

    @contextmanager
    def _locked(self):
        """The store lock; deletes queued while it was held run once it is released."""
        with self._cond:
            yield
        if self._deletes:
            self._run_deletes()

    # ---- streamed put / get -----------------------------------------------

    def put(self, key: BlockKey, data: bytes | bytearray | memoryview, meta: BlockMeta, deadline: float | None = None) -> tuple[bool, TierName]:
        """Store a block; returns (stored, tier). ``stored`` is False for a repeated put."""
        self._check_block(key, meta)
        data = memoryview(data).cast("B")
        if len(data) != meta.size:
            raise InvalidArgument(f"block {key} declares {meta.size} bytes but {len(data)} were sent")
        with self._cond:
            self._known_namespace(key.namespace, write=True)
            entry = self._catalog.live(key)
            if entry is not None:
                self._touch_locked(key, entry)
                return False, self._best(entry)
            parent = self._pin_parent_locked(key, meta)
        try:
            return self._put_new(key, data, meta, deadline)
        finally:
            with self._locked():
                for p in parent:
                    self._unpin_locked(p, self._catalog.entries[p])

    def _put_new(self, key: BlockKey, data: memoryview, meta: BlockMeta, deadline: float | None) -> tuple[bool, TierName]:
        offset = self._reserve(meta.size, deadline)
        view = self._head.view(offset, meta.size)
        try:
            got = copy_and_checksum(view, data)
        except BaseException:
            view.release()
            with self._cond:
                self._head.unreserve(offset)
            raise
        view.release()
        if got != meta.checksum:
            with self._cond:
                self._head.unreserve(offset)
                self._cond.notify_all()
            self.metrics.corrupt.labels(self._head.name.label).inc()
            raise CorruptBlock(
                f"block {key}: the bytes received do not match the checksum the writer declared "
                f"({got:#018x} != {meta.checksum:#018x}); nothing was stored: send it again"
            )
        return self._adopt(key, offset, meta, verify=False)

    def get(self, key: BlockKey) -> tuple[bytes, BlockMeta, TierName] | None:
        """A verified copy of the block, or None on a miss. Hits below the head are promoted."""
        with self._cond:
            self._expire_locked()
            self._readable_namespace(key.namespace)
            entry = self._catalog.live(key)
            if entry is not None:
                entry.pins += 1
                self._touch_locked(key, entry)
        if entry is None:
            got = self._read_through(key, self._clock() + self.limits.put_wait_s)
            if got is None:
                self.metrics.misses.inc()
            return got
        try:
            found = self._read_best(key, entry)
        finally:
            with self._locked():
                self._unpin_locked(key, entry)
        if found is None:
            self.metrics.misses.inc()
            return None
        data, tier = found
        self.metrics.hits.labels(tier.label).inc()
        self.metrics.bytes_out.labels(tier.label).inc(len(data))
        if self._chain.promotes(tier):
            self._promote(key, data, entry.meta, deadline=self._clock())
        return data, entry.meta, tier

    def _read_best(self, key: BlockKey, entry: Entry) -> tuple[bytes, TierName] | None:
        """Read a pinned block from the highest tier that holds it, verified.

        A tier whose copy went meanwhile (a race with a move down) or turned
        out corrupt is passed over for the next one down; a tier that fails
        raises TierUnavailable.
        """
        with self._cond:
            order = self._chain.ordered(entry.tiers)
        corrupt: CorruptBlock | None = None
        for tier in order:
            try:
                data = self._read(key, entry.meta, tier)
            except CorruptBlock as err:
                corrupt = err
                continue
            except TierUnavailable:
                if self._chain.tier(tier).remote:  # another machine's copy, unreachable now: not a local failure
                    continue
                raise
            if data is not None:
                return data, tier
        if corrupt is not None:  # no sound copy was left: the caller learns why it is gone
            raise corrupt
        return None

    def _read(self, key: BlockKey, meta: BlockMeta, tier: TierName) -> bytes | None:
        """Read a pinned block from one tier, verified; drop that copy if corrupt."""
        try:
            if self._chain.is_head(tier):
                loc = self._head.locate(key)
                if loc is None:
                    return None
                view = self._head.view(loc[0], meta.size)
                try:
                    data = bytes(view)
                finally:
                    view.release()
                if checksum(data) != meta.checksum:
                    raise CorruptBlock(f"block {key} failed its checksum in the {tier.label} tier")
                return data
            return self._chain.tier(tier).get(key)
        except CorruptBlock:
            log.error("dropping corrupt block %s found in tier %s", key, tier.label)
            self.metrics.corrupt.labels(tier.label).inc()
            with self._locked():
                entry = self._catalog.get(key)
                if entry is not None:
                    self._drop_copy_locked(key, entry, tier)
            raise
        except TierUnavailable as err:
            self.metrics.tier_errors.labels(tier.label).inc()
            log.error("tier %s failed reading %s: %s", tier.label, key, err)
            raise

    # ---- shared-memory path -----------------------------------------------

    def allocate(
        self, namespace: str, blocks: list[tuple[bytes, int, bytes | None, str]], lease_s: float | None = None,
        deadline: float | None = None, owner: str = "",
    ) -> list[SlotGrant]:
        """Reserve head extents for blocks a same-host client will write itself.

        ``blocks`` holds (key, size, parent_key, layout). A key already stored
        gets ``present=True`` and no slot. All slots or none: if one cannot be
        reserved, the ones reserved so far are given back.
        """
        self.check_batch(blocks)
        lease_s = self._lease_seconds(lease_s, self.limits.lease_s)
        with self._cond:
            self._known_namespace(namespace, write=True)
        grants: list[SlotGrant] = []
        try:
            for key_bytes, size, parent, layout in blocks:
                key = BlockKey(namespace, validate_key(key_bytes))
                meta = BlockMeta(size=size, checksum=0, parent=parent or None, layout=layout)
                self._check_block(key, meta)
                with self._cond:
                    entry = self._catalog.live(key)
                    if entry is not None:
                        self._touch_locked(key, entry)
                        grants.append(SlotGrant(key, present=True))
                        continue
                offset = self._reserve(size, deadline)
                with self._cond:
                    try:
                        lease = self._leases.issue(
                            LeaseKind.SLOT, self._clock() + lease_s, block=key, offset=offset, meta=meta, owner=owner
                        )
                    except BaseException:
                        self._head.unreserve(offset)
                        raise
                    lease.keys = self._pin_parent_locked(key, meta)
                grants.append(SlotGrant(key, False, lease.id, offset, size))
        except BaseException:
            self.abort([g.slot_id for g in grants if not g.present], owner=owner)
            raise
        return grants

    def commit(self, items: list[tuple[int, int | None]], owner: str = "") -> list[tuple[BlockKey, bool, TierName]]:
        """Turn written slots into blocks; ``items`` holds (slot_id, checksum or None).

        With no checksum the daemon computes it from the slot: the bytes were
        written in place and never travelled, so this is where the block's
        checksum is born. A given checksum is verified (``verify_commits``).
        All or nothing: every slot must be live, else nothing is committed
        and the live slots stay open. A mismatch frees every slot of the
        request and raises CorruptBlock.
        """
        self.check_batch(items)
        with self._cond:
            self._expire_locked()
            now = self._clock()
            taken: list[Lease] = []
            try:
                for slot_id, _ in items:
                    taken.append(self._leases.take(slot_id, LeaseKind.SLOT, now, owner))
            except LeaseError:
                for lease in taken:  # put them back untouched
                    self._leases.restore(lease)
                raise
        metas, bad = [], []
        for lease, (_, declared) in zip(taken, items):
            if declared is None or self.limits.verify_commits:
                view = self._head.view(lease.offset, lease.meta.size)
                try:
                    actual = checksum(view)
                finally:
                    view.release()
                if declared is not None and actual != declared:
                    bad.append(lease.block)
            else:
                actual = declared
            metas.append(BlockMeta(lease.meta.size, actual, lease.meta.parent, lease.meta.layout))
        if bad:
            with self._locked():
                for lease in taken:
                    self._head.unreserve(lease.offset)
                    self._end_pins_locked(lease)
                self._cond.notify_all()
            self.metrics.corrupt.labels(self._head.name.label).inc(len(bad))
            raise CorruptBlock(
                f"{len(bad)} slot(s) hold bytes that do not match their checksum (first: {bad[0]}); "
                "nothing was committed: write the blocks again"
            )
        done = [(lease.block, *self._adopt(lease.block, lease.offset, meta, verify=False)) for lease, meta in zip(taken, metas)]
        with self._locked():
            for lease in taken:
                self._end_pins_locked(lease)
        return done

    def abort(self, slot_ids: Iterable[int], owner: str = "") -> None:
        with self._locked():
            now = self._clock()
            for slot_id in slot_ids:
                try:
                    lease = self._leases.take(slot_id, LeaseKind.SLOT, now, owner)
                except LeaseError:
                    continue  # expired or unknown: already given back
                self._head.unreserve(lease.offset)
                self._end_pins_locked(lease)
            self._cond.notify_all()

    def lookup(
        self, namespace: str, keys: list[bytes], lease_s: float | None = None, deadline: float | None = None,
        owner: str = "",
    ) -> list[Located | None]:
        """Lease each present block in place in the head (None for a miss).

        A block only below the head is promoted first; the reader then copies
        it out of the arena, verifies its checksum and releases the lease.
        """
        self.check_batch(keys)
        lease_s = self._lease_seconds(lease_s, self.limits.lease_s)
        with self._cond:
            self._readable_namespace(namespace)
        out: list[Located | None] = []
        for key_bytes in keys:
            key = BlockKey(namespace, validate_key(key_bytes))
            located = self._lease_in_head(key, lease_s, owner)
            if located is not None:
                self.metrics.hits.labels(self._head.name.label).inc()
                out.append(located)
                continue
            with self._cond:
                entry = self._catalog.live(key)
                if entry is not None:
                    entry.pins += 1
            if entry is None:
                got = self._read_through(key, deadline)
                if got is None:
                    self.metrics.misses.inc()
                    out.append(None)
                    continue
                located = self._lease_in_head(key, lease_s, owner, found_in=got[2])
                out.append(located or Located(key, got[1], got[2]))
                continue
            try:
                found = self._read_best(key, entry)
            except CorruptBlock:
                found = None  # dropped and counted; for a batch read it is a miss
            finally:
                with self._locked():
                    self._unpin_locked(key, entry)
            if found is None:
                self.metrics.misses.inc()
                out.append(None)
                continue
            data, tier = found
            self.metrics.hits.labels(tier.label).inc()
            if self._chain.is_head(tier) or (self._chain.promotes(tier) and self._promote(key, data, entry.meta, deadline)):
                located = self._lease_in_head(key, lease_s, owner, found_in=tier)
            out.append(located or Located(key, entry.meta, tier))
        return out

    def _lease_in_head(self, key: BlockKey, lease_s: float, owner: str, found_in: TierName | None = None) -> Located | None:
        with self._cond:
            self._expire_locked()
            entry = self._catalog.live(key)
            if entry is None or self._head.name not in entry.tiers:
                return None
            loc = self._head.locate(key)
            if loc is None:
                return None
            lease = self._leases.issue(LeaseKind.READ, self._clock() + lease_s, keys=[key], owner=owner)
            entry.pins += 1
            self._touch_locked(key, entry)
            self.metrics.bytes_out.labels(self._head.name.label).inc(entry.meta.size)
            return Located(key, entry.meta, found_in or self._head.name, loc[0], lease.id)

    def release(self, lease_ids: Iterable[int], owner: str = "") -> list[bool]:
        """End read leases; per lease, whether it was still valid (the bytes read were stable)."""
        out = []
        with self._locked():
            self._expire_locked()
            now = self._clock()
            for lease_id in lease_ids:
                try:
                    lease = self._leases.take(lease_id, LeaseKind.READ, now, owner)
                except LeaseError:
                    out.append(False)
                    continue
                self._end_pins_locked(lease)
                out.append(True)
        return out

    # ---- control ----------------------------------------------------------

    def exists(self, namespace: str, keys: list[bytes]) -> list[TierName]:
        """Tiers of the leading present keys of a chain (stops at the first miss)."""
        self.check_batch(keys)
        keys = [validate_key(k) for k in keys]
        with self._cond:
            self._readable_namespace(namespace)
            tiers = []
            for k in keys:
                entry = self._catalog.live(BlockKey(namespace, k))
                if entry is None or not entry.tiers:
                    break
                tiers.append(self._best(entry))
            return tiers

    def delete(self, namespace: str, keys: list[bytes]) -> int:
        self.check_batch(keys)
        keys = [validate_key(k) for k in keys]
        deleted = 0
        with self._locked():
            self._known_namespace(namespace)
            for k in keys:
                key = BlockKey(namespace, k)
                entry = self._catalog.live(key)
                if entry is None:
                    continue
                entry.deleted = True
                deleted += 1
                self._publish_locked(key, entry)
                self._maybe_remove_locked(key, entry)
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
            self._known_namespace(namespace)
            page, token = self._catalog.page(namespace, prefix, page_size or DEFAULT_LIST_PAGE, page_token)
            return [Listed(k, e.meta, self._best(e)) for k, e in page], token

    def lease(
        self, namespace: str, keys: list[bytes], kind: LeaseKind, lease_s: float | None = None, owner: str = "",
    ) -> tuple[Lease, list[bytes]]:
        """Hold present blocks under a lease of ``kind`` (never evicted until it ends); returns (lease, missing keys).

        Any component defines its own kind (a handoff, a replication copy, a
        weights reader) and ends it with :meth:`end_lease`.
        """
        if kind in (LeaseKind.READ, LeaseKind.SLOT):
            raise InvalidArgument(f"{kind.value} leases come from lookup and allocate, not from lease()")
        self.check_batch(keys)
        keys = [validate_key(k) for k in keys]
        lease_s = self._lease_seconds(lease_s, self.limits.pin_lease_s)
        with self._cond:
            self._expire_locked()
            self._known_namespace(namespace)
            present, missing = [], []
            for k in keys:
                key = BlockKey(namespace, k)
                (missing.append(k) if self._catalog.live(key) is None else present.append(key))
            lease = self._leases.issue(kind, self._clock() + lease_s, keys=present, owner=owner)
            for key in present:
                self._catalog.entries[key].pins += 1
            return lease, missing

    def end_lease(self, lease_id: int, kind: LeaseKind, owner: str = "") -> bool:
        """End a lease early; False when it already ended (expired or released)."""
        with self._locked():
            self._expire_locked()
            try:
                lease = self._leases.take(lease_id, kind, self._clock(), owner)
            except LeaseOwnedElsewhere:
                raise
            except LeaseError:
                return False
            self._end_pins_locked(lease)
            return True

    def pin(self, namespace: str, keys: list[bytes], lease_s: float | None = None, owner: str = "") -> tuple[Lease, list[bytes]]:
        """Protect present blocks from eviction until the lease ends; returns (lease, missing keys)."""
        return self.lease(namespace, keys, LeaseKind.PIN, lease_s, owner)

    def unpin(self, lease_id: int, owner: str = "") -> bool:
        return self.end_lease(lease_id, LeaseKind.PIN, owner)

    def tier_stats(self) -> list[TierStats]:
        return [lvl.tier.stats() for lvl in self._chain]

    def demotion_queue_depth(self) -> int:
        return self._demoter.depth()

    def stats(self, namespace: str = "") -> StoreStats:
        with self._locked():
            self._expire_locked()
            entries = self._catalog.entries
            if namespace:
                self._known_namespace(namespace)
                pinned = sum(1 for k, e in entries.items() if e.pins and k.namespace == namespace)
                blocks = self._catalog.count(namespace)
                namespaces = [namespace]
            else:
                pinned = sum(1 for e in entries.values() if e.pins)
                blocks = len(entries)
                namespaces = sorted(self._namespaces)
            return StoreStats(
                tiers=self.tier_stats(),
                blocks=blocks,
                pinned_blocks=pinned,
                active_leases=len(self._leases),
                open_slots=self._leases.count(LeaseKind.SLOT),
                demotion_queue_depth=self._demoter.depth(),
                namespaces=namespaces,
            )

    def holdings(self) -> list[tuple[BlockKey, TierName]]:
        """Every visible block and its best tier: what a full re-publish to the index sends."""
        with self._cond:
            return [(k, self._best(e)) for k, e in self._catalog.visible()]

    def expire_leases(self) -> None:
        """Reclaim leases past their deadline now (the reaper does this every 100 ms)."""
        with self._locked():
            self._expire_locked()

    def flush_demotions(self) -> None:
        """Write every queued copy now, in the calling thread."""
        self._demoter.flush()

    def flush_recency(self) -> int:
        """Write the recency of persistent tiers back to them now (the reaper does this every second)."""
        written = 0
        while True:
            with self._cond:
                touched = self._recency.take_touched(self.limits.touch_batch_blocks)
            if not touched:
                return written
            for tier, key in touched:
                try:
                    self._chain.tier(tier).touch(key)
                except TierUnavailable as err:  # the order is a hint: a failed stamp loses no block
                    log.warning("could not record the use of %s in tier %s: %s", key, tier.label, err)
                    return written
                written += 1

    def persist_ram(self, deadline: float) -> int:
        """Write blocks held only in the head down the chain, most recent first, until ``deadline``.

        Called on a graceful stop so a restarted daemon finds its cache warm.
        Returns the number of blocks written.
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
                if entry is None or entry.tiers != {head} or not self._mark_copy_locked(key, below.name):
                    continue
            self._copy_down(Copy(key, head, below.name, evict=True))
            written += below.name in entry.tiers
        self.flush_recency()
        return written

    def close(self) -> None:
        self._closed.set()
        self._demoter.close()
        self._reaper.join(timeout=5)
        self._run_deletes()
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
                # file is already unlinked; the mapping goes with the process.
                gc.collect()
                try:
                    level.tier.close()
                except BufferError:
                    log.warning("%s tier still mapped at close; it is unlinked and freed at exit", level.name.label)

    # ---- internals: checks ----------------------------------------------

    def _check_block(self, key: BlockKey, meta: BlockMeta) -> None:
        if meta.size <= 0:
            raise InvalidArgument(f"block {key} is empty: a block needs at least one byte")
        if meta.size > self.limits.max_block_bytes:
            raise BlockTooLarge(
                f"block {key} is {meta.size} bytes; this daemon's limit is {self.limits.max_block_bytes} "
                "(--max-block-bytes): split the value into smaller blocks"
            )

    def check_batch(self, items) -> None:
        if len(items) > self.limits.max_batch_blocks:
            raise InvalidArgument(
                f"{len(items)} blocks in one request; the limit is {self.limits.max_batch_blocks}: split the batch"
            )

    def _lease_seconds(self, requested: float | None, default: float) -> float:
        if requested is None or requested <= 0:
            return default
        if requested > self.limits.max_lease_s:
            raise InvalidArgument(f"lease of {requested:.0f}s exceeds the limit of {self.limits.max_lease_s:.0f}s")
        return requested

    # ---- internals: placement in the head ----------------------------------

    def _adopt(self, key: BlockKey, offset: int, meta: BlockMeta, verify: bool) -> tuple[bool, TierName]:
        head = self._head.name
        with self._cond:
            entry = self._catalog.get(key)
            if entry is not None and not entry.deleted:
                self._head.unreserve(offset)  # lost a race with another writer of the same key
                self._cond.notify_all()
                return False, self._best(entry)
            if entry is not None:
                # Deleted but still pinned by a reader: revive it. Keys are
                # content- or prefix-addressed, so the bytes are the same.
                entry.deleted = False
                self._head.unreserve(offset)
                self._cond.notify_all()
                self._publish_locked(key, entry)
                return True, self._best(entry)
            if not self._head.commit(key, offset, meta, verify=verify):
                self._cond.notify_all()
                return False, head
            entry = Entry(meta, {head})
            self._catalog.add(key, entry)
            self._recency.add(head, key)
            self.metrics.bytes_in.labels(head.label).inc(meta.size)
            self._publish_locked(key, entry)
            self._write_through_locked(key, entry)
            self._keep_headroom_locked()
            return True, head

    def _promote(self, key: BlockKey, data: bytes, meta: BlockMeta, deadline: float | None) -> bool:
        """Copy a block read below up into the head (keeping the lower copy); False when there is no room in time."""
        head = self._head.name
        try:
            offset = self._reserve(meta.size, deadline)
        except TierFull:
            return False
        view = self._head.view(offset, meta.size)
        view[:] = data
        view.release()
        with self._cond:
            entry = self._catalog.live(key)
            if entry is None or head in entry.tiers:
                self._head.unreserve(offset)
                self._cond.notify_all()
                return entry is not None and head in entry.tiers
            self._head.commit(key, offset, meta, verify=False)
            entry.tiers.add(head)
            self._recency.add(head, key)
            self._publish_locked(key, entry)
            self.metrics.promotions.inc()
            self.metrics.bytes_in.labels(head.label).inc(meta.size)
            return True

    def _reserve(self, size: int, deadline: float | None) -> int:
        """A head extent of ``size`` bytes, evicting and waiting (until ``deadline``) as needed."""
        if deadline is None:
            deadline = self._clock() + self.limits.put_wait_s
        with self._locked():
            while True:
                self._expire_locked()
                try:
                    return self._head.reserve(size)
                except TierFull:
                    pass
                freed, pending = self._make_room_locked(size)
                if freed:
                    continue
                remaining = deadline - self._clock()
                if not pending or remaining <= 0:
                    stats = self._head.stats()
                    raise TierFull(
                        f"the {self._head.name.label} tier has no room for {size} bytes ({stats.used_bytes} of "
                        f"{stats.capacity_bytes} used, largest free extent {self._head.largest_free_bytes}; the rest "
                        "is pinned, leased or being demoted): retry later, unpin blocks, or raise --ram-bytes",
                        retry_after_s=0.1,
                    )
                if not self._demoter.threaded:
                    # No demotion thread: write the queued blocks down here.
                    self._cond.release()
                    try:
                        self._run_deletes()
                        self._demoter.flush()
                    finally:
                        self._cond.acquire()
                else:
                    self._cond.wait(timeout=min(remaining, 0.05))

    def _keep_headroom_locked(self) -> None:
        stats = self._head.stats()
        if stats.used_bytes > self.limits.high_watermark * stats.capacity_bytes and self._usable_below(self._head.name):
            target_free = int((1 - self.limits.low_watermark) * stats.capacity_bytes)
            self._make_room_locked(target_free - (stats.capacity_bytes - stats.used_bytes), background=True)

    def _make_room_locked(self, need: int, background: bool = False) -> tuple[bool, bool]:
        """Evict from the head; returns (freed now, copies down pending)."""
        head = self._head.name
        below = self._usable_below(head)
        plan = plan_eviction(head, need, self._catalog, self._recency, can_demote=below is not None, background=background)
        self._apply_plan_locked(head, plan, below)
        return plan.frees_now, self._demoting > 0

    def _apply_plan_locked(self, tier: TierName, plan, below: Level | None) -> list[BlockKey]:
        """Carry out an eviction plan in ``tier``; returns the blocks marked for a copy down (not yet queued
        when the tier is not the head: the caller writes them itself)."""
        for key in plan.drop_copy:
            self._drop_copy_locked(key, self._catalog.entries[key], tier)
            self.metrics.evictions.labels(tier.label).inc()
        for key in plan.drop:
            self._remove_locked(key, self._catalog.entries[key])
            self.metrics.evictions.labels(tier.label).inc()
            self.metrics.drops.inc()
        marked = []
        for key in plan.demote:
            if below is None:
                break
            if not self._mark_copy_locked(key, below.name):
                continue  # its old copy below is still being deleted: try it next time
            if self._chain.is_head(tier) and not self._demoter.offer(Copy(key, tier, below.name, evict=True)):
                self._unmark_copy_locked(key)
                break
            marked.append(key)
        return marked

    def _pin_parent_locked(self, key: BlockKey, meta: BlockMeta) -> list[BlockKey]:
        """Pin the parent of a block being written, so eviction cannot take it meanwhile."""
        if not meta.parent:
            return []
        parent = BlockKey(key.namespace, meta.parent)
        entry = self._catalog.live(parent)
        if entry is None:
            return []
        entry.pins += 1
        return [parent]

    # ---- internals: copies down the chain ----------------------------------

    def _usable_below(self, tier: TierName) -> Level | None:
        """The next level down when it takes copies now (its edge demotes and it has not just failed)."""
        below = self._chain.below(tier)
        if below is None or not self._chain.edge_below(tier).demote:
            return None
        if self._clock() < self._unhealthy_until.get(below.name, 0.0):
            return None
        return below

    def _write_through_locked(self, key: BlockKey, entry: Entry) -> None:
        head = self._head.name
        below = self._chain.below(head)
        if below is None or not self._chain.edge_below(head).write_through:
            return
        if self._clock() < self._unhealthy_until.get(below.name, 0.0):
            return
        if self._mark_copy_locked(key, below.name):
            if not self._demoter.offer(Copy(key, head, below.name, evict=False)):
                self._unmark_copy_locked(key)  # queue full: eviction will demote it later

    def _mark_copy_locked(self, key: BlockKey, dst: TierName) -> bool:
        entry = self._catalog.entries[key]
        if entry.demoting or (dst, key) in self._deleting:
            return False
        entry.demoting = True
        self._demoting += 1
        return True

    def _unmark_copy_locked(self, key: BlockKey) -> None:
        entry = self._catalog.entries[key]
        entry.demoting = False
        self._demoting -= 1

    def _copy_down(self, job: Copy) -> None:
        """Write one marked block from ``job.src`` into ``job.dst``; then, for a demotion, drop the upper copy."""
        with self._cond:
            entry = self._catalog.get(job.key)
            if entry is None or not entry.demoting:
                return
            if entry.deleted or job.src not in entry.tiers:
                self._end_copy_locked(job.key, entry)
                return
        outcome = self._write_copy(job, entry)
        self.metrics.demotions.labels(outcome).inc()
        with self._locked():
            if outcome == "ok":
                if job.dst not in entry.tiers:
                    entry.tiers.add(job.dst)
                    self._recency.add(job.dst, job.key)
                self._publish_locked(job.key, entry)
                if job.evict and not entry.pins:  # a reader may be copying it out right now
                    self._drop_copy_locked(job.key, entry, job.src)
                    self.metrics.evictions.labels(job.src.label).inc()
            elif outcome == "corrupt":
                self._drop_copy_locked(job.key, entry, job.src)
            elif outcome == "failed":
                self._unhealthy_until[job.dst] = self._clock() + self.limits.tier_retry_s
            self._end_copy_locked(job.key, entry)

    def _write_copy(self, job: Copy, entry: Entry) -> str:
        """Move the bytes of one copy down; the outcome names what happened (a metric label)."""
        try:
            if self._chain.is_head(job.src):
                loc = self._head.locate(job.key)
                if loc is None:
                    return "gone"
                view = self._head.view(loc[0], entry.meta.size)
                try:
                    self._put_below(job.dst, job.key, view, entry.meta)
                finally:
                    view.release()
            else:
                data = self._chain.tier(job.src).get(job.key)
                if data is None:
                    return "gone"
                self._put_below(job.dst, job.key, data, entry.meta)
            return "ok"
        except CorruptBlock:
            log.error("block %s failed its checksum in the %s tier while being copied down: dropped", job.key, job.src.label)
            self.metrics.corrupt.labels(job.src.label).inc()
            return "corrupt"
        except (TierFull, BlockTooLarge) as err:
            log.warning("no room in the %s tier for %s, keeping it above: %s", job.dst.label, job.key, err)
            return "failed"
        except TierUnavailable as err:
            self.metrics.tier_errors.labels(job.dst.label).inc()
            log.warning("could not copy %s down to the %s tier, keeping it above: %s", job.key, job.dst.label, err)
            return "failed"

    def _end_copy_locked(self, key: BlockKey, entry: Entry) -> None:
        entry.demoting = False
        self._demoting -= 1
        self._maybe_remove_locked(key, entry)
        self._cond.notify_all()

    def _put_below(self, dst: TierName, key: BlockKey, data, meta: BlockMeta) -> None:
        """Write a block into a lower tier, evicting from it (and further down) as it fills."""
        tier = self._chain.tier(dst)
        if meta.size > tier.capacity_bytes:
            raise TierFull(f"block {key} ({meta.size} bytes) is larger than the whole {dst.label} tier")
        while True:
            try:
                tier.put(key, data, meta)
            except TierFull:
                if not self._evict_one_below(dst):
                    raise
                continue
            self.metrics.bytes_in.labels(dst.label).inc(meta.size)
            return

    def _evict_one_below(self, tier: TierName) -> bool:
        """Make room in a lower tier by one block: drop a copy held elsewhere, demote it further, or drop it."""
        below = self._usable_below(tier)
        with self._locked():
            plan = plan_eviction(tier, 1, self._catalog, self._recency, can_demote=below is not None, max_victims=1)
            marked = self._apply_plan_locked(tier, plan, below)
            if not (plan.frees_now or marked):
                return False
        for key in marked:  # this thread writes it further down itself: it is already a copy in flight
            self._copy_down(Copy(key, tier, below.name, evict=True))
        return True

    # ---- internals: bookkeeping -------------------------------------------

    def _best(self, entry: Entry) -> TierName:
        return self._chain.best(entry.tiers)

    def _touch_locked(self, key: BlockKey, entry: Entry) -> None:
        self._recency.touch(key, entry.tiers)

    def _unpin_locked(self, key: BlockKey, entry: Entry) -> None:
        entry.pins -= 1
        self._maybe_remove_locked(key, entry)

    def _end_pins_locked(self, lease: Lease) -> None:
        # A pinned entry cannot be removed, so each key still maps to the
        # entry the lease pinned.
        for key in lease.keys:
            self._unpin_locked(key, self._catalog.entries[key])
        self._cond.notify_all()

    def _maybe_remove_locked(self, key: BlockKey, entry: Entry) -> None:
        if entry.deleted and not entry.pins and not entry.demoting and self._catalog.get(key) is entry:
            self._remove_locked(key, entry)

    def _drop_copy_locked(self, key: BlockKey, entry: Entry, tier: TierName) -> None:
        if tier not in entry.tiers:
            return
        if len(entry.tiers) == 1:
            self._remove_locked(key, entry)
            return
        self._free_copy_locked(tier, key)
        entry.tiers.discard(tier)
        self._publish_locked(key, entry)
        self._cond.notify_all()

    def _remove_locked(self, key: BlockKey, entry: Entry) -> None:
        for tier in entry.tiers:
            self._free_copy_locked(tier, key)
        entry.tiers.clear()
        self._catalog.remove(key)
        self._publish_locked(key, None)
        self._cond.notify_all()

    def _free_copy_locked(self, tier: TierName, key: BlockKey) -> None:
        """Forget a copy now; free its bytes now in the head, after the lock elsewhere."""
        self._recency.discard(tier, key)
        if self._chain.is_head(tier):
            self._head.delete(key)
            return
        self._deletes.append((self._chain.tier(tier), key))
        self._deleting[(tier, key)] = self._deleting.get((tier, key), 0) + 1

    def _run_deletes(self) -> None:
        """Delete the copies queued under the lock (disk unlinks), outside it."""
        with self._cond:
            deletes, self._deletes = self._deletes, []
        for tier, key in deletes:
            try:
                tier.delete(key)
            except TierUnavailable as err:  # the copy is forgotten; recovery drops or re-finds the file
                self.metrics.tier_errors.labels(tier.name.label).inc()
                log.warning("could not delete %s from the %s tier: %s", key, tier.name.label, err)
            finally:
                with self._cond:
                    left = self._deleting[(tier.name, key)] - 1
                    if left:
                        self._deleting[(tier.name, key)] = left
                    else:
                        del self._deleting[(tier.name, key)]

    def _publish_locked(self, key: BlockKey, entry: Entry | None) -> None:
        if self._listener is not None:
            visible = entry is not None and entry.visible
            self._listener(key, self._best(entry) if visible else None)

    def _expire_locked(self) -> None:
        expired = self._leases.pop_expired(self._clock())
        for lease in expired:
            self.metrics.leases_expired.labels(lease.kind.value).inc()
            if lease.kind == LeaseKind.SLOT:
                self._head.unreserve(lease.offset)
            self._end_pins_locked(lease)
        if expired:
            self._cond.notify_all()

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
