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
- a record is cleared (zeroed from its checksum on, through its last
  unit's checksum word, in one write: one cut short has zeroed the checksum
  first) *before* its extent goes back to the allocator
  (:meth:`BlockTable.forget`): a restart can never find a record that
  points at bytes another block reuses. The checksum check at adoption
  would catch that too; the order makes it impossible, not unlikely;
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
is refused, and the daemon says so).

Size: the records live in 256-byte units, and a record takes as many
units as it needs (one for keys of a few dozen bytes and a short layout;
:data:`MAX_RECORD_UNITS` for the longest namespace, key, parent and layout
the daemon accepts). Units are carved by the same best-fit allocator as the
arena. A table starts with one unit per arena page, the size every earlier
version kept, and *grows* (doubling, by ``ftruncate``) when a record finds
no room, up to :func:`max_table_units`: room for the longest record of
every page of the arena, twice over, and a little more. Why that bound:
each record belongs to one arena extent, so at most one per page is live
(a slot's and its block's record of one extent overlap for a moment); and
when no free extent of the units fits a record, each of them is shorter than
it and sits between two live records, so the free units are fewer than the
live ones plus a record's length. A table of that size therefore always
has room: whatever one tenant's keys and layouts, every block the arena
can hold can be recorded, and no tenant's records crowd out another's.

Why grow rather than size the file for the worst case at once: the file is
sparse, so its length costs no memory, but the load scans it, and a table
sized for records of 25 units would make every restart scan 25 times the
units that typical keys use. A growth is crash-safe by construction: the
new units are zeros (no record), the header is not touched, and the load
takes the file's length, within those bounds, as the table's size. So a
table written before tables grew is one that never did, and is read as
ever; a daemon older than this one refuses a table that grew (by its
length) and starts empty, saying why. Before
it grows, the table checks that the shared-memory directory keeps room for
the arena's pages not yet written: the arena is sparse on the same tmpfs,
and a page fault into a full tmpfs is SIGBUS, the very crash the table is
there for. The load reads only the parts of the file that hold data
(``SEEK_DATA``) with ``pread``: a read through a mapping would allocate a
tmpfs page for every hole it touches.

A block that cannot be recorded — the tmpfs is full, the table failed, or a
record longer than any the daemon's limits allow — is *refused*, never
stored unrecorded: :meth:`BlockTable.record_block` raises TierFull (with a
retry delay: RESOURCE_EXHAUSTED) or TierUnavailable (the table failed:
UNAVAILABLE), and the tier gives the extent back. Why refuse rather than
store it and say so: a daemon run crash-safe promises that an acknowledged
put survives a SIGKILL; a block kept without a record breaks that promise
silently, and only at the next crash, in whichever tenant's blocks came
last. A KV cache's client already handles a refused put (the value is not
cached; it recomputes, or retries after the delay), while the put's answer
has no field that could say "stored, but not crash-safe", and a client
would have nothing to do with it. :attr:`BlockTable.refused` counts the
refusals (``strata_ram_unrecorded_blocks_total``) and the first is logged.

Not thread-safe: the tier calls it under its own lock.

Errors, beyond :mod:`kvstore.errors` (whose TierFull and TierUnavailable a
record that cannot be written raises)::

    StrataError
    └── TableMismatch    the table file is not this arena's (format, arena id, size)
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import xxhash

from kvstore.block import (
    MAX_KEY_BYTES,
    MAX_LAYOUT_CHARS,
    MAX_NAMESPACE_CHARS,
    BlockKey,
    BlockMeta,
)
from kvstore.errors import StrataError, TierFull, TierUnavailable
from kvstore.shm.allocator import ExtentAllocator

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
# The longest record the daemon's limits allow: namespaces are ASCII, a layout's characters take
# up to 4 bytes of UTF-8, the parent is a key.
MAX_RECORD_BYTES = _HEAD.size + _BODY.size + MAX_NAMESPACE_CHARS + 2 * MAX_KEY_BYTES + 4 * MAX_LAYOUT_CHARS
MAX_RECORD_UNITS = -(-MAX_RECORD_BYTES // UNIT_BYTES)
_READ_BYTES = 4 << 20  # the load reads the file in pieces of this size
_RETRY_S = 1.0  # a full tmpfs does not empty itself in a moment


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
    """Units a new table starts with (and its header names): one per arena page."""
    return max(64, data_size // page)


def max_table_units(data_size: int, page: int) -> int:
    """Units a table may grow to: always room for a record of every arena page (module docstring)."""
    return max(table_units(data_size, page), (2 * (data_size // page) + 3) * MAX_RECORD_UNITS)


def _free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


class BlockTable:
    """See the module docstring. Build with :meth:`create` or :meth:`open`.

    ``keep_free`` says how many bytes of the table's filesystem others still
    need (the arena's pages not yet written); the table grows only while it
    leaves them free.
    """

    def __init__(self, path: str, fd: int, units: int, max_units: int, secret: int,
                 keep_free: Callable[[], int] | None = None) -> None:
        self._path = path
        self._fd: int | None = fd
        self._secret = secret
        self._file_units = units
        self._keep_free = keep_free or (lambda: 0)
        # The allocator spans the largest table; each growth step beyond the file's end is held as
        # one allocated extent, freed (and so merged into the free space) when the file grows over it.
        self._units = ExtentAllocator(max_units * UNIT_BYTES, page=UNIT_BYTES)
        self._growth: list[tuple[int, int]] = []  # (start, bytes) of the steps still to come, in order
        at = units
        while at < max_units:
            end = min(max_units, 2 * at)
            self._growth.append((at * UNIT_BYTES, (end - at) * UNIT_BYTES))
            at = end
        # Cleared one-unit positions kept for the next one-unit record: most records are one
        # unit, and a list pop is a fraction of a best-fit allocation on the put path.
        self._spare: list[int] = []
        self._at: dict[int, int] = {}  # arena offset -> record position in the units
        self._seq = 0
        self.refused = 0  # blocks refused because they could not be recorded

    # ---- lifecycle -----------------------------------------------------------

    @classmethod
    def create(cls, path: str, arena_id: bytes, data_size: int, page: int,
               keep_free: Callable[[], int] | None = None) -> BlockTable:
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
        table = cls(path, fd, units, max_table_units(data_size, page), secret, keep_free)
        table._claim([])
        return table

    @classmethod
    def open(cls, path: str, arena_id: bytes, data_size: int, page: int,
             keep_free: Callable[[], int] | None = None) -> tuple[BlockTable, Loaded]:
        """The table a previous run left, and its valid records.

        Raises FileNotFoundError when there is none, TableMismatch when it is
        not this arena's or has another format. Torn records are counted
        and cleared; of two records of one extent the block's wins. A table
        that grew is as long as it grew (its header keeps the size it started
        with); one written before tables grew is simply one that never did.
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
            most = max_table_units(data_size, page)
            grown, rest = divmod(st.st_size - HEADER_BYTES, UNIT_BYTES)
            if rest or not units <= grown <= most:
                raise TableMismatch(
                    f"{path} is {st.st_size} bytes; a table of this arena is {HEADER_BYTES} bytes of header and "
                    f"{units} to {most} units of {UNIT_BYTES} bytes"
                )
            table = cls(path, fd, grown, most, secret, keep_free)
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

    @property
    def units(self) -> int:
        """Units the file holds now (it grows; it never shrinks)."""
        return self._file_units

    def close(self, unlink: bool = False) -> None:
        """Close the file; ``unlink`` also removes it. Safe to call twice."""
        if unlink:
            remove(self._path)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # ---- records -------------------------------------------------------------

    def record_block(self, offset: int, key: BlockKey, meta: BlockMeta) -> None:
        """Record a committed block at ``offset``.

        Raises TierFull (the tmpfs has no room for the record) or
        TierUnavailable (the table failed): the block must then not be
        stored, as it would not survive a crash.
        """
        ns, layout, parent = key.namespace.encode(), meta.layout.encode(), meta.parent
        lengths = (len(ns), len(key.key), _NO_PARENT if parent is None else len(parent), len(layout))
        tail = ns + key.key + (parent or b"") + layout
        try:
            self._write(BLOCK, lengths, offset, meta.size, meta.checksum, 0, tail)
        except (TierFull, TierUnavailable) as err:
            self.refused += 1
            if self.refused == 1:
                log.warning(
                    "refused block %s: the RAM tier's block table could not record it (%s); further refusals "
                    "are counted in strata_ram_unrecorded_blocks_total", key, err,
                )
            raise

    def record_slot(self, offset: int, size: int, until: float) -> None:
        """Record that a writer outside the daemon may write ``size`` bytes at ``offset`` until ``until`` (unix s).

        Raises as :meth:`record_block` does: a slot that is not recorded must not be lent.
        """
        self._write(SLOT, (0, 0, _NO_PARENT, 0), offset, size, 0, int(until * 1000) + 1, b"")

    def forget(self, offset: int) -> None:
        """Clear the record of the extent at ``offset``, if any. Call it before the extent is reused."""
        pos = self._at.pop(offset, None)
        if pos is None or self._fd is None:
            return
        try:
            self._clear(pos, self._units.size_of(pos))
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

    def _write(self, kind: int, lengths: tuple, offset: int, size: int, sum_: int, until_ms: int, tail: bytes) -> None:
        """Write one record whole, then point ``offset`` at it (clearing the record it replaces)."""
        if self._fd is None:
            raise TierUnavailable(
                f"the RAM tier's block table {self._path} failed earlier and was removed: nothing more can be made "
                "crash-safe until the daemon restarts (or run it with --no-ram-crash-safe)"
            )
        self._seq += 1
        body = _BODY.pack(kind, *lengths, self._seq, offset, size, sum_, until_ms) + tail
        record = _HEAD.pack(self._seq, self._sum(_LENGTH.pack(len(body)) + body), len(body)) + body
        pos = self._take(len(record))
        try:
            written = os.pwrite(self._fd, record, HEADER_BYTES + pos)
        except OSError as err:
            self._give(pos)
            raise self._write_error(err) from err
        if written != len(record):  # cut short (a full tmpfs): its checksum fails at load, but clear what landed
            try:
                os.pwrite(self._fd, bytes(max(0, written - 8)), HEADER_BYTES + pos + 8)
            except OSError:
                pass  # then it stays as a torn record would: the load discards it
            self._give(pos)
            raise self._write_error(OSError(errno.ENOSPC, f"wrote {written} of the record's {len(record)} bytes"))
        old = self._at.get(offset)
        self._at[offset] = pos
        if old is not None:  # a slot's record, now the block's: the new one is whole, so clear the old
            try:
                self._clear(old, self._units.size_of(old))
            except OSError as err:
                self._fail(err)
                raise TierUnavailable(f"the RAM tier's block table {self._path} failed ({err}) and was removed") from err
            self._give(old)

    def _write_error(self, err: OSError) -> TierFull | TierUnavailable:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            return TierFull(
                f"the shared-memory directory of the RAM tier's block table {self._path} is full ({err.strerror or err}): "
                "the block was not stored; retry later, or give the directory more room (docker --shm-size, a larger "
                "emptyDir) or lower --ram-bytes", retry_after_s=_RETRY_S,
            )
        log.warning("could not write to the RAM tier's block table %s: %s", self._path, err)
        return TierUnavailable(f"could not write to the RAM tier's block table {self._path}: {err}")

    def _take(self, nbytes: int) -> int:
        """A position for a record of ``nbytes``, growing the file when none is free; raises TierFull."""
        if nbytes <= UNIT_BYTES and self._spare:
            return self._spare.pop()
        pos = self._units.allocate(nbytes)
        if pos is None and self._spare:  # the spares may be what a longer record needs: coalesce them
            for spare in self._spare:
                self._units.free(spare)
            self._spare.clear()
            pos = self._units.allocate(nbytes)
        while pos is None:
            self._grow(nbytes)
            pos = self._units.allocate(nbytes)
        return pos

    def _grow(self, nbytes: int) -> None:
        """Extend the file by its next growth step; raises TierFull when it may not."""
        if not self._growth:  # unreachable for records within the daemon's limits (module docstring)
            raise TierFull(
                f"the RAM tier's block table {self._path} is at its largest ({self._file_units} units) and has no "
                f"room for a record of {nbytes} bytes (at most {MAX_RECORD_BYTES} within the daemon's limits)",
                retry_after_s=_RETRY_S,
            )
        assert self._fd is not None
        start, step = self._growth[0]
        directory = os.path.dirname(self._path) or "."
        try:
            free, others = _free_bytes(directory), self._keep_free()
        except OSError as err:
            raise self._write_error(err) from err
        if free - others < step:
            raise TierFull(
                f"the RAM tier's block table {self._path} needs {step} more bytes of {directory} for its records, "
                f"which has {free} free, {others} of them kept for the arena's pages not yet written: the block was "
                "not stored; give the directory more room (docker --shm-size, a larger emptyDir) or lower --ram-bytes",
                retry_after_s=_RETRY_S,
            )
        try:
            os.ftruncate(self._fd, HEADER_BYTES + start + step)
        except OSError as err:
            raise self._write_error(err) from err
        self._growth.pop(0)
        self._units.free(start)
        self._file_units = (start + step) // UNIT_BYTES
        log.info("the RAM tier's block table %s grew to %d units of %d bytes (long keys or layouts)",
                 self._path, self._file_units, UNIT_BYTES)

    def _clear(self, pos: int, nbytes: int) -> None:
        """Clear the record in the ``nbytes`` of units at ``pos``: its checksum first, in one write.

        Through the checksum word of its last unit, so no part of its body is left where the load
        looks for a record (a later, shorter record there would leave it to be counted as torn);
        not past it, so the write finds every page it touches already there (a full tmpfs cannot
        refuse it).
        """
        os.pwrite(self._fd, bytes(nbytes - UNIT_BYTES + 8), HEADER_BYTES + pos + 8)

    def _give(self, pos: int) -> None:
        if self._units.size_of(pos) == UNIT_BYTES:
            self._spare.append(pos)
        else:
            self._units.free(pos)

    def _claim(self, records: list[tuple[int, int]]) -> list[bool]:
        """Take the records' ``(position, bytes)`` and the growth steps beyond the file's end, once."""
        return self._units.claim_all(records + self._growth)[: len(records)]

    def _sum(self, data: bytes) -> int:
        return xxhash.xxh3_64_intdigest(data, seed=self._secret) or 1  # 0 means "no record"

    def _fail(self, err: OSError) -> None:
        """A write to the table failed: remove it, so no restart trusts records that may be stale."""
        log.error(
            "the RAM tier's block table %s failed (%s): removed it; the RAM tier refuses new blocks until the "
            "daemon restarts, and its blocks will not survive a crash", self._path, err,
        )
        self.close(unlink=True)
        self._at.clear()

    def _data(self) -> list[tuple[int, int]]:
        """``[start, end)`` ranges of the record area that hold data; holes read as zeros (no record)."""
        assert self._fd is not None
        end = HEADER_BYTES + self._file_units * UNIT_BYTES
        ranges, at = [], HEADER_BYTES
        try:
            while at < end:
                try:
                    start = os.lseek(self._fd, at, os.SEEK_DATA)
                except OSError as err:
                    if err.errno == errno.ENXIO:  # no data past ``at``
                        break
                    raise
                stop = min(end, os.lseek(self._fd, start, os.SEEK_HOLE))
                if start >= end:
                    break
                ranges.append((max(start, HEADER_BYTES) - HEADER_BYTES, stop - HEADER_BYTES))
                at = stop
        except OSError as err:  # a filesystem without SEEK_DATA: read it all
            if err.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            ranges = [(0, end - HEADER_BYTES)]
        return [(start // UNIT_BYTES * UNIT_BYTES, stop) for start, stop in ranges if stop > start]

    def _load(self) -> Loaded:
        loaded = Loaded()
        best: dict[int, tuple] = {}  # arena offset -> (rank, pos, total, record): a block's beats a slot's, then the later
        dropped: list[tuple[int, int]] = []  # (position, bytes) to clear: torn records (their first unit), and
        # records another of their extent supersedes
        skip = 0  # the first position past the last record accepted: positions before it are inside it
        for start, stop in self._data():
            for piece in range(max(start, skip), stop, _READ_BYTES):
                length = min(_READ_BYTES, stop - piece)  # whole units; the rest finishes a record that starts here
                buf = os.pread(self._fd, length + MAX_RECORD_BYTES, HEADER_BYTES + piece)
                sums = memoryview(buf)[: min(length, len(buf)) // 8 * 8].cast("Q")[1 :: UNIT_BYTES // 8]
                for unit, value in enumerate(sums):
                    pos = piece + unit * UNIT_BYTES
                    if not value or pos < skip:
                        continue
                    parsed = self._parse(buf, pos - piece, pos)
                    if parsed is None:
                        loaded.torn += 1
                        dropped.append((pos, UNIT_BYTES))
                        continue
                    kind, seq, record, total = parsed
                    skip = pos + _units_of(total)
                    self._seq = max(self._seq, seq, getattr(record, "stamp", 0))
                    rank = (kind == BLOCK, seq)
                    other = best.get(record.offset)
                    if other is not None and other[0] > rank:
                        dropped.append((pos, _units_of(total)))
                        continue
                    if other is not None:
                        dropped.append((other[1], _units_of(other[2])))
                    best[record.offset] = (rank, pos, total, record)
        for pos, nbytes in dropped:
            self._clear(pos, nbytes)
        kept = list(best.values())
        for (_, pos, _, record), ok in zip(kept, self._claim([(pos, total) for _, pos, total, _ in kept])):
            if not ok:  # cannot happen: a forward scan skips the units of every record it accepted
                os.pwrite(self._fd, _ZERO, HEADER_BYTES + pos + 8)
                continue
            self._at[record.offset] = pos
            (loaded.blocks if isinstance(record, BlockRecord) else loaded.slots).append(record)
        return loaded

    def _parse(self, buf: bytes, at: int, pos: int):
        """(kind, seq, record, total bytes) of a valid record at ``pos`` (``buf[at:]``), or None."""
        end = self._file_units * UNIT_BYTES
        if pos + _HEAD.size + _BODY.size > end or at + _HEAD.size > len(buf):
            return None
        stamp, stored, length = _HEAD.unpack_from(buf, at)
        total = _HEAD.size + length
        if length < _BODY.size or pos + total > end:
            return None
        if at + total <= len(buf):
            body = buf[at + _HEAD.size : at + total]
        else:  # longer than any record within the daemon's limits: read it on its own
            body = os.pread(self._fd, length, HEADER_BYTES + pos + _HEAD.size)
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


def _units_of(nbytes: int) -> int:
    """Bytes of the whole units a record of ``nbytes`` takes."""
    return -(-nbytes // UNIT_BYTES) * UNIT_BYTES


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
