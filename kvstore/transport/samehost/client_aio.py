"""The same-host transport for asyncio: the twin of :mod:`kvstore.transport.samehost.client`.

Same wire format, same reads without a message for blocks seen before
(:mod:`kvstore.transport.samehost.locations`), same one-round-trip first get and
small put, same arena copies.
One connection per client carries every task's requests: requests are
written in order and the daemon answers in order, so a reader task hands
each reply to the future of its request id. A task cancelled (or past its
deadline) while it waits leaves its request in flight; when the reply
comes, what it granted is given back (the leases of a Lookup, the slots of
an Allocate), so cancellation never needs the connection torn down.

Copies of more than ``off_loop_bytes`` run through ``off_loop`` (the
client's worker-thread hop); smaller ones run on the loop.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Sequence

import msgpack

from kvstore.block import TierName, checksum
from kvstore.errors import (
    DaemonUnavailable, DeadlineExceeded, InvalidArgument, LeaseExpired, StrataError,
)
from kvstore.shm.arena import ShmArena
from kvstore.transport import arena_io
from kvstore.transport.samehost import frames
from kvstore.transport.samehost import regions
from kvstore.transport.base import Block, BlockInfo, BlockPut, Place, fit
from kvstore.transport.samehost.locations import DEFAULT_CAPACITY, Locations
from kvstore.transport.samehost.client import (
    INLINE_BYTES, MAX_PENDING_RELEASES, MAX_TOUCHED, RELEASE_DELAY_S, stale_attachment,
)
from kvstore.wire.unix import connect_unix

CONNECT_TIMEOUT_S = 5.0
CLOSE_WAIT_S = 1.0  # replies of cancelled requests waited for at close, to give back their leases
# Replies waited for at once on the connection; more wait for a turn.
MAX_IN_FLIGHT = 64

OffLoop = Callable[..., Awaitable]


def _timeout_ms(timeout: float | None) -> int:
    return 0 if timeout is None else max(1, int(timeout * 900))


class AsyncSameHostTransport:
    """See the module docstring. Create with :meth:`connect` inside the loop it serves."""

    name = "same-host"
    shared_memory = True

    def __init__(self, arena: ShmArena, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                 lease_ms: int, off_loop: OffLoop, off_loop_bytes: int, fallback, gpu: bool = True) -> None:
        self._arena = arena
        self._reader = reader
        self._writer = writer
        self._lease_ms = lease_ms
        self._off_loop = off_loop
        self._off_loop_bytes = off_loop_bytes
        self._fallback = fallback  # async (namespace, keys, place) -> blocks, for refetches
        self.writes_in_place = True  # False: the daemon's slots are in its gpu tier, not mapped here
        self._handles: list = []  # the daemon's gpu regions (the Hello's), mapped on first use
        self._regions = regions.Regions()
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[asyncio.Future, int]] = {}
        self._slots = asyncio.Semaphore(MAX_IN_FLIGHT)
        self._broken: StrataError | None = None
        self._pending: list[int] = []  # read leases to release with the next Lookup
        self._flush: asyncio.TimerHandle | None = None
        self._batch_bytes = arena.size // 4
        self._max_payload = frames.MAX_PAYLOAD_BYTES
        self._max_batch = 4096
        self._reading: asyncio.Task | None = None
        self._locations: Locations | None = None
        self._touched: dict[str, dict[bytes, None]] = {}  # read without asking: reported for recency

    @classmethod
    async def connect(cls, arena: ShmArena, path: str, token: bytes, *, locations: int = DEFAULT_CAPACITY,
                      **options) -> AsyncSameHostTransport:
        self = await cls._connect(arena, path, token, locations, options)
        self._path, self._token, self._options = path, bytes(token), {"locations": locations, **options}
        return self

    @property
    def mapped_regions(self) -> int:
        """How many gpu regions this transport has mapped (each once, by handle)."""
        return self._regions.mapped()

    @property
    def broken(self) -> bool:
        """The connection failed (the daemon closed it: a restart, or idle too long); see :meth:`reopen`."""
        return self._broken is not None

    async def reopen(self) -> AsyncSameHostTransport:
        """A new connection to the same socket with the same token, this one closed.

        The daemon accepted this token at the first Hello, so refusing it now
        means another daemon answers on the socket (a restart): raises
        :class:`StaleAttachment`, and the client must attach again.
        """
        await self.close()
        try:
            return await self.connect(self._arena, self._path, self._token, **self._options)
        except InvalidArgument as err:
            raise stale_attachment(err) from None

    @classmethod
    async def _connect(cls, arena: ShmArena, path: str, token: bytes, locations: int,
                       options: dict) -> AsyncSameHostTransport:
        loop = asyncio.get_running_loop()
        try:
            sock = await loop.run_in_executor(None, connect_unix, path, CONNECT_TIMEOUT_S)
            sock.setblocking(False)
            reader, writer = await asyncio.open_unix_connection(sock=sock, limit=frames.MAX_META_BYTES + 64)
        except OSError as err:
            raise DaemonUnavailable(f"cannot connect to the daemon's same-host socket {path}: {err}") from None
        self = cls(arena, reader, writer, **options)
        self._reading = asyncio.ensure_future(self._read_loop())
        try:
            # The gpu capability (kvstore.transport.samehost.regions): a gpu head's extents come with their region.
            hello = [frames.PROTOCOL_VERSION, bytes(token), [regions.CAPABILITY] if options.get("gpu", True) else []]
            limits = await self._call(frames.HELLO, hello, (), CONNECT_TIMEOUT_S)
            _, self._max_payload, self._max_batch, removals, *head = limits
            head = head[0] if head else {"tier": int(TierName.HOST), "regions": []}  # as a protocol 1 daemon
            self._handles = regions.regions_from_wire(head["regions"])
            self.writes_in_place = head["tier"] == int(TierName.HOST) or bool(self._handles)
            if removals and locations:
                self._locations = Locations(removals, bytes(token), locations)
        except BaseException:  # refused (a token of another run), unreadable, cancelled: nothing stays open
            await self.close()
            raise
        return self

    async def close(self) -> None:
        """Wait briefly for replies still due (what they grant is given back), release, close."""
        end = asyncio.get_running_loop().time() + CLOSE_WAIT_S
        while self._waiting and self._broken is None and asyncio.get_running_loop().time() < end:
            await asyncio.sleep(0.005)
        self._flush_pending()
        self._fail(DaemonUnavailable("the transport is closed"))
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except OSError:
            pass  # already gone
        if self._reading is not None:
            await asyncio.gather(self._reading, return_exceptions=True)
        if self._locations is not None:
            self._locations.close()
        self._regions.close()

    # ---- requests ------------------------------------------------------------

    async def _read_loop(self) -> None:
        try:
            while True:
                head = await self._reader.readexactly(frames.HEADER.size)
                meta_len, payload_len = frames.HEADER.unpack(head)
                if meta_len > frames.MAX_META_BYTES or payload_len:
                    raise StrataError("the daemon sent a frame this client cannot read")
                rid, status, result = msgpack.unpackb(await self._reader.readexactly(meta_len), raw=False)
                future, op = self._waiting.pop(rid, (None, 0))
                if future is None:
                    if status == frames.ERROR:  # a refusal of the connection itself (rid 0)
                        try:
                            frames.raise_error(result)
                        except StrataError as err:
                            self._fail(err)
                        return
                    continue
                if future.cancelled():
                    self._give_back(op, status, result)
                elif status == frames.ERROR:
                    try:
                        frames.raise_error(result)
                    except StrataError as err:
                        future.set_exception(err)
                else:
                    future.set_result(result)
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as err:
            self._fail(DaemonUnavailable(f"the daemon's same-host socket closed: {err}"))
        except (StrataError, ValueError, TypeError) as err:
            self._fail(DaemonUnavailable(f"the daemon's same-host socket sent garbage: {err}"))

    def _release_later(self, lease_ids: list[int]) -> None:
        """Release read leases with the next Lookup, or after RELEASE_DELAY_S, or now when many wait."""
        self._pending += lease_ids
        if len(self._pending) > MAX_PENDING_RELEASES:
            self._flush_pending()
        elif self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(RELEASE_DELAY_S, self._flush_pending)

    def _take_pending(self) -> list[int]:
        pending, self._pending = self._pending, []
        return pending

    def _touch_later(self, namespace: str, keys: list[bytes]) -> None:
        touched = self._touched.setdefault(namespace, {})
        if len(touched) < MAX_TOUCHED:  # beyond it recency is approximate, never unbounded
            touched.update(dict.fromkeys(keys))
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(RELEASE_DELAY_S, self._flush_pending)

    def _flush_pending(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        pending = self._take_pending()
        if pending:
            self._notify(frames.RELEASE, [pending])
        touched, self._touched = self._touched, {}
        for namespace, keys in touched.items():
            self._notify(frames.TOUCH, [namespace, list(keys)])

    def _give_back(self, op: int, status: int, result) -> None:
        """A reply nobody waits for any more: release what it granted."""
        if status != frames.OK:
            return
        if op == frames.LOOKUP:
            self._release_later([e[5] for e in result[1] if e is not None and e[5]])
        elif op == frames.ALLOCATE:
            self._notify(frames.ABORT, [[slot for present, slot, _ in result[1] if not present]])

    def _fail(self, err: StrataError) -> None:
        if self._broken is None:
            self._broken = err
        waiting, self._waiting = self._waiting, {}
        for future, _ in waiting.values():
            if not future.done():
                future.set_exception(err)

    def _notify(self, op: int, args) -> None:
        if self._broken is None:
            self._writer.write(frames.encode([op, 0, args]))

    def _send(self, op: int, args, payload: Sequence) -> asyncio.Future:
        if self._broken is not None:
            raise DaemonUnavailable(f"the same-host connection is unusable: {self._broken}")
        rid = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._waiting[rid] = (future, op)
        self._writer.write(frames.encode([op, rid, args], sum(len(p) for p in payload)))
        for part in payload:
            self._writer.write(part)
        return future

    async def _call(self, op: int, args, payload: Sequence, timeout: float | None):
        async with self._slots:
            future = self._send(op, args, payload)
            try:
                await self._writer.drain()
            except OSError as err:  # the daemon closed the socket (a restart) before its reader saw it
                self._abandon(future, op)
                self._fail(DaemonUnavailable(f"the daemon's same-host socket closed: {err}"))
                raise DaemonUnavailable(f"the daemon's same-host socket closed: {err}") from None
            except BaseException:
                self._abandon(future, op)
                raise
            return await self._wait(future, timeout, op)

    async def _wait(self, future: asyncio.Future, timeout: float | None, op: int):
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            self._abandon(future, op)
            raise DeadlineExceeded("the daemon did not answer on the same-host socket before the deadline") from None
        except asyncio.CancelledError:
            self._abandon(future, op)
            raise

    def _abandon(self, future: asyncio.Future, op: int) -> None:
        """Nobody will take this reply: when it comes (or if it already came) give back what it grants."""
        if future.cancel():
            return  # the read loop gives it back on arrival
        if not future.cancelled() and future.exception() is None:
            self._give_back(op, frames.OK, future.result())  # answered as the wait was cut short

    # ---- reads ---------------------------------------------------------------

    async def get_into(self, namespace: str, keys: Sequence[bytes], place: Place | None,
                       timeout: float | None) -> list[Block | None]:
        keys = list(keys)
        if not keys:
            return []
        blocks: list[Block | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        if self._locations is not None:
            todo = await self._read_known(namespace, keys, place, blocks)
        if todo:
            await self._lookup_into(namespace, keys, todo, place, blocks, timeout)
        return blocks

    async def _read_known(self, namespace: str, keys: list[bytes], place: Place | None,
                          blocks: list[Block | None]) -> list[int]:
        """Read the blocks whose arena extent this client already knows (see kvstore.transport.samehost.locations)."""
        locations = self._locations
        epoch = locations.epoch()
        todo: list[int] = []
        jobs: list[tuple[int, memoryview, tuple, int]] = []
        known: dict[int, tuple] = {}
        for i, key in enumerate(keys):
            where = locations.get(namespace, key)
            if where is None:
                todo.append(i)
                continue
            offset, size, sum_, parent, layout = where
            out = arena_io.target(place, i, BlockInfo(key, size, layout, parent))  # on the loop: the caller's code
            if out is None:
                continue  # declined: a miss
            jobs.append((i, out, (offset,), sum_))
            known[i] = where
        if not jobs:
            return todo
        nbytes = sum(len(out) for _, out, _, _ in jobs)
        sums = await self._off_loop(nbytes, self._copy_all, jobs) if nbytes > self._off_loop_bytes else self._copy_all(jobs)
        hits: list[int] = []
        for (i, out, _, sum_), got in zip(jobs, sums):
            if got != sum_:
                locations.forget(namespace, keys[i])  # the extent went to another block: ask the daemon
                todo.append(i)
                continue
            _, _, _, parent, layout = known[i]
            blocks[i] = Block(keys[i], out.obj if place is None else out, layout, parent, TierName.HOST)
            hits.append(i)
        if hits and not locations.still(epoch):  # a Delete answered while we copied: nothing read here counts
            for i in hits:
                blocks[i] = None
            return sorted(todo + hits)
        if hits:
            self._touch_later(namespace, [keys[i] for i in hits])
        return sorted(todo)

    async def _lookup_into(self, namespace: str, keys: list[bytes], todo: list[int], place: Place | None,
                           blocks: list[Block | None], timeout: float | None) -> None:
        """One Lookup for the keys at ``todo``; copies under its leases; refetches what it could not read."""
        asked = [keys[i] for i in todo]
        epoch = self._locations.epoch() if self._locations is not None else 0
        releases = self._take_pending()
        lease_deadline, answers = await self._call(
            frames.LOOKUP, [namespace, asked, self._lease_ms, _timeout_ms(timeout), releases], (), timeout
        )
        received = arena_io.now_ms()
        if len(answers) != len(asked):
            raise StrataError(f"the daemon answered {len(answers)} of {len(asked)} keys")
        entries = dict(zip(todo, answers))
        refetch: list[int] = []
        placed: dict[int, memoryview] = {}
        jobs: list[tuple[int, memoryview, tuple, int]] = []  # (index, out, (offset(, region)), checksum)
        try:
            for i, entry in entries.items():
                if entry is None:
                    continue
                size, sum_, parent, layout, offset, lease_id, tier, *region = entry
                if not lease_id:
                    refetch.append(i)
                    continue
                if place is None:
                    out = memoryview(bytearray(size))
                else:  # on the loop: placements are the caller's code
                    view = place(i, BlockInfo(keys[i], size, layout, parent))
                    if view is None:
                        continue
                    out = placed[i] = view[:size]
                jobs.append((i, out, (offset, *region), sum_))
            nbytes = sum(len(out) for _, out, _, _ in jobs)
            if nbytes > self._off_loop_bytes:
                sums = await self._off_loop(nbytes, self._copy_all, jobs)
            else:
                sums = self._copy_all(jobs)
        except BaseException:  # a placement refused, or the call was cancelled: give the leases back now
            self._notify(frames.RELEASE, [[e[5] for e in answers if e is not None and e[5]]])
            raise
        learned: list[tuple[bytes, tuple]] = []
        for (i, out, (offset, *region), sum_), got in zip(jobs, sums):
            if got is not None and got != sum_:  # None: copied device to device, verified on the way in
                refetch.append(i)
                continue
            size, _, parent, layout, _, _, tier, *_ = entries[i]
            blocks[i] = Block(keys[i], out.obj if place is None else out, layout, parent, TierName(tier))
            if not region:  # the location table holds arena extents only
                learned.append((keys[i], (offset, size, sum_, parent, layout)))
        ids = [e[5] for e in answers if e is not None and e[5]]
        if ids:
            if refetch or not arena_io.lease_held(lease_deadline, received):
                learned = []
                valid = await self._call(frames.RELEASE, [ids], (), timeout)
                by_id = dict(zip(ids, valid))
                for i, entry in entries.items():
                    if entry is not None and entry[5] and not by_id.get(entry[5]) and blocks[i] is not None:
                        blocks[i] = None
                        refetch.append(i)
            else:
                self._release_later(ids)
        if self._locations is not None:
            for key, where in learned:
                self._locations.learn(epoch, namespace, key, where)
        if refetch:
            refetch.sort()

            def again(j: int, info: BlockInfo) -> memoryview | None:
                i = refetch[j]
                if i in placed:
                    return fit(info.key, info.size, placed[i])
                return None if place is None else place(i, info)

            got = await self._fallback(namespace, [keys[i] for i in refetch], again if place else None)
            for i, block in zip(refetch, got):
                blocks[i] = block

    def _copy_all(self, jobs) -> list[int | None]:
        return [self._regions.region(self._handles, where[1]).read_into(where[0], out) if len(where) > 1
                else arena_io.copy_out(self._arena, where[0], out) for _, out, where, _ in jobs]

    # ---- writes --------------------------------------------------------------

    async def put(self, namespace: str, blocks: Sequence[BlockPut], timeout: float | None) -> list[bool]:
        views = [memoryview(b.value).cast("B") for b in blocks]
        results = [False] * len(blocks)
        inline = [i for i, v in enumerate(views) if len(v) <= INLINE_BYTES]
        in_place = [i for i, v in enumerate(views) if len(v) > INLINE_BYTES]
        limit = min(self._max_payload, frames.MAX_META_BYTES // 2)
        for group in arena_io.batches_by_bytes([len(views[i]) for i in inline], limit):
            group = [inline[j] for j in group]
            for start in range(0, len(group), self._max_batch):
                part = group[start : start + self._max_batch]
                headers = [[blocks[i].key, len(views[i]), checksum(views[i]), blocks[i].parent, blocks[i].layout]
                           for i in part]
                done = await self._call(frames.PUT, [namespace, _timeout_ms(timeout), headers],
                                        [views[i] for i in part], timeout)
                for i, (stored, _tier) in zip(part, done):
                    results[i] = stored
        for batch in arena_io.batches_by_bytes([len(views[i]) for i in in_place], self._batch_bytes):
            await self._put_in_place(namespace, blocks, views, [in_place[j] for j in batch], results, timeout)
        return results

    async def _put_in_place(self, namespace, blocks, views, indices, results, timeout) -> None:
        headers = [[blocks[i].key, len(views[i]), blocks[i].parent, blocks[i].layout] for i in indices]
        lease_deadline, grants = await self._call(
            frames.ALLOCATE, [namespace, self._lease_ms, _timeout_ms(timeout), headers], (), timeout
        )
        received = arena_io.now_ms()
        todo = [(i, slot, (offset, *region)) for i, (present, slot, offset, *region) in zip(indices, grants)
                if not present]
        commits: list[tuple[asyncio.Future, list]] = []
        try:
            for group in arena_io.commit_groups([len(views[i]) for i, _, _ in todo]):
                group = [todo[j] for j in group]
                if not arena_io.lease_held(lease_deadline, received):
                    raise LeaseExpired(
                        "the arena slots' lease ran out before they were written: nothing was stored, put again"
                    )
                nbytes = sum(len(views[i]) for i, _, _ in group)
                if nbytes > self._off_loop_bytes:
                    sums = await self._off_loop(nbytes, self._copy_in, group, views)
                else:
                    sums = self._copy_in(group, views)
                commits.append((self._send(frames.COMMIT, [[slot for _, slot, _ in group], sums], ()), group))
            await self._writer.drain()
            for future, group in commits:  # the daemon checksummed each group while the next was copied
                for (i, _, _), (stored, _tier) in zip(group, await self._wait(future, timeout, frames.COMMIT)):
                    results[i] = stored
        except BaseException:
            for future, _ in commits:
                future.cancel()
            if self._broken is None:  # committed slots are skipped by the daemon; the rest are given back
                self._notify(frames.ABORT, [[slot for _, slot, _ in todo]])
            raise

    def _copy_in(self, group, views) -> list[int]:
        """Into the arena, or into a gpu slot through the mapped region (``where`` names it)."""
        return [self._regions.region(self._handles, where[1]).write(where[0], views[i]) if len(where) > 1
                else arena_io.copy_in(self._arena, where[0], views[i]) for i, _, where in group]

