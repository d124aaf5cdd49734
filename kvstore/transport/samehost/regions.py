"""The gpu tier across the same-host socket: its regions' handles on the wire, and a client's mappings.

When the daemon's chain starts at the gpu tier, Lookup leases and Allocate
slots are extents of device memory, not of the RAM arena every client maps.
A client that says so in its Hello (``CAPABILITY`` in protocol 2 of
:mod:`kvstore.transport.samehost.frames`) is sent one :class:`MemoryHandle` per
device region in the Hello answer, and each Lookup entry or Allocate grant
names its region by index into that list with the offset inside it. The
client maps each region once (:class:`Regions`, keyed by handle) and copies
the leased bytes with :meth:`AttachedMemory.read_into`, or writes a slot
with :meth:`AttachedMemory.write`, under the same leases as arena extents.

Why a put from a CUDA tensor writes a gpu slot through the client's own
mapping, rather than going into the RAM arena for the store's policy to
promote: the block lands at once where the node's readers read it, in one
device-to-device copy, where the other way costs a device-to-host copy, a
host copy into the arena, and a host-to-device copy on promotion (only on a
later read, so the next reader would be served from RAM). The price is the
verification: the writer hashes the bytes it wrote (through the region's
pinned staging, as every device write is hashed) and the daemon hashes the
slot again at Commit (``DeviceMemory.checksum``, the contract's check of a
writer it cannot see), two device-to-host passes that the device check
measures. Blocks up to the inline limit go inline through host memory: one
round trip costs less there than a device copy's setup.

Handles cross the same-host socket only, whose peers share the host and
uid: a CUDA IPC handle names nothing on another machine, and gRPC never
carries one. Both same-host transports (:mod:`~kvstore.transport.samehost.client`,
:mod:`~kvstore.transport.samehost.client_aio`) declare it by default. A client
that does not (protocol 1, or ``gpu=False``) never sees a device offset:
its Lookups answer found but not leased (it reads through its fallback,
the gRPC stream) and its Allocates are refused with :class:`ArenaUnusable`
(it puts inline or through the stream).

A daemon restart makes new regions (new handles): a connection is answered
the handles of the daemon it reached, so a client never reads through the
previous daemon's mapping; :meth:`Regions.keep_only` closes mappings no
daemon serves any more.
"""

from __future__ import annotations

import threading

import msgpack

from kvstore.errors import InvalidArgument
from kvstore.transport import arena_io
from kvstore.tiers.device import AttachedMemory, MemoryHandle, attach_memory
from kvstore.tiers.device.buffers import host_view, is_tensor, tensor_bytes

CAPABILITY = "gpu"
MAX_REGIONS = 16  # as many as --gpu-devices may name
MAX_MAPPED = 2 * MAX_REGIONS  # mappings kept: this daemon's regions, and a restarted daemon's meanwhile


def on_device(value) -> bool:
    return is_tensor(value) and value.device.type != "cpu"


def device_or_host(value):
    """A put's value as bytes: a CUDA tensor's flat uint8 view (it stays on its device), else a host view."""
    return tensor_bytes(value) if on_device(value) else host_view(value)


def on_host(value) -> memoryview:
    """Bytes for a path that reads them on the host (inline, the arena, the stream): a CUDA tensor is copied."""
    return memoryview(tensor_bytes(value).cpu().numpy()) if on_device(value) else value


def placed_out(view, size: int):
    """The first ``size`` bytes of a placed buffer: a CUDA tensor's flat bytes, or a host view's."""
    if on_device(view):
        out = tensor_bytes(view)
        if out.numel() < size:
            raise InvalidArgument(f"the tensor holds {out.numel()} bytes; the block has {size}: pass a larger one")
        return out[:size]
    return view[:size]


def copy_up(host: memoryview, out) -> None:
    """Bytes read (and verified) on the host into a CUDA tensor: the paths that are not a gpu region."""
    import torch

    out[:len(host)].copy_(torch.frombuffer(host, dtype=torch.uint8))


def arena_into(arena, offset: int, out) -> int:
    """:func:`arena_io.copy_out` into a host view or, through a host buffer, a CUDA tensor."""
    if not on_device(out):
        return arena_io.copy_out(arena, offset, out)
    host = memoryview(bytearray(out.numel()))
    got = arena_io.copy_out(arena, offset, host)
    copy_up(host, out)
    return got


def to_wire(handle: MemoryHandle) -> list:
    return [handle.kind, handle.device, handle.size, list(handle.payload)]


def from_wire(value) -> MemoryHandle:
    if not isinstance(value, list) or len(value) != 4:
        raise InvalidArgument(f"malformed region handle from the daemon: {value!r:.80}")
    kind, device, size, payload = value
    if not (isinstance(kind, str) and isinstance(device, str) and isinstance(size, int) and isinstance(payload, list)):
        raise InvalidArgument(f"malformed region handle from the daemon: {value!r:.80}")
    return MemoryHandle(kind, device, size, tuple(payload))


def regions_from_wire(value) -> list[MemoryHandle]:
    if not isinstance(value, list) or len(value) > MAX_REGIONS:
        raise InvalidArgument(f"malformed region list from the daemon: {value!r:.80}")
    return [from_wire(v) for v in value]


def _key(handle: MemoryHandle) -> bytes:
    return msgpack.packb(to_wire(handle), use_bin_type=True)


class Regions:
    """One client's mappings of the daemon's gpu regions, by handle; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mapped: dict[bytes, AttachedMemory] = {}

    def region(self, handles: list[MemoryHandle], index) -> AttachedMemory:
        """The mapping of region ``index`` of ``handles`` (a connection's), attached on first use."""
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(handles):
            raise InvalidArgument(f"the daemon named region {index!r} of the {len(handles)} it handed out")
        handle = handles[index]
        key = _key(handle)
        with self._lock:
            found = self._mapped.get(key)
            if found is not None:
                return found
        attached = attach_memory(handle)  # outside the lock: a CUDA attach takes milliseconds
        if attached.size != handle.size:
            attached.close()
            raise InvalidArgument(f"the {handle.kind} region on {handle.device} maps {attached.size} bytes, "
                                  f"its handle says {handle.size}")
        with self._lock:
            found = self._mapped.setdefault(key, attached)
            over = len(self._mapped) > MAX_MAPPED
        if found is not attached:
            attached.close()  # another thread mapped it first
        if over:
            raise InvalidArgument(f"the daemon handed out more than {MAX_MAPPED} regions: reconnect")
        return found

    def mapped(self) -> int:
        with self._lock:
            return len(self._mapped)

    def handles(self) -> list[MemoryHandle]:
        """The handles of the regions mapped now."""
        with self._lock:
            return [from_wire(msgpack.unpackb(k, raw=False)) for k in self._mapped]

    def keep_only(self, handles: list[MemoryHandle]) -> None:
        """Close the mappings of regions not in ``handles`` (the daemon that made them is gone)."""
        keep = {_key(h) for h in handles}
        with self._lock:
            gone = [k for k in self._mapped if k not in keep]
            closing = [self._mapped.pop(k) for k in gone]
        for attached in closing:
            attached.close()

    def close(self) -> None:
        self.keep_only([])
