"""The slot protocol: blocks a same-host client writes into the head itself.

``allocate`` reserves head extents under SLOT leases (pinning each block's
parent, so a prefix cannot go while its next block is written); the client
copies its values in and computes their checksums as it goes; ``commit``
verifies each slot against its writer's checksum and adopts it as a block,
all or nothing; ``abort`` gives slots back. A slot whose lease lapses is
reclaimed by the store's lease expiry, so a client that dies mid-write
leaks nothing. Each slot is *lent* to its writer (``MappableTier.lend``):
a head that survives a daemon crash keeps a lent extent from reuse after a
restart for as long as the writer of the previous run may still write it.

When the daemon writes a slot itself (a peer's PUT receives its bytes
straight into the slots it reserved), it writes only inside ``writing``:
that checks the slot's lease is live and owned by the caller, and keeps the
extent from being freed until the write ends, even if the lease lapses
meanwhile (the reaper then only marks it ended, and the write's end frees
it). Checking the lease and then writing without that hold would leave the
gap this closes: a slot reaped between the two is another tenant's block by
the time the bytes land. The writer calls :meth:`SlotWrite.check` between
steps, so a lapsed lease stops it after the step in progress, and the hold
never outlasts the lease by more than one step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvstore.block import BlockKey, BlockMeta, TierName, validate_key
from kvstore.errors import CorruptBlock, InvalidArgument, LeaseError, LeaseExpired
from kvstore.store.leases import Lease, LeaseKind
from kvstore.store.placement import HeadPlacement
from kvstore.store.state import StorePart, StoreState


@dataclass(frozen=True, slots=True)
class SlotGrant:
    key: BlockKey
    present: bool
    slot_id: int = 0
    offset: int = 0
    size: int = 0


# How much longer than its lease a slot's extent stays lent (a crash-safe head keeps
# it from reuse after a restart): the client is told a deadline computed a moment
# after allocate returns, and may be mid-copy at it.
LEND_MARGIN_S = 2.0


def _lapsed(slot_id: int) -> LeaseExpired:
    return LeaseExpired(
        f"slot {slot_id}'s lease expired before its bytes were written: nothing was stored and no byte "
        "went into the slot; put the block again (sooner, or with a longer timeout)"
    )


class SlotWrite:
    """The daemon's own write into one live slot (see the module docstring): where it is, and
    :meth:`check`, which the writer calls before each step."""

    __slots__ = ("_clock", "_lease", "offset", "size", "slot_id")

    def __init__(self, lease: Lease, clock: Callable[[], float]) -> None:
        self.slot_id, self.offset, self.size = lease.id, lease.offset, lease.meta.size
        self._lease = lease
        self._clock = clock

    def check(self) -> None:
        """Raise LeaseExpired once the slot's lease has lapsed (reaped or not): write no more.
        No lock: the extent is held while the write lasts, this only says when to stop."""
        if self._lease.ended or self._lease.deadline <= self._clock():
            raise _lapsed(self.slot_id)


class SlotProtocol(StorePart):
    def __init__(self, state: StoreState, placement: HeadPlacement) -> None:
        super().__init__(state)
        self._place = placement

    def allocate(
        self, namespace: str, blocks: list[tuple[bytes, int, bytes | None, str]], lease_s: float | None = None,
        deadline: float | None = None, owner: str = "",
    ) -> list[SlotGrant]:
        """Reserve head extents for blocks a same-host client will write itself.

        ``blocks`` holds (key, size, parent_key, layout). A key already stored
        gets ``present=True`` and no slot. All slots or none: if one cannot be
        reserved, the ones reserved so far are given back.
        """
        self._s.checks.check_batch(blocks)
        lease_s = self._s.checks.lease_seconds(lease_s, self._s.limits.lease_s)
        with self._cond:
            self._s.known_namespace(namespace, write=True)
        grants: list[SlotGrant] = []
        try:
            for key_bytes, size, parent, layout in blocks:
                key = BlockKey(namespace, validate_key(key_bytes))
                meta = BlockMeta(size=size, checksum=0, parent=parent or None, layout=layout)
                self._s.checks.check_block(key, meta)
                with self._cond:
                    entry = self._catalog.live(key)
                    if entry is not None:
                        self._s.touch_locked(key, entry)
                        grants.append(SlotGrant(key, present=True))
                        continue
                offset = self._place.reserve(size, deadline)
                with self._cond:
                    try:
                        lease = self._s.leases.issue(
                            LeaseKind.SLOT, self._clock() + lease_s, block=key, offset=offset, meta=meta, owner=owner
                        )
                    except BaseException:
                        self._head.unreserve(offset)
                        raise
                    lease.keys = self._s.pin_parent_locked(key, meta)
                grants.append(SlotGrant(key, False, lease.id, offset, size))
            with self._cond:
                # Last, so each extent is lent at least as long as the lease the client is told of.
                for g in grants:
                    if not g.present:
                        self._head.lend(g.offset, lease_s + LEND_MARGIN_S + self._s.limits.lapsed_slot_hold_s)
        except BaseException:
            self.abort([g.slot_id for g in grants if not g.present], owner=owner)
            raise
        return grants

    @contextmanager
    def writing(self, slot_id: int, owner: str = "") -> Iterator[SlotWrite]:
        """``with`` it around the daemon's own write into a slot: LeaseExpired (or the reason the
        slot cannot be written: unknown, committed, another's) when its lease is not live; while
        the block runs, the extent is not freed, whatever happens to the lease."""
        with self._cond:
            self._s.expire_locked()
            try:
                lease = self._s.leases.live(slot_id, LeaseKind.SLOT, self._clock(), owner)
            except LeaseExpired:
                raise _lapsed(slot_id) from None
            lease.writing += 1
        try:
            yield SlotWrite(lease, self._clock)
        finally:
            with self._s.locked():
                lease.writing -= 1
                if lease.ended and not lease.writing:  # it ended while written: given back only now
                    self._head.unreserve(lease.offset)
                    self._cond.notify_all()

    def commit(self, items: list[tuple[int, int | None]], owner: str = "") -> list[tuple[BlockKey, bool, TierName]]:
        """Turn written slots into blocks; ``items`` holds (slot_id, the writer's checksum).

        The writer's checksum is required and verified against the slot
        (``verify_commits``): a slot committed half written, or written by
        someone else, would otherwise be stored as a valid block.
        All or nothing: every slot must be live, else nothing is committed
        and the live slots stay open. A mismatch frees every slot of the
        request and raises CorruptBlock. A block the head refuses to keep
        (a crash-safe RAM tier that cannot record it) ends the commit with
        its error: the slots after it are given back, not committed.
        """
        self._s.checks.check_batch(items)
        if any(declared is None for _, declared in items):
            raise InvalidArgument(
                "Commit needs the writer's checksum (xxh3-64) of every slot: compute it while copying "
                "the value in, and send it with the slot id"
            )
        with self._cond:
            self._s.expire_locked()
            now = self._clock()
            taken: list[Lease] = []
            try:
                for slot_id, _ in items:
                    taken.append(self._s.leases.take(slot_id, LeaseKind.SLOT, now, owner))
                    if taken[-1].writing:
                        raise InvalidArgument(
                            f"slot {slot_id} is still being written: commit it once its bytes are in"
                        )
            except (LeaseError, InvalidArgument):
                for lease in taken:  # put them back untouched
                    self._s.leases.restore(lease)
                raise
        metas, bad = [], []
        for lease, (_, declared) in zip(taken, items):
            if self._s.limits.verify_commits:
                if self._head.checksum_extent(lease.offset, lease.meta.size) != declared:
                    bad.append(lease.block)
            metas.append(BlockMeta(lease.meta.size, declared, lease.meta.parent, lease.meta.layout))
        if bad:
            with self._s.locked():
                for lease in taken:
                    self._head.unreserve(lease.offset)
                    self._s.end_pins_locked(lease)
                self._cond.notify_all()
            self._s.metrics.corrupt.labels(self._head.name.label).inc(len(bad))
            raise CorruptBlock(
                f"{len(bad)} slot(s) hold bytes that do not match their checksum (first: {bad[0]}); "
                "nothing was committed: write the blocks again"
            )
        done: list[tuple[BlockKey, bool, TierName]] = []
        try:
            for lease, meta in zip(taken, metas):
                done.append((lease.block, *self._place.adopt(lease.block, lease.offset, meta, verify=False)))
        except BaseException:  # the head refused one (it gave that extent back): the rest are not committed
            with self._s.locked():
                for lease in taken[len(done) + 1 :]:
                    self._head.unreserve(lease.offset)
                self._cond.notify_all()
            raise
        finally:
            with self._s.locked():
                for lease in taken:
                    self._s.end_pins_locked(lease)
        return done

    def abort(self, slot_ids: Iterable[int], owner: str = "") -> None:
        slot_ids = list(slot_ids)
        self._s.checks.check_batch(slot_ids)
        with self._s.locked():
            now = self._clock()
            for slot_id in slot_ids:
                try:
                    lease = self._s.leases.take(slot_id, LeaseKind.SLOT, now, owner)
                except LeaseError:
                    continue  # expired or unknown: already given back
                self._s.free_slot_locked(lease)
                self._s.end_pins_locked(lease)
            self._cond.notify_all()
