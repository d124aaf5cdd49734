"""WriteBack: blocks on their way up to the bucket, off every local path.

The store hands the object tier a block when it leaves the disk (write-back)
or as soon as it lands there (write-through). An upload takes tens of
milliseconds when S3 is well and seconds or never when it is not, and the
store's thread must not wait for it: a demotion worker stuck on S3 would
stop RAM from draining to disk and, in the end, block puts. So the tier
copies the block into this queue and answers at once; uploads run on the
object source's event loop, ``uploads`` at a time.

- **Bounded, oldest dropped first.** At most ``max_blocks`` blocks and
  ``max_bytes`` bytes are held (queued and uploading). A block that does not
  fit pushes out the oldest queued ones, each counted ``dropped``: when S3
  is slow or down, the newest blocks are the likeliest to be read again, and
  a put never waits for room. A dropped block is gone from every tier (its
  disk copy left when it was queued); a read of it is a miss, and the store
  forgets it then.
- **Readable while queued.** A queued or uploading block is served from
  here, so leaving the disk never makes a block unreadable on this node.
- **S3 down and back.** A failed upload (S3 unreachable, 5xx after the
  client's retries, its deadline) puts the block back at the head of the
  queue and pauses every upload for ``pause_s``, doubling to
  ``max_pause_s`` while failures go on, so an outage costs a few requests,
  not a storm; the first success ends the pause. A block that failed
  ``attempts`` times is dropped (``failed``). An upload S3 refuses for the
  block itself (a quota, a size) is ``refused``; bytes that do not match
  their meta are ``corrupt``; neither is retried.
- **Stop.** ``close`` waits up to ``drain_s`` for the queue to empty, then
  counts what is left ``closed``.
- **One copy.** ``frame`` (given by the object tier:
  :func:`~kvstore.remote.object.format.frame`) copies the block straight
  into the object it will be uploaded as, header first, checking its
  checksum in the same pass; the source sends that buffer as it is. Without
  it (any other source), the queue holds a plain verified copy.

Thread-safe: ``offer``, ``pending``, ``discard``, ``stats`` from any thread;
the workers run on the bridge's loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.block import BlockKey, BlockMeta, copy_and_checksum
from kvstore.errors import (
    BlockTooLarge, CorruptBlock, DeadlineExceeded, InvalidArgument, ResourceExhausted, StrataError, TierUnavailable,
)
from kvstore.remote.base import RemoteSource, WriteResult, WriteStatus
from kvstore.remote.object.metrics import ObjectMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WriteBackLimits:
    max_blocks: int = 1024  # queued and uploading
    max_bytes: int = 256 << 20  # queued and uploading
    uploads: int = 8  # uploads at once
    upload_s: float = 30.0  # one upload's deadline, the client's retries included
    attempts: int = 3  # uploads of one block before it is dropped as failed
    pause_s: float = 1.0  # after a failed upload every upload waits this long, doubling ...
    max_pause_s: float = 30.0  # ... up to this
    drain_s: float = 10.0  # close waits this long for the queue to empty

    def __post_init__(self) -> None:
        if min(self.max_blocks, self.max_bytes, self.uploads, self.attempts) < 1:
            raise InvalidArgument("write-back limits: max_blocks, max_bytes, uploads and attempts must be >= 1")
        if min(self.upload_s, self.pause_s, self.max_pause_s) <= 0 or self.drain_s < 0:
            raise InvalidArgument("write-back limits: upload, pause seconds must be positive, drain_s >= 0")


@dataclass(frozen=True, slots=True)
class WriteBackStats:
    queued_blocks: int  # waiting, and uploading
    queued_bytes: int
    uploading: int
    outcomes: dict[str, int]  # blocks that left the queue, by outcome (the metric's labels)
    failing: str  # why uploads are paused now; "" when they are not


@dataclass(slots=True)
class _Job:
    key: BlockKey
    data: object  # what the source's write is handed: the copy, or the framed object
    view: memoryview  # the block's own bytes within it
    meta: BlockMeta
    attempts: int = 0
    discarded: bool = False  # deleted while uploading: the object goes again once it is up


class WriteBack:
    def __init__(self, bridge, limits: WriteBackLimits = WriteBackLimits(), metrics: ObjectMetrics | None = None,
                 name: str = "object",
                 frame: Callable[[BlockKey, memoryview, BlockMeta], tuple[object, memoryview]] | None = None) -> None:
        """``bridge``: the RemoteBridge whose loop runs the uploads, on its source. ``frame(key, bytes,
        meta)``: the one copy of a block to hold and hand the source, and the block's bytes within it
        (CorruptBlock when they do not match ``meta``); None: a plain verified copy."""
        self._frame = frame or _plain_copy
        self.limits = limits
        self.name = name
        self._bridge = bridge
        self._metrics = metrics
        self._lock = threading.Condition()
        self._queued: OrderedDict[BlockKey, _Job] = OrderedDict()  # oldest first
        self._uploading: dict[BlockKey, _Job] = {}
        self._bytes = 0
        self._closing = self._stopping = False
        self._outcomes = dict.fromkeys(("uploaded", "present", "dropped", "failed", "refused", "corrupt", "closed"), 0)
        self._wake = asyncio.Event()
        self._paused_until = 0.0  # loop thread only
        self._streak = 0
        self._failing = ""
        self._workers = [bridge.background(self._worker) for _ in range(limits.uploads)]

    # From any thread.

    def offer(self, key: BlockKey, data: bytes | bytearray | memoryview, meta: BlockMeta) -> bool:
        """Queue a copy of a block for upload; False when it is queued already. Never waits.

        Raises CorruptBlock (the bytes do not match ``meta``), BlockTooLarge (larger than the
        whole queue), TierUnavailable (closed, or the queue is full of uploads in flight)."""
        src = memoryview(data).cast("B")
        if src.nbytes != meta.size:
            raise CorruptBlock(f"{self.name}: block {key} has {src.nbytes} bytes, its meta says {meta.size}")
        if meta.size > self.limits.max_bytes:
            raise BlockTooLarge(
                f"{self.name}: block {key} ({meta.size} bytes) is larger than the write-back queue "
                f"({self.limits.max_bytes}): raise [tiers.object] queue_bytes"
            )
        with self._lock:
            self._refuse_if_closed()
            if key in self._queued or key in self._uploading:
                return False
        try:
            data, view = self._frame(key, src, meta)
        except CorruptBlock:
            self._count("corrupt")
            raise CorruptBlock(
                f"{self.name}: block {key}'s bytes do not match its checksum: not queued for upload"
            ) from None
        dropped = 0
        with self._lock:
            self._refuse_if_closed()
            if key in self._queued or key in self._uploading:
                return False
            while self._queued and (self._held() >= self.limits.max_blocks or
                                    self._bytes + meta.size > self.limits.max_bytes):
                _, old = self._queued.popitem(last=False)
                self._bytes -= old.meta.size
                dropped += 1
            if self._held() >= self.limits.max_blocks or self._bytes + meta.size > self.limits.max_bytes:
                full = True
            else:
                full = False
                self._queued[key] = _Job(key, data, view, meta)
                self._bytes += meta.size
        if dropped:
            self._count("dropped", dropped)
            log.warning("%s: write-back queue full: dropped the %d oldest blocks waiting for upload", self.name, dropped)
        if full:
            self._count("dropped")
            raise TierUnavailable(
                f"{self.name}: the write-back queue is full of uploads in flight: S3 is slow; raise "
                "[tiers.object] queue_bytes or max_uploads"
            )
        self._bridge.call_soon(self._wake.set)
        return True

    def pending(self, key: BlockKey) -> tuple[bytes, BlockMeta] | None:
        """A copy of a block waiting for (or in) upload, and its meta."""
        with self._lock:
            job = self._queued.get(key) or self._uploading.get(key)
            if job is None or job.discarded:
                return None
            return bytes(job.view), job.meta

    def pending_meta(self, key: BlockKey) -> BlockMeta | None:
        with self._lock:
            job = self._queued.get(key) or self._uploading.get(key)
            return None if job is None or job.discarded else job.meta

    def discard(self, key: BlockKey) -> bool:
        """Forget a block (it was deleted); True when it was queued or uploading."""
        with self._lock:
            job = self._queued.pop(key, None)
            if job is not None:
                self._bytes -= job.meta.size
                return True
            job = self._uploading.get(key)
            if job is not None:
                job.discarded = True
            return job is not None

    def stats(self) -> WriteBackStats:
        with self._lock:
            return WriteBackStats(self._held(), self._bytes, len(self._uploading), dict(self._outcomes), self._failing)

    def depth(self) -> tuple[int, int, int]:
        """(queued blocks, queued bytes, uploading): what the metrics export."""
        with self._lock:
            return self._held(), self._bytes, len(self._uploading)

    def close(self) -> None:
        """Refuse new blocks, wait up to ``drain_s`` for the queue to empty, then stop the workers."""
        end = time.monotonic() + self.limits.drain_s
        with self._lock:
            self._closing = True
            self._lock.wait_for(lambda: not self._queued and not self._uploading, timeout=max(0.0, end - time.monotonic()))
            left = len(self._queued) + len(self._uploading)
            self._queued.clear()
            self._stopping = True
        if left:
            self._count("closed", left)
            log.warning("%s: stopped with %d blocks not uploaded", self.name, left)
        self._bridge.call_soon(self._wake.set)

    # The workers, on the bridge's loop.

    async def _worker(self, source: RemoteSource) -> None:
        while True:
            pause = self._paused_until - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
            job = self._take()
            if job is None:
                if self._stopping:
                    return
                self._wake.clear()
                job = self._take()
                if job is None:
                    await self._wake.wait()
                    continue
            outcome = await self._upload(source, job)
            self._finish(job, outcome)
            if job.discarded and outcome in ("uploaded", "present"):
                await self._delete(source, job.key)

    def _take(self) -> _Job | None:
        with self._lock:
            if self._stopping or not self._queued:
                return None
            key, job = self._queued.popitem(last=False)
            self._uploading[key] = job
            return job

    async def _upload(self, source: RemoteSource, job: _Job) -> str:
        """One try; the outcome (a metric label), or "retry"."""
        try:
            [result] = await source.write([(job.key, job.data, job.meta)], time.monotonic() + self.limits.upload_s)
        except (TierUnavailable, DeadlineExceeded) as err:
            result = WriteResult.failed(err)
        if result.status is WriteStatus.STORED:
            return self._ok("uploaded")
        if result.status is WriteStatus.PRESENT:
            return self._ok("present")
        err = result.error
        if isinstance(err, CorruptBlock):
            log.error("%s: block %s was not uploaded: %s", self.name, job.key, err)
            return "corrupt"
        if isinstance(err, (ResourceExhausted, InvalidArgument)):  # a quota, a size: this block, never retried
            log.warning("%s: block %s refused by the object tier: %s", self.name, job.key, err)
            return "refused"
        self._streak += 1
        wait = min(self.limits.max_pause_s, self.limits.pause_s * 2 ** (self._streak - 1))
        self._paused_until = time.monotonic() + wait
        self._failing = f"{self._streak} uploads failed in a row, the last: {err}"
        log.warning("%s: upload of %s failed (%s); uploads pause %.1fs", self.name, job.key, err, wait)
        job.attempts += 1
        return "retry" if job.attempts < self.limits.attempts else "failed"

    def _ok(self, outcome: str) -> str:
        self._streak = 0
        self._paused_until = 0.0
        self._failing = ""
        return outcome

    def _finish(self, job: _Job, outcome: str) -> None:
        with self._lock:
            self._uploading.pop(job.key, None)
            if outcome == "retry" and not job.discarded and not self._stopping:
                self._queued[job.key] = job  # back at the head: it is the oldest
                self._queued.move_to_end(job.key, last=False)
            else:
                self._bytes -= job.meta.size
            self._lock.notify_all()
        if outcome != "retry":
            self._count(outcome)

    async def _delete(self, source: RemoteSource, key: BlockKey) -> None:
        try:
            await source.delete([key], time.monotonic() + self.limits.upload_s)
        except StrataError as err:
            log.warning("%s: %s was deleted while uploading and could not be removed after: %s", self.name, key, err)

    # Bookkeeping.

    def _held(self) -> int:
        return len(self._queued) + len(self._uploading)

    def _refuse_if_closed(self) -> None:
        if self._closing:
            raise TierUnavailable(f"{self.name}: the object tier is closing; no more uploads")

    def _count(self, outcome: str, n: int = 1) -> None:
        with self._lock:
            self._outcomes[outcome] += n
        if self._metrics is not None:
            self._metrics.writeback.labels(outcome).inc(n)


def _plain_copy(key: BlockKey, src: memoryview, meta: BlockMeta) -> tuple[bytearray, memoryview]:
    copy = bytearray(meta.size)
    if copy_and_checksum(memoryview(copy), src) != meta.checksum:
        raise CorruptBlock(f"block {key}'s bytes do not match its checksum")
    return copy, memoryview(copy)
