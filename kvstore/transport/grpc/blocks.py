"""KVService's block messages: the Put/Get streams and the arena RPCs (Attach,
Allocate, Commit, Lookup, Release), built from and parsed into the transport's
value types.

The gRPC transports and the asyncio client loop over these functions, so
the streamed and arena paths cannot drift between them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvstore.api.v1 import kv_pb2 as pb
from kvstore.block import BlockMeta, TierName, checksum, copy_and_checksum, validate_key, validate_namespace
from kvstore.errors import ArenaReplaced, ArenaUnusable, CorruptBlock, LeaseExpired, StaleAttachment
from kvstore.shm.arena import ArenaMismatch, ShmArena
from kvstore.transport import arena_io
from kvstore.transport.arena_io import commit_groups, lease_held, now_ms  # noqa: F401 - grpc_arena uses it from here
from kvstore.transport.base import Block, BlockInfo, BlockPut, Place, fit

DEFAULT_CHUNK = 1 << 20
MAX_MESSAGE_BYTES = DEFAULT_CHUNK + (64 << 10)

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


def info_of(header: pb.BlockHeader) -> BlockInfo:
    return BlockInfo(header.key, header.size, header.layout, header.parent_key or None)



def stream_put_results(items: list[tuple[BlockPut, memoryview, BlockMeta]], response: pb.PutResponse) -> list[bool]:
    """Per item of a streamed Put, whether it was newly stored."""
    stored = {r.key: r.stored for r in response.results}
    return [stored.get(item.key, False) for item, _, _ in items]



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
        view = self._place(i, info_of(header))
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



# ---- the arena under gRPC control ---------------------------------------------


def open_arena(attach: pb.AttachResponse) -> ShmArena:
    """Map the daemon's arena, or raise ArenaUnusable when this client cannot (another host),
    or may not (the daemon sent no path: it does not let this caller map that arena)."""
    if not attach.arena_path:
        raise ArenaUnusable(
            f"the daemon does not let this client map arena {attach.arena_name or 'default'!r}: "
            "its namespaces' bytes are streamed over gRPC"
        )
    try:
        return ShmArena.attach(attach.arena_path, attach.arena_token)
    except (OSError, ArenaMismatch) as err:
        raise ArenaUnusable(f"cannot map the daemon's arena {attach.arena_path}: {err}") from None


def replaced(err: ArenaReplaced) -> StaleAttachment:
    """What a gRPC-arena client raises when the daemon refused the token of the file it mapped:
    the client's retry loop attaches again (maps the new arena) and tries the call once more."""
    return StaleAttachment(str(err))


def arena_batch_bytes(arena: ShmArena) -> int:
    """The most arena bytes one Allocate asks for (see :func:`batches_by_bytes`)."""
    return arena.size // 4


def batches_by_bytes(items: list, limit: int) -> Iterator[list]:
    """Checked puts split so that no Allocate asks for more than ``limit`` bytes (see arena_io)."""
    for group in arena_io.batches_by_bytes([len(item[1]) for item in items], limit):
        yield [items[i] for i in group]


def allocate_request(namespace: str, items: list[tuple[BlockPut, memoryview, BlockMeta]], lease_ms: int,
                     arena: str = "", arena_token: bytes = b"") -> pb.AllocateRequest:
    """``arena``: the one the caller mapped (Attach's ``arena_name``); the daemon refuses other arenas' namespaces.
    ``arena_token``: the mapped file's; the daemon refuses another file's (ArenaReplaced)."""
    return pb.AllocateRequest(
        arena=arena,
        arena_token=arena_token,
        namespace=namespace,
        blocks=[
            pb.BlockHeader(key=item.key, size=len(view), parent_key=item.parent or b"", layout=item.layout)
            for item, view, _ in items
        ],
        lease_ms=lease_ms,
    )


def slot_groups(items, response: pb.AllocateResponse) -> list[list[tuple[memoryview, pb.Slot]]]:
    """The slots to write (keys already present need none), in commit groups (:func:`arena_io.commit_groups`)."""
    todo = [(view, slot) for (_, view, _), slot in zip(items, response.slots) if not slot.present]
    return [[todo[k] for k in group] for group in commit_groups([slot.size for _, slot in todo])]


def copy_into_slots(
    arena: ShmArena, response: pb.AllocateResponse, received_ms: float, group: list[tuple[memoryview, pb.Slot]]
) -> pb.CommitRequest:
    """Copy values into their slots and build their Commit.

    The Commit carries each value's xxh3, computed while copying: the daemon
    verifies the slot against it, so a slot half written (or written by
    someone else) is never stored. Slots are written only while their lease
    holds with a margin: an expired slot may already belong to another block.
    """
    if not lease_held(response.lease_deadline_unix_ms, received_ms):
        raise LeaseExpired("the arena slots' lease ran out before they were written: nothing was stored, put again")
    items = []
    for view, slot in group:
        dst = arena.view(slot.offset, slot.size)
        try:
            items.append(pb.CommitRequest.Item(slot_id=slot.slot_id, checksum=copy_and_checksum(dst, view)))
        finally:
            dst.release()
    return pb.CommitRequest(items=items)


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


def place_lookup(response: pb.LookupResponse, place: Place) -> list[memoryview | None]:
    """Where each block a Lookup leased goes (None for the others, and for those declined)."""
    return [
        place(i, info_of(loc.block)) if loc.found and loc.lease_id else None
        for i, loc in enumerate(response.blocks)
    ]


def lookup_lease_ids(response: pb.LookupResponse) -> list[int]:
    return [loc.lease_id for loc in response.blocks if loc.found and loc.lease_id]


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
