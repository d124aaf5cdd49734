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
