"""The UCX peer transport as a :class:`~kvstore.transport.base.Transport`: a daemon's blocks over its UCX listener.

What :mod:`kvstore.transport.peer_tcp` is for the TCP listener, over
``--peer-ucx-listen`` (:class:`kvstore.peer.ucx.UcxPeerClient`), so the same
contract suite runs over UCX. ``target`` is the daemon's advertised UCX
address, ``ucx://host:port`` (``host:port`` also works). Needs ucxx (the
``ucx`` extra); without it :func:`connect` raises ``UcxUnavailable`` with
the fix.
"""

from __future__ import annotations

from kvstore.errors import InvalidArgument
from kvstore.peer.ucx import UcxPeerClient
from kvstore.peer.ucx_link import UcxRuntime
from kvstore.transport.peer_tcp import PeerTcpTransport


class PeerUcxTransport(PeerTcpTransport):
    name = "peer-ucx"
    scheme = "ucx"
    client_class = UcxPeerClient


def connect(target: str, **options) -> PeerUcxTransport:
    if not isinstance(target, str) or not target:
        raise InvalidArgument("the peer-ucx transport needs target='ucx://host:port' (the daemon's --peer-ucx-listen)")
    UcxRuntime.get()
    return PeerUcxTransport(target, **options)
