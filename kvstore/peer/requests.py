"""What each peer request does to the store: READ, PUT, CHECK, HOLD and RELEASE.

:class:`~kvstore.peer.server.PeerServer` takes connections, their Hello and
their frames, and hands each request here with the caller it authenticated.

A read leases each block in place in its arena
(:meth:`~kvstore.store.group.StoreGroup.lookup`, as a same-host client does)
and hands it to the socket straight out of the mapping, with its frame head,
in one ``sendmsg``; the lease is given back as soon as the kernel has taken
the bytes. The kernel copies them into the socket's buffers, so a slot
reused after that cannot change what is in flight; why not ``sendfile``,
which would pass the arena's pages by reference (and on loopback cost both
sides more CPU, not less). A block the store could not bring into RAM (the
head is full of pinned blocks) goes out of the store's verified copy
(:meth:`get`). The reader verifies every block it receives; the sender does
not hash what it sends (that pass cost as much as the copy into the
socket). A reader whose bytes failed their checksum sends CHECK for those
keys: the store reads each through its verifying path, which drops a
corrupt copy, so the next read finds a sound copy or a miss (bytes
corrupted in transit leave the holder's sound copy where it is).

A write reserves arena slots for the blocks (Allocate), receives their
bytes straight into the slots and commits each with the writer's checksum,
which the store verifies. Bytes go into a slot only while its lease is
live, inside the store's ``writing``, which keeps the extent from reuse
while they land: a writer late with its Data frame (slow, or on purpose)
would otherwise write over whatever block the arena gave that extent to
since. A block whose lease lapsed first is read off the socket and
dropped, and answered LeaseExpired.

A HOLD pins blocks held here under a lease of kind :data:`REPLICA_LEASE` on
behalf of another node's pin (the copies it made of a pinned prefix, see
:mod:`kvstore.replication.pin_copies`); the hold is bound to the caller's
principal, not to its connection, so the pinning node may end it (RELEASE)
over any pooled connection, and it ends by itself at its deadline when that
node dies first.

Each request's namespace is authorized like the gRPC interceptor does (read
for READ and CHECK, write for PUT and HOLD), before the store is touched, so
a namespace the caller may not use reads the same whether or not it exists.
Block bytes in flight are taken from the listener's byte budget: per block
on reads, per request on writes.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from collections.abc import Callable

from kvstore.auth import READ, WRITE, Authority
from kvstore.auth.identity import Caller, Identity
from kvstore.block import BlockKey, TierName, validate_namespace
from kvstore.errors import (
    DeadlineExceeded, InvalidArgument, LeaseExpired, LeaseOwnedElsewhere, Overloaded, StrataError, UnknownNamespace,
)
from kvstore.metrics import StoreMetrics
from kvstore.peer import wire
from kvstore.peer.fields import count, fields, items, put_block
from kvstore.peer.served import ServedBytes
from kvstore.rpc.status import code_for
from kvstore.store.group import StoreGroup
from kvstore.store.leases import LeaseKind
from kvstore.tiers.base import MappableTier
from kvstore.wire.budget import ByteBudget

log = logging.getLogger(__name__)

REPLICA_LEASE = LeaseKind("replica")  # a copy pinned here for another node's pin (HOLD)


class Refused(Exception):
    """A whole request refused part-way through its reply: the error frame is sent, the connection goes on."""

    def __init__(self, err: StrataError) -> None:
        self.err = err


def reply(conn: socket.socket, rid: int, status: int, result) -> None:
    wire.send(conn, wire.encode([rid, status, result]))


class PeerRequests:
    """The peer protocol's operations on one store group, for every connection of a listener.

    ``send_block``: how a BLOCK reply's head and bytes leave (over TCP in one
    ``sendmsg``; a UCX listener sends them its own way); ``scheme``: the
    label the bytes each read sends are counted under in ``served``."""

    def __init__(self, store: StoreGroup, authority: Authority, metrics: StoreMetrics, budget: ByteBudget,
                 request_bytes: int, served: ServedBytes, scheme: str,
                 send_block: Callable[[socket.socket, bytes, memoryview], None]) -> None:
        self._store = store
        self._authority = authority
        self._metrics = metrics
        self._budget = budget
        self._request_bytes = request_bytes
        self._served = served
        self._scheme = scheme
        self._send_block = send_block
        self.bytes_sent = 0
        self.bytes_received = 0

    def handlers(self) -> dict[int, Callable]:
        """Each operation's handler, ``(conn, link, caller, request id, args)``; each answers on ``conn``."""
        return {wire.READ: self.read, wire.PUT: self.put, wire.CHECK: self.check, wire.HOLD: self.hold,
                wire.RELEASE: self.release}

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

    def read(self, conn: socket.socket, link: wire.Wire, caller: Caller, rid: int, args) -> None:
        namespace, keys, timeout_ms, with_bytes = fields(args, 4, "Read")
        namespace = self._check(caller.identity, namespace, READ)
        keys = items(keys, "keys")
        self._store.check_batch(keys)
        deadline = self._deadline(count(timeout_ms, "timeout_ms"))
        for i, key in enumerate(keys):
            if deadline is not None and time.monotonic() >= deadline:
                raise Refused(DeadlineExceeded(
                    f"the read's deadline passed after {i} of {len(keys)} blocks: retry the rest with a longer timeout"
                ))
            try:
                self._read_one(conn, caller, rid, i, namespace, key, deadline, bool(with_bytes))
            except UnknownNamespace as err:
                raise Refused(err) from None  # the whole batch's namespace, not this key
            except StrataError as err:  # this key only (a bad key, a corrupt copy, a failing tier)
                self._metrics.rpc_errors.labels("PeerRead", code_for(err).name).inc()
                reply(conn, rid, wire.FAILED, [i, wire.error_result(err)])
        reply(conn, rid, wire.OK, len(keys))

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
            reply(conn, rid, wire.MISS, i)
            return
        meta = loc.meta
        head = [i, meta.size, meta.checksum, meta.parent, meta.layout, int(loc.tier)]
        if not with_bytes:
            reply(conn, rid, wire.BLOCK, head)
            return
        try:
            self._budget.take(meta.size, caller.share)
        except Overloaded as err:
            if loc.lease_id:
                self._store.release([loc.lease_id], caller.owner)
            raise Refused(err) from None
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
            self._served.add(self._scheme, meta.size)
        finally:
            view.release()
            self._store.release([loc.lease_id], caller.owner)

    def _send_copy(self, conn, rid: int, head: list, loc) -> None:
        found = self._store.get(loc.key, local_only=True)  # verified
        if found is None:  # gone since the lookup
            reply(conn, rid, wire.MISS, head[0])
            return
        data, meta, tier = found
        head[1:6] = [meta.size, meta.checksum, meta.parent, meta.layout, int(tier)]
        self._send_block(conn, wire.encode([rid, wire.BLOCK, head], meta.size), memoryview(data))
        self.bytes_sent += meta.size
        self._served.add(self._scheme, meta.size)

    # ---- CHECK ----------------------------------------------------------------------

    def check(self, conn: socket.socket, link: wire.Wire, caller: Caller, rid: int, args) -> None:
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
        reply(conn, rid, wire.OK, sound)

    # ---- PUT ----------------------------------------------------------------------

    def put(self, conn: socket.socket, link: wire.Wire, caller: Caller, rid: int, args) -> None:
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
                reply(conn, rid, wire.OK, [g.present for g in grants])
                out = self._receive(conn, link, caller, rid, namespace, blocks, grants)
            finally:
                open_slots = [g.slot_id for g in grants if not g.present]
                if open_slots:  # what was not committed (a broken connection, a refused frame); committed ids are skipped
                    self._store.abort(open_slots, caller.owner)
        finally:
            self._budget.give(total, caller.share)
        # Answered only now: a writer that has its answer finds the budget and the slots given back.
        reply(conn, rid, wire.OK, out)

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

    def hold(self, conn: socket.socket, link: wire.Wire, caller: Caller, rid: int, args) -> None:
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
        reply(conn, rid, wire.OK, [lease.id if held else 0, int(lease_s * 1000), [k in held for k in keys]])

    def release(self, conn: socket.socket, link: wire.Wire, caller: Caller, rid: int, args) -> None:
        [lease_ids] = fields(args, 1, "Release")
        lease_ids = [count(i, "lease id") for i in items(lease_ids, "lease ids")]
        self._store.check_batch(lease_ids)
        out = []
        for lease_id in lease_ids:
            try:
                out.append(self._store.end_lease(lease_id, REPLICA_LEASE, self._hold_owner(caller)))
            except LeaseOwnedElsewhere:
                out.append(False)  # as for an id never issued: a stranger learns nothing of it
        reply(conn, rid, wire.OK, out)
