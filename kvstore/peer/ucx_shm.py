"""The UCX shared-memory peer transport: the peer protocol over UCX between daemons of one host.

Scheme ``ucx-shm://<host id>:<port>``, the address a daemon with
``--peer-ucx-shm`` advertises (first: a reader on the same host prefers
it). The host id (:func:`~kvstore.peer.ucx_shm_link.host_id`) is this
host's and container's; a reader elsewhere never tries the address
(:meth:`UcxShmPeerTransport.reaches` is False there, and the peer tier
takes its next scheme). Everything above the link is the TCP client's, as
for ``ucx://`` (:mod:`kvstore.peer.ucx`): the pool, the Hello with the
token, reads into placed views verified after they landed, writes, per-key
failures, cancellation. The connection is the handshake and lifeline of
:mod:`kvstore.peer.ucx_shm_link`: an endpoint from the holder's worker
address on the shared-memory worker (transports ``sm,self`` only), error
handling off; a holder that dies mid-transfer ends the lifeline, and the
read fails the keys left ``TierUnavailable`` at once.
"""

from __future__ import annotations

import socket

from kvstore.errors import StrataError, TierUnavailable
from kvstore.peer import wire
from kvstore.peer.base import PeerAddress
from kvstore.peer.ucx import UcxPeerClient, UcxPeerTransport, _UcxConnection
from kvstore.peer.ucx_shm_link import (
    HANDSHAKE_VERSION, ShmLink, UcxShmRuntime, check_peer_uid, host_id, new_connection_id, read_handshake,
    send_handshake, socket_name,
)

__all__ = ["UcxShmPeerClient", "UcxShmPeerTransport", "reaches"]

SCHEME = "ucx-shm"


def reaches(address: str) -> bool:
    """Whether ``address`` (``ucx-shm://<host id>:<port>``) is a daemon on this host."""
    try:
        return PeerAddress.parse(address).host == host_id()
    except StrataError:
        return False


class _ShmConnection(_UcxConnection):
    """One shared-memory endpoint to a daemon on this host, its lifeline open, Hello done."""

    @staticmethod
    def _open(address: PeerAddress, timeout: float):
        if address.host != host_id():
            raise TierUnavailable(
                f"UCX shared-memory peer {address} is on another host or container (this one is {host_id()}): "
                "shared memory reaches daemons on this host only; use tcp or ucx"
            )
        runtime = UcxShmRuntime.get()
        lifeline = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lifeline.settimeout(timeout)
            try:
                lifeline.connect(socket_name(address.port))
                check_peer_uid(lifeline, f"UCX shared-memory peer {address}")
                conn_id = new_connection_id()
                send_handshake(lifeline, [HANDSHAKE_VERSION, conn_id, runtime.address])
                answer = read_handshake(lifeline)
            except (OSError, EOFError, wire.FrameError) as err:
                raise TierUnavailable(
                    f"cannot reach UCX shared-memory peer {address} ({err or type(err).__name__}): "
                    "it may be down; try another holder"
                ) from None
            if len(answer) != 2:
                raise TierUnavailable(f"UCX shared-memory peer {address} sent a malformed handshake")
            status, result = answer
            if status == wire.ERROR:
                wire.raise_error(result)  # its refusal (full, a bad request) as the daemon's own class
            if status != wire.OK or not isinstance(result, bytes):
                raise TierUnavailable(f"UCX shared-memory peer {address} sent a malformed handshake")
            try:
                ep = runtime.call(runtime.endpoint(result), timeout + 1.0)
            except Exception as err:  # noqa: BLE001 - every way UCX refuses an address (unreachable, malformed)
                raise TierUnavailable(
                    f"cannot reach UCX shared-memory peer {address} ({type(err).__name__}: {err}); try another holder"
                ) from None
            link = ShmLink(runtime, ep, lifeline, send_tag=conn_id, recv_tag=conn_id + 1)
        except BaseException:
            lifeline.close()
            raise
        return link, link


class UcxShmPeerClient(UcxPeerClient):
    """Blocking reads and writes of peer blocks over UCX shared memory, with a pool of endpoints. Thread-safe."""

    scheme = SCHEME
    connection = _ShmConnection


class UcxShmPeerTransport(UcxPeerTransport):
    """The :class:`~kvstore.peer.base.PeerTransport` over UCX shared memory (scheme ``ucx-shm``)."""

    scheme = SCHEME
    same_host_only = True
    client_class = UcxShmPeerClient
    runtime_class = UcxShmRuntime

    def reaches(self, address: str) -> bool:
        return reaches(address)
