"""The peer transports and their blocking cores, by address scheme: the one place a scheme is named.

The contracts live in :mod:`kvstore.peer.base`; each implementation is
imported here only when a transport of its scheme is opened (UCX needs
ucxx, which a node without the ``ucx`` extra does not have). A new peer
transport is one module and one entry in :data:`PEER_TRANSPORTS` (and in
:data:`PEER_CLIENTS` when a handoff may pull over it).

:func:`fabric_order` is the order a node actually uses: UCX is worth its
hops only where it has a fabric Strata's TCP path lacks (RDMA); with its
``tcp`` transport alone it moved every block size slower than the ``tcp``
scheme (``docs/guide/peers.md``), so there ``tcp`` goes first unless
``[peers] ucx_over_tcp`` says otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvstore.errors import InvalidArgument
from kvstore.peer.base import PeerTransport

log = logging.getLogger(__name__)


def _tcp(**options) -> PeerTransport:
    from kvstore.peer.tcp import TcpPeerTransport

    return TcpPeerTransport(**options)


def _grpc(**options) -> PeerTransport:
    from kvstore.peer.grpc import GrpcPeerTransport

    return GrpcPeerTransport(**options)


def _ucx(**options) -> PeerTransport:
    from kvstore.peer.ucx import UcxPeerTransport

    return UcxPeerTransport(**options)


def _ucx_shm(**options) -> PeerTransport:
    from kvstore.peer.ucx_shm import UcxShmPeerTransport

    return UcxShmPeerTransport(**options)


# Address scheme → constructor (keyword options: token, pool limits); a new
# peer transport is one module and one entry here.
PEER_TRANSPORTS: dict[str, Callable[..., PeerTransport]] = {
    "tcp": _tcp, "grpc": _grpc, "ucx": _ucx, "ucx-shm": _ucx_shm,
}


def _tcp_client(security) -> object:
    from kvstore.peer.tcp import TcpPeerClient

    return TcpPeerClient(token=security.token or "")


def _ucx_client(security) -> object:
    from kvstore.peer.ucx import UcxPeerClient

    return UcxPeerClient(token=security.token or "")


def _grpc_client(security) -> object:
    from kvstore.peer.grpc import GrpcPeerClient

    return GrpcPeerClient(security=security)


# The blocking cores under the transports, by address scheme, each built from a
# ChannelSecurity (its token; the gRPC one its TLS CA too): ``read(address,
# namespace, keys, place, Deadline) -> list[Got]`` and ``close()``, in the
# calling thread. A handoff pull runs in a gRPC worker thread and uses these.
PEER_CLIENTS: dict[str, Callable[..., object]] = {"tcp": _tcp_client, "ucx": _ucx_client, "grpc": _grpc_client}


def open_peer_client(scheme: str, security) -> object:
    try:
        factory = PEER_CLIENTS[scheme]
    except KeyError:
        raise InvalidArgument(f"unknown peer transport {scheme!r}; known: {', '.join(sorted(PEER_CLIENTS))}") from None
    return factory(security)


def open_peer_transport(scheme: str, **options) -> PeerTransport:
    try:
        factory = PEER_TRANSPORTS[scheme]
    except KeyError:
        raise InvalidArgument(
            f"unknown peer transport {scheme!r}; known: {', '.join(sorted(PEER_TRANSPORTS))}"
        ) from None
    return factory(**options)


# The transports replication pushes copies and holds with (they write blocks), preferred first.
PUSH_SCHEMES = ("tcp",)


def schemes(*, writes: bool = False) -> tuple[str, ...]:
    """Every peer transport's scheme; with ``writes``, those replication pushes over, preferred first."""
    return PUSH_SCHEMES if writes else tuple(PEER_TRANSPORTS)


def pull_schemes() -> tuple[str, ...]:
    """The schemes a handoff pull can use (those with a blocking client)."""
    return tuple(PEER_CLIENTS)


def fabric_order(schemes: Sequence[str], *, ucx_over_tcp: bool = False,
                 network: Callable[[], set[str]] | None = None) -> tuple[str, ...]:
    """``schemes`` as this node should use them: where ``ucx`` comes before ``tcp`` and UCX's only
    transport to another host is its own ``tcp`` (no RDMA: what ``network()`` returns, by default
    the UCX worker's :meth:`~kvstore.peer.ucx_link.UcxRuntime.network_transports`), ``tcp`` takes
    ``ucx``'s place and ``ucx`` follows it, since UCX over TCP is the same wire with more hops.
    Unchanged with ``ucx_over_tcp``, when UCX has a fabric of its own, or when ucxx cannot start
    (the daemon's start says why)."""
    order = tuple(schemes)
    if ucx_over_tcp or "ucx" not in order or "tcp" not in order or order.index("tcp") < order.index("ucx"):
        return order
    if network is None:
        from kvstore.peer.ucx_link import UcxRuntime, UcxUnavailable

        try:
            found = UcxRuntime.get().network_transports()
        except UcxUnavailable:
            return order
    else:
        found = network()
    if found - {"tcp"}:
        return order
    moved = [scheme for scheme in order if scheme != "tcp"]
    moved.insert(moved.index("ucx"), "tcp")
    log.info("UCX reaches other hosts over tcp only here (no RDMA transport: %s), which is slower than "
             "Strata's own tcp peer path; peers that advertise tcp:// are reached over it first (order %s; "
             "[peers] ucx_over_tcp = true keeps %s)", ", ".join(sorted(found)) or "none", ",".join(moved),
             ",".join(order))
    return tuple(moved)
