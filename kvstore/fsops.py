"""The file-system calls of the disk tier and the node identity, behind one object.

:class:`FileOps` is the real thing: each method *is* the ``os`` function
of the same name (a ``staticmethod`` alias, so production pays one attribute
lookup and nothing else). :class:`FaultyFileOps` is the same calls with
faults injected, for sweeps in the style of SQLite's I/O-error tests: the
Nth write, fsync, rename or unlink fails with the errno chosen (``EIO``,
``ENOSPC``), once or from then on, while every other call reaches the real
file system. The disk tier under test is the real one on real files; only
the one call fails, as a failing device or a full filesystem would make it.

The methods are the calls the disk tier and :mod:`kvstore.node` make, and
no others: a new call there goes through here too, so a sweep reaches it.
"""

from __future__ import annotations

import errno as errnos
import fcntl
import os
from collections import Counter
from dataclasses import dataclass


class FileOps:
    """The real file system: every method is the ``os`` (or ``fcntl``) call of its name."""

    open = staticmethod(os.open)
    close = staticmethod(os.close)
    read = staticmethod(os.read)
    readv = staticmethod(os.readv)
    write = staticmethod(os.write)
    writev = staticmethod(os.writev)
    fsync = staticmethod(os.fsync)
    fstat = staticmethod(os.fstat)
    utime = staticmethod(os.utime)
    replace = staticmethod(os.replace)
    unlink = staticmethod(os.unlink)
    mkdir = staticmethod(os.mkdir)
    listdir = staticmethod(os.listdir)
    scandir = staticmethod(os.scandir)
    statvfs = staticmethod(os.statvfs)
    ftruncate = staticmethod(os.ftruncate)
    flock = staticmethod(fcntl.flock)

    def free_bytes(self, path: str | os.PathLike) -> int:
        """Bytes an unprivileged writer can still add to the filesystem holding ``path``."""
        st = self.statvfs(path)
        return st.f_bavail * st.f_frsize


REAL = FileOps()

# The kinds a sweep fails, and the calls each one counts.
KINDS: dict[str, tuple[str, ...]] = {
    "open": ("open",),
    "read": ("read", "readv"),
    "write": ("write", "writev"),
    "fsync": ("fsync",),
    "rename": ("replace",),
    "unlink": ("unlink",),
    "mkdir": ("mkdir",),
    "utime": ("utime",),
}


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    nth: int  # the first call of ``kind`` that fails, counted from 1
    errno: int = errnos.EIO
    persist: bool = False  # every later call of ``kind`` fails too (a device gone bad, a disk that stays full)


class FaultyFileOps(FileOps):
    """The real calls, except the ones a :class:`Fault` picks, which raise ``OSError(errno)``.

    A failing write first writes half of what it was given, as a device
    that fills mid-write does (``write`` and ``writev`` may stop short in
    reality too): what is left behind is a torn file, which nothing may
    ever serve. Other failing calls have no effect. ``calls`` counts every
    call by kind, failed or not; ``injected`` lists the faults raised as
    (kind, call number, path or fd).
    """

    def __init__(self, *faults: Fault) -> None:
        for fault in faults:
            if fault.kind not in KINDS:
                raise ValueError(f"unknown fault kind {fault.kind!r}: pick one of {', '.join(KINDS)}")
        self.faults = list(faults)
        self.calls: Counter[str] = Counter()
        self.injected: list[tuple[str, int, object]] = []

    def _failing(self, kind: str, target: object) -> OSError | None:
        self.calls[kind] += 1
        n = self.calls[kind]
        for fault in self.faults:
            if fault.kind == kind and (n == fault.nth or (fault.persist and n > fault.nth)):
                self.injected.append((kind, n, target))
                return OSError(fault.errno, f"injected: {kind} call {n} fails ({os.strerror(fault.errno)})", str(target))
        return None

    def _checked(self, kind: str, target: object) -> None:
        err = self._failing(kind, target)
        if err is not None:
            raise err

    def open(self, path, flags, mode=0o777, *, dir_fd=None):
        self._checked("open", path)
        return os.open(path, flags, mode)

    def read(self, fd, n):
        self._checked("read", fd)
        return os.read(fd, n)

    def readv(self, fd, buffers):
        self._checked("read", fd)
        return os.readv(fd, buffers)

    def write(self, fd, data):
        err = self._failing("write", fd)
        if err is not None:
            with memoryview(data) as view:
                os.write(fd, view[: len(view) // 2])
            raise err
        return os.write(fd, data)

    def writev(self, fd, buffers):
        err = self._failing("write", fd)
        if err is not None:
            torn = b"".join(bytes(b) for b in buffers)
            os.write(fd, torn[: len(torn) // 2])
            raise err
        return os.writev(fd, buffers)

    def fsync(self, fd):
        self._checked("fsync", fd)
        return os.fsync(fd)

    def utime(self, path, *args, **kwargs):
        self._checked("utime", path)
        return os.utime(path, *args, **kwargs)

    def replace(self, src, dst):
        self._checked("rename", dst)
        return os.replace(src, dst)

    def unlink(self, path):
        self._checked("unlink", path)
        return os.unlink(path)

    def mkdir(self, path, mode=0o777):
        self._checked("mkdir", path)
        return os.mkdir(path, mode)
