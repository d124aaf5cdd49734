"""The same-host transport for asyncio: the twin of :mod:`kvstore.transport.samehost.client`.

Same wire format, same requests for the same calls: what each request says
and what its answer means is :mod:`kvstore.transport.samehost.protocol`,
which both drive (reads without a message for blocks seen before, the
one-round-trip first get and small put, the arena copies, the gpu regions
and CUDA tensors device to device). Only the waiting differs.

One connection per transport carries every task's requests: requests are
written in order and the daemon answers in order, so a reader task hands
each reply to the future of its request id. A task cancelled (or past its
deadline) while it waits leaves its request in flight; when the reply
comes, what it granted is given back (the leases of a Lookup, the slots of
an Allocate), so cancellation never needs the connection torn down. A
connection the daemon closed (a restart, or idle too long) makes the
transport :attr:`~AsyncSameHostTransport.broken`; :meth:`~AsyncSameHostTransport.reopen`
gives a new one.

Copies of more than ``off_loop.threshold`` bytes run in a worker thread
(:class:`kvstore.transport.off_loop.OffLoop`); smaller ones, and every
placement, run on the loop.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

import msgpack

from kvstore.block import TierName
from kvstore.errors import DaemonUnavailable, DeadlineExceeded, InvalidArgument, StrataError
from kvstore.shm.arena import Prefault, ShmArena
from kvstore.transport import arena_io
from kvstore.transport.base import AsyncTransport, Block, BlockPut, Deadline, Place
from kvstore.transport.off_loop import OffLoop
from kvstore.transport.samehost import frames, protocol, regions
from kvstore.transport.samehost.locations import Locations
from kvstore.transport.samehost.protocol import (
    DEFAULT_LOCATIONS, INLINE_BYTES, MAX_PENDING_RELEASES, MAX_TOUCHED, RELEASE_DELAY_S, stale_attachment,
)
from kvstore.wire.unix import connect_unix

CONNECT_TIMEOUT_S = 5.0
CLOSE_WAIT_S = 1.0  # replies of cancelled requests waited for at close, to give back their leases
# Replies waited for at once on the connection; more wait for a turn.
MAX_IN_FLIGHT = 64


class AsyncSameHostTransport(AsyncTransport):
    """See the module docstring. Create with :meth:`connect` inside the loop it serves; ``arena`` and
    ``fallback`` stay the caller's to close."""

    name = "same-host"
    shared_memory = True

    def __init__(self, arena: ShmArena, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                 fallback: AsyncTransport | None, lease_ms: int, inline_bytes: int, off_loop: OffLoop) -> None:
        self._arena = arena
        self._reader = reader
        self._writer = writer
        self._fallback = fallback
        self._lease_ms = lease_ms
        self._inline = inline_bytes
        self._off_loop = off_loop
        self._hello = protocol.Hello(frames.MAX_META_BYTES, frames.MAX_PAYLOAD_BYTES, 4096, "", TierName.HOST, [])
        self._regions = regions.Regions()
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[asyncio.Future, int]] = {}
        self._slots = asyncio.Semaphore(MAX_IN_FLIGHT)
        self._broken: StrataError | None = None
        self._closed = False
        self._pending: list[int] = []  # read leases to release with the next Lookup
        self._flush: asyncio.TimerHandle | None = None
        self._batch_bytes = arena.size // 4
        self._reading: asyncio.Task | None = None
        self._locations: Locations | None = None
        self._prefault: Prefault | None = None
        self._touched: dict[str, dict[bytes, None]] = {}  # read without asking: reported for recency
        self._path, self._token, self._options = "", b"", {}

    @classmethod
    async def connect(cls, arena: ShmArena, socket_path: str, token: bytes, *, fallback: AsyncTransport | None = None,
                      lease_ms: int = 0, inline_bytes: int = INLINE_BYTES, locations: int = DEFAULT_LOCATIONS,
                      gpu: bool = True, off_loop: OffLoop | None = None) -> AsyncSameHostTransport:
        """Connect and say Hello; the arguments are :class:`~kvstore.transport.samehost.client.SameHostTransport`'s,
        and ``off_loop`` (shared with the caller, who must not unmap the arena while it is busy)."""
        off_loop = off_loop if off_loop is not None else OffLoop()
        try:
            sock = await asyncio.get_running_loop().run_in_executor(None, connect_unix, socket_path, CONNECT_TIMEOUT_S)
            sock.setblocking(False)
            reader, writer = await asyncio.open_unix_connection(sock=sock, limit=frames.MAX_META_BYTES + 64)
        except OSError as err:
            raise DaemonUnavailable(f"cannot connect to the daemon's same-host socket {socket_path}: {err}") from None
        self = cls(arena, reader, writer, fallback=fallback, lease_ms=lease_ms, inline_bytes=inline_bytes,
                   off_loop=off_loop)
        self._path, self._token = socket_path, bytes(token)
        self._options = dict(fallback=fallback, lease_ms=lease_ms, inline_bytes=inline_bytes, locations=locations,
                             gpu=gpu, off_loop=off_loop)
        self._reading = asyncio.ensure_future(self._read_loop())
        try:
            answer = await self._call(frames.HELLO, protocol.hello_request(token, gpu), (),
                                      Deadline.after(CONNECT_TIMEOUT_S))
            self._hello = protocol.Hello.parse(answer)
            self.device_tensors = self._hello.device_tensors
            if self._hello.prefaults_arena():
                self._prefault = Prefault(self._arena)
            if self._hello.removal_page and locations:
                self._locations = Locations(self._hello.removal_page, self._token, locations)
        except BaseException:  # refused (a token of another run), unreadable, cancelled: nothing stays open
            await self.close()
            raise
        return self

    @property
    def writes_in_place(self) -> bool:
        """Whether large blocks are written into slots (False: a gpu head without regions for this client)."""
        return self._hello.in_place

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

    async def close(self) -> None:
        """Wait briefly for replies still due (what they grant is given back), release, close."""
        if self._closed:
            return
        self._closed = True
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
        if self._prefault is not None:
            await asyncio.to_thread(self._prefault.stop)
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
        if self._flush is None and not self._closed:
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
            self._release_later(protocol.leased_ids(result))
        elif op == frames.ALLOCATE:
            self._notify(frames.ABORT, [protocol.granted_slot_ids(result)])

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

    async def _call(self, op: int, args, payload: Sequence, deadline: Deadline):
        deadline.check()
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
            return await self._wait(future, deadline, op)

    async def _wait(self, future: asyncio.Future, deadline: Deadline, op: int):
        try:
            return await asyncio.wait_for(asyncio.shield(future), deadline.remaining())
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

    async def _copy(self, nbytes: int, fn, *args):
        return await self._off_loop(nbytes, fn, *args) if nbytes > self._off_loop.threshold else fn(*args)

    # ---- reads ---------------------------------------------------------------

    async def touch(self, namespace: str, keys: Sequence[bytes]) -> None:
        """Tell the daemon these blocks were used (recency), with the next flush; no reply."""
        if keys:
            self._touch_later(namespace, list(keys))

    async def exists(self, namespace: str, keys: Sequence[bytes], deadline: Deadline) -> list[TierName] | None:
        """As the blocking transport's: one Exists on the socket; None when the daemon has none."""
        if not self._hello.exists:
            return None
        return protocol.exists_answer(await self._call(frames.EXISTS, [namespace, list(keys)], (), deadline))

    async def get_into(self, namespace: str, keys: Sequence[bytes], place: Place | None,
                       deadline: Deadline) -> list[Block | None]:
        keys = list(keys)
        if not keys:
            return []
        deadline.check()
        read = protocol.Read(namespace, keys, place, self._locations)
        if self._locations is not None:
            copies = read.known_copies()  # on the loop: placements are the caller's code
            if copies:
                sums = await self._copy(sum(c.size for c in copies), protocol.copy_out, self._arena, self._regions,
                                        [], copies)
                touched = read.known_copied(copies, sums)
                if touched:
                    self._touch_later(namespace, touched)
        if read.todo:
            await self._lookup_into(read, deadline)
        return read.blocks

    async def _lookup_into(self, read: protocol.Read, deadline: Deadline) -> None:
        """One Lookup for the keys left; copies under its leases; refetches what it could not read."""
        releases = self._take_pending()
        try:
            answer = await self._call(frames.LOOKUP, read.lookup_args(self._lease_ms, _timeout_ms(deadline), releases),
                                      (), deadline)
        except StrataError:
            if releases:  # in case the Lookup failed before releasing them
                self._notify(frames.RELEASE, [releases])
            raise
        read.answered(answer, arena_io.now_ms())
        try:
            copies = read.leased_copies()  # on the loop: placements are the caller's code
            sums = await self._copy(sum(c.size for c in copies), protocol.copy_out, self._arena, self._regions,
                                    self._hello.regions, copies)
        except BaseException:  # a placement refused, or the call was cancelled: give the leases back now
            self._notify(frames.RELEASE, [read.lease_ids])
            raise
        read.leased_copied(copies, sums)
        if read.release_now():
            read.released(await self._call(frames.RELEASE, [read.lease_ids], (), deadline))
        elif read.lease_ids:
            self._release_later(read.lease_ids)
        read.learn()
        if read.refetch:
            if self._fallback is None:
                raise StrataError("blocks the daemon could not lease in the arena need a fallback transport to be read")
            got = await self._fallback.get_into(read.namespace, read.refetch_keys(), read.again(), deadline)
            await self._copy(read.staged_bytes(), read.refetched, got)

    # ---- writes --------------------------------------------------------------

    async def put(self, namespace: str, blocks: Sequence[BlockPut], deadline: Deadline) -> list[bool]:
        # Without slots to write in place (a gpu head, no capability): inline up to a frame, streamed beyond.
        put = protocol.Put(namespace, blocks, self._inline if self._hello.in_place else self._hello.max_inline,
                           in_place=self._hello.in_place)
        for part in put.inline_parts(self._hello):
            args, payload = put.put_frame(part, _timeout_ms(deadline))
            put.stored(part, await self._call(frames.PUT, args, payload, deadline))
        if put.large and not self._hello.in_place:
            if self._fallback is None:
                raise StrataError("blocks the daemon cannot take in place need a fallback transport to be put")
            put.stored_elsewhere(await self._fallback.put(namespace, put.staged(), deadline))
            return put.results
        for batch in put.slot_batches(self._batch_bytes):
            await self._put_in_place(put, batch, deadline)
        return put.results

    async def _put_in_place(self, put: protocol.Put, indices: list[int], deadline: Deadline) -> None:
        answer = await self._call(frames.ALLOCATE, put.allocate_args(indices, self._lease_ms, _timeout_ms(deadline)),
                                  (), deadline)
        received = arena_io.now_ms()
        lease_deadline, slots = put.granted(indices, answer)
        commits: list[tuple[asyncio.Future, list[protocol.Slot]]] = []
        try:
            for group in put.commit_groups(slots):
                protocol.check_slot_lease(lease_deadline, received)
                sums = await self._copy(put.group_bytes(group), put.copy_in, self._arena, self._regions,
                                        self._hello.regions, group)
                commits.append((self._send(frames.COMMIT, protocol.commit_args(group, sums), ()), group))
            await self._writer.drain()
            for future, group in commits:  # the daemon checksummed each group while the next was copied
                put.stored([s.index for s in group], await self._wait(future, deadline, frames.COMMIT))
        except BaseException:
            for future, _ in commits:
                future.cancel()
            if self._broken is None:  # committed slots are skipped by the daemon; the rest are given back
                self._notify(frames.ABORT, [[s.slot_id for s in slots]])
            raise


def _timeout_ms(deadline: Deadline) -> int:
    return protocol.timeout_ms(deadline.remaining())
