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

Lifecycle (:mod:`kvstore.remote.object.lifecycle`): with a TTL or a quota,
reads refresh a block's read marker, every daemon sweeps the namespaces
whose sweep lease it wins (``sweep_s``), a namespace's quota refuses a
block before it is queued (``TierFull``: the store keeps it above), and
blocks a sweep here deleted are forgotten by this store (``on_gone``), so
its index entries as holder ``object`` go with them; with the daemon's
index (``index``), every other node's ``object`` holding of those blocks,
and of objects found corrupt, goes too
(:class:`~kvstore.remote.object.holders.ObjectHolders`). The sweep also
aborts multipart uploads abandoned longer than ``upload_age_s``
(:mod:`kvstore.remote.object.uploads`).

How blocks get here is the edge's policy (``[tiers.object] write_policy``):
``back`` when evicted from the tier above, ``through`` as soon as stored
there, ``off`` never (read-through only).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Mapping

from kvstore.block import BlockKey, BlockMeta, TierName
from kvstore.errors import CorruptBlock, DeadlineExceeded, InvalidArgument, Overloaded, StrataError, TierUnavailable
from kvstore.remote.bridge import BridgeLimits, RemoteBridge
from kvstore.remote.object import credentials
from kvstore.remote.object.client import S3Client, S3Options
from kvstore.remote.object.format import frame
from kvstore.remote.object.holders import ObjectHolders
from kvstore.remote.object.layout import KeyLayout
from kvstore.remote.object.lease import SweepLease
from kvstore.remote.object.lifecycle import LifecyclePolicy, ReadMarks, SharedQuota, Sweeper, run_sweeps
from kvstore.remote.object.metrics import ObjectMetrics
from kvstore.remote.object.source import ObjectLimits, ObjectSource
from kvstore.remote.object.uploads import PendingUploads
from kvstore.remote.object.writeback import WriteBack, WriteBackLimits, WriteBackStats
from kvstore.tiers.base import TierStats
from kvstore.tiers.remote import RemoteTier

log = logging.getLogger(__name__)


class ObjectTier(RemoteTier):
    answers_exists = True  # a fresh node's Exists asks the bucket past its local misses (bounded)
    evicts_to_fit = False  # full means a namespace's quota: TTL sweeps make room, not this node's LRU
    def __init__(self, bridge: RemoteBridge, call_s: float, writeback: WriteBackLimits = WriteBackLimits(),
                 metrics: ObjectMetrics | None = None, quota: SharedQuota | None = None,
                 holders: ObjectHolders | None = None) -> None:
        super().__init__(bridge, call_s)
        self._holders = holders
        self._metrics = metrics
        self._quota = quota
        self._gone_lock = threading.Lock()
        self._on_gone: list[Callable[[list[BlockKey]], None]] = []
        self._sweeps = None
        self._writeback = WriteBack(bridge, writeback, metrics, bridge.name, frame=frame)
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
        ttl_s: float = 0.0, namespace_ttl_s: Mapping[str, float] | None = None,
        namespace_quota_bytes: Mapping[str, int] | None = None, sweep_s: float = 0.0, sweep_deadline_s: float = 600.0,
        lease_s: float = 300.0, node_id: str = "", upload_age_s: float = 3600.0, index=None, index_loop=None,
    ) -> ObjectTier:
        """Resolve credentials (``environ``: the daemon's environment, read once here), then start the
        source on its bridge's loop and the write-back workers (``writeback``: every write-back limit,
        in place of the queue_*, max_uploads, upload_s and drain_s values). ``sweep_s`` > 0 runs a
        lifecycle sweep that often, under a sweep lease held as ``node_id``: it expires blocks when
        there is a TTL or a quota, and always aborts multipart uploads older than ``upload_age_s``.
        ``index`` (a PrefixIndex, on ``index_loop``): blocks whose object goes leave it for every node."""
        if upload_age_s <= upload_s:
            raise InvalidArgument(
                f"object abandoned_upload_seconds ({upload_age_s:g}) must exceed upload_seconds ({upload_s:g}): "
                "a live upload would be aborted"
            )
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
        policy = LifecyclePolicy(ttl_s, dict(namespace_ttl_s or {}), dict(namespace_quota_bytes or {}), upload_age_s)
        holders = ObjectHolders(index, index_loop) if index is not None and index_loop is not None else None
        tier_ref: list[ObjectTier] = []  # the tier, once made: a corrupt object's block goes as a swept one
        quota = SharedQuota(policy.quota_bytes, metrics) if policy.quota_bytes else None

        def source() -> ObjectSource:
            client = S3Client(options, metrics)
            ttls = policy.ttl_s > 0 or policy.namespace_ttl_s
            marks = ReadMarks(client, layout, policy) if ttls else None
            return ObjectSource(client, layout, limits=limits, marks=marks,
                                on_dropped=lambda keys: tier_ref[0]._gone(keys) if tier_ref else None)

        bridge = RemoteBridge(source, BridgeLimits(max_in_flight=max_requests, max_queued=4 * max_requests))
        try:
            tier = cls(bridge, call_s, writeback, metrics, quota, holders)
            tier_ref.append(tier)
            if sweep_s > 0:
                tier.start_sweeps(policy, node_id or f"{os.uname().nodename}-{os.getpid()}", sweep_s,
                                  sweep_deadline_s, lease_s)
            return tier
        except BaseException:
            bridge.close()
            raise

    def start_sweeps(self, policy: LifecyclePolicy, holder: str, every_s: float, deadline_s: float,
                     lease_s: float) -> None:
        """Sweep the bucket's namespaces every ``every_s`` on the source's loop (cancelled at close)."""
        async def sweeps(src: ObjectSource) -> None:
            lease = SweepLease(src.client, src.layout, holder, lease_s)
            uploads = PendingUploads(src.client, src.layout, policy.upload_age_s)
            sweeper = Sweeper(src.client, src.layout, policy, lease, self._quota, self._gone, uploads=uploads,
                              blocks=policy.has_blocks_work)
            await run_sweeps(sweeper, every_s, deadline_s, asyncio.Event())

        self._sweeps = self._bridge.background(sweeps)

    def on_gone(self, callback: Callable[[list[BlockKey]], None]) -> None:
        """Call ``callback(keys)`` (on the source's loop: be quick) for blocks a sweep here deleted."""
        with self._gone_lock:
            self._on_gone.append(callback)

    def _gone(self, keys: list[BlockKey]) -> None:
        """On the loop: the store's lock is taken on a thread of its own (a store thread holding it
        may be waiting on this loop)."""
        if self._holders is not None:
            self._holders.forget(keys)
        with self._gone_lock:
            callbacks = list(self._on_gone)
        if callbacks:
            threading.Thread(target=lambda: [c(keys) for c in callbacks], name="strata-object-gone",
                             daemon=True).start()

    @property
    def writeback(self) -> WriteBackStats:
        return self._writeback.stats()

    def put(self, key: BlockKey, data: bytes | bytearray | memoryview, meta: BlockMeta) -> bool:
        """Queue the block for upload (True), or False when it is queued already; never waits on S3.
        TierFull when its namespace's quota has no room (the store keeps it above)."""
        if self._writeback.pending_meta(key) is not None:
            return False
        if self._quota is not None:
            self._quota.admit(key, meta.size)
        return self._writeback.offer(key, data, meta)

    def fetch(self, key: BlockKey) -> tuple[bytearray | memoryview, BlockMeta] | None:
        """A verified copy: from the queue while the block waits for upload, else the object read whole
        and verified in place (a read-only view of the response, no copy here: the store copies it)."""
        waiting = self._writeback.pending(key)
        if waiting is not None:
            return bytearray(waiting[0]), waiting[1]
        try:
            return self._bridge.call("read", lambda source, deadline: source.fetch(key, deadline), self._deadline())
        except (DeadlineExceeded, Overloaded, TierUnavailable) as err:
            raise self._unavailable("read", err) from None

    def fetch_many(self, keys: list[BlockKey]) -> list[tuple[bytearray | memoryview, BlockMeta] | None | StrataError]:
        """Per key :meth:`fetch`'s answer, or its CorruptBlock; one object per block. The bucket found
        unavailable is not asked for the rest: they get the same TierUnavailable."""
        out: list[tuple[bytearray | memoryview, BlockMeta] | None | StrataError] = []
        for i, key in enumerate(keys):
            try:
                out.append(self.fetch(key))
            except CorruptBlock as err:
                out.append(err)
            except TierUnavailable as err:
                return out + [err] * (len(keys) - i)
        return out

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
