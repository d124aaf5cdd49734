"""The host-RAM tier: blocks are extents of one shared-memory arena.

All block bytes live in a single :class:`~kvstore.shm.arena.ShmArena`, carved
by an :class:`~kvstore.tiers.allocator.ExtentAllocator`. Keeping them in the
arena (rather than in Python ``bytes`` objects) is what lets a same-host
client read or write a block in place: the daemon tells it an offset, never
copies the payload through gRPC.

Two ways in:

- ``put`` copies caller bytes into a fresh extent (the streamed path);
- ``reserve`` → client writes through its own mapping → ``commit`` adopts the
  extent as a block without another copy (the shared-memory path).

One lock guards the metadata (block map, LRU order, allocator, reservations).
``put`` and ``commit`` hash and copy outside it: the extent they work on is
reserved, so nothing else can free or hand it out meanwhile. ``get`` copies
under the lock, which keeps a concurrent ``delete`` from freeing the extent
mid-copy without a per-block pin count; the checksum runs after the lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator

from kvstore.block import BlockKey, BlockMeta, TierName, checksum, copy_and_checksum
from kvstore.errors import BlockTooLarge, CorruptBlock, InvalidArgument, TierFull
from kvstore.tiers.allocator import ExtentAllocator
from kvstore.shm.arena import ShmArena
from kvstore.tiers.base import MappableTier, TierStats


class HostRamTier(MappableTier):
    """Blocks in a shared-memory arena, LRU-ordered; the store decides what to evict.

    ``get`` counts as a use and moves the block to the most-recently-used end;
    ``meta``, ``contains`` and ``locate`` do not (the store calls ``touch``
    when a located block is actually read).
    """

    name = TierName.HOST

    def __init__(
        self,
        capacity_bytes: int,
        shm_dir: str = "/dev/shm",
        arena_name: str = "strata-arena",
    ) -> None:
        self._alloc = ExtentAllocator(capacity_bytes)
        self._arena = ShmArena.create(self._alloc.capacity_bytes, shm_dir, arena_name)
        self._lock = threading.Lock()
        self._blocks: OrderedDict[BlockKey, tuple[int, BlockMeta]] = OrderedDict()
        self._reserved: set[int] = set()

    # ---- Tier ------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self._alloc.capacity_bytes

    def contains(self, key: BlockKey) -> bool:
        with self._lock:
            return key in self._blocks

    def meta(self, key: BlockKey) -> BlockMeta | None:
        with self._lock:
            entry = self._blocks.get(key)
        return None if entry is None else entry[1]

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
            with self._lock:
                if self._blocks.get(key) is entry:
                    del self._blocks[key]
                    self._alloc.free(offset)
            raise CorruptBlock(f"host tier block {key} failed its checksum on read; dropped it")
        return data

    def put(self, key: BlockKey, data: bytes | bytearray | memoryview, meta: BlockMeta) -> bool:
        src = memoryview(data).cast("B")
        if len(src) != meta.size:
            raise CorruptBlock(f"block {key} is {len(src)} bytes but its meta says {meta.size}")
        with self._lock:
            if key in self._blocks:
                return False
        offset = self.reserve(meta.size)
        try:
            view = self._arena.view(offset, meta.size)
            try:
                got = copy_and_checksum(view, src)
            finally:
                view.release()
        except BaseException:
            self.unreserve(offset)
            raise
        if got != meta.checksum:
            self.unreserve(offset)
            raise CorruptBlock(f"block {key} does not match its checksum on put: {got:#x} != {meta.checksum:#x}")
        return self._adopt(key, offset, meta)

    def delete(self, key: BlockKey) -> bool:
        with self._lock:
            entry = self._blocks.pop(key, None)
            if entry is None:
                return False
            self._alloc.free(entry[0])
            return True

    def touch(self, key: BlockKey) -> None:
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def lru(self) -> Iterator[BlockKey]:
        with self._lock:
            keys = list(self._blocks)
        return iter(keys)

    def stats(self) -> TierStats:
        """Used bytes are whole pages and include reserved extents not yet committed."""
        with self._lock:
            return TierStats(self.name, self._alloc.used_bytes, self._alloc.capacity_bytes, len(self._blocks))

    def close(self) -> None:
        """Drop every block and remove the arena file (host RAM does not persist)."""
        with self._lock:
            self._blocks.clear()
            self._reserved.clear()
        self._arena.close(unlink=True)

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

    def reserve(self, size: int) -> int:
        """Offset of a fresh extent of ``size`` bytes that is not yet a block.

        The caller writes it (through :meth:`view` or its own mapping), then
        calls :meth:`commit` or :meth:`unreserve`. Raises TierFull when no
        extent fits (evict and retry), BlockTooLarge when none ever could.
        """
        if size < 0:
            raise InvalidArgument(f"block size must not be negative, got {size}")
        if self._alloc.rounded(max(size, 1)) > self._alloc.capacity_bytes:
            raise BlockTooLarge(
                f"a {size}-byte block cannot fit the host tier's {self._alloc.capacity_bytes} bytes"
            )
        with self._lock:
            offset = self._alloc.allocate(max(size, 1))  # an empty block still takes a page
            if offset is None:
                raise TierFull(
                    f"host tier has no free extent for {size} bytes "
                    f"(largest free {self._alloc.largest_free_bytes}); evict and retry"
                )
            self._reserved.add(offset)
            return offset

    def unreserve(self, offset: int) -> None:
        """Give back a reserved extent that will not be committed."""
        with self._lock:
            self._take_reservation(offset)
            self._alloc.free(offset)

    def view(self, offset: int, size: int) -> memoryview:
        """A writable view of the arena's data region; release it when done."""
        return self._arena.view(offset, size)

    def commit(self, key: BlockKey, offset: int, meta: BlockMeta, verify: bool = True) -> bool:
        """Adopt the reserved extent at ``offset`` as block ``key``; False when ``key`` was present.

        Commit always consumes the reservation: the extent becomes the block,
        or it is freed (key present, CorruptBlock when ``verify`` finds the
        bytes differ from ``meta.checksum``, InvalidArgument when ``meta.size``
        exceeds the extent). ValueError when ``offset`` is not reserved.
        """
        with self._lock:
            if offset not in self._reserved:
                raise ValueError(f"offset {offset} is not a reserved extent")
            extent = self._alloc.size_of(offset)
            if key in self._blocks or meta.size > extent:
                self._take_reservation(offset)
                self._alloc.free(offset)
                if meta.size > extent:
                    raise InvalidArgument(f"block {key} is {meta.size} bytes but its extent holds {extent}")
                return False
        if verify:
            view = self._arena.view(offset, meta.size)
            try:
                got = checksum(view)
            finally:
                view.release()
            if got != meta.checksum:
                self.unreserve(offset)
                raise CorruptBlock(
                    f"block {key} written to the arena does not match its checksum: "
                    f"{got:#x} != {meta.checksum:#x}; freed the slot"
                )
        return self._adopt(key, offset, meta)

    def locate(self, key: BlockKey) -> tuple[int, BlockMeta] | None:
        """Offset in the data region and meta of a present block; copies nothing, keeps LRU order."""
        with self._lock:
            return self._blocks.get(key)

    # ---- internals ---------------------------------------------------------

    def _take_reservation(self, offset: int) -> None:
        try:
            self._reserved.remove(offset)
        except KeyError:
            raise ValueError(f"offset {offset} is not a reserved extent") from None

    def _adopt(self, key: BlockKey, offset: int, meta: BlockMeta) -> bool:
        """Turn a reserved, filled extent into block ``key``; frees it when ``key`` won a race."""
        with self._lock:
            self._take_reservation(offset)
            if key in self._blocks:
                self._alloc.free(offset)
                return False
            self._blocks[key] = (offset, meta)
            return True
