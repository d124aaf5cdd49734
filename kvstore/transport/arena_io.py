"""Copies between a caller's buffers and the daemon's arena, under leases that must still hold.

Shared by every transport that moves bytes through the arena (the
same-host socket, the gRPC-controlled arena path, the clients' codec).
"""

from __future__ import annotations

import time

from kvstore.block import checksum, copy_and_checksum
from kvstore.shm.arena import ShmArena

# A lease is relied on only until this margin before its deadline (client and
# daemon share a host, so they share a clock): a read in place that finished
# earlier is trusted without asking the daemon; later, the client asks
# (Release) whether the lease held and reads again if it did not. Slots are
# written only inside the margin too. Short leases get a quarter of their span.
LEASE_MARGIN_MS = 1000

# Slots are committed in a few groups, each group's Commit in flight while the
# next group is copied: the daemon checksums one group on its own core while
# the client copies the next. Each Commit costs a round trip of client CPU, so
# groups are at least this big and at most MAX_COMMIT_GROUPS per batch.
MIN_COMMIT_GROUP_BYTES = 8 << 20
MAX_COMMIT_GROUPS = 3


def now_ms() -> float:
    return time.time() * 1000


def lease_held(deadline_ms: int, received_ms: float) -> bool:
    margin = min(LEASE_MARGIN_MS, (deadline_ms - received_ms) / 4)
    return now_ms() < deadline_ms - margin


def copy_out(arena: ShmArena, offset: int, out: memoryview) -> int:
    """Copy ``len(out)`` bytes at ``offset`` of the arena into ``out``; their checksum."""
    src = arena.view(offset, len(out))
    try:
        return copy_and_checksum(out, src)
    finally:
        src.release()


def copy_in(arena: ShmArena, offset: int, value: memoryview) -> int:
    """Copy a value into its slot; returns its xxh3, computed in the same pass (the Commit carries it)."""
    dst = arena.view(offset, len(value))
    try:
        return copy_and_checksum(dst, value)
    finally:
        dst.release()


def copy_new(arena: ShmArena, offset: int, size: int) -> tuple[memoryview, int]:
    """``size`` bytes at ``offset`` of the arena in a new buffer, and their checksum.

    One allocation that is the copy (``bytearray(view)`` never zeroes what it
    is about to overwrite, as ``bytearray(size)`` does), then the checksum of
    the copy, read back from the cache the copy left it in."""
    src = arena.view(offset, size)
    try:
        out = bytearray(src)
    finally:
        src.release()
    return memoryview(out), checksum(out)


def commit_groups(sizes: list[int]) -> list[list[int]]:
    """Indices of the slots to write, in commit groups (see MIN_COMMIT_GROUP_BYTES)."""
    group_bytes = max(MIN_COMMIT_GROUP_BYTES, -(-sum(sizes) // MAX_COMMIT_GROUPS))
    groups: list[list[int]] = []
    group: list[int] = []
    size = 0
    for i, n in enumerate(sizes):
        group.append(i)
        size += n
        if size >= group_bytes:
            groups.append(group)
            group, size = [], 0
    if group:
        groups.append(group)
    return groups


def batches_by_bytes(sizes: list[int], limit: int) -> list[list[int]]:
    """Indices split so that no batch asks for more than ``limit`` bytes of arena at once.

    Slots are held until committed, so one batch larger than the arena could
    never be placed; a quarter of it leaves room for other writers.
    """
    out: list[list[int]] = []
    group: list[int] = []
    size = 0
    for i, n in enumerate(sizes):
        if group and size + n > limit:
            out.append(group)
            group, size = [], 0
        group.append(i)
        size += n
    if group:
        out.append(group)
    return out
