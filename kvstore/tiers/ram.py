"""The host-RAM tier: blocks are extents of one shared-memory arena.

All block bytes live in a single :class:`~kvstore.shm.arena.ShmArena`, carved
by an :class:`~kvstore.shm.allocator.ExtentAllocator`. Keeping them in the
arena (rather than in Python ``bytes`` objects) is what lets a same-host
client read or write a block in place: the daemon tells it an offset, never
copies the payload through gRPC.

Two ways in:

- ``put`` copies caller bytes into a fresh extent (the streamed path);
- ``reserve`` → client writes through its own mapping → ``commit`` adopts the
  extent as a block without another copy (the shared-memory path).

With ``crash_safe`` the tier keeps a table of its committed blocks beside
the arena (:mod:`kvstore.shm.table`), and a tier built on an arena a
previous run left re-adopts every block whose record is whole and whose
bytes still match its checksum: a daemon killed with SIGKILL comes back
with its RAM blocks, as long as the host (and its tmpfs) stayed up. The
order that keeps a restart honest: a block's record is written before its
put or commit returns, and cleared before its extent can be handed out
again. A block the table cannot record (its tmpfs is full, or the table
failed) is refused — TierFull with a retry delay, or TierUnavailable —
and its extent given back: an acknowledged block is a recorded one (why
refuse, not store it unrecorded: :mod:`kvstore.shm.table`). Slots lent to
writers outside the daemon (:meth:`lend`) are recorded too, and a restart
keeps their extents out of reuse until their writers' leases are over: a
client of the previous run may still be copying into one. Nothing else survives: reservations the daemon itself
was filling are free again, and leases and pins are the store's, not the
tier's.

The block map, the reservations and the slot protocol are
:class:`~kvstore.tiers.extents.ExtentTier`'s; this tier adds the arena, the
table and :meth:`~HostRamTier.lend`. One lock guards the metadata (block
map, LRU order, allocator, reservations, table). ``put`` and ``commit``
hash and copy outside it: the extent they work on is reserved, so nothing
else can free or hand it out meanwhile. ``get`` copies under the lock,
which keeps a concurrent ``delete`` from freeing the extent mid-copy
without a per-block pin count; the checksum runs after the lock.
"""

from __future__ import annotations

import heapq
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.block import BlockKey, BlockMeta, TierName, checksum, validate_key, validate_namespace
from kvstore.errors import BlockTooLarge, CorruptBlock, InvalidArgument, TierFull, TierUnavailable
from kvstore.shm.allocator import ExtentAllocator
from kvstore.shm import table as block_table
from kvstore.shm.arena import ArenaMismatch, Prefault, ShmArena, filesystem_of
from kvstore.shm.table import BlockTable, Loaded, TableMismatch
from kvstore.tiers.extents import ExtentTier

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ArenaRecovery:
    """What a crash-safe tier found at start in the arena its previous run left."""

    kept: bool = False  # an arena was re-adopted (False: started empty)
    reason: str = ""  # why it started empty, when an arena was there but could not be kept
    adopted_blocks: int = 0
    adopted_bytes: int = 0
    corrupt: int = 0  # blocks whose bytes no longer matched their checksum: discarded
    torn: int = 0  # records torn by the crash (or damaged): discarded
    conflicting: int = 0  # records that overlapped another, repeated a key or left the arena: discarded
    slots: int = 0  # slots of writers of the previous run: their extents free once those leases end


class HostRamTier(ExtentTier):
    """Blocks in a shared-memory arena, LRU-ordered; the store decides what to evict.

    ``get`` counts as a use and moves the block to the most-recently-used end;
    ``meta``, ``contains`` and ``locate`` do not (the store calls ``touch``
    when a located block is actually read).
    """

    name = TierName.HOST
    _written_to = "the arena"

    def __init__(
        self,
        capacity_bytes: int,
        shm_dir: str = "/dev/shm",
        arena_name: str = "strata-arena",
        *,
        crash_safe: bool = False,
        keep_on_exit: bool = False,
        prefault: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``crash_safe``: keep the block table and re-adopt a previous run's arena (see the module
        docstring); ``keep_on_exit``: :meth:`close` leaves the arena and its table for the next start;
        ``prefault``: fault the arena's pages in on a thread of its own (:class:`~kvstore.shm.arena.Prefault`).
        ``clock`` is wall-clock seconds, the clock writers' slot leases are told in."""
        super().__init__()
        self._alloc = ExtentAllocator(capacity_bytes)
        self._held: list[tuple[float, int]] = []  # (until, offset): extents a previous run's writers may still write
        self._clock = clock
        self.persistent = crash_safe  # the store recovers its blocks and writes its recency back
        self._keep = crash_safe and keep_on_exit
        self._closing: bool | None = None  # at close: whether the arena is kept
        self.recovery = ArenaRecovery()
        self._table: BlockTable | None = None
        table_path = os.path.join(shm_dir, arena_name) + ".table"
        if crash_safe:
            self._arena = self._open_kept(shm_dir, arena_name, table_path)
        else:
            block_table.remove(table_path)
            self._arena = ShmArena.create(self._alloc.capacity_bytes, shm_dir, arena_name)
        fstype = filesystem_of(shm_dir) if prefault else "tmpfs"
        if fstype != "tmpfs":
            # A page faulted in on a disk's file system is a disk block allocated and written back.
            log.info("arena %s is on %s, not a tmpfs: its pages are not faulted in at start", self._arena.path, fstype)
            prefault = False
        self._prefault = Prefault(self._arena) if prefault else None
        self.prefaults = prefault

    # ---- Tier ------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self._alloc.capacity_bytes

    def get(self, key: BlockKey) -> bytes | None:
        with self._lock:
            entry = self._blocks.get(key)
            if entry is None:
                return None
            self._blocks.move_to_end(key)
            offset, meta = entry
            view = self._arena.view(offset, meta.size)
            try:
                data = bytes(view)
            finally:
                view.release()
        if checksum(data) != meta.checksum:
            self._drop(key, entry)
            raise CorruptBlock(f"host tier block {key} failed its checksum on read; dropped it")
        return data

    def close(self) -> None:
        """Unmap the arena; remove it and its table unless they are kept for the next start.

        Kept with ``keep_on_exit`` when they hold blocks: an empty arena (a
        daemon that stored nothing, or failed to start on a fresh one) is
        not worth a file in the shared-memory directory.
        """
        if self._prefault is not None:
            self._prefault.stop()
        with self._lock:
            if self._closing is None:  # decided once: a close retried after a BufferError keeps to it
                self._closing = self._keep and bool(self._blocks)
            keep = self._closing
            if keep and self.prefaults:
                self._release_free_pages()
            self._blocks.clear()
            self._reserved.clear()
            if self._table is not None:
                self._table.close(unlink=not keep)
        self._arena.close(unlink=not keep)

    def _release_free_pages(self) -> None:
        """A kept arena that was faulted in holds every page; what no block uses goes back to the tmpfs,
        so the kept arena takes the memory of its blocks only, as it would have without the prefault."""
        try:
            for start, size in self._alloc.free_extents():
                self._arena.release_pages(start, size)
        except OSError as err:
            log.warning("arena %s: could not give its unused pages back to the tmpfs (%s); the kept arena "
                        "takes its whole size until the next start reuses it or `strata clean` removes it",
                        self._arena.path, err)

    # ---- shared-memory fast path -------------------------------------------

    @property
    def arena(self) -> ShmArena:
        return self._arena

    @property
    def used_bytes(self) -> int:
        return self._alloc.used_bytes  # one int read: no lock needed for a watermark check

    @property
    def largest_free_bytes(self) -> int:
        with self._lock:
            return self._alloc.largest_free_bytes

    def lend(self, offset: int, seconds: float) -> None:
        """A writer outside the daemon may write the reserved extent at ``offset`` for ``seconds``.

        Recorded in the table, so that a restart within that time keeps the
        extent from other blocks while the writer may still be copying in.
        An extent no longer reserved (its slot's lease already lapsed) is not lent.
        Raises TierFull or TierUnavailable when the table cannot record it:
        the slot must not be handed out (the extent stays reserved).
        """
        with self._lock:
            if offset in self._reserved and self._table is not None:
                self._table.record_slot(offset, self._alloc.size_of(offset), self._clock() + seconds)

    def view(self, offset: int, size: int) -> memoryview:
        """A writable view of the arena's data region; release it when done."""
        return self._arena.view(offset, size)

    # ---- ExtentTier's hooks ----------------------------------------------------

    def _check_fits(self, size: int, need: int) -> None:
        if self._alloc.rounded(need) > self._alloc.capacity_bytes:
            raise BlockTooLarge(
                f"a {size}-byte block cannot fit the host tier's {self._alloc.capacity_bytes} bytes"
            )

    def _allocate_locked(self, size: int, need: int) -> int:
        if self._held and self._held[0][0] <= self._clock():
            self._release_held_locked()
        offset = self._alloc.allocate(need)
        if offset is None:
            raise TierFull(
                f"host tier has no free extent for {size} bytes "
                f"(largest free {self._alloc.largest_free_bytes}); evict and retry"
            )
        return offset

    def _size_of_locked(self, offset: int) -> int:
        return self._alloc.size_of(offset)

    def _record_locked(self, key: BlockKey, offset: int, meta: BlockMeta) -> None:
        """The block's record is written before its adoption, so before any put or commit of it
        is acknowledged; a block the table cannot record is not stored (its extent is freed) and
        the table's TierFull or TierUnavailable goes to the caller."""
        if self._table is not None:
            try:
                self._table.record_block(offset, key, meta)
            except (TierFull, TierUnavailable):
                self._free_locked(offset)
                raise

    def _touched_locked(self, offset: int) -> None:
        if self._table is not None:
            self._table.stamp(offset)

    def _free_locked(self, offset: int) -> None:
        """Give an extent back: its record goes first, so a restart never adopts bytes reused meanwhile."""
        if self._table is not None:
            self._table.forget(offset)
        self._release_locked(offset)

    def _release_locked(self, offset: int) -> None:
        self._alloc.free(offset)

    # ---- extents a previous run's writers may still write ---------------------------

    def _release_held_locked(self) -> None:
        now = self._clock()
        while self._held and self._held[0][0] <= now:
            _, offset = heapq.heappop(self._held)
            self._free_locked(offset)

    @property
    def held_bytes(self) -> int:
        """Bytes of extents kept from reuse because a previous run's writer may still write them."""
        with self._lock:
            return sum(self._alloc.size_of(offset) for _, offset in self._held)

    @property
    def unrecorded_blocks(self) -> int:
        """Blocks refused because the table could not record them (its tmpfs full, or the table failed)."""
        return 0 if self._table is None else self._table.refused

    # ---- start: a new arena, or the one a previous run left ----------------------

    def _open_kept(self, shm_dir: str, arena_name: str, table_path: str) -> ShmArena:
        path = os.path.join(shm_dir, arena_name)
        capacity, page = self._alloc.capacity_bytes, self._alloc.page_bytes
        reason = ""
        try:
            arena = ShmArena.reopen(path, capacity)
        except FileNotFoundError:
            arena = None
        except (ArenaMismatch, OSError) as err:
            arena, reason = None, str(err)
        if arena is not None:
            try:
                table, loaded = BlockTable.open(table_path, arena.arena_id, capacity, page, arena.unbacked_bytes)
            except FileNotFoundError:
                reason = f"{table_path} is missing (the previous run kept no table, or did not finish starting)"
            except (TableMismatch, OSError) as err:
                reason = str(err)
            else:
                self._table = table
                self._adopt_previous(arena, loaded)
                return arena
            arena.close()
        if reason:
            log.warning("the RAM tier starts empty: the arena %s left by a previous run cannot be kept: %s", path, reason)
        self.recovery.reason = reason
        block_table.remove(table_path)  # before the arena: a crash in between leaves an arena without a table
        arena = ShmArena.create(capacity, shm_dir, arena_name)
        try:
            self._table = BlockTable.create(table_path, arena.arena_id, capacity, page, arena.unbacked_bytes)
        except OSError as err:
            arena.close(unlink=True)
            raise TierUnavailable(
                f"cannot create the RAM tier's block table {table_path}: {err.strerror or err}; set --shm-dir "
                "to a writable tmpfs directory, or turn the table off with --no-ram-crash-safe"
            ) from err
        return arena

    def _adopt_previous(self, arena: ShmArena, loaded: Loaded) -> None:
        """Rebuild the block map and the allocator from the table's records, verifying every block's bytes."""
        table, report = self._table, self.recovery
        assert table is not None
        report.kept, report.torn = True, loaded.torn
        now = self._clock()
        blocks = sorted(loaded.blocks, key=lambda r: r.stamp)  # least recently used first
        live = [s for s in loaded.slots if s.until > now]
        for slot in loaded.slots:
            if slot.until <= now:
                table.forget(slot.offset)
        claimed = self._alloc.claim_all(
            [(r.offset, max(r.meta.size, 1)) for r in blocks] + [(s.offset, s.size) for s in live]
        )
        for record, ok in zip(blocks, claimed):
            if not ok or record.key in self._blocks or not _valid_key(record.key):
                report.conflicting += 1
                table.forget(record.offset)
                if ok:
                    self._alloc.free(record.offset)
                continue
            view = arena.view(record.offset, record.meta.size)
            try:
                intact = checksum(view) == record.meta.checksum
            finally:
                view.release()
            if not intact:
                report.corrupt += 1
                self._free_locked(record.offset)
                continue
            self._blocks[record.key] = (record.offset, record.meta)
            report.adopted_blocks += 1
            report.adopted_bytes += record.meta.size
        for slot, ok in zip(live, claimed[len(blocks):]):
            if not ok:
                report.conflicting += 1
                table.forget(slot.offset)
                continue
            heapq.heappush(self._held, (slot.until, slot.offset))
            report.slots += 1
        log.info(
            "re-adopted %d blocks (%d bytes) from the arena %s left by the previous run; discarded %d whose bytes "
            "failed their checksum, %d torn records, %d conflicting records; %d in-flight slots of the previous "
            "run are held until their leases end", report.adopted_blocks, report.adopted_bytes, arena.path,
            report.corrupt, report.torn, report.conflicting, report.slots,
            extra={"adopted_blocks": report.adopted_blocks, "adopted_bytes": report.adopted_bytes,
                   "corrupt_blocks": report.corrupt, "torn_records": report.torn,
                   "conflicting_records": report.conflicting, "held_slots": report.slots},
        )


def _valid_key(key: BlockKey) -> bool:
    try:
        validate_namespace(key.namespace)
        validate_key(key.key)
    except InvalidArgument:
        return False
    return True
