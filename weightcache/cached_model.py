"""One model revision in the node cache: its files, which chunks are verified, and who fetches what.

A :class:`CachedModel` is what the fetch planner writes into and the reader
reads from. It never holds an unverified byte: :meth:`store` checks a
chunk's BLAKE3 digest *before* the bytes reach the file, writes them, marks
them present for this process, then makes them durable and records them
(:mod:`weightcache.record`) for every other process and the next start.
Presence is known only those two ways, this object's in-memory map and the
record: the sparse file's contents are never taken as evidence, so bytes of
a chunk written before a crash but never recorded are fetched again.

Files are created at their full size (sparse) when the first chunk of one
is about to be fetched, after the node cache admits them (capacity and the
disk's free space). A write that still finds the disk full raises
:class:`~kvstore.errors.DiskFull`; the record stays as it was, so a later
run resumes from the chunks verified so far.

A model is normally opened pinned: its lease is held until :meth:`close`,
so the node cache never evicts it under a reader. A weight node's serving
handle is opened unpinned (:meth:`NodeCache.open`): it holds no lease
between reads, so a model the node only serves to peers can be evicted,
and :meth:`leased` takes the lease for one read and answers False once
the model's folder is no longer the one this handle opened (evicted, or
evicted and fetched again): the handle is stale, and its owner drops it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from kvstore.errors import DiskFull, TierUnavailable
from weightcache.claims import Claims
from weightcache.manifest import Manifest, digest_of
from weightcache.record import ChunkRecord


class CachedModel:
    def __init__(self, cache, folder: Path, manifest: Manifest, lease_fd: int, identity: bytes = b"") -> None:
        self.cache = cache
        self.folder = folder
        self.manifest = manifest
        self._lease_fd = lease_fd  # -1: unpinned (see leased)
        self._identity = identity  # the lease token of the folder's life this handle opened
        self.record = ChunkRecord(folder / "verified.log", manifest)
        self.claims = Claims(folder / "claims")
        self._present = [bytearray(len(f.chunks)) for f in manifest.files]
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self._closed = False
        for f, c in self.record.load():
            self._present[f][c] = 1

    # ---- presence ----------------------------------------------------------------

    def is_present(self, file: int, chunk: int) -> bool:
        return bool(self._present[file][chunk])

    def verified_chunks(self) -> int:
        return sum(sum(p) for p in self._present)

    def file_complete(self, file: int) -> bool:
        return all(self._present[file])

    def refresh(self) -> list[tuple[int, int]]:
        """Chunks other processes recorded since the last look, now present here too."""
        new = []
        with self._lock:
            for f, c in self.record.tail():
                if not self._present[f][c]:
                    self._present[f][c] = 1
                    new.append((f, c))
        return new

    def global_index(self, file: int, chunk: int) -> int:
        return self.manifest.first_chunk[file] + chunk

    # ---- the lease -----------------------------------------------------------------

    @property
    def pinned(self) -> bool:
        return self._lease_fd >= 0

    def current(self) -> bool:
        """Whether the cache's folder for this digest is still the one this handle opened."""
        if self.pinned:
            return True
        try:
            fd = os.open(self.folder / "lease", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            return os.pread(fd, 64, 0) == self._identity
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def leased(self) -> Iterator[bool]:
        """The model's lease for the block (a pinned handle already holds it). False: the model was
        evicted, or is being evicted now, since this handle was opened; nothing may be read."""
        if self.pinned:
            yield True
            return
        try:
            fd = os.open(self.folder / "lease", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            yield False
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # an eviction holds it exclusively: the folder is leaving
                yield False
                return
            # Ours, and still at its path (not renamed into the trash between our open and our lock):
            # while this descriptor is open its inode cannot be reused, so equal inodes are the same file.
            yield os.pread(fd, 64, 0) == self._identity and _same_file(fd, self.folder / "lease")
        finally:
            os.close(fd)

    # ---- writing -----------------------------------------------------------------

    def path(self, file: int) -> Path:
        return self.folder / "files" / self.manifest.files[file].path

    def prepare(self, file: int) -> int:
        """The file's descriptor, creating the file at full size (admitted by the cache) if new."""
        with self._lock:
            fd = self._fds.get(file)
            if fd is not None:
                return fd
            entry = self.manifest.files[file]
            path = self.path(file)
            with self.cache.locked():
                try:
                    exists = path.stat().st_size == entry.size
                except FileNotFoundError:
                    exists = False
                if not exists:
                    self.cache.reserve(self.manifest.digest, entry.size)
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                    if not exists:
                        os.ftruncate(fd, entry.size)
                except OSError as err:
                    raise _io_error(err, path) from None
            self._fds[file] = fd
            return fd

    def write(self, file: int, chunk: int, data: memoryview) -> bool:
        """Verify one chunk and write it to its file: present for this process at once (the bytes
        are verified and in the page cache) and queued for the record's next :meth:`flush`. False
        (nothing written) if it fails its digest."""
        if digest_of(data) != self.manifest.files[file].chunks[chunk]:
            return False
        fd = self.prepare(file)
        offset = chunk * self.manifest.chunk_bytes
        view = memoryview(data).cast("B")
        try:
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
        except OSError as err:
            raise _io_error(err, self.path(file)) from None
        # Present here first, then durable: this process may serve the bytes now; and refresh()
        # never mistakes our own entry for another's.
        self._present[file][chunk] = 1
        self.record.add(fd, [(file, chunk)])
        return True

    def flush(self) -> None:
        """Make the chunks written so far durable and recorded, for every other process and the next start."""
        self.record.flush()

    def store(self, file: int, chunk: int, data: memoryview) -> bool:
        """:meth:`write` and :meth:`flush` one chunk; False (nothing written) if it fails its digest."""
        if not self.write(file, chunk, data):
            return False
        self.flush()
        return True

    # ---- reading -----------------------------------------------------------------

    def map(self, file: int, start: int, end: int) -> tuple[mmap.mmap, int]:
        """A private (copy-on-write) mapping holding bytes [start, end) of the file, and where
        ``start`` is inside it. The caller maps only verified bytes; writes to the mapping (an
        engine scaling a tensor in place) stay in this process and never reach the cache."""
        fd = self.prepare(file)
        base = start - start % mmap.ALLOCATIONGRANULARITY
        return mmap.mmap(fd, end - base, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=base), start - base

    def read(self, file: int, start: int, end: int) -> bytes:
        return os.pread(self.prepare(file), end - start, start)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
        self.record.close()
        self.claims.close()
        if not self.pinned:  # it never counted as a use: the LRU order is the readers'
            return
        try:
            (self.folder / "used").touch()
        except OSError:
            pass
        fcntl.flock(self._lease_fd, fcntl.LOCK_UN)
        os.close(self._lease_fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _io_error(err: OSError, path: Path) -> Exception:
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(f"{path}: the filesystem is full; free space, or put the weight cache on a larger disk")
    return TierUnavailable(f"{path}: {err.strerror}")
