"""Leases: time-bounded claims on blocks and arena slots.

Anything a client holds across RPCs is a lease with a deadline: a pin on
blocks, a read of a block in the shared arena, an arena slot being written.
A client that dies never releases what it held, so every lease expires by
itself and the store reclaims it; no claim lives forever.

A lease has a kind, an owner, a deadline and the blocks it holds. Kinds are
open: the store knows three of its own (``PIN``, ``READ``, ``SLOT``) and any
component defines another (a prefill/decode handoff, a replication copy, a
weights reader) with ``LeaseKind("handoff")`` and uses the store's generic
``lease``/``end_lease``, without editing the store. An owner, when set, is
the only one that may end the lease early: another client presenting the
id is refused.

The table is not thread-safe: :class:`~kvstore.store.tiered.TieredStore`
calls it under its own lock.
"""

from __future__ import annotations

import heapq
import itertools
import re
import secrets
from dataclasses import dataclass, field

from kvstore.block import BlockKey, BlockMeta
from kvstore.errors import InvalidArgument, LeaseExpired, LeaseOwnedElsewhere, Overloaded, SlotAlreadyCommitted, UnknownLease

_KIND_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")

# A tagged table (one store of several, see kvstore.store.group) puts its tag
# in the top bits of every id, so an id alone names the store that issued it
# without a shared map; the rest stay random.
ID_BITS = 63
TAG_BITS = 8
RANDOM_BITS = ID_BITS - TAG_BITS
MAX_ID_TAG = (1 << TAG_BITS) - 1


def tag_of(lease_id: int) -> int:
    """The tag a tagged table put in ``lease_id`` (its top bits)."""
    return lease_id >> RANDOM_BITS


@dataclass(frozen=True, slots=True)
class LeaseKind:
    """What a lease is for. ``value`` names it in errors and in the ``kind`` metric label,
    so kinds must be few and fixed in code, never made up per request."""

    value: str

    def __post_init__(self) -> None:
        if not _KIND_RE.match(self.value):
            raise InvalidArgument(f"lease kind {self.value!r} must be a short lowercase word such as 'handoff'")


LeaseKind.PIN = LeaseKind("pin")  # Pin RPC: protects blocks from eviction
LeaseKind.READ = LeaseKind("read")  # Lookup: a block being read in place from the arena
LeaseKind.SLOT = LeaseKind("slot")  # Allocate: an arena extent being written, not yet a block


NO_LEASE = 0  # the id of a pin that found none of its keys: no lease was issued (ids are never 0)


@dataclass(slots=True)
class Lease:
    id: int
    kind: LeaseKind
    deadline: float
    keys: list[BlockKey] = field(default_factory=list)  # blocks this lease pins
    owner: str = ""  # who may end it early; empty: whoever holds the id
    # SLOT only: the block being written, its reserved extent and metadata.
    # A slot pins the block's parent, so a prefix cannot be evicted while
    # its next block is being written.
    block: BlockKey | None = None
    offset: int = 0
    meta: BlockMeta | None = None
    # SLOT only: writes the daemon itself is making into the extent (a peer's PUT receiving
    # into it). While one is in progress the extent is not freed, even when the lease ends;
    # ``ended`` then says it did, and the last writer frees the extent (kvstore.store.slots).
    writing: int = 0
    ended: bool = False


def _expired(kind: LeaseKind, lease_id: int) -> LeaseExpired:
    if kind == LeaseKind.SLOT:
        return LeaseExpired(
            f"slot lease {lease_id} expired before it was committed: nothing was stored; "
            "put the block again (finish sooner, or ask for a longer lease_ms)"
        )
    return LeaseExpired(
        f"{kind.value} lease {lease_id} expired before it was used: ask for a longer lease_ms or finish sooner"
    )


def _never_issued(kind: LeaseKind, lease_id: int) -> UnknownLease:
    return UnknownLease(f"no {kind.value} lease {lease_id}: it was never issued by this daemon (it may have restarted)")


class LeaseTable:
    """``id_tag`` None: ids are 63 random bits. A number: ids carry it in their top
    ``TAG_BITS`` bits and 55 random bits below (still unguessable).

    ``per_owner``: leases one owner (``Lease.owner``: a tenant, a connection, a same-host
    process) may hold at once, so that no caller's pins take every lease of the node (0: no
    share). Leases the daemon takes for itself have no owner and count only against the whole."""

    def __init__(self, max_leases: int, id_tag: int | None = None, per_owner: int = 0) -> None:
        if id_tag is not None and not 0 <= id_tag <= MAX_ID_TAG:
            raise ValueError(f"lease id tag {id_tag} is outside 0..{MAX_ID_TAG}")
        self._max = max_leases
        self._per_owner = per_owner
        self._owned: dict[str, int] = {}  # owner -> leases held; only owners that hold some
        self._tag = id_tag
        self._leases: dict[int, Lease] = {}
        self._deadlines: list[tuple[float, int]] = []
        # Ids are random 63-bit numbers: another client cannot guess a live
        # lease from its own (sequential ids could be taken over by counting),
        # and an id kept from a previous daemon run names nothing here.
        # Recently ended leases and why, so an error can say "expired" or
        # "already committed" rather than just "unknown".
        self._ended: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def count(self, kind: LeaseKind) -> int:
        return sum(1 for lease in self._leases.values() if lease.kind == kind)

    def issue(self, kind: LeaseKind, deadline: float, **fields) -> Lease:
        if len(self._leases) >= self._max:
            raise Overloaded(
                f"{len(self._leases)} leases are open, the limit (--max-leases) is {self._max}: "
                "release leases you no longer need, or retry shortly",
                retry_after_s=0.05,
            )
        owner = fields.get("owner", "")
        if owner and self._per_owner and self._owned.get(owner, 0) >= self._per_owner:
            raise Overloaded(
                f"{owner} holds {self._owned[owner]} leases, its share of this daemon's is {self._per_owner} "
                "(--max-leases-per-identity): release pins and reads you no longer need (unpin), or retry shortly",
                retry_after_s=0.2,
            )
        lease = Lease(self._new_id(), kind, deadline, **fields)
        self._add(lease)
        heapq.heappush(self._deadlines, (deadline, lease.id))
        return lease

    def _new_id(self) -> int:
        while True:
            if self._tag is None:
                lease_id = secrets.randbits(ID_BITS)
            else:
                lease_id = self._tag << RANDOM_BITS | secrets.randbits(RANDOM_BITS)
            if lease_id and lease_id not in self._leases and lease_id not in self._ended:
                return lease_id

    def take(self, lease_id: int, kind: LeaseKind, now: float, owner: str = "") -> Lease:
        """Remove and return a live lease; raise if it expired, never existed or is another's."""
        lease = self._leases.get(lease_id)
        if lease is not None and lease.kind == kind and lease.owner and owner != lease.owner:
            err = LeaseOwnedElsewhere(
                f"{kind.value} lease {lease_id} belongs to another client: only the client that took it may end it"
            )
            # What a server tells the stranger instead: the same as for an id never issued, so that
            # presenting another client's id teaches nothing about it.
            err.stranger_view = _never_issued(kind, lease_id)
            raise err
        if lease is None or lease.kind != kind:
            ended = self._ended.get(lease_id)
            if ended == "expired":
                raise _expired(kind, lease_id)
            if ended == "taken" and kind == LeaseKind.SLOT:
                raise SlotAlreadyCommitted(f"slot {lease_id} was already committed or aborted: allocate a new slot")
            if ended == "taken":
                raise UnknownLease(f"{kind.value} lease {lease_id} was already released")
            raise _never_issued(kind, lease_id)
        if lease.deadline <= now:
            # Let the caller treat it as expired; expire() does the reclaiming.
            raise _expired(kind, lease_id)
        self._drop(lease_id)
        self._remember(lease_id, "taken")
        return lease

    def live(self, lease_id: int, kind: LeaseKind, now: float, owner: str = "") -> Lease:
        """A live lease, left in the table; raise as :meth:`take` does when it ended, never
        existed or is another's."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.kind != kind or lease.deadline <= now or (lease.owner and owner != lease.owner):
            self.take(lease_id, kind, now, owner)  # raises the reason
            raise AssertionError("unreachable")  # pragma: no cover
        return lease

    def extend(self, lease_id: int, kind: LeaseKind, deadline: float, now: float) -> Lease:
        """Move a live lease's deadline to ``deadline`` (never earlier than it was); raise as
        :meth:`take` does when it ended. The old heap entry stays: :meth:`pop_expired` skips an
        entry whose lease has a later deadline."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.kind != kind or lease.deadline <= now:
            self.take(lease_id, kind, now)  # raises the reason (expired, released, never issued)
            raise AssertionError("unreachable")  # pragma: no cover
        if deadline > lease.deadline:
            lease.deadline = deadline
            heapq.heappush(self._deadlines, (deadline, lease_id))
        return lease

    def restore(self, lease: Lease) -> None:
        """Put back a lease taken by a request that then failed as a whole."""
        self._add(lease)
        self._ended.pop(lease.id, None)

    def pop_expired(self, now: float) -> list[Lease]:
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, lease_id = heapq.heappop(self._deadlines)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.deadline <= now:  # a later deadline: extended, a later entry
                self._drop(lease_id)
                expired.append(lease)
                self._remember(lease_id, "expired")
        return expired

    def _add(self, lease: Lease) -> None:
        self._leases[lease.id] = lease
        if lease.owner:
            self._owned[lease.owner] = self._owned.get(lease.owner, 0) + 1

    def _drop(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id)
        if lease.owner:
            left = self._owned[lease.owner] - 1
            if left:
                self._owned[lease.owner] = left
            else:
                del self._owned[lease.owner]

    def held_by(self, owner: str) -> int:
        """Leases ``owner`` holds now."""
        return self._owned.get(owner, 0)

    def _remember(self, lease_id: int, why: str) -> None:
        self._ended[lease_id] = why
        if len(self._ended) > 4 * self._max:
            # Forget the oldest half; beyond that an id is simply "unknown".
            for stale in list(itertools.islice(self._ended, 2 * self._max)):
                del self._ended[stale]
