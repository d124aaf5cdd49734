"""The daemon's same-host control socket: the store's arena calls without gRPC's per-call cost.

A client on the daemon's host maps the arena (block bytes move there) and
sends its control messages here: Lookup and Release around an in-place
read, Allocate and Commit around an in-place write, and whole small blocks
inline (one round trip per put). The format is :mod:`kvstore.transport.samehost.frames`.

Why threads with blocking sockets: a connection's requests are served in
order, one at a time, by the connection's own thread, which sleeps in
``recv`` between them; the store call dominates, and a thread per
connection adds no hop (a selector loop handing requests to a pool would add
two thread switches per request, ~20 us here). The cost is one thread per
connected client, so connections are limited.

Limits: ``max_connections`` at once, at most ``per_uid`` of them from one
uid (one more is told Overloaded, with a retry delay, and closed: no user's
processes take the socket from the others); a Hello of at most
:data:`~kvstore.transport.samehost.frames.MAX_HELLO_BYTES`, whole within
:data:`HELLO_TIMEOUT_S` of the accept however slowly its bytes come; one
request in flight per connection (the next
is not read until the reply is sent; the kernel's socket buffer bounds what
a client can queue); frames within :mod:`~kvstore.transport.samehost.frames` limits;
a connection idle for ``idle_s``, or whose client stops reading its
replies for as long, is closed (the client reconnects). A
client that dies leaves its leases and slots to expire as on gRPC.

When the chain starts at the gpu tier, Lookup leases and Allocate slots
are extents of device memory: a client that declares the ``gpu``
capability in its Hello is answered the regions' handles and addresses
each extent by region and offset; any other client is never handed a
device offset (its reads go through its fallback, its in-place writes are
refused so it puts inline or through the stream). See
:mod:`kvstore.transport.samehost.regions`.

The first frame must be a Hello carrying the arena's token: the socket file
is created 0600 next to the arena (``mode``), and the token proves the client mapped
this daemon's arena rather than a stale one. The connecting uid (SO_PEERCRED)
is the connection's identity (:class:`kvstore.auth.peers.PeerGate`): each
request's namespace is checked against it, and its slots and leases are
bound to the connecting process.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable

from kvstore.auth import READ, WRITE, owner_of
from kvstore.auth.identity import set_caller
from kvstore.auth.peers import PeerGate, peer_credentials
from kvstore.block import BlockKey, BlockMeta, TierName
from kvstore.errors import ArenaUnusable, InvalidArgument, LeaseOwnedElsewhere, Overloaded, StrataError
from kvstore.metrics import StoreMetrics
from kvstore.rpc.status import code_for
from kvstore.store.api import Store
from kvstore.wire.listeners import ConnectionTable, accept_loop, stop_listening
from kvstore.shares import Shares
from kvstore.transport.samehost import frames
from kvstore.transport.samehost import regions
from kvstore.transport.samehost.locations import RemovalPage
from kvstore.wire.unix import bind_unix, set_kernel_timeouts

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0  # a connection whose Hello is not whole this soon after its accept is dropped


def _lease_s(lease_ms) -> float | None:
    return lease_ms / 1000 if lease_ms else None


def _deadline(timeout_ms) -> float | None:
    return time.monotonic() + timeout_ms / 1000 if timeout_ms else None


def _unix_ms(deadline_monotonic: float) -> int:
    return int((time.time() + (deadline_monotonic - time.monotonic())) * 1000)


def _fields(value, n: int, what: str) -> list:
    """A request part that must be a list of ``n`` fields (msgpack arrays decode as lists)."""
    if not isinstance(value, list) or len(value) != n:
        raise InvalidArgument(f"malformed same-host {what}: expected {n} fields, got {value!r:.80}")
    return value


def _list(value, what: str) -> list:
    if not isinstance(value, list):
        raise InvalidArgument(f"malformed same-host request: {what} is not a list")
    return value


def _int(value, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgument(f"malformed same-host request: {what} is not a non-negative integer")
    return value


def _ints(values, what: str) -> list[int]:
    for v in _list(values, what):
        _int(v, what)
    return values


class SameHostServer:
    """Serves one store's arena calls on a Unix socket. :meth:`start`, then :meth:`stop`."""

    def __init__(self, store: Store, path: str, token: bytes, *, metrics: StoreMetrics | None = None,
                 max_connections: int = 64, idle_s: float = 300.0, gate: PeerGate | None = None,
                 mode: int = 0o600, per_uid: int = 0) -> None:
        self._store = store
        self._gate = gate if gate is not None else PeerGate()
        self._mode = mode
        self._metrics = metrics if metrics is not None else store.metrics
        self.path = path
        self._token = bytes(token)
        self._max_connections = max_connections
        self._idle_s = idle_s
        self._listener: socket.socket | None = None
        self._removals: RemovalPage | None = None
        self._acceptor: threading.Thread | None = None
        self._connections = ConnectionTable(max_connections)
        self._uids = Shares(per_uid or max(1, max_connections // 2), "same-host connections",
                            "--same-host-max-connections-per-uid", retry_after_s=0.5)
        self._head = store.head  # Lookup's leases and Allocate's slots are its extents
        self._gpu = self._head.name == TierName.GPU  # device memory: only a client with the gpu capability maps it
        self._session = threading.local()  # per connection (one thread each): whether it reads gpu regions
        handlers = {
            frames.LOOKUP: self._lookup, frames.RELEASE: self._release, frames.PUT: self._put,
            frames.ALLOCATE: self._allocate, frames.COMMIT: self._commit, frames.ABORT: self._abort,
            frames.TOUCH: self._touch, frames.EXISTS: self._exists,
        }
        # Per operation: its handler and its latency series, bound once (labels cost a lookup per call).
        m = self._metrics
        self._ops = {op: (fn, m.op_latency.labels(frames.OP_NAMES[op]), frames.OP_NAMES[op]) for op, fn in handlers.items()}

    @property
    def connections(self) -> int:
        return len(self._connections)

    def start(self) -> SameHostServer:
        self._removals = RemovalPage(self.path + ".removals", self._token)
        self._listener = bind_unix(self.path, mode=self._mode)
        self._listener.listen(128)
        self._acceptor = threading.Thread(target=self._accept_loop, name="strata-samehost-accept", daemon=True)
        self._acceptor.start()
        log.info("same-host block path on %s", self.path)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, close every connection, remove the socket file and the removal page."""
        self.removed()  # clients stop trusting what they remember of this arena
        stop_listening(self._listener, self._acceptor, self._connections.close(), timeout)
        if self._listener is not None:  # bound by us: ours to remove
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        if self._removals is not None:
            self._removals.close()

    def removed(self, namespace: str | None = None, keys: Iterable[bytes] = ()) -> None:
        """These blocks were deleted (every block, without ``namespace``): clients forget where they saw
        them (see kvstore.transport.samehost.locations).

        Called after the store deleted and before the Delete answers."""
        if self._removals is not None:
            self._removals.bump(namespace, keys)

    # ---- connections ---------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        accept_loop(self._listener, self._connections, name="strata-samehost",
                    serve=lambda conn, _: self._serve(conn), refuse=self._refuse)

    def _refuse(self, conn: socket.socket, err: Overloaded | None = None) -> None:
        err = err or Overloaded(
            f"the same-host socket serves at most {self._max_connections} connections: retry later, "
            "or share one client between threads", retry_after_s=0.5,
        )
        try:
            conn.settimeout(1.0)
            frames.send(conn, frames.encode([0, frames.ERROR, frames.error_result(err)]))
        except OSError:
            pass  # the client went away first
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            uid = f"uid {peer_credentials(conn)[1]}"
        except OSError:
            conn.close()  # gone before it was served
            return
        try:
            self._uids.take(uid)
        except Overloaded as err:
            self._refuse(conn, err)
            return
        reader = frames.FrameReader(conn, max_meta=frames.MAX_HELLO_BYTES, max_payload=0)
        try:
            if self._hello(conn, reader):
                reader.limit(max_meta=frames.MAX_META_BYTES, max_payload=frames.MAX_PAYLOAD_BYTES)
                self._loop(conn, reader)
        except (EOFError, ConnectionError, TimeoutError, BlockingIOError):
            pass  # the client closed, died, idled out or stopped reading: its leases expire
        except OSError as err:
            log.debug("same-host connection ended: %s", err)
        except Exception:  # noqa: BLE001 - a bug in serving one request ends that connection, not the daemon
            log.exception("same-host connection closed after an unexpected error")
        finally:
            self._uids.give(uid)
            conn.close()

    def _hello(self, conn: socket.socket, reader: frames.FrameReader) -> bool:
        try:
            meta, _ = reader.read(deadline=time.monotonic() + HELLO_TIMEOUT_S)
            op, rid, args = _fields(meta, 3, "request")
            if op != frames.HELLO:
                raise InvalidArgument("the first frame on the same-host socket must be Hello")
            if not isinstance(args, list) or len(args) not in (2, 3):  # [version, token(, capabilities)]
                raise InvalidArgument(f"malformed same-host Hello: expected 2 or 3 fields, got {args!r:.80}")
            version, token, *caps = args
            caps = _list(caps[0], "the Hello's capabilities") if caps else []
            if not isinstance(version, int) or not frames.MIN_PROTOCOL_VERSION <= version <= frames.PROTOCOL_VERSION:
                raise InvalidArgument(
                    f"same-host protocol {version} is not among the daemon's {frames.MIN_PROTOCOL_VERSION}.."
                    f"{frames.PROTOCOL_VERSION}: upgrade the client or the daemon so they match"
                )
            if not isinstance(token, bytes) or not hmac.compare_digest(token, self._token):
                raise InvalidArgument("the arena token does not match this daemon's: attach again")
            set_caller(self._gate.admit(conn))  # this connection's thread serves only this caller
        except (TypeError, ValueError) as err:
            self._reply_error(conn, 0, InvalidArgument(f"malformed Hello frame ({err})"))
            return False
        except StrataError as err:
            self._reply_error(conn, 0, err)
            return False
        gpu = self._gpu and version >= 2 and regions.CAPABILITY in caps
        self._session.gpu = gpu  # this connection is handed the regions, and device offsets in its answers
        limits = [frames.MAX_META_BYTES, frames.MAX_PAYLOAD_BYTES, self._store.limits.max_batch_blocks,
                  self._removals.path if self._removals is not None else ""]
        if version >= 2:
            head = TierName.GPU if self._gpu else TierName.HOST
            handles = [regions.to_wire(h) for h in self._head.handles()] if gpu else []
            limits.append({"tier": int(head), "regions": handles, "prefault": self._head.prefaults, "exists": True})
        frames.send(conn, frames.encode([rid, frames.OK, limits]))
        return True

    def _loop(self, conn: socket.socket, reader: frames.FrameReader) -> None:
        # One timeout for both directions, kept by the kernel (see set_kernel_timeouts):
        # a client idle this long, or not reading its replies, is dropped.
        conn.settimeout(None)
        set_kernel_timeouts(conn, self._idle_s)
        while True:
            try:
                meta, payload = reader.read()
            except frames.FrameError as err:
                self._reply_error(conn, 0, err)
                return  # the stream cannot be resynchronised
            rid, name = 0, "Unknown"
            t0 = time.perf_counter()
            try:
                op, rid, args = _fields(meta, 3, "request")
                if not isinstance(rid, int):
                    raise InvalidArgument("malformed same-host request: its id is not an integer")
                if not isinstance(op, int):
                    raise InvalidArgument(f"malformed same-host request: its operation is a {type(op).__name__}, "
                                          "not an integer")
                handler, latency, name = self._ops.get(op) or (None, None, "Unknown")
                if handler is None:
                    raise InvalidArgument(f"unknown same-host operation {op!r}: upgrade the daemon or the client")
                result = handler(args, payload)
                latency.observe(time.perf_counter() - t0)
            except StrataError as err:
                self._failed(conn, rid, name, err)
                continue
            if rid:
                frames.send(conn, frames.encode([rid, frames.OK, result]))

    def _failed(self, conn: socket.socket, rid: int, op: str, err: StrataError) -> None:
        self._metrics.rpc_errors.labels(op, code_for(err).name).inc()
        if rid:
            self._reply_error(conn, rid, err)

    def _reply_error(self, conn: socket.socket, rid: int, err: StrataError) -> None:
        try:
            frames.send(conn, frames.encode([rid, frames.ERROR, frames.error_result(err)]))
        except OSError:
            pass  # the client is gone

    # ---- operations: translate to store calls, nothing more --------------------

    def _lookup(self, args, payload) -> list:
        namespace, keys, lease_ms, timeout_ms, release_ids = _fields(args, 5, "Lookup")
        keys, release_ids = _list(keys, "keys"), _ints(release_ids, "release_ids")
        lease_ms, timeout_ms = _int(lease_ms, "lease_ms"), _int(timeout_ms, "timeout_ms")
        if release_ids:
            self._store.release(release_ids, owner_of())
        self._gate.check(namespace, READ)
        lease_s = _lease_s(lease_ms)
        found = self._store.lookup(namespace, keys, lease_s, _deadline(timeout_ms), owner_of())
        lease_deadline = time.monotonic() + (lease_s or self._store.limits.lease_s)
        out = []
        unusable = []  # leases on gpu extents a client without the capability cannot reach
        for loc in found:
            if loc is None:
                out.append(None)
                continue
            m = loc.meta
            entry = [m.size, m.checksum, m.parent, m.layout, loc.offset, loc.lease_id, int(loc.tier)]
            if self._gpu and loc.lease_id:
                if self._session.gpu:
                    region, entry[4] = self._head.handle_of(loc.offset)
                    entry.append(region)
                else:
                    unusable.append(loc.lease_id)
                    entry[4] = entry[5] = 0  # found, not leased: the client reads it through its fallback
            out.append(entry)
        if unusable:
            self._store.release(unusable, owner_of())
        return [_unix_ms(lease_deadline), out]

    def _release(self, args, payload) -> list:
        [lease_ids] = _fields(args, 1, "Release")
        return self._store.release(_ints(lease_ids, "lease_ids"), owner_of())

    def _put(self, args, payload) -> list:
        namespace, timeout_ms, blocks = _fields(args, 3, "Put")
        self._gate.check(namespace, WRITE)
        self._store.check_batch(_list(blocks, "blocks"))
        blocks = [_fields(b, 5, "Put block") for b in blocks]
        for b in blocks:
            _int(b[1], "size"), _int(b[2], "checksum")
        timeout_ms = _int(timeout_ms, "timeout_ms")
        if sum(b[1] for b in blocks) != len(payload):
            raise InvalidArgument(f"the blocks declare {sum(b[1] for b in blocks)} bytes but {len(payload)} came")
        deadline = _deadline(timeout_ms)
        out, at = [], 0
        for key, size, sum_, parent, layout in blocks:
            meta = BlockMeta(size, sum_, parent or None, layout)
            stored, tier = self._store.put(BlockKey.checked(namespace, key), payload[at : at + size], meta, deadline)
            at += size
            out.append([stored, int(tier)])
        return out

    def _allocate(self, args, payload) -> list:
        namespace, lease_ms, timeout_ms, blocks = _fields(args, 4, "Allocate")
        self._gate.check(namespace, WRITE)
        lease_ms, timeout_ms = _int(lease_ms, "lease_ms"), _int(timeout_ms, "timeout_ms")
        blocks = [tuple(_fields(b, 4, "Allocate block")) for b in _list(blocks, "blocks")]
        for b in blocks:
            _int(b[1], "size")
        if self._gpu and not self._session.gpu:
            raise ArenaUnusable("this daemon's slots are in the gpu tier, which a client without the gpu capability "
                                "cannot write: put inline or through the gRPC stream (or upgrade the client)")
        lease_s = _lease_s(lease_ms)
        grants = self._store.allocate(namespace, blocks, lease_s, _deadline(timeout_ms), owner_of())
        lease_deadline = time.monotonic() + (lease_s or self._store.limits.lease_s)
        if not self._gpu:
            return [_unix_ms(lease_deadline), [[g.present, g.slot_id, g.offset] for g in grants]]
        out = []
        for g in grants:
            region, local = self._head.handle_of(g.offset) if not g.present else (0, 0)
            out.append([g.present, g.slot_id, local, region])
        return [_unix_ms(lease_deadline), out]

    def _commit(self, args, payload) -> list:
        slot_ids, sums = _fields(args, 2, "Commit")
        slot_ids, sums = _ints(slot_ids, "slot_ids"), _ints(sums, "checksums")
        if len(sums) != len(slot_ids):
            raise InvalidArgument(f"Commit names {len(slot_ids)} slots but {len(sums)} checksums: send one per slot")
        try:
            done = self._store.commit(list(zip(slot_ids, sums)), owner_of())
        except LeaseOwnedElsewhere as err:
            raise err.stranger_view from None
        return [[stored, int(tier)] for _, stored, tier in done]

    def _touch(self, args, payload) -> None:
        """Blocks a client read without asking: refresh their recency."""
        namespace, keys = _fields(args, 2, "Touch")
        self._gate.check(namespace, READ)
        self._store.touch(namespace, _list(keys, "keys"))

    def _exists(self, args, payload) -> list[int]:
        """The tier of each leading present block of a prefix chain, as the gRPC Exists answers."""
        namespace, keys = _fields(args, 2, "Exists")
        self._gate.check(namespace, READ)
        return [int(tier) for tier in self._store.exists(namespace, _list(keys, "keys"))]

    def _abort(self, args, payload) -> None:
        [slot_ids] = _fields(args, 1, "Abort")
        self._store.abort(_ints(slot_ids, "slot_ids"), owner_of())
