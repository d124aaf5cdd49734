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


class PeerGate:
    """Admits same-host connections by their uid and checks each request's namespace."""

    def __init__(self, authority: Authority | None = None) -> None:
        self._authority = authority if authority is not None else Authority()

    def admit(self, conn: socket.socket) -> Caller:
        """The connection's caller; Unauthenticated when its uid has no rule and authentication is required."""
        _, uid, _ = peer_credentials(conn)
        identity = self._authority.from_peer(uid)
        # Unauthenticated callers own their slots per connection, not per uid.
        owner = identity.principal if identity.authenticated else f"samehost:{secrets.token_hex(8)}"
        return Caller(identity, owner)

    def check(self, namespace, action: str) -> None:
        """PERMISSION_DENIED unless the connection's caller may ``action`` ``namespace``."""
        validate_namespace(namespace)
        self._authority.check(current_identity(), namespace, action)
