"""The daemon's UCX peer listener (``--peer-ucx-listen``): the TCP peer server's requests over ucxx.

Every request is served by :class:`~kvstore.peer.server.PeerServer`'s own
code (the Hello with its token and policy, READ leasing blocks in the
arena, PUT receiving into reserved slots, CHECK, the limits and their
refusals); only the link under it differs (:mod:`kvstore.peer.ucx_link`):
a BLOCK reply's bytes leave as one tag message straight from the arena
mapping, and a PUT's blocks are received by tag receives posted into the
slots the store reserved. As over TCP, one thread serves one endpoint's
requests in order, waiting on the UCX thread with the GIL released.

ucxx's listener binds its port on every interface (it takes a port, not an
address): the host of ``--peer-ucx-listen`` only names what is advertised,
so the daemon's protected mode treats the listener as reachable from
anywhere. UCX's listener connects over TCP sockets; the data then moves
over the UCX transports both ends share (``UCX_TLS``; TCP, or RDMA verbs
with a UCX built with them).
"""

from __future__ import annotations

import itertools
import logging
import threading

from kvstore.peer import wire
from kvstore.peer.server import PeerServer
from kvstore.peer.ucx_link import UcxLink, UcxRuntime
from kvstore.wire.listeners import Admission

log = logging.getLogger(__name__)

__all__ = ["UcxPeerServer"]


class UcxPeerServer(PeerServer):
    """Serves a store group's blocks to other daemons over UCX. :meth:`start`, then :meth:`stop`."""

    scheme = "ucx"

    def start(self) -> UcxPeerServer:
        _, _, port = self._listen.rpartition(":")
        self._runtime = UcxRuntime.get()
        self._serial = itertools.count(1)

        async def listen():
            return self._runtime.context.create_listener(self._accepted, port=int(port), endpoint_error_handling=True)

        self._listener = self._runtime.call(listen(), 30)
        self.port = self._listener.port
        log.info("UCX peer data plane on %s (port %d)", self._listen, self.port)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        conns = self._connections.close()
        if self._listener is not None:
            listener, self._listener = self._listener, None

            async def close():
                listener.close()

            try:
                self._runtime.call(close(), timeout)
            except Exception as err:  # noqa: BLE001 - stopping: report, go on
                log.warning("the UCX listener did not close cleanly: %s", err)
        for link, _ in conns:
            link.shutdown()
        for _, thread in conns:
            thread.join(timeout)

    async def _accepted(self, endpoint) -> None:
        """On the UCX thread: hand the endpoint to a serving thread (or a refusing one), never block here."""
        link = UcxLink(self._runtime, endpoint)
        peer = ("ucx", next(self._serial))
        verdict = self._connections.admit(link, self._serve, (link, peer), "strata-peer-ucx")
        if verdict is Admission.STOPPING:
            endpoint.abort()
        elif verdict is Admission.FULL:
            threading.Thread(target=self._refuse, args=(link,), name="strata-peer-ucx-refuse", daemon=True).start()

    def _serve(self, conn: UcxLink, peer) -> None:
        """As over TCP, with the idle limit as the link's wait limit: a message (a frame's head,
        one block) comes whole within it, so no frame trickles in a byte at a time. The
        connections waiting for their Hello share the gate with no address (UCX does not say)."""
        conn.limit(max_meta=wire.MAX_HELLO_BYTES, max_payload=0)
        self._track(conn, True)
        caller = None
        try:
            caller = self._greet(conn, conn, peer, None, conn.shutdown)
            if caller is not None:
                conn.limit(max_meta=wire.MAX_META_BYTES, max_payload=self._request_bytes)
                conn.settimeout(self._idle_s)
                self._loop(conn, conn, caller)
        except (EOFError, ConnectionError, TimeoutError, BlockingIOError):
            pass  # the peer closed, died or idled out: its leases and slots end or expire
        except Exception:  # noqa: BLE001 - a bug in serving one request ends that connection, not the daemon
            log.exception("UCX peer connection closed after an unexpected error")
        finally:
            self._ended(conn, caller)
            conn.close()

    @staticmethod
    def _send_block(conn: UcxLink, head: bytes, data: memoryview) -> None:
        conn.sendmsg([head, data])

