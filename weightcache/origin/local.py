"""A local directory as an origin: a plain folder, or a Hugging Face cache repo.

Two layouts are understood:

- a plain folder of files (``/models/llama-3-8b``), its revision the
  folder's name unless the publisher names one;
- the Hugging Face hub cache (``~/.cache/huggingface/hub/models--org--name``):
  ``refs/<branch>`` holds a commit, ``snapshots/<commit>/`` the files as
  symlinks into ``blobs/``. Given the repo folder and a revision (a branch or
  a commit; default ``main``), or a snapshot folder itself, the origin is that
  snapshot and its revision the commit.

Symlinks are followed, but only to files inside the repo (or the folder):
a manifest path can never make the daemon read ``/etc/shadow``. Reads run
in a bounded thread pool with a bounded cache of open files; each read
fills the caller's buffer (``preadv``), so no memory is allocated per chunk.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvstore.errors import DiskFull, InvalidArgument
from weightcache.errors import ManifestError, ManifestMismatch, OriginUnavailable, quoted
from weightcache.origin.base import CATALOG_DIR, Origin

MAX_OPEN_FILES = 256
READ_THREADS = 16
NAME_MAX = 255  # bytes of one path component (Linux's NAME_MAX, and most filesystems')
PATH_MAX = 4096  # bytes of a whole path (Linux's PATH_MAX)


class LocalOrigin(Origin):
    def __init__(self, root: Path, fence: Path, revision: str) -> None:
        self.root = root
        self.fence = fence.resolve()
        self.location = str(root)
        self.default_revision = revision
        hf = fence.name.startswith("models--") and fence != root
        self.default_model = "/".join(fence.name.split("--")[1:]) if hf else root.name
        self._pool = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="weights-local")
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def open(cls, path: str | os.PathLike, revision: str | None = None) -> LocalOrigin:
        try:
            return cls._open(Path(path).expanduser(), revision)
        except OSError as err:  # a stat, a ref's read or a listing refused: not a path this host can use
            raise InvalidArgument(_unusable(str(path), err)) from None
        except RuntimeError:  # expanduser: "~name" of no user here
            raise InvalidArgument(f"model location {quoted(str(path))} names the home of a user this host does "
                                  "not know: give the path itself") from None

    @classmethod
    def _open(cls, p: Path, revision: str | None) -> LocalOrigin:
        if not p.is_dir():
            raise InvalidArgument(f"model location {quoted(str(p))} is not a directory")
        if (p / "snapshots").is_dir():  # a Hugging Face repo folder
            rev = revision or "main"
            ref = p / "refs" / rev
            commit = ref.read_text().strip() if ref.is_file() else rev
            snapshot = p / "snapshots" / commit
            if not snapshot.is_dir():
                known = sorted(x.name for x in (p / "snapshots").iterdir())
                raise InvalidArgument(
                    f"{p}: no snapshot for revision {quoted(rev)}; snapshots here: {', '.join(known) or 'none'}")
            return cls(snapshot, p, commit)
        if p.parent.name == "snapshots":  # a snapshot folder of one
            if revision not in (None, p.name):
                raise InvalidArgument(f"{p} is the snapshot of revision {p.name}, not {quoted(revision)}")
            return cls(p, p.parent.parent, p.name)
        return cls(p, p, revision or p.name)

    async def list_files(self, catalog: bool = False) -> list[tuple[str, int]]:
        return await self._run(self._list, catalog)

    def _list(self, catalog: bool) -> list[tuple[str, int]]:
        out = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            rel_dir = os.path.relpath(dirpath, self.root)
            if rel_dir == ".":
                dirnames[:] = [d for d in dirnames if (d == CATALOG_DIR) == catalog]
                if catalog:
                    continue
            for name in filenames:
                rel = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
                full = self._inside(rel)
                if full.is_file():
                    out.append((rel, full.stat().st_size))
        return sorted(out)

    async def read(self, path: str, start: int, length: int, into: memoryview) -> memoryview:
        return await self._run(self._read, path, start, length, into)

    def _read(self, path: str, start: int, length: int, into: memoryview) -> memoryview:
        fd, cached = self._fd(path)
        view = into[:length]
        done = 0
        try:
            while done < length:
                n = os.preadv(fd, [view[done:]], start + done)
                if n == 0:
                    raise ManifestMismatch(
                        f"{self.where(path)}: ends at byte {start + done}, but its manifest expects {length} bytes "
                        f"from {start}: the file changed since publishing; publish again (strata weights publish)"
                    )
                done += n
        except OSError as err:
            raise OriginUnavailable(f"{self.where(path)}: read failed: {err.strerror}") from None
        finally:
            if not cached:
                os.close(fd)
        return view

    def _fd(self, path: str) -> tuple[int, bool]:
        """An open descriptor, and whether it is kept open (the first MAX_OPEN_FILES files are; a
        descriptor in the cache is never closed while the origin is open, so no read can race a close)."""
        with self._lock:
            fd = self._fds.get(path)
        if fd is not None:
            return fd, True
        full = self._inside(path)
        try:
            fd = os.open(full, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ManifestMismatch(
                f"{self.where(path)} is gone: the origin no longer holds what its manifest lists; publish again"
            ) from None
        except OSError as err:
            raise OriginUnavailable(f"{self.where(path)}: cannot open: {err.strerror}") from None
        with self._lock:
            if path in self._fds:
                os.close(fd)
                return self._fds[path], True
            if len(self._fds) < MAX_OPEN_FILES:
                self._fds[path] = fd
                return fd, True
        return fd, False

    def _inside(self, path: str) -> Path:
        full = (self.root / path).resolve()
        if os.path.commonpath([full, self.fence]) != str(self.fence):
            raise ManifestMismatch(f"{self.where(path)} leads outside {self.fence} (a symlink): refused")
        return full

    async def get(self, path: str, limit: int) -> bytes | None:
        return await self._run(self._get, path, limit)

    def _get(self, path: str, limit: int) -> bytes | None:
        try:
            with open(self._inside(path), "rb") as f:
                data = f.read(limit + 1)
        except FileNotFoundError:
            return None
        if len(data) > limit:
            raise ManifestError(f"{self.where(path)} is over {limit} bytes")
        return data

    async def put(self, path: str, data: bytes) -> None:
        await self._run(self._put, path, data)

    def _put(self, path: str, data: bytes) -> None:
        full = self.root / path
        full.parent.mkdir(parents=True, exist_ok=True)
        tmp = full.with_name(f".{full.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, full)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            if err.errno == errno.ENOSPC:
                raise DiskFull(f"{self.where(path)}: the filesystem is full") from None
            raise OriginUnavailable(f"{self.where(path)}: cannot write: {err.strerror}") from None

    async def _run(self, fn, *args):
        if self._closed:
            raise OriginUnavailable(f"origin {self.location} is closed")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def _unusable(location: str, err: OSError) -> str:
    """Why the OS refused ``location`` (or a path under it: a revision's ref) as a path, and what a usable one is."""
    where = f"model location {quoted(location)}"
    if err.errno == errno.ENAMETOOLONG:
        path = os.fsencode(err.filename if err.filename is not None else location)
        longest = max(path.split(b"/"), key=len)
        if len(longest) > NAME_MAX:
            return (f"{where}: a path component of {len(longest)} bytes is over the {NAME_MAX}-byte limit on a file "
                    "or folder name: give the model's directory (and a revision that is a branch or a commit)")
        return (f"{where}: a path of {len(path)} bytes is over this host's {PATH_MAX}-byte limit: give the model's "
                "directory")
    return f"{where} cannot be used here: {err.strerror}: give a directory this node can read"
