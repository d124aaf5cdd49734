"""The UCX peer transport: the peer protocol over ucxx, blocks received straight into placed buffers.

Scheme ``ucx://host:port``, the address a daemon's UCX listener
(``--peer-ucx-listen``) advertises. Everything above the link is the TCP
client's (:mod:`kvstore.peer.tcp`, :mod:`kvstore.peer.connection`): the
pool, the Hello with the bearer token, the reads that ask ``place`` for each block's view and verify its
checksum after it landed there, CHECK for blocks that arrived corrupt, the
writes, the per-key failures and the cancellation. Only the connection
differs: a ucxx endpoint (through ucxx's listener, which connects over
TCP sockets and then moves data over whatever UCX transports both ends
share) carrying frames as tag messages (:mod:`kvstore.peer.ucx_link`),
each block one tag receive posted into the placed view.

Why not one-sided RDMA reads: the Python binding has no put/get; tag
receives into preallocated views are the zero-copy path it has. Why not
active messages: their receives allocate their own buffers, which would
cost a copy into the arena slot.
"""

from __future__ import annotations

import socket

from kvstore.errors import TierUnavailable
from kvstore.peer.base import PeerAddress
from kvstore.peer.connection import PeerConnection
from kvstore.peer.tcp import MAX_CONNECTIONS, MAX_IDLE_PER_PEER, TcpPeerClient, TcpPeerTransport
from kvstore.peer.ucx_link import UcxLink, UcxRuntime

__all__ = ["UcxPeerClient", "UcxPeerTransport"]


class _UcxConnection(PeerConnection):
    """One ucxx endpoint to a peer's UCX listener, Hello done."""

    @staticmethod
    def _open(address: PeerAddress, timeout: float):
        runtime = UcxRuntime.get()
        try:  # UCX's socket addresses are numeric
            host = socket.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM)[0][4][0]
        except OSError as err:
            raise TierUnavailable(f"cannot resolve peer {address} ({err}): check its advertised address") from None
        try:
            ep = runtime.call(
                runtime.context.create_endpoint(host, address.port, endpoint_error_handling=True, connect_timeout=timeout),
                timeout + 1.0,
            )
        except Exception as err:  # noqa: BLE001 - every way a connect fails (refused, timed out, UCX's own errors)
            raise TierUnavailable(
                f"cannot reach UCX peer {address} ({type(err).__name__}: {err}): it may be down; try another holder"
            ) from None
        link = UcxLink(runtime, ep)
        return link, link

    def _set_timeout(self, seconds: float | None, *, send: bool = True) -> None:
        self.sock.settimeout(seconds)

    def stale(self) -> bool:
        """Whether the idle endpoint was closed or reported an error (the peer went away)."""
        return self.sock.closed or not self.sock.ep.alive


class UcxPeerClient(TcpPeerClient):
    """Blocking reads and writes of peer blocks over UCX, with a pool of endpoints. Thread-safe."""

    scheme = "ucx"
    connection = _UcxConnection


class UcxPeerTransport(TcpPeerTransport):
    """The :class:`~kvstore.peer.base.PeerTransport` over UCX (scheme ``ucx``)."""

    scheme = "ucx"
    writes = True
    client_class = UcxPeerClient
    #: The ucxx worker its connections use (the shared-memory transport has its own).
    runtime_class = UcxRuntime

    def __init__(self, *, token: str = "", max_connections: int = MAX_CONNECTIONS,
                 max_idle_per_peer: int = MAX_IDLE_PER_PEER) -> None:
        self.runtime_class.get()  # fails here, with the fix, when ucxx cannot be imported
        super().__init__(token=token, max_connections=max_connections, max_idle_per_peer=max_idle_per_peer)

