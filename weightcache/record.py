"""The persisted record of a cached model's verified chunks: an append-only log.

One record per cached model (``verified.log`` in its folder). A chunk is
appended only after its bytes passed their digest, were written to the
model's file and that file was flushed (``fdatasync``): a recorded chunk is
on the disk, so after a crash or a restart it is served without being
fetched again, and a chunk that was written but not yet recorded is simply
fetched again. The log is the whole truth about presence; the sparse files
may hold bytes of chunks never recorded, which nothing reads.

Layout: a 48-byte header (magic, version, entry size, the manifest's
digest), then 16-byte entries ``(file u32, chunk u32, first 8 bytes of the
chunk's digest)``. The digest prefix makes each entry self-checking: a
torn write, a zero-filled tail after a power cut, or an entry of another
manifest never matches, and is skipped (the reader slides forward a byte at
a time to find the next whole entry, so one torn entry cannot shift all the
later ones). Appends are ``O_APPEND`` writes of whole entries, so several
processes may record into one log; a chunk recorded twice counts once.

Several writers commit in groups: whoever takes the commit lock flushes
every file touched since the last commit and appends every pending entry,
so a burst of finished chunks costs one ``fdatasync`` per file, not one per
chunk. A follower (another process fetching other chunks of the same
model) calls :meth:`ChunkRecord.tail` to learn what was recorded since.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
from collections.abc import Iterable

from kvstore.errors import DiskFull, TierUnavailable
from weightcache.manifest import Manifest

log = logging.getLogger(__name__)

MAGIC = b"STRATAWR"
VERSION = 1
_HEADER = struct.Struct("<8sII32s")
_ENTRY = struct.Struct("<II8s")
HEADER_BYTES = _HEADER.size
ENTRY_BYTES = _ENTRY.size
MAX_TAIL_BYTES = 4 << 20  # read at most this much of the log per tail() call


class ChunkRecord:
    def __init__(self, path: str | os.PathLike, manifest: Manifest) -> None:
        self.path = os.fspath(path)
        self._manifest = manifest
        self._header = _HEADER.pack(MAGIC, VERSION, ENTRY_BYTES, bytes.fromhex(manifest.digest))
        self._fd = self._open()
        self._offset = HEADER_BYTES  # how far tail() has read
        self._pending: list[tuple[int, int]] = []
        self._pending_fds: set[int] = set()
        self._pending_lock = threading.Lock()
        self._commit_lock = threading.Lock()
        self.skipped = 0  # entries that did not check out (torn, zeroed, foreign)

    def _open(self) -> int:
        """Open the log, creating it whole (header first, then linked in place) if it is missing,
        and starting it over if its header is not this manifest's."""
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
            except FileNotFoundError:
                self._create()
                continue
            head = os.pread(fd, HEADER_BYTES, 0)
            if head == self._header:
                return fd
            os.close(fd)
            log.warning("chunk record %s is not this manifest's (or torn): starting it over", self.path)
            os.unlink(self.path)
        raise TierUnavailable(f"cannot open the chunk record {self.path}")

    def _create(self) -> None:
        tmp = f"{self.path}.{os.getpid()}.{threading.get_ident()}.new"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, self._header)
                os.fdatasync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, self.path)  # fails if another process created it first: use theirs
            except FileExistsError:
                pass
        except OSError as err:
            raise _io_error(err, self.path) from None
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    def load(self) -> set[tuple[int, int]]:
        """Every chunk recorded so far, from the start of the log."""
        self._offset = HEADER_BYTES
        found: set[tuple[int, int]] = set()
        while True:
            before = self._offset
            found.update(self.tail())
            if self._offset == before:
                return found

    def tail(self) -> list[tuple[int, int]]:
        """Chunks recorded since the last call (by any process), at most MAX_TAIL_BYTES of log."""
        size = os.fstat(self._fd).st_size
        if size - self._offset < ENTRY_BYTES:
            return []
        data = os.pread(self._fd, min(size - self._offset, MAX_TAIL_BYTES), self._offset)
        out, used = self._entries(data)
        self._offset += used
        return out

    def _entries(self, data: bytes) -> tuple[list[tuple[int, int]], int]:
        """The entries of ``data`` that check out, and how many bytes were scanned (a partial last
        entry is left for the next call)."""
        files = self._manifest.files
        out, i = [], 0
        while i + ENTRY_BYTES <= len(data):
            f, c, prefix = _ENTRY.unpack_from(data, i)
            if f < len(files) and c < len(files[f].chunks) and files[f].chunks[c][:8] == prefix:
                out.append((f, c))
                i += ENTRY_BYTES
            else:
                self.skipped += 1
                i += 1
        return out, i

    def commit(self, fd: int, chunks: Iterable[tuple[int, int]]) -> None:
        """Record chunks whose bytes were written to ``fd``: flush the data, then the entries.
        Returns once these chunks are durable (possibly committed by another thread's group)."""
        self.add(fd, chunks)
        self.flush()

    def add(self, fd: int, chunks: Iterable[tuple[int, int]]) -> None:
        """Queue chunks whose bytes were written to ``fd`` for the next :meth:`flush`."""
        with self._pending_lock:
            self._pending.extend(chunks)
            self._pending_fds.add(fd)

    def flush(self) -> None:
        """Make every queued chunk durable: flush the data, then append their entries. Returns once
        the chunks queued before the call are recorded (possibly by another thread's group)."""
        with self._commit_lock:
            with self._pending_lock:
                batch, fds = self._pending, self._pending_fds
                self._pending, self._pending_fds = [], set()
            if not batch:
                return  # a group commit that ran while we waited took ours
            files = self._manifest.files
            payload = b"".join(_ENTRY.pack(f, c, files[f].chunks[c][:8]) for f, c in batch)
            try:
                for data_fd in fds:
                    os.fdatasync(data_fd)
                written = os.write(self._fd, payload)
                if written != len(payload):
                    raise OSError(errno.ENOSPC, "short write")
                os.fdatasync(self._fd)
            except OSError as err:
                raise _io_error(err, self.path) from None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _io_error(err: OSError, path: str) -> Exception:
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(f"{path}: the filesystem is full; free space, or give the cache a larger disk")
    return TierUnavailable(f"{path}: {err.strerror}")
