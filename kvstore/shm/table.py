"""The table of committed blocks kept beside an arena, so a restarted daemon re-adopts them.

The arena is a file on a tmpfs: it outlives the daemon process. What dies
with the process is the map of which extents hold which blocks. This table
keeps that map in a second file next to the arena (``<arena>.table``, mode
0600), one record per committed block — namespace, key, offset, size,
checksum, parent, layout — and one per slot lent to a same-host writer
(offset, size, and until when the writer may still write it). A daemon
that starts on an arena left by a previous run reads the table, verifies
each block's bytes against its checksum and adopts the ones that pass.

Crash consistency, one record at a time (a SIGKILL can stop the daemon at
any instruction, but the kernel keeps every byte a finished ``pwrite``
wrote):

- a record is written whole by one ``pwrite``, its own checksum (xxh3,
  seeded with the table's random secret) in front; a record that a SIGKILL
  tore, or that was never finished, fails it and is discarded at load;
- a block's record is written before its put or commit is acknowledged, so
  a record lost that way was never promised to anyone;
- a record is cleared (its checksum zeroed: one 8-byte write) *before* its
  extent goes back to the allocator (:meth:`BlockTable.forget`): a restart
  can never find a record that points at bytes another block reuses. The
  checksum check at adoption would catch that too; the order makes it
  impossible, not unlikely;
- a slot's record becomes a block's record by writing the new record first
  and clearing the old one after; a crash between leaves both, and the load
  keeps the block's;
- nothing else is updated in place but the recency stamp, which lies outside
  the checksum: a stamp torn by a crash misorders one block, never loses it.

The secret matters because keys and layouts are bytes clients choose: a
client could write what looks like a record into a key, and a record that
was torn before its checksum landed would leave it at a unit boundary. The
load accepts only records whose checksum was made with the secret, which
lives in this 0600 file that clients are never given.

Why a separate file, not a region of the arena: clients map the arena read
and write; the table must not be theirs to scribble on, and the arena's
format as clients see it stays as it was. Why ``pwrite``, not a mapping:
the file is sparse, and a store through a mapping into a hole of a full
tmpfs is SIGBUS (the daemon dies) where ``pwrite`` is ENOSPC (that block
is not recorded, and the daemon says so).

Size: the records live in 256-byte units, one unit per arena page — as
many as the arena can hold blocks — and a record takes as many units as it
needs (one for keys of a few dozen bytes and a short layout). Units are
carved by the same best-fit allocator as the arena. The file is sparse, so
memory goes only to units in use. When the units run out (one-page blocks
with long keys and layouts), a block is still stored but would not survive
a crash: :attr:`BlockTable.unrecorded` counts them and the first is logged.

Not thread-safe: the tier calls it under its own lock.

Errors, beyond :mod:`kvstore.errors`::

    StrataError
    └── TableMismatch    the table file is not this arena's (format, arena id, size)
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import struct
from dataclasses import dataclass, field

import xxhash

from kvstore.block import BlockKey, BlockMeta
from kvstore.errors import StrataError
from kvstore.tiers.allocator import ExtentAllocator

log = logging.getLogger(__name__)

MAGIC = b"STRATATB"
TABLE_VERSION = 1
HEADER_BYTES = 4096
UNIT_BYTES = 256
_HEADER = struct.Struct("<8sII16sQQQ")  # magic, version, unit bytes, arena id, data size, units, secret
_HEAD = struct.Struct("<QQI")  # recency stamp (not checksummed), record checksum, body length
_STAMP = struct.Struct("<Q")
_LENGTH = struct.Struct("<I")
_BODY = struct.Struct("<BxHHHHxxQQQQq")  # kind, lengths (ns, key, parent, layout), seq, offset, size, checksum, until ms
_NO_PARENT = 0xFFFF
_ZERO = bytes(8)
BLOCK, SLOT = 1, 2


class TableMismatch(StrataError):
    """The table file does not belong to this arena, or has another format: start empty."""


@dataclass(frozen=True, slots=True)
class BlockRecord:
    offset: int
    key: BlockKey
    meta: BlockMeta
    stamp: int  # recency: larger is more recent


@dataclass(frozen=True, slots=True)
class SlotRecord:
    offset: int
    size: int
    until: float  # unix seconds: until then a writer of the previous run may still write the extent


@dataclass(slots=True)
class Loaded:
    blocks: list[BlockRecord] = field(default_factory=list)
    slots: list[SlotRecord] = field(default_factory=list)
    torn: int = 0  # records that failed their checksum: torn by a crash, or damaged


def table_units(data_size: int, page: int) -> int:
    return max(64, data_size // page)


class BlockTable:
    """See the module docstring. Build with :meth:`create` or :meth:`open`."""

    def __init__(self, path: str, fd: int, units: int, secret: int) -> None:
        self._path = path
        self._fd: int | None = fd
        self._secret = secret
        self._units = ExtentAllocator(units * UNIT_BYTES, page=UNIT_BYTES)
        # Cleared one-unit positions kept for the next one-unit record: most records are one
        # unit, and a list pop is a fraction of a best-fit allocation on the put path.
        self._spare: list[int] = []
        self._at: dict[int, int] = {}  # arena offset -> record position in the units
        self._seq = 0
        self.unrecorded = 0  # blocks stored without a record (no room, or the table failed)

    # ---- lifecycle -----------------------------------------------------------

    @classmethod
    def create(cls, path: str, arena_id: bytes, data_size: int, page: int) -> BlockTable:
        """A new, empty table for the arena ``arena_id`` (replacing any file at ``path``)."""
        remove(path)
        units = table_units(data_size, page)
        secret = int.from_bytes(secrets.token_bytes(8), "little")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, HEADER_BYTES + units * UNIT_BYTES)
            os.pwrite(fd, _HEADER.pack(MAGIC, TABLE_VERSION, UNIT_BYTES, arena_id, data_size, units, secret), 0)
        except BaseException:
            os.close(fd)
            remove(path)
            raise
        return cls(path, fd, units, secret)

    @classmethod
    def open(cls, path: str, arena_id: bytes, data_size: int, page: int) -> tuple[BlockTable, Loaded]:
        """The table a previous run left, and its valid records.

        Raises FileNotFoundError when there is none, TableMismatch when it is
        not this arena's or has another format. Torn records are counted
        and cleared; of two records of one extent the block's wins.
        """
        fd = os.open(path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid():
                raise TableMismatch(f"{path} belongs to uid {st.st_uid}, not this daemon's {os.geteuid()}")
            head = os.pread(fd, _HEADER.size, 0)
            if len(head) < _HEADER.size:
                raise TableMismatch(f"{path} is too short to be a block table")
            magic, version, unit, file_arena, file_size, units, secret = _HEADER.unpack(head)
            if magic != MAGIC or version != TABLE_VERSION or unit != UNIT_BYTES:
                raise TableMismatch(
                    f"{path} has table format {version} (magic {magic!r}); this daemon reads format {TABLE_VERSION}"
                )
            if file_arena != arena_id or file_size != data_size or units != table_units(data_size, page):
                raise TableMismatch(f"{path} was written for another arena (arena id or size differ)")
            if st.st_size != HEADER_BYTES + units * UNIT_BYTES:
                raise TableMismatch(f"{path} is {st.st_size} bytes; its header says {HEADER_BYTES + units * UNIT_BYTES}")
            table = cls(path, fd, units, secret)
            loaded = table._load()
        except BaseException:
            os.close(fd)
            raise
        return table, loaded

    @property
    def path(self) -> str:
        return self._path

    @property
    def broken(self) -> bool:
        return self._fd is None

    def close(self, unlink: bool = False) -> None:
        """Close the file; ``unlink`` also removes it. Safe to call twice."""
        if unlink:
            remove(self._path)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # ---- records -------------------------------------------------------------

    def record_block(self, offset: int, key: BlockKey, meta: BlockMeta) -> bool:
        """Record a committed block at ``offset``; False when it could not be (no room, a failed write)."""
        ns, layout, parent = key.namespace.encode(), meta.layout.encode(), meta.parent
        lengths = (len(ns), len(key.key), _NO_PARENT if parent is None else len(parent), len(layout))
        tail = ns + key.key + (parent or b"") + layout
        if self._write(BLOCK, lengths, offset, meta.size, meta.checksum, 0, tail):
            return True
        self.unrecorded += 1
        if self.unrecorded == 1:
            log.warning(
                "the RAM tier's block table could not record block %s (no room left, or the table failed): it is "
                "stored but would not survive a daemon crash (further ones are counted in "
                "strata_ram_unrecorded_blocks_total)", key,
            )
        return False

    def record_slot(self, offset: int, size: int, until: float) -> bool:
        """Record that a writer outside the daemon may write ``size`` bytes at ``offset`` until ``until`` (unix s)."""
        return self._write(SLOT, (0, 0, _NO_PARENT, 0), offset, size, 0, int(until * 1000) + 1, b"")

    def forget(self, offset: int) -> None:
        """Clear the record of the extent at ``offset``, if any. Call it before the extent is reused."""
        pos = self._at.pop(offset, None)
        if pos is None or self._fd is None:
            return
        try:
            os.pwrite(self._fd, _ZERO, HEADER_BYTES + pos + 8)
        except OSError as err:
            self._fail(err)
            return
        self._give(pos)

    def stamp(self, offset: int) -> None:
        """Mark the block at ``offset`` most recently used (a hint for the order after a restart)."""
        pos = self._at.get(offset)
        if pos is None or self._fd is None:
            return
        self._seq += 1
        try:
            os.pwrite(self._fd, _STAMP.pack(self._seq), HEADER_BYTES + pos)
        except OSError as err:
            self._fail(err)

    def recorded(self, offset: int) -> bool:
        return offset in self._at

    # ---- internals -------------------------------------------------------------

    def _write(self, kind: int, lengths: tuple, offset: int, size: int, sum_: int, until_ms: int, tail: bytes) -> bool:
        """Write one record whole, then point ``offset`` at it (clearing the record it replaces)."""
        if self._fd is None:
            return False
        self._seq += 1
        body = _BODY.pack(kind, *lengths, self._seq, offset, size, sum_, until_ms) + tail
        pos = self._take(_HEAD.size + len(body))
        if pos is None:
            return False
        record = _HEAD.pack(self._seq, self._sum(_LENGTH.pack(len(body)) + body), len(body)) + body
        try:
            os.pwrite(self._fd, record, HEADER_BYTES + pos)
        except OSError as err:
            self._give(pos)
            log.warning("could not write to the RAM tier's block table %s: %s", self._path, err)
            return False
        old = self._at.get(offset)
        self._at[offset] = pos
        if old is not None:  # a slot's record, now the block's: the new one is whole, so clear the old
            try:
                os.pwrite(self._fd, _ZERO, HEADER_BYTES + old + 8)
            except OSError as err:
                self._fail(err)
                return False
            self._give(old)
        return True

    def _take(self, nbytes: int) -> int | None:
        if nbytes <= UNIT_BYTES and self._spare:
            return self._spare.pop()
        pos = self._units.allocate(nbytes)
        if pos is None and self._spare:  # the spares may be what a longer record needs: coalesce them
            for spare in self._spare:
                self._units.free(spare)
            self._spare.clear()
            pos = self._units.allocate(nbytes)
        return pos

    def _give(self, pos: int) -> None:
        if self._units.size_of(pos) == UNIT_BYTES:
            self._spare.append(pos)
        else:
            self._units.free(pos)

    def _sum(self, data: bytes) -> int:
        return xxhash.xxh3_64_intdigest(data, seed=self._secret) or 1  # 0 means "no record"

    def _fail(self, err: OSError) -> None:
        """A write to the table failed: remove it, so no restart trusts records that may be stale."""
        log.error(
            "the RAM tier's block table %s failed (%s): removed it; RAM blocks will not survive a crash "
            "until the daemon restarts", self._path, err,
        )
        self.close(unlink=True)
        self._at.clear()

    def _load(self) -> Loaded:
        loaded = Loaded()
        units = self._units.capacity_bytes // UNIT_BYTES
        best: dict[int, tuple] = {}  # arena offset -> (rank, pos, total, record): a block's beats a slot's, then the later
        dropped: list[int] = []  # positions to clear: torn records, and records another of their extent supersedes
        with mmap.mmap(self._fd, HEADER_BYTES + units * UNIT_BYTES, prot=mmap.PROT_READ) as mapping:
            records = memoryview(mapping)[HEADER_BYTES:]
            sums = records.cast("Q")[1 :: UNIT_BYTES // 8]
            try:
                skip = 0
                for unit, value in enumerate(sums):
                    if not value or unit < skip:
                        continue
                    pos = unit * UNIT_BYTES
                    parsed = self._parse(records, pos)
                    if parsed is None:
                        loaded.torn += 1
                        dropped.append(pos)
                        continue
                    kind, seq, record, total = parsed
                    skip = unit + -(-total // UNIT_BYTES)
                    self._seq = max(self._seq, seq, getattr(record, "stamp", 0))
                    rank = (kind == BLOCK, seq)
                    other = best.get(record.offset)
                    if other is not None and other[0] > rank:
                        dropped.append(pos)
                        continue
                    if other is not None:
                        dropped.append(other[1])
                    best[record.offset] = (rank, pos, total, record)
            finally:
                sums.release()
                records.release()
        for pos in dropped:
            os.pwrite(self._fd, _ZERO, HEADER_BYTES + pos + 8)
        kept = list(best.values())
        for (_, pos, _, record), ok in zip(kept, self._units.claim_all([(pos, total) for _, pos, total, _ in kept])):
            if not ok:  # cannot happen: a forward scan skips the units of every record it accepted
                os.pwrite(self._fd, _ZERO, HEADER_BYTES + pos + 8)
                continue
            self._at[record.offset] = pos
            (loaded.blocks if isinstance(record, BlockRecord) else loaded.slots).append(record)
        return loaded

    def _parse(self, records: memoryview, pos: int):
        """(kind, seq, record, total bytes) of a valid record at ``pos``, or None."""
        end = len(records)
        if pos + _HEAD.size + _BODY.size > end:
            return None
        stamp, stored, length = _HEAD.unpack_from(records, pos)
        total = _HEAD.size + length
        if length < _BODY.size or pos + total > end:
            return None
        body = bytes(records[pos + _HEAD.size : pos + total])
        if self._sum(_LENGTH.pack(length) + body) != stored:
            return None
        kind, ns_len, key_len, parent_len, layout_len, seq, offset, size, sum_, until_ms = _BODY.unpack_from(body)
        at = _BODY.size
        if kind == SLOT:
            return kind, seq, SlotRecord(offset, size, until_ms / 1000), total
        if kind != BLOCK:
            return None
        plen = 0 if parent_len == _NO_PARENT else parent_len
        if at + ns_len + key_len + plen + layout_len != length:
            return None
        try:
            ns = body[at : at + ns_len].decode()
            at += ns_len
            key = body[at : at + key_len]
            at += key_len
            parent = None if parent_len == _NO_PARENT else body[at : at + plen]
            at += plen
            layout = body[at : at + layout_len].decode()
        except UnicodeDecodeError:
            return None
        return kind, seq, BlockRecord(offset, BlockKey(ns, key), BlockMeta(size, sum_, parent, layout), stamp), total


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
