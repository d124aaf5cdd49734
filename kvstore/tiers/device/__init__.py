"""Device memory kinds and their registry: a kind name in config -> a constructor.

``cuda`` is device memory through torch (one allocation per device, pinned
host staging, CUDA IPC handles); ``host`` is an in-process stand-in over a
shared-memory file that runs the GPU tier's code on any machine (tests, a
dry run of the device check). A new kind is one module and one entry in
``_KINDS``, and a row in the tier contract suite.
"""

from __future__ import annotations

import importlib

from kvstore.errors import InvalidArgument
from kvstore.tiers.device.base import AttachedMemory, DeviceMemory, MemoryHandle

__all__ = ["AttachedMemory", "DeviceMemory", "MemoryHandle", "attach_memory", "known_kinds", "open_memory", "probe"]

# kind -> (module, owner class, attached class); imported on use, so torch loads only for ``cuda``
_KINDS: dict[str, tuple[str, str, str]] = {
    "cuda": ("kvstore.tiers.device.cuda", "CudaMemory", "AttachedCudaMemory"),
    "host": ("kvstore.tiers.device.host", "HostMemory", "AttachedHostMemory"),
}


def known_kinds() -> list[str]:
    return sorted(_KINDS)


def _entry(kind: str) -> tuple[str, str, str]:
    entry = _KINDS.get(kind)
    if entry is None:
        raise InvalidArgument(f"unknown device memory kind {kind!r}: the known kinds are {', '.join(known_kinds())}")
    return entry


def open_memory(kind: str, size: int, device: int = 0, **options) -> DeviceMemory:
    """A fresh region of ``size`` bytes of ``kind`` memory on device index ``device``."""
    module, owner, _ = _entry(kind)
    return getattr(importlib.import_module(module), owner)(size, device, **options)


def attach_memory(handle: MemoryHandle) -> AttachedMemory:
    """Map a region another process on this host owns (its handle came over the same-host control path)."""
    module, _, attached = _entry(handle.kind)
    return getattr(importlib.import_module(module), attached)(handle)


def probe(kind: str, devices) -> None:
    """Check at start that ``kind`` memory can be had on ``devices``, allocating nothing;
    TierUnavailable naming the fix when it cannot (no CUDA, no such device)."""
    module, _, _ = _entry(kind)
    getattr(importlib.import_module(module), "probe")(list(devices))
