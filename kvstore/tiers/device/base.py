"""Device memory: the bytes of the GPU tier, one region per configured device.

The GPU tier (:mod:`kvstore.tiers.gpu`) owns the policy-free bookkeeping of a
mappable tier (block map, extents, reservations); a :class:`DeviceMemory`
owns only the region and the copies into and out of it. Keeping them apart
is what lets the same tier code run on a machine without a GPU: the
``host`` implementation stands a shared-memory file in for device memory,
and the contract suite, the leases, demotion and promotion and the same-host
handle exchange run for real on it.

The contract of every implementation:

- the region is allocated once, at construction, and never grows: a device
  whose memory is short fails the start, not a put;
- ``write`` and ``read_into`` return the checksum (xxh3-64) of the bytes as
  they crossed into or out of the region, computed on the host side of the
  copy, so a block is never verified from a second pass over its bytes;
- ``checksum`` hashes bytes already in the region (a commit whose writer
  wrote through its own mapping);
- ``handle`` describes the region to another process on the same host
  (:func:`kvstore.tiers.device.attach_memory` maps it there); the handle
  says nothing of blocks: offsets and leases come from the store, as for the
  host arena's slots;
- bounds are checked on every call: an offset outside the region is
  ``InvalidArgument``, never a stray write.

Errors: :class:`~kvstore.errors.TierUnavailable` when the device or its
runtime is missing (the message names the setting to change),
:class:`~kvstore.errors.InvalidArgument` for a bad offset or buffer.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

from kvstore.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class MemoryHandle:
    """What another process on the host needs to map a region: its kind, its size, and an opaque payload
    (the CUDA IPC handle of the region's allocation, or the shared-memory file's path and token)."""

    kind: str
    device: str
    size: int
    payload: Any


class RegionAccess(abc.ABC):
    """Copies between a region and the host, bounds-checked; what an owner and an attached reader share."""

    kind: str = ""
    device: str = ""

    @property
    @abc.abstractmethod
    def size(self) -> int: ...

    @abc.abstractmethod
    def read_into(self, offset: int, dst) -> int:
        """Copy ``len(dst)`` bytes at ``offset`` into ``dst`` (a writable buffer, or a tensor on this
        device or the host); the checksum of the bytes copied."""

    def read(self, offset: int, size: int) -> tuple[bytes, int]:
        """The ``size`` bytes at ``offset`` and their checksum."""
        out = bytearray(size)
        got = self.read_into(offset, memoryview(out))
        return bytes(out), got

    @abc.abstractmethod
    def close(self) -> None: ...

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise InvalidArgument(
                f"{length} bytes at offset {offset} leave the {self.size}-byte {self.kind} region on {self.device}"
            )


class DeviceMemory(RegionAccess):
    """One region of device memory owned by this process."""

    addressable: bool = False  # view() gives host access in place (only a host stand-in can)

    @abc.abstractmethod
    def write(self, offset: int, src) -> int:
        """Copy ``src`` (bytes-like, or a tensor on any device) into the region at ``offset``;
        the checksum of the bytes copied."""

    @abc.abstractmethod
    def checksum(self, offset: int, size: int) -> int:
        """The checksum of ``size`` bytes already in the region."""

    def view(self, offset: int, size: int) -> memoryview:
        """A writable host view of the bytes, where the region is host-addressable; device memory is not."""
        from kvstore.errors import TierUnavailable

        raise TierUnavailable(
            f"{self.kind} memory on {self.device} is not addressable from the host: copy with write/read_into, "
            "or map it in another process through its handle"
        )

    @abc.abstractmethod
    def handle(self) -> MemoryHandle:
        """The region's handle for another process on this host."""


class AttachedMemory(RegionAccess):
    """A region another process owns, mapped here through its :class:`MemoryHandle`. A reader copies
    only blocks it holds a read lease on; it writes only an extent it holds a slot on (Allocate), and
    the owner verifies that extent's bytes (``DeviceMemory.checksum``) when the slot is committed."""

    @abc.abstractmethod
    def write(self, offset: int, src) -> int:
        """As :meth:`DeviceMemory.write`, into an extent this process holds a slot on."""
