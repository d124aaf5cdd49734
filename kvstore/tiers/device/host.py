"""``host`` device memory: a shared-memory file standing in for a GPU's memory.

It exists so that the GPU tier's code (extents, reservations, leases,
demotion and promotion, the same-host handle exchange) runs for real on a
machine without a GPU, through the same contract suite as the RAM tier. It
reuses :class:`~kvstore.shm.arena.ShmArena` — the file the RAM tier maps — so
its handle is the file's path and random token, the way a CUDA IPC handle
names an allocation: a reader maps the region once and copies the blocks it
holds leases on. Tensors on the host are copied straight; tensors on a
device are refused with a clear error (this kind never touches CUDA).
"""

from __future__ import annotations

import secrets

from kvstore.block import checksum, copy_and_checksum
from kvstore.shm.arena import ShmArena
from kvstore.tiers.device.base import AttachedMemory, DeviceMemory, MemoryHandle
from kvstore.tiers.device.buffers import host_view


def probe(devices: list[int]) -> None:
    """Shared memory is always there; the directory is checked when the region is made."""


class HostMemory(DeviceMemory):
    kind = "host"

    def __init__(self, size: int, device: int = 0, *, shm_dir: str = "/dev/shm", name: str = "",
                 addressable: bool = True) -> None:
        """``addressable`` False refuses :meth:`view` as device memory does, so a store over it takes
        the paths it takes on a GPU (copies through ``write``/``read_into``, buffered streamed writes)."""
        self.device = f"host:{device}"
        self.addressable = addressable
        name = name or f"strata-gpu-{device}-{secrets.token_hex(4)}"
        self._arena = ShmArena.create(size, shm_dir, name)

    @property
    def size(self) -> int:
        return self._arena.size

    def write(self, offset: int, src) -> int:
        return _write(self._arena, self, offset, src)

    def read_into(self, offset: int, dst) -> int:
        return _read_into(self._arena, self, offset, dst)

    def checksum(self, offset: int, size: int) -> int:
        self._check(offset, size)
        view = self._arena.view(offset, size)
        try:
            return checksum(view)
        finally:
            view.release()

    def view(self, offset: int, size: int) -> memoryview:
        if not self.addressable:
            return super().view(offset, size)
        self._check(offset, size)
        return self._arena.view(offset, size)

    def handle(self) -> MemoryHandle:
        return MemoryHandle(self.kind, self.device, self.size, (self._arena.path, self._arena.token))

    def close(self) -> None:
        self._arena.close(unlink=True)


class AttachedHostMemory(AttachedMemory):
    kind = "host"

    def __init__(self, handle: MemoryHandle) -> None:
        path, token = handle.payload
        self.device = handle.device
        self._arena = ShmArena.attach(path, token)

    @property
    def size(self) -> int:
        return self._arena.size

    def read_into(self, offset: int, dst) -> int:
        return _read_into(self._arena, self, offset, dst)

    def write(self, offset: int, src) -> int:
        return _write(self._arena, self, offset, src)

    def close(self) -> None:
        self._arena.close()


def _read_into(arena: ShmArena, region, offset: int, dst) -> int:
    out = host_view(dst, writable=True)
    region._check(offset, len(out))
    src = arena.view(offset, len(out))
    try:
        return copy_and_checksum(out, src)
    finally:
        src.release()


def _write(arena: ShmArena, region, offset: int, src) -> int:
    src = host_view(src)
    region._check(offset, len(src))
    dst = arena.view(offset, len(src))
    try:
        return copy_and_checksum(dst, src)
    finally:
        dst.release()
