"""ExtentTier: the bookkeeping of a mappable tier whose blocks are extents of allocated memory.

The host-RAM arena (:mod:`kvstore.tiers.ram`) and device memory
(:mod:`kvstore.tiers.gpu`) keep their blocks the same way: a block is an
extent ``(offset, size)`` handed out by an
:class:`~kvstore.shm.allocator.ExtentAllocator`, reserved before it is
written and adopted as a block after. What they share lives here, once, so
the two cannot drift apart: the lock, the block map in LRU order, the
reserved extents, the slot protocol's ``reserve``/``unreserve``/``commit``,
``put`` and the lookups that copy nothing.

What a subclass says, each a small hook:

- where extents come from: :meth:`_check_fits` (BlockTooLarge before the
  lock), :meth:`_allocate_locked` (TierFull when none fits now),
  :meth:`_size_of_locked` and :meth:`_release_locked`;
- what it keeps beside the map: :meth:`_record_locked` when a block is
  adopted, :meth:`_touched_locked` when one is used, and an override of
  :meth:`_free_locked` when an extent cannot go back to its allocator at
  once (the RAM tier forgets the block's record first; the gpu tier waits
  for a reader still copying out of it);
- how bytes come in: :meth:`_source` (a buffer, or a device tensor), and the
  tier's own ``write_extent``/``checksum_extent``.

Reads stay in the subclasses, because they differ for a reason: the RAM tier
copies under the lock, device memory is too slow for that and keeps reader
pins instead.

One lock guards the map, the reservations and whatever the hooks touch;
``put`` and ``commit`` copy and hash outside it, on an extent that is
reserved, so nothing else can free or hand it out meanwhile.
"""

from __future__ import annotations

import abc
import threading
from collections import OrderedDict
from collections.abc import Iterator

from kvstore.block import BlockKey, BlockMeta
from kvstore.errors import CorruptBlock, InvalidArgument
from kvstore.tiers.base import MappableTier, TierStats


class ExtentTier(MappableTier):
    """Blocks as extents, LRU-ordered; the store decides what to evict.

    ``meta``, ``contains`` and ``locate`` do not change the LRU order (the
    store calls ``touch`` when a located block is actually read).
    """

    _written_to = "the tier"  # where a slot's bytes were written, as a failed commit tells it

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: OrderedDict[BlockKey, tuple[int, BlockMeta]] = OrderedDict()
        self._reserved: set[int] = set()

    # ---- Tier ------------------------------------------------------------

    def contains(self, key: BlockKey) -> bool:
        with self._lock:
            return key in self._blocks

    def meta(self, key: BlockKey) -> BlockMeta | None:
        with self._lock:
            entry = self._blocks.get(key)
        return None if entry is None else entry[1]

    def put(self, key: BlockKey, data, meta: BlockMeta) -> bool:
        src, size = self._source(data)
        if size != meta.size:
            raise CorruptBlock(f"block {key} is {size} bytes but its meta says {meta.size}")
        with self._lock:
            if key in self._blocks:
                return False
        offset = self.reserve(meta.size)
        try:
            got = self.write_extent(offset, src)
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
            self._free_locked(entry[0])
            return True

    def touch(self, key: BlockKey) -> None:
        with self._lock:
            entry = self._blocks.get(key)
            if entry is not None:
                self._blocks.move_to_end(key)
                self._touched_locked(entry[0])

    def lru(self) -> Iterator[BlockKey]:
        with self._lock:
            keys = list(self._blocks)
        return iter(keys)

    def stats(self) -> TierStats:
        """Used bytes are whole pages and include reserved extents not yet committed."""
        with self._lock:
            return TierStats(self.name, self.used_bytes, self.capacity_bytes, len(self._blocks))

    # ---- MappableTier ------------------------------------------------------

    def reserve(self, size: int) -> int:
        """Offset of a fresh extent of ``size`` bytes that is not yet a block.

        The caller writes it (through :meth:`write_extent` or its own
        mapping), then calls :meth:`commit` or :meth:`unreserve`. Raises
        TierFull when no extent fits (evict and retry), BlockTooLarge when
        none ever could.
        """
        if size < 0:
            raise InvalidArgument(f"block size must not be negative, got {size}")
        need = max(size, 1)  # an empty block still takes a page
        self._check_fits(size, need)
        with self._lock:
            offset = self._allocate_locked(size, need)
            self._reserved.add(offset)
            return offset

    def unreserve(self, offset: int) -> None:
        """Give back a reserved extent that will not be committed."""
        with self._lock:
            self._take_reservation(offset)
            self._free_locked(offset)

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
            extent = self._size_of_locked(offset)
            if key in self._blocks or meta.size > extent:
                self._take_reservation(offset)
                self._free_locked(offset)
                if meta.size > extent:
                    raise InvalidArgument(f"block {key} is {meta.size} bytes but its extent holds {extent}")
                return False
        if verify:
            got = self.checksum_extent(offset, meta.size)
            if got != meta.checksum:
                self.unreserve(offset)
                raise CorruptBlock(
                    f"block {key} written to {self._written_to} does not match its checksum: "
                    f"{got:#x} != {meta.checksum:#x}; freed the slot"
                )
        return self._adopt(key, offset, meta)

    def locate(self, key: BlockKey) -> tuple[int, BlockMeta] | None:
        """Offset and meta of a present block; copies nothing, keeps LRU order."""
        with self._lock:
            return self._blocks.get(key)

    # ---- the block map -------------------------------------------------------

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
                self._free_locked(offset)
                return False
            self._record_locked(key, offset, meta)
            self._blocks[key] = (offset, meta)
            return True

    def _drop(self, key: BlockKey, entry: tuple[int, BlockMeta]) -> None:
        """Remove a block that failed its checksum on read, unless it was replaced meanwhile."""
        with self._lock:
            if self._blocks.get(key) is entry:
                del self._blocks[key]
                self._free_locked(entry[0])

    def _free_locked(self, offset: int) -> None:
        """Give an extent back (a deleted block's, or a reservation's)."""
        self._release_locked(offset)

    # ---- hooks -------------------------------------------------------------

    def _source(self, data) -> tuple[object, int]:
        """What ``put`` copies from, and its size in bytes."""
        src = memoryview(data).cast("B")
        return src, len(src)

    @abc.abstractmethod
    def _check_fits(self, size: int, need: int) -> None:
        """Raise BlockTooLarge when no extent of ``need`` bytes could ever be had (``size`` asked)."""

    @abc.abstractmethod
    def _allocate_locked(self, size: int, need: int) -> int:
        """Offset of a fresh extent of ``need`` bytes; TierFull when none fits now (``size`` asked)."""

    @abc.abstractmethod
    def _size_of_locked(self, offset: int) -> int:
        """Bytes of the extent at ``offset``."""

    @abc.abstractmethod
    def _release_locked(self, offset: int) -> None:
        """Give the extent at ``offset`` back to its allocator."""

    def _record_locked(self, key: BlockKey, offset: int, meta: BlockMeta) -> None:
        """A block is about to be adopted; raise to refuse it (free its extent first)."""

    def _touched_locked(self, offset: int) -> None:
        """The block at ``offset`` was used."""
