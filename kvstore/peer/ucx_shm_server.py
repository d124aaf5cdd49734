"""The daemon's UCX shared-memory peer listener (``--peer-ucx-shm``): the peer server's requests to daemons on this host.

Every request is served by :class:`~kvstore.peer.server.PeerServer`'s code,
over the link :class:`~kvstore.peer.ucx_server.UcxPeerServer` uses (a BLOCK
reply's bytes leave as one tag message straight from the arena mapping; a
PUT's blocks land by tag receives posted into the reserved slots); only
the way in differs. Readers connect to an abstract Unix socket (the port of
``ucx-shm://<host id>:<port>``, picked at random among the free ones unless
given), and the handshake of :mod:`kvstore.peer.ucx_shm_link` exchanges the
workers' addresses; that socket then stays open as the connection's
lifeline, so a reader that dies, or shuts its connection to cancel a read,
ends the serving thread's wait at once and its leases and slots are given
back, not held until the idle limit.

Reach: only processes in this host's network namespace can connect to an
abstract socket, and both sides refuse another user (``SO_PEERCRED``), so
no protected-mode rule applies; the Hello's token is checked as over TCP.
A listener full at ``--peer-max-connections`` answers the handshake with
``Overloaded`` and a retry delay.
"""

from __future__ import annotations

import errno
import itertools
import logging
import random
import socket
import threading

from kvstore.errors import InvalidArgument, Overloaded, StrataError, TierUnavailable
from kvstore.peer import wire
from kvstore.peer.server import REFUSE_RETRY_S
from kvstore.peer.ucx_server import UcxPeerServer
from kvstore.peer.ucx_shm_link import (
    HANDSHAKE_VERSION, ShmLink, UcxShmRuntime, check_peer_uid, host_id, read_handshake, send_handshake, socket_name,
)
from kvstore.rpc.status import code_for
from kvstore.wire.listeners import accept_loop, stop_listening

log = logging.getLogger(__name__)

__all__ = ["UcxShmPeerServer"]

PORTS = (1024, 65535)
BIND_TRIES = 64


class UcxShmPeerServer(UcxPeerServer):
    """Serves a store group's blocks to daemons on this host over UCX shared memory. :meth:`start`, then :meth:`stop`.
    ``listen``: the port to take, as text ("" or "0": a free one at random)."""

    def start(self) -> UcxShmPeerServer:
        self._runtime = UcxShmRuntime.get()
        self._serial = itertools.count(1)
        wanted = int(self._listen or 0)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            for _ in range(1 if wanted else BIND_TRIES):
                port = wanted or random.randint(*PORTS)
                try:
                    sock.bind(socket_name(port))
                    break
                except OSError as err:
                    if err.errno != errno.EADDRINUSE or wanted:
                        raise
            else:
                raise OSError(errno.EADDRINUSE, f"no free port after {BIND_TRIES} tries")
            sock.listen(128)
        except BaseException:
            sock.close()
            raise
        self._listener = sock
        self.port = port
        self.address = f"ucx-shm://{host_id()}:{port}"
        self._acceptor = threading.Thread(target=self._accept_loop, name="strata-peer-shm-accept", daemon=True)
        self._acceptor.start()
        log.info("UCX shared-memory peer data plane on %s (port %d)", self.address, port)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        stop_listening(self._listener, self._acceptor, self._connections.close(), timeout)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        accept_loop(self._listener, self._connections, name="strata-peer-ucx-shm",
                    serve=lambda conn, _: self._connect(conn), refuse=self._refuse_handshake, refuse_on_thread=True)

    def _answer(self, conn: socket.socket, err: StrataError) -> None:
        self._metrics.rpc_errors.labels("PeerHello", code_for(err).name).inc()
        try:
            send_handshake(conn, [wire.ERROR, wire.error_result(err)])
        except OSError:
            pass  # the reader went away first

    def _refuse_handshake(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(1.0)
            read_handshake(conn)
            self._answer(conn, Overloaded(
                f"the UCX shared-memory listener serves at most {self._max_connections} connections "
                "(--peer-max-connections): retry after the delay, or read from another holder",
                retry_after_s=REFUSE_RETRY_S,
            ))
        except (OSError, EOFError, StrataError):
            pass
        finally:
            conn.close()

    def _connect(self, conn: socket.socket) -> None:
        """The handshake, then the connection's requests until it ends (on its own thread)."""
        link = None
        try:
            link = self._handshake(conn)
            if link is not None:
                if self._connections.swap(conn, link):
                    self._serve(link, ("ucx-shm", next(self._serial)))
                else:
                    link.close()  # stopping
        finally:
            if link is None:
                conn.close()

    def _handshake(self, conn: socket.socket) -> ShmLink | None:
        conn.settimeout(self._hello_s)
        try:
            check_peer_uid(conn, "UCX shared-memory reader")
            request = read_handshake(conn)
        except PermissionError as err:
            log.warning("refused a UCX shared-memory connection: %s", err)
            return None
        except (OSError, EOFError):
            return None  # the reader went away, or stopping
        except (StrataError, wire.FrameError) as err:
            self._answer(conn, InvalidArgument(str(err)))
            return None
        try:
            version, conn_id, address = request if len(request) == 3 else (None, None, None)
            if version != HANDSHAKE_VERSION:
                raise InvalidArgument(
                    f"UCX shared-memory handshake {version!r} is not this daemon's {HANDSHAKE_VERSION}: "
                    "run the same Strata release on both daemons"
                )
            if not (isinstance(conn_id, int) and 0 < conn_id < 1 << 63 and not conn_id & 1 and isinstance(address, bytes)):
                raise InvalidArgument("a malformed UCX shared-memory handshake (connection id or worker address)")
            try:
                ep = self._runtime.call(self._runtime.endpoint(address), self._hello_s)
            except Exception as err:  # noqa: BLE001 - every way UCX refuses an address (unreachable, malformed)
                raise TierUnavailable(f"cannot reach the reader's UCX worker ({type(err).__name__}: {err})") from None
            try:
                send_handshake(conn, [wire.OK, self._runtime.address])
                return ShmLink(self._runtime, ep, conn, send_tag=conn_id + 1, recv_tag=conn_id)
            except BaseException:
                self._runtime.loop.call_soon_threadsafe(ep.abort)
                raise
        except StrataError as err:
            self._answer(conn, err)
            return None
        except OSError:
            return None
