"""What a client holds on stored blocks: reads in place, and leases of any kind.

A same-host reader does not get a block's bytes over the socket: ``lookup``
leases the block in place in the head (promoting it there first when only a
lower tier has it) and answers its arena offset; the reader copies it out,
verifies its checksum and ends the lease with ``release``, which says whether the
bytes it read were stable. ``lease`` holds present blocks under a lease of a
kind a component defines (a pin, a handoff, a replication copy), ended by
``end_lease`` or moved by ``extend_lease``. Both are the same job: a
time-bounded claim on present blocks that keeps them from eviction, issued
in the :class:`~kvstore.store.leases.LeaseTable` and counted in the blocks'
pins. It is apart from the facade (:mod:`~kvstore.store.tiered`) as the slot
protocol (:mod:`~kvstore.store.slots`) is: one protocol, one module.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvstore.block import BlockKey, BlockMeta, TierName, validate_key
from kvstore.errors import CorruptBlock, InvalidArgument, LeaseError, LeaseOwnedElsewhere
from kvstore.store.leases import NO_LEASE, Lease, LeaseKind
from kvstore.store.placement import HeadPlacement
from kvstore.store.reads import READ_THROUGH_BATCH, ChainReader
from kvstore.store.state import StorePart, StoreState


@dataclass(frozen=True, slots=True)
class Located:
    """A block found by :meth:`~kvstore.store.tiered.TieredStore.lookup`.

    ``lease_id`` 0 means the block exists but could not be brought into the
    head (it is full of pinned blocks): read it with :meth:`~kvstore.store.tiered.TieredStore.get`.
    """

    key: BlockKey
    meta: BlockMeta
    tier: TierName
    offset: int = 0
    lease_id: int = 0


class BlockHolds(StorePart):
    def __init__(self, state: StoreState, placement: HeadPlacement, reader: ChainReader) -> None:
        super().__init__(state)
        self._leases = state.leases
        self._place = placement
        self._reader = reader

    def lookup(
        self, namespace: str, keys: list[bytes], lease_s: float | None = None, deadline: float | None = None,
        owner: str = "", *, local_only: bool = False,
    ) -> list[Located | None]:
        """Lease each present block in place in the head (None for a miss).

        A block only below the head is promoted first; the reader then copies
        it out of the arena, verifies its checksum and releases the lease.
        ``local_only`` as for :meth:`~kvstore.store.tiered.TieredStore.get` (a peer's read over the peer data plane).
        """
        self._s.checks.check_batch(keys)
        lease_s = self._s.checks.lease_seconds(lease_s, self._s.limits.lease_s)
        with self._cond:
            self._s.readable_namespace(namespace)
        out: list[Located | None] = []
        block_keys = [BlockKey(namespace, validate_key(k)) for k in keys]
        fetched: dict[BlockKey, tuple[bytes, BlockMeta, TierName] | None] = {}
        batched: set[BlockKey] = set()  # keys of this window read through together (found or not)
        for n, key in enumerate(block_keys):
            if n % READ_THROUGH_BATCH == 0 and not local_only:
                fetched = self._reader.read_through_absent(block_keys[n:n + READ_THROUGH_BATCH], deadline)
                batched = set(fetched)
            got = fetched.pop(key, None)
            if got is not None:  # read through with the others of its batch: as for one block below
                located = self._lease_in_head(key, lease_s, owner, found_in=got[2])
                out.append(located or Located(key, got[1], got[2]))
                continue
            located = self._lease_in_head(key, lease_s, owner)
            if located is not None:
                self._s.metrics.hits.labels(self._head.name.label).inc()
                out.append(located)
                continue
            with self._cond:
                entry = self._catalog.live(key)
                if entry is not None:
                    entry.pins += 1
            if entry is None:  # a miss, unless its batch was not read through (then it is read alone)
                got = None if local_only or key in batched else self._reader.read_through(key, deadline)
                if got is None:
                    self._s.metrics.misses.inc()
                    out.append(None)
                    continue
                located = self._lease_in_head(key, lease_s, owner, found_in=got[2])
                out.append(located or Located(key, got[1], got[2]))
                continue
            with self._cond:
                listed = frozenset(entry.tiers)
            try:
                found = self._reader.read_best(key, entry, local_only=local_only)
            except CorruptBlock:
                found = None  # dropped and counted; for a batch read it is a miss
            finally:
                with self._s.locked():
                    self._s.unpin_locked(key, entry)
            if found is None:
                # every listed copy failed: a remote tier the store did not list may still have it
                got = None if local_only else self._reader.read_through(key, deadline, skip=listed)
                if got is None:
                    self._s.metrics.misses.inc()
                    out.append(None)
                    continue
                located = self._lease_in_head(key, lease_s, owner, found_in=got[2])
                out.append(located or Located(key, got[1], got[2]))
                continue
            data, tier = found
            self._s.metrics.hits.labels(tier.label).inc()
            if self._chain.is_head(tier) or (self._chain.promotes(tier) and self._place.promote(key, data, entry.meta, deadline, tier)):
                located = self._lease_in_head(key, lease_s, owner, found_in=tier)
            out.append(located or Located(key, entry.meta, tier))
        return out

    def _lease_in_head(self, key: BlockKey, lease_s: float, owner: str, found_in: TierName | None = None) -> Located | None:
        with self._cond:
            self._s.expire_locked()
            entry = self._catalog.live(key)
            if entry is None or self._head.name not in entry.tiers:
                return None
            loc = self._head.locate(key)
            if loc is None:
                return None
            lease = self._leases.issue(LeaseKind.READ, self._clock() + lease_s, keys=[key], owner=owner)
            entry.pins += 1
            self._s.touch_locked(key, entry)
            self._s.metrics.bytes_out.labels(self._head.name.label).inc(entry.meta.size)
            return Located(key, entry.meta, found_in or self._head.name, loc[0], lease.id)

    def release(self, lease_ids: Iterable[int], owner: str = "") -> list[bool]:
        """End read leases; per lease, whether it was still valid (the bytes read were stable)."""
        lease_ids = list(lease_ids)
        self._s.checks.check_batch(lease_ids)
        out = []
        with self._s.locked():
            self._s.expire_locked()
            now = self._clock()
            for lease_id in lease_ids:
                try:
                    lease = self._leases.take(lease_id, LeaseKind.READ, now, owner)
                except LeaseError:
                    out.append(False)
                    continue
                self._s.end_pins_locked(lease)
                out.append(True)
        return out

    def lease(
        self, namespace: str, keys: list[bytes], kind: LeaseKind, lease_s: float | None = None, owner: str = "",
    ) -> tuple[Lease, list[bytes]]:
        """Hold present blocks under a lease of ``kind`` (never evicted until it ends); returns (lease, missing keys).

        Any component defines its own kind (a handoff, a replication copy, a
        weights reader) and ends it with :meth:`end_lease`.
        """
        if kind in (LeaseKind.READ, LeaseKind.SLOT):
            raise InvalidArgument(f"{kind.value} leases come from lookup and allocate, not from lease()")
        if not keys:
            raise InvalidArgument(f"a {kind.value} lease needs at least one key: name the blocks to hold")
        self._s.checks.check_batch(keys)
        keys = [validate_key(k) for k in keys]
        lease_s = self._s.checks.lease_seconds(lease_s, self._s.limits.pin_lease_s)
        with self._cond:
            self._s.expire_locked()
            self._s.known_namespace(namespace)
            present, missing = [], []
            for k in keys:
                key = BlockKey(namespace, k)
                (missing.append(k) if self._catalog.live(key) is None else present.append(key))
            if not present and kind is LeaseKind.PIN:  # nothing to hold: no lease is taken from the table
                return Lease(NO_LEASE, kind, self._clock() + lease_s, owner=owner), missing
            lease = self._leases.issue(kind, self._clock() + lease_s, keys=present, owner=owner)
            for key in present:
                self._catalog.entries[key].pins += 1
            return lease, missing

    def end_lease(self, lease_id: int, kind: LeaseKind, owner: str = "") -> bool:
        """End a lease early; False when it already ended (expired or released)."""
        with self._s.locked():
            self._s.expire_locked()
            try:
                lease = self._leases.take(lease_id, kind, self._clock(), owner)
            except LeaseOwnedElsewhere:
                raise
            except LeaseError:
                return False
            self._s.end_pins_locked(lease)
            return True

    def extend_lease(self, lease_id: int, kind: LeaseKind, lease_s: float) -> float:
        """Move a live lease's deadline to ``lease_s`` from now (never earlier); returns the deadline.
        Raises LeaseExpired or UnknownLease when it already ended."""
        with self._s.locked():
            self._s.expire_locked()
            return self._leases.extend(lease_id, kind, self._clock() + lease_s, self._clock()).deadline
