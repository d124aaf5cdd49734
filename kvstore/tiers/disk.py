"""The disk tier: one file per block in a local (NVMe) directory.

Layout. A block lives at ``<dir>/<xx>/<name>`` where ``name`` is the hex of an
xxh3-128 of ``(namespace, key)`` and ``xx`` its first byte: 256 fan-out
folders keep any one directory small enough for fast lookups even with
millions of blocks. The file's format (a self-checking header naming the
block, then the payload) is :mod:`kvstore.tiers.block_file`.

Crash safety. A block is written to a unique ``*.tmp`` file in its folder and
renamed into place; the rename is the commit point, and is atomic. A SIGKILL
at any moment therefore leaves each block either complete or absent: the page
cache belongs to the kernel and survives the process, so even with
``fsync=False`` a killed daemon cannot tear a block. A power loss can: without
fsync the kernel may persist the rename before the data. ``fsync=True`` syncs
the file before the rename and the folder after it, which closes that window
at the cost of write latency. Without it a torn file is still never served:
its checksum fails on read and the block is dropped.

Recovery. Construction deletes leftover ``*.tmp`` files, reads every header,
drops files whose header fails its own checksum or whose size disagrees with
it, and rebuilds the index in LRU order from the files' mtimes. Every put and
every ``touch`` stamps its file with a strictly increasing mtime; a ``get``
moves the block to the MRU end in memory only. Stamping on reads cost a
syscall per read (a large share of a 64 KiB read), and a cache's eviction
order after a restart may be approximate: it follows writes and touches, not
the reads since. Payload checksums are verified lazily, on ``get``: reading a
multi-terabyte cache in full at start would keep the daemon down for minutes.

I/O. Block bytes move in chunks of ``_IO_CHUNK`` through ``os.writev`` and
``os.readv``, each chunk hashed right after it is written or read, while it is
still in cache; the header travels with the first chunk. A separate verifying
pass would read every block from memory twice. A put verifies the checksum
before its rename, so a mismatch commits nothing. The index keeps each
header's own checksum, so a get recognises its header without parsing it.
``get`` returns the ``bytearray`` it read into, not ``bytes``.

Room. The tier holds at most ``capacity_bytes`` and at most what its
filesystem can: at start, what it holds plus the free space (``statvfs``),
asked again by :meth:`DiskTier.upkeep` and whenever a put does not fit. A
write that finds the filesystem full (``ENOSPC``) raises ``DiskFull``, a
kind of ``TierFull``: the tier is full, not failing, and holds what it has
until the filesystem has room again; meanwhile it reports itself degraded.
A failed fsync leaves durability unknown, so the block is not committed
(see :meth:`DiskTier._write`). A deleted block whose unlink failed leaves
the index at once and its file goes on the next upkeep.

File-system calls. Every one goes through a :class:`~kvstore.tiers.fsops.FileOps`
(the real ``os`` calls unless a test passes a faulty one).

Concurrency. One lock guards the index, the LRU order and the byte counts.
Reads, writes and fsyncs of block bytes run outside it. The two metadata
operations that change which file a name points to, the commit ``rename`` and
the ``unlink`` of a delete, run under it so that the index and the directory
change together: otherwise a delete racing a re-put of the same key could
unlink the new file after the index recorded it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvstore.block import BlockKey, BlockMeta, TierName
from kvstore.errors import (
    BlockTooLarge,
    CorruptBlock,
    DiskFull,
    InvalidArgument,
    TierFull,
    TierUnavailable,
)
from kvstore.tiers.base import Tier, TierStats
from kvstore.tiers.block_file import (
    BadHeader,
    block_name,
    decode_header,
    encode_header,
    header_checksum,
    header_matches,
    read_header,
)
from kvstore.tiers.fsops import REAL, FileOps

log = logging.getLogger(__name__)

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_LOW_SPACE_BYTES = 1 << 20  # a filesystem with less free than this (and a tier below its size) is full
_LOCK_FILE = "LOCK"
_FOLDERS = [f"{i:02x}" for i in range(256)]  # fan-out by the name's first byte
_IO_CHUNK = 1 << 20  # bytes per read or write: small enough that a chunk just hashed is still in cache
_TEMP_ATTEMPTS = 100
_temp_numbers = itertools.count()  # next() on a count is atomic under the GIL


class _BadPayload(ValueError):
    """A block file whose header is sound but whose payload is short, long or fails its checksum."""


@dataclass(slots=True)
class _Entry:
    key: BlockKey
    meta: BlockMeta
    header_len: int
    header_sum: int  # lets a get recognise its own header without parsing it

    @property
    def disk_bytes(self) -> int:
        return self.header_len + self.meta.size


class DiskTier(Tier):
    """Blocks as files under ``directory``, at most ``capacity_bytes`` of them (headers included).

    One process owns a directory at a time (an exclusive ``flock`` on
    ``<dir>/LOCK``): recovery deletes ``*.tmp`` files, which would destroy a
    second live writer's blocks in flight.
    """

    name = TierName.DISK
    persistent = True

    def __init__(
        self, directory: str | os.PathLike, capacity_bytes: int, fsync: bool = False, ops: FileOps = REAL,
    ) -> None:
        if capacity_bytes <= 0:
            raise InvalidArgument(
                f"disk tier capacity is {capacity_bytes} bytes; pass a positive --disk-bytes"
            )
        self._root = Path(directory)
        self._root_str = os.fspath(self._root)  # paths are built as strings: pathlib costs microseconds a call
        self._configured = capacity_bytes
        self._limit = capacity_bytes  # the effective capacity: what the filesystem lets this tier hold
        self._full = ""  # why the filesystem takes no more blocks now; "" while it does
        self._fsync = fsync
        self._ops = ops
        self._lock = threading.Lock()
        self._index: OrderedDict[str, _Entry] = OrderedDict()  # block name -> entry, LRU first
        self._used = 0
        self._reserved = 0  # bytes of puts in flight, so concurrent puts cannot overshoot capacity
        self._doomed: dict[str, int] = {}  # deleted blocks whose unlink failed: name -> bytes, retried by upkeep
        self._clock_ns = 0  # last mtime stamp handed out; strictly increasing
        self.recovered_blocks = 0
        self.dropped_on_recovery = 0
        self._lock_fd = self._open_directory()
        try:
            self._recover()
            self._bound_by_filesystem()
        except BaseException:
            self.close()
            raise

    # -- Tier API ---------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        """The configured capacity: no block larger than this can ever be held.

        What the tier can hold now, bounded by its filesystem, is
        ``stats().capacity_bytes`` (see :meth:`_bound_by_filesystem`).
        """
        return self._configured

    @property
    def directory(self) -> Path:
        return self._root

    def contains(self, key: BlockKey) -> bool:
        return self.meta(key) is not None

    def meta(self, key: BlockKey) -> BlockMeta | None:
        with self._lock:
            entry = self._lookup(block_name(key), key)
            return entry.meta if entry else None

    def get(self, key: BlockKey) -> bytearray | None:
        name = block_name(key)
        with self._lock:
            entry = self._lookup(name, key)
        if entry is None:
            return None
        path = self._path(name)
        ops = self._ops
        try:
            fd = ops.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._forget(name, entry)
            return None
        except OSError as e:
            raise self._unavailable(path, e) from e
        try:
            payload = self._read(fd, name, entry)
        except BadHeader as e:
            self._drop_corrupt(name, entry)
            raise CorruptBlock(f"{key}: bad header in {path} ({e}); the block was dropped") from None
        except _BadPayload as e:
            self._drop_corrupt(name, entry)
            raise CorruptBlock(f"{key}: {e} in {path}; the block was dropped") from None
        except OSError as e:
            raise self._unavailable(path, e) from e
        finally:
            ops.close(fd)
        if payload is not None:
            with self._lock:
                if self._index.get(name) is entry:
                    self._index.move_to_end(name)
        return payload

    def _read(self, fd: int, name: str, entry: _Entry) -> bytearray | None:
        """The verified payload of the open block file ``fd``; None when the file is another block now.

        The index knows the header's length, so one ``readv`` fetches the
        header and the first chunk of payload; each chunk is hashed right after
        it is read, while it is still in cache. Raises BadHeader or _BadPayload
        when the file is this entry's but damaged.
        """
        size = entry.meta.size
        head, payload = bytearray(entry.header_len), _uninitialized(size)
        h = xxhash.xxh3_64()
        with memoryview(payload) as view:
            with view[:_IO_CHUNK] as chunk:
                pos = self._ops.readv(fd, [head, chunk]) - len(head)
            if pos < 0:
                if self._replaced(name, entry):
                    return None
                raise BadHeader("file ends inside the header")
            if not self._is_own_header(head, name, entry):
                return None
            with view[:pos] as chunk:
                h.update(chunk)
            while pos < size:
                with view[pos : pos + _IO_CHUNK] as chunk:
                    n = self._ops.readv(fd, [chunk])
                    with chunk[:n] as done:
                        h.update(done)
                if n == 0:
                    break
                pos += n
        if pos != size or self._ops.read(fd, 1):
            raise _BadPayload("file size disagrees with its header")
        if h.intdigest() != entry.meta.checksum:
            raise _BadPayload("payload checksum mismatch")
        return payload

    def _is_own_header(self, head: bytearray, name: str, entry: _Entry) -> bool:
        """Whether ``head`` is the header written for ``entry``; False when the file is another block now.

        The fast path compares the header's checksum with the one recorded at
        put or recovery, and checks it against the bytes: no parsing. Anything
        else is parsed: another key's header (a collision, or a file copied in
        by hand) is not this block; a header for this key that is not the
        recorded one is a race with a delete and re-put, or damage.
        """
        if header_matches(head, entry.header_sum):
            return True
        try:
            header = decode_header(head)
        except BadHeader:
            if self._replaced(name, entry):
                return False
            raise
        if header.key != entry.key or self._replaced(name, entry):
            return False
        raise BadHeader("header disagrees with the index")

    def _replaced(self, name: str, entry: _Entry) -> bool:
        """Whether ``name`` stopped holding ``entry`` since it was looked up.

        Renames and unlinks change the directory and the index together, under
        the lock, so while the index still holds ``entry`` the file is the one
        written for it: a header that disagrees is then damage, not a race.
        """
        with self._lock:
            return self._index.get(name) is not entry

    def put(self, key: BlockKey, data: bytes | bytearray | memoryview, meta: BlockMeta) -> bool:
        # Released explicitly: ``data`` may be a view of the shared arena, and
        # an exception's traceback would otherwise keep this view (and so the
        # arena's mapping) alive until the garbage collector runs.
        view = memoryview(data).cast("B")
        try:
            return self._put(key, view, meta)
        finally:
            view.release()

    def _put(self, key: BlockKey, view: memoryview, meta: BlockMeta) -> bool:
        if view.nbytes != meta.size:
            raise CorruptBlock(f"{key}: got {view.nbytes} bytes but the metadata says {meta.size}")
        header = encode_header(key, meta)
        entry = _Entry(key, meta, len(header), header_checksum(header))
        if entry.disk_bytes > self._configured:
            raise BlockTooLarge(
                f"{key} takes {entry.disk_bytes} bytes on disk; the disk tier holds only {self._configured}"
            )
        name = block_name(key)
        with self._lock:
            if self._lookup(name, key) is not None:
                return False
            if not self._fits_locked(entry.disk_bytes):
                if self._limit < self._configured:
                    raise TierFull(
                        f"disk tier directory {self._root} holds {self._used} bytes and its filesystem has no room "
                        f"for {entry.disk_bytes} more (--disk-bytes is {self._configured}): evict and retry, "
                        "free space on that filesystem or lower --disk-bytes"
                    )
                raise TierFull(
                    f"disk tier holds {self._used} of {self._configured} bytes; "
                    f"{key} needs {entry.disk_bytes} more: evict and retry"
                )
            self._reserved += entry.disk_bytes
            stamp = self._next_stamp()
        try:
            return self._write(name, entry, header, view, stamp)
        finally:
            with self._lock:
                self._reserved -= entry.disk_bytes

    def _fits_locked(self, size: int) -> bool:
        """Whether ``size`` more bytes fit now; below the configured size, asks the filesystem again first."""
        if self._used + self._reserved + size <= self._limit:
            return True
        if self._limit < self._configured:
            try:
                self._refresh_locked(self._ops.free_bytes(self._root_str))
            except OSError as e:
                log.warning("disk tier %s: cannot read its filesystem's free space: %s", self._root, e.strerror)
        return self._used + self._reserved + size <= self._limit

    def delete(self, key: BlockKey) -> bool:
        name = block_name(key)
        with self._lock:
            entry = self._lookup(name, key)
            if entry is None:
                return False
            self._unlink_locked(name, entry)
        return True

    def touch(self, key: BlockKey) -> None:
        name = block_name(key)
        with self._lock:
            entry = self._lookup(name, key)
        if entry is not None:
            self._mark_used(name, entry)

    def lru(self) -> Iterator[BlockKey]:
        with self._lock:
            keys = [e.key for e in self._index.values()]
        return iter(keys)

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(self.name, self._used, self._limit, len(self._index), self._degraded_locked())

    @property
    def degraded(self) -> str:
        """Why the tier cannot take the blocks it was configured for (its filesystem is full); "" when it can."""
        with self._lock:
            return self._degraded_locked()

    def _degraded_locked(self) -> str:
        if not self._full:
            return ""
        return (
            f"the filesystem of {self._root} is full ({self._full}): the disk tier holds {self._used} of its "
            f"{self._configured} bytes and takes more only as it evicts; free space there or lower --disk-bytes"
        )

    def upkeep(self) -> None:
        """Ask the filesystem again how much it holds (space may have come back, or gone to another
        writer), and retry the unlinks of deleted blocks that failed. The store calls this about
        once a second; it is how a tier degraded by a full filesystem recovers."""
        with self._lock:
            doomed = list(self._doomed.items())
        for name, size in doomed:
            try:
                self._ops.unlink(self._path(name))
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("disk tier: still cannot remove deleted block file %s: %s", self._path(name), e.strerror)
                continue
            with self._lock:
                if self._doomed.get(name) == size:
                    del self._doomed[name]
                    self._used -= size
        try:
            free = self._ops.free_bytes(self._root_str)
        except OSError as e:
            log.warning("disk tier %s: cannot read its filesystem's free space: %s", self._root, e.strerror)
            return
        with self._lock:
            self._refresh_locked(free)

    def _refresh_locked(self, free: int) -> None:
        """Bound the capacity by what the filesystem holds: what the tier has plus the free space, never
        more than configured and never less than what it holds (those blocks are safe where they are)."""
        self._limit = min(self._configured, self._used + free)  # never below what it holds: those blocks stay
        was = self._full
        if free >= _LOW_SPACE_BYTES or self._limit >= self._configured:
            self._full = ""
        elif not self._full:
            self._full = f"{free} bytes free"
        if was and not self._full:
            log.warning(
                "disk tier %s: its filesystem has room again (%d bytes free); capacity %d of %d configured bytes",
                self._root, free, self._limit, self._configured,
                extra={"disk_dir": self._root_str, "free_bytes": free, "capacity_bytes": self._limit},
            )
        elif self._full and not was:
            self._log_degraded_locked()

    def _filled_locked(self, e: OSError, pending: int) -> None:
        """A write found the filesystem full: the tier now holds what it has (and the puts still in flight)."""
        self._limit = min(self._limit, max(self._used + self._reserved - pending, self._used))
        was, self._full = self._full, e.strerror or "no space left on device"
        if not was:
            self._log_degraded_locked()

    def _log_degraded_locked(self) -> None:
        log.warning(
            "disk tier degraded: %s; blocks stay in RAM while it has room",
            self._degraded_locked(),
            extra={"disk_dir": self._root_str, "capacity_bytes": self._limit, "configured_bytes": self._configured},
        )

    def namespaces(self) -> set[str]:
        """Namespaces with at least one block here; the daemon re-registers them after a restart."""
        with self._lock:
            return {e.key.namespace for e in self._index.values()}

    def close(self) -> None:
        """Release the directory lock. Blocks stay on disk for the next instance."""
        if self._lock_fd is not None:
            self._ops.close(self._lock_fd)
            self._lock_fd = None

    # -- writing ---------------------------------------------------------------

    def _write(self, name: str, entry: _Entry, header: bytes, view: memoryview, stamp: int) -> bool:
        """Write the block to a temp file and rename it into place; True once it is committed.

        With ``fsync`` a block counts as on disk only once both the file and
        its folder are synced. A failed fsync leaves the durability of what
        it covered unknown (Linux may even drop the unwritten pages and
        report the next fsync clean), so the block is not committed: before
        the rename the temp file goes; after it, the file is unlinked and
        the index forgets it, and the caller keeps its copy above.
        """
        folder = self._folder(name)
        ops = self._ops
        tmp = None
        committed = False
        try:
            tmp, fd = self._create_temp(folder, name)
            try:
                self._write_verified(fd, entry, header, view)
                if self._fsync:
                    ops.fsync(fd)
                ops.utime(fd, ns=(stamp, stamp))
            finally:
                ops.close(fd)
            with self._lock:
                if self._lookup(name, entry.key) is not None:
                    return False  # a concurrent put of the same key committed first
                ops.replace(tmp, self._path(name))
                tmp = None
                displaced = self._index.pop(name, None)  # a hash collision: the newer block wins
                if displaced is not None:
                    self._used -= displaced.disk_bytes
                self._used -= self._doomed.pop(name, 0)  # the rename replaced a deleted block's file
                self._index[name] = entry
                self._used += entry.disk_bytes
                committed = True
            if self._fsync:
                self._fsync_dir(folder)
            return True
        except OSError as e:
            if committed:
                self._uncommit(name, entry)
            if e.errno in _FULL_ERRNOS:
                with self._lock:
                    self._filled_locked(e, entry.disk_bytes)
                raise DiskFull(
                    f"disk tier directory {self._root} is full ({e.strerror}) writing {entry.key}: "
                    "free space on that filesystem or lower --disk-bytes below its free space"
                ) from e
            raise self._unavailable(tmp or folder, e) from e
        finally:
            if tmp is not None:
                self._remove_quietly(tmp)

    def _uncommit(self, name: str, entry: _Entry) -> None:
        """Take back a renamed block whose folder fsync failed: it must not count as on disk."""
        with self._lock:
            if self._index.get(name) is entry:
                self._unlink_locked(name, entry, quiet=True)

    def _write_verified(self, fd: int, entry: _Entry, header: bytes, view: memoryview) -> None:
        """Write header and payload to ``fd``, hashing each chunk right after it is written.

        The write has just pulled the chunk into cache, so the hash reads it
        from there, where hashing first would read it from memory. The
        checksum is verified at the end, before the caller's rename: a
        mismatch raises CorruptBlock and the temp file is never committed.
        The header goes out with the first chunk, in one ``writev``.
        """
        h = xxhash.xxh3_64()
        with view[:_IO_CHUNK] as chunk:
            self._write_all(fd, [header, chunk])
            h.update(chunk)
        for pos in range(_IO_CHUNK, len(view), _IO_CHUNK):
            with view[pos : pos + _IO_CHUNK] as chunk:
                self._write_all(fd, [chunk])
                h.update(chunk)
        if h.intdigest() != entry.meta.checksum:
            raise CorruptBlock(f"{entry.key}: payload checksum does not match the metadata; nothing stored")

    def _write_all(self, fd: int, parts: list[bytes | memoryview]) -> None:
        """``writev`` until every byte is written: a write may stop short (a signal, a nearly full disk)."""
        ops = self._ops
        written = ops.writev(fd, parts)
        for part in parts:
            if written >= len(part):
                written -= len(part)
                continue
            with memoryview(part) as rest:
                while written < len(rest):
                    with rest[written:] as tail:
                        n = ops.write(fd, tail)
                    if n == 0:
                        raise OSError(errno.EIO, "write made no progress")
                    written += n
            written = 0

    def _fsync_dir(self, folder: str) -> None:
        fd = self._ops.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            self._ops.fsync(fd)
        finally:
            self._ops.close(fd)

    def _create_temp(self, folder: str, name: str) -> tuple[str, int]:
        """Create a new, empty temp file for block ``name``; its path and an fd open for writing.

        Names come from the pid and a counter, not from ``tempfile.mkstemp``'s
        random names: cheaper, and just as unique, since the directory has one
        owning process and each of its puts takes the next number. ``O_EXCL``
        still refuses to reuse a name; a leftover under one moves to the next.
        A fan-out folder that could not be made at start (a full filesystem)
        is made here, on its first block.
        """
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        for _ in range(_TEMP_ATTEMPTS):
            tmp = f"{folder}/{name}.{os.getpid()}-{next(_temp_numbers)}.tmp"
            try:
                return tmp, self._ops.open(tmp, flags, 0o600)
            except FileExistsError:
                continue
            except FileNotFoundError:
                self._ops.mkdir(folder)
                return tmp, self._ops.open(tmp, flags, 0o600)
        raise FileExistsError(errno.EEXIST, f"no free temp file name after {_TEMP_ATTEMPTS} tries", folder)

    def _remove_quietly(self, path: str | Path) -> None:
        """Remove a temp or dropped file while another error, or recovery, is under way.

        A failure here must not hide the error being raised; the file is garbage
        that the next recovery removes, so it is logged rather than raised.
        """
        try:
            self._ops.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("disk tier: could not remove %s: %s", path, e.strerror)

    # -- index helpers (call the *_locked ones, and _lookup, with the lock held) --

    def _lookup(self, name: str, key: BlockKey) -> _Entry | None:
        entry = self._index.get(name)
        return entry if entry is not None and entry.key == key else None

    def _unlink_locked(self, name: str, entry: _Entry, quiet: bool = False) -> None:
        """Remove a block: from the index at once, from the directory now or, when the unlink
        fails, by :meth:`upkeep` later (its bytes count as used until then). Raises
        TierUnavailable for a failed unlink unless ``quiet``."""
        del self._index[name]
        path = self._path(name)
        try:
            self._ops.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            self._doomed[name] = self._doomed.get(name, 0) + entry.disk_bytes  # still used until upkeep removes it
            if not quiet:
                raise self._unavailable(path, e) from e
            log.warning("disk tier: could not remove %s (%s); retrying later", path, e.strerror)
            return
        self._used -= entry.disk_bytes

    def _forget(self, name: str, entry: _Entry) -> None:
        """Drop an entry whose file vanished, if no one replaced it meanwhile."""
        with self._lock:
            if self._index.get(name) is entry:
                del self._index[name]
                self._used -= entry.disk_bytes

    def _drop_corrupt(self, name: str, entry: _Entry) -> None:
        log.warning("disk tier: dropping corrupt block %s", entry.key)
        with self._lock:
            if self._index.get(name) is entry:
                self._unlink_locked(name, entry)

    def _mark_used(self, name: str, entry: _Entry) -> None:
        """Move the block to the MRU end and stamp its mtime, so ``touch`` survives a restart.

        Only ``touch`` stamps; a ``get`` moves the block in memory alone (see
        the module docstring). The stamp is advisory: when it fails (a
        filesystem remounted read-only after errors, say) the block is still
        sound, so it is logged, not raised; a failing device surfaces on the
        next put.
        """
        with self._lock:
            if self._index.get(name) is not entry:
                return
            self._index.move_to_end(name)
            stamp = self._next_stamp()
        path = self._path(name)
        try:
            self._ops.utime(path, ns=(stamp, stamp))
        except FileNotFoundError:
            pass  # deleted meanwhile
        except OSError as e:
            log.warning(
                "disk tier: cannot stamp %s, its LRU place may be stale after a restart: %s", path, e.strerror
            )

    def _next_stamp(self) -> int:
        """A strictly increasing mtime: the clock alone repeats within its tick (often 4 ms)."""
        self._clock_ns = max(time.time_ns(), self._clock_ns + 1)
        return self._clock_ns

    def _path(self, name: str) -> str:
        return f"{self._root_str}/{name[:2]}/{name}"

    def _folder(self, name: str) -> str:
        return f"{self._root_str}/{name[:2]}"

    def _unavailable(self, path: Path | str, e: OSError) -> TierUnavailable:
        reason = os.strerror(e.errno) if e.errno else str(e)
        return TierUnavailable(f"disk tier I/O failed on {path}: {reason} (errno {e.errno})")

    # -- start-up ----------------------------------------------------------------

    def _open_directory(self) -> int:
        ops = self._ops
        try:
            _make_dirs(ops, self._root)
            present = set(ops.listdir(self._root_str))
            for folder in _FOLDERS:
                if folder not in present:
                    try:
                        ops.mkdir(f"{self._root_str}/{folder}")
                    except FileExistsError:
                        pass
                    except OSError as e:
                        if e.errno not in _FULL_ERRNOS:
                            raise
                        # A full filesystem: the folder is made by the first put into it.
            # Read-only: flock needs no more, and a file open for writing would
            # keep the filesystem from being remounted read-only after errors.
            fd = ops.open(f"{self._root_str}/{_LOCK_FILE}", os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError as e:
            raise TierUnavailable(
                f"cannot use {self._root} as the disk tier directory: {os.strerror(e.errno or 0)}; "
                "point --disk-dir at a writable directory"
            ) from e
        try:
            ops.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            ops.close(fd)
            raise TierUnavailable(
                f"disk tier directory {self._root} is in use by another process; "
                "stop it or give this one its own --disk-dir"
            ) from e
        return fd

    def _bound_by_filesystem(self) -> None:
        """At start: the capacity is at most what the tier holds plus the filesystem's free space."""
        try:
            free = self._ops.free_bytes(self._root_str)
        except OSError as e:
            log.warning("disk tier %s: cannot read its filesystem's free space: %s", self._root, e.strerror)
            return
        with self._lock:
            self._refresh_locked(free)
            if self._limit < self._configured:
                log.warning(
                    "disk tier %s: --disk-bytes is %d but its filesystem holds only %d more bytes beside the %d "
                    "it has: the tier holds at most %d; lower --disk-bytes or free space there",
                    self._root, self._configured, free, self._used, self._limit,
                    extra={"disk_dir": self._root_str, "configured_bytes": self._configured,
                           "capacity_bytes": self._limit, "free_bytes": free},
                )

    def _recover(self) -> None:
        found: list[tuple[int, str, _Entry]] = []
        for folder in _FOLDERS:
            folder_path = f"{self._root_str}/{folder}"
            try:
                with self._ops.scandir(folder_path) as it:
                    files = [(d.name, d.path) for d in it if d.is_file(follow_symlinks=False)]
            except FileNotFoundError:
                continue  # not made yet (the filesystem was full at the last start)
            except OSError as e:
                raise self._unavailable(folder_path, e) from e
            for fname, path in files:
                if fname.endswith(".tmp"):
                    self._remove_quietly(path)  # an uncommitted write from a killed process
                elif len(fname) == 32 and fname.startswith(folder):
                    item = self._recover_file(fname, path)
                    if item is None:
                        self.dropped_on_recovery += 1
                        self._remove_quietly(path)
                    else:
                        found.append(item)
        found.sort(key=lambda item: (item[0], item[1]))
        for mtime, name, entry in found:
            self._index[name] = entry
            self._used += entry.disk_bytes
            self._clock_ns = max(self._clock_ns, mtime)
        self.recovered_blocks = len(found)
        log.info(
            "disk tier %s: recovered %d blocks (%d bytes), dropped %d",
            self._root, self.recovered_blocks, self._used, self.dropped_on_recovery,
        )

    def _recover_file(self, name: str, path: str) -> tuple[int, str, _Entry] | None:
        """The (mtime, name, entry) of a sound block file, or None when it must be dropped."""
        ops = self._ops
        try:
            fd = ops.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                st = ops.fstat(fd)
                header = read_header(_FdReader(ops, fd))
            finally:
                ops.close(fd)
        except BadHeader as e:
            log.warning("disk tier: dropping %s at recovery: %s", path, e)
            return None
        except OSError as e:
            raise self._unavailable(path, e) from e
        if header.meta.size != st.st_size - header.length or block_name(header.key) != name:
            log.warning("disk tier: dropping %s at recovery: size or name disagrees with its header", path)
            return None
        return st.st_mtime_ns, name, _Entry(header.key, header.meta, header.length, header.checksum)


class _FdReader:
    """``read(n)`` on an fd through the tier's FileOps: what :func:`read_header` reads from."""

    __slots__ = ("_ops", "_fd")

    def __init__(self, ops: FileOps, fd: int) -> None:
        self._ops, self._fd = ops, fd

    def read(self, n: int) -> bytes:
        return self._ops.read(self._fd, n)


def _make_dirs(ops: FileOps, path: Path) -> None:
    """``mkdir -p`` through ``ops``."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for p in reversed(missing):
        try:
            ops.mkdir(os.fspath(p))
        except FileExistsError:
            pass


def _uninitialized(size: int) -> bytearray:
    """A bytearray of ``size`` bytes that every caller overwrites in full before it escapes.

    ``bytearray(size)`` zero-fills: for a 16 MiB block one more pass over
    memory, which halved the tier's read throughput next to a plain
    ``f.read()`` (whose ``bytes`` is not zeroed). CPython's
    ``PyByteArray_FromStringAndSize(NULL, size)`` allocates without filling.
    Other interpreters get the zero-filled one.
    """
    if _new_bytearray is None or size == 0:
        return bytearray(size)
    return _new_bytearray(None, size)


def _bytearray_constructor():
    pythonapi = getattr(ctypes, "pythonapi", None)
    if pythonapi is None or sys.implementation.name != "cpython":
        return None
    new = pythonapi.PyByteArray_FromStringAndSize
    new.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
    new.restype = ctypes.py_object
    return new


_new_bytearray = _bytearray_constructor()
