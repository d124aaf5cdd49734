"""The object tier at the bottom of a real store's chain (RAM, disk, then a moto bucket).

Write policies on the edge above it (back, through, off), read-through from
a store with empty local tiers, the write-back queue when S3 is down (puts
never wait; the oldest queued blocks are dropped and counted; the rest go
up once S3 is back), blocks the store lists but the bucket lost, corrupt
objects, and two stores writing the same blocks.
"""

from __future__ import annotations

import hashlib

import pytest

from kvstore.block import BlockKey, BlockMeta, TierName, checksum
from kvstore.remote.object.format import header_length
from kvstore.remote.object.metrics import ObjectMetrics
from kvstore.remote.object.writeback import WriteBackLimits
from kvstore.store import EdgePolicy, StoreLimits, TieredStore
from kvstore.tiers import open_tier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.object import ObjectTier
from kvstore.tiers.ram import HostRamTier
from tests.support import s3_servers
from tests.support.store_blocks import Clock, MiB, value
from tests.support.wait import wait_until

pytestmark = pytest.mark.system

HOST, DISK, OBJECT = TierName.HOST, TierName.DISK, TierName.OBJECT
BLOCKS = 12  # 12 MiB through a 4 MiB RAM tier and a 3 MiB disk tier: most end up in the bucket


@pytest.fixture
def prefix(request) -> str:
    return "tier-" + hashlib.blake2b(request.node.nodeid.encode(), digest_size=6).hexdigest()


@pytest.fixture
def made(tmp_path):
    """Build stores over ram -> disk -> object; each gets RAM and disk of its own. Closed at the end."""
    stores: list[TieredStore] = []

    def make(s3, prefix: str, *, endpoint: str = "", edges=(), metrics=None, **tier_options):
        n = len(stores)
        environ = {"AWS_ACCESS_KEY_ID": s3_servers.ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": s3_servers.SECRET_KEY,
                   "HOME": str(tmp_path)}
        tier = ObjectTier.open(bucket=s3.bucket, prefix=prefix, endpoint=endpoint or s3.endpoint, environ=environ,
                               metrics=metrics, retries=0, backoff_s=0.01, **tier_options)
        tiers = [HostRamTier(4 * MiB, shm_dir=str(tmp_path), arena_name=f"obj{n}"),
                 DiskTier(tmp_path / f"disk{n}", 3 * MiB), tier]
        store = TieredStore(tiers, edges=edges, clock=Clock(),
                            limits=StoreLimits.from_settings(max_block_bytes=2 * MiB, demotion_threads=0))
        stores.append(store)
        return store, tier

    yield make
    for s in stores:
        s.close()


def put(store: TieredStore, i: int, ns: str = "m") -> None:
    data = value(i)
    store.put(BlockKey(ns, b"k%d" % i), data, BlockMeta(len(data), checksum(data)))
    store.flush_demotions()


def uploaded(tier: ObjectTier) -> bool:
    return tier.writeback.queued_blocks == 0


def sample(metrics: ObjectMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_blocks_evicted_from_disk_land_in_the_bucket_and_a_store_with_empty_tiers_reads_them(s3, prefix, made):
    writer, tier = made(s3, prefix)
    for i in range(BLOCKS):
        put(writer, i)
    wait_until(lambda: uploaded(tier), what="the write-back queue to empty")
    in_bucket = [i for i in range(BLOCKS) if writer.exists("m", [b"k%d" % i]) == [OBJECT]]
    assert in_bucket, "nothing left the disk for the bucket"
    assert len(s3.keys(prefix + "/")) >= len(in_bucket)
    assert tier.writeback.outcomes["uploaded"] >= len(in_bucket) and tier.writeback.outcomes["dropped"] == 0

    reader, _ = made(s3, prefix)  # another node, or this one after a reschedule: empty RAM and disk
    for i in in_bucket:
        data, meta, where = reader.get(BlockKey("m", b"k%d" % i))
        assert data == value(i) and where is OBJECT and meta.checksum == checksum(value(i))
        assert reader.exists("m", [b"k%d" % i]) == [HOST], "promoted into RAM"
    assert reader.get(BlockKey("m", b"never-written")) is None

    unpromoted, _ = made(s3, prefix, edges=[EdgePolicy(), EdgePolicy(promote=False)])  # [tiers.object] promote = false
    i = in_bucket[0]
    assert unpromoted.get(BlockKey("m", b"k%d" % i))[0] == value(i)
    assert unpromoted.exists("m", [b"k%d" % i]) == [OBJECT], "copied up though the edge says not to"


def test_a_block_waiting_for_upload_is_served_from_the_queue(s3, prefix, made):
    proxy = s3.proxy()
    proxy.down = True
    store, tier = made(s3, prefix, endpoint=proxy.endpoint,
                       writeback=WriteBackLimits(attempts=1000, pause_s=0.05, max_pause_s=0.1, drain_s=0))
    for i in range(BLOCKS):
        put(store, i)
    waiting = [i for i in range(BLOCKS) if store.exists("m", [b"k%d" % i]) == [OBJECT]]
    assert waiting and tier.writeback.queued_blocks == len(waiting)
    for i in waiting:
        data, _, where = store.get(BlockKey("m", b"k%d" % i))
        assert data == value(i) and where is OBJECT
    proxy.down = False
    wait_until(lambda: uploaded(tier), what="the queue to drain once S3 is back")
    proxy.close()


def test_when_s3_is_down_puts_never_wait_and_the_oldest_queued_blocks_are_dropped(s3, prefix, made):
    proxy = s3.proxy()
    proxy.down = True
    metrics = ObjectMetrics()
    store, tier = made(s3, prefix, endpoint=proxy.endpoint, metrics=metrics,
                       writeback=WriteBackLimits(max_blocks=3, attempts=1000, pause_s=0.05, max_pause_s=0.1,
                                                 drain_s=0))
    for i in range(BLOCKS):
        put(store, i)  # none of these waits on S3 or fails
    assert tier.writeback.queued_blocks <= 3
    dropped = sample(metrics, "strata_object_writeback_total", outcome="dropped")
    assert dropped > 0 and dropped == tier.writeback.outcomes["dropped"]
    # The first upload fails on the tier's own loop, a moment after the puts.
    wait_until(lambda: tier.stats().degraded.startswith("uploads to"), what="the tier to say why it is not doing its job")
    lost = []
    for i in range(BLOCKS):
        got = store.get(BlockKey("m", b"k%d" % i))  # local tiers and the queue answer; S3 is not waited for
        if got is None:
            lost.append(i)
        else:
            assert got[0] == value(i), "a wrong byte is never served"
    assert len(lost) == dropped
    proxy.down = False
    wait_until(lambda: uploaded(tier), what="the queue to drain once S3 is back")
    assert tier.stats().degraded == ""
    assert len(s3.keys(prefix + "/")) == tier.writeback.outcomes["uploaded"] > 0
    for i in lost:  # S3 answers now: a block the queue dropped is a miss there, and the store forgets it
        assert store.exists("m", [b"k%d" % i]) == [OBJECT]
        assert store.get(BlockKey("m", b"k%d" % i)) is None
        assert store.exists("m", [b"k%d" % i]) == [], "a block the bucket does not have is still offered"
    proxy.close()


def test_write_through_uploads_a_block_as_soon_as_it_is_stored(s3, prefix, made):
    store, tier = made(s3, prefix, edges=[EdgePolicy(write_through=True), EdgePolicy(write_through=True)])
    put(store, 1)
    wait_until(lambda: uploaded(tier), what="the write-through upload")
    assert s3.keys(prefix + "/") == [f"{prefix}/m/{b'k1'.hex()}"]
    assert store.exists("m", [b"k1"]) == [HOST], "the copies above stay"


def test_write_policy_off_uploads_nothing_but_still_reads_through(s3, prefix, made):
    writer, tier = made(s3, prefix)
    put(writer, 0)
    for i in range(1, BLOCKS):
        put(writer, i)
    wait_until(lambda: uploaded(tier), what="the writer's uploads")
    in_bucket = len(s3.keys(prefix + "/"))
    off, _ = made(s3, prefix, edges=[EdgePolicy(), EdgePolicy(demote=False)])
    for i in range(100, 100 + BLOCKS):
        put(off, i)
    assert len(s3.keys(prefix + "/")) == in_bucket, "write_policy off sent blocks up"
    shared = next(i for i in range(BLOCKS) if writer.exists("m", [b"k%d" % i]) == [OBJECT])
    assert off.get(BlockKey("m", b"k%d" % shared))[0] == value(shared)


def test_two_stores_writing_the_same_blocks_make_one_object_each(s3, prefix, made):
    one, tier_one = made(s3, prefix)
    two, tier_two = made(s3, prefix)
    for i in range(BLOCKS):
        put(one, i)
        put(two, i)
    wait_until(lambda: uploaded(tier_one) and uploaded(tier_two), what="both queues to drain")
    keys = s3.keys(prefix + "/")
    assert len(keys) == len(set(keys)) <= BLOCKS
    outcomes = [t.writeback.outcomes for t in (tier_one, tier_two)]
    assert sum(o["uploaded"] for o in outcomes) == len(keys), "a block was uploaded twice"
    assert sum(o["present"] for o in outcomes) > 0


def test_a_corrupt_object_is_a_miss_deleted_from_the_bucket_and_counted(s3, prefix, made):
    writer, tier = made(s3, prefix)
    for i in range(BLOCKS):
        put(writer, i)
    wait_until(lambda: uploaded(tier), what="the uploads")
    victim = next(i for i in range(BLOCKS) if writer.exists("m", [b"k%d" % i]) == [OBJECT])
    path = f"{prefix}/m/{(b'k%d' % victim).hex()}"
    obj = bytearray(s3.raw_get(path))
    obj[header_length(obj) + 100] ^= 0x01
    s3.raw_put(path, bytes(obj))
    reader, _ = made(s3, prefix)
    assert reader.get(BlockKey("m", b"k%d" % victim)) is None, "a corrupt byte was served"
    assert reader.metrics.corrupt.labels("object")._value.get() == 1
    assert s3.raw_get(path) is None
    assert writer.get(BlockKey("m", b"k%d" % victim)) is None, "the writer's listed copy is gone too: forgotten"
    assert writer.exists("m", [b"k%d" % victim]) == []


def test_the_tier_registry_builds_the_object_tier(s3, prefix, tmp_path):
    tier = open_tier("object", bucket=s3.bucket, prefix=prefix, endpoint=s3.endpoint,
                     environ={"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b", "HOME": str(tmp_path)})
    try:
        assert tier.name is OBJECT and tier.remote and not tier.persistent
        assert tier.source == f"s3://{s3.bucket}/{prefix}"
    finally:
        tier.close()
