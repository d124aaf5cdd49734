"""The GPU tier: blocks in device memory, one region per configured device.

A mappable tier like the host-RAM arena: each device's region is allocated
once at start (:mod:`kvstore.tiers.device`) and carved by the same
:class:`~kvstore.shm.allocator.ExtentAllocator`, so a block is an extent
``(offset, size)`` and the store's slot and lease protocol applies
unchanged. Offsets are global: region *i* spans ``[base_i, base_i + size_i)``
of one offset space, so the store never learns how many devices there are;
:meth:`GpuTier.handle_of` turns an offset into the region's handle and the
offset inside it, for a reader in another process. The block map, the
reservations and the slot protocol are
:class:`~kvstore.tiers.extents.ExtentTier`'s; this tier adds the regions,
the reader pins and the handles.

Bytes cross into and out of device memory only through the region's
``write`` and ``read_into``, which hash them on the way (the contract's
checksum on put and get, with no second pass). ``view`` works only where the
memory is host-addressable (the ``host`` stand-in): the store copies through
:meth:`write_extent` and :meth:`readable` instead.

A new extent goes to the device with the most free room that fits it:
blocks of one engine's prefixes spread evenly, and no device fills while
another has room. Reads copy outside the lock; an extent being read when it
is deleted is freed by its last reader, so a concurrent eviction never hands
out bytes still being copied (the RAM tier copies under its lock instead,
which a device copy is too slow for).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from kvstore.block import BlockKey, BlockMeta, TierName
from kvstore.errors import BlockTooLarge, CorruptBlock, InvalidArgument, TierFull
from kvstore.shm.allocator import ExtentAllocator
from kvstore.tiers.extents import ExtentTier
from kvstore.tiers.device import DeviceMemory, MemoryHandle, open_memory
from kvstore.tiers.device.buffers import nbytes

MIN_GPU_BYTES = 1 << 20


class GpuTier(ExtentTier):
    name = TierName.GPU
    _written_to = "the gpu tier"

    def __init__(self, capacity_bytes: int, devices: Sequence[int] = (0,), memory: str = "cuda", **options) -> None:
        """``capacity_bytes`` per device; ``memory`` a kind of :mod:`kvstore.tiers.device` (``options`` go to it)."""
        if not devices or len(set(devices)) != len(devices):
            raise InvalidArgument(f"gpu devices {list(devices)}: name at least one device, each once")
        if capacity_bytes < MIN_GPU_BYTES:
            raise InvalidArgument(f"--gpu-bytes is {capacity_bytes}; give each device at least {MIN_GPU_BYTES} bytes")
        super().__init__()
        self._regions: list[DeviceMemory] = []
        self._allocs: list[ExtentAllocator] = []
        self._bases: list[int] = []
        try:
            base = 0
            for device in devices:
                alloc = ExtentAllocator(capacity_bytes)
                self._regions.append(open_memory(memory, alloc.capacity_bytes, device, **options))
                self._allocs.append(alloc)
                self._bases.append(base)
                base += alloc.capacity_bytes
        except BaseException:
            for region in self._regions:
                region.close()
            raise
        self._capacity = base
        self._readers: dict[int, int] = {}  # offset -> copies out in progress
        self._doomed: set[int] = set()  # deleted while being read: freed by the last reader

    # ---- Tier ------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def get(self, key: BlockKey) -> bytes | None:
        out = None
        with self._reading(key, touch=True) as entry:
            if entry is None:
                return None
            offset, meta = entry
            region, local = self._region_of(offset)
            out, got = region.read(local, meta.size)
        if got != meta.checksum:
            self._drop(key, entry)
            raise CorruptBlock(f"gpu tier block {key} failed its checksum on read; dropped it")
        return out

    def read_into(self, key: BlockKey, dst) -> BlockMeta | None:
        """Copy block ``key`` into ``dst`` (a host buffer or a CUDA tensor on the block's device), verified
        where its bytes leave device memory; None on a miss. ``dst`` must hold exactly the block."""
        with self._reading(key, touch=True) as entry:
            if entry is None:
                return None
            offset, meta = entry
            if nbytes(dst) != meta.size:
                raise InvalidArgument(f"block {key} is {meta.size} bytes; the buffer holds {nbytes(dst)}")
            region, local = self._region_of(offset)
            got = region.read_into(local, dst)
        if got is not None and got != meta.checksum:
            self._drop(key, entry)
            raise CorruptBlock(f"gpu tier block {key} failed its checksum on read; dropped it")
        return meta

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._reserved.clear()
            regions, self._regions = self._regions, []
        for region in regions:
            region.close()

    # ---- MappableTier --------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._used_locked()  # a sum of ints: a watermark check needs no lock

    @property
    def largest_free_bytes(self) -> int:
        with self._lock:
            return max(a.largest_free_bytes for a in self._allocs)

    def view(self, offset: int, size: int) -> memoryview:
        """A host view, where the memory kind has one (``host``); TierUnavailable for device memory."""
        region, local = self._region_of(offset)
        return region.view(local, size)

    @property
    def host_addressable(self) -> bool:
        return all(region.addressable for region in self._regions)

    def checksum_extent(self, offset: int, size: int) -> int:
        region, local = self._region_of(offset)
        return region.checksum(local, size)

    def write_extent(self, offset: int, src) -> int:
        region, local = self._region_of(offset)
        return region.write(local, src)

    @contextlib.contextmanager
    def readable(self, offset: int, size: int):
        region, local = self._region_of(offset)
        data, _ = region.read(local, size)
        yield memoryview(data)

    @property
    def held_bytes(self) -> int:
        """Bytes of deleted blocks whose extents wait for a copy out in progress before they are reused."""
        with self._lock:
            return sum(self._size_of_locked(offset) for offset in self._doomed)

    # ---- the same-host exchange ----------------------------------------------

    def handles(self) -> list[MemoryHandle]:
        """One handle per device region, in offset order; a reader maps each once."""
        return [region.handle() for region in self._regions]

    def handle_of(self, offset: int) -> tuple[int, int]:
        """(index into :meth:`handles`, offset inside that region) of a global offset."""
        index = self._index_of(offset)
        return index, offset - self._bases[index]

    # ---- internals ---------------------------------------------------------

    def _index_of(self, offset: int) -> int:
        for i in range(len(self._bases) - 1, -1, -1):
            if offset >= self._bases[i]:
                if offset >= self._bases[i] + self._allocs[i].capacity_bytes:
                    break
                return i
        raise InvalidArgument(f"offset {offset} is outside the gpu tier's {self._capacity} bytes")

    def _region_of(self, offset: int) -> tuple[DeviceMemory, int]:
        i = self._index_of(offset)
        return self._regions[i], offset - self._bases[i]

    def _used_locked(self) -> int:
        return sum(a.used_bytes for a in self._allocs)

    @contextlib.contextmanager
    def _reading(self, key: BlockKey, touch: bool):
        """The block's entry, its extent kept from reuse until the copy out ends; None on a miss."""
        with self._lock:
            entry = self._blocks.get(key)
            if entry is not None:
                if touch:
                    self._blocks.move_to_end(key)
                self._readers[entry[0]] = self._readers.get(entry[0], 0) + 1
        try:
            yield entry
        finally:
            if entry is not None:
                with self._lock:
                    offset = entry[0]
                    self._readers[offset] -= 1
                    if not self._readers[offset]:
                        del self._readers[offset]
                        if offset in self._doomed:
                            self._doomed.discard(offset)
                            self._release_locked(offset)

    # ---- ExtentTier's hooks ----------------------------------------------------

    def _source(self, data) -> tuple[object, int]:
        return data, nbytes(data)  # a host buffer or a tensor (a CUDA tensor is copied device to device)

    def _check_fits(self, size: int, need: int) -> None:
        if self._allocs[0].rounded(need) > max(a.capacity_bytes for a in self._allocs):
            raise BlockTooLarge(f"a {size}-byte block cannot fit one device's {self._allocs[0].capacity_bytes} "
                                "bytes of the gpu tier")

    def _allocate_locked(self, size: int, need: int) -> int:
        """On the device with the most free room that fits it."""
        order = sorted(range(len(self._allocs)), key=lambda i: -self._allocs[i].free_bytes)
        for i in order:
            local = self._allocs[i].allocate(need)
            if local is not None:
                return self._bases[i] + local
        raise TierFull(f"gpu tier has no free extent for {size} bytes (largest free "
                       f"{max(a.largest_free_bytes for a in self._allocs)}); evict and retry")

    def _size_of_locked(self, offset: int) -> int:
        i = self._index_of(offset)
        return self._allocs[i].size_of(offset - self._bases[i])

    def _free_locked(self, offset: int) -> None:
        if offset in self._readers:
            self._doomed.add(offset)  # its last reader frees it
        else:
            self._release_locked(offset)

    def _release_locked(self, offset: int) -> None:
        i = self._index_of(offset)
        self._allocs[i].free(offset - self._bases[i])
