"""The UCX shared-memory peer transport as a :class:`~kvstore.transport.base.Transport`: a daemon's blocks on this host.

What :mod:`kvstore.transport.peer_ucx` is for the UCX listener, over a
daemon's ``--peer-ucx-shm`` (:class:`kvstore.peer.ucx_shm.UcxShmPeerClient`),
so the same contract suite runs over UCX shared memory. ``target`` is the
daemon's advertised address, ``ucx-shm://<host id>:<port>``; it reaches a
daemon on this host only. Needs ucxx (the ``ucx`` extra); without it
:func:`connect` raises ``UcxUnavailable`` with the fix.
"""

from __future__ import annotations

from kvstore.errors import InvalidArgument
from kvstore.peer.ucx_shm import UcxShmPeerClient
from kvstore.peer.ucx_shm_link import UcxShmRuntime
from kvstore.transport.peer_tcp import PeerTcpTransport


class PeerUcxShmTransport(PeerTcpTransport):
    name = "peer-ucx-shm"
    scheme = "ucx-shm"
    client_class = UcxShmPeerClient


def connect(target: str, **options) -> PeerUcxShmTransport:
    if not isinstance(target, str) or "://" not in target:
        raise InvalidArgument(
            "the peer-ucx-shm transport needs target='ucx-shm://<host id>:<port>' (the address a daemon with "
            "--peer-ucx-shm advertises)"
        )
    UcxShmRuntime.get()
    return PeerUcxShmTransport(target, **options)
