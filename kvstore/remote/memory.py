"""The in-process remote source: blocks in this process's memory, behaving like far ones.

A real source, not a mock (as httpx's ``MockTransport`` is a real
transport): it keeps every rule of the contract in
:mod:`kvstore.remote.base` and passes the same suite the peer and object
sources will, so store tests that run a chain ending in it test the store,
not a stand-in. What makes it useful for that:

- **Shared under a name.** Every ``MemoryRemote("fleet")`` in a process sees
  the same blocks, as every node sees one bucket or one peer: two stores in
  one test exchange blocks through it, and a store closed and opened again
  finds what it wrote (the object tier's point is to outlive restarts). The
  blocks behind a name live until :func:`forget` drops them; a source made
  without a name has blocks of its own.
- **Bounded.** A capacity in bytes per name. When full, a write fails with
  ``TierFull`` for that key, or with ``evict=True`` the least recently used
  blocks make room, as a peer with its own cache or a bucket with a
  lifecycle rule would. Blocks being read are not torn by an eviction:
  readers hold their own reference.
- **Slow on request.** ``latency_s`` is slept once per call (the round
  trip), ``bytes_per_s`` per copied chunk (the transfer), both with
  ``asyncio.sleep`` semantics, so deadlines and cancellation are exercised
  for real and a read can be stopped half-way through a block. Both are
  plain attributes a test may change between calls.
- **Corruptible.** :meth:`MemoryRemote.corrupt` flips a stored byte, as a bit
  flip in a bucket would, for tests and chaos drills.

A name's blocks are shared between threads (each store's bridge runs its own
event loop thread), so they sit behind a lock held only for dictionary
work; bytes are copied outside it. A write reserves its room under the lock,
copies, then commits, so a block is visible in full or not at all, and a
write that is cancelled or times out gives its reservation back.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence

from kvstore.block import BlockKey, BlockMeta, Checksummer, TierName, copy_and_checksum
from kvstore.errors import (
    BlockTooLarge,
    CorruptBlock,
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    StrataError,
    TierFull,
    TierUnavailable,
)
from kvstore.remote.base import (
    MISS,
    PRESENT,
    STORED,
    MetaPlace,
    ReadResult,
    RemoteSource,
    RemoteStats,
    WriteResult,
    check_batch,
    time_left,
)

DEFAULT_CAPACITY_BYTES = 256 << 20
MAX_SHARED_NAMES = 256  # named block sets in one process; each is bounded by its capacity
TIER_FULL_RETRY_S = 1.0  # a full remote frees room only when something else deletes
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

_PACED_CHUNK = 256 << 10  # at bytes_per_s, the bytes copied between two pauses (a deadline can fall between)


class _Blocks:
    """The blocks behind one name: what a bucket, or a peer's store, holds. Thread-safe."""

    def __init__(self, capacity_bytes: int, evict: bool) -> None:
        self.capacity_bytes = capacity_bytes
        self.evict = evict
        self.lock = threading.Lock()
        self.blocks: OrderedDict[BlockKey, tuple[bytes | bytearray, BlockMeta]] = OrderedDict()  # LRU first
        self.used = 0
        self.reserved = 0

    def get(self, key: BlockKey) -> tuple[bytes | bytearray, BlockMeta] | None:
        with self.lock:
            found = self.blocks.get(key)
            if found is not None:
                self.blocks.move_to_end(key)
            return found

    def meta(self, key: BlockKey) -> BlockMeta | None:
        with self.lock:
            found = self.blocks.get(key)
            return None if found is None else found[1]

    def reserve(self, key: BlockKey, size: int, where: str) -> WriteResult | None:
        """Room for a new block (None), or the answer without it: PRESENT, or why there is no room."""
        with self.lock:
            if key in self.blocks:
                return PRESENT
            if size > self.capacity_bytes:
                return WriteResult.failed(
                    BlockTooLarge(
                        f"{where}: block {key} is {size} bytes, more than the whole source "
                        f"({self.capacity_bytes}): raise its capacity or keep such blocks local"
                    )
                )
            while self.evict and self.blocks and self.used + self.reserved + size > self.capacity_bytes:
                _, (old, _meta) = self.blocks.popitem(last=False)
                self.used -= len(old)
            if self.used + self.reserved + size > self.capacity_bytes:
                return WriteResult.failed(
                    TierFull(
                        f"{where}: no room for block {key} ({size} bytes; {self.used} used, "
                        f"{self.reserved} being written, of {self.capacity_bytes}): delete blocks, "
                        "raise the capacity, or open it with evict=True",
                        retry_after_s=TIER_FULL_RETRY_S,
                    )
                )
            self.reserved += size
            return None

    def release(self, size: int) -> None:
        with self.lock:
            self.reserved -= size

    def commit(self, key: BlockKey, data: bytearray, meta: BlockMeta) -> bool:
        """Make a reserved block visible; False when another writer stored the key meanwhile."""
        with self.lock:
            self.reserved -= len(data)
            if key in self.blocks:
                return False
            self.blocks[key] = (data, meta)
            self.used += len(data)
            return True

    def remove(self, key: BlockKey, only: bytes | bytearray | None = None) -> bool:
        """Drop a block (only if it is still the copy ``only``, when given)."""
        with self.lock:
            found = self.blocks.get(key)
            if found is None or (only is not None and found[0] is not only):
                return False
            del self.blocks[key]
            self.used -= len(found[0])
            return True

    def flip(self, key: BlockKey, offset: int) -> bool:
        with self.lock:
            found = self.blocks.get(key)
            if found is None or not 0 <= offset < len(found[0]):
                return False
            damaged = bytearray(found[0])  # a new object: readers holding the old copy keep it intact
            damaged[offset] ^= 0xFF
            self.blocks[key] = (damaged, found[1])
            return True


_shared: dict[str, _Blocks] = {}
_shared_lock = threading.Lock()


def _blocks_named(name: str, capacity_bytes: int | None, evict: bool | None) -> _Blocks:
    with _shared_lock:
        blocks = _shared.get(name)
        if blocks is None:
            if len(_shared) >= MAX_SHARED_NAMES:
                raise ResourceExhausted(
                    f"memory://{name}: this process already holds {MAX_SHARED_NAMES} named in-process "
                    "remotes: forget() the ones no longer used"
                )
            blocks = _shared[name] = _Blocks(
                DEFAULT_CAPACITY_BYTES if capacity_bytes is None else capacity_bytes, bool(evict)
            )
            return blocks
    if capacity_bytes is not None and capacity_bytes != blocks.capacity_bytes:
        raise InvalidArgument(
            f"memory://{name} exists with capacity {blocks.capacity_bytes} bytes, not {capacity_bytes}: "
            "open it without capacity_bytes, or forget() it first"
        )
    if evict is not None and bool(evict) != blocks.evict:
        raise InvalidArgument(
            f"memory://{name} exists with evict={blocks.evict}: open it without evict, or forget() it first"
        )
    return blocks


def forget(name: str) -> bool:
    """Drop the blocks shared under ``name`` (sources still open keep the old set). False if unknown."""
    with _shared_lock:
        return _shared.pop(name, None) is not None


class MemoryRemote(RemoteSource):
    """An in-process remote source; see the module docstring. One event loop per object."""

    def __init__(
        self,
        name: str | None = None,
        *,
        capacity_bytes: int | None = None,
        evict: bool | None = None,
        tier: TierName = TierName.OBJECT,
        latency_s: float = 0.0,
        bytes_per_s: float | None = None,
    ) -> None:
        if tier not in (TierName.PEER, TierName.OBJECT):
            raise InvalidArgument(f"a remote source is a PEER or OBJECT tier, not {TierName(tier).name}")
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise InvalidArgument(f"capacity_bytes is {capacity_bytes}: give a positive number of bytes")
        if latency_s < 0 or (bytes_per_s is not None and bytes_per_s <= 0):
            raise InvalidArgument(
                f"latency_s={latency_s}, bytes_per_s={bytes_per_s}: latency must be >= 0 and "
                "the rate positive (None: no transfer delay)"
            )
        if name is None:
            self._blocks = _Blocks(DEFAULT_CAPACITY_BYTES if capacity_bytes is None else capacity_bytes, bool(evict))
            self.name = "memory://"
        else:
            if not _NAME_RE.match(name):
                raise InvalidArgument(
                    f"in-process remote name {name!r}: use 1-128 characters of [A-Za-z0-9._-], "
                    "starting with a letter or digit"
                )
            self._blocks = _blocks_named(name, capacity_bytes, evict)
            self.name = f"memory://{name}"
        self.tier = TierName(tier)
        self.latency_s = latency_s
        self.bytes_per_s = bytes_per_s
        self._closed = False
        self._wakers: set[asyncio.Future] = set()  # pauses that close() cuts short
        self._in_flight = 0
        self._idle: asyncio.Future | None = None
        self._hits = self._misses = self._read_bytes = 0
        self._stored = self._written_bytes = self._errors = 0

    # The contract.

    async def lookup(self, keys: Sequence[BlockKey], deadline: float) -> list[BlockMeta | None]:
        return await self._whole("lookup", len(keys), deadline, lambda: [self._blocks.meta(k) for k in keys])

    async def delete(self, keys: Sequence[BlockKey], deadline: float) -> int:
        return await self._whole("delete", len(keys), deadline, lambda: sum(self._blocks.remove(k) for k in keys))

    async def read(self, keys: Sequence[BlockKey], place: MetaPlace, deadline: float) -> list[ReadResult]:
        return await self._batch(
            "read", len(keys), lambda i: self._read_one(i, keys[i], place), deadline, ReadResult.failed
        )

    async def write(
        self, blocks: Sequence[tuple[BlockKey, bytes | bytearray | memoryview, BlockMeta]], deadline: float
    ) -> list[WriteResult]:
        return await self._batch(
            "write", len(blocks), lambda i: self._write_one(*blocks[i]), deadline, WriteResult.failed
        )

    async def close(self) -> None:
        self._closed = True
        for waker in self._wakers:
            if not waker.done():
                waker.set_result(None)
        if self._in_flight:
            if self._idle is None:
                self._idle = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._idle)

    def stats(self) -> RemoteStats:
        with self._blocks.lock:
            blocks, used = len(self._blocks.blocks), self._blocks.used
        return RemoteStats(
            self.tier, self.name, self._hits, self._misses, self._read_bytes, self._stored,
            self._written_bytes, self._errors, blocks, used, self._blocks.capacity_bytes,
        )  # fmt: skip

    # For tests and chaos drills.

    def corrupt(self, key: BlockKey, offset: int = 0) -> bool:
        """Flip the stored byte at ``offset`` of a block, as a bit flip at rest would. False if absent."""
        return self._blocks.flip(key, offset)

    # One key's work.

    async def _read_one(self, i: int, key: BlockKey, place: MetaPlace) -> ReadResult:
        found = self._blocks.get(key)
        if found is None:
            self._misses += 1
            return MISS
        data, meta = found
        view = place(i, meta)
        if view is None:
            return ReadResult.skipped(meta)
        dst = memoryview(view)
        if dst.readonly or not dst.contiguous or dst.nbytes < meta.size:
            self._errors += 1
            what = "read-only" if dst.readonly else "not contiguous" if not dst.contiguous else f"{dst.nbytes} bytes"
            return ReadResult.failed(
                InvalidArgument(
                    f"{self.name}: the buffer placed for block {key} is {what}; "
                    f"it needs {meta.size} writable contiguous bytes"
                )
            )
        dst = dst.cast("B")[: meta.size]
        got = await self._copy(dst, data) if len(data) == meta.size else None
        if got != meta.checksum:
            self._blocks.remove(key, only=data)
            self._errors += 1
            return ReadResult.failed(
                CorruptBlock(
                    f"{self.name}: block {key} failed its checksum when read; the copy was dropped: "
                    "read it from another tier or write it again"
                )
            )
        self._hits += 1
        self._read_bytes += meta.size
        return ReadResult.hit(meta)

    async def _write_one(self, key: BlockKey, data: bytes | bytearray | memoryview, meta: BlockMeta) -> WriteResult:
        src = memoryview(data).cast("B")
        if src.nbytes != meta.size:
            self._errors += 1
            return WriteResult.failed(
                CorruptBlock(
                    f"{self.name}: block {key} has {src.nbytes} bytes but its meta says {meta.size}: nothing stored"
                )
            )
        refused = self._blocks.reserve(key, meta.size, self.name)
        if refused is not None:
            self._errors += refused.error is not None
            return refused
        committed = False
        try:
            copy = bytearray(meta.size)
            if await self._copy(memoryview(copy), src) != meta.checksum:
                self._errors += 1
                return WriteResult.failed(
                    CorruptBlock(
                        f"{self.name}: block {key}'s bytes do not match the checksum in its meta: "
                        "nothing stored; recompute the meta from the bytes"
                    )
                )
            committed = True
            if not self._blocks.commit(key, copy, meta):
                return PRESENT
        finally:
            if not committed:
                self._blocks.release(meta.size)
        self._stored += 1
        self._written_bytes += meta.size
        return STORED

    async def _copy(self, dst: memoryview, src: bytes | bytearray | memoryview) -> int:
        """Copy and checksum what landed in ``dst``; at ``bytes_per_s`` each chunk takes its time."""
        if self.bytes_per_s is None:
            return copy_and_checksum(dst, src)
        src = memoryview(src)
        h = Checksummer()
        for off in range(0, len(dst), _PACED_CHUNK):
            end = min(off + _PACED_CHUNK, len(dst))
            dst[off:end] = src[off:end]
            h.update(dst[off:end])
            await self._pause((end - off) / self.bytes_per_s)
        return h.value()

    # Deadlines, close, and the round trip.

    async def _whole(self, op: str, n: int, deadline: float, answer: Callable[[], object]):
        """An all-or-nothing call: the round trip, then ``answer()`` at once, or an error."""
        left = self._admit(op, n, deadline)
        try:
            async with asyncio.timeout(left) as timer:
                await self._pause(self.latency_s)
                return answer()
        except TimeoutError:
            if not timer.expired():
                raise
            self._errors += 1
            raise DeadlineExceeded(
                f"{self.name}: {op} of {n} blocks passed its deadline: nothing was done; give it more time"
            ) from None
        except TierUnavailable:
            self._errors += 1
            raise
        finally:
            self._leave()

    async def _batch(
        self,
        op: str,
        n: int,
        step: Callable[[int], Awaitable],
        deadline: float,
        failed: Callable[[StrataError], object],
    ) -> list:
        """A per-key call: keys answered by the deadline keep their answer, the rest fail."""
        left = self._admit(op, n, deadline)
        results: list = [None] * n
        try:
            async with asyncio.timeout(left) as timer:
                await self._pause(self.latency_s)
                for i in range(n):
                    results[i] = await step(i)
            return results
        except TimeoutError:
            if not timer.expired():
                raise
            error: StrataError = DeadlineExceeded(
                f"{self.name}: {op} of {n} blocks passed its deadline with {results.count(None)} unanswered: "
                "give it more time or fewer blocks"
            )
        except TierUnavailable as closed:  # close() cut the call short
            error = closed
        finally:
            self._leave()
        self._errors += results.count(None)
        return [failed(error) if r is None else r for r in results]

    def _admit(self, op: str, n: int, deadline: float) -> float:
        left = time_left(self, op, deadline)
        check_batch(self, op, n)
        if self._closed:
            raise TierUnavailable(f"{self.name} is closed: {op} refused; open a new source")
        self._in_flight += 1
        return left

    def _leave(self) -> None:
        self._in_flight -= 1
        if not self._in_flight and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    async def _pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or less if the source closes (then raise TierUnavailable)."""
        if seconds <= 0:
            await asyncio.sleep(0)
        else:
            loop = asyncio.get_running_loop()
            waker = loop.create_future()
            timer = loop.call_later(seconds, lambda: waker.done() or waker.set_result(None))
            self._wakers.add(waker)
            try:
                await waker
            finally:
                timer.cancel()
                self._wakers.discard(waker)
        if self._closed:
            raise TierUnavailable(f"{self.name} closed during the call; open a new source and retry")
