"""A remote source (:mod:`kvstore.remote`) as the bottom levels of a store's chain.

The store is threaded and calls its tiers synchronously; a remote source is
asynchronous, deadline-bound and answers per key. :class:`RemoteTier` is
the adapter between the two: it calls the source through a
:class:`~kvstore.remote.bridge.RemoteBridge` (one event loop thread, bounded
calls in flight and queued, ``Overloaded`` beyond) with a deadline of its
own on every call, and turns per-key answers into what the store's chain
expects of a tier — a verified copy or a miss, a write that happened or an
error. Every failure it raises is one the store already handles for a
tier: ``TierUnavailable`` (the source is down, slow past its deadline, or
overloaded), ``TierFull``, ``CorruptBlock``, and ``InvalidArgument`` for a
block the source refuses (too large, or a source that takes no writes):
the store's "refused" outcome, the block's problem and never the tier's.

What it does not pretend: a remote source has no recency the store could
persist (``lru`` is empty, ``touch`` does nothing) and is not recovered at
start (``persistent`` is False): blocks another node wrote are found by
reading through on a local miss.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from kvstore.block import BlockKey, BlockMeta, TierName
from kvstore.errors import (
    CorruptBlock, DeadlineExceeded, InvalidArgument, Overloaded, StrataError, TierFull, TierUnavailable,
)
from kvstore.tiers.base import Tier, TierStats

DEFAULT_CALL_S = 2.0


class RemoteTier(Tier):
    remote = True  # the store reads through to it on a local miss

    def __init__(self, bridge, call_s: float = DEFAULT_CALL_S) -> None:
        """``bridge``: a RemoteBridge (it owns the source and its loop); ``call_s``: each call's deadline."""
        self._bridge = bridge
        self._call_s = call_s
        self.name: TierName = TierName(bridge.tier)
        self.source = bridge.name

    @classmethod
    def open(cls, url: str, call_s: float = DEFAULT_CALL_S, **options) -> RemoteTier:
        from kvstore.remote.bridge import RemoteBridge

        return cls(RemoteBridge.open(url, **options), call_s)

    def _deadline(self) -> float:
        return time.monotonic() + self._call_s

    def _unavailable(self, op: str, err: StrataError) -> TierUnavailable:
        return TierUnavailable(f"remote tier {self.source}: {op} failed ({err}); local tiers keep serving")

    @property
    def capacity_bytes(self) -> int:
        cap = self._bridge.stats().source.capacity_bytes
        return cap if cap is not None else 1 << 62

    def contains(self, key: BlockKey) -> bool:
        return self.meta(key) is not None

    def meta(self, key: BlockKey) -> BlockMeta | None:
        try:
            return self._bridge.lookup([key], self._deadline())[0]
        except (DeadlineExceeded, Overloaded, TierUnavailable) as err:
            raise self._unavailable("lookup", err) from None

    def lookup_many(self, keys: list[BlockKey]) -> list[BlockMeta | None]:
        """Metadata of many blocks in one call within this tier's deadline (TierUnavailable otherwise)."""
        try:
            return self._bridge.lookup(keys, self._deadline())
        except (DeadlineExceeded, Overloaded, TierUnavailable) as err:
            raise self._unavailable("lookup", err) from None

    def fetch(self, key: BlockKey) -> tuple[bytearray, BlockMeta] | None:
        """A verified copy and its metadata, or None on a miss: how the store reads through."""
        [got] = self.fetch_many([key])
        if isinstance(got, StrataError):
            raise got
        return got

    def fetch_many(self, keys: list[BlockKey]) -> list[tuple[bytearray, BlockMeta] | None | StrataError]:
        """Verified copies of many blocks in one call within this tier's deadline: per key the copy and
        its metadata, None on a miss, or that block's error (CorruptBlock, TierUnavailable); the
        call as a whole failing raises TierUnavailable."""
        bufs: dict[int, bytearray] = {}

        def place(i: int, meta: BlockMeta) -> memoryview:
            bufs[i] = bytearray(meta.size)
            return memoryview(bufs[i])

        try:
            results = self._bridge.read(keys, place, self._deadline())
        except (DeadlineExceeded, Overloaded, TierUnavailable) as err:
            raise self._unavailable("read", err) from None
        out: list[tuple[bytearray, BlockMeta] | None | StrataError] = []
        for i, result in enumerate(results):
            if result.is_hit:
                out.append((bufs[i], result.meta))
            elif result.error is None:
                out.append(None)
            elif isinstance(result.error, CorruptBlock):
                out.append(result.error)
            else:
                out.append(self._unavailable("read", result.error))
        return out

    def get(self, key: BlockKey) -> bytes | bytearray | None:
        found = self.fetch(key)
        return None if found is None else found[0]

    def put(self, key: BlockKey, data: bytes | bytearray | memoryview, meta: BlockMeta) -> bool:
        try:
            [result] = self._bridge.write([(key, data, meta)], self._deadline())
        except (DeadlineExceeded, Overloaded, TierUnavailable) as err:
            raise self._unavailable("write", err) from None
        if result.ok:
            return result.status.value == "stored"
        if isinstance(result.error, (TierFull, CorruptBlock, InvalidArgument)):
            # InvalidArgument (BlockTooLarge, a read-only source such as the peer tier): this
            # block is refused, and the store keeps it above; the tier itself is healthy.
            raise result.error
        raise self._unavailable("write", result.error)

    def delete(self, key: BlockKey) -> bool:
        try:
            return self._bridge.delete([key], self._deadline()) > 0
        except (DeadlineExceeded, Overloaded, TierUnavailable) as err:
            raise self._unavailable("delete", err) from None

    def touch(self, key: BlockKey) -> None:
        """A remote source keeps no recency for this node."""

    def lru(self) -> Iterator[BlockKey]:
        return iter(())

    def stats(self) -> TierStats:
        s = self._bridge.stats().source
        return TierStats(self.name, s.stored_bytes or 0, s.capacity_bytes or 0, s.stored_blocks or 0)

    def close(self) -> None:
        self._bridge.close()
