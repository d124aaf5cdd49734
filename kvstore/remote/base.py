"""The contract every remote source keeps: a tier on someone else's machine.

A remote source is where blocks live that this node does not own: another
daemon's store (the peer tier) or an object store (the object tier). It
differs from a local tier in three ways that shape this interface:

- **It is slow and far.** Every method is a coroutine, runs on one event
  loop, and takes an absolute ``deadline`` on :func:`time.monotonic`. A
  call never answers later than its deadline (give or take the loop's
  scheduling): what finished by then is reported, the rest is not done.
- **It fails part-way.** ``read`` and ``write`` answer per key, so one lost
  block does not lose the batch: each key is a hit, a miss, skipped, or
  failed with the error for that key. A failed key never leaves anything
  half-done visible: a write that did not finish stores nothing, a read
  that did not verify is never a hit.
- **It is cancelled.** Cancelling the task that awaits a call stops its work
  at the next await point. A buffer a read was filling may then be partly
  written; it was never reported as a hit, so the caller gives it back.

The methods:

``lookup(keys, deadline) -> list[BlockMeta | None]``
    Metadata of the blocks the source holds, ``None`` for a miss. All or
    nothing: it raises rather than answer part of a batch, because a lookup
    carries no bytes worth saving and a guessed miss would hide an outage.
``read(keys, place, deadline) -> list[ReadResult]``
    Reads each found block straight into the buffer ``place(i, meta)``
    returns for the i-th key (``None``: skip that block, nothing is read).
    The buffer must hold at least ``meta.size`` bytes; the block fills its
    first ``meta.size``. One call is one round trip: the source learns each
    block's metadata and sends its bytes together, which is why placement
    is a callback and not a second call. ``place`` runs on the source's
    event loop thread, so it must be quick and must not block on anything
    the caller holds while awaiting (or, through the bridge, while calling)
    ``read``; an exception from it ends the call and propagates. Every block
    is verified against its xxh3-64 checksum before it is reported a hit;
    a block that fails is reported ``CorruptBlock`` and deleted from the
    source (best effort), so a later write can replace it rather than be
    turned away as "already present".
``write(blocks, deadline) -> list[WriteResult]``
    Stores ``(key, bytes, meta)`` triples. The bytes are checked against
    ``meta`` (size and checksum) before anything is stored. Idempotent: a
    key the source already holds is ``PRESENT``, not an error (keys are
    content- or prefix-addressed, so the bytes are the same). A stored block
    is visible to every reader of the source at once and in full, or not at
    all. The source copies what it keeps: the caller may reuse its buffers
    as soon as the call returns.
``delete(keys, deadline) -> int``
    Removes blocks; returns how many were present. Each key is removed
    whole or not at all; on an error some keys may already be gone, and
    repeating the call is safe.
``close()``
    Stops accepting calls (later ones raise ``TierUnavailable``), ends the
    calls in flight promptly (their unanswered keys fail with
    ``TierUnavailable``), then releases connections. Idempotent. What the
    source stores stays where it is.
``stats() -> RemoteStats``
    Counters; cheap, non-blocking, callable from any thread.

Errors. A whole call raises (and has done nothing) only when no key could be
tried: ``DeadlineExceeded`` when the deadline had already passed,
``TierUnavailable`` when the source is closed or cannot be reached at all,
``InvalidArgument`` for a batch over :data:`MAX_BATCH_BLOCKS` or a bad
deadline. Otherwise ``read`` and ``write`` answer every key, and a failed
key carries one of::

    StrataError
    ├── InvalidArgument
    │   └── BlockTooLarge       write: the block is larger than the whole source
    ├── ResourceExhausted
    │   └── TierFull            write: no room (retry_after_s says when to retry)
    ├── CorruptBlock            read: stored bytes fail their checksum (the copy was dropped);
    │                           write: the bytes do not match their meta (nothing stored)
    ├── TierUnavailable         the source failed for this key, or closed mid-call
    └── DeadlineExceeded        the deadline passed before this key was done

``InvalidArgument`` itself is also a per-key read error: ``place`` returned a
buffer smaller than the block.

A source object is used from one event loop. Threaded code (the store) calls
it through :class:`kvstore.remote.bridge.RemoteBridge`. Blocking I/O never
runs on that loop: an implementation uses asynchronous I/O or a worker
thread.

Implementations pass one contract suite (``tests/remote/test_remote_contract.py``):
:class:`~kvstore.remote.memory.MemoryRemote`, the in-process source that
tests and embedded use rely on, and :class:`~kvstore.remote.object.ObjectSource`
(an S3-compatible bucket, run against a moto server). The peer source is
read-through only and has suites of its own.
"""

from __future__ import annotations

import abc
import enum
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.block import BlockKey, BlockMeta, TierName
from kvstore.errors import DeadlineExceeded, InvalidArgument, StrataError

__all__ = [
    "MAX_BATCH_BLOCKS",
    "MISS",
    "PRESENT",
    "STORED",
    "MetaPlace",
    "ReadResult",
    "ReadStatus",
    "RemoteSource",
    "RemoteStats",
    "WriteResult",
    "WriteStatus",
    "check_batch",
    "time_left",
]

MAX_BATCH_BLOCKS = 4096  # the store's own batch limit; one call never carries more

# read's placement: for the i-th key's found block, the writable buffer its bytes go to, or None to skip it.
MetaPlace = Callable[[int, BlockMeta], memoryview | None]


class ReadStatus(enum.Enum):
    HIT = "hit"  # the bytes are in the caller's buffer and verified
    MISS = "miss"  # the source does not hold the block: an answer, not an error
    SKIPPED = "skipped"  # the source holds it; place returned None, so nothing was read
    FAILED = "failed"  # see error; the buffer, if one was placed, may be partly written


@dataclass(frozen=True, slots=True)
class ReadResult:
    """One key's answer to ``read``. ``meta`` is set on HIT and SKIPPED; ``error`` only on FAILED."""

    status: ReadStatus
    meta: BlockMeta | None = None
    error: StrataError | None = None

    @classmethod
    def hit(cls, meta: BlockMeta) -> ReadResult:
        return cls(ReadStatus.HIT, meta)

    @classmethod
    def skipped(cls, meta: BlockMeta) -> ReadResult:
        return cls(ReadStatus.SKIPPED, meta)

    @classmethod
    def failed(cls, error: StrataError) -> ReadResult:
        return cls(ReadStatus.FAILED, None, error)

    @property
    def is_hit(self) -> bool:
        return self.status is ReadStatus.HIT


MISS = ReadResult(ReadStatus.MISS)


class WriteStatus(enum.Enum):
    STORED = "stored"  # the block is now in the source
    PRESENT = "present"  # the source already held it (idempotent write)
    FAILED = "failed"  # see error; nothing of this block is visible


@dataclass(frozen=True, slots=True)
class WriteResult:
    status: WriteStatus
    error: StrataError | None = None

    @classmethod
    def failed(cls, error: StrataError) -> WriteResult:
        return cls(WriteStatus.FAILED, error)

    @property
    def ok(self) -> bool:
        """True when the block is in the source after the call (stored now or before)."""
        return self.status is not WriteStatus.FAILED


STORED = WriteResult(WriteStatus.STORED)
PRESENT = WriteResult(WriteStatus.PRESENT)


@dataclass(frozen=True, slots=True)
class RemoteStats:
    """Traffic of this source object, and what the source holds when it can know it.

    ``stored_*`` and ``capacity_bytes`` are None for a source that cannot
    count its contents cheaply (a shared bucket). ``errors`` counts failed
    keys and failed whole calls.
    """

    tier: TierName
    name: str
    hits: int
    misses: int
    read_bytes: int
    stored: int  # blocks this object wrote (PRESENT is not counted)
    written_bytes: int
    errors: int
    stored_blocks: int | None = None
    stored_bytes: int | None = None
    capacity_bytes: int | None = None


class RemoteSource(abc.ABC):
    tier: TierName  # PEER or OBJECT: what the store reports for blocks found here
    name: str  # where it is, for messages and metrics labels (e.g. "memory://fleet")

    @abc.abstractmethod
    async def lookup(self, keys: Sequence[BlockKey], deadline: float) -> list[BlockMeta | None]:
        """Per key its metadata, or None on a miss. All or nothing (see the module docstring)."""

    @abc.abstractmethod
    async def read(self, keys: Sequence[BlockKey], place: MetaPlace, deadline: float) -> list[ReadResult]:
        """Per key a ReadResult; hits are verified and in the buffers ``place`` gave."""

    @abc.abstractmethod
    async def write(
        self, blocks: Sequence[tuple[BlockKey, bytes | bytearray | memoryview, BlockMeta]], deadline: float
    ) -> list[WriteResult]:
        """Per block a WriteResult: STORED, PRESENT, or FAILED with nothing visible."""

    @abc.abstractmethod
    async def delete(self, keys: Sequence[BlockKey], deadline: float) -> int:
        """Remove blocks; how many were present."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop accepting calls, end those in flight, release resources. Idempotent."""

    @abc.abstractmethod
    def stats(self) -> RemoteStats: ...


# Input checks shared by every implementation.


def check_batch(source: RemoteSource, op: str, n: int) -> None:
    if n > MAX_BATCH_BLOCKS:
        raise InvalidArgument(
            f"{source.name}: {op} of {n} blocks; one call carries at most {MAX_BATCH_BLOCKS}: split the batch"
        )


def time_left(source: RemoteSource, op: str, deadline: float) -> float:
    """Seconds until ``deadline``; raises DeadlineExceeded when none are left (nothing was tried)."""
    if not isinstance(deadline, (int, float)) or not math.isfinite(deadline):
        raise InvalidArgument(
            f"{source.name}: {op} deadline {deadline!r} is not a finite time: pass time.monotonic() + seconds"
        )
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded(
            f"{source.name}: {op} called {-left:.3f}s after its deadline; nothing was tried: give it a later deadline"
        )
    return left
