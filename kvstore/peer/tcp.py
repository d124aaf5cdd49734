"""The TCP peer transport: reads blocks from another daemon's peer listener into placed buffers.

:class:`TcpPeerClient` is the blocking core, thread-safe, with a pool of
connections per peer (:class:`~kvstore.peer.connection.PeerConnection`):
a read sends one request and receives each block's header, asks ``place``
where the bytes go, and ``recv_into`` s them straight into that view (the
kernel copies from the socket into the arena slot; no buffer in between),
hashing each chunk as it lands. Only a block whose checksum matches is
reported a hit. :class:`TcpPeerTransport` is the
:class:`~kvstore.peer.base.PeerTransport` over it: each call runs the core
in a worker thread and ``place`` hops back to the event loop.

Failure, per key (see :mod:`kvstore.peer.base`): a connection that breaks
or a peer that dies while a block is arriving fails that key and every key
after it with ``TierUnavailable`` (blocks already verified stay hits), and
the connection is thrown away. A deadline is kept in the kernel (see
:mod:`kvstore.peer.connection`) and checked between chunks; a cancellation
shuts the socket down, which wakes a ``recv`` at once. A connection used by
a call that did not finish cleanly is never reused: the stream may be out
of step.

Limits: ``max_connections`` open at once over all peers (one more call
waits for none: it is refused with ``Overloaded``), ``max_idle_per_peer``
kept for reuse; the peer's own limits come back as its errors.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.block import BlockMeta, Checksummer, TierName, validate_namespace
from kvstore.errors import CorruptBlock, DeadlineExceeded, InvalidArgument, Overloaded, StrataError, TierUnavailable
from kvstore.peer import wire
from kvstore.peer.base import Held, PeerAddress, PeerStats, PeerTransport
from kvstore.peer.connection import Broken, PeerConnection
from kvstore.remote.base import MISS, PRESENT, STORED, MetaPlace, ReadResult, ReadStatus, WriteResult
from kvstore.transport.base import Deadline

MAX_CONNECTIONS = 64
MAX_IDLE_PER_PEER = 4


@functools.lru_cache(maxsize=1024)
def _parse(address: str) -> PeerAddress:
    """A peer address, parsed once per distinct string (urlsplit costs more than a small read's syscalls)."""
    return PeerAddress.parse(address)


def _timeout_ms(deadline: Deadline) -> int:
    """The peer's share of the deadline: a little less, so its refusal arrives in time."""
    remaining = deadline.remaining()
    return 0 if remaining is None else max(1, int(remaining * 900))


@dataclass(frozen=True, slots=True)
class Got:
    """One key's answer from the core: a ReadResult and, for a hit, the tier the peer held it in."""

    result: ReadResult
    tier: TierName | None = None


class _PlaceFailed(Exception):
    """The caller's ``place`` raised: its error ends the call as it is."""

    def __init__(self, err: BaseException) -> None:
        self.err = err


def _meta(head) -> tuple[int, BlockMeta, TierName]:
    i, size, sum_, parent, layout, tier = head
    return i, BlockMeta(size, sum_, parent or None, layout or ""), TierName(tier)


class TcpPeerClient:
    """Blocking reads and writes of peer blocks over TCP, with a connection pool. Thread-safe."""

    #: The address scheme served, and the connection it opens (the UCX client swaps both).
    scheme = "tcp"
    connection = PeerConnection

    def __init__(self, *, token: str = "", max_connections: int = MAX_CONNECTIONS,
                 max_idle_per_peer: int = MAX_IDLE_PER_PEER) -> None:
        self._token = token
        self._max_connections = max_connections
        self._max_idle = max_idle_per_peer
        self._lock = threading.Lock()
        self._idle: dict[PeerAddress, list[PeerConnection]] = {}
        self._open = 0
        self._in_use: set[PeerConnection] = set()
        self._closed = False
        self.counts = dict(reads=0, hits=0, misses=0, read_bytes=0, writes=0, written_bytes=0, corrupt=0, errors=0)

    @property
    def open_connections(self) -> int:
        with self._lock:
            return self._open

    # ---- the pool --------------------------------------------------------------

    def _take(self, address: PeerAddress, deadline: Deadline) -> PeerConnection:
        with self._lock:
            if self._closed:
                raise TierUnavailable("the peer transport is closed")
            idle = self._idle.get(address)
            while idle:
                conn = idle.pop()
                if conn.stale():  # the peer closed it while idle (its idle timeout, a restart)
                    self._open -= 1
                    conn.close()
                    continue
                self._in_use.add(conn)
                return conn
            if self._open >= self._max_connections:
                raise Overloaded(
                    f"all {self._max_connections} peer connections are in use: retry after the delay, "
                    "or allow more connections", retry_after_s=0.05,
                )
            self._open += 1
        try:
            conn = self.connection(address, self._token, deadline)
        except BaseException:
            with self._lock:
                self._open -= 1
            raise
        with self._lock:
            self._in_use.add(conn)
        return conn

    def _give(self, conn: PeerConnection) -> None:
        with self._lock:
            self._in_use.discard(conn)
            keep = not conn.broken and not self._closed and len(self._idle.setdefault(conn.address, [])) < self._max_idle
            if keep:
                self._idle[conn.address].append(conn)
            else:
                self._open -= 1
        if not keep:
            conn.close()

    def close(self) -> None:
        """Close idle connections and shut those in use (their calls fail TierUnavailable or Cancelled)."""
        with self._lock:
            self._closed = True
            idle = [c for conns in self._idle.values() for c in conns]
            self._idle.clear()
            busy = list(self._in_use)
            self._open -= len(idle)
        for conn in idle:
            conn.close()
        for conn in busy:
            conn.shutdown()

    def _call(self, address: str, deadline: Deadline, fn):
        deadline.check()
        peer = _parse(address)
        if peer.scheme != self.scheme:
            raise InvalidArgument(f"peer address {address!r} is not {self.scheme}://host:port")
        conn = self._take(peer, deadline)
        forget = deadline.on_cancel(conn.shutdown) if deadline.cancellable else (lambda: None)
        done = False
        try:
            conn.bound(deadline)
            out = fn(conn)
            done = True
            return out
        except Broken as broken:
            raise broken.err from None
        finally:
            forget()
            if not done:
                conn.broken = True  # the stream may be out of step: never reuse it
                with self._lock:
                    self.counts["errors"] += 1
            self._give(conn)

    # ---- reads -----------------------------------------------------------------

    def read(self, address: str, namespace: str, keys: Sequence[bytes], place: MetaPlace | None,
             deadline: Deadline) -> list[Got]:
        """Per key a Got; ``place(i, meta)`` gives each found block's view (None: skip it). Without
        ``place`` no bytes move: the answers carry metadata only (SKIPPED for a found block)."""
        validate_namespace(namespace)
        keys = list(keys)
        if not keys:
            return []
        return self._call(address, deadline, lambda conn: self._read(conn, namespace, keys, place, deadline))

    def _read(self, conn: PeerConnection, namespace: str, keys: list[bytes], place: MetaPlace | None,
              deadline: Deadline) -> list[Got]:
        if len(keys) > conn.max_batch:
            raise InvalidArgument(f"{len(keys)} keys in one read; peer {conn.address} takes at most {conn.max_batch}: split the batch")
        rid = conn.send(wire.READ, [namespace, keys, _timeout_ms(deadline), place is not None])
        out: list[Got | None] = [None] * len(keys)
        answered = 0
        try:
            while True:
                status, result = conn.reply(rid)
                if status == wire.OK:
                    break
                if status == wire.MISS:
                    out[result] = Got(MISS)
                elif status == wire.FAILED:
                    i, err = result
                    try:
                        wire.raise_error(err)
                    except StrataError as e:
                        out[i] = Got(ReadResult.failed(e))
                elif status == wire.BLOCK:
                    i, meta, tier = _meta(result)
                    out[i] = self._block(conn, i, meta, tier, place, deadline)
                else:
                    conn.close()
                    raise Broken(TierUnavailable(f"peer {conn.address} sent reply status {status} to a read"))
                answered += 1
        except _PlaceFailed as failed:
            raise failed.err
        except (Broken, StrataError) as err:
            error = err.err if isinstance(err, Broken) else err
            conn.close()  # whatever the peer still sends for this request is not read: never reuse it
            if answered == 0:
                raise error from None  # nothing answered: the whole call failed
            out = [g if g is not None else Got(ReadResult.failed(error)) for g in out]
        if any(g is None for g in out):
            conn.close()
            raise TierUnavailable(f"peer {conn.address} ended a read without answering every key")
        corrupt = [keys[i] for i, g in enumerate(out) if isinstance(g.result.error, CorruptBlock)]
        if corrupt and not conn.broken:
            self._report_corrupt(conn, namespace, corrupt)
        with self._lock:
            c = self.counts
            c["reads"] += 1
            for g in out:
                st = g.result.status
                c["hits"] += st is ReadStatus.HIT
                c["misses"] += st is ReadStatus.MISS
                c["read_bytes"] += g.result.meta.size if st is ReadStatus.HIT else 0
                c["corrupt"] += isinstance(g.result.error, CorruptBlock)
                c["errors"] += st is ReadStatus.FAILED
        return out  # type: ignore[return-value]

    @staticmethod
    def _report_corrupt(conn: PeerConnection, namespace: str, keys: list[bytes]) -> None:
        """Ask the holder to verify its copies of blocks that arrived corrupt (it drops bad ones).
        Best effort: the blocks were failed already, and a copy the holder keeps is checked again
        by the next reader."""
        try:
            conn.reply(conn.send(wire.CHECK, [namespace, keys]))
        except (Broken, StrataError):
            conn.close()

    def _block(self, conn: PeerConnection, i: int, meta: BlockMeta, tier: TierName, place: MetaPlace | None,
               deadline: Deadline) -> Got:
        if place is None:
            return Got(ReadResult.skipped(meta), tier)
        try:
            view = place(i, meta)
        except BaseException as err:
            conn.close()  # the block's bytes are still coming: the stream cannot be reused
            raise _PlaceFailed(err) from None
        if view is None:
            conn.skip()
            return Got(ReadResult.skipped(meta), tier)
        view = memoryview(view).cast("B")
        if len(view) < meta.size or view.readonly:
            conn.skip()
            why = "read-only" if view.readonly else f"{len(view)} bytes; the block has {meta.size}"
            return Got(ReadResult.failed(InvalidArgument(f"the buffer for block {i} is {why}: pass a larger, writable one")))
        hasher = Checksummer()
        conn.read_into(view[: meta.size], hasher)
        if hasher.value() != meta.checksum:
            return Got(ReadResult.failed(CorruptBlock(
                f"block {i} from peer {conn.address} failed its checksum on arrival (in transit or at the holder); "
                "its bytes were not delivered"
            )))
        return Got(ReadResult.hit(meta), tier)

    # ---- writes ----------------------------------------------------------------

    def write(self, address: str, namespace: str,
              blocks: Sequence[tuple[bytes, bytes | bytearray | memoryview, BlockMeta]], deadline: Deadline,
              ) -> list[tuple[WriteResult, TierName | None]]:
        """Per block (STORED or PRESENT, the peer's tier), or FAILED with nothing stored there."""
        validate_namespace(namespace)
        blocks = list(blocks)
        if not blocks:
            return []
        for key, data, meta in blocks:
            if len(data) != meta.size:
                raise InvalidArgument(f"a block of {len(data)} bytes declares {meta.size}: its meta must match its bytes")
        return self._call(address, deadline, lambda conn: self._write(conn, namespace, blocks, deadline))

    def _write(self, conn: PeerConnection, namespace: str, blocks, deadline: Deadline):
        head = [[bytes(k), m.size, m.checksum, m.parent, m.layout] for k, _, m in blocks]
        rid = conn.send(wire.PUT, [namespace, _timeout_ms(deadline), head])
        _, present = conn.reply(rid)
        sent = [(data, m) for (_, data, m), p in zip(blocks, present) if not p]
        conn.bound(deadline)
        conn.send(wire.DATA, [], [memoryview(d).cast("B") for d, _ in sent], rid=rid)
        _, results = conn.reply(rid)
        out, it = [], iter(results)
        for p in present:
            if p:
                out.append((PRESENT, None))
                continue
            stored, detail = next(it)
            if stored is None:
                try:
                    wire.raise_error(detail)
                except StrataError as err:
                    out.append((WriteResult.failed(err), None))
            else:
                out.append((STORED if stored else PRESENT, TierName(detail)))
        with self._lock:
            self.counts["writes"] += 1
            self.counts["written_bytes"] += sum(m.size for (_, _, m), (r, _) in zip(blocks, out) if r is STORED)
        return out

    # ---- holds -----------------------------------------------------------------

    def hold(self, address: str, namespace: str, keys: Sequence[bytes], lease_s: float,
             deadline: Deadline) -> Held:
        """Pin ``keys`` at the peer for ``lease_s`` (see :meth:`PeerTransport.hold`)."""
        validate_namespace(namespace)
        keys = [bytes(k) for k in keys]
        if not keys:
            return Held(0, 0.0, [])
        lease_ms = max(1, int(lease_s * 1000))

        def call(conn: PeerConnection) -> Held:
            _, result = conn.reply(conn.send(wire.HOLD, [namespace, keys, lease_ms]))
            try:
                lease_id, granted_ms, held = result
                if not (isinstance(held, list) and len(held) == len(keys)):
                    raise ValueError("one answer per key")
                return Held(int(lease_id), float(granted_ms) / 1000, [bool(h) for h in held])
            except (TypeError, ValueError):
                raise TierUnavailable(f"peer {address} answered a hold of {len(keys)} keys with {result!r:.80}") from None

        return self._call(address, deadline, call)

    def release(self, address: str, lease_ids: Sequence[int], deadline: Deadline) -> list[bool]:
        """End holds at the peer; per id whether it was still held."""
        lease_ids = [int(i) for i in lease_ids]
        if not lease_ids:
            return []
        def call(conn: PeerConnection) -> list[bool]:
            _, result = conn.reply(conn.send(wire.RELEASE, [lease_ids]))
            if not isinstance(result, list) or len(result) != len(lease_ids):
                raise TierUnavailable(f"peer {address} answered a release of {len(lease_ids)} holds with {result!r:.80}")
            return [bool(r) for r in result]

        return self._call(address, deadline, call)


class TcpPeerTransport(PeerTransport):
    """The :class:`PeerTransport` over TCP: the blocking core in worker threads, ``place`` on the loop."""

    scheme = "tcp"
    writes = True
    client_class = TcpPeerClient

    def __init__(self, *, token: str = "", max_connections: int = MAX_CONNECTIONS,
                 max_idle_per_peer: int = MAX_IDLE_PER_PEER) -> None:
        self.client = self.client_class(token=token, max_connections=max_connections, max_idle_per_peer=max_idle_per_peer)
        self._workers = concurrent.futures.ThreadPoolExecutor(max_workers=max_connections, thread_name_prefix="strata-peer-io")
        self._closed = False

    async def _run(self, deadline: float, fn, *args):
        if self._closed:
            raise TierUnavailable(f"the {self.scheme} peer transport is closed")
        if deadline - time.monotonic() <= 0:
            raise DeadlineExceeded("the peer call's deadline had passed before it started; nothing was tried")
        call = Deadline(deadline)
        future = asyncio.get_running_loop().run_in_executor(self._workers, fn, *args, call)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            call.cancel()  # shuts the socket: the worker stops at once
            while not future.done():  # it must stop writing into the caller's buffers before we return
                try:
                    await asyncio.wait({future})
                except asyncio.CancelledError:
                    continue
            raise

    def _on_loop(self, place: MetaPlace, deadline: float) -> MetaPlace:
        loop = asyncio.get_running_loop()

        def placed(i: int, meta: BlockMeta):
            answer: concurrent.futures.Future = concurrent.futures.Future()

            def run() -> None:
                try:
                    answer.set_result(place(i, meta))
                except BaseException as err:  # noqa: BLE001 - handed to the worker, which re-raises it
                    answer.set_exception(err)

            loop.call_soon_threadsafe(run)
            try:
                return answer.result(timeout=max(0.001, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                raise DeadlineExceeded("the placement did not answer before the deadline") from None

        return placed

    async def read(self, address, namespace, keys, place, deadline) -> list[ReadResult]:
        got = await self._run(deadline, self.client.read, address, namespace, keys, self._on_loop(place, deadline))
        return [g.result for g in got]

    async def lookup(self, address, namespace, keys, deadline) -> list[BlockMeta | None]:
        got = await self._run(deadline, self.client.read, address, namespace, keys, None)
        out = []
        for g in got:
            if g.result.status is ReadStatus.FAILED:
                raise g.result.error
            out.append(g.result.meta)
        return out

    async def write(self, address, namespace, blocks, deadline) -> list[WriteResult]:
        got = await self._run(deadline, self.client.write, address, namespace, blocks)
        return [r for r, _ in got]

    async def hold(self, address, namespace, keys, lease_s, deadline) -> Held:
        return await self._run(deadline, self.client.hold, address, namespace, keys, lease_s)

    async def release(self, address, lease_ids, deadline) -> list[bool]:
        return await self._run(deadline, self.client.release, address, lease_ids)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.client.close()
        await asyncio.get_running_loop().run_in_executor(None, self._workers.shutdown, True)

    def stats(self) -> PeerStats:
        c = self.client.counts
        return PeerStats(self.scheme, c["reads"], c["hits"], c["misses"], c["read_bytes"], c["writes"],
                         c["written_bytes"], c["corrupt"], c["errors"], self.client.open_connections)
