"""Unix-socket paths of any length, and the socket file's permissions.

``sockaddr_un`` holds at most 107 path bytes; an arena's directory can be
deeper than that (a test's temporary directory, a Kubernetes volume). A
longer path is reached through an open descriptor of its directory
(``/proc/self/fd/N/name``), which Linux resolves like the full path.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Iterator

_SUN_PATH_BYTES = 107


@contextlib.contextmanager
def _short(path: str) -> Iterator[str]:
    if len(os.fsencode(path)) <= _SUN_PATH_BYTES:
        yield path
        return
    directory, name = os.path.split(path)
    fd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{name}"
    finally:
        os.close(fd)


def bind_unix(path: str, mode: int = 0o600) -> socket.socket:
    """A stream socket bound at ``path`` (a stale file there is replaced), its file set to ``mode``.

    The mode is set right after bind; clients also prove themselves with
    the arena's token, so the instant before it is not an opening.
    """
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _short(path) as address:
            sock.bind(address)
        os.chmod(path, mode)
    except BaseException:
        sock.close()
        raise
    return sock


def connect_unix(path: str, timeout: float | None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        with _short(path) as address:
            sock.connect(address)
    except BaseException:
        sock.close()
        raise
    return sock


def set_kernel_timeouts(sock: socket.socket, seconds: float | None) -> None:
    """Bound each blocking ``recv``/``send`` on ``sock`` in the kernel (SO_RCVTIMEO/SO_SNDTIMEO).

    Python's own socket timeout makes every call a ``poll`` plus the call;
    on a busy host each extra system call costs as much as the copy of a
    small block. With kernel timeouts the socket stays blocking, one system
    call per operation, and an expired wait raises BlockingIOError (EAGAIN).
    ``None`` waits for ever.
    """
    tv = _timeval(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def set_receive_timeout(sock: socket.socket, seconds: float | None) -> None:
    """Only the receive half of :func:`set_kernel_timeouts` (a reader between chunks sends nothing)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))


def _timeval(seconds: float | None) -> bytes:
    if seconds is None:
        return struct.pack("ll", 0, 0)
    seconds = max(seconds, 0.001)  # 0 would mean "for ever"
    return struct.pack("ll", int(seconds), int((seconds % 1) * 1_000_000))
