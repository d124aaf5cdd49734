"""What an object source may store: the bound checked before every upload.

An upload is admitted in three steps, so an upload that fails or is
cancelled never holds room and a stored block is counted exactly once:
``reserve`` (before any byte is sent: TierFull or BlockTooLarge refuse it),
then ``commit`` when S3 stored it or ``release`` when it did not (failed,
cancelled, or already present). ``forget`` gives back a block this source
saw deleted (a delete, a corrupt copy dropped).

:class:`ByteQuota` is the bound the remote-source contract asks for
(``capacity_bytes``): block bytes this source stored under its prefix,
counted by this source. It does not see other daemons' uploads or a GC's
deletes; the fleet-wide per-namespace bound is
:class:`~kvstore.remote.object.lifecycle.SharedQuota`, which the object tier
checks before a block is queued (usage from the sweep lease, plus this
daemon's uploads since).
"""

from __future__ import annotations

from typing import Protocol

from kvstore.block import BlockKey
from kvstore.errors import BlockTooLarge, StrataError, TierFull

FULL_RETRY_S = 5.0  # room comes back only when something deletes


class Quota(Protocol):
    capacity_bytes: int | None
    used_bytes: int

    def reserve(self, key: BlockKey, size: int) -> StrataError | None: ...
    def commit(self, key: BlockKey, size: int) -> None: ...
    def release(self, key: BlockKey, size: int) -> None: ...
    def forget(self, key: BlockKey, size: int) -> None: ...


class ByteQuota:
    """At most ``capacity_bytes`` of block bytes stored by this source. Used from one event loop."""

    def __init__(self, capacity_bytes: int, name: str) -> None:
        self.capacity_bytes = capacity_bytes
        self.name = name
        self.used_bytes = 0
        self.reserved_bytes = 0

    def reserve(self, key: BlockKey, size: int) -> StrataError | None:
        if size > self.capacity_bytes:
            return BlockTooLarge(
                f"{self.name}: block {key} is {size} bytes, more than the whole quota ({self.capacity_bytes}): "
                "raise it or keep such blocks local"
            )
        if self.used_bytes + self.reserved_bytes + size > self.capacity_bytes:
            return TierFull(
                f"{self.name}: the quota of {self.capacity_bytes} bytes has no room for block {key} ({size} bytes; "
                f"{self.used_bytes} stored, {self.reserved_bytes} being uploaded): delete blocks or raise it",
                retry_after_s=FULL_RETRY_S,
            )
        self.reserved_bytes += size
        return None

    def commit(self, key: BlockKey, size: int) -> None:
        self.reserved_bytes -= size
        self.used_bytes += size

    def release(self, key: BlockKey, size: int) -> None:
        self.reserved_bytes -= size

    def forget(self, key: BlockKey, size: int) -> None:
        self.used_bytes = max(0, self.used_bytes - size)
