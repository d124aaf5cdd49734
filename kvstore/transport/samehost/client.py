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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import replace

from kvstore.block import TierName, checksum
from kvstore.errors import (
    ArenaUnusable,
    DaemonUnavailable,
    InvalidArgument,
    LeaseExpired,
    StaleAttachment,
    StrataError,
)
from kvstore.shm.arena import ShmArena
from kvstore.transport import arena_io
from kvstore.transport.samehost import frames
from kvstore.transport.samehost import regions
from kvstore.transport.base import Block, BlockInfo, BlockPut, Deadline, Place, Transport, fit
from kvstore.transport.samehost.locations import DEFAULT_CAPACITY, Locations
from kvstore.transport.samehost.conn import _Connection, _timeout_ms

# Blocks up to this size travel inline in a Put frame: one round trip, where
# the arena path needs two (Allocate, Commit). Above it the copy dominates
# and writing in place saves the socket's two copies.
INLINE_BYTES = 256 << 10
MAX_IDLE_CONNECTIONS = 8
# Read leases waiting to ride on the next Lookup: at most this many, this long.
MAX_PENDING_RELEASES = 256
RELEASE_DELAY_S = 0.05
MAX_TOUCHED = 4096  # keys read without asking, reported per flush
DEFAULT_LOCATIONS = DEFAULT_CAPACITY


def stale_attachment(refusal: InvalidArgument) -> StaleAttachment:
    """What a client is told when the daemon refuses a token it accepted before (both transports)."""
    return StaleAttachment(f"the daemon refused this client's arena token ({refusal}); it restarted since the "
                           "client attached: attach again")


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
        self._writes_in_place = first.in_place
        self.device_tensors = any(h.kind == "cuda" for h in first.regions)
        self._max_inline = min(first.max_payload, first.max_meta // 2)
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

    # ---- reads ---------------------------------------------------------------

    def get_into(self, namespace: str, keys: Sequence[bytes], place: Place | None,
                 deadline: Deadline) -> list[Block | None]:
        keys = list(keys)
        if not keys:
            return []
        deadline.check()
        blocks: list[Block | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        if self._locations is not None:
            todo = self._read_known(namespace, keys, place, blocks)
        if todo:
            self._lookup_into(namespace, keys, todo, place, blocks, deadline)
        return blocks

    def _read_known(self, namespace: str, keys: list[bytes], place: Place | None,
                    blocks: list[Block | None]) -> list[int]:
        """Read the blocks whose arena extent this client already knows; the indices still to look up."""
        locations = self._locations
        epoch = locations.epoch()
        todo: list[int] = []
        hits: list[int] = []
        for i, key in enumerate(keys):
            known = locations.get(namespace, key)
            if known is None:
                todo.append(i)
                continue
            offset, size, sum_, parent, layout = known
            out = arena_io.target(place, i, BlockInfo(key, size, layout, parent))
            if out is None:
                continue  # declined: a miss
            if arena_io.copy_out(self._arena, offset, out) != sum_:
                locations.forget(namespace, key)  # the extent went to another block: ask the daemon
                todo.append(i)
                continue
            blocks[i] = Block(key, out.obj if place is None else out, layout, parent, TierName.HOST)
            hits.append(i)
        if not hits:
            return todo
        if not locations.still(epoch):  # a Delete answered while we copied: nothing read here counts
            for i in hits:
                blocks[i] = None
            return sorted(todo + hits)
        self._touch_later(namespace, [keys[i] for i in hits])
        return todo

    def _lookup_into(self, namespace: str, keys: list[bytes], todo: list[int], place: Place | None,
                     blocks: list[Block | None], deadline: Deadline) -> None:
        """One Lookup for the keys at ``todo``; copies under its leases; refetches what it could not read."""
        asked = [keys[i] for i in todo]
        refetch: list[int] = []
        placed: dict[int, memoryview] = {}
        epoch = self._locations.epoch() if self._locations is not None else 0
        learned: list[tuple[bytes, tuple]] = []
        conn = self._take()
        releases = self._take_pending()
        try:
            try:
                lease_deadline, entries = conn.call(
                    frames.LOOKUP, [namespace, asked, self._lease_ms, _timeout_ms(deadline), releases],
                    deadline=deadline,
                )
            except StrataError:
                if releases:  # in case the Lookup failed before releasing them
                    conn.notify(frames.RELEASE, [releases])
                raise
            received = arena_io.now_ms()
            if len(entries) != len(asked):
                conn.close()
                raise StrataError(f"the daemon answered {len(entries)} of {len(asked)} keys")
            leased: list[tuple[int, int]] = []
            try:
                for i, entry in zip(todo, entries):
                    if entry is None:
                        continue
                    size, sum_, parent, layout, offset, lease_id, tier, *region = entry
                    if not lease_id:  # found, but could not be brought into the arena
                        refetch.append(i)
                        continue
                    leased.append((i, lease_id))
                    if place is None:
                        out = memoryview(bytearray(size))
                    else:
                        view = place(i, BlockInfo(keys[i], size, layout, parent))
                        if view is None:
                            continue  # declined: a miss, its lease still released
                        out = placed[i] = regions.placed_out(view, size)
                    if region:  # a gpu extent: copied out of the mapped region (None: it stayed on the device)
                        got = self._regions.region(conn.regions, region[0]).read_into(offset, out)
                    else:
                        got = regions.arena_into(self._arena, offset, out)
                    if got is not None and got != sum_:
                        refetch.append(i)  # torn under an expired lease, or corrupt: read it again
                        continue
                    blocks[i] = Block(keys[i], out.obj if place is None else out, layout, parent, TierName(tier))
                    if not region:
                        learned.append((keys[i], (offset, size, sum_, parent, layout)))
            except BaseException:  # a placement refused: give every lease of the read back now
                conn.notify(frames.RELEASE, [[e[5] for e in entries if e is not None and e[5]]])
                raise
            if leased:
                ids = [lease_id for _, lease_id in leased]
                if refetch and arena_io.lease_held(lease_deadline, received):
                    conn.call(frames.RELEASE, [ids], deadline=deadline)  # done before a refetch drops a corrupt block
                elif arena_io.lease_held(lease_deadline, received):
                    self._release_later(conn, ids)
                else:  # the copy ran close to the lease's end: ask whether it held
                    learned = []
                    valid = conn.call(frames.RELEASE, [ids], deadline=deadline)
                    for (i, _), ok in zip(leased, valid):
                        if not ok and blocks[i] is not None:
                            blocks[i] = None
                            refetch.append(i)
        finally:
            self._give(conn)
        if self._locations is not None:
            for key, location in learned:
                self._locations.learn(epoch, namespace, key, location)
        if refetch:
            self._refetch(namespace, keys, refetch, place, placed, blocks, deadline)

    def _refetch(self, namespace, keys, refetch, place, placed, blocks, deadline) -> None:
        if self._fallback is None:
            raise StrataError("blocks the daemon could not lease in the arena need a fallback transport to be read")
        refetch.sort()

        staged: dict[int, memoryview] = {}  # CUDA tensors read through the fallback via host memory

        def again(j: int, info: BlockInfo) -> memoryview | None:
            i = refetch[j]
            view = placed[i] if i in placed else None if place is None else place(i, info)
            if regions.on_device(view):
                placed[i] = regions.placed_out(view, info.size)
                staged[i] = memoryview(bytearray(info.size))
                return staged[i]
            return fit(info.key, info.size, view) if i in placed else view

        got = self._fallback.get_into(namespace, [keys[i] for i in refetch], again if place else None, deadline)
        for i, block in zip(refetch, got):
            if block is not None and i in staged:
                regions.copy_up(staged[i], placed[i])
                block = replace(block, data=placed[i][:len(staged[i])])
            blocks[i] = block

    # ---- writes --------------------------------------------------------------

    def put(self, namespace: str, blocks: Sequence[BlockPut], deadline: Deadline) -> list[bool]:
        views = [regions.device_or_host(b.value) for b in blocks]  # CUDA tensors only where device_tensors
        results = [False] * len(blocks)
        # Without slots to write in place (a gpu head, no capability): inline up to a frame, streamed beyond.
        limit = self._inline if self._writes_in_place else self._max_inline
        inline = [i for i, v in enumerate(views) if len(v) <= limit]
        in_place = [i for i, v in enumerate(views) if len(v) > limit]
        for i in inline:
            views[i] = regions.on_host(views[i])
        if inline:
            self._put_inline(namespace, blocks, views, inline, results, deadline)
        if in_place and not self._writes_in_place:
            self._put_elsewhere(namespace, blocks, in_place, results, deadline)
            return results
        for batch in arena_io.batches_by_bytes([len(views[i]) for i in in_place], self._batch_bytes):
            self._put_in_place(namespace, blocks, views, [in_place[j] for j in batch], results, deadline)
        return results

    def _put_elsewhere(self, namespace, blocks, indices, results, deadline) -> None:
        if self._fallback is None:
            raise StrataError("blocks the daemon cannot take in place need a fallback transport to be put")
        staged = [BlockPut(blocks[i].key, regions.on_host(blocks[i].value), blocks[i].parent, blocks[i].layout)
                  for i in indices]
        for i, stored in zip(indices, self._fallback.put(namespace, staged, deadline)):
            results[i] = stored

    def _put_inline(self, namespace, blocks, views, indices, results, deadline) -> None:
        conn = self._take()
        try:
            limit = min(conn.max_payload, conn.max_meta // 2)
            for group in arena_io.batches_by_bytes([len(views[i]) for i in indices], limit):
                group = [indices[j] for j in group]
                for start in range(0, len(group), conn.max_batch):
                    part = group[start : start + conn.max_batch]
                    headers = [
                        [blocks[i].key, len(views[i]), checksum(views[i]), blocks[i].parent, blocks[i].layout]
                        for i in part
                    ]
                    done = conn.call(frames.PUT, [namespace, _timeout_ms(deadline), headers],
                                     [views[i] for i in part], deadline=deadline)
                    for i, (stored, _tier) in zip(part, done):
                        results[i] = stored
        finally:
            self._give(conn)

    def _put_in_place(self, namespace, blocks, views, indices, results, deadline) -> None:
        conn = self._take()
        slots: list[int] = []
        unread = 0
        try:
            headers = [[blocks[i].key, len(views[i]), blocks[i].parent, blocks[i].layout] for i in indices]
            lease_deadline, grants = conn.call(
                frames.ALLOCATE, [namespace, self._lease_ms, _timeout_ms(deadline), headers], deadline=deadline
            )
            received = arena_io.now_ms()
            todo = [(i, slot, (offset, *region)) for i, (present, slot, offset, *region) in zip(indices, grants)
                    if not present]
            slots = [slot for _, slot, _ in todo]
            sent: list[tuple[int, list]] = []
            for group in arena_io.commit_groups([len(views[i]) for i, _, _ in todo]):
                group = [todo[j] for j in group]
                if not arena_io.lease_held(lease_deadline, received):
                    raise LeaseExpired(
                        "the arena slots' lease ran out before they were written: nothing was stored, put again"
                    )
                sums = []
                for i, _, (offset, *region) in group:
                    deadline.check()
                    if region:  # a gpu slot: written through the mapped region (device to device from a CUDA tensor)
                        sums.append(self._regions.region(conn.regions, region[0]).write(offset, views[i]))
                    else:
                        sums.append(arena_io.copy_in(self._arena, offset, regions.on_host(views[i])))
                commit = [[slot for _, slot, _ in group], sums]
                sent.append((conn.send(frames.COMMIT, commit, deadline=deadline), group))
                unread += 1
            for rid, group in sent:  # the daemon checksummed each group while the next was copied
                unread -= 1
                for (i, _, _), (stored, _tier) in zip(group, conn.reply(rid, deadline)):
                    results[i] = stored
            slots = []
        except BaseException:
            if unread:
                conn.close()  # replies still on their way would be taken for the next call's
            if slots:
                self._abort(conn, slots)
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
