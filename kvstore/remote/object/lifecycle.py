"""Lifecycle of block objects: per-namespace TTL, a garbage-collecting sweep, a quota the fleet shares.

**TTL from last use.** A namespace's TTL counts from the later of the
object's last write (S3's ``LastModified``) and its last read. S3 keeps no
read time, and rewriting a block to refresh it would cost its bytes, so a
read of an object older than TTL/2 writes a **read marker**: an empty
object ``<prefix>/~touch/<namespace>/<key name>`` (one small PUT; each
daemon writes a block's marker at most once per TTL/2). A block read at
least once per TTL/2 therefore never expires; one neither written nor read
for a whole TTL does. The markers' ``LastModified`` is the last read.

**The sweep** (:class:`Sweeper`), run by every daemon with the tier every
``sweep_s``: for each namespace under the prefix, take its
:class:`~kvstore.remote.object.lease.SweepLease` (a conditional write in
the bucket; the others skip it, so no listing is paid twice), list the
markers, then the blocks, and delete the expired blocks and every marker
whose block is gone or expired, so a pass leaves no byte that belongs to
no live block. It records the namespace's usage in the lease, where the
others read it. Names it cannot parse are not Strata's and are left.

**Multipart uploads.** Blocks of at least ``multipart_bytes`` go up in
parts; a daemon killed mid-upload leaves the uploaded parts in S3, billed
and invisible to an object listing. The sweep lists the uploads in
progress under the prefix (:class:`~kvstore.remote.object.uploads.PendingUploads`,
S3's ListMultipartUploads) and, for each namespace whose lease it holds,
aborts those initiated more than ``upload_age_s`` ago (an hour by
default: past any upload's deadline, so a live one is never aborted). A
namespace that has nothing but abandoned uploads is swept too.

**Quota** (:class:`SharedQuota`): per namespace, the bytes the last sweep
listed (read from the lease by every daemon) plus what this daemon queued
for upload since. A block without room is refused before it is queued
(``TierFull``): the store keeps it in the tier above, nothing is lost. A
queued block counts even if its upload later fails or finds the object
present; the next sweep's listing corrects that (the bound errs on the
side of refusing). Other daemons' uploads since the last sweep are not
seen: the bound holds to within one sweep interval of the fleet's uploads.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvstore.block import BlockKey
from kvstore.errors import InvalidArgument, NamespaceFull, StrataError
from kvstore.remote.object.client import S3Client
from kvstore.remote.object.layout import KeyLayout, escape_namespace, key_name, unescape_namespace
from kvstore.remote.object.lease import SweepLease
from kvstore.remote.object.metrics import ObjectMetrics
from kvstore.remote.object.uploads import PendingUploads, Upload

log = logging.getLogger(__name__)
TOUCH_SEGMENT = "~touch"
DELETE_BATCH = 1000  # S3's DeleteObjects takes at most 1000 keys
MAX_MARKS_REMEMBERED = 100_000
MAX_GONE_KEYS = 100_000  # deleted keys a sweep hands the store; past it, a read's miss forgets the rest
FULL_RETRY_S = 30.0


def parse_ttls(entries: Mapping[str, float] | list[str], what: str = "object_namespace_ttl") -> dict[str, float]:
    """``NAMESPACE=SECONDS`` entries (split at the last ``=``: a namespace may hold ``=``)."""
    if isinstance(entries, Mapping):
        return {str(k): float(v) for k, v in entries.items()}
    out: dict[str, float] = {}
    for entry in entries:
        ns, sep, value = entry.rpartition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if not sep or not ns or seconds <= 0:
            raise InvalidArgument(f"{what} {entry!r}: write NAMESPACE=SECONDS with a positive number, e.g. chat=86400")
        out[ns] = seconds
    return out


@dataclass(frozen=True)
class LifecyclePolicy:
    ttl_s: float = 0.0  # every namespace's TTL; 0: blocks never expire
    namespace_ttl_s: Mapping[str, float] = field(default_factory=dict)  # overrides ttl_s
    quota_bytes: Mapping[str, int] = field(default_factory=dict)  # per namespace; absent: no bound
    upload_age_s: float = 3600.0  # multipart uploads initiated longer ago are abandoned: aborted

    @property
    def has_blocks_work(self) -> bool:
        """Whether a daemon's sweep has blocks to look at (a TTL, or usage to measure), not only uploads."""
        return bool(self.ttl_s > 0 or self.namespace_ttl_s or self.quota_bytes)

    def ttl(self, namespace: str) -> float:
        return self.namespace_ttl_s.get(namespace, self.ttl_s)


@dataclass
class SweepReport:
    namespace: str
    swept: bool = False  # False: another daemon holds the lease
    expired: int = 0
    expired_bytes: int = 0
    markers: int = 0  # markers deleted
    kept: int = 0
    kept_bytes: int = 0
    uploads: int = 0  # abandoned multipart uploads aborted
    deleted_keys: list[BlockKey] = field(default_factory=list)


def touch_root(layout: KeyLayout, namespace: str) -> str:
    return f"{layout.root}{TOUCH_SEGMENT}/{escape_namespace(namespace)}/"


def _seconds(meta: dict) -> float:
    return meta["last_modified"].timestamp()


class ReadMarks:
    """Writes a block's read marker when a read finds it older than half its TTL (see the module)."""

    def __init__(self, client: S3Client, layout: KeyLayout, policy: LifecyclePolicy,
                 wall: Callable[[], float] = time.time) -> None:
        self._client, self._layout, self._policy, self._wall = client, layout, policy, wall
        self._marked: OrderedDict[BlockKey, float] = OrderedDict()  # when this daemon last marked a block

    async def read(self, key: BlockKey, written_at: float, deadline: float) -> None:
        ttl = self._policy.ttl(key.namespace)
        if ttl <= 0:
            return
        now = self._wall()
        last = max(written_at, self._marked.get(key, 0.0))
        if now - last < ttl / 2:
            return
        self._marked[key] = now
        self._marked.move_to_end(key)
        while len(self._marked) > MAX_MARKS_REMEMBERED:
            self._marked.popitem(last=False)
        path = touch_root(self._layout, key.namespace) + key_name(key.key)
        try:
            await self._client.put_control(path, b"", deadline, overwrite=True)
        except StrataError as err:  # the block stays readable; it may expire a little early
            log.warning("could not write the read marker of %s: %s", key, err)


class SharedQuota:
    """Per-namespace byte bounds (see the module). Thread-safe: the tier asks from the store's threads."""

    def __init__(self, bounds: Mapping[str, int], metrics: ObjectMetrics | None = None) -> None:
        for ns, cap in bounds.items():
            if cap <= 0:
                raise InvalidArgument(f"object quota of {ns!r} is {cap}: give a positive number of bytes")
        self.bounds = dict(bounds)
        self._listed: dict[str, int] = {}
        self._local: dict[str, int] = {}
        self._lock = threading.Lock()
        self._metrics = metrics

    def used(self, namespace: str) -> int:
        with self._lock:
            return self._listed.get(namespace, 0) + self._local.get(namespace, 0)

    def admit(self, key: BlockKey, size: int) -> None:
        """Count a block about to be queued, or raise TierFull naming the namespace and its bound."""
        cap = self.bounds.get(key.namespace)
        if cap is None:
            return
        with self._lock:
            used = self._listed.get(key.namespace, 0) + self._local.get(key.namespace, 0)
            if used + size <= cap:
                self._local[key.namespace] = self._local.get(key.namespace, 0) + size
                return
        if self._metrics is not None:
            self._metrics.refused.inc()
        raise NamespaceFull(
            f"object quota of namespace {key.namespace!r} is full: {used} of {cap} bytes used, block {key} needs "
            f"{size}; it stays in the local tiers. Raise [tiers.object] namespace_quota, lower its TTL, or run "
            "strata object gc",
            retry_after_s=FULL_RETRY_S, namespace=key.namespace,
        )

    def observe(self, namespace: str, usage_bytes: int) -> None:
        """The namespace's usage as a sweep listed it: replaces what this daemon counted since."""
        with self._lock:
            self._listed[namespace] = usage_bytes
            self._local[namespace] = 0


class Sweeper:
    """One daemon's lifecycle sweeps over every namespace of a layout (see the module)."""

    def __init__(self, client: S3Client, layout: KeyLayout, policy: LifecyclePolicy, lease: SweepLease,
                 quota: SharedQuota | None = None, on_deleted: Callable[[list[BlockKey]], None] | None = None,
                 wall: Callable[[], float] = time.time, uploads: PendingUploads | None = None,
                 blocks: bool = True) -> None:
        """``uploads``: collect abandoned multipart uploads too (None: leave them to a bucket rule);
        ``blocks``: list the blocks (expire, collect markers, measure usage), else uploads only."""
        self._client, self._layout, self._policy, self._lease = client, layout, policy, lease
        self._quota, self._on_deleted, self._wall = quota, on_deleted, wall
        self._uploads, self._blocks = uploads, blocks
        self._metrics = self.metrics = client.metrics

    async def namespaces(self, deadline: float) -> list[str]:
        """The namespaces that have objects under the prefix (not the lease and marker folders)."""
        out = []
        for segment in await self._client.list_segments(self._layout.root, deadline):
            ns = unescape_namespace(segment)
            if escape_namespace(ns) == segment:
                out.append(ns)
        return out

    async def sweep_all(self, deadline: float, progress: Callable[[int], None] | None = None) -> list[SweepReport]:
        by_ns: dict[str, list[Upload]] = {}
        if self._uploads is not None:
            for upload in await self._uploads.list(self._layout.root, deadline):
                parsed = self._layout.parse(upload.path)
                if parsed is not None:
                    by_ns.setdefault(parsed[0], []).append(upload)
        names = await self.namespaces(deadline) if self._blocks else []
        names += [ns for ns in by_ns if ns not in names]
        reports = []
        for ns in names:
            try:
                reports.append(await self.sweep(ns, deadline, progress, uploads=by_ns.get(ns, [])))
            except StrataError as err:
                self._metrics.sweeps.labels("failed").inc()
                log.warning("lifecycle sweep of namespace %r failed: %s", ns, err)
        return reports

    async def refresh(self, namespace: str, deadline: float) -> None:
        """Learn a namespace's usage from its lease (what the last sweep, by any daemon, listed)."""
        state = await self._lease.read(namespace, deadline)
        if self._quota is not None and state is not None and state.usage_bytes is not None:
            self._quota.observe(namespace, int(state.usage_bytes))

    async def sweep(self, namespace: str, deadline: float, progress: Callable[[int], None] | None = None,
                    uploads: list[Upload] | None = None) -> SweepReport:
        """Sweep one namespace under its lease. ``uploads``: its pending multipart uploads as
        :meth:`sweep_all` listed them (None: listed here)."""
        report = SweepReport(namespace)
        state = await self._lease.acquire(namespace, deadline)
        if state is None:
            self._metrics.sweeps.labels("leased_elsewhere").inc()
            await self.refresh(namespace, deadline)
            return report
        report.swept = True
        seen: dict[str, float] | None = None  # when each pending upload was first seen (None: not looked)
        if self._uploads is not None:
            if uploads is None:
                uploads = await self._uploads.list(self._layout.namespace_root(namespace), deadline)
            doomed_uploads, seen = self._uploads.abandoned(uploads, state.uploads)
            for upload in doomed_uploads:
                if await self._uploads.abort(upload, deadline):
                    report.uploads += 1
                    log.info("aborted the abandoned multipart upload of %s", upload.path)
        if not self._blocks:
            await self._lease.release(namespace, deadline, uploads=seen)
            self._count(report)
            return report
        marks: dict[str, tuple[str, float]] = {}
        async for page in self._client.list(touch_root(self._layout, namespace), deadline):
            for m in page:
                marks[m["path"].rsplit("/", 1)[-1]] = (m["path"], _seconds(m))
        ttl, now = self._policy.ttl(namespace), self._wall()
        renew_at = time.monotonic() + self._lease.lease_s / 2
        doomed: list[str] = []
        complete = True
        async for page in self._client.list(self._layout.namespace_root(namespace), deadline):
            for m in page:
                parsed = self._layout.parse(m["path"])
                if parsed is None or parsed[0] != namespace:
                    continue
                name = m["path"].rsplit("/", 1)[-1]
                mark = marks.pop(name, None)
                last_use = max(_seconds(m), mark[1] if mark else 0.0)
                if ttl > 0 and now - last_use > ttl:
                    doomed.append(m["path"])
                    if mark:
                        doomed.append(mark[0])
                    report.expired += 1
                    report.expired_bytes += m["size"]
                    if parsed[1] is not None and len(report.deleted_keys) < MAX_GONE_KEYS:
                        report.deleted_keys.append(BlockKey(namespace, parsed[1]))
                else:
                    report.kept += 1
                    report.kept_bytes += m["size"]
            if progress is not None:
                progress(len(page))
            while len(doomed) >= DELETE_BATCH:
                await self._client.delete(doomed[:DELETE_BATCH], deadline)
                del doomed[:DELETE_BATCH]
            if time.monotonic() >= renew_at:  # a long sweep keeps its lease
                if await self._lease.acquire(namespace, deadline) is None:
                    log.warning("lost the sweep lease of %r mid-sweep; leaving the rest to its holder", namespace)
                    marks.clear()  # blocks not listed yet: their markers are not stale
                    complete = False
                    break
                renew_at = time.monotonic() + self._lease.lease_s / 2
        stale = [path for path, _ in marks.values()]  # markers of blocks no longer there
        doomed.extend(stale)
        for i in range(0, len(doomed), DELETE_BATCH):
            await self._client.delete(doomed[i:i + DELETE_BATCH], deadline)
        report.markers = len(stale)
        if complete:  # a partial listing is no usage figure
            await self._lease.release(namespace, deadline, (report.kept_bytes, report.kept), uploads=seen)
            if self._quota is not None:
                self._quota.observe(namespace, report.kept_bytes)
        self._count(report)
        if report.deleted_keys and self._on_deleted is not None:
            self._on_deleted(report.deleted_keys)
        return report

    def _count(self, r: SweepReport) -> None:
        m = self._metrics
        m.sweeps.labels("done").inc()
        m.gc_objects.labels("expired").inc(r.expired)
        m.gc_objects.labels("marker").inc(r.markers)
        m.gc_objects.labels("kept").inc(r.kept)
        m.gc_objects.labels("upload").inc(r.uploads)
        m.gc_bytes.labels("expired").inc(r.expired_bytes)
        m.gc_bytes.labels("kept").inc(r.kept_bytes)


async def run_sweeps(sweeper: Sweeper, interval_s: float, deadline_s: float, stop: asyncio.Event) -> None:
    """Sweep every ``interval_s`` until ``stop`` is set (a daemon's background task)."""
    while not stop.is_set():
        try:
            await sweeper.sweep_all(time.monotonic() + deadline_s)
        except StrataError as err:  # listing the namespaces failed: S3 is unwell; try next interval
            sweeper.metrics.sweeps.labels("failed").inc()
            log.warning("lifecycle sweep failed: %s", err)
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
        except asyncio.TimeoutError:
            pass
