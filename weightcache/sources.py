"""Chunk sources: where the fetch planner can get a chunk's bytes from, and how hard to push each.

A :class:`ChunkSource` reads one chunk, named by a :class:`ChunkRef`, into
the caller's buffer (or returns its own), returns ``None`` when it does not
hold the chunk (a miss is an answer: the planner moves on to the next source
without counting a failure), and raises the origin errors of
:mod:`weightcache.origin.base` (throttled, unavailable, mismatch). It does
not verify: the planner verifies every chunk, whatever gave it, against the
manifest's digest before it is stored, so a source cannot hand a reader a
wrong byte; it can only waste a try.

Two kinds: the origin (:class:`OriginSource`), and peers, which read a chunk
from another node's cache: its owner in a listed swarm
(:class:`~weightcache.peers.PeerChunkSource`, ``--peer``), or a node the
prefix index names by the chunk's digest, which is content-addressed
(:mod:`weightcache.index_swarm`, ``--index-url``). A :data:`SourceChooser`
puts the peers that may hold a chunk before the origin.
Each source carries its own :class:`AdaptiveLimit`, so a slow peer or a
throttling bucket only slows the requests that go to it.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from weightcache.manifest import Manifest
from weightcache.origin.base import Origin


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """One chunk of one file of a manifest: everything a source needs to find its bytes."""

    file: int
    chunk: int
    path: str
    start: int
    length: int
    digest: bytes  # BLAKE3 of its bytes: the chunk's content address

    @classmethod
    def of(cls, manifest: Manifest, file: int, chunk: int) -> ChunkRef:
        entry = manifest.files[file]
        start, end = entry.chunk_span(chunk, manifest.chunk_bytes)
        return cls(file, chunk, entry.path, start, end - start, entry.chunks[chunk])


class AdaptiveLimit:
    """At most ``current`` requests in flight, ``1 <= current <= maximum``: halved when the source
    throttles, grown by one after ``current`` successes in a row (additive increase,
    multiplicative decrease, as TCP does), so a throttled origin sees load fall at once and
    come back gently."""

    def __init__(self, maximum: int) -> None:
        if maximum < 1:
            raise ValueError("a source needs a concurrency of at least 1")
        self.maximum = maximum
        self.current = maximum
        self.in_flight = 0
        self._streak = 0
        self._changed = asyncio.Condition()

    async def __aenter__(self) -> AdaptiveLimit:
        async with self._changed:
            await self._changed.wait_for(lambda: self.in_flight < self.current)
            self.in_flight += 1
        return self

    async def __aexit__(self, *exc) -> None:
        async with self._changed:
            self.in_flight -= 1
            self._changed.notify_all()

    def throttled(self) -> None:
        self.current = max(1, self.current // 2)
        self._streak = 0

    def succeeded(self) -> None:
        self._streak += 1
        if self._streak >= self.current and self.current < self.maximum:
            self.current += 1
            self._streak = 0


class ChunkSource(abc.ABC):
    kind: str  # a bounded metrics label: "origin", "peer"
    name: str  # for messages
    limit: AdaptiveLimit

    @abc.abstractmethod
    async def read(self, ref: ChunkRef, into: memoryview) -> memoryview | None:
        """The chunk's ``ref.length`` bytes (in ``into`` or a buffer of the source's own); None: not here."""


class OriginSource(ChunkSource):
    kind = "origin"

    def __init__(self, origin: Origin, concurrency: int) -> None:
        self.origin = origin
        self.name = origin.location
        self.limit = AdaptiveLimit(concurrency)

    async def read(self, ref: ChunkRef, into: memoryview) -> memoryview:
        return await self.origin.read(ref.path, ref.start, ref.length, into)


# Sources to try for a chunk, in order of preference (peers first, the origin last).
SourceChooser = Callable[[ChunkRef], Sequence[ChunkSource]]


def only(*sources: ChunkSource) -> SourceChooser:
    return lambda ref: sources
