"""UCX shared memory between daemons on one host: its own worker, the handshake, and a link with a lifeline.

UCX moves bytes between processes of one host through shared memory
(``sysv``/``posix`` segments for messages, ``cma`` — the kernel copying
straight from one process's memory into the other's — for large ones),
but only on endpoints made from the other worker's address with endpoint
error handling off on both sides; ucxx's listener does neither. So:

- **Its own worker** (:class:`UcxShmRuntime`): a second ucxx context whose
  transports are fixed to ``sm,self`` (config, not the environment: an
  operator's ``UCX_TLS`` does not reach it), so an endpoint of it moves
  bytes over shared memory or fails; it never falls back to tcp. ucxx
  progresses one context per event loop, so it has its own loop thread.
- **The handshake** over a Unix socket in the abstract namespace,
  ``\\0strata-peer-ucx-shm:<port>`` (the port is what the daemon advertises,
  ``ucx-shm://<host id>:<port>``): the reader sends ``[version, connection
  id, its worker address]``, the holder answers ``[OK, its worker address]``
  (or ``[ERROR, error]``: full, a bad request), and each side makes an
  endpoint from the other's address. The connection id names the link's
  two tags (reader to holder: the id; back: the id + 1), unique on each
  worker. Both sides check the other's uid (``SO_PEERCRED``): the same
  user only, as CMA itself needs, so another user on the host never gets a
  connection, let alone the bearer token the Hello carries.
- **A lifeline**: the Unix socket stays open for as long as the link.
  Endpoint error handling is off, so UCX never reports a dead peer: a
  request to it waits for ever. The kernel closes a process's sockets when
  it dies, SIGKILL included, so the UCX thread watches the lifeline
  (``add_reader``) and aborts the endpoint the moment it reads EOF (or
  anything: nothing else is ever sent on it); the waiting call then fails
  at once with ``ConnectionError``, as a TCP connection reset does, well
  within its deadline. A clean close, or a shutdown for a cancellation,
  shuts the lifeline too, so the other side stops waiting on requests that
  will never be answered (a holder mid-send frees its leases). Every wait
  still has its deadline (the link's timeout), for a peer that lives but
  stalls.

The host identity (:func:`host_id`) is what makes the address meaningful on
one host only: a digest of the boot id and the IPC, mount, PID and network
namespaces this process runs in (what shared memory, CMA and the abstract
socket each need to be the same), so a daemon on another host, or in
another container, never tries it.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import secrets
import socket
import struct

from kvstore.errors import InvalidArgument
from kvstore.peer import wire
from kvstore.peer.ucx_link import UcxLink, UcxRuntime

log = logging.getLogger(__name__)

__all__ = [
    "HANDSHAKE_VERSION", "MAX_HANDSHAKE_BYTES", "SHM_TLS", "SHM_TRANSPORTS", "ShmLink", "UcxShmRuntime",
    "check_peer_uid", "host_id", "new_connection_id", "read_handshake", "send_handshake", "socket_name",
]

SHM_TLS = "sm,self"
HANDSHAKE_VERSION = 1
MAX_HANDSHAKE_BYTES = 4096  # a worker address of these transports is ~150 bytes
SHM_TRANSPORTS = frozenset({"posix", "sysv", "cma", "knem", "xpmem", "self"})
_NAMESPACES = ("ipc", "mnt", "pid", "net")


@functools.cache
def host_id() -> str:
    """This host (and container) as 16 hex digits; equal for two processes only where UCX shared
    memory and the abstract Unix socket can reach from one to the other."""
    parts = []
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append(socket.gethostname())
    for ns in _NAMESPACES:
        try:
            parts.append(os.readlink(f"/proc/self/ns/{ns}"))
        except OSError:
            parts.append(f"{ns}:?")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def socket_name(port: int) -> bytes:
    """The abstract Unix socket a holder's handshake listens on (per network namespace)."""
    return b"\0strata-peer-ucx-shm:%d" % port


def check_peer_uid(sock: socket.socket, what: str) -> None:
    """Refuse a process of another user on the other end of ``sock``."""
    _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid != os.getuid():
        raise PermissionError(
            f"the {what} runs as uid {uid}, this daemon as uid {os.getuid()}: UCX shared memory connects "
            "daemons of one user only; run both as one user, or use the tcp peer transport"
        )


def send_handshake(sock: socket.socket, meta) -> None:
    sock.sendall(wire.encode(meta))


def read_handshake(sock: socket.socket) -> list:
    """One handshake frame (a list), within :data:`MAX_HANDSHAKE_BYTES`."""
    meta, payload = wire.Wire(sock, max_meta=MAX_HANDSHAKE_BYTES).read_meta()
    if payload or not isinstance(meta, list):
        raise wire.FrameError("a malformed UCX shared-memory handshake: run the same Strata release on both daemons")
    return meta


class UcxShmRuntime(UcxRuntime):
    """The process's shared-memory ucxx worker (transports ``sm,self`` only) and its loop thread."""

    _instance: UcxShmRuntime | None = None
    thread_name = "strata-ucx-shm"
    options = {"TLS": SHM_TLS}

    def _start_worker(self) -> None:
        super()._start_worker()
        self.address = self.context.worker_address.tobytes()
        if len(self.address) > MAX_HANDSHAKE_BYTES // 2:
            raise InvalidArgument(f"the shared-memory worker's address is {len(self.address)} bytes, more than the handshake takes")
        if not self.transports() & {"posix", "sysv", "cma", "knem", "xpmem"}:
            raise InvalidArgument(f"UCX has no shared-memory transport here (it offers {sorted(self.transports())})")

    async def endpoint(self, address: bytes):
        """An endpoint to the worker at ``address``, error handling off (what shared memory needs)."""
        return await self.context.create_endpoint_from_worker_address(
            self.ucxx.get_ucx_address_from_buffer(address), endpoint_error_handling=False,
        )


class ShmLink(UcxLink):
    """A :class:`UcxLink` over a shared-memory endpoint, aborted when its lifeline ends (see the module)."""

    def __init__(self, runtime: UcxShmRuntime, endpoint, lifeline: socket.socket, *, send_tag: int, recv_tag: int) -> None:
        super().__init__(runtime, endpoint, send_tag=send_tag, recv_tag=recv_tag)
        self.lifeline = lifeline
        self.peer_gone = False
        lifeline.setblocking(False)
        watched = asyncio.run_coroutine_threadsafe(self._watch(), runtime.loop)
        watched.result(5)

    async def _watch(self) -> None:
        self._rt.loop.add_reader(self.lifeline.fileno(), self._on_lifeline)

    def _on_lifeline(self) -> None:
        """On the UCX thread: the other side closed its end, or its process ended."""
        try:
            self.lifeline.recv(1)
        except BlockingIOError:
            return  # woken for nothing
        except OSError:
            pass
        self.peer_gone = True
        self._abort()

    def _closed_why(self) -> str:
        if self.peer_gone:
            return "the shared-memory peer closed the connection or its process ended"
        return "the UCX shared-memory endpoint is closed"

    def _abort_endpoint(self) -> None:
        try:
            self._rt.loop.remove_reader(self.lifeline.fileno())
        except (OSError, ValueError):
            pass  # closed already
        try:
            self.lifeline.shutdown(socket.SHUT_RDWR)  # the other side stops waiting on us at once
        except OSError:
            pass
        super()._abort_endpoint()

    def close(self) -> None:
        self._abort()
        self.lifeline.close()


def new_connection_id() -> int:
    """A link's id: its two tags are the id (reader to holder) and the id + 1 (back)."""
    return (secrets.randbits(63) | 1 << 62) & ~1
