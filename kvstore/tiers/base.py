"""The contracts of the store's local tiers.

A tier is one place bytes can live. It knows nothing of other tiers, pins,
leases or prefix chains: :class:`kvstore.store.TieredStore` composes an
ordered chain of them and owns every policy (placement, eviction, demotion,
promotion, recency). Three kinds, from the top of the chain down:

- :class:`MappableTier`: bytes addressable in place, so a same-host client
  reads and writes them through its own mapping (the host-RAM arena; device
  memory, :mod:`kvstore.tiers.gpu`). The head of every chain is one.
- :class:`Tier` (a *local* tier): bounded latency, bytes copied in and out
  (local NVMe).
- a *remote source* (:mod:`kvstore.remote`): asynchronous, deadline-bound,
  may fail part-way (peers, object storage). A different interface, because a
  blocking whole-payload call fits neither a peer nor S3.

Every local tier:

- is safe to call from several threads; it does its blocking I/O outside its
  own lock so that one slow read does not stall the others;
- never evicts on its own: ``put`` raises :class:`~kvstore.errors.TierFull`
  and the store chooses what to evict;
- verifies the checksum on every ``put`` (the bytes crossed into it) and every
  ``get`` (they cross out), drops a block that fails and raises
  :class:`~kvstore.errors.CorruptBlock`;
- makes a repeated ``put`` of a present key a no-op (keys are content- or
  prefix-addressed, so the bytes are the same);
- keeps an order of its blocks (``lru``/``touch``) only so that a
  ``persistent`` tier can hand its recency back after a restart. While the
  daemon runs the store's own recency decides every eviction and tells a
  persistent tier, in batches, which blocks were used (``touch``).

New tiers join by a factory in :mod:`kvstore.tiers`' registry and a row in
``tests/tiers/test_tier_contract.py``.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from kvstore.block import BlockKey, BlockMeta, TierName, checksum, copy_and_checksum


@dataclass(frozen=True, slots=True)
class TierStats:
    tier: TierName
    used_bytes: int
    capacity_bytes: int  # what it can hold now: the configured size, or less when its device holds less
    blocks: int
    degraded: str = ""  # why it cannot take what it was configured for (a full filesystem); "" when it can


class Tier(abc.ABC):
    name: TierName
    persistent: bool = False  # keeps its blocks across a restart (the store recovers them)
    prefaults: bool = False  # faults its arena's pages in at start: same-host clients may map them all at attach
    remote: bool = False  # another machine's: a local miss reads through to it (kvstore.tiers.remote)

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

    def upkeep(self) -> None:
        """Periodic housekeeping; the store calls it about once a second. A tier whose room depends
        on its device (the disk tier on a filesystem that fills) checks it again here, so a
        degraded tier recovers by itself. The default does nothing."""

    def close(self) -> None:
        """Release the tier's resources. Blocks on a persistent tier stay."""


class MappableTier(Tier):
    """A tier whose bytes are addressable in place: the slot protocol.

    ``reserve`` an extent, write it (through :meth:`view` or a client's own
    mapping of the same memory), then ``commit`` it as a block or
    ``unreserve`` it. ``locate`` gives a present block's offset without
    copying, for readers that copy it out themselves under a lease. The store
    frees extents of a mappable tier under its own lock (accounting must be
    exact when a writer waits for room), so ``delete`` must be cheap.
    """

    @property
    @abc.abstractmethod
    def largest_free_bytes(self) -> int: ...

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Bytes taken (blocks and reserved extents): cheap, for the store's watermarks."""

    @abc.abstractmethod
    def reserve(self, size: int) -> int:
        """Offset of a fresh extent; TierFull when none fits now, BlockTooLarge when none ever could."""

    @abc.abstractmethod
    def unreserve(self, offset: int) -> None:
        """Give back a reserved extent that will not be committed."""

    def lend(self, offset: int, seconds: float) -> None:
        """A writer outside the daemon (a same-host client) may write the reserved extent for ``seconds``.

        A tier whose blocks survive a daemon crash keeps such an extent from
        other blocks after a restart until then; others need do nothing.
        """

    @abc.abstractmethod
    def view(self, offset: int, size: int) -> memoryview:
        """A writable view of ``size`` bytes at ``offset``; the caller releases it."""

    host_addressable: bool = True  # view() works; device memory says False and is copied in and out instead

    def write_extent(self, offset: int, src) -> int:
        """Copy ``src`` into the reserved extent at ``offset``; the checksum of the bytes as they crossed.
        The store writes through this, not :meth:`view`, so a tier whose memory the host cannot address
        (device memory) copies its own way."""
        size = memoryview(src).nbytes
        view = self.view(offset, size)
        try:
            return copy_and_checksum(view, src)
        finally:
            view.release()

    def checksum_extent(self, offset: int, size: int) -> int:
        """The checksum of ``size`` bytes at ``offset`` (a slot its writer filled through its own mapping)."""
        view = self.view(offset, size)
        try:
            return checksum(view)
        finally:
            view.release()

    @contextlib.contextmanager
    def readable(self, offset: int, size: int) -> Iterator[memoryview]:
        """The ``size`` bytes at ``offset`` for the length of a ``with``: a view in place where the host
        addresses the memory, a copy where it does not."""
        view = self.view(offset, size)
        try:
            yield view
        finally:
            view.release()

    @abc.abstractmethod
    def commit(self, key: BlockKey, offset: int, meta: BlockMeta, verify: bool = True) -> bool:
        """Adopt a reserved, written extent as block ``key``; False when ``key`` was present (extent freed)."""

    @abc.abstractmethod
    def locate(self, key: BlockKey) -> tuple[int, BlockMeta] | None:
        """Offset and meta of a present block; copies nothing."""

    def handle_of(self, offset: int) -> tuple[int, int]:
        """(region, offset inside that region) of an offset this tier handed out, for a reader in
        another process that maps each region once. A tier of one region (the host-RAM arena)
        answers ``(0, offset)``; device memory spans one region per device."""
        return 0, offset
