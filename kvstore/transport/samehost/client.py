"""Same-host transport: block bytes through the daemon's arena, control over its Unix socket.

A get is one round trip: Lookup leases the blocks in place and the client
copies each into the caller's buffer while computing the checksum it
verifies. The copy is known good when the lease still held with a margin,
so its Release needs no answer; it rides on the next Lookup instead of
costing a message of its own (on a busy machine each message the daemon
must wake for costs as much as the round trip). Releases wait at most
``RELEASE_DELAY_S`` (a flusher thread sends them when no Lookup came) and
at most ``MAX_PENDING_RELEASES`` of them. A small
put (at most ``inline_bytes``) is one round trip too: its bytes travel in
the request and the daemon checks the checksum the client computed. Larger
blocks are written in place: Allocate, copy, and Commits pipelined with the
next group's copy. Blocks the daemon could not lease in the arena, or whose
copy failed its checksum, are read again through ``fallback`` (the gRPC
stream).

When the daemon's chain starts at the gpu tier, leases and slots are
extents of device memory: with ``gpu`` (the default) the client declares
the capability, maps each region once through its handle and copies
leased bytes out of it (and slot bytes into it) itself; without, its reads
of those blocks go through ``fallback`` and its puts inline or through
``fallback`` (see :mod:`kvstore.transport.samehost.regions`). The location table is
kept for arena extents only: a device extent is always asked for.

Thread-safe: each call takes a connection from a small pool (a connection
carries one request at a time), so threads do not queue behind each other.
What each request says and what its answer means is
:mod:`kvstore.transport.samehost.protocol`, which the asyncio twin
(:mod:`kvstore.transport.samehost.client_aio`) drives too; this module
holds only the waiting: connections, the flusher thread, the pipelined Commits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from kvstore.block import TierName
from kvstore.errors import ArenaUnusable, DaemonUnavailable, InvalidArgument, StrataError
from kvstore.shm.arena import Prefault, ShmArena
from kvstore.transport import arena_io
from kvstore.transport.base import Block, BlockPut, Deadline, Place, Transport
from kvstore.transport.samehost import frames, protocol, regions
from kvstore.transport.samehost.conn import _Connection, _timeout_ms
from kvstore.transport.samehost.locations import Locations
from kvstore.transport.samehost.protocol import (  # noqa: F401 - the constants' old home
    DEFAULT_LOCATIONS, INLINE_BYTES, MAX_PENDING_RELEASES, MAX_TOUCHED, RELEASE_DELAY_S, stale_attachment,
)

MAX_IDLE_CONNECTIONS = 8


class SameHostTransport(Transport):
    """See the module docstring. ``arena`` and ``fallback`` stay the caller's to close."""

    name = "same-host"
    shared_memory = True

    def __init__(self, arena: ShmArena, socket_path: str, token: bytes, *, fallback: Transport | None = None,
                 lease_ms: int = 0, inline_bytes: int = INLINE_BYTES,
                 locations: int = DEFAULT_LOCATIONS, gpu: bool = True) -> None:
        self._arena = arena
        self._path = socket_path
        self._token = bytes(token)
        self._fallback = fallback
        self._lease_ms = lease_ms
        self._inline = inline_bytes
        self._lock = threading.Lock()
        self._idle: list[_Connection] = []
        self._closed = False
        self._pending: list[int] = []  # read leases to release with the next Lookup
        self._flusher: threading.Thread | None = None
        self._wake = threading.Condition(self._lock)
        self._touched: dict[str, dict[bytes, None]] = {}  # read without asking: reported for recency
        self._caps = [regions.CAPABILITY] if gpu else []
        self._regions = regions.Regions()
        first = _Connection(socket_path, self._token, self._caps)  # fail now, not on the first call, when unusable
        self._locations: Locations | None = None
        if locations and first.removal_page:
            try:
                self._locations = Locations(first.removal_page, self._token, locations)
            except ArenaUnusable:
                first.close()
                raise
        self._give(first)
        self._hello = first.hello
        self.device_tensors = first.hello.device_tensors
        self._prefault = Prefault(arena) if self._hello.prefaults_arena() else None
        self._batch_bytes = arena.size // 4

    # ---- connections ---------------------------------------------------------

    def _take(self) -> _Connection:
        with self._lock:
            if self._closed:
                raise DaemonUnavailable("the transport is closed")
            if self._idle:
                return self._idle.pop()
        return self._connect()

    def _connect(self) -> _Connection:
        """A new connection. The daemon accepted this token at the first Hello, so refusing it
        now means another daemon answers on the socket (a restart): what this transport
        attached is gone, and the client must attach again."""
        try:
            conn = _Connection(self._path, self._token, self._caps)
        except InvalidArgument as err:
            raise stale_attachment(err) from None
        self._regions.keep_only(conn.regions)  # a restarted daemon's regions: the old mappings are dead
        return conn

    @property
    def writes_in_place(self) -> bool:
        """Whether large blocks are written into slots (False: a gpu head without regions for this client)."""
        return self._hello.in_place

    @property
    def mapped_regions(self) -> int:
        """How many gpu regions this transport has mapped (each once, by handle)."""
        return self._regions.mapped()

    def _give(self, conn: _Connection) -> None:
        with self._lock:
            if not conn.broken and not self._closed and len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append(conn)
                return
            # A connection the daemon closed: the idle ones most likely went with it (a daemon
            # restart). Drop them too, so the next calls connect afresh instead of each
            # finding a dead socket in turn.
            idle = [] if not conn.broken else self._idle
            if conn.broken:
                self._idle = []
        conn.close()
        for other in idle:
            other.close()

    def close(self) -> None:
        """Send pending releases, then close every connection."""
        with self._lock:
            pending, self._pending = self._pending, []
            flusher, self._flusher = self._flusher, None
            self._closed = True
            self._wake.notify_all()
            idle, self._idle = self._idle, []
        if pending and idle:
            idle[0].notify(frames.RELEASE, [pending])
        for conn in idle:
            conn.close()
        if flusher is not None:
            flusher.join(1.0)
        if self._prefault is not None:
            self._prefault.stop()
        if self._locations is not None:
            self._locations.close()
        self._regions.close()

    # ---- releases ------------------------------------------------------------

    def _release_later(self, conn: _Connection, lease_ids: list[int]) -> None:
        with self._lock:
            self._pending += lease_ids
            over = len(self._pending) > MAX_PENDING_RELEASES
            if over:
                lease_ids, self._pending = self._pending, []
            else:
                self._start_flusher()
        if over:
            conn.notify(frames.RELEASE, [lease_ids])

    def _take_pending(self) -> list[int]:
        with self._lock:
            pending, self._pending = self._pending, []
            return pending

    def _touch_later(self, namespace: str, keys: list[bytes]) -> None:
        with self._lock:
            touched = self._touched.setdefault(namespace, {})
            if len(touched) < MAX_TOUCHED:  # beyond it recency is approximate, never unbounded
                touched.update(dict.fromkeys(keys))
            self._start_flusher()

    def _start_flusher(self) -> None:
        if self._flusher is None and not self._closed:
            self._flusher = threading.Thread(target=self._flush_loop, name="strata-release", daemon=True)
            self._flusher.start()

    def _flush_loop(self) -> None:
        """Send releases that waited RELEASE_DELAY_S for a Lookup to carry them, and the keys read without asking."""
        while True:
            with self._lock:
                while not self._closed and not (self._pending or self._touched):
                    self._wake.wait(RELEASE_DELAY_S)
                if self._closed:
                    return
            time.sleep(RELEASE_DELAY_S)
            with self._lock:
                if self._closed:
                    return
                pending, self._pending = self._pending, []
                touched, self._touched = self._touched, {}
                conn = self._idle.pop() if self._idle else None
            if not (pending or touched):
                continue  # a Lookup carried them
            if conn is None:
                try:
                    conn = self._connect()
                except StrataError:
                    continue  # the daemon is gone: the leases expire by themselves
            if pending:
                conn.notify(frames.RELEASE, [pending])
            for namespace, keys in touched.items():
                conn.notify(frames.TOUCH, [namespace, list(keys)])
            self._give(conn)

    def touch(self, namespace: str, keys: Sequence[bytes]) -> None:
        """Tell the daemon these blocks were used (recency), with the next flush; no reply."""
        if keys:
            self._touch_later(namespace, list(keys))

    def exists(self, namespace: str, keys: Sequence[bytes], deadline: Deadline) -> list[TierName] | None:
        """One Exists on the socket (no leases taken): a prefix chain's leading hits; None when the
        daemon answers Exists over gRPC only."""
        if not self._hello.exists:
            return None
        conn = self._take()
        try:
            answer = conn.call(frames.EXISTS, [namespace, list(keys)], deadline=deadline)
        finally:
            self._give(conn)
        return protocol.exists_answer(answer)

    # ---- reads ---------------------------------------------------------------

    def get_into(self, namespace: str, keys: Sequence[bytes], place: Place | None,
                 deadline: Deadline) -> list[Block | None]:
        keys = list(keys)
        if not keys:
            return []
        deadline.check()
        read = protocol.Read(namespace, keys, place, self._locations)
        if self._locations is not None:
            copies = read.known_copies()
            if copies:
                touched = read.known_copied(copies, protocol.copy_out(self._arena, self._regions, [], copies))
                if touched:
                    self._touch_later(namespace, touched)
        if read.todo:
            self._lookup_into(read, deadline)
        return read.blocks

    def _lookup_into(self, read: protocol.Read, deadline: Deadline) -> None:
        """One Lookup for the keys left; copies under its leases; refetches what it could not read."""
        conn = self._take()
        releases = self._take_pending()
        try:
            try:
                answer = conn.call(frames.LOOKUP, read.lookup_args(self._lease_ms, _timeout_ms(deadline), releases),
                                   deadline=deadline)
            except StrataError:
                if releases:  # in case the Lookup failed before releasing them
                    conn.notify(frames.RELEASE, [releases])
                raise
            try:
                read.answered(answer, arena_io.now_ms())
            except StrataError:
                conn.close()
                raise
            try:
                copies = read.leased_copies()
                read.leased_copied(copies, protocol.copy_out(self._arena, self._regions, conn.regions, copies))
            except BaseException:  # a placement refused: give every lease of the read back now
                conn.notify(frames.RELEASE, [read.lease_ids])
                raise
            if read.release_now():
                read.released(conn.call(frames.RELEASE, [read.lease_ids], deadline=deadline))
            elif read.lease_ids:
                self._release_later(conn, read.lease_ids)
        finally:
            self._give(conn)
        read.learn()
        if read.refetch:
            if self._fallback is None:
                raise StrataError("blocks the daemon could not lease in the arena need a fallback transport to be read")
            read.refetched(self._fallback.get_into(read.namespace, read.refetch_keys(), read.again(), deadline))

    # ---- writes --------------------------------------------------------------

    def put(self, namespace: str, blocks: Sequence[BlockPut], deadline: Deadline) -> list[bool]:
        # Without slots to write in place (a gpu head, no capability): inline up to a frame, streamed beyond.
        put = protocol.Put(namespace, blocks, self._inline if self._hello.in_place else self._hello.max_inline,
                           in_place=self._hello.in_place)
        if put.inline:
            self._put_inline(put, deadline)
        if put.large and not self._hello.in_place:
            if self._fallback is None:
                raise StrataError("blocks the daemon cannot take in place need a fallback transport to be put")
            put.stored_elsewhere(self._fallback.put(namespace, put.staged(), deadline))
            return put.results
        for batch in put.slot_batches(self._batch_bytes):
            self._put_in_place(put, batch, deadline)
        return put.results

    def _put_inline(self, put: protocol.Put, deadline: Deadline) -> None:
        conn = self._take()
        try:
            for part in put.inline_parts(conn.hello):
                args, payload = put.put_frame(part, _timeout_ms(deadline))
                put.stored(part, conn.call(frames.PUT, args, payload, deadline=deadline))
        finally:
            self._give(conn)

    def _put_in_place(self, put: protocol.Put, indices: list[int], deadline: Deadline) -> None:
        conn = self._take()
        slots: list[protocol.Slot] = []
        unread = 0
        try:
            answer = conn.call(frames.ALLOCATE, put.allocate_args(indices, self._lease_ms, _timeout_ms(deadline)),
                               deadline=deadline)
            received = arena_io.now_ms()
            lease_deadline, slots = put.granted(indices, answer)
            sent: list[tuple[int, list[protocol.Slot]]] = []
            for group in put.commit_groups(slots):
                protocol.check_slot_lease(lease_deadline, received)
                sums = put.copy_in(self._arena, self._regions, conn.regions, group, deadline.check)
                sent.append((conn.send(frames.COMMIT, protocol.commit_args(group, sums), deadline=deadline), group))
                unread += 1
            for rid, group in sent:  # the daemon checksummed each group while the next was copied
                unread -= 1
                put.stored([s.index for s in group], conn.reply(rid, deadline))
            slots = []
        except BaseException:
            if unread:
                conn.close()  # replies still on their way would be taken for the next call's
            if slots:
                self._abort(conn, [s.slot_id for s in slots])
            raise
        finally:
            self._give(conn)

    def _abort(self, conn: _Connection, slots: list[int]) -> None:
        """Give slots back (committed ones are skipped by the daemon); on a fresh socket if this one broke."""
        if conn.broken:
            try:
                conn = self._connect()
            except StrataError:
                return  # the slots expire by themselves
            conn.notify(frames.ABORT, [slots])
            conn.close()
            return
        conn.notify(frames.ABORT, [slots])
