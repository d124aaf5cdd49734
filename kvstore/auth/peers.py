"""Peer credentials on the same-host socket: the kernel says which uid connected.

``SO_PEERCRED`` gives the uid of the process at the other end of an
``AF_UNIX`` connection, as the kernel recorded it at ``connect``; a client
cannot forge it. The same-host server asks once per connection, maps the
uid to an identity through the policy's ``[[peer]]`` rules and keeps it as
that connection's caller (the connection is served by its own thread).

gRPC's own Unix socket reports only ``unix:`` as the peer and no uid (gRPC
Python exposes neither the descriptor nor the credentials), so callers
there authenticate with a bearer token; its file mode keeps other users out.
"""

from __future__ import annotations

import secrets
import socket
import struct

from kvstore.auth.authority import Authority
from kvstore.auth.identity import Caller, current_identity
from kvstore.block import validate_namespace

_UCRED = struct.Struct("3i")  # pid, uid, gid


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected ``conn``."""
    return _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


def _owner(pid: int) -> str:
    """Slots and leases belong to the connecting process.

    Not to the connection: a client spreads its calls over a pool of
    connections (a Release may go on another one than its Lookup). Not to
    the uid: two processes of one user must not end each other's slots by
    mistake. A peer in a pid namespace the daemon cannot see reads as pid 0;
    its connection is then the owner.
    """
    return f"pid:{pid}" if pid > 0 else f"conn:{secrets.token_hex(8)}"


class PeerGate:
    """Admits same-host connections by their uid and checks each request's namespace."""

    def __init__(self, authority: Authority | None = None) -> None:
        self._authority = authority if authority is not None else Authority()

    def admit(self, conn: socket.socket) -> Caller:
        """The connection's caller; Unauthenticated when its uid has no rule and authentication is required."""
        pid, uid, _ = peer_credentials(conn)
        identity = self._authority.from_peer(uid)
        return Caller(identity, _owner(pid))

    def check(self, namespace, action: str) -> None:
        """PERMISSION_DENIED unless the connection's caller may ``action`` ``namespace``."""
        validate_namespace(namespace)
        self._authority.check(current_identity(), namespace, action)
