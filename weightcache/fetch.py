"""The fetch planner: get the chunks a reader needs, in the order it needs them, verified.

Given a plan (chunks in the order the reader will consume them: each
file's header first, then its tensors), :class:`Planner` keeps a bounded
number of chunks in flight (``max_in_flight``, each with a buffer of its
own that is reused chunk after chunk) and for each one:

1. skips it if the cache already holds it (a restart after a crash fetches
   only what was never recorded);
2. claims it (:mod:`weightcache.claims`); a chunk another process on this
   node is fetching is left to it and watched in the record, and taken over
   if that process dies;
3. asks the sources the :data:`~weightcache.sources.SourceChooser` names, in
   order (the peers that may hold the chunk, then the origin), each under its
   own adaptive concurrency limit;
4. verifies the bytes against the manifest before anything is written
   (:meth:`CachedModel.write`); a chunk that fails is fetched again, up to
   ``corrupt_retries`` more times per source, then from the next source;
   when every source has failed it the chunk fails with
   :class:`~weightcache.errors.CorruptChunk`;
5. hands a written chunk to the reader at once, and to one flushing
   thread that makes written chunks durable and recorded in groups while
   the workers fetch on (its claim is held until it is recorded).

A throttled source (S3 ``503 SlowDown``) halves its concurrency and the
chunk waits an exponential, jittered back-off before its next try; an
unavailable one (refused, 5xx, timed out) backs off the same way; after
``max_attempts`` rounds the chunk fails with OriginUnavailable. A failed
chunk fails only the tensors that need it: the rest of the plan goes on,
and the reader reports the failure after serving what it can.
Cache-side errors (disk full, cache full, a failing disk) end the whole
run: nothing more can be stored.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import random
from collections import Counter, deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from weightcache.cached_model import CachedModel
from weightcache.errors import CorruptChunk, ManifestMismatch, OriginThrottled, OriginUnavailable
from weightcache.sources import ChunkRef, ChunkSource, SourceChooser

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FetchLimits:
    max_in_flight: int = 8  # chunks being fetched at once (buffers of chunk_bytes each)
    origin_concurrency: int = 8  # requests in flight to the origin, before throttling halves it
    max_attempts: int = 8  # rounds over the sources before a chunk fails
    corrupt_retries: int = 2  # refetches from one source after a failed digest
    backoff_base_s: float = 0.1
    backoff_max_s: float = 10.0
    request_timeout_s: float = 120.0  # one chunk from one source
    poll_interval_s: float = 0.05  # how often to look for chunks another process is fetching

    def __post_init__(self) -> None:
        for name in ("max_in_flight", "origin_concurrency", "max_attempts"):
            if not 1 <= getattr(self, name) <= 1024:
                raise ValueError(f"{name} must be 1..1024")
        if not 0 <= self.corrupt_retries <= 16:
            raise ValueError("corrupt_retries must be 0..16")
        if not (0 < self.backoff_base_s <= self.backoff_max_s and 0 < self.request_timeout_s and 0 < self.poll_interval_s):
            raise ValueError("back-off, timeout and poll interval must be positive (base <= max)")


@dataclass
class FetchStats:
    planned: int = 0
    cached: int = 0  # already verified in the cache when the run began
    fetched: Counter = field(default_factory=Counter)  # chunks stored, by source kind
    fetched_bytes: Counter = field(default_factory=Counter)
    requests: Counter = field(default_factory=Counter)  # reads asked of a source, by kind
    by_others: int = 0  # chunks another process on this node fetched while we watched
    throttled: int = 0
    unavailable: int = 0
    corrupt: int = 0
    failed: int = 0


def _chunk_buffer(nbytes: int) -> mmap.mmap:
    """A reusable chunk buffer: an anonymous mapping, so its pages are given (zeroed by the kernel)
    only when a read first lands in them. A ``bytearray`` would be zero-filled here, on the loop,
    for every in-flight slot before the first request could go out, and for an origin that hands
    back buffers of its own (S3) that memory would never be used at all."""
    return mmap.mmap(-1, nbytes)


class _Miss(Exception):
    """Why a source was passed over for a chunk: it answered that it does not hold it."""


class Planner:
    def __init__(
        self,
        model: CachedModel,
        sources: SourceChooser,
        *,
        limits: FetchLimits = FetchLimits(),
        stats: FetchStats | None = None,
        on_present: Callable[[int, int], None] = lambda f, c: None,
        on_failed: Callable[[int, int, Exception], None] = lambda f, c, e: None,
        metrics=None,
    ) -> None:
        self.model = model
        self.sources = sources
        self.limits = limits
        self.stats = stats if stats is not None else FetchStats()
        self._on_present = on_present
        self._on_failed = on_failed
        self._metrics = metrics
        self._queue: deque[tuple[int, int]] = deque()
        self._deferred: dict[tuple[int, int], None] = {}  # claimed by another process: watched
        self._done: set[tuple[int, int]] = set()
        self._leading: set[tuple[int, int]] = set()  # the first tensor's chunks, still coming
        self._led = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=limits.max_in_flight, thread_name_prefix="weights-store")
        # One thread makes written chunks durable, in groups, while the workers fetch on.
        self._flusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-flush")
        self._flushing: set[asyncio.Future] = set()
        self._fatal: BaseException | None = None

    async def run(self, plan: Iterable[tuple[int, int]], lead: int = 0) -> None:
        """Fetch every chunk of the plan; returns when each is present or has failed (reported
        through ``on_failed``). Raises only what stops all storing (DiskFull, CacheFull, ...).

        The plan's first ``lead`` chunks (what a reader's first tensor needs) are fetched on their
        own, so they do not share the source and this host with the rest; the other slots open
        once those are present or failed."""
        seen: dict[tuple[int, int], None] = {}
        for item in plan:
            if item in seen:
                continue
            seen[item] = None
            self.stats.planned += 1
            if self.model.is_present(*item):
                self.stats.cached += 1
                self.stats.fetched_bytes["disk"] += self._length(item)
                if self._metrics is not None:
                    self._metrics.cached(self._length(item))
                self._present(item)
            else:
                self._queue.append(item)
        self._leading = {i for i in list(seen)[:lead] if i not in self._done}
        slots = min(self.limits.max_in_flight, len(self._queue))
        first = min(slots, len(self._leading)) if self._leading else slots
        workers = [asyncio.ensure_future(self._worker()) for _ in range(first)]
        try:
            if first < slots:
                led = asyncio.ensure_future(self._led.wait())
                await asyncio.wait([led, *workers], return_when=asyncio.FIRST_COMPLETED)
                led.cancel()
                workers += [asyncio.ensure_future(self._worker()) for _ in range(slots - first)]
            if workers:
                await asyncio.gather(*workers)
            if self._flushing:
                await asyncio.gather(*self._flushing)
            if self._fatal is not None:
                raise self._fatal
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            self._executor.shutdown(wait=True)
            self._flusher.shutdown(wait=True)

    def _length(self, item: tuple[int, int]) -> int:
        start, end = self.model.manifest.files[item[0]].chunk_span(item[1], self.model.manifest.chunk_bytes)
        return end - start

    def _present(self, item: tuple[int, int]) -> None:
        if item not in self._done:
            self._done.add(item)
            self._on_present(*item)
            self._settle(item)

    def _settle(self, item: tuple[int, int]) -> None:
        self._leading.discard(item)
        if not self._leading:
            self._led.set()

    def _refresh(self) -> None:
        for item in self.model.refresh():
            if item in self._deferred:
                self.stats.by_others += 1
            self._present(item)

    async def _worker(self) -> None:
        buffer = _chunk_buffer(self.model.manifest.chunk_bytes)
        while True:
            if self._fatal is not None:
                raise self._fatal  # a flush failed (disk full): nothing more can be stored
            if self._queue:
                item = self._queue.popleft()
                buffer = await self._one(item, buffer)
                continue
            if not self._deferred:
                return
            await asyncio.sleep(self.limits.poll_interval_s)
            self._refresh()
            waiting, self._deferred = self._deferred, {}
            self._queue.extend(i for i in waiting if i not in self._done)

    async def _one(self, item: tuple[int, int], buffer: bytearray) -> bytearray:
        if item in self._done or self.model.is_present(*item):
            self._present(item)
            return buffer
        index = self.model.global_index(*item)
        if not self.model.claims.try_claim(index):
            self._deferred[item] = None
            return buffer
        flushing = False
        try:
            self._refresh()  # it may have been recorded just before its claim was let go
            if item in self._done:
                return buffer
            ref = ChunkRef.of(self.model.manifest, *item)
            try:
                buffer = await self._fetch(ref, buffer)
            except (CorruptChunk, ManifestMismatch, OriginUnavailable) as err:
                self.stats.failed += 1
                log.error("chunk %d of %s failed: %s", ref.chunk, ref.path, err)
                self._done.add(item)
                self._on_failed(*item, err)
                self._settle(item)
                return buffer
            self._present(item)
            self._flush_later(index)
            flushing = True
            return buffer
        finally:
            if not flushing:
                self.model.claims.release(index)

    def _flush_later(self, index: int) -> None:
        """Make a written chunk durable off the worker's path (the worker fetches on); its claim is
        let go once it is recorded. A failed flush ends the run, as a failed write does."""

        def flush() -> None:
            try:
                self.model.flush()
            finally:
                self.model.claims.release(index)

        def done(future: asyncio.Future) -> None:
            self._flushing.discard(future)
            if not future.cancelled() and future.exception() is not None and self._fatal is None:
                self._fatal = future.exception()

        future = asyncio.get_running_loop().run_in_executor(self._flusher, flush)
        self._flushing.add(future)
        future.add_done_callback(done)

    async def _fetch(self, ref: ChunkRef, buffer: bytearray) -> bytearray:
        """Get, verify and store one chunk; returns the buffer to use next (a new one when a timed-out
        read may still be writing into the old)."""
        loop = asyncio.get_running_loop()
        corrupt: Counter = Counter()
        excluded: dict[ChunkSource, Exception] = {}
        last: Exception | None = None
        for attempt in range(1, self.limits.max_attempts + 1):
            candidates = [s for s in self.sources(ref) if s not in excluded]
            if not candidates:
                break
            for source in candidates:
                self.stats.requests[source.kind] += 1
                try:
                    async with source.limit:
                        view = await asyncio.wait_for(
                            source.read(ref, memoryview(buffer)[: ref.length]), self.limits.request_timeout_s
                        )
                except OriginThrottled as err:
                    source.limit.throttled()
                    self.stats.throttled += 1
                    self._count("throttled", source)
                    last = err
                    continue
                except (OriginUnavailable, TimeoutError) as err:
                    if isinstance(err, TimeoutError):
                        buffer = _chunk_buffer(len(buffer))  # the abandoned read may still land in the old one
                        err = OriginUnavailable(f"{source.name}: {ref.path} chunk {ref.chunk} timed out")
                    self.stats.unavailable += 1
                    self._count("unavailable", source)
                    last = err
                    continue
                except ManifestMismatch as err:
                    excluded[source] = err
                    self._count("mismatch", source)
                    last = err
                    continue
                if view is None:  # a miss: this source does not hold the chunk (a peer); not an error
                    excluded[source] = _Miss(f"{source.name} does not hold it")
                    self._count("miss", source)
                    continue
                # Verify and write off the loop; an error here (disk full) ends the run. The reader has
                # the chunk once its verified bytes are in the file; the flush that makes them durable
                # follows on its own thread (_flush_later), not in this worker's way.
                if await loop.run_in_executor(self._executor, self.model.write, ref.file, ref.chunk, view):
                    source.limit.succeeded()
                    self.stats.fetched[source.kind] += 1
                    self.stats.fetched_bytes[source.kind] += ref.length
                    self._count("ok", source, ref.length)
                    return buffer
                self.stats.corrupt += 1
                corrupt[source] += 1
                self._count("corrupt", source)
                log.warning("chunk %d of %s from %s failed its digest (try %d)", ref.chunk, ref.path, source.name, corrupt[source])
                if corrupt[source] > self.limits.corrupt_retries:
                    excluded[source] = CorruptChunk(f"{source.name} gave {corrupt[source]} corrupt copies")
            if attempt < self.limits.max_attempts and any(s not in excluded for s in self.sources(ref)):
                await asyncio.sleep(self._backoff(attempt))
        where = f"chunk {ref.chunk} of {ref.path} (bytes {ref.start}..{ref.start + ref.length})"
        corrupt_everywhere = [e for e in excluded.values() if isinstance(e, CorruptChunk)]
        if corrupt_everywhere and all(isinstance(e, (CorruptChunk, _Miss)) for e in excluded.values()) and len(
            excluded
        ) == len(self.sources(ref)):
            raise CorruptChunk(
                f"{where} does not match manifest {self.model.manifest.digest} from any source "
                f"({'; '.join(str(e) for e in corrupt_everywhere)}): the origin's bytes changed since publishing; "
                "publish the model again (strata weights publish) and open the new digest"
            )
        if isinstance(last, ManifestMismatch):
            raise last
        raise OriginUnavailable(f"{where}: no source gave it after {self.limits.max_attempts} tries (last: {last})")

    def _backoff(self, attempt: int) -> float:
        ceiling = min(self.limits.backoff_max_s, self.limits.backoff_base_s * 2 ** (attempt - 1))
        return ceiling * random.uniform(0.5, 1.0)

    def _count(self, outcome: str, source: ChunkSource, nbytes: int = 0) -> None:
        if self._metrics is not None:
            self._metrics.chunk(source.kind, outcome, nbytes)
