"""The disk tier: one file per block in a local (NVMe) directory.

Layout. A block lives at ``<dir>/<xx>/<name>`` where ``name`` is the hex of an
xxh3-128 of ``(namespace, key)`` and ``xx`` its first byte: 256 fan-out
folders keep any one directory small enough for fast lookups even with
millions of blocks. The file is a header (see :func:`encode_header`) followed
by the payload. The header carries the full namespace and key, so a 128-bit
hash collision is detected on read and answered as a miss, never with another
key's bytes.

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
it, and rebuilds the index in LRU order from the files' mtimes (every put,
get and touch stamps the file, so the order survives a restart). Payload
checksums are verified lazily, on ``get``: reading a multi-terabyte cache in
full at start would keep the daemon down for minutes.

Concurrency. One lock guards the index, the LRU order and the byte counts.
Reads, writes and fsyncs of block bytes run outside it. The two metadata
operations that change which file a name points to, the commit ``rename`` and
the ``unlink`` of a delete, run under it so that the index and the directory
change together: otherwise a delete racing a re-put of the same key could
unlink the new file after the index recorded it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvstore.block import BlockKey, BlockMeta, TierName, checksum
from kvstore.errors import (
    BlockTooLarge,
    CorruptBlock,
    DiskFull,
    InvalidArgument,
    TierFull,
    TierUnavailable,
)
from kvstore.tiers.base import Tier, TierStats

log = logging.getLogger(__name__)

MAGIC = b"STRATABK"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<8sHHIQQ")  # magic, version, flags, header length, payload size, payload xxh3
_LEN = struct.Struct("<H")
_HEADER_SUM = struct.Struct("<Q")
_HAS_PARENT = 1
_MAX_FIELD = 0xFFFF
_MAX_HEADER = _FIXED.size + 4 * (_LEN.size + _MAX_FIELD) + _HEADER_SUM.size
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_LOCK_FILE = "LOCK"
_FOLDERS = [f"{i:02x}" for i in range(256)]  # fan-out by the name's first byte


class BadHeader(ValueError):
    """A block file whose header cannot be trusted."""


@dataclass(frozen=True, slots=True)
class BlockHeader:
    key: BlockKey
    meta: BlockMeta
    length: int  # bytes before the payload


def block_name(key: BlockKey) -> str:
    """The file name of a block: hex xxh3-128 of namespace and key.

    Namespaces cannot contain NUL, so ``namespace NUL key`` is unambiguous.
    """
    return xxhash.xxh3_128_hexdigest(key.namespace.encode() + b"\0" + key.key)


def encode_header(key: BlockKey, meta: BlockMeta) -> bytes:
    """Fixed fields, then namespace, key, parent and layout (u16 length each), then xxh3-64 of all that."""
    fields = [key.namespace.encode(), key.key, meta.parent or b"", meta.layout.encode()]
    for field in fields:
        if len(field) > _MAX_FIELD:
            raise InvalidArgument(
                f"{key}: a header field is {len(field)} bytes; the disk format allows {_MAX_FIELD}"
            )
    body = b"".join(_LEN.pack(len(f)) + f for f in fields)
    length = _FIXED.size + len(body) + _HEADER_SUM.size
    flags = _HAS_PARENT if meta.parent is not None else 0
    head = _FIXED.pack(MAGIC, FORMAT_VERSION, flags, length, meta.size, meta.checksum) + body
    return head + _HEADER_SUM.pack(xxhash.xxh3_64_intdigest(head))


def read_header(f) -> BlockHeader:
    """Read and verify the header at the start of the binary file ``f``; raise BadHeader."""
    fixed = f.read(_FIXED.size)
    if len(fixed) < _FIXED.size:
        raise BadHeader("file shorter than a header")
    magic, version, flags, length, size, payload_sum = _FIXED.unpack(fixed)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise BadHeader(f"not a version-{FORMAT_VERSION} block file")
    if not _FIXED.size + 4 * _LEN.size + _HEADER_SUM.size <= length <= _MAX_HEADER:
        raise BadHeader(f"header length {length} out of range")
    rest = f.read(length - _FIXED.size)
    if len(rest) < length - _FIXED.size:
        raise BadHeader("file ends inside the header")
    head, (stored_sum,) = fixed + rest[: -_HEADER_SUM.size], _HEADER_SUM.unpack(rest[-_HEADER_SUM.size :])
    if xxhash.xxh3_64_intdigest(head) != stored_sum:
        raise BadHeader("header checksum mismatch")
    fields, pos = [], _FIXED.size
    for _ in range(4):
        if pos + _LEN.size > len(head):
            raise BadHeader("header fields run past its length")
        (n,) = _LEN.unpack_from(head, pos)
        fields.append(head[pos + _LEN.size : pos + _LEN.size + n])
        pos += _LEN.size + n
    if pos != len(head):
        raise BadHeader("header fields do not add up to its length")
    namespace, key, parent, layout = fields
    try:
        meta = BlockMeta(size, payload_sum, parent if flags & _HAS_PARENT else None, layout.decode())
        return BlockHeader(BlockKey(namespace.decode(), key), meta, length)
    except UnicodeDecodeError as e:
        raise BadHeader(f"header text is not UTF-8: {e}") from None


@dataclass(slots=True)
class _Entry:
    key: BlockKey
    meta: BlockMeta
    header_len: int

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

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, fsync: bool = False) -> None:
        if capacity_bytes <= 0:
            raise InvalidArgument(
                f"disk tier capacity is {capacity_bytes} bytes; pass a positive --disk-bytes"
            )
        self._root = Path(directory)
        self._capacity = capacity_bytes
        self._fsync = fsync
        self._lock = threading.Lock()
        self._index: OrderedDict[str, _Entry] = OrderedDict()  # block name -> entry, LRU first
        self._used = 0
        self._reserved = 0  # bytes of puts in flight, so concurrent puts cannot overshoot capacity
        self._clock_ns = 0  # last mtime stamp handed out; strictly increasing
        self.recovered_blocks = 0
        self.dropped_on_recovery = 0
        self._lock_fd = self._open_directory()
        try:
            self._recover()
        except BaseException:
            self.close()
            raise

    # -- Tier API ---------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def directory(self) -> Path:
        return self._root

    def contains(self, key: BlockKey) -> bool:
        return self.meta(key) is not None

    def meta(self, key: BlockKey) -> BlockMeta | None:
        with self._lock:
            entry = self._lookup(block_name(key), key)
            return entry.meta if entry else None

    def get(self, key: BlockKey) -> bytes | None:
        name = block_name(key)
        with self._lock:
            entry = self._lookup(name, key)
        if entry is None:
            return None
        path = self._path(name)
        try:
            with open(path, "rb") as f:
                header = read_header(f)
                if header.key != key:
                    return None  # a colliding key replaced the file after our lookup
                payload = f.read(entry.meta.size + 1)
        except FileNotFoundError:
            self._forget(name, entry)
            return None
        except BadHeader as e:
            self._drop_corrupt(name, entry)
            raise CorruptBlock(f"{key}: bad header in {path} ({e}); the block was dropped") from None
        except OSError as e:
            raise self._unavailable(path, e) from e
        if len(payload) != header.meta.size or checksum(payload) != header.meta.checksum:
            self._drop_corrupt(name, entry)
            raise CorruptBlock(f"{key}: payload checksum mismatch in {path}; the block was dropped")
        self._mark_used(name, entry)
        return payload

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
        if checksum(view) != meta.checksum:
            raise CorruptBlock(f"{key}: payload checksum does not match the metadata; nothing stored")
        header = encode_header(key, meta)
        entry = _Entry(key, meta, len(header))
        if entry.disk_bytes > self._capacity:
            raise BlockTooLarge(
                f"{key} takes {entry.disk_bytes} bytes on disk; the disk tier holds only {self._capacity}"
            )
        name = block_name(key)
        with self._lock:
            if self._lookup(name, key) is not None:
                return False
            if self._used + self._reserved + entry.disk_bytes > self._capacity:
                raise TierFull(
                    f"disk tier holds {self._used} of {self._capacity} bytes; "
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
            return TierStats(self.name, self._used, self._capacity, len(self._index))

    def namespaces(self) -> set[str]:
        """Namespaces with at least one block here; the daemon re-registers them after a restart."""
        with self._lock:
            return {e.key.namespace for e in self._index.values()}

    def close(self) -> None:
        """Release the directory lock. Blocks stay on disk for the next instance."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- writing ---------------------------------------------------------------

    def _write(self, name: str, entry: _Entry, header: bytes, view: memoryview, stamp: int) -> bool:
        folder = self._path(name).parent
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=name + ".", suffix=".tmp", dir=folder)
            with open(fd, "wb") as f:
                f.write(header)
                f.write(view)
                f.flush()
                if self._fsync:
                    os.fsync(fd)
                os.utime(fd, ns=(stamp, stamp))
            with self._lock:
                if self._lookup(name, entry.key) is not None:
                    return False  # a concurrent put of the same key committed first
                os.replace(tmp, self._path(name))
                tmp = None
                displaced = self._index.pop(name, None)  # a hash collision: the newer block wins
                if displaced is not None:
                    self._used -= displaced.disk_bytes
                self._index[name] = entry
                self._used += entry.disk_bytes
            if self._fsync:
                # Raises after the commit: the block is readable, only its durability is in doubt.
                self._fsync_dir(folder)
            return True
        except OSError as e:
            if e.errno in _FULL_ERRNOS:
                raise DiskFull(
                    f"disk tier directory {self._root} is full ({e.strerror}) writing {entry.key}: "
                    "free space on that filesystem or lower --disk-bytes below its free space"
                ) from e
            raise self._unavailable(tmp or folder, e) from e
        finally:
            if tmp is not None:
                _remove_quietly(tmp)

    def _fsync_dir(self, folder: Path) -> None:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- index helpers (call the *_locked ones, and _lookup, with the lock held) --

    def _lookup(self, name: str, key: BlockKey) -> _Entry | None:
        entry = self._index.get(name)
        return entry if entry is not None and entry.key == key else None

    def _unlink_locked(self, name: str, entry: _Entry) -> None:
        del self._index[name]
        self._used -= entry.disk_bytes
        path = self._path(name)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise self._unavailable(path, e) from e

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
        """Move the block to the MRU end and stamp its mtime, so the order survives a restart.

        The stamp is advisory: when it fails (a filesystem remounted read-only
        after errors, say) the read it follows is still verified and correct,
        so it is logged, not raised; a failing device surfaces on the next put.
        """
        with self._lock:
            if self._index.get(name) is not entry:
                return
            self._index.move_to_end(name)
            stamp = self._next_stamp()
        path = self._path(name)
        try:
            os.utime(path, ns=(stamp, stamp))
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

    def _path(self, name: str) -> Path:
        return self._root / name[:2] / name

    def _unavailable(self, path: Path | str, e: OSError) -> TierUnavailable:
        reason = os.strerror(e.errno) if e.errno else str(e)
        return TierUnavailable(f"disk tier I/O failed on {path}: {reason} (errno {e.errno})")

    # -- start-up ----------------------------------------------------------------

    def _open_directory(self) -> int:
        try:
            self._root.mkdir(parents=True, exist_ok=True)
            present = set(os.listdir(self._root))
            for folder in _FOLDERS:
                if folder not in present:
                    (self._root / folder).mkdir(exist_ok=True)
            # Read-only: flock needs no more, and a file open for writing would
            # keep the filesystem from being remounted read-only after errors.
            fd = os.open(self._root / _LOCK_FILE, os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError as e:
            raise TierUnavailable(
                f"cannot use {self._root} as the disk tier directory: {os.strerror(e.errno or 0)}; "
                "point --disk-dir at a writable directory"
            ) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            raise TierUnavailable(
                f"disk tier directory {self._root} is in use by another process; "
                "stop it or give this one its own --disk-dir"
            ) from e
        return fd

    def _recover(self) -> None:
        found: list[tuple[int, str, _Entry]] = []
        for folder in map(self._root.joinpath, _FOLDERS):
            try:
                with os.scandir(folder) as it:
                    files = [(d.name, d.path) for d in it if d.is_file(follow_symlinks=False)]
            except OSError as e:
                raise self._unavailable(folder, e) from e
            for fname, path in files:
                if fname.endswith(".tmp"):
                    _remove_quietly(path)  # an uncommitted write from a killed process
                elif len(fname) == 32 and fname.startswith(folder.name):
                    item = self._recover_file(fname, path)
                    if item is None:
                        self.dropped_on_recovery += 1
                        _remove_quietly(path)
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
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                header = read_header(f)
        except BadHeader as e:
            log.warning("disk tier: dropping %s at recovery: %s", path, e)
            return None
        except OSError as e:
            raise self._unavailable(path, e) from e
        if header.meta.size != st.st_size - header.length or block_name(header.key) != name:
            log.warning("disk tier: dropping %s at recovery: size or name disagrees with its header", path)
            return None
        return st.st_mtime_ns, name, _Entry(header.key, header.meta, header.length)


def _remove_quietly(path: str | Path) -> None:
    """Remove a temp or dropped file while another error, or recovery, is under way.

    A failure here must not hide the error being raised; the file is garbage
    that the next recovery removes, so it is logged rather than raised.
    """
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("disk tier: could not remove %s: %s", path, e.strerror)
