"""TieredStore: host RAM over local disk, with leases and prefix-aware eviction.

Policy lives here; the tiers only hold bytes.

- Writes land in host RAM (the shared arena), so a same-host reader can map
  them at once.
- Reads fall through RAM then disk; a disk hit is copied up into RAM
  (promotion) and keeps its disk copy, so evicting it from RAM later is free.
- When RAM runs short, the least recently used blocks move down to disk
  through a bounded write-behind queue; a block stays readable in RAM until
  its disk copy is complete. Disk evictions drop the block.
- A block that is the parent of a cached block is never dropped, and RAM
  demotes a chain from its deepest cached block up, so a prefix always
  outlives its descendants.
- Pinned, leased and in-flight blocks are never evicted. Every lease expires
  by itself, so a client that dies gives its space back.

Thread model: one lock (``self._cond``) guards all metadata; byte copies and
disk I/O happen outside it, protected by pin counts and the ``demoting``
mark. Lock order is store → tier; tiers never call back.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from sortedcontainers import SortedList

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
    TierFull,
    TierUnavailable,
    UnknownNamespace,
)
from kvstore.metrics import StoreMetrics
from kvstore.store.leases import Lease, LeaseKind, LeaseTable
from kvstore.tiers.base import Tier, TierStats
from kvstore.tiers.ram import HostRamTier

log = logging.getLogger(__name__)

HOST, DISK = TierName.HOST, TierName.DISK

DEFAULT_LIST_PAGE = 1000
MAX_LIST_PAGE = 10000


@dataclass(frozen=True, slots=True)
class StoreLimits:
    max_block_bytes: int = 64 << 20
    lease_s: float = 30.0  # default for reads in place and arena slots
    pin_lease_s: float = 300.0  # default for Pin
    max_lease_s: float = 3600.0
    max_leases: int = 65536
    max_batch_blocks: int = 4096
    demotion_queue_blocks: int = 256
    demotion_threads: int = 1  # 0: demote inline in the writer (deterministic tests)
    high_watermark: float = 0.95  # start demoting when RAM is this full ...
    low_watermark: float = 0.85  # ... until it is this full
    disk_retry_s: float = 5.0  # after a disk failure, evict by dropping for this long
    verify_commits: bool = True  # verify checksums of blocks written through the arena
    put_wait_s: float = 5.0  # longest a writer waits for RAM to free up when no deadline is given


@dataclass(slots=True)
class _Entry:
    meta: BlockMeta
    tiers: set[TierName] = field(default_factory=set)
    pins: int = 0
    demoting: bool = False
    deleted: bool = False

    @property
    def best_tier(self) -> TierName:
        return HOST if HOST in self.tiers else DISK


@dataclass(frozen=True, slots=True)
class Located:
    """A block found by :meth:`TieredStore.lookup`.

    ``lease_id`` 0 means the block exists but could not be brought into the
    arena (RAM full of pinned blocks): read it with :meth:`TieredStore.get`.
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
        ram: HostRamTier,
        disk: Tier | None = None,
        *,
        limits: StoreLimits = StoreLimits(),
        namespaces: Iterable[str] = (),
        auto_create_namespaces: bool = True,
        metrics: StoreMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        listener: Callable[[BlockKey, TierName | None], None] | None = None,
    ) -> None:
        if limits.max_block_bytes > ram.capacity_bytes:
            raise ValueError(
                f"max block size {limits.max_block_bytes} exceeds host RAM {ram.capacity_bytes}: "
                "raise --ram-bytes or lower --max-block-bytes"
            )
        self._ram = ram
        self._disk = disk
        self.limits = limits
        self.metrics = metrics or StoreMetrics()
        self._clock = clock
        # Told (under the store lock: it must not block) whenever a block's
        # best tier changes or the block goes (None): the prefix index's feed.
        self._listener = listener
        self._auto_create = auto_create_namespaces
        self._namespaces = {validate_namespace(ns) for ns in namespaces}
        self._cond = threading.Condition(threading.Lock())
        self._entries: dict[BlockKey, _Entry] = {}
        self._children: dict[BlockKey, set[BlockKey]] = {}
        self._lru: dict[TierName, OrderedDict[BlockKey, None]] = {HOST: OrderedDict(), DISK: OrderedDict()}
        # Each namespace's keys in byte order: block counts and paged listings.
        self._ns_keys: dict[str, SortedList] = {}
        self._leases = LeaseTable(limits.max_leases)
        self._disk_unhealthy_until = 0.0
        self._demoting = 0  # blocks marked for demotion, queued or being written
        self._demote_q: queue.Queue[BlockKey | None] = queue.Queue(maxsize=limits.demotion_queue_blocks)
        self._closed = threading.Event()
        self._recover_disk()
        self.metrics.watch_tiers(self.tier_stats, self._demote_q.qsize)
        self._demoters = [
            threading.Thread(target=self._demote_loop, name=f"strata-demote-{i}", daemon=True)
            for i in range(limits.demotion_threads if disk is not None else 0)
        ]
        self._threads = [*self._demoters, threading.Thread(target=self._reap_loop, name="strata-lease-reaper", daemon=True)]
        for t in self._threads:
            t.start()

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

    # ---- streamed put / get -----------------------------------------------

    def put(self, key: BlockKey, data: bytes | bytearray | memoryview, meta: BlockMeta, deadline: float | None = None) -> tuple[bool, TierName]:
        """Store a block; returns (stored, tier). ``stored`` is False for a repeated put."""
        self._check_block(key, meta)
        data = memoryview(data).cast("B")
        if len(data) != meta.size:
            raise InvalidArgument(f"block {key} declares {meta.size} bytes but {len(data)} were sent")
        with self._cond:
            self._known_namespace(key.namespace, write=True)
            entry = self._entries.get(key)
            if entry is not None and not entry.deleted:
                self._touch_locked(key, entry)
                return False, entry.best_tier
            parent = self._pin_parent_locked(key, meta)
        try:
            return self._put_new(key, data, meta, deadline)
        finally:
            with self._cond:
                for p in parent:
                    self._unpin_locked(p, self._entries[p])

    def _put_new(self, key: BlockKey, data: memoryview, meta: BlockMeta, deadline: float | None) -> tuple[bool, TierName]:
        offset = self._reserve(meta.size, deadline)
        view = self._ram.view(offset, meta.size)
        try:
            got = copy_and_checksum(view, data)
        except BaseException:
            view.release()
            with self._cond:
                self._ram.unreserve(offset)
            raise
        view.release()
        if got != meta.checksum:
            with self._cond:
                self._ram.unreserve(offset)
                self._cond.notify_all()
            self.metrics.corrupt.labels("host").inc()
            raise CorruptBlock(
                f"block {key}: the bytes received do not match the checksum the writer declared "
                f"({got:#018x} != {meta.checksum:#018x}); nothing was stored: send it again"
            )
        return self._adopt(key, offset, meta, verify=False)

    def get(self, key: BlockKey) -> tuple[bytes, BlockMeta, TierName] | None:
        """A verified copy of the block, or None on a miss. Disk hits are promoted to RAM."""
        with self._cond:
            self._expire_locked()
            self._known_namespace(key.namespace)
            entry = self._entries.get(key)
            if entry is None or entry.deleted:
                self.metrics.misses.inc()
                return None
            tier = entry.best_tier
            entry.pins += 1
            self._touch_locked(key, entry)
        try:
            data = self._read(key, entry.meta, tier)
        finally:
            with self._cond:
                self._unpin_locked(key, entry)
        if data is None:
            self.metrics.misses.inc()
            return None
        self.metrics.hits.labels(tier.label).inc()
        self.metrics.bytes_out.labels(tier.label).inc(len(data))
        if tier is DISK:
            self._promote(key, data, entry.meta, deadline=self._clock())
        return data, entry.meta, tier

    def _read(self, key: BlockKey, meta: BlockMeta, tier: TierName) -> bytes | None:
        """Read a pinned block from one tier, verified; drop it if corrupt."""
        try:
            if tier is HOST:
                loc = self._ram.locate(key)
                if loc is None:  # raced with a move to disk: read there
                    return self._read(key, meta, DISK) if self._disk is not None else None
                view = self._ram.view(loc[0], meta.size)
                try:
                    data = bytes(view)
                finally:
                    view.release()
                if checksum(data) != meta.checksum:
                    raise CorruptBlock(f"block {key} failed its checksum in host RAM")
                return data
            assert self._disk is not None
            return self._disk.get(key)
        except CorruptBlock:
            log.error("dropping corrupt block %s found in tier %s", key, tier.label)
            self.metrics.corrupt.labels(tier.label).inc()
            with self._cond:
                entry = self._entries.get(key)
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
        deadline: float | None = None,
    ) -> list[SlotGrant]:
        """Reserve arena slots for blocks a same-host client will write itself.

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
                    entry = self._entries.get(key)
                    if entry is not None and not entry.deleted:
                        self._touch_locked(key, entry)
                        grants.append(SlotGrant(key, present=True))
                        continue
                offset = self._reserve(size, deadline)
                with self._cond:
                    try:
                        lease = self._leases.issue(
                            LeaseKind.SLOT, self._clock() + lease_s, block=key, offset=offset, meta=meta
                        )
                    except BaseException:
                        self._ram.unreserve(offset)
                        raise
                    lease.keys = self._pin_parent_locked(key, meta)
                grants.append(SlotGrant(key, False, lease.id, offset, size))
        except BaseException:
            self.abort([g.slot_id for g in grants if not g.present])
            raise
        return grants

    def commit(self, items: list[tuple[int, int | None]]) -> list[tuple[BlockKey, bool, TierName]]:
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
                    taken.append(self._leases.take(slot_id, LeaseKind.SLOT, now))
            except LeaseError:
                for lease in taken:  # put them back untouched
                    self._leases.restore(lease)
                raise
        metas, bad = [], []
        for lease, (_, declared) in zip(taken, items):
            if declared is None or self.limits.verify_commits:
                view = self._ram.view(lease.offset, lease.meta.size)
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
            with self._cond:
                for lease in taken:
                    self._ram.unreserve(lease.offset)
                    self._end_pins_locked(lease)
                self._cond.notify_all()
            self.metrics.corrupt.labels("host").inc(len(bad))
            raise CorruptBlock(
                f"{len(bad)} slot(s) hold bytes that do not match their checksum (first: {bad[0]}); "
                "nothing was committed: write the blocks again"
            )
        done = [(lease.block, *self._adopt(lease.block, lease.offset, meta, verify=False)) for lease, meta in zip(taken, metas)]
        with self._cond:
            for lease in taken:
                self._end_pins_locked(lease)
        return done

    def abort(self, slot_ids: Iterable[int]) -> None:
        with self._cond:
            now = self._clock()
            for slot_id in slot_ids:
                try:
                    lease = self._leases.take(slot_id, LeaseKind.SLOT, now)
                except LeaseError:
                    continue  # expired or unknown: already given back
                self._ram.unreserve(lease.offset)
                self._end_pins_locked(lease)
            self._cond.notify_all()

    def lookup(self, namespace: str, keys: list[bytes], lease_s: float | None = None, deadline: float | None = None) -> list[Located | None]:
        """Lease each present block in place in the arena (None for a miss).

        A block only on disk is promoted first; the reader then copies it out
        of the arena, verifies its checksum and releases the lease.
        """
        self.check_batch(keys)
        lease_s = self._lease_seconds(lease_s, self.limits.lease_s)
        with self._cond:
            self._known_namespace(namespace)
        out: list[Located | None] = []
        for key_bytes in keys:
            key = BlockKey(namespace, validate_key(key_bytes))
            located = self._lease_in_arena(key, lease_s)
            if located is None:
                with self._cond:
                    entry = self._entries.get(key)
                    if entry is None or entry.deleted:
                        self.metrics.misses.inc()
                        out.append(None)
                        continue
                    entry.pins += 1
                try:
                    data = self._read(key, entry.meta, DISK)
                except CorruptBlock:
                    data = None
                finally:
                    with self._cond:
                        self._unpin_locked(key, entry)
                if data is None:
                    self.metrics.misses.inc()
                    out.append(None)
                    continue
                self.metrics.hits.labels("disk").inc()
                if self._promote(key, data, entry.meta, deadline):
                    located = self._lease_in_arena(key, lease_s, found_in=DISK)
                out.append(located or Located(key, entry.meta, DISK))
            else:
                self.metrics.hits.labels("host").inc()
                out.append(located)
        return out

    def _lease_in_arena(self, key: BlockKey, lease_s: float, found_in: TierName = HOST) -> Located | None:
        with self._cond:
            self._expire_locked()
            entry = self._entries.get(key)
            if entry is None or entry.deleted or HOST not in entry.tiers:
                return None
            loc = self._ram.locate(key)
            if loc is None:
                return None
            lease = self._leases.issue(LeaseKind.READ, self._clock() + lease_s, keys=[key])
            entry.pins += 1
            self._touch_locked(key, entry)
            self.metrics.bytes_out.labels("host").inc(entry.meta.size)
            return Located(key, entry.meta, found_in, loc[0], lease.id)

    def release(self, lease_ids: Iterable[int]) -> list[bool]:
        """End read leases; per lease, whether it was still valid (the bytes read were stable)."""
        out = []
        with self._cond:
            self._expire_locked()
            now = self._clock()
            for lease_id in lease_ids:
                try:
                    lease = self._leases.take(lease_id, LeaseKind.READ, now)
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
            self._known_namespace(namespace)
            tiers = []
            for k in keys:
                entry = self._entries.get(BlockKey(namespace, k))
                if entry is None or entry.deleted:
                    break
                tiers.append(entry.best_tier)
            return tiers

    def delete(self, namespace: str, keys: list[bytes]) -> int:
        self.check_batch(keys)
        keys = [validate_key(k) for k in keys]
        deleted = 0
        with self._cond:
            self._known_namespace(namespace)
            for k in keys:
                key = BlockKey(namespace, k)
                entry = self._entries.get(key)
                if entry is None or entry.deleted:
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
        page_size = page_size or DEFAULT_LIST_PAGE
        with self._cond:
            self._known_namespace(namespace)
            keys = self._ns_keys.get(namespace)
            if keys is None:
                return [], b""
            start = page_token or prefix
            page: list[Listed] = []
            for k in keys.irange(minimum=start, inclusive=(not page_token, True)):
                if not k.startswith(prefix):
                    return page, b""
                entry = self._entries[BlockKey(namespace, k)]
                if entry.deleted or not entry.tiers:
                    continue
                if len(page) == page_size:
                    return page, page[-1].key
                page.append(Listed(k, entry.meta, entry.best_tier))
            return page, b""

    def pin(self, namespace: str, keys: list[bytes], lease_s: float | None = None) -> tuple[Lease, list[bytes]]:
        """Protect present blocks from eviction until the lease ends; returns (lease, missing keys)."""
        self.check_batch(keys)
        keys = [validate_key(k) for k in keys]
        lease_s = self._lease_seconds(lease_s, self.limits.pin_lease_s)
        with self._cond:
            self._expire_locked()
            self._known_namespace(namespace)
            present, missing = [], []
            for k in keys:
                key = BlockKey(namespace, k)
                entry = self._entries.get(key)
                (missing.append(k) if entry is None or entry.deleted else present.append(key))
            lease = self._leases.issue(LeaseKind.PIN, self._clock() + lease_s, keys=present)
            for key in present:
                self._entries[key].pins += 1
            return lease, missing

    def unpin(self, lease_id: int) -> bool:
        with self._cond:
            self._expire_locked()
            try:
                lease = self._leases.take(lease_id, LeaseKind.PIN, self._clock())
            except LeaseError:
                return False
            self._end_pins_locked(lease)
            return True

    def tier_stats(self) -> list[TierStats]:
        tiers: list[Tier] = [self._ram] + ([self._disk] if self._disk is not None else [])
        return [t.stats() for t in tiers]

    def stats(self, namespace: str = "") -> StoreStats:
        with self._cond:
            self._expire_locked()
            if namespace:
                self._known_namespace(namespace)
                pinned = sum(1 for k, e in self._entries.items() if e.pins and k.namespace == namespace)
                blocks = len(self._ns_keys.get(namespace, ()))
                namespaces = [namespace]
            else:
                pinned = sum(1 for e in self._entries.values() if e.pins)
                blocks = len(self._entries)
                namespaces = sorted(self._namespaces)
            return StoreStats(
                tiers=self.tier_stats(),
                blocks=blocks,
                pinned_blocks=pinned,
                active_leases=len(self._leases),
                open_slots=self._leases.count(LeaseKind.SLOT),
                demotion_queue_depth=self._demote_q.qsize(),
                namespaces=namespaces,
            )

    def expire_leases(self) -> None:
        """Reclaim leases past their deadline now (the reaper does this every 100 ms)."""
        with self._cond:
            self._expire_locked()

    def flush_demotions(self) -> None:
        """Write every queued demotion now, in the calling thread."""
        while True:
            try:
                key = self._demote_q.get_nowait()
            except queue.Empty:
                return
            if key is not None:
                self._demote(key)

    def persist_ram(self, deadline: float) -> int:
        """Write blocks held only in RAM down to disk, most recent first, until ``deadline``.

        Called on a graceful stop so a restarted daemon finds its cache warm.
        Returns the number of blocks written.
        """
        if self._disk is None:
            return 0
        written = 0
        with self._cond:
            keys = [k for k in reversed(self._lru[HOST]) if self._entries[k].tiers == {HOST}]
        for key in keys:
            if self._clock() >= deadline:
                break
            with self._cond:
                entry = self._entries.get(key)
                if entry is None or entry.deleted or entry.demoting or entry.tiers != {HOST}:
                    continue
                entry.demoting = True
                self._demoting += 1
            try:
                self._demote(key)
            finally:
                written += DISK in entry.tiers
        return written

    def close(self) -> None:
        self._closed.set()
        for _ in self._demoters:
            try:
                self._demote_q.put_nowait(None)
            except queue.Full:
                pass
        for t in self._threads:
            t.join(timeout=5)
        try:
            self._ram.close()
        except BufferError:
            # A view still held somewhere (an RPC past its grace period, an
            # exception's traceback): collect cycles and try once more. The
            # file is already unlinked; the mapping goes with the process.
            gc.collect()
            try:
                self._ram.close()
            except BufferError:
                log.warning("host RAM arena still mapped at close; it is unlinked and freed at exit")
        if self._disk is not None:
            self._disk.close()

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

    # ---- internals: placement ---------------------------------------------

    def _adopt(self, key: BlockKey, offset: int, meta: BlockMeta, verify: bool) -> tuple[bool, TierName]:
        with self._cond:
            entry = self._entries.get(key)
            if entry is not None and not entry.deleted:
                self._ram.unreserve(offset)  # lost a race with another writer of the same key
                self._cond.notify_all()
                return False, entry.best_tier
            if entry is not None:
                # Deleted but still pinned by a reader: revive it. Keys are
                # content- or prefix-addressed, so the bytes are the same.
                entry.deleted = False
                self._ram.unreserve(offset)
                self._cond.notify_all()
                self._publish_locked(key, entry)
                return True, entry.best_tier
            if not self._ram.commit(key, offset, meta, verify=verify):
                self._cond.notify_all()
                return False, HOST
            entry = _Entry(meta, {HOST})
            self._entries[key] = entry
            self._lru[HOST][key] = None
            self._index_key_locked(key)
            if meta.parent:
                self._children.setdefault(BlockKey(key.namespace, meta.parent), set()).add(key)
            self.metrics.bytes_in.labels("host").inc(meta.size)
            self._publish_locked(key, entry)
            self._keep_headroom_locked()
            return True, HOST

    def _promote(self, key: BlockKey, data: bytes, meta: BlockMeta, deadline: float | None) -> bool:
        """Copy a disk block up into RAM (keeping the disk copy); False when RAM has no room in time."""
        try:
            offset = self._reserve(meta.size, deadline)
        except TierFull:
            return False
        view = self._ram.view(offset, meta.size)
        view[:] = data
        view.release()
        with self._cond:
            entry = self._entries.get(key)
            if entry is None or entry.deleted or HOST in entry.tiers:
                self._ram.unreserve(offset)
                self._cond.notify_all()
                return entry is not None and not entry.deleted and HOST in entry.tiers
            self._ram.commit(key, offset, meta, verify=False)
            entry.tiers.add(HOST)
            self._lru[HOST][key] = None
            self._publish_locked(key, entry)
            self.metrics.promotions.inc()
            self.metrics.bytes_in.labels("host").inc(meta.size)
            return True

    def _reserve(self, size: int, deadline: float | None) -> int:
        """An arena extent of ``size`` bytes, evicting and waiting (until ``deadline``) as needed."""
        if deadline is None:
            deadline = self._clock() + self.limits.put_wait_s
        with self._cond:
            while True:
                self._expire_locked()
                try:
                    return self._ram.reserve(size)
                except TierFull:
                    pass
                freed, pending = self._make_room_locked(size)
                if freed:
                    continue
                remaining = deadline - self._clock()
                if not pending or remaining <= 0:
                    stats = self._ram.stats()
                    raise TierFull(
                        f"host RAM has no room for {size} bytes ({stats.used_bytes} of {stats.capacity_bytes} used, "
                        f"largest free extent {self._ram.largest_free_bytes}; the rest is pinned, leased or being "
                        "demoted): retry later, unpin blocks, or raise --ram-bytes",
                        retry_after_s=0.1,
                    )
                if not self._demoters:
                    # No demotion thread: write the queued blocks down here.
                    self._cond.release()
                    try:
                        self.flush_demotions()
                    finally:
                        self._cond.acquire()
                else:
                    self._cond.wait(timeout=min(remaining, 0.05))

    def _keep_headroom_locked(self) -> None:
        stats = self._ram.stats()
        if stats.used_bytes > self.limits.high_watermark * stats.capacity_bytes and self._disk_usable():
            target_free = int((1 - self.limits.low_watermark) * stats.capacity_bytes)
            self._make_room_locked(target_free - (stats.capacity_bytes - stats.used_bytes), background=True)

    def _disk_usable(self) -> bool:
        return self._disk is not None and self._clock() >= self._disk_unhealthy_until

    def _make_room_locked(self, need: int, background: bool = False) -> tuple[bool, bool]:
        """Evict from RAM, least recently used first; returns (freed now, demotions pending).

        A block that also has a disk copy leaves RAM at once; one without is
        queued for demotion and stays readable until written (a chain's
        deepest blocks first, its parents only when that is not enough); with
        no usable disk, a block with no cached children is dropped. Background headroom
        only queues demotions. The scan decides first and acts after, so it
        never mutates the LRU it walks.
        """
        disk_ok = self._disk_usable()
        drop_copy: list[BlockKey] = []
        demote: list[BlockKey] = []
        demote_later: list[BlockKey] = []  # parents of blocks in RAM: demoted only if leaves are not enough
        drop: list[BlockKey] = []
        budget = 0
        for key in self._lru[HOST]:
            if budget >= need:
                break
            entry = self._entries[key]
            if entry.pins or entry.demoting:
                continue
            if DISK in entry.tiers:
                if not background:
                    drop_copy.append(key)
                    budget += entry.meta.size
            elif disk_ok and self._has_child_in_locked(key, HOST):
                demote_later.append(key)
            elif disk_ok:
                demote.append(key)
                budget += entry.meta.size
            elif not background and not self._children.get(key):
                drop.append(key)
                budget += entry.meta.size
        for key in demote_later:
            if budget >= need:
                break
            demote.append(key)
            budget += self._entries[key].meta.size
        for key in drop_copy:
            self._drop_copy_locked(key, self._entries[key], HOST)
            self.metrics.evictions.labels("host").inc()
        for key in drop:
            self._remove_locked(key, self._entries[key])
            self.metrics.evictions.labels("host").inc()
            self.metrics.drops.inc()
        for key in demote:
            try:
                self._demote_q.put_nowait(key)
            except queue.Full:
                break
            self._entries[key].demoting = True
            self._demoting += 1
        return bool(drop_copy or drop), self._demoting > 0

    def _pin_parent_locked(self, key: BlockKey, meta: BlockMeta) -> list[BlockKey]:
        """Pin the parent of a block being written, so eviction cannot take it meanwhile."""
        if not meta.parent:
            return []
        parent = BlockKey(key.namespace, meta.parent)
        entry = self._entries.get(parent)
        if entry is None or entry.deleted:
            return []
        entry.pins += 1
        return [parent]

    def _has_child_in_locked(self, key: BlockKey, tier: TierName) -> bool:
        return any(tier in self._entries[c].tiers for c in self._children.get(key, ()))

    # ---- internals: demotion to disk --------------------------------------

    def _demote_loop(self) -> None:
        while True:
            key = self._demote_q.get()
            if key is None:
                return
            try:
                self._demote(key)
            except Exception:  # a bug: keep demoting the rest rather than stall RAM
                log.exception("demotion of %s failed unexpectedly", key)

    def _demote(self, key: BlockKey) -> None:
        with self._cond:
            entry = self._entries.get(key)
            if entry is None or not entry.demoting:
                return
            loc = None if entry.deleted else self._ram.locate(key)
            if loc is None:
                self._end_demotion_locked(key, entry)
                return
        outcome = "ok"
        view = self._ram.view(loc[0], entry.meta.size)
        try:
            self._put_disk(key, view, entry.meta)
        except CorruptBlock:
            outcome = "corrupt"
            log.error("block %s failed its checksum in host RAM while being demoted: dropped", key)
            self.metrics.corrupt.labels("host").inc()
        except (TierFull, BlockTooLarge) as err:
            outcome = "failed"
            log.warning("no room on disk for %s, keeping it in RAM: %s", key, err)
        except TierUnavailable as err:
            outcome = "failed"
            self.metrics.tier_errors.labels("disk").inc()
            log.warning("could not demote %s to disk, keeping it in RAM: %s", key, err)
        except Exception:  # a bug: keep the block and the store consistent
            outcome = "failed"
            log.exception("demotion of %s failed unexpectedly", key)
        finally:
            view.release()
        self.metrics.demotions.labels(outcome).inc()
        with self._cond:
            if outcome == "ok":
                entry.tiers.add(DISK)
                self._lru[DISK][key] = None
                self._publish_locked(key, entry)
                if not entry.pins:  # a reader may be copying it out of RAM right now
                    self._drop_copy_locked(key, entry, HOST)
                    self.metrics.evictions.labels("host").inc()
            elif outcome == "corrupt":
                self._drop_copy_locked(key, entry, HOST)
            else:
                self._disk_unhealthy_until = self._clock() + self.limits.disk_retry_s
            self._end_demotion_locked(key, entry)

    def _end_demotion_locked(self, key: BlockKey, entry: _Entry) -> None:
        entry.demoting = False
        self._demoting -= 1
        self._maybe_remove_locked(key, entry)
        self._cond.notify_all()

    def _put_disk(self, key: BlockKey, data: memoryview, meta: BlockMeta) -> None:
        assert self._disk is not None
        if meta.size > self._disk.capacity_bytes:
            raise TierFull(f"block {key} ({meta.size} bytes) is larger than the whole disk tier")
        while True:
            try:
                self._disk.put(key, data, meta)
            except TierFull:
                with self._cond:
                    if not self._evict_disk_locked():
                        raise
                continue
            self.metrics.bytes_in.labels("disk").inc(meta.size)
            return

    def _evict_disk_locked(self) -> bool:
        for key in self._lru[DISK]:
            entry = self._entries[key]
            if entry.pins or entry.demoting:
                continue
            if HOST in entry.tiers:
                self._drop_copy_locked(key, entry, DISK)
            elif not self._children.get(key):
                self._remove_locked(key, entry)
                self.metrics.drops.inc()
            else:
                continue
            self.metrics.evictions.labels("disk").inc()
            return True
        return False

    # ---- internals: bookkeeping -------------------------------------------

    def _touch_locked(self, key: BlockKey, entry: _Entry) -> None:
        for tier in entry.tiers:
            self._lru[tier].move_to_end(key)

    def _unpin_locked(self, key: BlockKey, entry: _Entry) -> None:
        entry.pins -= 1
        self._maybe_remove_locked(key, entry)

    def _end_pins_locked(self, lease: Lease) -> None:
        # A pinned entry cannot be removed, so each key still maps to the
        # entry the lease pinned.
        for key in lease.keys:
            self._unpin_locked(key, self._entries[key])
        self._cond.notify_all()

    def _maybe_remove_locked(self, key: BlockKey, entry: _Entry) -> None:
        if entry.deleted and not entry.pins and not entry.demoting and self._entries.get(key) is entry:
            self._remove_locked(key, entry)

    def _drop_copy_locked(self, key: BlockKey, entry: _Entry, tier: TierName) -> None:
        if tier not in entry.tiers:
            return
        if len(entry.tiers) == 1:
            self._remove_locked(key, entry)
            return
        self._tier(tier).delete(key)
        entry.tiers.discard(tier)
        self._lru[tier].pop(key, None)
        self._publish_locked(key, entry)
        self._cond.notify_all()

    def _remove_locked(self, key: BlockKey, entry: _Entry) -> None:
        for tier in entry.tiers:
            self._tier(tier).delete(key)
            self._lru[tier].pop(key, None)
        entry.tiers.clear()
        del self._entries[key]
        self._publish_locked(key, None)
        keys = self._ns_keys[key.namespace]
        keys.remove(key.key)
        if not keys:
            del self._ns_keys[key.namespace]
        if entry.meta.parent:
            parent = BlockKey(key.namespace, entry.meta.parent)
            siblings = self._children.get(parent)
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self._children[parent]
        self._cond.notify_all()

    def _index_key_locked(self, key: BlockKey) -> None:
        keys = self._ns_keys.get(key.namespace)
        if keys is None:
            keys = self._ns_keys[key.namespace] = SortedList()
        keys.add(key.key)

    def _publish_locked(self, key: BlockKey, entry: _Entry | None) -> None:
        if self._listener is not None:
            gone = entry is None or entry.deleted or not entry.tiers
            self._listener(key, None if gone else entry.best_tier)

    def holdings(self) -> list[tuple[BlockKey, TierName]]:
        """Every visible block and its best tier: what a full re-publish to the index sends."""
        with self._cond:
            return [(k, e.best_tier) for k, e in self._entries.items() if not e.deleted and e.tiers]

    def _tier(self, name: TierName) -> Tier:
        if name is HOST:
            return self._ram
        assert self._disk is not None
        return self._disk

    def _expire_locked(self) -> None:
        expired = self._leases.pop_expired(self._clock())
        for lease in expired:
            self.metrics.leases_expired.labels(lease.kind.value).inc()
            if lease.kind is LeaseKind.SLOT:
                self._ram.unreserve(lease.offset)
            self._end_pins_locked(lease)
        if expired:
            self._cond.notify_all()

    def _reap_loop(self) -> None:
        while not self._closed.wait(0.1):
            self.expire_leases()

    def _recover_disk(self) -> None:
        """Index the blocks a previous run left on disk."""
        if self._disk is None:
            return
        for key in self._disk.lru():
            meta = self._disk.meta(key)
            if meta is None:
                continue
            self._entries[key] = _Entry(meta, {DISK})
            self._lru[DISK][key] = None
            self._index_key_locked(key)
            self._namespaces.add(key.namespace)
            if meta.parent:
                self._children.setdefault(BlockKey(key.namespace, meta.parent), set()).add(key)
        if self._entries:
            log.info("recovered %d blocks from disk", len(self._entries))
