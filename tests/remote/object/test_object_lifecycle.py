"""Lifecycle of block objects against the real moto server: TTL, the sweep lease, GC, quotas, the index.

What the bucket holds after a sweep is checked by listing it (``S3Env.keys``):
every object left under the prefix is a live block, its read marker, or a
sweep lease. Ages come from S3's own LastModified; the sweeps' clock is
moved forward instead of waiting, except where a read must land later than
a write (one short sleep, with a margin of seconds over S3's 1-second
resolution).
"""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest

from kvstore.block import BlockKey, BlockMeta, TierName, checksum
from kvstore.errors import TierFull
from kvstore.remote.object.client import S3Client, S3Options
from kvstore.remote.object.credentials import StaticCredentials
from kvstore.remote.object.layout import KeyLayout
from kvstore.remote.object.lease import SweepLease
from kvstore.remote.object.lifecycle import LifecyclePolicy, ReadMarks, SharedQuota, Sweeper
from kvstore.remote.object.metrics import ObjectMetrics
from kvstore.remote.object.source import ObjectSource
from kvstore.store import EdgePolicy, StoreLimits, TieredStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.object import ObjectTier
from kvstore.tiers.ram import HostRamTier
from tests.support import s3_servers
from tests.support.store_blocks import MiB, value
from tests.support.wait import wait_until

pytestmark = pytest.mark.system

CREDS = StaticCredentials(s3_servers.ACCESS_KEY, s3_servers.SECRET_KEY)


def later() -> float:
    return time.monotonic() + 30.0


def blk(i: int, n: int = 4096) -> tuple[BlockKey, bytes, BlockMeta]:
    data = bytes([i % 251]) * n
    return BlockKey("ns", b"k%d" % i), data, BlockMeta(n, checksum(data))


@pytest.fixture
def prefix(request) -> str:
    return "life-" + hashlib.blake2b(request.node.nodeid.encode(), digest_size=6).hexdigest()


def client(s3, endpoint: str = "") -> S3Client:
    return S3Client(S3Options(bucket=s3.bucket, endpoint=endpoint or s3.endpoint, credentials=CREDS, retries=1,
                              backoff_s=0.01), ObjectMetrics())


def sweeper(c: S3Client, prefix: str, policy: LifecyclePolicy, holder: str = "a", wall=time.time, **kw) -> Sweeper:
    layout = KeyLayout(prefix)
    return Sweeper(c, layout, policy, SweepLease(c, layout, holder, 60.0, wall=wall), wall=wall, **kw)


def test_ttl_counts_from_the_last_read_and_a_sweep_leaves_no_orphan(s3, prefix):
    async def main():
        c = client(s3)
        layout = KeyLayout(prefix)
        policy = LifecyclePolicy(ttl_s=3.0)
        src = ObjectSource(c, layout, marks=ReadMarks(c, layout, policy))
        blocks = [blk(i) for i in range(3)]
        assert all(r.ok for r in await src.write(blocks, later()))
        s3.raw_put(f"{prefix}/~touch/ns/{b'gone'.hex()}", b"")  # a marker whose block is no longer there
        await asyncio.sleep(2.2)  # past TTL/2: a read now writes the block's marker
        [hit] = await src.read([blocks[1][0]], lambda i, m: memoryview(bytearray(m.size)), later())
        assert hit.is_hit
        deleted: list[BlockKey] = []
        sw = sweeper(c, prefix, policy, wall=lambda: time.time() + 1.5, on_deleted=deleted.extend)
        [report] = await sw.sweep_all(later())
        return blocks, report, deleted

    blocks, report, deleted = asyncio.run(main())
    assert report.swept and report.expired == 2 and report.kept == 1 and report.markers == 1
    assert set(deleted) == {blocks[0][0], blocks[2][0]}
    left = s3.keys(prefix + "/")
    assert sorted(left) == sorted([f"{prefix}/ns/{b'k1'.hex()}", f"{prefix}/~touch/ns/{b'k1'.hex()}",
                                   f"{prefix}/~lease/ns"]), left


def test_only_one_of_two_daemons_sweeps_a_namespace(s3, prefix):
    async def main():
        c = client(s3)
        src = ObjectSource(c, KeyLayout(prefix))
        await src.write([blk(i) for i in range(4)], later())
        far = lambda: time.time() + 100  # noqa: E731  everything expired
        a = sweeper(c, prefix, LifecyclePolicy(ttl_s=10), "a", far)
        b = sweeper(client(s3), prefix, LifecyclePolicy(ttl_s=10), "b", far)
        ra, rb = await asyncio.gather(a.sweep("ns", later()), b.sweep("ns", later()))
        return ra, rb, a.metrics, b.metrics

    ra, rb, ma, mb = asyncio.run(main())
    assert sorted([ra.swept, rb.swept]) == [False, True]
    assert ra.expired + rb.expired == 4  # each object deleted once, by the holder alone
    deletes = [m.requests.labels("delete", "ok")._value.get() for m in (ma, mb)]
    assert sorted(deletes) == [0, 1]
    assert s3.keys(prefix + "/") == [f"{prefix}/~lease/ns"]


def test_the_sweep_lease_is_taken_over_only_once_it_expires(s3, prefix):
    async def main():
        c, layout = client(s3), KeyLayout(prefix)
        a = SweepLease(c, layout, "a", 60.0)
        b = SweepLease(c, layout, "b", 60.0)
        taken = await a.acquire("ns", later())
        refused = await b.acquire("ns", later())
        renewed = await a.acquire("ns", later())
        late_b = SweepLease(c, layout, "b", 60.0, wall=lambda: time.time() + 120)
        late_c = SweepLease(c, layout, "c", 60.0, wall=lambda: time.time() + 120)
        raced = await asyncio.gather(late_b.acquire("ns", later()), late_c.acquire("ns", later()))
        a_after = await a.release("ns", later())
        return taken, refused, renewed, raced, a_after

    taken, refused, renewed, raced, a_after = asyncio.run(main())
    assert taken is not None and refused is None and renewed is not None
    assert sum(r is not None for r in raced) == 1  # both saw it expire; If-Match let one in
    assert a_after is False  # a's lease was taken: its release writes nothing


def test_the_quota_is_learned_from_the_lease_by_other_daemons(s3, prefix):
    async def main():
        c = client(s3)
        await ObjectSource(c, KeyLayout(prefix)).write([blk(i) for i in range(3)], later())
        await sweeper(c, prefix, LifecyclePolicy(quota_bytes={"ns": 1 << 20})).sweep("ns", later())
        other = SharedQuota({"ns": 1 << 20})
        await sweeper(client(s3), prefix, LifecyclePolicy(), "b", quota=other).refresh("ns", later())
        return other

    other = asyncio.run(main())
    assert other.used("ns") == sum(len(s3.raw_get(k)) for k in s3.keys(f"{prefix}/ns/"))
    other.admit(BlockKey("ns", b"x"), (1 << 20) - other.used("ns"))
    with pytest.raises(TierFull, match="namespace 'ns'.*stays in the local tiers"):
        other.admit(BlockKey("ns", b"y"), 1)


@pytest.fixture
def store(tmp_path, s3, prefix):
    made: list[TieredStore] = []

    def make(disk_bytes: int = 3 * MiB, edges=(), **options):
        environ = {"AWS_ACCESS_KEY_ID": s3_servers.ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": s3_servers.SECRET_KEY,
                   "HOME": str(tmp_path)}
        n = len(made)
        tier = ObjectTier.open(bucket=s3.bucket, prefix=prefix, endpoint=s3.endpoint, environ=environ,
                               retries=0, backoff_s=0.01, **options)
        tiers = [HostRamTier(4 * MiB, shm_dir=str(tmp_path), arena_name=f"life{n}"),
                 DiskTier(tmp_path / f"disk{n}", disk_bytes), tier]
        made.append(TieredStore(tiers, edges=edges,
                                limits=StoreLimits.from_settings(max_block_bytes=2 * MiB, demotion_threads=0)))
        return made[-1], tier

    yield make
    for s in made:
        s.close()


def put(store: TieredStore, i: int, ns: str = "q") -> BlockKey:
    data = value(i)
    key = BlockKey(ns, b"k%d" % i)
    store.put(key, data, BlockMeta(len(data), checksum(data)), time.monotonic() + 2.0)
    store.flush_demotions()
    return key


def test_a_full_quota_keeps_blocks_local_and_loses_none(store, s3, prefix):
    """Blocks written through to the bucket past their namespace's quota are refused before upload
    (TierFull, naming the namespace) and stay on disk; every block is still served."""
    st, tier = store(disk_bytes=16 * MiB, edges=[EdgePolicy(), EdgePolicy(write_through=True)],
                     namespace_quota_bytes={"q": 2 * MiB})
    keys = [put(st, i) for i in range(6)]
    wait_until(lambda: tier.writeback.queued_blocks == 0, what="uploads")
    assert tier._metrics.refused._value.get() > 0
    for i, k in enumerate(keys):
        got = st.get(k)
        assert got is not None and got[0] == value(i), k
    assert 0 < len(s3.keys(f"{prefix}/q/")) <= 2  # 2 MiB of 1 MiB blocks (the headers aside)
    data = value(99)
    with pytest.raises(TierFull, match="object quota of namespace 'q' is full"):
        tier.put(BlockKey("q", b"more"), data, BlockMeta(len(data), checksum(data)))
    tier.put(BlockKey("other", b"free"), data, BlockMeta(len(data), checksum(data)))  # other namespaces: no bound


def test_a_full_quota_pauses_uploads_of_its_namespace_only(store, s3, prefix):
    """Blocks evicted from disk (write-back) of a namespace past its quota stay local; blocks of
    another namespace written after keep going up to the bucket, and every block is served."""
    st, tier = store(disk_bytes=6 * MiB, namespace_quota_bytes={"q": 2 * MiB})
    full = [put(st, i, "q") for i in range(5)]  # 5 MiB through 4 MiB of RAM and 6 MiB of disk: 2 go up
    free = [put(st, 100 + i, "p") for i in range(12)]  # 12 MiB more: they must leave for the bucket
    wait_until(lambda: tier.writeback.queued_blocks == 0, what="uploads")
    assert tier._metrics.refused._value.get() > 0
    assert 0 < len(s3.keys(f"{prefix}/q/")) <= 2
    assert len(s3.keys(f"{prefix}/p/")) >= 12 - 7, "the other namespace's uploads paused too"  # 7 local slots left
    for i, k in list(enumerate(full)) + [(100 + i, k) for i, k in enumerate(free)]:
        got = st.get(k)
        assert got is not None and got[0] == value(i), k


def test_a_swept_block_leaves_the_store_and_its_index_holding(store, s3, prefix):
    st, tier = store(ttl_s=1.0, sweep_s=0.5)
    keys = [put(st, i, "t") for i in range(8)]
    wait_until(lambda: tier.writeback.queued_blocks == 0, what="uploads")
    in_bucket = [k for k in keys if (k, TierName.OBJECT) in set(st.holdings())]
    assert in_bucket
    wait_until(lambda: not s3.keys(f"{prefix}/t/"), what="the sweep to expire the blocks")
    wait_until(lambda: not any(t is TierName.OBJECT for _, t in st.holdings()), what="the store to forget them")


def test_exists_on_a_fresh_store_sees_blocks_only_the_bucket_has(store, s3, prefix):
    first, tier = store()
    keys = [put(first, i, "e") for i in range(8)]
    wait_until(lambda: tier.writeback.queued_blocks == 0, what="uploads")
    fresh, _ = store()
    names = set(s3.keys(f"{prefix}/e/"))
    leading = next((n for n, k in enumerate(keys) if f"{prefix}/e/{k.key.hex()}" not in names), len(keys))
    assert leading > 0
    assert fresh.exists("e", [k.key for k in keys]) == [TierName.OBJECT] * leading
