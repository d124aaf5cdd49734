"""The object tier at the bottom of a store's chain: an S3 bucket the whole fleet shares.

A :class:`~kvstore.tiers.remote.RemoteTier` over an
:class:`~kvstore.remote.object.ObjectSource`, with one difference that makes
it safe at the bottom of the chain: **writes never wait for S3.** ``put``
hands the block to a bounded :class:`~kvstore.remote.object.writeback.WriteBack`
queue and returns (the store then drops the copy above, as for any tier
that took the block); uploads run on the source's loop. While a block
waits it is read from the queue. When S3 is slow or down the queue drops
its oldest blocks (``strata_object_writeback_total{outcome="dropped"}``),
and nothing local waits, so the RAM and disk tiers keep serving.

Reads go through the bridge with a deadline (``call_s``): a local miss
reads through, is verified by the source, and is promoted by the edge's
policy. A block the store still lists here but the bucket no longer has (a
dropped upload, another node's delete, a lifecycle rule) reads as a miss,
and the store then forgets its copy here.

How blocks get here is the edge's policy (``[tiers.object] write_policy``):
``back`` when evicted from the tier above, ``through`` as soon as stored
there, ``off`` never (read-through only).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvstore.block import BlockKey, BlockMeta, TierName
from kvstore.errors import TierUnavailable
from kvstore.remote.bridge import BridgeLimits, RemoteBridge
from kvstore.remote.object import credentials
from kvstore.remote.object.client import S3Client, S3Options
from kvstore.remote.object.layout import KeyLayout
from kvstore.remote.object.metrics import ObjectMetrics
from kvstore.remote.object.source import ObjectLimits, ObjectSource
from kvstore.remote.object.writeback import WriteBack, WriteBackLimits, WriteBackStats
from kvstore.tiers.base import TierStats
from kvstore.tiers.remote import RemoteTier


class ObjectTier(RemoteTier):
    def __init__(self, bridge: RemoteBridge, call_s: float, writeback: WriteBackLimits = WriteBackLimits(),
                 metrics: ObjectMetrics | None = None) -> None:
        super().__init__(bridge, call_s)
        self._metrics = metrics
        self._writeback = WriteBack(bridge, writeback, metrics, bridge.name)
        if metrics is not None:
            metrics.watch_queue(self._writeback.depth)

    @classmethod
    def open(
        cls, *, bucket: str, prefix: str = "", endpoint: str = "", region: str = "", profile: str = "",
        virtual_hosted: bool = False, environ: Mapping[str, str] | None = None, metrics: ObjectMetrics | None = None,
        call_s: float = 5.0, max_requests: int = 32, request_s: float = 10.0, connect_s: float = 2.0,
        retries: int = 4, backoff_s: float = 0.1, max_backoff_s: float = 5.0, part_bytes: int = 8 << 20,
        parts_in_flight: int = 4, multipart_bytes: int = 64 << 20, check_before_put: bool = True,
        queue_blocks: int = 1024, queue_bytes: int = 256 << 20, max_uploads: int = 8, upload_s: float = 30.0,
        drain_s: float = 10.0, max_block_bytes: int = 1 << 30, writeback: WriteBackLimits | None = None,
    ) -> ObjectTier:
        """Resolve credentials (``environ``: the daemon's environment, read once here), then start the
        source on its bridge's loop and the write-back workers (``writeback``: every write-back limit,
        in place of the queue_*, max_uploads, upload_s and drain_s values)."""
        writeback = writeback or WriteBackLimits(max_blocks=queue_blocks, max_bytes=queue_bytes,
                                                 uploads=max_uploads, upload_s=upload_s, drain_s=drain_s)
        found = credentials.resolve(os.environ if environ is None else environ, region=region, profile=profile)
        options = S3Options(
            bucket=bucket, endpoint=endpoint, region=found.region, virtual_hosted=virtual_hosted,
            credentials=found.credentials, request_s=request_s, connect_s=connect_s, max_requests=max_requests,
            retries=retries, backoff_s=backoff_s, max_backoff_s=max_backoff_s, part_bytes=part_bytes,
            parts_in_flight=parts_in_flight,
        )
        layout = KeyLayout(prefix)
        limits = ObjectLimits(multipart_bytes, check_before_put, max_block_bytes)
        metrics = metrics or ObjectMetrics()
        bridge = RemoteBridge(
            lambda: ObjectSource(S3Client(options, metrics), layout, limits=limits),
            BridgeLimits(max_in_flight=max_requests, max_queued=4 * max_requests),
        )
        try:
            return cls(bridge, call_s, writeback, metrics)
        except BaseException:
            bridge.close()
            raise

    @property
    def writeback(self) -> WriteBackStats:
        return self._writeback.stats()

    def put(self, key: BlockKey, data: bytes | bytearray | memoryview, meta: BlockMeta) -> bool:
        """Queue the block for upload (True), or False when it is queued already; never waits on S3."""
        return self._writeback.offer(key, data, meta)

    def fetch(self, key: BlockKey) -> tuple[bytearray, BlockMeta] | None:
        waiting = self._writeback.pending(key)
        if waiting is not None:
            return bytearray(waiting[0]), waiting[1]
        return super().fetch(key)

    def meta(self, key: BlockKey) -> BlockMeta | None:
        waiting = self._writeback.pending_meta(key)
        return waiting if waiting is not None else super().meta(key)

    def delete(self, key: BlockKey) -> bool:
        queued = self._writeback.discard(key)
        try:
            return super().delete(key) or queued
        except TierUnavailable:
            if queued:
                return True
            raise

    def stats(self) -> TierStats:
        base = super().stats()
        failing = self._writeback.stats().failing
        return TierStats(TierName.OBJECT, base.used_bytes, base.capacity_bytes, base.blocks,
                         f"uploads to {self.source} are failing: {failing}" if failing else "")

    def close(self) -> None:
        try:
            self._writeback.close()
        finally:
            if self._metrics is not None:
                self._metrics.unwatch_queue(self._writeback.depth)
            super().close()
