"""The daemon's peer data plane: a TCP listener other daemons read blocks from and write blocks to.

The protocol is :mod:`kvstore.peer.wire`. This module takes connections,
their Hello and their frames; what each request does to the store (READ
leasing blocks in place, PUT receiving into reserved slots, CHECK, HOLD,
RELEASE) is :mod:`kvstore.peer.requests`.

Why threads with blocking sockets, as the same-host server: a connection's
requests are served in order by its own thread, which spends its time in
``sendmsg`` and ``recv_into`` with the GIL released; the bytes go from the
arena to the kernel with no copy in between. An asyncio server would need
its own buffers for partial writes (or a buffered protocol per slot) and a
hop to a worker thread for every store call, which can block on disk. The
cost is one thread per connection, so connections are limited.

Limits (each refusal is an error frame the client raises as the daemon's
class; beyond a limit ``Overloaded`` with a retry delay, never a queue):
``max_connections`` at once; one request in flight per connection; a
frame's control part within :data:`~kvstore.peer.wire.MAX_META_BYTES`;
batches within the store's ``max_batch_blocks``; one request's block bytes
within ``request_bytes``, a frame's payload too (refused from its header);
the block bytes every connection together is
sending or receiving within ``in_flight_bytes`` (a byte budget, taken per
block on reads and per request on writes); a connection that sends nothing,
or stops reading its reply, for ``idle_s`` is closed (kernel socket
timeouts), and so is one whose frame, once begun, is not whole within
``idle_s`` (each byte that comes restarts a socket timeout, so a byte now and
then would otherwise hold the connection for ever).

Before its Hello a connection costs whoever opened it nothing but a TCP
handshake, so it gets little: its first frame must be a Hello of at most
:data:`~kvstore.peer.wire.MAX_HELLO_BYTES` and no payload (a header claiming
more is refused before a byte more is read, never given a buffer of the
length it claims), whole within ``hello_s`` of the accept however slowly its
bytes come; and the connections waiting for their Hello share at most half
of ``max_connections``, a quarter from one address, the oldest closed to
make room (:mod:`kvstore.peer.hello_gate` says why), so a flood of them
cannot keep an authenticated peer out. After its Hello, one peer node (its
identity from one address; over UCX, which names no address, its identity)
holds at most ``per_node`` of the connections, so one node's pool, or one
stolen token, cannot take the listener from the others.

Authentication: the Hello carries a bearer token, checked against the same
policy as gRPC (:class:`~kvstore.auth.Authority`); without a token the
caller is anonymous, which only a daemon without authentication accepts.
Each request's namespace is then authorized as the gRPC interceptor does
(:mod:`kvstore.peer.requests`). Protected mode (the daemon refuses a
non-loopback ``--peer-listen`` without authentication) is the daemon's.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time

from kvstore.auth import Authority
from kvstore.auth.identity import Caller, Identity
from kvstore.errors import InvalidArgument, Overloaded, StrataError
from kvstore.metrics import StoreMetrics
from kvstore.peer import wire
from kvstore.peer.fields import fields, request
from kvstore.peer.hello_gate import HelloGate
from kvstore.peer.requests import PeerRequests, Refused, reply
from kvstore.peer.served import ServedBytes
from kvstore.rpc.status import code_for
from kvstore.shares import Shares
from kvstore.store.group import StoreGroup
from kvstore.wire.budget import ByteBudget
from kvstore.wire.listeners import ConnectionTable, accept_loop, stop_listening
from kvstore.wire.unix import set_kernel_timeouts

log = logging.getLogger(__name__)

HELLO_S = 5.0
REFUSE_RETRY_S = 0.5

__all__ = ["HELLO_S", "REFUSE_RETRY_S", "PeerServer"]


def _node(identity: Identity, host: str | None) -> str:
    """Whose share a peer connection counts against: its identity from its address (one node)."""
    return f"peer {identity.principal} from {host}" if host else f"peer {identity.principal}"


def _stop_reading(conn: socket.socket) -> None:
    """Wake a thread waiting in ``recv`` on ``conn`` (it reads EOF); it can still send its answer."""
    try:
        conn.shutdown(socket.SHUT_RD)
    except OSError:
        pass  # already gone


class PeerServer:
    """Serves a store group's blocks to other daemons over TCP. :meth:`start`, then :meth:`stop`.
    ``served``: where the bytes each block read sends are counted, under :attr:`scheme`."""

    #: The transport served (a label of ``served``); the UCX listener says ``ucx``.
    scheme = "tcp"

    def __init__(self, store: StoreGroup, listen: str, *, authority: Authority | None = None,
                 metrics: StoreMetrics | None = None, max_connections: int = 64, idle_s: float = 120.0,
                 hello_s: float = HELLO_S, in_flight_bytes: int = 1 << 30, request_bytes: int = 512 << 20,
                 served: ServedBytes | None = None, per_node: int = 0, per_node_bytes: int = 0) -> None:
        self._store = store
        self._served = served if served is not None else ServedBytes()
        self._listen = listen
        self._authority = authority if authority is not None else Authority()
        self._metrics = metrics if metrics is not None else store.metrics
        self._max_connections = max_connections
        self._idle_s = idle_s
        self._hello_s = hello_s
        self._request_bytes = request_bytes
        self._budget = ByteBudget(in_flight_bytes, "peer transfers", "--peer-in-flight-bytes",
                                  # half by default, never less than one whole request
                                  share_bytes=per_node_bytes or max(in_flight_bytes // 2,
                                                                    min(request_bytes, in_flight_bytes)),
                                  share_setting="--peer-in-flight-bytes-per-node")
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._connections = ConnectionTable(max_connections)
        self._hellos = HelloGate(max(1, max_connections // 2), max(1, max_connections // 4))
        self._nodes = Shares(per_node or max(1, max_connections // 2), "peer connections",
                             "--peer-max-connections-per-node", retry_after_s=REFUSE_RETRY_S)
        self._links: set = set()  # every served connection's link, for buffered_bytes
        self._links_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._requests = PeerRequests(store, self._authority, self._metrics, self._budget, request_bytes,
                                      self._served, self.scheme, self._send_block)
        self.port: int | None = None

    @property
    def bytes_sent(self) -> int:
        return self._requests.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self._requests.bytes_received

    @property
    def connections(self) -> int:
        return len(self._connections)

    @property
    def in_flight_bytes(self) -> int:
        return self._budget.used_bytes

    @property
    def waiting_for_hello(self) -> int:
        """Connections accepted that have not said Hello yet."""
        return len(self._hellos)

    @property
    def buffered_bytes(self) -> int:
        """The bytes the served connections' frame buffers hold (block bytes are the budget's)."""
        with self._links_lock:
            links = list(self._links)
        return sum(link.buffer_bytes for link in links)

    # ---- listening -------------------------------------------------------------

    def start(self) -> PeerServer:
        host, _, port = self._listen.rpartition(":")
        host = host.strip("[]") or "0.0.0.0"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, int(port)))
            sock.listen(128)
        except BaseException:
            sock.close()
            raise
        self._listener = sock
        self.port = sock.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, name="strata-peer-accept", daemon=True)
        self._acceptor.start()
        log.info("peer data plane on %s (port %d)", self._listen, self.port)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        stop_listening(self._listener, self._acceptor, self._connections.close(), timeout)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        accept_loop(self._listener, self._connections, name="strata-peer", serve=self._serve, refuse=self._refuse,
                    configure=lambda conn: conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1))

    def _refuse(self, conn: socket.socket, err: Overloaded | None = None) -> None:
        err = err or Overloaded(
            f"the peer listener serves at most {self._max_connections} connections (--peer-max-connections): "
            "retry after the delay, or read from another holder", retry_after_s=REFUSE_RETRY_S,
        )
        self._metrics.rpc_errors.labels("PeerHello", code_for(err).name).inc()
        try:
            conn.settimeout(1.0)
            wire.send(conn, wire.encode([0, wire.ERROR, wire.error_result(err)]))
        except OSError:
            pass  # the client went away first
        conn.close()

    # ---- one connection ----------------------------------------------------------

    def _serve(self, conn: socket.socket, peer) -> None:
        link = wire.Wire(conn, max_meta=wire.MAX_HELLO_BYTES, max_payload=0)
        self._track(link, True)
        caller = None
        try:
            caller = self._greet(conn, link, peer, peer[0], lambda: _stop_reading(conn))
            if caller is not None:
                link.limit(max_meta=wire.MAX_META_BYTES, max_payload=self._request_bytes)
                link.frame_s = self._idle_s
                set_kernel_timeouts(conn, self._idle_s)
                conn.settimeout(None)
                self._loop(conn, link, caller)
        except (EOFError, ConnectionError, TimeoutError, BlockingIOError):
            pass  # the peer closed, died, idled out or stopped reading: its leases and slots end or expire
        except OSError as err:
            log.debug("peer connection ended: %s", err)
        except Exception:  # noqa: BLE001 - a bug in serving one request ends that connection, not the daemon
            log.exception("peer connection closed after an unexpected error")
        finally:
            self._ended(link, caller)
            conn.close()

    def _ended(self, link, caller: Caller | None) -> None:
        """A served connection ended: it leaves the listener's tables and its node's share."""
        self._track(link, False)
        if caller is not None:
            self._nodes.give(caller.share)

    def _track(self, link, served: bool) -> None:
        with self._links_lock:
            if served:
                self._links.add(link)
            else:
                self._links.discard(link)

    def _greet(self, conn, link, peer, host, wake) -> Caller | None:
        """The connection's Hello, waited for within the Hello gate's share (``host``: where it
        came from; ``wake``: ends its wait when the gate closes it), answered OK with this
        daemon's limits; None when it was refused (and told why)."""
        deadline = time.monotonic() + self._hello_s
        with self._hellos.waiting(host, wake) as ticket:
            try:
                said = self._hello(conn, link, deadline)
            except (EOFError, OSError):
                if not ticket.closed:
                    raise
                said = None
        if ticket.closed:  # closed to make room for a newer connection (even if its Hello came in the meantime)
            self._refuse(conn, Overloaded(
                f"too many peer connections were waiting for their Hello (at most {self._hellos.limit}, half of "
                f"--peer-max-connections, {self._hellos.per_host} from one address): this one, the oldest, was "
                "closed to make room; retry after the delay", retry_after_s=REFUSE_RETRY_S,
            ))
            return None
        if said is None:
            return None
        rid, identity = said
        node = _node(identity, host)
        try:
            self._nodes.take(node)
        except Overloaded as err:
            self._refuse(conn, err)
            return None
        conn.settimeout(self._idle_s)  # not what was left of the Hello's deadline
        limits = [wire.MAX_META_BYTES, self._store.limits.max_block_bytes, self._store.limits.max_batch_blocks,
                  self._request_bytes]
        reply(conn, rid, wire.OK, limits)
        return Caller(identity, f"peer:{identity.principal}:{peer[0]}:{peer[1]}:{next(self._ids)}", share=node)

    def _hello(self, conn, link, deadline: float) -> tuple[int, Identity] | None:
        """The Hello's request id and the caller it names, read by ``deadline``; None when it was
        refused (the error frame is sent)."""
        conn.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            try:
                meta, payload = link.read_meta(deadline)
                op, rid, args = fields(meta, 3, "request")
                if op != wire.HELLO or payload:
                    raise InvalidArgument("the first frame on a peer connection must be a Hello")
                version, token = fields(args, 2, "Hello")
                if version != wire.PROTOCOL_VERSION:
                    raise InvalidArgument(
                        f"peer protocol {version!r} is not this daemon's {wire.PROTOCOL_VERSION}: "
                        "run the same Strata release on both nodes"
                    )
                if not isinstance(token, str):
                    raise InvalidArgument("malformed peer Hello: the token is not a string")
                identity = self._authority.from_token(token) if token else self._authority.anonymous()
            except (TypeError, ValueError) as err:
                raise InvalidArgument(f"malformed peer Hello ({err})") from None
        except StrataError as err:
            self._metrics.rpc_errors.labels("PeerHello", code_for(err).name).inc()
            reply(conn, 0, wire.ERROR, wire.error_result(err))
            return None
        return rid, identity

    def _loop(self, conn: socket.socket, link: wire.Wire, caller: Caller) -> None:
        handlers = self._requests.handlers()
        latency = self._metrics.op_latency
        ops = {op: (fn, latency.labels(wire.OP_NAMES[op])) for op, fn in handlers.items()}  # labels looked up once
        while True:
            try:
                meta, payload = link.read_meta()
            except wire.FrameError as err:
                reply(conn, 0, wire.ERROR, wire.error_result(err))
                return  # the stream cannot be resynchronised
            name = "PeerUnknown"
            t0 = time.perf_counter()
            try:
                op, rid, args = request(meta)
            except InvalidArgument as err:  # no id to answer: a reply of id 0 refuses the connection
                self._failed(conn, 0, name, err)
                return
            try:
                if not isinstance(op, int):
                    raise InvalidArgument(f"malformed peer request: its operation is a {type(op).__name__}, "
                                          "not an integer")
                handler, timer = ops.get(op, (None, None))
                name = wire.OP_NAMES.get(op, name)
                if handler is None:
                    raise InvalidArgument(f"unknown peer operation {op!r}: run the same Strata release on both nodes")
                if payload:
                    raise InvalidArgument(f"a {name} request carries no payload; {payload} bytes came")
                handler(conn, link, caller, rid, args)
                timer.observe(time.perf_counter() - t0)
            except Refused as refused:
                self._failed(conn, rid, name, refused.err)
            except StrataError as err:
                if link.pending:  # bytes of a refused frame: the stream cannot go on
                    self._failed(conn, 0, name, err)
                    return
                self._failed(conn, rid, name, err)

    def _failed(self, conn: socket.socket, rid: int, op: str, err: StrataError) -> None:
        self._metrics.rpc_errors.labels(op, code_for(err).name).inc()
        reply(conn, rid, wire.ERROR, wire.error_result(err))

    @staticmethod
    def _send_block(conn: socket.socket, head: bytes, data: memoryview) -> None:
        """A BLOCK reply's head and bytes (over TCP in one ``sendmsg``; a subclass sends it its own way)."""
        wire.send_block(conn, head, data)
