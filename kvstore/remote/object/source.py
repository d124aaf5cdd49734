"""ObjectSource: the object tier as a remote source (:mod:`kvstore.remote.base`), over S3.

Every block is one object (:mod:`~kvstore.remote.object.layout` names it,
:mod:`~kvstore.remote.object.format` lays out its bytes). The contract's
calls, and what each costs in S3 requests:

``lookup``
    A small ranged GET per key (the header; :data:`PROBE_BYTES`), all at
    once within ``max_requests``.
``read``
    One GET per key, streamed: the header's metadata goes to ``place``, the
    payload is copied chunk by chunk into the caller's buffer and hashed on
    the way (obstore cannot read into a caller's buffer, so this is the one
    copy). A block is a hit only when its xxh3-64 matches; an object that
    fails (its header, its length, its bytes) is deleted and the key
    reported ``CorruptBlock``, never served.
``write``
    Per block: the object is built (one copy, verified against the meta in
    the same pass), the quota reserves room, a ranged GET asks whether the
    bucket already has it (``check_before_put``: a block another pod wrote
    is not sent again) and then one conditional PUT (``If-None-Match: *``)
    stores it: of two writers racing, exactly one object is written and the
    other is told ``PRESENT``. Objects of ``multipart_bytes`` or more go up
    as multipart uploads, which S3 cannot make conditional through obstore:
    two writers racing on such a block may both upload it (the same bytes
    under the same name: still one object).
``delete``
    A ranged GET per key (to count what was there), then one bulk delete.

Deadlines and close: each call runs as a task raced against its deadline
and against ``close()``; whichever comes first cancels the work (obstore
drops the request), and keys not answered by then fail
``DeadlineExceeded`` or ``TierUnavailable``. Nothing half-written becomes
visible: a single PUT is atomic, and an abandoned multipart upload leaves
only parts S3 hides (a bucket lifecycle rule for incomplete multipart
uploads reclaims them).

Objects of a newer format are misses, never deleted (a newer daemon wrote
them); objects whose header is broken, or lies about the object (a size
past its end, another block's key, a field out of range), are deleted as
corrupt by whichever call meets them first: read, fetch, lookup, or the
probe before a write. A header's size is checked against the object's
length as S3 reports it before anything is sized by it; only then is a
block larger than ``max_block_bytes`` a miss, left alone (another fleet's
block, whole and consistent).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import xxhash

from kvstore.block import BlockKey, BlockMeta, Checksummer, TierName
from kvstore.errors import CorruptBlock, DeadlineExceeded, InvalidArgument, StrataError, TierUnavailable
from kvstore.remote.base import (
    MISS, PRESENT, STORED, MetaPlace, ReadResult, RemoteSource, RemoteStats, WriteResult, check_batch, time_left,
)
from kvstore.remote.object.client import S3Client, S3Options
from kvstore.remote.object.format import (
    FIXED_BYTES, MAX_MAP_BYTES, PROBE_BYTES, Framed, Header, UnknownFormat, decode_header, encode, header_length,
)
from kvstore.remote.object.layout import KeyLayout
from kvstore.remote.object.lifecycle import ReadMarks
from kvstore.remote.object.metrics import ObjectMetrics
from kvstore.remote.object.quota import ByteQuota, Quota

log = logging.getLogger(__name__)
T = TypeVar("T")
DEFAULT_MULTIPART_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class ObjectLimits:
    multipart_bytes: int = DEFAULT_MULTIPART_BYTES  # objects at least this large go up in parts (not conditional)
    check_before_put: bool = True  # ask (a ranged GET) before uploading: no second upload of a stored block
    max_block_bytes: int = 1 << 30  # a larger block (another fleet's limits) is a miss here: never allocated

    def __post_init__(self) -> None:
        if self.multipart_bytes < 5 << 20:
            raise InvalidArgument(f"multipart_bytes {self.multipart_bytes} is under S3's 5MiB minimum part")


class ObjectSource(RemoteSource):
    tier = TierName.OBJECT

    def __init__(
        self, client: S3Client, layout: KeyLayout, *, limits: ObjectLimits = ObjectLimits(),
        quota: Quota | None = None, wall_clock: Callable[[], float] = time.time, marks: ReadMarks | None = None,
        on_dropped: Callable[[list[BlockKey]], None] | None = None,
    ) -> None:
        """``marks``: writes read markers for a TTL counted from last use (kvstore.remote.object.lifecycle);
        ``on_dropped(keys)``: called on this loop when a corrupt object was deleted (be quick)."""
        self._client = client
        self._on_dropped = on_dropped
        self._marks = marks
        self._layout = layout
        self._limits = limits
        self._quota = quota
        self._wall = wall_clock
        self._metrics: ObjectMetrics = client.metrics
        self.name = f"{client.name}/{layout.prefix}" if layout.prefix else client.name
        self._closed = False
        self._closing = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_flight = 0
        self._hits = self._misses = self._read_bytes = 0
        self._stored = self._written_bytes = self._errors = 0

    @classmethod
    def open(cls, rest: str, *, capacity_bytes: int | None = None, multipart_bytes: int = DEFAULT_MULTIPART_BYTES,
             check_before_put: bool = True, max_block_bytes: int = 1 << 30, metrics: ObjectMetrics | None = None,
             **options: Any) -> ObjectSource:
        """``rest``: ``BUCKET[/PREFIX]``; ``options``: the fields of :class:`S3Options` (endpoint,
        region, credentials, max_requests, retries, ...); ``capacity_bytes``: a :class:`ByteQuota`."""
        bucket, _, prefix = rest.partition("/")
        try:
            client = S3Client(S3Options(bucket=bucket, **options), metrics)
        except TypeError as err:
            raise InvalidArgument(f"object source s3://{rest}: {err}") from None
        source = cls(client, KeyLayout(prefix), limits=ObjectLimits(multipart_bytes, check_before_put, max_block_bytes))
        if capacity_bytes is not None:
            if capacity_bytes <= 0:
                raise InvalidArgument(f"capacity_bytes is {capacity_bytes}: give a positive number of bytes")
            source._quota = ByteQuota(capacity_bytes, source.name)
        return source

    @property
    def layout(self) -> KeyLayout:
        return self._layout

    @property
    def client(self) -> S3Client:
        return self._client

    # The contract.

    async def lookup(self, keys: Sequence[BlockKey], deadline: float) -> list[BlockMeta | None]:
        async def body() -> list[BlockMeta | None]:
            found = await _gather([self._probe(k, deadline) for k in keys])
            return [h.meta if isinstance(h, Header) and self._takes(h) else None for h in found]

        return await self._whole("lookup", len(keys), deadline, body)

    async def delete(self, keys: Sequence[BlockKey], deadline: float) -> int:
        async def body() -> int:
            unique = list(dict.fromkeys(keys))
            found = await _gather([self._probe(k, deadline, keep_corrupt=True) for k in unique])
            present = [(k, h) for k, h in zip(unique, found) if h is not None]
            await self._client.delete([self._layout.path(k) for k, _ in present], deadline)
            for k, h in present:
                if isinstance(h, Header) and self._quota is not None:
                    self._quota.forget(k, h.meta.size)
            return len(present)

        return await self._whole("delete", len(keys), deadline, body)

    async def read(self, keys: Sequence[BlockKey], place: MetaPlace, deadline: float) -> list[ReadResult]:
        turns = _turns_by_key(keys)

        async def step(i: int) -> ReadResult:
            await turns.wait(i)  # a key repeated in one batch is read again after its earlier read ended
            try:
                return await self._read_one(i, keys[i], place, deadline)
            finally:
                turns.done(i)

        return await self._per_key("read", len(keys), step, deadline, ReadResult.failed)

    async def fetch(self, key: BlockKey, deadline: float) -> tuple[memoryview, BlockMeta] | None:
        """One block whole, verified where it landed: a read-only view of its payload in the response
        body, no copy and no buffer to zero, for a caller with none of its own (the object tier's
        read-through: the store copies it where it goes). None on a miss; a damaged object is
        deleted and raised as CorruptBlock."""
        return await self._whole("read", 1, deadline, lambda: self._fetch_one(key, deadline))

    async def write(
        self, blocks: Sequence[tuple[BlockKey, bytes | bytearray | memoryview, BlockMeta]], deadline: float
    ) -> list[WriteResult]:
        """Store blocks; a block's bytes may come as a :class:`~kvstore.remote.object.format.Framed`
        object (the write-back queue's, checked when it was framed): uploaded as it is."""
        turns = _turns_by_key([b[0] for b in blocks])

        async def step(i: int) -> WriteResult:
            earlier = await turns.wait(i)  # a key repeated in one batch is written once
            result: WriteResult | None = None
            try:
                if earlier is not None:
                    result = PRESENT if earlier.ok else earlier
                else:
                    result = await self._write_one(*blocks[i], deadline)
                return result
            finally:
                turns.done(i, result)  # None (it raised): the next occurrence writes it itself

        return await self._per_key("write", len(blocks), step, deadline, WriteResult.failed)

    async def close(self) -> None:
        self._closed = True
        self._closing.set()
        await self._idle.wait()

    def stats(self) -> RemoteStats:
        q = self._quota
        return RemoteStats(
            self.tier, self.name, self._hits, self._misses, self._read_bytes, self._stored, self._written_bytes,
            self._errors, None, None if q is None else q.used_bytes, None if q is None else q.capacity_bytes,
        )

    # One key's work.

    def _takes(self, header: Header) -> bool:
        """Whether this daemon reads the block: a larger one (another fleet's limits) is a miss here."""
        return header.meta.size <= self._limits.max_block_bytes

    async def _probe(self, key: BlockKey, deadline: float, keep_corrupt: bool = False) -> Header | CorruptBlock | None:
        """The header of ``key``'s object, None when absent (or of a newer format); a damaged one is
        deleted and reported None, or as its CorruptBlock when ``keep_corrupt`` (it was there)."""
        path = self._layout.path(key)
        got = await self._client.get_range_sized(path, 0, PROBE_BYTES, deadline)
        if got is None:
            return None
        head, object_bytes = got
        try:
            need = header_length(head)
            if len(head) < need and len(head) == PROBE_BYTES:  # a long header: ask for all of it
                got = await self._client.get_range_sized(path, 0, need, deadline)
                if got is None:
                    return None
                head, object_bytes = got
            return decode_header(head, key, object_bytes)
        except UnknownFormat:
            return None
        except CorruptBlock as err:
            failed = await self._drop_corrupt(key, path, None, err, deadline)
            return failed.error if keep_corrupt else None

    async def _read_one(self, i: int, key: BlockKey, place: MetaPlace, deadline: float) -> ReadResult:
        path = self._layout.path(key)
        damage: tuple[CorruptBlock, Header | None] | None = None
        async with self._client.reading(path, deadline) as body:
            if body is None:
                self._misses += 1
                return MISS
            chunks = body.chunks().__aiter__()
            header: Header | None = None
            try:
                head, header = await _read_header(chunks, key, body.size)
                if not self._takes(header):
                    log.warning("%s: block %s is %d bytes, over this daemon's %d: read as a miss", self.name, key,
                                header.meta.size, self._limits.max_block_bytes)
                    self._misses += 1
                    return MISS
                view = place(i, header.meta)
                if view is None:
                    return ReadResult.skipped(header.meta)
                dst = _writable(self.name, key, view, header.meta.size)
                if isinstance(dst, ReadResult):
                    self._errors += 1
                    return dst
                await _fill(dst, memoryview(head)[header.header_bytes:], chunks, header.meta)
            except UnknownFormat:
                self._misses += 1
                return MISS
            except CorruptBlock as err:
                damage = (err, header)
        if damage is not None:  # the request's turn is given back before the delete takes one
            err, header = damage
            return await self._drop_corrupt(key, path, header, err, deadline)
        self._hits += 1
        self._read_bytes += header.meta.size
        if self._marks is not None:
            await self._marks.read(key, header.written_at, deadline)
        return ReadResult.hit(header.meta)

    async def _fetch_one(self, key: BlockKey, deadline: float) -> tuple[memoryview, BlockMeta] | None:
        path = self._layout.path(key)
        damage: tuple[CorruptBlock, Header | None] | None = None
        header: Header | None = None
        async with self._client.reading(path, deadline) as body:
            if body is None:
                self._misses += 1
                return None
            oversized = body.size > self._limits.max_block_bytes + FIXED_BYTES + MAX_MAP_BYTES
            if not oversized:  # never a body larger than the largest block in memory
                view = memoryview(await body.whole())
                try:
                    header = decode_header(view, key, len(view))
                    if not self._takes(header):
                        self._misses += 1
                        return None
                    payload = view[header.header_bytes:]
                    if xxhash.xxh3_64_intdigest(payload) != header.meta.checksum:
                        raise CorruptBlock("its bytes failed their xxh3-64 checksum")
                except UnknownFormat:
                    self._misses += 1
                    return None
                except CorruptBlock as err:
                    damage = (err, header)
        if oversized:  # the request's turn given back: its header alone says whether it is whole
            found = await self._probe(key, deadline, keep_corrupt=True)
            if isinstance(found, CorruptBlock):
                raise found
            if found is not None:
                log.warning("%s: block %s is %d bytes, over this daemon's %d: read as a miss", self.name, key,
                            found.meta.size, self._limits.max_block_bytes)
            self._misses += 1
            return None
        if damage is not None:
            failed = await self._drop_corrupt(key, path, damage[1], damage[0], deadline)
            raise failed.error
        self._hits += 1
        self._read_bytes += header.meta.size
        if self._marks is not None:
            await self._marks.read(key, header.written_at, deadline)
        return payload, header.meta

    async def _write_one(self, key: BlockKey, data, meta: BlockMeta, deadline: float) -> WriteResult:
        try:
            obj = data.obj if isinstance(data, Framed) else encode(key, data, meta, self._wall())
        except (CorruptBlock, InvalidArgument) as err:
            self._errors += 1
            return WriteResult.failed(err if isinstance(err, CorruptBlock) else InvalidArgument(f"{self.name}: {err}"))
        if self._quota is not None:
            refused = self._quota.reserve(key, meta.size)
            if refused is not None:
                self._errors += 1
                return WriteResult.failed(refused)
        stored = False
        path = self._layout.path(key)
        try:
            if self._limits.check_before_put and isinstance(await self._probe(key, deadline), Header):
                return PRESENT
            if len(obj) >= self._limits.multipart_bytes:
                stored = await self._client.put(path, obj, deadline, create=False)
            else:
                stored = await self._client.put(path, obj, deadline, create=True)
        except StrataError as err:  # TierUnavailable or InvalidArgument from the client: this key failed
            self._errors += 1
            return WriteResult.failed(err)
        finally:
            if self._quota is not None:
                (self._quota.commit if stored else self._quota.release)(key, meta.size)
        if not stored:
            return PRESENT
        self._stored += 1
        self._written_bytes += meta.size
        return STORED

    async def _drop_corrupt(self, key: BlockKey, path: str, header: Header | None, err: CorruptBlock,
                            deadline: float) -> ReadResult:
        self._errors += 1
        self._metrics.corrupt.inc()
        log.error("%s: object %s of block %s is corrupt (%s): deleting it", self.name, path, key, err)
        try:
            await self._client.delete([path], deadline)
        except StrataError as failed:  # best effort: the next read finds it corrupt again
            log.warning("%s: could not delete the corrupt object of %s: %s", self.name, key, failed)
        else:
            if header is not None and self._quota is not None:
                self._quota.forget(key, header.meta.size)
            if self._on_dropped is not None:
                self._on_dropped([key])
        return ReadResult.failed(CorruptBlock(
            f"{self.name}: block {key} failed its check when read ({err}); the object was deleted: "
            "read it from another tier or write it again"
        ))

    # Deadlines and close.

    async def _whole(self, op: str, n: int, deadline: float, body: Callable[[], Awaitable[T]]) -> T:
        """An all-or-nothing call: ``body``'s answer, or an error (nothing reported done)."""
        try:
            return await self._race(op, n, deadline, body, per_key=False)
        except StrataError:
            self._errors += 1
            raise

    async def _per_key(self, op: str, n: int, step: Callable[[int], Awaitable], deadline: float,
                       failed: Callable[[StrataError], Any]) -> list:
        """A per-key call: keys answered before the deadline (or close) keep their answer, the rest fail."""
        results: list = [None] * n

        async def body() -> None:
            async def fill(i: int) -> None:
                try:
                    results[i] = await step(i)
                except StrataError as err:  # the client's TierUnavailable or InvalidArgument: this key failed
                    self._errors += 1
                    results[i] = failed(err)

            await _gather([fill(i) for i in range(n)])

        try:
            await self._race(op, n, deadline, body, per_key=True)
        except _Stopped as stop:
            self._errors += results.count(None)
            return [failed(stop.error) if r is None else r for r in results]
        return results

    async def _race(self, op: str, n: int, deadline: float, body: Callable[[], Awaitable[T]], per_key: bool) -> T:
        """Run ``body`` until it ends, the deadline passes or the source closes; the last two cancel
        it and raise (``_Stopped`` for a per-key call, whose answered keys keep their answers)."""
        left = time_left(self, op, deadline)
        check_batch(self, op, n)
        if self._closed:
            raise TierUnavailable(f"{self.name} is closed: {op} refused; open a new source")
        self._in_flight += 1
        self._idle.clear()
        work = asyncio.ensure_future(body())
        closer = asyncio.ensure_future(self._closing.wait())
        try:
            done, _ = await asyncio.wait({work, closer}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                return work.result()
            if self._closing.is_set():
                error: StrataError = TierUnavailable(f"{self.name} closed during the {op}; open a new source and retry")
            else:
                error = DeadlineExceeded(
                    f"{self.name}: {op} of {n} blocks passed its deadline: give it more time or fewer blocks"
                )
            raise _Stopped(error) if per_key else error
        finally:
            closer.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()


class _Turns:
    """Indices of one batch that name the same key take turns, in index order (distinct keys run at once)."""

    def __init__(self, previous: list[int | None]) -> None:
        self._previous = previous  # index of the same key's earlier occurrence, or None
        self._ended: dict[int, asyncio.Future] = {}

    def _future(self, i: int) -> asyncio.Future:
        if i not in self._ended:
            self._ended[i] = asyncio.get_running_loop().create_future()
        return self._ended[i]

    async def wait(self, i: int):
        """Wait for the same key's previous occurrence; its result (None for the first occurrence)."""
        j = self._previous[i]
        return None if j is None else await asyncio.shield(self._future(j))

    def done(self, i: int, result=True) -> None:
        future = self._future(i)
        if not future.done():
            future.set_result(result)


def _turns_by_key(keys: Sequence[BlockKey]) -> _Turns:
    last: dict[BlockKey, int] = {}
    previous: list[int | None] = []
    for i, k in enumerate(keys):
        previous.append(last.get(k))
        last[k] = i
    return _Turns(previous)


class _Stopped(Exception):
    def __init__(self, error: StrataError) -> None:
        self.error = error


async def _gather(coros: list[Awaitable[T]]) -> list[T]:
    """Run all at once; the first exception cancels the rest and is raised as itself."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        if any(not t.done() for t in tasks):
            await asyncio.gather(*tasks, return_exceptions=True)


async def _read_header(chunks, key: BlockKey, object_bytes: int) -> tuple[bytes | bytearray, Header]:
    """The first bytes of a streamed object of ``object_bytes``, holding at least its whole header, and
    the header (CorruptBlock unless it describes an object of that length)."""
    head: bytes | bytearray = b""
    need = FIXED_BYTES
    while True:
        while len(head) < need:
            chunk = await anext(chunks, None)
            if chunk is None:
                raise CorruptBlock(f"object ends after {len(head)} bytes, inside its header")
            head = chunk if not head else bytearray(head) + chunk
        if need == FIXED_BYTES:
            need = header_length(head)
            continue
        return head, decode_header(head, key, object_bytes)


def _writable(name: str, key: BlockKey, view, size: int) -> memoryview | ReadResult:
    dst = memoryview(view)
    if dst.readonly or not dst.contiguous or dst.nbytes < size:
        what = "read-only" if dst.readonly else "not contiguous" if not dst.contiguous else f"{dst.nbytes} bytes"
        return ReadResult.failed(InvalidArgument(
            f"{name}: the buffer placed for block {key} is {what}; it needs {size} writable contiguous bytes"
        ))
    return dst.cast("B")[:size]


async def _fill(dst: memoryview, first: memoryview, chunks, meta: BlockMeta) -> None:
    """Copy the payload into ``dst`` as it arrives, hashing as it lands; CorruptBlock unless it is the block."""
    h = Checksummer()
    filled = 0
    part: memoryview | bytes | None = first
    while part is not None:
        n = len(part)
        if filled + n > meta.size:
            raise CorruptBlock(f"object holds more than the {meta.size} bytes its header says")
        dst[filled:filled + n] = part
        h.update(dst[filled:filled + n])
        filled += n
        part = await anext(chunks, None)
    if filled != meta.size:
        raise CorruptBlock(f"object ends after {filled} of its {meta.size} bytes")
    if h.value() != meta.checksum:
        raise CorruptBlock("its bytes failed their xxh3-64 checksum")
