"""The node's host-RAM copy of cached models: one copy per node, mapped by every engine process.

Tensor-parallel ranks and replicas on one node each open the same model;
without this copy each maps the disk cache privately and the page cache
holds the bytes at the kernel's whim. With it, the weight node copies every
verified file of a model into a shared-memory directory (a tmpfs such as
``/dev/shm``) once, and every :func:`~weightcache.reader.open_model` given
the same ``ram_dir`` maps those files read-only (``MAP_SHARED``,
``PROT_READ``): its tensors are zero-copy views of the one copy, however
many processes read them. Layout under the directory::

    models/<digest>/files/<path>   a whole, verified file of the model (its final name)
    models/<digest>/.<n>.copying   a file being copied (never opened by readers)
    models/<digest>/lease          flock(LOCK_SH) by every process reading the model
    models/<digest>/used           its mtime: when the model was last opened (LRU order)
    trash/                         evicted models, renamed here whole, then deleted
    lock                           the copy's lock (flock), for admission and eviction

Why files and not extents of the KV daemon's arena (:mod:`kvstore.shm.arena`
with :mod:`kvstore.shm.allocator`): a tensor is contiguous bytes of one
file, often larger than a chunk, and an engine keeps its zero-copy views
long after its reader closed. In an arena, an evicted model's extents are
handed to the next model while some process may still map them, so a
tensor could change under its engine. A tmpfs file that is unlinked keeps
its pages until the last mapping goes: eviction can never change a byte a
process sees, and the kernel does the allocation the allocator would.

Only verified bytes are ever visible: a file is copied chunk by chunk from
the disk cache, each chunk checked against the manifest's digest again on
the way (a disk that rotted since fails here, not in an engine), into a
temporary name that readers never open, and renamed to its final name when
whole. A reader sees a file either whole and verified or not at all.

Bounded by ``capacity_bytes``: a file is admitted only when it fits with
every file already there (and those being copied, at their full size) and
in the tmpfs's free space; otherwise unused models are evicted, least
recently opened first, never one a process has open (its lease) and never
the one being copied. A file that still does not fit is left out: the copy
is optional, and readers read that file from the disk cache instead.
Copies outlive every reader process (a tmpfs file) and the weight node's
own restarts; eviction (:meth:`RamCopy.evict`, ``strata weights evict
--ram-dir``) removes the model's files.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import shutil
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import InvalidArgument, TierUnavailable
from weightcache.manifest import Manifest, digest_of

log = logging.getLogger(__name__)

MIN_CAPACITY_BYTES = 1 << 20
_COPYING = ".copying"


@dataclass(frozen=True)
class RamEntry:
    """One model in the RAM copy, as ``strata weights ls --ram-dir`` shows it."""

    digest: str
    files: int
    bytes: int
    in_use: bool


class RamModel:
    """The files of one model resident in the RAM copy, leased while open (not evicted by the budget).

    ``files`` maps the manifest's file index to its path; a file not there is read from disk."""

    def __init__(self, manifest: Manifest, folder: Path, lease_fd: int) -> None:
        self.manifest = manifest
        self.folder = folder
        self._lease_fd = lease_fd
        self.files: dict[int, Path] = {}
        for i, entry in enumerate(manifest.files):
            path = folder / "files" / entry.path
            try:
                if path.stat().st_size == entry.size:
                    self.files[i] = path
            except (FileNotFoundError, NotADirectoryError):
                continue

    def has(self, file: int) -> bool:
        return file in self.files

    def map(self, file: int):
        """A read-only shared mapping of the whole file (``b""`` for an empty one)."""
        size = self.manifest.files[file].size
        if size == 0:
            return b""
        fd = os.open(self.files[file], os.O_RDONLY | os.O_CLOEXEC)
        try:
            return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._lease_fd >= 0:
            fcntl.flock(self._lease_fd, fcntl.LOCK_UN)
            os.close(self._lease_fd)
            self._lease_fd = -1


class RamCopy:
    def __init__(self, root: str | os.PathLike, capacity_bytes: int = 0, *, writable: bool = False) -> None:
        """``capacity_bytes`` bounds what :meth:`admit` copies in. Readers (who never copy) pass 0 and
        write nothing: an engine running as another user than the weight node needs only read
        access, and a directory the weight node never filled reads as an empty copy. ``writable``
        without a capacity: evict only (``strata weights evict``)."""
        if capacity_bytes and capacity_bytes < MIN_CAPACITY_BYTES:
            raise InvalidArgument(f"the RAM copy's capacity is {capacity_bytes} bytes; give it at least 1 MiB")
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.models_dir = self.root / "models"
        self.trash_dir = self.root / "trash"
        self._thread_lock = threading.RLock()
        self._lock_fd = -1
        self.writable = writable or bool(capacity_bytes)
        if not self.writable:
            try:
                self._lock_fd = os.open(self.root / "lock", os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                log.warning("no RAM copy at %s (is the weight node running with --ram-dir?): reading from disk",
                            self.root)
            except OSError as err:
                raise TierUnavailable(f"RAM copy {self.root}: {err.strerror}: give this process read access") from None
            return
        try:
            self.models_dir.mkdir(parents=True, exist_ok=True)
            self.trash_dir.mkdir(exist_ok=True)
            self._lock_fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise TierUnavailable(
                f"RAM copy {self.root}: {err.strerror}: point --ram-dir at a writable tmpfs directory"
            ) from None
        with self.locked():
            for leftover in self.trash_dir.iterdir():
                shutil.rmtree(leftover, ignore_errors=True)

    def drop_stale_copies(self) -> int:
        """Remove files a crashed copier left half-copied; only the one copier (the weight node, at
        its start) may call this. Returns how many."""
        with self.locked():
            stale = list(self.models_dir.glob(f"*/.*{_COPYING}"))
            for path in stale:
                path.unlink(missing_ok=True)
        return len(stale)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with self._thread_lock:
            if self._lock_fd < 0:  # a reader of a copy that does not exist: nothing to agree on
                yield
                return
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    # ---- readers -------------------------------------------------------------------

    def open(self, manifest: Manifest) -> RamModel:
        """The model's resident files, leased until :meth:`RamModel.close`."""
        folder = self.models_dir / manifest.digest
        with self.locked():
            if self.writable:
                folder.mkdir(exist_ok=True)
                lease = os.open(folder / "lease", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            else:
                try:
                    lease = os.open(folder / "lease", os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:  # never copied here: nothing to lease, every file from disk
                    return RamModel(manifest, folder, -1)
            fcntl.flock(lease, fcntl.LOCK_SH)
            try:
                (folder / "used").touch()
            except OSError:
                pass  # a reader without write access: the weight node's own opens keep the LRU order
            return RamModel(manifest, folder, lease)

    # ---- the weight node: copying in ------------------------------------------------

    def admit(self, model) -> int:
        """Copy every file of a cached model (:class:`~weightcache.cached_model.CachedModel`) whose
        chunks are all verified and that is not resident yet; returns the bytes copied. Files that do
        not fit the budget are left out (logged): readers read them from disk."""
        if not self.capacity_bytes:
            raise InvalidArgument("this RAM copy was opened for reading (capacity 0): give it a capacity to admit")
        manifest = model.manifest
        ram = self.open(manifest)  # leased: no other process evicts it while we copy
        copied = 0
        try:
            for file, entry in enumerate(manifest.files):
                if ram.has(file) or not model.file_complete(file):
                    continue
                tmp = self._reserve(manifest.digest, ram.folder, entry.size)
                if tmp is None:
                    log.warning("RAM copy %s is full: %s of %s stays on disk only", self.root, entry.path,
                                manifest.digest)
                    continue  # a smaller file may still fit
                if self._copy(model, file, tmp):
                    final = ram.folder / "files" / entry.path
                    final.parent.mkdir(parents=True, exist_ok=True)
                    os.rename(tmp, final)  # whole and verified: visible from now on
                    copied += entry.size
        finally:
            ram.close()
        return copied

    def _reserve(self, digest: str, folder: Path, nbytes: int) -> Path | None:
        """A temporary file of ``nbytes`` admitted under the budget (evicting unused models), or None."""
        with self.locked():
            while True:
                used = self.used_bytes()
                fits = used + nbytes <= self.capacity_bytes and nbytes <= _free_bytes(self.root)
                if fits:
                    tmp = folder / f".{uuid.uuid4().hex[:12]}{_COPYING}"
                    try:
                        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                        os.ftruncate(fd, nbytes)  # counted at full size by used_bytes() from now on
                        os.close(fd)
                    except OSError as err:
                        raise TierUnavailable(f"RAM copy {self.root}: {err.strerror}") from None
                    return tmp
                if not self._evict_one(digest):
                    return None

    def _copy(self, model, file: int, tmp: Path) -> bool:
        """Copy one file, verifying each chunk again; False (nothing left behind) if one fails or the
        tmpfs fills."""
        manifest = model.manifest
        entry = manifest.files[file]
        fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC)
        try:
            for chunk, want in enumerate(entry.chunks):
                start, end = entry.chunk_span(chunk, manifest.chunk_bytes)
                data = model.read(file, start, end)
                if digest_of(data) != want:
                    log.error("chunk %d of %s (%s) no longer matches its digest on disk: not copied to RAM",
                              chunk, entry.path, manifest.digest)
                    return _dropped(tmp)
                done = 0
                while done < len(data):
                    done += os.pwrite(fd, memoryview(data)[done:], start + done)
            return True
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
                raise TierUnavailable(f"RAM copy {tmp}: {err.strerror}") from None
            log.warning("RAM copy %s: the tmpfs is full: %s stays on disk only", self.root, entry.path)
            return _dropped(tmp)
        finally:
            os.close(fd)

    # ---- bounds and eviction -------------------------------------------------------

    def used_bytes(self) -> int:
        """Bytes of every file in the copy, those being copied at their full size."""
        total = 0
        if not self.models_dir.is_dir():
            return 0
        for dirpath, _, names in os.walk(self.models_dir):
            for name in names:
                if name in ("lease", "used"):
                    continue
                try:
                    total += os.stat(os.path.join(dirpath, name)).st_size
                except FileNotFoundError:
                    continue
        return total

    def _evict_one(self, asking: str) -> bool:
        def last_used(p: Path) -> float:
            try:
                return (p / "used").stat().st_mtime
            except FileNotFoundError:
                return 0.0

        folders = [p for p in self.models_dir.iterdir() if p.is_dir() and p.name != asking]
        for folder in sorted(folders, key=last_used):
            if _folder_bytes(folder) and self._evict_folder(folder):
                return True
        return False

    def evict(self, digest: str) -> bool:
        """Remove a model's RAM copy if no process has it open; False if in use or absent. Processes
        that still map its files keep their pages until they unmap them."""
        if not self.writable:
            raise InvalidArgument("evicting from the RAM copy needs it opened writable (RamCopy(root, writable=True))")
        with self.locked():
            folder = self.models_dir / digest
            return folder.is_dir() and self._evict_folder(folder)

    def _evict_folder(self, folder: Path) -> bool:
        lease = os.open(folder / "lease", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(lease, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            gone = self.trash_dir / f"{folder.name}.{uuid.uuid4().hex[:8]}"
            os.rename(folder, gone)
        finally:
            os.close(lease)
        log.info("evicted the RAM copy of %s", folder.name)
        shutil.rmtree(gone, ignore_errors=True)
        return True

    def model_bytes(self, digest: str) -> int:
        return _folder_bytes(self.models_dir / digest, resident_only=True)

    def entries(self) -> list[RamEntry]:
        out = []
        if not self.models_dir.is_dir():
            return out
        for folder in sorted(p for p in self.models_dir.iterdir() if p.is_dir()):
            files = [p for p in (folder / "files").rglob("*") if p.is_file()] if (folder / "files").is_dir() else []
            out.append(RamEntry(folder.name, len(files), sum(p.stat().st_size for p in files), _in_use(folder)))
        return out

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _dropped(tmp: Path) -> bool:
    tmp.unlink(missing_ok=True)
    return False


def _folder_bytes(folder: Path, resident_only: bool = False) -> int:
    total = 0
    for dirpath, _, names in os.walk(folder / "files" if resident_only else folder):
        for name in names:
            if name in ("lease", "used"):
                continue
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                continue
    return total


def _in_use(folder: Path) -> bool:
    try:
        fd = os.open(folder / "lease", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _free_bytes(path: Path) -> int:
    vfs = os.statvfs(path)
    return vfs.f_bavail * vfs.f_frsize
