"""What the daemon exposes beyond its gRPC service, and the checks made before it does.

The daemon (:mod:`kvstore.server.daemon`) wires its parts together; the
listeners it serves next to the gRPC port start here, each with the error that
names the flag to change when it cannot:

- :func:`authority` is protected mode: an unauthenticated daemon is refused
  any listener reachable beyond loopback, before anything is bound.
- :func:`server_credentials` reads the gRPC port's TLS key pair and client CA.
- :func:`start_same_host_sockets` serves one same-host socket per arena, that
  arena's namespaces only.
- :func:`start_peer_server`, :func:`start_ucx_server` and
  :func:`start_ucx_shm_server` serve the peer data plane over TCP, UCX and UCX
  shared memory; :func:`start_ucx` starts ucxx's worker where only the peer
  tier reads over UCX.
- :func:`peer_addresses` is how other daemons reach those listeners: what the
  node record advertises.

:class:`DaemonError` lives here, with most of the code that raises it.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import grpc

from kvstore.auth import Authority
from kvstore.auth.exposure import refusal, split_host
from kvstore.auth.peers import PeerGate
from kvstore.config import Settings
from kvstore.errors import StrataError
from kvstore.metrics import StoreMetrics
from kvstore.peer.base import PeerAddress
from kvstore.peer.served import ServedBytes
from kvstore.peer.server import PeerServer
from kvstore.transport.samehost.server import SameHostServer
from kvstore.store.group import StoreGroup

log = logging.getLogger("kvstore.server.daemon")  # the daemon's warnings, under the daemon's logger


class DaemonError(StrataError):
    """The daemon cannot start as configured; the message says what to change."""


def authority(settings: Settings) -> Authority:
    """Who may call, and protected mode: refuse to expose an unauthenticated daemon beyond loopback."""
    a = settings.auth
    why = refusal(settings.server.listen, a.authenticated, a.insecure)
    if why is None and settings.peers.listen:
        why = refusal(settings.peers.listen, a.authenticated, a.insecure, flag="--peer-listen")
    if why is None and settings.peers.ucx_listen and not (a.authenticated or a.insecure):
        why = (f"protected mode: --peer-ucx-listen {settings.peers.ucx_listen} is reachable on every "
               "interface (ucxx's listener binds a port, not an address) and no authentication is configured: "
               "configure authentication (--auth-file with bearer tokens), or pass --insecure to serve every "
               "peer that can reach it")
    if why is not None:
        raise DaemonError(why)
    if a.authenticated and a.tls_client_ca and not a.file and settings.peers.listen:
        log.warning("the peer listener authenticates bearer tokens only; with mTLS and no --auth-file "
                    "no peer can authenticate there: add an --auth-file with a token for the peers")
    if not a.authenticated and refusal(settings.server.listen, False, False) is not None:
        log.warning(
            "--insecure: serving %s without authentication; any client that reaches it may read and "
            "overwrite every namespace", settings.server.listen,
        )
    trusted = [os.getuid()] if a.trust_own_uid else []
    found = Authority(a.file, mtls=bool(a.tls_client_ca), reload_s=a.reload_seconds, trusted_uids=trusted)
    if a.file and not a.tls_cert and refusal(settings.server.listen, False, False) is not None:
        log.warning("bearer tokens cross %s in plaintext: set --tls-cert and --tls-key", settings.server.listen)
    return found


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    a = settings.auth
    if not a.tls_cert:
        return None

    def read(path: str, flag: str) -> bytes:
        try:
            return Path(path).expanduser().read_bytes()
        except OSError as err:
            raise DaemonError(f"cannot read {path} ({err.strerror}): check {flag}") from None

    pair = (read(a.tls_key, "--tls-key"), read(a.tls_cert, "--tls-cert"))
    ca = read(a.tls_client_ca, "--tls-client-ca") if a.tls_client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def start_same_host_sockets(settings: Settings, store: StoreGroup, authority: Authority, metrics: StoreMetrics,
                            into: dict[str, SameHostServer]) -> None:
    """One socket per arena, serving that arena's namespaces only. Each server enters ``into``
    before it starts, so a failed start leaves every one taken there for the caller to stop."""
    s = settings
    for named in store.arenas:
        arena = named.shm
        auto = os.path.join(os.path.dirname(arena.path), "samehost-" + os.path.basename(arena.path) + ".sock")
        path = auto if s.server.same_host_socket == "auto" else s.server.same_host_socket
        if named.index and s.server.same_host_socket != "auto":
            path = f"{path}.{named.name}"
        same_host = into[named.name] = SameHostServer(
            store.only(named.name), path, arena.token, metrics=metrics,
            max_connections=s.server.same_host_max_connections, idle_s=s.server.same_host_idle_seconds,
            per_uid=s.server.same_host_max_connections_per_uid,
            gate=PeerGate(authority), mode=s.auth.mode,
        )
        try:
            same_host.start()
        except OSError as err:
            raise DaemonError(
                f"cannot serve the same-host socket at {path} ({err.strerror or err}): "
                "set --same-host-socket to a writable path, or 'off'"
            ) from None


def _peer_limits(s: Settings) -> dict:
    """The limits every peer listener (TCP, UCX, UCX shared memory) is built with."""
    p = s.peers
    return dict(max_connections=p.max_connections, idle_s=p.idle_seconds, hello_s=p.hello_seconds,
                in_flight_bytes=int(p.in_flight_bytes), request_bytes=int(p.connection_in_flight_bytes),
                per_node=p.max_connections_per_node, per_node_bytes=int(p.in_flight_bytes_per_node))


def start_peer_server(settings: Settings, store: StoreGroup, authority: Authority, metrics: StoreMetrics,
                      served: ServedBytes) -> PeerServer:
    """The TCP peer data plane (--peer-listen)."""
    s = settings
    server = PeerServer(
        store, s.peers.listen, authority=authority, metrics=metrics,
        **_peer_limits(s),
        served=served,
    )
    try:
        server.start()
    except (OSError, ValueError) as err:
        raise DaemonError(
            f"cannot serve the peer data plane on {s.peers.listen} ({err}): pick a free address with "
            "--peer-listen, or leave it empty to turn it off"
        ) from None
    return server


def start_ucx(why: str, *, shared_memory: bool = False) -> None:
    """Start ucxx's worker now, not on the first peer read (its start can take seconds on a busy
    host, longer than a read's deadline), and say at once when it cannot be imported."""
    from kvstore.peer.ucx_link import UcxRuntime, UcxUnavailable

    try:
        if shared_memory:
            from kvstore.peer.ucx_shm_link import UcxShmRuntime

            UcxShmRuntime.get()
        else:
            UcxRuntime.get()
    except UcxUnavailable as err:
        raise DaemonError(f"{err} ({why})") from None


def start_ucx_shm_server(settings: Settings, store: StoreGroup, authority: Authority,
                         metrics: StoreMetrics) -> PeerServer:
    """The UCX shared-memory peer listener: the same requests, to daemons on this host."""
    from kvstore.peer.ucx_shm_server import UcxShmPeerServer

    s = settings
    start_ucx("--peer-ucx-shm", shared_memory=True)
    server = UcxShmPeerServer(
        store, "", authority=authority, metrics=metrics,
        **_peer_limits(s),
    )
    try:
        return server.start()
    except OSError as err:
        raise DaemonError(
            f"cannot serve UCX shared memory to this host's daemons ({err}): turn --peer-ucx-shm off"
        ) from None


def start_ucx_server(settings: Settings, store: StoreGroup, authority: Authority, metrics: StoreMetrics,
                     served: ServedBytes) -> PeerServer:
    """The UCX peer listener: the same requests as the TCP one, over ucxx (the ucx extra)."""
    from kvstore.peer.ucx_server import UcxPeerServer

    s = settings
    server = UcxPeerServer(
        store, s.peers.ucx_listen, authority=authority, metrics=metrics,
        **_peer_limits(s),
        served=served,
    )
    start_ucx(f"--peer-ucx-listen {s.peers.ucx_listen}")
    try:
        return server.start()
    except Exception as err:  # noqa: BLE001 - ucxx's own errors (a port taken, no usable transport)
        raise DaemonError(
            f"cannot serve the UCX peer data plane on {s.peers.ucx_listen} ({type(err).__name__}: {err}): "
            "pick a free port with --peer-ucx-listen, or leave it empty to turn it off"
        ) from None


def peer_addresses(settings: Settings, tcp: PeerServer | None, ucx: PeerServer | None,
                   ucx_shm: PeerServer | None) -> dict[str, str]:
    """The peer data plane's addresses by transport scheme, as other daemons reach them, shared
    memory first; see :meth:`kvstore.server.daemon.Daemon.peer_addresses`."""
    p = settings.peers
    out = {}
    if ucx_shm is not None and ucx_shm.port is not None:
        out["ucx-shm"] = ucx_shm.address
    for scheme, server, listen, advertise in (("tcp", tcp, p.listen, p.advertise),
                                              ("ucx", ucx, p.ucx_listen, p.ucx_advertise)):
        if server is None or server.port is None:
            continue
        host, port = split_host(advertise or listen)
        if advertise:
            port = int(port)
        else:
            port = server.port  # the one bound (a listen port of 0 picks one)
            if host in ("", "0.0.0.0", "::"):
                host = socket.gethostname()
        out[scheme] = str(PeerAddress(scheme, host, port))
    return out
