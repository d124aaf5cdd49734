"""The node cache: every model revision this node holds, bounded in bytes, evicted by model.

Layout under the cache's root (one folder per manifest digest, so two
revisions of one model never share a byte, and a digest names exactly the
bytes it hashed)::

    models/<digest>/manifest.json   the manifest, checked against <digest> when read back
    models/<digest>/files/<path>    each file of the revision, a sparse file at its full size
    models/<digest>/verified.log    the chunks verified and on disk (weightcache.record)
    models/<digest>/claims          which process fetches which chunk now (weightcache.claims)
    models/<digest>/lease           flock(LOCK_SH) by every process using the model
    models/<digest>/used            its mtime: when the model was last opened (LRU order)
    trash/                          evicted models, renamed here whole, then deleted

The bound counts each file at its full size from the moment it is created
(a sparse file's holes are promised space), so a model that was admitted
can always finish. Admitting a file also checks the filesystem: the space
still to be written into every cached file must fit in what is free, or the
cache would overcommit a disk it shares. When either bound is short, whole
models are evicted, least recently used first, never one in use (its lease
is held) and never the one asking; if that is not enough, the file is
refused: :class:`~weightcache.errors.CacheFull` (the configured bound) or
:class:`~kvstore.errors.DiskFull` (the filesystem), each saying what to change.

"In use" means leased: a process that reads or fetches a model holds its
lease from open to close, so a model being fetched (complete or not) is
never evicted. A handle that only *serves* verified chunks (the weight
node's peer data plane, its status) is opened unpinned
(``open(..., pinned=False)``) and takes the lease only for each read: a
weight node that has finished a prefetch does not hold the model against
the next one. A model no process has open, complete or left partial by a
fetch that stopped, is idle, and idle models go least recently used first.

An eviction renames the model's folder into ``trash/`` under the cache
lock, so no process ever opens a half-deleted model; a crash mid-delete
leaves only trash, emptied at the next start. Admission and eviction take
the cache lock (``flock`` on ``lock``, and a thread lock), so processes
sharing a cache agree on what is in it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import DiskFull, InvalidArgument, TierUnavailable
from weightcache.errors import CacheFull, ManifestError, ManifestMismatch
from weightcache.manifest import MAX_MANIFEST_BYTES, Manifest

log = logging.getLogger(__name__)

MIN_CAPACITY_BYTES = 1 << 20


@dataclass(frozen=True)
class CachedEntry:
    """One cached model, as ``strata weights ls --cache`` shows it."""

    digest: str
    model: str
    revision: str
    total_bytes: int  # the whole revision
    reserved_bytes: int  # its files created here, at full size
    allocated_bytes: int  # what the disk holds of them
    verified_chunks: int
    total_chunks: int
    in_use: bool


class NodeCache:
    def __init__(self, root: str | os.PathLike, capacity_bytes: int) -> None:
        if capacity_bytes < MIN_CAPACITY_BYTES:
            raise InvalidArgument(f"the weight cache's capacity is {capacity_bytes} bytes; give it at least 1 MiB")
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.models_dir = self.root / "models"
        self.trash_dir = self.root / "trash"
        try:
            self.models_dir.mkdir(parents=True, exist_ok=True)
            self.trash_dir.mkdir(exist_ok=True)
            self._lock_fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise TierUnavailable(f"weight cache {self.root}: {err.strerror}") from None
        self._thread_lock = threading.RLock()
        with self.locked():
            for leftover in self.trash_dir.iterdir():
                shutil.rmtree(leftover, ignore_errors=True)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with self._thread_lock:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def open(self, manifest: Manifest, *, pinned: bool = True):
        """The model's cache entry, leased until closed (it cannot be evicted meanwhile). Unpinned,
        it holds no lease: :meth:`CachedModel.leased` takes one around each read, and says when
        the model was evicted since."""
        from weightcache.cached_model import CachedModel

        folder = self.models_dir / manifest.digest
        with self.locked():
            (folder / "files").mkdir(parents=True, exist_ok=True)
            stored = folder / "manifest.json"
            if not stored.exists():
                _write_atomically(stored, manifest.encoded)
            lease = os.open(folder / "lease", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            if pinned:
                fcntl.flock(lease, fcntl.LOCK_SH)
                (folder / "used").touch()
            identity = lease_token(lease)
            if not pinned:
                os.close(lease)
                lease = -1
        return CachedModel(self, folder, manifest, lease, identity)

    def stored_manifest(self, digest: str) -> Manifest | None:
        """The manifest of a cached model (None when not cached), checked against its digest, so a
        warm node opens a pinned digest without asking the origin."""
        path = self.models_dir / digest / "manifest.json"
        try:
            raw = path.read_bytes()[: MAX_MANIFEST_BYTES + 1]
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            return Manifest.from_bytes(raw, expect_digest=digest, where=str(path))
        except (ManifestError, ManifestMismatch) as err:
            log.warning("ignoring the cached manifest %s: %s", path, err)
            return None

    def reserve(self, asking: str, nbytes: int) -> None:
        """Admit a new file of ``nbytes`` for model ``asking``, evicting unused models if needed.
        Call with :meth:`locked` held."""
        while True:
            reserved, allocated = self._usage()
            vfs = os.statvfs(self.root)
            fs_free = vfs.f_bavail * vfs.f_frsize
            over_capacity = reserved + nbytes > self.capacity_bytes
            over_disk = nbytes + max(0, reserved - allocated) > fs_free
            if not over_capacity and not over_disk:
                return
            if not self._evict_one(asking):
                if over_disk:
                    raise DiskFull(
                        f"weight cache {self.root}: a {nbytes}-byte file needs {nbytes + max(0, reserved - allocated)} "
                        f"bytes of disk with what cached files still need, and the filesystem has {fs_free} free: "
                        "free space, or put the cache on a larger disk",
                        retry_after_s=5.0,
                    )
                raise CacheFull(
                    f"weight cache {self.root}: a {nbytes}-byte file of model {asking[:12]} does not fit in the "
                    f"cache's bound of {self.capacity_bytes} bytes (--cache-bytes): {reserved} bytes are held by "
                    f"{self._holding(asking)}, and a model in use is never evicted; raise the cache's capacity "
                    "(--cache-bytes), or stop the engines using those models (strata weights ls --cache "
                    f"{self.root} shows them)",
                    retry_after_s=5.0,
                )

    def _holding(self, asking: str, most: int = 8) -> str:
        """What holds the cache's bytes, for CacheFull's message: the largest models first."""
        held = sorted(((*_folder_usage(f), f) for f in self._folders()), key=lambda u: -u[0])
        parts = []
        for reserved, _, folder in held[:most]:
            if folder.name == asking:
                parts.append(f"{folder.name[:12]} (this model, {reserved} bytes so far)")
                continue
            manifest = self.stored_manifest(folder.name)
            name = f"{manifest.model} @ {manifest.revision}, " if manifest is not None else ""
            parts.append(f"{folder.name[:12]} ({name}{reserved} bytes, {'in use' if _in_use(folder) else 'idle'})")
        if len(held) > most:
            parts.append(f"{len(held) - most} more")
        return "; ".join(parts) or "no model"

    def _usage(self) -> tuple[int, int]:
        reserved = allocated = 0
        for folder in self._folders():
            r, a = _folder_usage(folder)
            reserved += r
            allocated += a
        return reserved, allocated

    def _folders(self) -> list[Path]:
        return [p for p in self.models_dir.iterdir() if p.is_dir()]

    def _evict_one(self, asking: str) -> bool:
        def last_used(p: Path) -> float:
            try:
                return (p / "used").stat().st_mtime
            except FileNotFoundError:
                return 0.0

        for folder in sorted(self._folders(), key=last_used):
            if folder.name != asking and self._evict_folder(folder):
                return True
        return False

    def evict(self, digest: str) -> bool:
        """Remove a cached model that no process is using; False if in use or absent."""
        with self.locked():
            folder = self.models_dir / digest
            return folder.is_dir() and self._evict_folder(folder)

    def _evict_folder(self, folder: Path) -> bool:
        try:
            lease = os.open(folder / "lease", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            return False
        try:
            try:
                fcntl.flock(lease, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # in use
            gone = self.trash_dir / f"{folder.name}.{uuid.uuid4().hex[:8]}"
            os.rename(folder, gone)
        finally:
            os.close(lease)
        log.info("evicted cached model %s", folder.name)
        shutil.rmtree(gone, ignore_errors=True)
        return True

    def entries(self) -> list[CachedEntry]:
        from weightcache.record import ChunkRecord

        out = []
        for folder in sorted(self._folders()):
            manifest = self.stored_manifest(folder.name)
            if manifest is None:
                continue
            record = ChunkRecord(folder / "verified.log", manifest)
            try:
                verified = len(record.load())
            finally:
                record.close()
            reserved, allocated = _folder_usage(folder)
            out.append(
                CachedEntry(
                    manifest.digest, manifest.model, manifest.revision, manifest.total_bytes, reserved, allocated,
                    verified, manifest.total_chunks, _in_use(folder),
                )
            )
        return out

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _folder_usage(folder: Path) -> tuple[int, int]:
    reserved = allocated = 0
    for dirpath, _, names in os.walk(folder / "files"):
        for name in names:
            try:
                st = os.stat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            reserved += st.st_size
            allocated += min(st.st_size, st.st_blocks * 512)
    return reserved, allocated


def lease_token(fd: int) -> bytes:
    """The id of one life of a model's folder, kept in its lease file (written when the file is new;
    call with the cache lock held). A folder evicted and fetched again gets a new one: its inode
    number may well be the old one's, freed and reused."""
    token = os.pread(fd, 64, 0)
    if not token:
        token = uuid.uuid4().hex.encode()
        os.pwrite(fd, token, 0)
    return token


def _in_use(folder: Path) -> bool:
    fd = os.open(folder / "lease", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(f"{path}: the filesystem is full; free space, or put the cache on a larger disk") from None
        raise TierUnavailable(f"{path}: {err.strerror}") from None
