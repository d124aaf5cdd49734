"""Prefetch jobs on one weight node: fill the node cache with a model, report how far it got.

A :class:`Prefetcher` owns the node's cache directory and at most
``max_jobs`` jobs, one per manifest digest (asking again for a digest that
is running or done starts nothing). Each job is an :func:`open_model` of
the whole model driven to the end on a thread of its own; its progress is
the node cache's record, so :meth:`status` is true across restarts: a
model a previous run completed is COMPLETE without a job.

It is also what the peer data plane reads from (:meth:`read_chunk`): only
chunks recorded as verified are served, by digest and position, with a
bounded wait for a chunk this node is still fetching and at most
``max_uploads`` reads at once (more are refused as overloaded, so a
popular node slows its callers instead of queueing without bound). A node
asked for a model it has no prefetch of waits only ``join_wait_s`` for one
to start (the members of a swarm are asked at about the same time, not at
once), so a member that was never asked costs its peers that long, not
their whole wait; the window counts from the caller's first ask
(``waited_s``), as a caller asks again every few seconds while it waits.

A read that must wait holds one of ``max_waiting`` places (and, in the
gRPC server, one worker thread) for as long as it waits; beyond them it is
refused at once (RESOURCE_EXHAUSTED with a retry delay), so readers
waiting on a model this node does not have can never take every worker
and starve Status and Prefetch (:func:`weightcache.service.serve` sizes
its pool from these bounds). A wait that runs out while the chunk may still
come answers "not yet" (:attr:`ChunkAnswer.pending`), not "not here".

A Prefetch resolves its manifest at the origin before it returns (the
digest it answers), which holds the gRPC worker for as long as the origin
takes, all its retries included when the origin is unreachable. At most
``max_resolving`` resolutions run at once; one more is refused at once
(RESOURCE_EXHAUSTED with a retry delay), so Prefetch calls to an origin that
does not answer can never take every worker either.

The serving handles (one per model, for status and peer reads) are opened
unpinned (:meth:`NodeCache.open`): a model this node only serves is idle
in the cache and may be evicted for the next prefetch; a read takes the
model's lease for its own duration, and a handle whose model was evicted
is dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.errors import InvalidArgument, ResourceExhausted, StrataError
from weightcache import catalog
from weightcache.cache import NodeCache
from weightcache.fetch import FetchLimits, FetchStats
from weightcache.origin import S3OriginOptions

log = logging.getLogger(__name__)

RUNNING, COMPLETE, FAILED, UNKNOWN = "running", "complete", "failed", "unknown"
MAX_WAIT_S = 600.0


@dataclass(frozen=True, slots=True)
class ChunkAnswer:
    """What :meth:`Prefetcher.read_chunk` found: the bytes, or none and whether to ask again."""

    data: bytes | None  # None: not here now
    pending: bool = False  # not here yet, but a prefetch here may still bring it: ask again


@dataclass
class Progress:
    state: str
    model: str = ""
    total_bytes: int = 0
    verified_bytes: int = 0
    total_chunks: int = 0
    verified_chunks: int = 0
    error: str = ""
    bytes_by_source: dict = field(default_factory=dict)
    ram_bytes: int = 0  # of this model in the node's host-RAM copy


class _Job:
    def __init__(self, reader) -> None:
        self.reader = reader
        self.manifest = reader.manifest
        self.stats = reader.stats
        self.error: Exception | None = None
        self.done = threading.Event()


class Prefetcher:
    def __init__(self, cache_dir: str | Path, *, cache_bytes: int | None = None, limits: FetchLimits = FetchLimits(),
                 s3: S3OriginOptions | None = None, swarm=None, metrics=None, max_jobs: int = 16,
                 max_uploads: int = 8, max_waiting: int = 32, join_wait_s: float = 5.0, ram=None,
                 max_resolving: int = 4) -> None:
        if not all(1 <= n <= 1024 for n in (max_jobs, max_uploads, max_waiting, max_resolving)):
            raise ValueError("max_jobs, max_uploads, max_waiting and max_resolving must be 1..1024")
        if not 0 <= join_wait_s <= MAX_WAIT_S:
            raise ValueError(f"join_wait_s must be 0..{MAX_WAIT_S:g}")
        self.join_wait_s = join_wait_s
        self.cache_dir = Path(cache_dir)
        self.cache_bytes = cache_bytes
        self.limits = limits
        self.s3 = s3
        self.swarm = swarm
        self.metrics = metrics
        self.ram = ram  # a RamCopy with a capacity: complete models are copied there before COMPLETE
        if ram is not None and metrics is not None:
            metrics.ram_bytes.set_function(ram.used_bytes)
        self.max_jobs = max_jobs
        self.max_uploads = max_uploads
        self.max_waiting = max_waiting
        self.max_resolving = max_resolving
        self._resolving = threading.BoundedSemaphore(max_resolving)
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self._uploads = threading.BoundedSemaphore(max_uploads)
        self._waiting = threading.BoundedSemaphore(max_waiting)
        self._closing = threading.Event()  # ends every wait in read_chunk
        self._cache = NodeCache(self.cache_dir, cache_bytes if cache_bytes is not None else 1 << 62)
        self._serving: dict[str, object] = {}  # digest -> CachedModel opened for peer reads

    # ---- jobs ----------------------------------------------------------------------

    def prefetch(self, location: str, digest: str = "", revision: str = "") -> tuple[str, bool]:
        """Start fetching the model (blocking while its manifest is resolved); (digest, started)."""
        from weightcache.reader import open_model

        if digest:
            catalog.check_digest(digest)
            with self._lock:
                job = self._jobs.get(digest)
            if self._holds(job, self._served(digest) if job is not None else None):
                return digest, False
        with self._lock:
            live = sum(1 for j in self._jobs.values() if not j.done.is_set())
            if live >= self.max_jobs:
                raise ResourceExhausted(f"{live} prefetches are running (the most is {self.max_jobs}): wait for one",
                                        retry_after_s=5.0)
        route = self.swarm.route if self.swarm is not None else None
        if not self._resolving.acquire(blocking=False):
            raise ResourceExhausted(
                f"{self.max_resolving} prefetches are resolving their manifest at the origin now (the most at once): "
                "retry after the delay; if it persists, check that the origin answers", retry_after_s=2.0,
            )
        try:
            reader = open_model(location, digest or None, cache_dir=self.cache_dir, cache_bytes=self.cache_bytes,
                                revision=revision or None, limits=self.limits, s3=self.s3, metrics=self.metrics,
                                include="*", route=route, ram_dir=self.ram.root if self.ram is not None else None)
        finally:
            self._resolving.release()
        with self._lock:
            if self._holds(self._jobs.get(reader.digest), reader.model):
                reader.close()
                return reader.digest, False
            job = self._jobs[reader.digest] = _Job(reader)  # a failed or evicted one before it: fetched again
        threading.Thread(target=self._drive, args=(job,), name=f"prefetch-{reader.digest[:12]}", daemon=True).start()
        return reader.digest, True

    @staticmethod
    def _holds(job: _Job | None, model) -> bool:
        """Whether there is nothing to start: a job for the model runs, or one ended well and the
        cache (``model``: a handle on it, or None) still holds every chunk. An evicted model is
        fetched again when asked for."""
        if job is None or job.error is not None:
            return False
        if not job.done.is_set():
            return True
        if model is None:
            return False
        model.refresh()
        return model.verified_chunks() == model.manifest.total_chunks

    def _drive(self, job: _Job) -> None:
        try:
            job.reader.wait()
            if self.ram is not None:  # before COMPLETE: an engine told "warm" finds the RAM copy
                try:
                    self.ram.admit(job.reader.model)
                except StrataError as err:  # the copy is optional: engines read the disk cache instead
                    log.error("the RAM copy of %s failed; engines read it from disk: %s", job.manifest.digest, err)
        except StrataError as err:
            job.error = err
            log.error("prefetch of %s failed: %s", job.manifest.digest, err)
        finally:
            job.reader.close()  # its loop, origin and lease: the chunks are in the record now
            job.done.set()

    def status(self, digest: str) -> Progress:
        catalog.check_digest(digest)
        with self._lock:
            job = self._jobs.get(digest)
        manifest = job.manifest if job is not None else self._cache.stored_manifest(digest)
        if manifest is None:
            return Progress(UNKNOWN)
        model = self._served(digest)
        if model is None:
            return Progress(RUNNING if job is not None and not job.done.is_set() else UNKNOWN)
        model.refresh()
        verified = sum(
            e - s for f, entry in enumerate(manifest.files) for c in range(len(entry.chunks))
            if model.is_present(f, c) for s, e in [entry.chunk_span(c, manifest.chunk_bytes)]
        )
        chunks = model.verified_chunks()
        whole = chunks == manifest.total_chunks
        if job is None:
            state = COMPLETE if whole else UNKNOWN  # a model a previous run (or another process) fetched
        elif not job.done.is_set():
            state = RUNNING  # even when every chunk is recorded: its counts are final once the job ends
        else:
            state = COMPLETE if whole and job.error is None else FAILED
        by_source = dict(job.stats.fetched_bytes) if job is not None else {}
        ram_bytes = self.ram.model_bytes(digest) if self.ram is not None else 0
        return Progress(state, manifest.model, manifest.total_bytes, verified, manifest.total_chunks, chunks,
                        str(job.error) if job is not None and job.error else "", by_source, ram_bytes)

    # ---- the peer data plane -----------------------------------------------------------

    def _served(self, digest: str):
        """The model's serving handle (unpinned), None when the cache does not hold it."""
        with self._lock:
            model = self._serving.get(digest)
            if model is not None and not model.current():  # evicted since: drop the stale handle
                self._serving.pop(digest).close()
                model = None
            if model is None:
                manifest = self._cache.stored_manifest(digest)
                if manifest is None:
                    return None
                model = self._serving[digest] = self._cache.open(manifest, pinned=False)
            return model

    def _drop(self, digest: str, model) -> None:
        with self._lock:
            if self._serving.get(digest) is model:
                del self._serving[digest]
                model.close()

    def verified(self, digest: str) -> list[tuple[int, int]]:
        """(file, chunk) of every verified chunk of the model here: what an index swarm announces."""
        model = self._served(digest)
        if model is None:
            return []
        model.refresh()
        return [(f, c) for f, entry in enumerate(model.manifest.files) for c in range(len(entry.chunks))
                if model.is_present(f, c)]

    def read_chunk(self, digest: str, file: int, chunk: int, wait_s: float = 0.0,
                   waited_s: float = 0.0) -> ChunkAnswer:
        """A verified chunk's bytes, or none: after waiting up to ``wait_s`` while a prefetch here
        may still bring it, and then ``pending`` if it still may. ``waited_s``: how long the caller
        has waited on this chunk already (earlier asks), counted against ``join_wait_s``."""
        catalog.check_digest(digest)
        now = time.monotonic()
        deadline = now + min(max(wait_s, 0.0), MAX_WAIT_S)
        joined = now + max(0.0, self.join_wait_s - min(max(waited_s, 0.0), MAX_WAIT_S))  # a prefetch should have begun
        waiting = False
        try:
            while True:
                model = self._served(digest)
                if model is not None:
                    entry = model.manifest.files[file] if file < len(model.manifest.files) else None
                    if entry is None or chunk >= len(entry.chunks):
                        raise InvalidArgument(f"manifest {digest} has no chunk {chunk} of file {file}")
                    model.refresh()
                    if model.is_present(file, chunk):
                        return ChunkAnswer(self._upload(digest, model, file, chunk))
                with self._lock:
                    job = self._jobs.get(digest)
                coming = not job.done.is_set() if job is not None else now < joined
                if not coming or self._closing.is_set():
                    return ChunkAnswer(None)
                if now >= deadline:
                    return ChunkAnswer(None, pending=True)
                if not waiting:
                    if not self._waiting.acquire(blocking=False):
                        raise ResourceExhausted(
                            f"{self.max_waiting} chunk reads are already waiting on this node for chunks it is "
                            "still fetching: ask again shortly, or read the chunk from another source",
                            retry_after_s=0.5,
                        )
                    waiting = True
                self._closing.wait(min(self.limits.poll_interval_s, max(0.0, deadline - now)))
                now = time.monotonic()
        finally:
            if waiting:
                self._waiting.release()

    def _upload(self, digest: str, model, file: int, chunk: int) -> bytes | None:
        """The bytes of a chunk recorded as verified, read under the model's lease; None when the
        model was evicted meanwhile (the handle is dropped: the chunk is not here any more)."""
        if not self._uploads.acquire(blocking=False):
            raise ResourceExhausted("this node is serving its most chunks at once: try another source",
                                    retry_after_s=0.05)
        try:
            with model.leased() as here:
                if not here:
                    self._drop(digest, model)
                    return None
                start, end = model.manifest.files[file].chunk_span(chunk, model.manifest.chunk_bytes)
                data = model.read(file, start, end)
        finally:
            self._uploads.release()
        if self.metrics is not None:
            self.metrics.served.inc(len(data))
        return data

    def close(self) -> None:
        self._closing.set()
        with self._lock:
            jobs, self._jobs = list(self._jobs.values()), {}
            serving, self._serving = list(self._serving.values()), {}
        for job in jobs:
            job.reader.close()  # closing twice is a no-op
        for model in serving:
            model.close()
        self._cache.close()
        if self.ram is not None:
            self.ram.close()
