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
kind of ``TierFull``: the tier is full, not failing; it deletes nothing of
its own accord and reports itself degraded until the filesystem has room
again. Its capacity then shrinks to what it holds, so the store makes room
in it as in any full tier: by moving its least recent blocks down to a
tier below that takes copies (a bucket). With none, nothing more is demoted
into it meanwhile, the tier above keeps its blocks, and a writer that finds
no room is refused with a retry delay (:mod:`kvstore.store.state`).
A failed fsync leaves durability unknown, so the block is not committed
(see :meth:`DiskTier._write`). A deleted block whose unlink failed leaves
the index at once and its file goes on the next upkeep.

File-system calls. Every one goes through a :class:`~kvstore.fsops.FileOps`
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
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import xxhash

from kvstore.block import BlockKey, BlockMeta, TierName
from kvstore.errors import (
    BlockTooLarge,
    CorruptBlock,
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
)
from kvstore.tiers.disk_entry import _IO_CHUNK, _BadPayload, _Entry
from kvstore.tiers.disk_recovery import _Recovery
from kvstore.tiers.disk_room import _Room
from kvstore.tiers.disk_writes import _Writes
from kvstore.fsops import REAL, FileOps

log = logging.getLogger(__name__)


class DiskTier(_Writes, _Room, _Recovery, Tier):
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

    def namespaces(self) -> set[str]:
        """Namespaces with at least one block here; the daemon re-registers them after a restart."""
        with self._lock:
            return {e.key.namespace for e in self._index.values()}

    def close(self) -> None:
        """Release the directory lock. Blocks stay on disk for the next instance."""
        if self._lock_fd is not None:
            self._ops.close(self._lock_fd)
            self._lock_fd = None

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
