"""A full filesystem under the disk tier, on a real small tmpfs (issue: hardening, a full disk).

The daemon starts on a full filesystem and serves from RAM with the disk
tier marked degraded (log, metric, health, Stats) and recovers when space
comes back; the epoch still only grows; ``--disk-bytes`` larger than the
filesystem is bounded by what it holds; a disk that fills never costs an
acknowledged block: it stays in RAM, and a put that finds RAM full too is
refused with a retry delay. Each test mounts its own tmpfs (tests run as
root in CI) and is skipped, saying why, where mounting is not permitted.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.block import BlockKey, BlockMeta, checksum
from kvstore.client.sync import Client
from kvstore.errors import TierFull
from kvstore.fsops import Fault, FaultyFileOps
from kvstore.node import NodeIdentity
from kvstore.store import StoreLimits, TieredStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.ram import HostRamTier
from tests.support.small_filesystem import fill, tmpfs
from tests.support.store_blocks import Clock, MiB, value
from tests.support.wait import wait_until

BLOCK = 64 << 10


def put(store, i: int, ns: str = "m") -> None:
    data = value(i, BLOCK)
    store.put(BlockKey(ns, b"k%d" % i), data, BlockMeta(len(data), checksum(data)))


def health(target: str, service: str):
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_the_daemon_starts_on_a_full_disk_serves_from_ram_and_recovers_when_space_comes_back(
    make_daemon, tmp_path, caplog
):
    with tmpfs(tmp_path / "mnt", "2m") as mnt:
        NodeIdentity.start("n", mnt)  # an earlier run left its epoch, then the disk filled up
        before = NodeIdentity.start("n", mnt).epoch
        filler = fill(mnt)
        caplog.set_level(logging.WARNING)
        daemon = make_daemon(disk_dir=str(mnt))
        assert daemon.node.epoch > before, "the epoch grew although the disk is full"
        assert not (mnt / "epoch.tmp").exists(), "no temp file left behind"
        c = Client(daemon.target)
        c.put("m", b"k", value(1, BLOCK))
        assert c.get("m", b"k") == value(1, BLOCK), "served from RAM"
        disk = c.stats().tiers["disk"]
        assert str(mnt) in disk["degraded"] and "free space" in disk["degraded"]
        assert health(daemon.target, "strata.tier.disk") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert health(daemon.target, "") == health_pb2.HealthCheckResponse.SERVING
        assert daemon.metrics.registry.get_sample_value("strata_tier_degraded", {"tier": "disk"}) == 1
        assert any("disk tier degraded" in r.getMessage() and str(mnt) in r.getMessage() for r in caplog.records)

        filler.unlink()  # space comes back: the periodic check finds it
        wait_until(lambda: health(daemon.target, "strata.tier.disk") == health_pb2.HealthCheckResponse.SERVING,
                   what="the disk tier to recover")
        assert c.stats().tiers["disk"]["degraded"] == ""
        assert daemon.metrics.registry.get_sample_value("strata_tier_degraded", {"tier": "disk"}) == 0
        assert NodeIdentity.start("n", mnt).epoch > daemon.node.epoch
        c.close()


@pytest.mark.system
def test_an_epoch_that_cannot_be_written_at_all_is_the_clock_and_written_once_there_is_room(tmp_path):
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        filler = fill(mnt)  # a first start on a full disk: no epoch file to rewrite in place
        node = NodeIdentity.start("n", mnt)
        assert not node.persisted and node.epoch > 10**12, "the clock in milliseconds"
        assert not list(mnt.glob("epoch*")), "nothing half-written left"
        filler.unlink()
        assert node.persist(mnt)
        assert NodeIdentity.start("n", mnt).epoch > node.epoch


@pytest.mark.system
def test_disk_bytes_larger_than_the_filesystem_is_bounded_by_it(tmp_path, caplog):
    with tmpfs(tmp_path / "mnt", "2m") as mnt:
        caplog.set_level(logging.WARNING)
        tier = DiskTier(mnt / "blocks", 64 * MiB)
        try:
            stats = tier.stats()
            assert stats.capacity_bytes <= 2 * MiB < tier.capacity_bytes
            assert stats.degraded == ""
            [warning] = [r.getMessage() for r in caplog.records if "--disk-bytes" in r.getMessage()]
            assert str(64 * MiB) in warning and str(stats.capacity_bytes) in warning
        finally:
            tier.close()


def _store(tmp_path: Path, mnt: Path, ram_blocks: int, **limits) -> TieredStore:
    limits.setdefault("max_block_bytes", BLOCK)
    limits.setdefault("demotion_threads", 0)
    tiers = [HostRamTier(ram_blocks * BLOCK, shm_dir=str(tmp_path), arena_name="full"), DiskTier(mnt / "blocks", 64 * MiB)]
    return TieredStore(tiers, limits=StoreLimits.from_settings(**limits), clock=Clock())


@pytest.mark.system
def test_a_disk_that_fills_drops_no_block_while_ram_has_room(tmp_path):
    """300 acknowledged blocks, RAM room for all of them, headroom demotion pushing them down,
    and a 2 MiB disk that fills: every one of them is kept."""
    with tmpfs(tmp_path / "mnt", "2m") as mnt:
        store = _store(tmp_path, mnt, 320, high_watermark=0.5, low_watermark=0.4)
        try:
            for i in range(300):
                put(store, i)
                store.flush_demotions()
            lost = [i for i in range(300) if not store.exists("m", [b"k%d" % i])]
            assert lost == [], f"{len(lost)} of 300 acknowledged blocks were dropped"
            disk = store.tier_stats()[1]
            assert disk.blocks > 0 and disk.degraded, "the disk filled"
            assert store.metrics.demotions.labels("failed")._value.get() == 0
            for i in range(300):
                assert store.get(BlockKey("m", b"k%d" % i))[0] == value(i, BLOCK)
        finally:
            store.close()


@pytest.mark.system
def test_with_the_disk_full_and_ram_full_a_put_is_refused_not_accepted_and_dropped(tmp_path):
    """The filesystem under the disk tier is full (another writer's file) and RAM fills: puts beyond
    RAM get RESOURCE_EXHAUSTED with a retry delay; no acknowledged block is ever dropped."""
    with tmpfs(tmp_path / "mnt", "2m") as mnt:
        (mnt / "blocks").mkdir()
        fill(mnt)
        store = _store(tmp_path, mnt, 64)
        try:
            acked, refused = [], []
            for i in range(100):
                try:
                    put(store, i)
                except TierFull as err:
                    assert err.retry_after_s > 0 and "full" in str(err)
                    refused.append(i)
                else:
                    acked.append(i)
            assert refused, "RAM and disk are both full: some puts must be refused"
            lost = [i for i in acked if not store.exists("m", [b"k%d" % i])]
            assert lost == [], f"{len(lost)} acknowledged blocks were dropped"
            assert store.metrics.drops._value.get() == 0
        finally:
            store.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("threads", [0, 1], ids=["inline-demotion", "demotion-thread"])
@pytest.mark.parametrize("clock", ["frozen", "real"])
def test_a_put_that_finds_ram_full_and_the_disk_refusing_every_write_is_refused_not_spun_on(tmp_path, threads, clock):
    """Regression: the disk's filesystem refuses every write (ENOSPC, injected) and its full period
    is over by the next look (``tier_retry_s`` 0), so each round of the writer's wait demoted
    again and no demotion ever happened. With a frozen clock the put deadline never came and the
    wait spun forever; with a real one it spun, copy after failed copy, until the deadline. Now
    the writer counts rounds whose copies all ended without room: after a few it is refused,
    RESOURCE_EXHAUSTED with a retry delay, whatever the clock says."""
    ops = FaultyFileOps(Fault("write", 1, errno.ENOSPC, persist=True))
    tiers = [HostRamTier(16 * BLOCK, shm_dir=str(tmp_path), arena_name="spin"),
             DiskTier(tmp_path / "disk", 64 * MiB, ops=ops)]
    limits = StoreLimits.from_settings(max_block_bytes=BLOCK, demotion_threads=threads, tier_retry_s=0.0,
                                       put_wait_s=3600.0)
    store = TieredStore(tiers, limits=limits, **({"clock": Clock()} if clock == "frozen" else {}))
    try:
        for i in range(16):
            put(store, i)
        with pytest.raises(TierFull) as refused:
            put(store, 16)
        assert refused.value.retry_after_s > 0
        attempts = store.metrics.demotions.labels("full")._value.get()
        assert 0 < attempts <= 4 * 16, f"{attempts} copies down were tried for one refused put"
        assert all(store.exists("m", [b"k%d" % i]) for i in range(16)), "no acknowledged block was dropped"
        assert store.metrics.drops._value.get() == 0
    finally:
        store.close()
