"""The contract every storage tier keeps.

A tier is one place bytes can live (host RAM, local disk, later a peer or an
object store). It knows nothing of other tiers, pins, leases or prefix chains:
:class:`kvstore.store.tiered.TieredStore` composes tiers and owns policy.

A tier:

- is safe to call from several threads; it does its blocking I/O outside its
  own lock so that one slow read does not stall the others;
- never evicts on its own: ``put`` raises :class:`~kvstore.errors.TierFull`
  and the store chooses what to evict;
- verifies the checksum on every ``put`` (the bytes crossed into it) and every
  ``get`` (they cross out), drops a block that fails and raises
  :class:`~kvstore.errors.CorruptBlock`;
- makes a repeated ``put`` of a present key a no-op (keys are content- or
  prefix-addressed, so the bytes are the same).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass

from kvstore.block import BlockKey, BlockMeta, TierName


@dataclass(frozen=True, slots=True)
class TierStats:
    tier: TierName
    used_bytes: int
    capacity_bytes: int
    blocks: int


class Tier(abc.ABC):
    name: TierName

    @property
    @abc.abstractmethod
    def capacity_bytes(self) -> int: ...

    @abc.abstractmethod
    def contains(self, key: BlockKey) -> bool: ...

    @abc.abstractmethod
    def meta(self, key: BlockKey) -> BlockMeta | None:
        """The block's metadata, or None when absent. Does not touch LRU order."""

    @abc.abstractmethod
    def get(self, key: BlockKey) -> bytes | None:
        """A verified copy of the payload, or None on a miss.

        Raises CorruptBlock (after dropping the block) when the checksum fails.
        """

    @abc.abstractmethod
    def put(self, key: BlockKey, data: bytes | bytearray | memoryview, meta: BlockMeta) -> bool:
        """Store a block; False when the key was already present.

        Raises CorruptBlock when ``checksum(data) != meta.checksum`` or
        ``len(data) != meta.size``, TierFull when there is no room (the caller
        evicts and retries), BlockTooLarge when the block exceeds the whole
        tier (no eviction could help), TierUnavailable/DiskFull when the
        device fails.
        """

    @abc.abstractmethod
    def delete(self, key: BlockKey) -> bool:
        """Remove a block; False when it was absent."""

    @abc.abstractmethod
    def touch(self, key: BlockKey) -> None:
        """Mark the block most recently used."""

    @abc.abstractmethod
    def lru(self) -> Iterator[BlockKey]:
        """Present keys, least recently used first (a snapshot; safe to mutate while iterating)."""

    @abc.abstractmethod
    def stats(self) -> TierStats: ...

    def close(self) -> None:
        """Release the tier's resources. Blocks on a persistent tier stay."""
