"""The peer data plane: blocks between daemons.

- :mod:`kvstore.peer.base`: the :class:`PeerTransport` contract, addresses;
- :mod:`kvstore.peer.registry`: the scheme → transport (and blocking client) registry;
- :mod:`kvstore.peer.fields`: the checks of a peer request's fields;
- :mod:`kvstore.peer.source`: the peer tier (a remote source built on the transports);
- :mod:`kvstore.peer.transports`: the peer listeners as client-side transports;
- :mod:`kvstore.peer.wire`: the TCP peer protocol's frames;
- :mod:`kvstore.peer.server`: the daemon's TCP listener (``--peer-listen``): connections, Hello, frames;
- :mod:`kvstore.peer.requests`: what each peer request (READ, PUT, CHECK, HOLD, RELEASE) does to the store;
- :mod:`kvstore.peer.connection`: one connection to a peer's listener (Hello, frames, deadline);
- :mod:`kvstore.peer.tcp`: the TCP client and its pool, a :class:`PeerTransport`;
- :mod:`kvstore.peer.ucx_link`, :mod:`kvstore.peer.ucx`, :mod:`kvstore.peer.ucx_server`:
  the same protocol over ucxx (the ``ucx`` extra): the link, the client, the listener;
  :mod:`kvstore.peer.ucx_progress`: how the UCX thread progresses its worker without spinning;
- :mod:`kvstore.peer.ucx_shm_link`, :mod:`kvstore.peer.ucx_shm`, :mod:`kvstore.peer.ucx_shm_server`:
  UCX shared memory between daemons of one host (its worker, handshake and lifeline; the
  client; the listener).
"""

from kvstore.peer.base import Held, PeerAddress, PeerStats, PeerTransport
from kvstore.peer.registry import PEER_TRANSPORTS, open_peer_transport

__all__ = ["PEER_TRANSPORTS", "Held", "PeerAddress", "PeerStats", "PeerTransport", "open_peer_transport"]
