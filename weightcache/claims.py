"""Claims: which process on this host is fetching which chunk of a cached model, right now.

Two engine processes on one node (two tensor-parallel ranks, or two
replicas) open the same model into the same cache. Each claims a chunk
before fetching it, with an open-file-description lock on one byte of the
model's ``claims`` file (byte ``i`` for the model's ``i``-th chunk): a
claim held by another process means "it is coming; watch the record", so
the chunk is fetched once per node, not once per process. The kernel drops
a process's claims when it dies, so a chunk claimed by a process killed
mid-download is free again at once and another process takes it over.

OFD locks (Linux ``F_OFD_SETLK``) belong to the open file, not the process,
so two openers in one process exclude each other too, and closing some
other descriptor of the file does not drop them (classic POSIX locks would
do both wrong). Where the platform has no OFD locks, every claim succeeds:
processes then fetch overlapping chunks twice, which costs requests, never
correctness (a chunk is verified and recorded the same way by each).
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct

_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", None)
_FLOCK = struct.Struct("hhqqi4x")  # struct flock on Linux: type, whence, start, len, pid (0 for OFD)


class Claims:
    def __init__(self, path: str | os.PathLike) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def try_claim(self, index: int) -> bool:
        """Claim chunk ``index``; False when another opener holds it."""
        if _OFD_SETLK is None:
            return True
        try:
            fcntl.fcntl(self._fd, _OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, index, 1, 0))
        except OSError as err:
            if err.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def release(self, index: int) -> None:
        if _OFD_SETLK is not None and self._fd >= 0:
            fcntl.fcntl(self._fd, _OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, index, 1, 0))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
