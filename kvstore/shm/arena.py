"""One fixed-size shared-memory region that the daemon and same-host clients map.

The daemon creates the arena; a client on the same host attaches it by path
and reads or writes block bytes in place, so gRPC carries only control
messages. The arena is a plain file under a tmpfs directory (``/dev/shm`` by
default), mapped with ``mmap``.

Why not :mod:`multiprocessing.shared_memory`: on Python < 3.13 it registers
every segment it opens, even one it only attaches to, with the resource
tracker, and the tracker unlinks the segment when the attaching process
exits. A client that exits would delete the daemon's arena under it. A file
we open and map ourselves has no tracker: only :meth:`ShmArena.close` with
``unlink=True`` removes it.

Layout::

    [0, 4096)           header: magic b"STRATAAR", format version (u32),
                        16-byte random token, data size (u64), creator pid (u32),
                        16-byte arena id
    [4096, 4096 + size) data region; offsets handed to clients are relative
                        to its start

The token is random per daemon start (:meth:`ShmArena.create`, and
:meth:`ShmArena.reopen` when a restarted daemon keeps the arena its
previous run left): a client checks it against the one the daemon sent over
gRPC, so a path that names a different daemon's (or host's) file, or a
client of the previous run, is refused and attaches again. The arena id is
random per ``create`` and kept by ``reopen``: it ties the arena to its
table of committed blocks (:mod:`kvstore.shm.table`). Clients of format 1
that predate it read the header up to the pid and are not affected.

Errors, beyond :mod:`kvstore.errors`::

    StrataError
    └── ArenaMismatch    the file at the path is not the arena we were told about
"""

from __future__ import annotations

import hmac
import logging
import mmap
import os
import secrets
import struct
import threading
import time
from pathlib import Path

from kvstore.errors import StrataError, TierUnavailable

log = logging.getLogger(__name__)

HEADER_BYTES = 4096
MAGIC = b"STRATAAR"
FORMAT_VERSION = 1
TOKEN_BYTES = 16
ID_BYTES = 16
_HEADER = struct.Struct("<8sI16sQI16s")  # magic, version, token, data size, creator pid, arena id
# madvise(MADV_POPULATE_WRITE), Linux 5.14 and later: fault pages in writable without touching them.
POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
# Per madvise call. Python's madvise holds the GIL: a chunk of fresh pages stalls the process's other
# threads ~2 ms here, about what a 16 MiB copy does; a stop request waits at most one chunk too.
PREFAULT_CHUNK = 2 << 20


class ArenaMismatch(StrataError):
    """The file is not the arena the caller expected (magic, version, token or size differ)."""


class ShmArena:
    """A mapped arena file: header plus data region. Create with :meth:`create` or :meth:`attach`.

    :meth:`view` hands out memoryviews into the mapping. An mmap cannot be
    closed while any view of it is alive (``BufferError``), so every caller
    must ``release()`` its views (or let them be collected) before
    :meth:`close`. The arena keeps one base view of the data region and slices
    it, so closing releases exactly one export of its own.
    """

    def __init__(self, path: str, mapping: mmap.mmap, token: bytes, size: int, arena_id: bytes = bytes(ID_BYTES)) -> None:
        self._path = path
        self._mmap: mmap.mmap | None = mapping
        self._token = token
        self._size = size
        self._arena_id = arena_id
        self._data: memoryview | None = memoryview(mapping)[HEADER_BYTES : HEADER_BYTES + size]

    @classmethod
    def create(
        cls,
        size: int,
        directory: str = "/dev/shm",
        name: str = "strata-arena",
        *,
        mode: int = 0o600,
    ) -> ShmArena:
        """Create (replacing any stale file of the same name) and map a new arena.

        ``mode`` is the file's permission bits: clients running as another
        user need it widened (e.g. ``0o660`` with a shared group).
        """
        if size <= 0:
            raise ValueError(f"arena size must be positive, got {size}")
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"arena name {name!r} must be a plain file name")
        if not os.path.isdir(directory):
            raise TierUnavailable(
                f"shared-memory directory {directory!r} does not exist: create it "
                "or set --shm-dir to a writable tmpfs directory"
            )
        path = os.path.join(directory, name)
        total = HEADER_BYTES + size
        try:
            _remove_stale(path)
            free = _free_bytes(directory)
            if free < total:
                raise TierUnavailable(
                    f"shared-memory directory {directory!r} has {free} bytes free but the "
                    f"arena needs {total}: enlarge it (docker --shm-size), point --shm-dir "
                    "elsewhere or lower the host tier capacity"
                )
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        except OSError as e:
            raise TierUnavailable(
                f"cannot create arena {path!r}: {e.strerror or e}; set --shm-dir "
                "to a directory this process can write (a tmpfs such as /dev/shm)"
            ) from e
        token = secrets.token_bytes(TOKEN_BYTES)
        arena_id = secrets.token_bytes(ID_BYTES)
        try:
            os.ftruncate(fd, total)
            mapping = mmap.mmap(fd, total)
            _HEADER.pack_into(mapping, 0, MAGIC, FORMAT_VERSION, token, size, os.getpid(), arena_id)
        except OSError as e:
            os.unlink(path)
            raise TierUnavailable(f"cannot map arena {path!r}: {e.strerror or e}; check --shm-dir") from e
        finally:
            os.close(fd)  # the mapping keeps its own reference to the file
        log.info("created arena %s (%d data bytes)", path, size)
        return cls(path, mapping, token, size, arena_id)

    @classmethod
    def reopen(cls, path: str, size: int) -> ShmArena:
        """Map, as its new owner, the arena a previous run of this daemon left at ``path``.

        The bytes stay; the token is new, so clients of the previous run are
        refused at their next Hello and attach again. Raises
        FileNotFoundError when there is no file, ArenaMismatch (saying why)
        when the file cannot be kept: another format, another size, written
        by a version that kept no arena id, or owned by another user.
        """
        fd = os.open(path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid():
                raise ArenaMismatch(f"{path!r} belongs to uid {st.st_uid}, not this daemon's {os.geteuid()}")
            if st.st_size < HEADER_BYTES:
                raise ArenaMismatch(f"{path!r} is {st.st_size} bytes, too short to be an arena")
            magic, version, _, file_size, _, arena_id = _HEADER.unpack(os.pread(fd, _HEADER.size, 0))
            if magic != MAGIC or version != FORMAT_VERSION:
                raise ArenaMismatch(f"{path!r} has arena format {version} (magic {magic!r}); this daemon writes {FORMAT_VERSION}")
            if file_size != size or st.st_size != HEADER_BYTES + size:
                raise ArenaMismatch(f"{path!r} holds {file_size} data bytes; the RAM tier is now configured for {size}")
            if arena_id == bytes(ID_BYTES):
                raise ArenaMismatch(f"{path!r} was written by a version that kept no table of its blocks")
            mapping = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        token = secrets.token_bytes(TOKEN_BYTES)
        _HEADER.pack_into(mapping, 0, MAGIC, FORMAT_VERSION, token, size, os.getpid(), arena_id)
        return cls(path, mapping, token, size, arena_id)

    @classmethod
    def attach(cls, path: str, token: bytes) -> ShmArena:
        """Map an existing arena read/write after checking that it is the expected one.

        Raises :class:`ArenaMismatch` when the header does not match;
        FileNotFoundError (and other OSErrors) pass through so a client can
        fall back to streamed bytes.
        """
        fd = os.open(path, os.O_RDWR)
        try:
            file_bytes = os.fstat(fd).st_size
            if file_bytes < HEADER_BYTES:
                raise ArenaMismatch(f"{path!r} is {file_bytes} bytes, too short to be an arena")
            magic, version, file_token, size, pid, _ = _HEADER.unpack(os.pread(fd, _HEADER.size, 0))
            if magic != MAGIC:
                raise ArenaMismatch(f"{path!r} is not a Strata arena (magic {magic!r})")
            if version != FORMAT_VERSION:
                raise ArenaMismatch(
                    f"{path!r} has arena format {version}; this client reads {FORMAT_VERSION}: "
                    "upgrade the client or the daemon so they match"
                )
            if not hmac.compare_digest(file_token, bytes(token)):
                raise ArenaMismatch(
                    f"{path!r} belongs to another daemon (token differs; creator pid {pid}): "
                    "the daemon restarted or the path names another host's file"
                )
            if HEADER_BYTES + size != file_bytes:
                raise ArenaMismatch(f"{path!r} header says {size} data bytes but the file is {file_bytes} bytes")
            mapping = mmap.mmap(fd, file_bytes)
        finally:
            os.close(fd)
        return cls(path, mapping, bytes(token), size)

    @property
    def path(self) -> str:
        return self._path

    @property
    def token(self) -> bytes:
        return self._token

    @property
    def arena_id(self) -> bytes:
        """Random per :meth:`create`, kept by :meth:`reopen`: names this arena's table."""
        return self._arena_id

    @property
    def size(self) -> int:
        """Bytes in the data region."""
        return self._size

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def unbacked_bytes(self) -> int:
        """Bytes of the file its filesystem has not allocated yet: pages no one has written.

        The file is sparse; a first write into one of these pages needs a free page of the
        tmpfs, and a page fault that finds none is SIGBUS. What else shares the directory (the
        block table) keeps this much free.
        """
        st = os.stat(self._path)
        return max(0, st.st_size - st.st_blocks * 512)

    def view(self, offset: int, length: int) -> memoryview:
        """A writable view of ``[offset, offset + length)`` of the data region. Release it when done."""
        if self._data is None:
            raise ValueError(f"arena {self._path!r} is closed")
        if offset < 0 or length < 0 or offset + length > self._size:
            raise ValueError(f"range [{offset}, {offset + length}) is outside the arena's {self._size} data bytes")
        return self._data[offset : offset + length]

    def prefault(self, start: int = 0, length: int | None = None) -> None:
        """Fault in ``[start, start + length)`` of the data region writable (``MADV_POPULATE_WRITE``)
        without changing a byte: the tmpfs allocates the pages it has not yet, and this process's page
        tables map them. A first write into an unfaulted page costs a fault and a zeroed page, on a VM
        ten times the copy of the page; a populated page costs nothing. OSError where the kernel cannot
        (before 5.14: EINVAL) or the tmpfs has no room left (the range is then partly populated)."""
        if self._mmap is None:
            raise ValueError(f"arena {self._path!r} is closed")
        length = self._size - start if length is None else length
        self._mmap.madvise(POPULATE_WRITE, HEADER_BYTES + start, length)

    def release_pages(self, start: int, length: int) -> None:
        """Give the tmpfs pages of ``[start, start + length)`` back (``MADV_REMOVE``: the file gets a hole
        there, which reads as zeros): for extents that hold no block, in an arena kept for the next start.
        OSError where the file system cannot punch holes."""
        if self._mmap is None:
            raise ValueError(f"arena {self._path!r} is closed")
        self._mmap.madvise(mmap.MADV_REMOVE, HEADER_BYTES + start, length)

    def close(self, unlink: bool = False) -> None:
        """Unmap the arena and, when ``unlink``, remove its file. Safe to call twice.

        The file is unlinked first, so a leaked view cannot keep the name
        around. Raises BufferError, leaving the arena mapped, while views from
        :meth:`view` are still alive.
        """
        if unlink:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
        if self._mmap is None:
            return
        assert self._data is not None
        self._data.release()
        try:
            self._mmap.close()
        except BufferError:
            self._data = memoryview(self._mmap)[HEADER_BYTES : HEADER_BYTES + self._size]
            raise BufferError(
                f"arena {self._path!r} still has views exported: release every view() before close()"
            ) from None
        self._mmap = None
        self._data = None

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"ShmArena({self._path!r}, size={self._size}, {state})"


class Prefault:
    """Faults every page of an arena in, a chunk at a time, on a thread of its own (see
    :meth:`ShmArena.prefault`), so the writes that fill the arena find their pages ready. Stop it
    before the arena closes."""

    def __init__(self, arena: ShmArena, chunk: int = PREFAULT_CHUNK) -> None:
        self._arena = arena
        self._chunk = chunk
        self._stop = threading.Event()
        self.done_bytes = 0
        self._thread = threading.Thread(target=self._run, name="strata-prefault", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0, size = time.monotonic(), self._arena.size
        while self.done_bytes < size and not self._stop.is_set():
            length = min(self._chunk, size - self.done_bytes)
            try:
                self._arena.prefault(self.done_bytes, length)
            except (OSError, ValueError) as err:
                log.warning("arena %s: stopped faulting its pages in after %d MiB (%s); the rest are faulted "
                            "at their first write, which costs the puts that make it (set ram.prefault = false "
                            "to not try)", self._arena.path, self.done_bytes >> 20, err)
                return
            self.done_bytes += length
            time.sleep(0)  # the GIL to whoever waited on it
        if self.done_bytes == size:
            log.debug("arena %s: %d MiB faulted in, in %.1f s", self._arena.path, size >> 20, time.monotonic() - t0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def filesystem_of(path: str | os.PathLike) -> str:
    """The filesystem type mounted at ``path`` (from /proc/mounts), or ``"unknown"``."""
    path = Path(path).resolve()
    best, fstype = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > len(best):
                    best, fstype = mount, fields[2]
    except OSError:
        pass
    return fstype


def _remove_stale(path: str) -> None:
    """Unlink a file left by a daemon that died; processes still mapping it keep their copy."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    log.warning("removed stale arena file %s", path)


def _free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize
