"""FaultySource: a remote source that fails on purpose, for fault sweeps and chaos drills.

It wraps a real source (any kind) and adds the failures a far source has,
so the code above it (the store's chain, a replication job) can be shown
to lose nothing committed and serve nothing torn. Every call not chosen to
fail goes to the wrapped source unchanged. The faults are plain attributes;
change them between calls:

- ``fail_calls``: call numbers (counted over every method, from 1; see
  ``calls``) that raise ``TierUnavailable`` before reaching the source, for
  sweeps that fail the Nth transfer for N = 1, 2, ...;
- ``answer_first``: read and write pass only the first k keys of a batch on;
  the rest fail ``TierUnavailable``, as when a connection drops mid-batch;
- ``fail_keys``: read and write of these keys fail ``TierUnavailable``;
- ``corrupt_keys``: a read of these keys is damaged on the way: the bytes
  land in the caller's buffer with one byte flipped and the key reports
  ``CorruptBlock``, never a hit, which is what a verifying source reports
  for a bit flip in transit.

Lookups and deletes are all or nothing, so only ``fail_calls`` applies to them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace

from kvstore.block import BlockKey, BlockMeta
from kvstore.errors import CorruptBlock, TierUnavailable
from kvstore.remote.base import MetaPlace, ReadResult, RemoteSource, RemoteStats, WriteResult, check_batch, time_left


class FaultySource(RemoteSource):
    def __init__(
        self,
        inner: RemoteSource,
        *,
        fail_calls: Collection[int] = (),
        answer_first: int | None = None,
        fail_keys: Collection[BlockKey] = (),
        corrupt_keys: Collection[BlockKey] = (),
    ) -> None:
        self.inner = inner
        self.tier = inner.tier
        self.name = inner.name
        self.fail_calls = set(fail_calls)
        self.answer_first = answer_first
        self.fail_keys = set(fail_keys)
        self.corrupt_keys = set(corrupt_keys)
        self.calls = 0
        self.injected = 0  # failures this wrapper made up (keys and whole calls)

    async def lookup(self, keys: Sequence[BlockKey], deadline: float) -> list[BlockMeta | None]:
        self._count("lookup")
        return await self.inner.lookup(keys, deadline)

    async def delete(self, keys: Sequence[BlockKey], deadline: float) -> int:
        self._count("delete")
        return await self.inner.delete(keys, deadline)

    async def read(self, keys: Sequence[BlockKey], place: MetaPlace, deadline: float) -> list[ReadResult]:
        chosen = self._choose("read", keys, deadline)
        placed: dict[int, memoryview] = {}

        def tracked(j: int, meta: BlockMeta) -> memoryview | None:
            view = place(chosen[j], meta)
            if view is not None:
                placed[j] = view
            return view

        results: list[ReadResult] = [self._dropped(ReadResult.failed, "read")] * len(keys)
        if chosen:
            answers = await self.inner.read([keys[i] for i in chosen], tracked, deadline)
            for j, (i, answer) in enumerate(zip(chosen, answers)):
                if answer.is_hit and keys[i] in self.corrupt_keys:
                    if answer.meta.size:
                        memoryview(placed[j]).cast("B")[0] ^= 0xFF
                    self.injected += 1
                    answer = ReadResult.failed(
                        CorruptBlock(f"{self.name}: injected: block {keys[i]} was damaged in transit")
                    )
                results[i] = answer
        return results

    async def write(self, blocks, deadline: float) -> list[WriteResult]:
        chosen = self._choose("write", [b[0] for b in blocks], deadline)
        results: list[WriteResult] = [self._dropped(WriteResult.failed, "write")] * len(blocks)
        if chosen:
            for i, answer in zip(chosen, await self.inner.write([blocks[i] for i in chosen], deadline)):
                results[i] = answer
        return results

    async def close(self) -> None:
        await self.inner.close()

    def stats(self) -> RemoteStats:
        inner = self.inner.stats()
        return replace(inner, errors=inner.errors + self.injected)

    def _count(self, op: str) -> None:
        self.calls += 1
        if self.calls in self.fail_calls:
            self.injected += 1
            raise TierUnavailable(f"{self.name}: injected failure of call {self.calls} ({op})")

    def _choose(self, op: str, keys: Sequence[BlockKey], deadline: float) -> list[int]:
        """Indices of the keys passed on to the wrapped source; the others fail."""
        time_left(self, op, deadline)
        check_batch(self, op, len(keys))
        self._count(op)
        chosen = [i for i, key in enumerate(keys) if key not in self.fail_keys]
        if self.answer_first is not None:
            chosen = chosen[: self.answer_first]
        self.injected += len(keys) - len(chosen)
        return chosen

    def _dropped(self, failed, op: str):
        return failed(TierUnavailable(f"{self.name}: injected: {op} of this key was not answered"))
