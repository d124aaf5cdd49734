"""What the sync and asyncio clients share: value types, request building,
response parsing, the shared-memory copies and the retry policy.

Both clients are thin loops over these functions, so the two cannot drift.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc

from kvstore.api.v1 import kv_pb2 as pb
from kvstore.block import BlockMeta, TierName, checksum, copy_and_checksum, validate_key, validate_namespace
from kvstore.errors import ArenaUnusable, CorruptBlock, InvalidArgument, LeaseExpired, DaemonUnavailable, ResourceExhausted, StrataError
from kvstore.rpc.status import from_rpc_error
from kvstore.shm.arena import ArenaMismatch, ShmArena

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_CHUNK = 1 << 20
MAX_MESSAGE_BYTES = DEFAULT_CHUNK + (64 << 10)

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]

# Methods safe to repeat after UNAVAILABLE: they change nothing, or a repeat
# is a no-op (puts are idempotent), or what a lost reply held (a lease, a
# slot) expires by itself. Commit and Pin are not: a repeat of a call that
# succeeded fails or takes a second lease.
RETRY_ON_UNAVAILABLE = frozenset(
    {"Put", "Get", "Exists", "Delete", "Stats", "Attach", "Allocate", "Lookup", "Release", "Abort", "Unpin",
     "Score", "Holders", "List"}
)


@dataclass(frozen=True, slots=True)
class BlockPut:
    key: bytes
    value: bytes | bytearray | memoryview
    parent: bytes | None = None
    layout: str = ""


@dataclass(frozen=True, slots=True)
class Block:
    key: bytes
    data: bytes | bytearray | memoryview  # a view of the caller's buffer after get_into
    layout: str
    parent: bytes | None
    tier: TierName


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What the daemon says of a found block before its bytes are read: enough to
    choose where they go (see ``get_into`` with a placement function)."""

    key: bytes
    size: int
    layout: str
    parent: bytes | None

    @classmethod
    def of(cls, header: pb.BlockHeader) -> BlockInfo:
        return cls(header.key, header.size, header.layout, header.parent_key or None)


# get_into's placement: for the i-th key's found block, the writable buffer to
# read it into (at least info.size bytes), or None to skip it (a miss).
Placement = Callable[[int, BlockInfo], object | None]
# The same after the client has checked the buffer: a view of it, fitted.
Place = Callable[[int, BlockInfo], memoryview | None]


@dataclass(frozen=True, slots=True)
class Listed:
    """One block of a listing."""

    key: bytes
    size: int
    layout: str
    parent: bytes | None
    tier: TierName


@dataclass(frozen=True, slots=True)
class ListPage:
    blocks: list[Listed]
    next_page_token: bytes  # empty after the last page


@dataclass(frozen=True, slots=True)
class PinLease:
    lease_id: int
    pinned: int
    missing: list[bytes]
    deadline_unix_ms: int


@dataclass(frozen=True, slots=True)
class Stats:
    tiers: dict[str, dict[str, int]]
    blocks: int
    pinned_blocks: int
    active_leases: int
    open_slots: int
    demotion_queue_depth: int
    namespaces: list[str]
    node_id: str
    epoch: int


def stream_put_results(items: list[tuple[BlockPut, memoryview, BlockMeta]], response: pb.PutResponse) -> list[bool]:
    """Per item of a streamed Put, whether it was newly stored."""
    stored = {r.key: r.stored for r in response.results}
    return [stored.get(item.key, False) for item, _, _ in items]


def parse_exists(r: pb.ExistsResponse) -> list[TierName]:
    return [TierName(t) for t in r.tiers]


def parse_pin(r: pb.PinResponse) -> PinLease:
    return PinLease(r.lease_id, r.pinned, list(r.missing), r.lease_deadline_unix_ms)


@dataclass(frozen=True, slots=True)
class EndpointScore:
    node_id: str
    blocks: int
    tier: TierName | None
    score: float


@dataclass(frozen=True, slots=True)
class Holder:
    node_id: str
    tier: TierName
    epoch: int


def chain_request(cls, namespace: str, keys, tokens, block_size: int, hash_seed: str, lora_name: str, cache_salt: str):
    """A Score or Holders request for a chain given as block keys or as token ids."""
    if (keys is None) == (tokens is None):
        raise InvalidArgument("give the chain either as keys or as tokens")
    request = cls(namespace=namespace)
    if keys is not None:
        request.keys.keys.extend(keys)
    else:
        request.tokens.token_ids.extend(tokens)
        request.tokens.block_size = block_size
        request.tokens.hash_seed = hash_seed
        request.tokens.lora_name = lora_name
        request.tokens.cache_salt = cache_salt
    return request


def parse_scores(r) -> list[EndpointScore]:
    return [EndpointScore(e.node_id, e.blocks, tier_name(e.tier), e.score) for e in r.endpoints]


def parse_holders(r) -> list[list[Holder]]:
    return [[Holder(h.node_id, TierName(h.tier), h.epoch) for h in b.holders] for b in r.blocks]


def tier_name(value: int) -> TierName | None:
    return TierName(value) if value else None


def check_puts(namespace: str, items: Sequence[BlockPut]) -> list[tuple[BlockPut, memoryview, BlockMeta]]:
    validate_namespace(namespace)
    out = []
    for item in items:
        validate_key(item.key)
        view = memoryview(item.value).cast("B")
        out.append((item, view, BlockMeta(len(view), 0, item.parent, item.layout)))
    return out


def check_gets(namespace: str, keys: Sequence[bytes]) -> list[bytes]:
    validate_namespace(namespace)
    return [validate_key(k) for k in keys]


def put_requests(namespace: str, items: list[tuple[BlockPut, memoryview, BlockMeta]], chunk: int) -> Iterator[pb.PutRequest]:
    first = True
    for item, view, _ in items:
        header = pb.BlockHeader(
            key=item.key, size=len(view), checksum=checksum(view), parent_key=item.parent or b"", layout=item.layout
        )
        yield pb.PutRequest(namespace=namespace if first else "", header=header)
        first = False
        for off in range(0, len(view), chunk):
            yield pb.PutRequest(chunk=bytes(view[off : off + chunk]))


class GetAssembler:
    """Rebuilds blocks from a Get stream and verifies each one's checksum.

    With ``place`` each found block is read straight into the buffer it
    returns (``indices`` maps the stream's blocks to the caller's key
    indices); a block it declines (None) is read and dropped, a miss.
    """

    def __init__(self, place: Place | None = None,
                 indices: Sequence[int] | None = None) -> None:
        self.blocks: list[Block | None] = []
        self._place = place
        self._indices = indices
        self._header: pb.GetHeader | None = None
        self._buf: bytearray | memoryview | None = None
        self._filled = 0

    def feed(self, msg: pb.GetResponse) -> None:
        if msg.WhichOneof("part") == "header":
            self._close_current()
            if msg.header.found:
                self._header = msg.header
                self._buf = self._target(msg.header.block)
                self._filled = 0
                if msg.header.block.size == 0:
                    self._close_current()
            else:
                self.blocks.append(None)
        else:
            assert self._header is not None, "chunk before header"
            end = self._filled + len(msg.chunk)
            if end > self._header.block.size:
                raise CorruptBlock("the daemon sent more bytes than the block's header declared: retry the read")
            if self._buf is not None:
                self._buf[self._filled : end] = msg.chunk
            self._filled = end
            if end == self._header.block.size:
                self._close_current()

    def _target(self, header: pb.BlockHeader) -> bytearray | memoryview | None:
        if self._place is None:
            return bytearray(header.size)
        i = len(self.blocks) if self._indices is None else self._indices[len(self.blocks)]
        view = self._place(i, BlockInfo.of(header))
        return None if view is None else view[: header.size]

    def _close_current(self) -> None:
        if self._header is None:
            return
        header, buf = self._header, self._buf
        self._header = self._buf = None
        b = header.block
        if buf is None:  # declined by the placement
            self.blocks.append(None)
            return
        if self._filled != b.size or checksum(buf) != b.checksum:
            raise CorruptBlock(
                f"block {b.key.hex()[:16]} arrived with a bad checksum or length; it was discarded: retry the read"
            )
        self.blocks.append(Block(b.key, buf, b.layout, b.parent_key or None, TierName(header.tier)))

    def finish(self) -> list[Block | None]:
        self._close_current()
        return self.blocks


def list_request(namespace: str, prefix: bytes, page_size: int, page_token: bytes) -> pb.ListRequest:
    validate_namespace(namespace)
    return pb.ListRequest(namespace=namespace, prefix=prefix, page_size=page_size, page_token=page_token)


def parse_list(r: pb.ListResponse) -> ListPage:
    return ListPage(
        [Listed(x.block.key, x.block.size, x.block.layout, x.block.parent_key or None, TierName(x.tier)) for x in r.blocks],
        r.next_page_token,
    )


def parse_stats(r: pb.StatsResponse) -> Stats:
    return Stats(
        tiers={
            TierName(t.tier).label: {"used_bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes, "blocks": t.blocks}
            for t in r.tiers
        },
        blocks=r.blocks,
        pinned_blocks=r.pinned_blocks,
        active_leases=r.active_leases,
        open_slots=r.open_slots,
        demotion_queue_depth=r.demotion_queue_depth,
        namespaces=list(r.namespaces),
        node_id=r.node_id,
        epoch=r.epoch,
    )


# ---- shared memory ----------------------------------------------------------


def open_arena(attach: pb.AttachResponse) -> ShmArena:
    """Map the daemon's arena, or raise ArenaUnusable when this client cannot (another host)."""
    try:
        return ShmArena.attach(attach.arena_path, attach.arena_token)
    except (OSError, ArenaMismatch) as err:
        raise ArenaUnusable(f"cannot map the daemon's arena {attach.arena_path}: {err}") from None


def arena_batch_bytes(arena: ShmArena) -> int:
    """The most arena bytes one Allocate asks for (see :func:`batches_by_bytes`)."""
    return arena.size // 4


def batches_by_bytes(items: list, limit: int) -> Iterator[list]:
    """Split a batch so that no Allocate asks for more than ``limit`` bytes of arena.

    Slots are held until committed, so one batch larger than the arena could
    never be placed; a quarter of it leaves room for other writers.
    """
    group: list = []
    size = 0
    for item in items:
        n = len(item[1])
        if group and size + n > limit:
            yield group
            group, size = [], 0
        group.append(item)
        size += n
    if group:
        yield group


def allocate_request(namespace: str, items: list[tuple[BlockPut, memoryview, BlockMeta]], lease_ms: int) -> pb.AllocateRequest:
    return pb.AllocateRequest(
        namespace=namespace,
        blocks=[
            pb.BlockHeader(key=item.key, size=len(view), parent_key=item.parent or b"", layout=item.layout)
            for item, view, _ in items
        ],
        lease_ms=lease_ms,
    )


# Slots are committed in a few groups, each group's Commit in flight while the
# next group is copied: the daemon checksums one group on its own core while
# the client copies the next. Each Commit costs a round trip of client CPU, so
# groups are at least this big and at most MAX_COMMIT_GROUPS per batch.
MIN_COMMIT_GROUP_BYTES = 8 << 20
MAX_COMMIT_GROUPS = 3


def slot_groups(items, response: pb.AllocateResponse) -> list[list[tuple[memoryview, pb.Slot]]]:
    """The slots to write (keys already present need none), in commit groups."""
    total = sum(slot.size for slot in response.slots if not slot.present)
    group_bytes = max(MIN_COMMIT_GROUP_BYTES, -(-total // MAX_COMMIT_GROUPS))
    groups: list[list[tuple[memoryview, pb.Slot]]] = []
    group: list[tuple[memoryview, pb.Slot]] = []
    size = 0
    for (_, view, _), slot in zip(items, response.slots):
        if slot.present:
            continue
        group.append((view, slot))
        size += slot.size
        if size >= group_bytes:
            groups.append(group)
            group, size = [], 0
    if group:
        groups.append(group)
    return groups


def copy_into_slots(
    arena: ShmArena, response: pb.AllocateResponse, received_ms: float, group: list[tuple[memoryview, pb.Slot]]
) -> pb.CommitRequest:
    """Copy values into their slots and build their Commit.

    No checksum is sent: the bytes do not travel, so the daemon checksums
    them in place at commit. Slots are written only while their lease holds
    with a margin: an expired slot may already belong to another block.
    """
    if not lease_held(response.lease_deadline_unix_ms, received_ms):
        raise LeaseExpired("the arena slots' lease ran out before they were written: nothing was stored, put again")
    for view, slot in group:
        dst = arena.view(slot.offset, slot.size)
        try:
            dst[:] = view
        finally:
            dst.release()
    return pb.CommitRequest(items=[pb.CommitRequest.Item(slot_id=slot.slot_id) for _, slot in group])


def slot_ids(response: pb.AllocateResponse) -> list[int]:
    return [s.slot_id for s in response.slots if not s.present]


def put_results(response: pb.AllocateResponse, commits: Sequence[pb.CommitResponse]) -> list[bool]:
    stored = {r.key: r.stored for commit in commits for r in commit.results}
    return [False if s.present else stored.get(s.key, False) for s in response.slots]


def read_located(arena: ShmArena, located: pb.Located, into: memoryview | None = None) -> memoryview | bytearray | None:
    """Copy a leased block out of the arena (into ``into`` when given); None when its bytes fail the checksum."""
    b = located.block
    out = memoryview(bytearray(b.size)) if into is None else into[: b.size]
    src = arena.view(located.offset, b.size)
    try:
        sum_ = copy_and_checksum(out, src)
    finally:
        src.release()
    if sum_ != b.checksum:
        return None
    return out.obj if into is None else out


def writable(key: bytes, buffer) -> memoryview:
    view = memoryview(buffer).cast("B")
    if view.readonly:
        raise InvalidArgument(f"the buffer for key {key.hex()[:16]} is read-only: pass a bytearray, array or tensor")
    return view


def fit(key: bytes, size: int, view: memoryview) -> memoryview:
    if size > len(view):
        raise InvalidArgument(
            f"the buffer for key {key.hex()[:16]} holds {len(view)} bytes; the block has {size}: pass a larger buffer"
        )
    return view


def placement(keys: Sequence[bytes], buffers: Sequence | Placement) -> Place:
    """``get_into``'s buffers as one function: index and block info to a writable view, or None to skip."""
    if callable(buffers):
        def place(i: int, info: BlockInfo) -> memoryview | None:
            buffer = buffers(i, info)
            return None if buffer is None else fit(info.key, info.size, writable(info.key, buffer))

        return place
    if len(buffers) != len(keys):
        raise InvalidArgument(f"{len(keys)} keys but {len(buffers)} buffers: pass one buffer per key")
    views = [writable(key, buf) for key, buf in zip(keys, buffers)]
    return lambda i, info: fit(info.key, info.size, views[i])


def place_lookup(response: pb.LookupResponse, place: Place) -> list[memoryview | None]:
    """Where each block a Lookup leased goes (None for the others, and for those declined)."""
    return [
        place(i, BlockInfo.of(loc.block)) if loc.found and loc.lease_id else None
        for i, loc in enumerate(response.blocks)
    ]


def lookup_lease_ids(response: pb.LookupResponse) -> list[int]:
    return [loc.lease_id for loc in response.blocks if loc.found and loc.lease_id]


# A lease is relied on only until this margin before its deadline (client and
# daemon share a host, so they share a clock): a read in place that finished
# earlier is trusted without asking the daemon; later, the client asks
# (Release) whether the lease held and reads again if it did not. Slots are
# written only inside the margin too. Short leases get a quarter of their span.
LEASE_MARGIN_MS = 1000


def now_ms() -> float:
    return time.time() * 1000


def lease_held(deadline_ms: int, received_ms: float) -> bool:
    margin = min(LEASE_MARGIN_MS, (deadline_ms - received_ms) / 4)
    return now_ms() < deadline_ms - margin


@dataclass(slots=True)
class ArenaRead:
    """One Lookup's blocks as copied out of the arena.

    ``leased`` pairs the index of each block read in place with its read
    lease, which the client must Release; ``refetch`` lists the indices to
    stream instead: blocks the daemon could not place in the arena, and
    blocks whose bytes failed the checksum or whose lease expired while they
    were copied (torn).
    """

    blocks: list[Block | None]
    leased: list[tuple[int, int]]
    refetch: list[int]

    def lease_ids(self) -> list[int]:
        return [lease_id for _, lease_id in self.leased]


def leased_bytes(response: pb.LookupResponse) -> int:
    """Bytes :func:`read_lookup` will copy out of the arena."""
    return sum(loc.block.size for loc in response.blocks if loc.found and loc.lease_id)


def refetch_placement(
    place: Place | None, placed: list[memoryview | None] | None
) -> Place | None:
    """Where streamed refetches go: into the buffer their arena read was placed in, if any."""
    if place is None:
        return None

    def again(i: int, info: BlockInfo) -> memoryview | None:
        view = placed[i] if placed is not None else None
        return place(i, info) if view is None else fit(info.key, info.size, view)

    return again


def read_lookup(arena: ShmArena, response: pb.LookupResponse, into: list[memoryview | None] | None = None) -> ArenaRead:
    """Copy every leased block of a Lookup out of the arena; None for misses and refetches.

    ``into`` (from :func:`place_lookup`) gives the caller's buffer per block;
    a leased block without one was declined: a miss, its lease still released.
    """
    read = ArenaRead([], [], [])
    for i, loc in enumerate(response.blocks):
        if not loc.found:
            read.blocks.append(None)
            continue
        if not loc.lease_id:  # could not be placed in the arena
            read.blocks.append(None)
            read.refetch.append(i)
            continue
        read.leased.append((i, loc.lease_id))
        if into is not None and into[i] is None:
            read.blocks.append(None)
            continue
        data = read_located(arena, loc, None if into is None else into[i])
        if data is None:
            read.blocks.append(None)
            read.refetch.append(i)
        else:
            b = loc.block
            read.blocks.append(Block(b.key, data, b.layout, b.parent_key or None, TierName(loc.tier)))
    return read


def drop_expired(read: ArenaRead, valid: Sequence[bool]) -> None:
    """Apply a Release answer: a block whose lease had expired may be torn, so refetch it."""
    for (i, _), ok in zip(read.leased, valid):
        if not ok and i not in read.refetch:
            read.refetch.append(i)
            read.blocks[i] = None


# ---- errors and retries -----------------------------------------------------


def translate(err: grpc.RpcError) -> StrataError:
    return from_rpc_error(err)


def retry_delay(err: StrataError, method: str, attempt: int, retries: int) -> float | None:
    """Seconds to wait before another attempt, or None to give up."""
    if attempt >= retries:
        return None
    if isinstance(err, ResourceExhausted):
        return err.retry_after_s
    if isinstance(err, DaemonUnavailable) and method in RETRY_ON_UNAVAILABLE:
        return min(0.05 * 2**attempt, 1.0)
    return None
