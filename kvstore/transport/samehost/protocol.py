"""The client's half of the same-host protocol without its I/O: what each request says, what its answer means.

Both client transports drive this module, as httpcore drives h11: the
blocking one (:mod:`~kvstore.transport.samehost.client`, a pool of
connections each carrying one request at a time) and the asyncio one
(:mod:`~kvstore.transport.samehost.client_aio`, one connection whose
replies a reader task hands to each request's future). They differ in how
they wait and where copies run, which is why neither is generated from the
other; what they decide is decided here, once:

- :class:`Hello`: the daemon's limits and head, from the Hello answer;
- :class:`Read`: one ``get_into``: blocks read from remembered arena
  extents (:mod:`~kvstore.transport.samehost.locations`), the Lookup and
  what its answer leases, the copies, whether the leases need an answered
  Release, which blocks to read again through the fallback and where
  (CUDA tensors staged through host memory there);
- :class:`Put`: one ``put``: which blocks go inline and which into slots,
  the Put and Allocate requests, the Commit groups and their copies
  (into the arena, or a gpu region through its mapping).

``tests/transport/test_samehost_twins.py`` checks that both transports send the same
requests for the same calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from kvstore.block import TierName, checksum
from kvstore.errors import InvalidArgument, LeaseExpired, StaleAttachment, StrataError
from kvstore.shm.arena import ShmArena
from kvstore.tiers.device import MemoryHandle
from kvstore.transport import arena_io
from kvstore.transport.base import Block, BlockInfo, BlockPut, Place, fit
from kvstore.transport.samehost import frames, regions
from kvstore.transport.samehost.locations import DEFAULT_CAPACITY, Locations

# Blocks up to this size travel inline in a Put frame: one round trip, where
# the arena path needs two (Allocate, Commit). Above it the copy dominates
# and writing in place saves the socket's two copies.
INLINE_BYTES = 256 << 10
# ... unless the batch is large: then its blocks are written in place, where one Allocate and
# pipelined Commits serve the whole batch and no byte crosses the socket. Measured (put_many of
# fresh keys, GB/s inline / in place): 256 KiB blocks 1.1 / 1.6 at 2 MiB, 1.46 / 2.1 at 4 MiB,
# SGLang's pages 0.85 / 2.25 at 64 MiB; 64 KiB blocks 0.28 / 0.21 at 2 MiB, 0.27 / 0.26 at 3 MiB,
# 0.44 / 0.74 at 8 MiB; 16 and 32 KiB blocks even at 3-4 MiB. So: blocks of at least
# IN_PLACE_MIN_BYTES in a batch over INLINE_BATCH_BYTES, and any block in a batch over four times that.
INLINE_BATCH_BYTES = 1 << 20
IN_PLACE_MIN_BYTES = 128 << 10
# Read leases waiting to ride on the next Lookup: at most this many, this long.
MAX_PENDING_RELEASES = 256
RELEASE_DELAY_S = 0.05
MAX_TOUCHED = 4096  # keys read without asking, reported per flush
DEFAULT_LOCATIONS = DEFAULT_CAPACITY
NEW = object()  # where a get's block goes: a buffer its copy makes (see Read._out)


def timeout_ms(remaining: float | None) -> int:
    """The daemon's share of a call's remaining seconds: a little less, so its answer (a refusal, say)
    arrives in time; 0 without a deadline."""
    return 0 if remaining is None else max(1, int(remaining * 900))


def stale_attachment(refusal: InvalidArgument) -> StaleAttachment:
    """What a client is told when the daemon refuses a token it accepted before (both transports)."""
    return StaleAttachment(f"the daemon refused this client's arena token ({refusal}); it restarted since the "
                           "client attached: attach again")


def exists_answer(answer) -> list[TierName]:
    """An Exists answer's tiers; StrataError when it is not a list of tier numbers."""
    try:
        return [TierName(t) for t in answer]
    except (TypeError, ValueError):
        raise StrataError(f"the daemon sent a malformed Exists answer: {answer!r:.120}") from None


def hello_request(token: bytes, gpu: bool) -> list:
    """Protocol 2 with the client's capabilities: with ``gpu``, a gpu head's extents come with their region."""
    return [frames.PROTOCOL_VERSION, bytes(token), [regions.CAPABILITY] if gpu else []]


@dataclass(frozen=True, slots=True)
class Hello:
    """The daemon's Hello answer: its limits, its removal page and what its head is."""

    max_meta: int
    max_payload: int
    max_batch: int
    removal_page: str
    head: TierName
    regions: list[MemoryHandle]
    prefault: bool = False  # the daemon faults the arena's pages in: the client maps them all at attach
    exists: bool = False  # the daemon answers Exists on this socket (an older one only over gRPC)

    @classmethod
    def parse(cls, answer) -> Hello:
        """A daemon that answers as protocol 1 did is taken as a RAM head without regions."""
        try:
            max_meta, max_payload, max_batch, removal_page, *head = answer
            head = head[0] if head else {"tier": int(TierName.HOST), "regions": []}
            return cls(max_meta, max_payload, max_batch, removal_page, TierName(head["tier"]),
                       regions.regions_from_wire(head["regions"]), bool(head.get("prefault", False)),
                       bool(head.get("exists", False)))
        except (TypeError, ValueError, KeyError):
            raise StrataError(f"the daemon sent a malformed Hello answer: {answer!r:.120}") from None

    @property
    def in_place(self) -> bool:
        """Whether slots and leases are usable in place: in the arena, or in regions this client was handed."""
        return self.head == TierName.HOST or bool(self.regions)

    def prefaults_arena(self) -> bool:
        """Whether the client should fault its mapping of the arena in (see :class:`kvstore.shm.arena.Prefault`):
        a first touch of each page of a fresh mapping costs a fault, several times the copy of the page."""
        return self.prefault and self.head == TierName.HOST

    @property
    def device_tensors(self) -> bool:
        """Whether a CUDA tensor can be written into (and read out of) a slot device to device."""
        return any(h.kind == "cuda" for h in self.regions)

    @property
    def max_inline(self) -> int:
        """The most bytes of values one Put frame carries."""
        return min(self.max_payload, self.max_meta // 2)


def leased_ids(lookup_answer) -> list[int]:
    """The read leases a Lookup answer grants (to give back when nobody reads them)."""
    return [e[5] for e in lookup_answer[1] if e is not None and e[5]]


def granted_slot_ids(allocate_answer) -> list[int]:
    """The slots an Allocate answer grants (to abort when nobody writes them)."""
    return [grant[1] for grant in allocate_answer[1] if not grant[0]]


@dataclass(slots=True)
class ReadCopy:
    """One block's bytes between the arena (or a gpu region) and the caller's buffer."""

    index: int  # of the key in the call
    out: object  # a host view, or a CUDA tensor's bytes; None: a new buffer, made by the copy (a get's)
    offset: int
    region: int | None  # index into the Hello's regions; None: the arena
    size: int
    checksum: int
    parent: bytes | None
    layout: str
    tier: TierName


def copy_out(arena: ShmArena, mapped: regions.Regions, handles: list[MemoryHandle], copies: Sequence[ReadCopy],
             ) -> list[int | None]:
    """Each copy's bytes into its buffer; their checksums (None: copied device to device, verified on the way in).
    A copy without a buffer gets a new one, filled as it is made."""
    sums: list[int | None] = []
    for c in copies:
        if c.region is not None:
            sums.append(mapped.region(handles, c.region).read_into(c.offset, c.out))
        elif c.out is None:
            c.out, got = arena_io.copy_new(arena, c.offset, c.size)
            sums.append(got)
        else:
            sums.append(regions.arena_into(arena, c.offset, c.out))
    return sums


class Read:
    """One ``get_into``: the blocks found so far, and what is left to read.

    The transport calls, in order: :meth:`known_copies` and
    :meth:`known_copied` when it keeps a location table; then, for the keys
    left in :attr:`todo`, :meth:`lookup_args`, :meth:`answered`,
    :meth:`leased_copies` (the placement runs here, on the caller's
    thread) and :meth:`leased_copied`; the leases go back with an answer
    when :meth:`release_now` says so (:meth:`released` applies it), else
    later without one; :meth:`learn`; and, when :attr:`refetch` is not
    empty, a read through the fallback of :meth:`refetch_keys` placed by
    :meth:`again`, handed to :meth:`refetched`.
    """

    def __init__(self, namespace: str, keys: list[bytes], place: Place | None, locations: Locations | None) -> None:
        self.namespace = namespace
        self.keys = keys
        self.place = place
        self.locations = locations
        self.blocks: list[Block | None] = [None] * len(keys)
        self.todo = list(range(len(keys)))  # indices still to look up
        self.refetch: list[int] = []  # indices to read again through the fallback
        self.lease_ids: list[int] = []
        self.learned: list[tuple[int, tuple]] = []  # (index, arena extent) seen, for the location table
        self._placed: dict[int, object] = {}  # index -> where its bytes go (the placement's answer, fitted)
        self._staged: dict[int, memoryview] = {}  # index -> host staging of a CUDA tensor read through the fallback
        self._stamps: dict[int, int] = {}  # index -> its key's removal stamp when it was read or looked up
        self._entries: list[tuple[int, list | None]] = []
        self._lease_deadline = 0
        self._received = 0.0

    def _out(self, i: int, info: BlockInfo, region: int | None):
        """Where block ``i``'s bytes go: the placement's buffer (None: declined, a miss); for a get (no
        placement), NEW: a buffer the copy makes as it copies, or a zeroed one to read a gpu region into."""
        if self.place is None:
            return NEW if region is None else memoryview(bytearray(info.size))
        view = self.place(i, info)
        if view is None:
            return None  # declined: a miss
        out = self._placed[i] = regions.placed_out(view, info.size)
        return out

    def _deliver(self, c: ReadCopy) -> None:
        self.blocks[c.index] = Block(self.keys[c.index], c.out.obj if self.place is None else c.out, c.layout,
                                     c.parent, c.tier)

    # ---- blocks whose arena extent this client remembers ---------------------------------

    def known_copies(self) -> list[ReadCopy]:
        """Copies for the remembered blocks (placed now); the others stay in :attr:`todo`."""
        locations = self.locations
        locations.check()
        todo: list[int] = []
        copies: list[ReadCopy] = []
        for i, key in enumerate(self.keys):
            found = locations.get(self.namespace, key)
            if found is None:
                todo.append(i)
                continue
            (offset, size, sum_, parent, layout), self._stamps[i] = found
            out = self._out(i, BlockInfo(key, size, layout, parent), None)
            if out is not None:
                copies.append(ReadCopy(i, None if out is NEW else out, offset, None, size, sum_, parent, layout,
                                       TierName.HOST))
        self.todo = todo
        return copies

    def known_copied(self, copies: Sequence[ReadCopy], sums: Sequence[int | None]) -> list[bytes]:
        """Keep the copies that verified; the keys read that way (the daemon hears of them by Touch)."""
        locations, namespace, hits = self.locations, self.namespace, []
        for c, got in zip(copies, sums):
            key = self.keys[c.index]
            if got != c.checksum:
                locations.forget(namespace, key)  # the extent went to another block
                self.todo.append(c.index)
            elif locations.stamp(namespace, key) != self._stamps[c.index]:
                self.todo.append(c.index)  # a Delete of the key answered while we copied: the copy does not count
            else:
                self._deliver(c)
                hits.append(key)
        self.todo.sort()
        return hits

    # ---- one Lookup --------------------------------------------------------------------------

    def lookup_args(self, lease_ms: int, timeout: int, releases: list[int]) -> list:
        """The Lookup of the keys in :attr:`todo`, carrying ``releases`` (leases of earlier reads)."""
        if self.locations is not None:
            self._stamps = {i: self.locations.stamp(self.namespace, self.keys[i]) for i in self.todo}
        return [self.namespace, [self.keys[i] for i in self.todo], lease_ms, timeout, releases]

    def answered(self, answer, received_ms: float) -> None:
        """Take the Lookup's answer; StrataError for one that does not answer what was asked."""
        try:
            lease_deadline, entries = answer
            n = len(entries)
        except (TypeError, ValueError):
            raise StrataError(f"the daemon sent a malformed Lookup answer: {answer!r:.120}") from None
        if n != len(self.todo):
            raise StrataError(f"the daemon answered {n} of {len(self.todo)} keys")
        self._lease_deadline, self._received = lease_deadline, received_ms
        self._entries = list(zip(self.todo, entries))
        self.lease_ids = [e[5] for e in entries if e is not None and e[5]]

    def leased_copies(self) -> list[ReadCopy]:
        """Copies for the blocks the Lookup leased (placed now, in key order). Found but not leased (not in
        the arena): read again. Declined by the placement: a miss, its lease still given back."""
        copies: list[ReadCopy] = []
        for i, entry in self._entries:
            if entry is None:
                continue
            size, sum_, parent, layout, offset, lease_id, tier, *region = entry
            if not lease_id:
                self.refetch.append(i)
                continue
            at = region[0] if region else None
            out = self._out(i, BlockInfo(self.keys[i], size, layout, parent), at)
            if out is not None:
                copies.append(ReadCopy(i, None if out is NEW else out, offset, at, size, sum_, parent, layout,
                                       TierName(tier)))
        return copies

    def leased_copied(self, copies: Sequence[ReadCopy], sums: Sequence[int | None]) -> None:
        """Keep the copies that verified; read the others again (torn under an expired lease, or corrupt)."""
        for c, got in zip(copies, sums):
            if got is not None and got != c.checksum:
                self.refetch.append(c.index)
                continue
            self._deliver(c)
            if c.region is None:  # the location table holds arena extents only
                self.learned.append((c.index, (c.offset, c.size, c.checksum, c.parent, c.layout)))

    def release_now(self) -> bool:
        """Whether the leases must be released now and the answer applied (:meth:`released`), rather than
        later without an answer: before a refetch (which may drop a corrupt block), or when the copies ran
        close to the lease's end (then only the daemon knows whether it held)."""
        if not self.lease_ids:
            return False
        held = arena_io.lease_held(self._lease_deadline, self._received)
        if not held:
            self.learned = []
        return bool(self.refetch) or not held

    def released(self, valid: Sequence[bool]) -> None:
        """Apply a Release answer: a block whose lease had expired may be torn, so read it again."""
        by_id = dict(zip(self.lease_ids, valid))
        for i, entry in self._entries:
            if entry is not None and entry[5] and not by_id.get(entry[5]) and self.blocks[i] is not None:
                self.blocks[i] = None
                self.refetch.append(i)

    def learn(self) -> None:
        if self.locations is not None:
            for i, where in self.learned:
                self.locations.learn(self._stamps[i], self.namespace, self.keys[i], where)

    # ---- reads again through the fallback -----------------------------------------------------

    def refetch_keys(self) -> list[bytes]:
        self.refetch.sort()
        return [self.keys[i] for i in self.refetch]

    def again(self) -> Place | None:
        """The fallback read's placement: each block into the buffer its arena read was placed in, if
        any; a CUDA tensor through host staging (the fallback reads on the host), copied up by
        :meth:`refetched` once verified."""
        if self.place is None:
            return None
        refetch, placed, place, staged = self.refetch, self._placed, self.place, self._staged

        def again(j: int, info: BlockInfo) -> memoryview | None:
            i = refetch[j]
            view = placed[i] if i in placed else place(i, info)
            if regions.on_device(view):
                placed[i] = regions.placed_out(view, info.size)
                staged[i] = memoryview(bytearray(info.size))
                return staged[i]
            return fit(info.key, info.size, view) if i in placed else view

        return again

    def staged_bytes(self) -> int:
        """Bytes :meth:`refetched` copies up into CUDA tensors."""
        return sum(len(v) for v in self._staged.values())

    def refetched(self, got: Sequence[Block | None]) -> None:
        for i, block in zip(self.refetch, got):
            if block is not None and i in self._staged:
                regions.copy_up(self._staged[i], self._placed[i])
                block = replace(block, data=self._placed[i][:len(self._staged[i])])
            self.blocks[i] = block


@dataclass(slots=True)
class Slot:
    """One granted slot: where block ``index``'s bytes go."""

    index: int
    slot_id: int
    offset: int
    region: int | None  # index into the Hello's regions; None: the arena


class Put:
    """One ``put``: inline blocks (their bytes in the Put frame), the rest written into slots.

    With ``in_place`` False (a gpu head this client was handed no regions
    of) there are no slots to write: blocks beyond the inline limit go
    through the fallback, staged on the host (:meth:`staged`).
    """

    def __init__(self, namespace: str, blocks: Sequence[BlockPut], inline_limit: int, in_place: bool = False) -> None:
        self.namespace = namespace
        self.blocks = blocks
        self.views = [regions.device_or_host(b.value) for b in blocks]  # CUDA tensors only where device_tensors
        self.results = [False] * len(blocks)
        total = sum(len(v) for v in self.views) if in_place else 0
        if total > 4 * INLINE_BATCH_BYTES:
            inline_limit = -1  # a large batch: every block in place
        elif total > INLINE_BATCH_BYTES:
            inline_limit = min(inline_limit, IN_PLACE_MIN_BYTES - 1)
        self.inline = [i for i, v in enumerate(self.views) if len(v) <= inline_limit]
        self.large = [i for i, v in enumerate(self.views) if len(v) > inline_limit]
        for i in self.inline:
            self.views[i] = regions.on_host(self.views[i])

    def stored(self, indices: Sequence[int], answer) -> None:
        """Apply a Put or Commit answer ([[stored, tier]] per block)."""
        for i, (stored, _tier) in zip(indices, answer):
            self.results[i] = stored

    # ---- inline ------------------------------------------------------------------------------

    def inline_parts(self, hello: Hello) -> Iterator[list[int]]:
        """The inline blocks, in Put frames the daemon accepts (bytes and blocks per frame)."""
        for group in arena_io.batches_by_bytes([len(self.views[i]) for i in self.inline], hello.max_inline):
            group = [self.inline[j] for j in group]
            for start in range(0, len(group), hello.max_batch):
                yield group[start : start + hello.max_batch]

    def put_frame(self, part: Sequence[int], timeout: int) -> tuple[list, list]:
        """A Put's arguments and payload; the daemon checks each block against the checksum sent."""
        headers = [[self.blocks[i].key, len(self.views[i]), checksum(self.views[i]), self.blocks[i].parent,
                    self.blocks[i].layout] for i in part]
        return [self.namespace, timeout, headers], [self.views[i] for i in part]

    # ---- elsewhere ---------------------------------------------------------------------------

    def staged(self) -> list[BlockPut]:
        """The large blocks on the host, for the fallback."""
        return [replace(self.blocks[i], value=regions.on_host(self.blocks[i].value)) for i in self.large]

    def stored_elsewhere(self, results: Sequence[bool]) -> None:
        for i, stored in zip(self.large, results):
            self.results[i] = stored

    # ---- into slots --------------------------------------------------------------------------

    def slot_batches(self, batch_bytes: int) -> Iterator[list[int]]:
        """The large blocks in Allocates of at most ``batch_bytes`` (see arena_io.batches_by_bytes)."""
        for batch in arena_io.batches_by_bytes([len(self.views[i]) for i in self.large], batch_bytes):
            yield [self.large[j] for j in batch]

    def allocate_args(self, indices: Sequence[int], lease_ms: int, timeout: int) -> list:
        headers = [[self.blocks[i].key, len(self.views[i]), self.blocks[i].parent, self.blocks[i].layout]
                   for i in indices]
        return [self.namespace, lease_ms, timeout, headers]

    @staticmethod
    def granted(indices: Sequence[int], answer) -> tuple[int, list[Slot]]:
        """The slots' lease deadline, and the slots to write (keys already present need none)."""
        lease_deadline, grants = answer
        return lease_deadline, [Slot(i, slot, offset, region[0] if region else None)
                                for i, (present, slot, offset, *region) in zip(indices, grants) if not present]

    def commit_groups(self, slots: list[Slot]) -> list[list[Slot]]:
        """The slots in Commit groups, each group's Commit in flight while the next is copied."""
        return [[slots[j] for j in group] for group in arena_io.commit_groups([len(self.views[s.index]) for s in slots])]

    def group_bytes(self, group: Sequence[Slot]) -> int:
        return sum(len(self.views[s.index]) for s in group)

    def copy_in(self, arena: ShmArena, mapped: regions.Regions, handles: list[MemoryHandle], group: Sequence[Slot],
                check: Callable[[], None] | None = None) -> list[int]:
        """Write each slot (into the arena, or a gpu region through its mapping, device to device from a CUDA
        tensor); their checksums, which the Commit carries. ``check`` runs before each block (a deadline's)."""
        sums = []
        for s in group:
            if check is not None:
                check()
            if s.region is not None:
                sums.append(mapped.region(handles, s.region).write(s.offset, self.views[s.index]))
            else:
                sums.append(arena_io.copy_in(arena, s.offset, regions.on_host(self.views[s.index])))
        return sums


def check_slot_lease(lease_deadline: int, received_ms: float) -> None:
    """Slots are written only while their lease holds with a margin: an expired slot may be another block's."""
    if not arena_io.lease_held(lease_deadline, received_ms):
        raise LeaseExpired("the arena slots' lease ran out before they were written: nothing was stored, put again")


def commit_args(group: Sequence[Slot], sums: list[int]) -> list:
    return [[s.slot_id for s in group], sums]
