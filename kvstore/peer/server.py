"""The daemon's peer data plane: a TCP listener other daemons read blocks from and write blocks to.

The protocol is :mod:`kvstore.peer.wire`. A read leases each block in place
in its arena (:meth:`~kvstore.store.group.StoreGroup.lookup`, as a same-host
client does) and hands it to the socket straight out of the mapping, with
its frame head, in one ``sendmsg``; the lease is given back as soon as the
kernel has taken the bytes. The kernel copies them into the socket's
buffers, so a slot reused after that cannot change what is in flight; why
not ``sendfile``, which would pass the arena's pages by reference (and on
loopback cost both sides more CPU, not less). A block the store could not
bring into RAM (the head is full of pinned blocks) goes out of the store's
verified copy (:meth:`get`). The reader verifies every block it receives;
the sender does not hash what it sends (that pass cost as much as the copy
into the socket). A reader whose bytes failed their checksum sends CHECK
for those keys: the store reads each through its verifying path, which
drops a corrupt copy, so the next read finds a sound copy or a miss (bytes
corrupted in transit leave the holder's sound copy where it is). A write reserves arena slots for the blocks (Allocate), receives
their bytes straight into the slots and commits each with the writer's
checksum, which the store verifies. Bytes go into a slot only while its
lease is live, inside the store's ``writing``, which keeps the extent from
reuse while they land: a writer late with its Data frame (slow, or on
purpose) would otherwise write over whatever block the arena gave that
extent to since. A block whose lease lapsed first is read off the socket
and dropped, and answered LeaseExpired. A HOLD pins blocks held here under a
lease of kind :data:`REPLICA_LEASE` on behalf of another node's pin (the
copies it made of a pinned prefix, see :mod:`kvstore.replication.pin_copies`);
the hold is bound to the caller's principal, not to its connection, so the
pinning node may end it (RELEASE) over any pooled connection, and it ends
by itself at its deadline when that node dies first.

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
Each request's namespace is authorized like the gRPC interceptor does (read
for READ, write for PUT), before the store is touched, so a namespace the
caller may not use reads the same whether or not it exists. Protected mode
(the daemon refuses a non-loopback ``--peer-listen`` without
authentication) is the daemon's.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import socket
import threading
import time

from kvstore.auth import READ, WRITE, Authority
from kvstore.auth.identity import Caller, Identity
from kvstore.block import BlockKey, TierName, validate_namespace
from kvstore.errors import (
    DeadlineExceeded, InvalidArgument, LeaseExpired, LeaseOwnedElsewhere, Overloaded, StrataError, UnknownNamespace,
)
from kvstore.metrics import StoreMetrics
from kvstore.peer import wire
from kvstore.peer.fields import count, fields, items, put_block, request
from kvstore.peer.hello_gate import HelloGate
from kvstore.peer.served import ServedBytes
from kvstore.rpc.status import code_for
from kvstore.wire.budget import ByteBudget
from kvstore.store.group import StoreGroup
from kvstore.store.leases import LeaseKind
from kvstore.tiers.base import MappableTier
from kvstore.wire.listeners import ConnectionTable, accept_loop, stop_listening
from kvstore.shares import Shares
from kvstore.wire.unix import set_kernel_timeouts

log = logging.getLogger(__name__)

HELLO_S = 5.0
REFUSE_RETRY_S = 0.5
REPLICA_LEASE = LeaseKind("replica")  # a copy pinned here for another node's pin (HOLD)


def _node(identity: Identity, host: str | None) -> str:
    """Whose share a peer connection counts against: its identity from its address (one node)."""
    return f"peer {identity.principal} from {host}" if host else f"peer {identity.principal}"


def _stop_reading(conn: socket.socket) -> None:
    """Wake a thread waiting in ``recv`` on ``conn`` (it reads EOF); it can still send its answer."""
    try:
        conn.shutdown(socket.SHUT_RD)
    except OSError:
        pass  # already gone


class _Refused(Exception):
    """A whole request refused part-way through its reply: the error frame is sent, the connection goes on."""

    def __init__(self, err: StrataError) -> None:
        self.err = err


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
        self.port: int | None = None
        self.bytes_sent = 0
        self.bytes_received = 0

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
        self._reply(conn, rid, wire.OK, limits)
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
            self._reply(conn, 0, wire.ERROR, wire.error_result(err))
            return None
        return rid, identity

    def _loop(self, conn: socket.socket, link: wire.Wire, caller: Caller) -> None:
        handlers = {wire.READ: self._read, wire.PUT: self._put, wire.CHECK: self._verify, wire.HOLD: self._hold,
                    wire.RELEASE: self._release}
        latency = self._metrics.op_latency
        ops = {op: (fn, latency.labels(wire.OP_NAMES[op])) for op, fn in handlers.items()}  # labels looked up once
        while True:
            try:
                meta, payload = link.read_meta()
            except wire.FrameError as err:
                self._reply(conn, 0, wire.ERROR, wire.error_result(err))
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
            except _Refused as refused:
                self._failed(conn, rid, name, refused.err)
            except StrataError as err:
                if link.pending:  # bytes of a refused frame: the stream cannot go on
                    self._failed(conn, 0, name, err)
                    return
                self._failed(conn, rid, name, err)

    def _failed(self, conn: socket.socket, rid: int, op: str, err: StrataError) -> None:
        self._metrics.rpc_errors.labels(op, code_for(err).name).inc()
        self._reply(conn, rid, wire.ERROR, wire.error_result(err))

    @staticmethod
    def _reply(conn: socket.socket, rid: int, status: int, result) -> None:
        wire.send(conn, wire.encode([rid, status, result]))

    @staticmethod
    def _send_block(conn: socket.socket, head: bytes, data: memoryview) -> None:
        """A BLOCK reply's head and bytes (over TCP in one ``sendmsg``; a subclass sends it its own way)."""
        wire.send_block(conn, head, data)

    def _check(self, identity: Identity, namespace, action: str) -> str:
        if not isinstance(namespace, str):
            raise InvalidArgument("malformed peer request: the namespace is not a string")
        validate_namespace(namespace)  # its syntax only: says nothing about other namespaces
        self._authority.check(identity, namespace, action)
        return namespace

    @staticmethod
    def _deadline(timeout_ms: int) -> float | None:
        return time.monotonic() + timeout_ms / 1000 if timeout_ms else None

    # ---- READ --------------------------------------------------------------------

    def _read(self, conn: socket.socket, link: wire.Wire, caller: Caller, rid: int, args) -> None:
        namespace, keys, timeout_ms, with_bytes = fields(args, 4, "Read")
        namespace = self._check(caller.identity, namespace, READ)
        keys = items(keys, "keys")
        self._store.check_batch(keys)
        deadline = self._deadline(count(timeout_ms, "timeout_ms"))
        for i, key in enumerate(keys):
            if deadline is not None and time.monotonic() >= deadline:
                raise _Refused(DeadlineExceeded(
                    f"the read's deadline passed after {i} of {len(keys)} blocks: retry the rest with a longer timeout"
                ))
            try:
                self._read_one(conn, caller, rid, i, namespace, key, deadline, bool(with_bytes))
            except UnknownNamespace as err:
                raise _Refused(err) from None  # the whole batch's namespace, not this key
            except StrataError as err:  # this key only (a bad key, a corrupt copy, a failing tier)
                self._metrics.rpc_errors.labels("PeerRead", code_for(err).name).inc()
                self._reply(conn, rid, wire.FAILED, [i, wire.error_result(err)])
        self._reply(conn, rid, wire.OK, len(keys))

    def _read_one(self, conn, caller: Caller, rid: int, i: int, namespace: str, key, deadline, with_bytes: bool) -> None:
        # A peer's read is answered from this node's own tiers, as a gRPC peer Get (local_only) is:
        # a block only a remote tier has here (the peer tier: a third node; the object tier) is a
        # miss, which the asker repairs or fetches itself, never a fetch made for it.
        [loc] = self._store.lookup(namespace, [key], None, deadline, caller.owner, local_only=True)
        if loc is not None and not with_bytes:  # the metadata only
            if loc.lease_id:
                self._store.release([loc.lease_id], caller.owner)
            loc = dataclasses.replace(loc, lease_id=0)
        if loc is None:
            self._reply(conn, rid, wire.MISS, i)
            return
        meta = loc.meta
        head = [i, meta.size, meta.checksum, meta.parent, meta.layout, int(loc.tier)]
        if not with_bytes:
            self._reply(conn, rid, wire.BLOCK, head)
            return
        try:
            self._budget.take(meta.size, caller.share)
        except Overloaded as err:
            if loc.lease_id:
                self._store.release([loc.lease_id], caller.owner)
            raise _Refused(err) from None
        try:
            if loc.lease_id and self._store.store_for(namespace).head.name == TierName.GPU:
                self._store.release([loc.lease_id], caller.owner)  # leased in device memory: sent from a copy
                self._send_copy(conn, rid, head, loc)
            elif loc.lease_id:
                self._send_leased(conn, caller, rid, head, loc)
            else:
                self._send_copy(conn, rid, head, loc)
        finally:
            self._budget.give(meta.size, caller.share)

    def _send_leased(self, conn, caller: Caller, rid: int, head: list, loc) -> None:
        """The block straight out of the arena under its read lease; the lease ends once it is sent."""
        meta = loc.meta
        view = self._store.store_for(loc.key.namespace).head.view(loc.offset, meta.size)
        try:
            self._send_block(conn, wire.encode([rid, wire.BLOCK, head], meta.size), view)
            self.bytes_sent += meta.size
            self._served.add(self.scheme, meta.size)
        finally:
            view.release()
            self._store.release([loc.lease_id], caller.owner)

    def _send_copy(self, conn, rid: int, head: list, loc) -> None:
        found = self._store.get(loc.key, local_only=True)  # verified
        if found is None:  # gone since the lookup
            self._reply(conn, rid, wire.MISS, head[0])
            return
        data, meta, tier = found
        head[1:6] = [meta.size, meta.checksum, meta.parent, meta.layout, int(tier)]
        self._send_block(conn, wire.encode([rid, wire.BLOCK, head], meta.size), memoryview(data))
        self.bytes_sent += meta.size
        self._served.add(self.scheme, meta.size)

    # ---- PUT ----------------------------------------------------------------------

    # ---- CHECK ----------------------------------------------------------------------

    def _verify(self, conn: socket.socket, link: wire.Wire, caller: Caller, rid: int, args) -> None:
        """A reader got bytes that failed their checksum: read each block through the store, which
        verifies it and drops a corrupt copy, so the next read finds a sound copy or a miss."""
        namespace, keys = fields(args, 2, "Check")
        namespace = self._check(caller.identity, namespace, READ)
        keys = items(keys, "keys")
        self._store.check_batch(keys)
        sound = []
        for key in [BlockKey.checked(namespace, k) for k in keys]:  # InvalidKey before any read
            try:
                found = self._store.get(key, local_only=True)
            except StrataError:  # CorruptBlock: no sound copy was left, and it is gone now
                found = None
            if found is None:
                log.warning("block %s/%s failed its checksum here after a peer read; dropped", namespace,
                            key.key.hex()[:16])
            sound.append(found is not None)
        self._reply(conn, rid, wire.OK, sound)

    def _put(self, conn: socket.socket, link: wire.Wire, caller: Caller, rid: int, args) -> None:
        namespace, timeout_ms, blocks = fields(args, 3, "Put")
        namespace = self._check(caller.identity, namespace, WRITE)
        blocks = items(blocks, "blocks")
        self._store.check_batch(blocks)
        blocks = [put_block(b) for b in blocks]
        total = sum(b[1] for b in blocks)
        if total > self._request_bytes:
            raise InvalidArgument(
                f"a peer write of {total} bytes is over the limit of {self._request_bytes} per request "
                "(--peer-connection-in-flight-bytes): split the batch"
            )
        deadline = self._deadline(count(timeout_ms, "timeout_ms"))
        lease_s = None if deadline is None else min(max(1.0, deadline - time.monotonic()), self._store.limits.lease_s)
        self._budget.take(total, caller.share)
        try:
            grants = self._store.allocate(
                namespace, [(key, size, parent, layout) for key, size, _, parent, layout in blocks],
                lease_s, deadline, caller.owner,
            )
            try:
                self._reply(conn, rid, wire.OK, [g.present for g in grants])
                out = self._receive(conn, link, caller, rid, namespace, blocks, grants)
            finally:
                open_slots = [g.slot_id for g in grants if not g.present]
                if open_slots:  # what was not committed (a broken connection, a refused frame); committed ids are skipped
                    self._store.abort(open_slots, caller.owner)
        finally:
            self._budget.give(total, caller.share)
        # Answered only now: a writer that has its answer finds the budget and the slots given back.
        self._reply(conn, rid, wire.OK, out)

    def _receive(self, conn, link: wire.Wire, caller: Caller, rid: int, namespace: str, blocks, grants) -> list:
        """The Data frame's bytes into the granted slots, each committed; the per-block answers."""
        meta, payload = link.read_meta()
        if not isinstance(meta, list) or len(meta) != 3 or meta[0] != wire.DATA or meta[1] != rid:
            raise InvalidArgument("a peer Put must be followed by its Data frame")
        expect = sum(b[1] for b, g in zip(blocks, grants) if not g.present)
        if payload != expect:
            raise InvalidArgument(f"the Data frame carries {payload} bytes; the blocks not present hold {expect}")
        head = self._store.store_for(namespace).head  # the grants' offsets are its extents
        lapsed: dict[int, LeaseExpired] = {}
        for block, grant in zip(blocks, grants):
            if grant.present:
                continue
            try:
                self._receive_block(link, head, caller, grant, block[1])
            except LeaseExpired as err:
                lapsed[grant.slot_id] = err
            self.bytes_received += block[1]
        out = []
        for block, grant in zip(blocks, grants):
            if grant.present:
                continue
            if grant.slot_id in lapsed:
                out.append([None, wire.error_result(lapsed[grant.slot_id])])
                continue
            try:
                [(_, stored, tier)] = self._store.commit([(grant.slot_id, block[2])], caller.owner)
                out.append([stored, int(tier)])
            except StrataError as err:
                out.append([None, wire.error_result(err)])
        return out

    def _receive_block(self, link: wire.Wire, head: MappableTier, caller: Caller, grant, size: int) -> None:
        """One block's bytes into its slot, written only while the slot's lease is live.

        The store holds the slot's extent for as long as a write into it lasts
        (:meth:`~kvstore.store.group.StoreGroup.writing`): a slot whose lease
        lapsed may already be another block's, so checking the lease and then
        writing would not do. The lease is checked again before each chunk
        lands; once it has lapsed, the rest of the block's bytes are read and
        thrown away (the stream stays in step) and LeaseExpired says to put
        the block again.
        """
        left = link.pending
        try:
            if head.name == TierName.GPU:  # a slot in device memory: received on the host, then copied in
                buf = memoryview(bytearray(size))
                link.read_into(buf)
                with self._store.writing(grant.slot_id, caller.owner):
                    head.write_extent(grant.offset, buf)
                return
            with self._store.writing(grant.slot_id, caller.owner) as slot:
                view = head.view(grant.offset, size)
                try:
                    link.read_into(view, before=slot.check)
                finally:
                    view.release()
        except LeaseExpired:
            link.skip(size - (left - link.pending))
            raise

    # ---- HOLD / RELEASE ------------------------------------------------------------

    @staticmethod
    def _hold_owner(caller: Caller) -> str:
        """Who may end a hold: the calling node's principal (any of its connections), never another's."""
        return f"peer-hold:{caller.identity.principal}"

    def _hold(self, conn: socket.socket, link: wire.Wire, caller: Caller, rid: int, args) -> None:
        namespace, keys, lease_ms = fields(args, 3, "Hold")
        namespace = self._check(caller.identity, namespace, WRITE)  # a hold takes capacity, as a write does
        keys = items(keys, "keys")
        lease_ms = count(lease_ms, "lease_ms")
        if not keys or lease_ms <= 0:
            raise InvalidArgument("a peer Hold names at least one key and a lease of at least 1 ms")
        self._store.check_batch(keys)
        lease_s = min(lease_ms / 1000, self._store.limits.max_lease_s)
        lease, _ = self._store.lease(namespace, keys, REPLICA_LEASE, lease_s, self._hold_owner(caller))
        held = {k.key for k in lease.keys}
        if not held:
            self._store.end_lease(lease.id, REPLICA_LEASE, self._hold_owner(caller))
        self._reply(conn, rid, wire.OK, [lease.id if held else 0, int(lease_s * 1000), [k in held for k in keys]])

    def _release(self, conn: socket.socket, link: wire.Wire, caller: Caller, rid: int, args) -> None:
        [lease_ids] = fields(args, 1, "Release")
        lease_ids = [count(i, "lease id") for i in items(lease_ids, "lease ids")]
        self._store.check_batch(lease_ids)
        out = []
        for lease_id in lease_ids:
            try:
                out.append(self._store.end_lease(lease_id, REPLICA_LEASE, self._hold_owner(caller)))
            except LeaseOwnedElsewhere:
                out.append(False)  # as for an id never issued: a stranger learns nothing of it
        self._reply(conn, rid, wire.OK, out)
