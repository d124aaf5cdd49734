"""How the disk tier writes a block: a unique temp file, the bytes written and hashed chunk by
chunk, fsyncs when asked, and the rename that commits it (see :mod:`kvstore.tiers.disk`).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
from pathlib import Path

import xxhash

from kvstore.errors import CorruptBlock, DiskFull
from kvstore.tiers.disk_entry import _FULL_ERRNOS, _IO_CHUNK, _Entry

log = logging.getLogger(__name__)

_TEMP_ATTEMPTS = 100
_temp_numbers = itertools.count()  # next() on a count is atomic under the GIL


class _Writes:
    """:class:`~kvstore.tiers.disk.DiskTier`'s writing (a mixin of it)."""

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
