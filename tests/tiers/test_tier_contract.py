"""The contract every tier keeps (kvstore/tiers/base.py), run against each tier.

One suite, one ``tier`` fixture parametrized over factories: a new tier joins
by adding a factory to ``FACTORIES``. Tests only use the Tier API, and assert
byte accounting loosely (``used`` may round up: the host tier counts whole
pages, the disk tier adds a header), so they hold for every implementation.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from kvstore.block import BlockKey, BlockMeta, checksum
from kvstore.errors import BlockTooLarge, CorruptBlock, TierFull
from kvstore.tiers.base import Tier

CAPACITY = 64 << 20


def make_host(tmp_path: Path, capacity: int) -> Tier:
    from kvstore.tiers.ram import HostRamTier

    return HostRamTier(capacity, shm_dir=str(tmp_path), arena_name="strata-test-arena")


def make_disk(tmp_path: Path, capacity: int) -> Tier:
    from kvstore.tiers.disk import DiskTier

    return DiskTier(tmp_path / "disk", capacity)


# The GPU tier runs on the ``host`` stand-in for device memory here; the device check
# (benchmarks/gpu_check.py) runs this suite again with STRATA_TEST_GPU_MEMORY=cuda.
GPU_MEMORY = os.environ.get("STRATA_TEST_GPU_MEMORY", "host")


def make_gpu(tmp_path: Path, capacity: int) -> Tier:
    from kvstore.tiers.gpu import GpuTier

    options = {"shm_dir": str(tmp_path)} if GPU_MEMORY == "host" else {}
    return GpuTier(capacity, devices=(0,), memory=GPU_MEMORY, **options)


FACTORIES: dict[str, Callable[[Path, int], Tier]] = {"host": make_host, "disk": make_disk, "gpu": make_gpu}


@pytest.fixture(params=sorted(FACTORIES))
def tier_factory(request, tmp_path):
    """A function capacity -> fresh tier; every tier it made is closed afterwards."""
    made: list[Tier] = []

    def make(capacity: int = CAPACITY) -> Tier:
        home = tmp_path / f"tier{len(made)}"
        home.mkdir()
        made.append(FACTORIES[request.param](home, capacity))
        return made[-1]

    yield make
    for t in made:
        t.close()


@pytest.fixture
def tier(tier_factory) -> Tier:
    return tier_factory()


def block(n: int, seed: int = 0, parent: bytes | None = None, layout: str = "") -> tuple[bytes, BlockMeta]:
    data = random.Random(seed).randbytes(n)
    return data, BlockMeta(n, checksum(data), parent, layout)


def key(name: str, namespace: str = "model-a") -> BlockKey:
    return BlockKey.checked(namespace, name.encode())


@pytest.mark.parametrize("size", [4096, 4097, 64 << 10, 1 << 20, (3 << 20) + 17])
def test_round_trip_sizes(tier, size):
    data, meta = block(size, seed=size)
    assert tier.put(key("k"), data, meta) is True
    assert tier.get(key("k")) == data
    assert tier.meta(key("k")) == meta


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview], ids=lambda w: w.__name__)
def test_put_accepts_any_bytes_like(tier, wrap):
    data, meta = block(10_000)
    assert tier.put(key("k"), wrap(data), meta)
    assert tier.get(key("k")) == data


def test_meta_preserved(tier):
    data, meta = block(5000, parent=b"\x00parent-key", layout="f16[2,32,8,128]")
    tier.put(key("child"), data, meta)
    got = tier.meta(key("child"))
    assert got == meta
    assert got.parent == b"\x00parent-key" and got.layout == "f16[2,32,8,128]"
    root_data, root_meta = block(100, seed=1)
    tier.put(key("root"), root_data, root_meta)
    assert tier.meta(key("root")).parent is None


def test_contains_delete_and_misses(tier):
    data, meta = block(4096)
    assert not tier.contains(key("k"))
    assert tier.get(key("k")) is None
    assert tier.meta(key("k")) is None
    tier.put(key("k"), data, meta)
    assert tier.contains(key("k"))
    assert tier.delete(key("k")) is True
    assert tier.delete(key("k")) is False
    assert not tier.contains(key("k"))
    assert tier.get(key("k")) is None
    tier.touch(key("k"))  # the store may touch a block another thread just evicted


def test_repeated_put_is_a_no_op(tier):
    data, meta = block(8192)
    assert tier.put(key("k"), data, meta) is True
    before = tier.stats()
    assert tier.put(key("k"), data, meta) is False
    assert tier.stats() == before
    assert tier.get(key("k")) == data


@pytest.mark.parametrize("fault", ["checksum", "size"])
def test_put_of_mismatched_bytes_raises_and_stores_nothing(tier, fault):
    data, meta = block(8192)
    if fault == "checksum":
        meta = BlockMeta(meta.size, meta.checksum ^ 1)
    else:
        data = data[:-1]
    before = tier.stats()
    with pytest.raises(CorruptBlock):
        tier.put(key("k"), data, meta)
    assert not tier.contains(key("k"))
    assert tier.stats() == before
    # the failed put left no reservation behind: the key can still be stored
    good, good_meta = block(8192)
    assert tier.put(key("k"), good, good_meta)


def test_tier_full_when_out_of_room(tier_factory):
    tier = tier_factory(1 << 20)
    size = 100_000
    stored = []
    with pytest.raises(TierFull):
        for i in range(tier.capacity_bytes // size + 2):
            data, meta = block(size, seed=i)
            before = tier.stats()
            tier.put(key(f"k{i}"), data, meta)
            stored.append((key(f"k{i}"), data))
    assert stored, "at least one block fits"
    after = tier.stats()
    assert after == before
    assert after.blocks == len(stored)
    assert not tier.contains(key(f"k{len(stored)}"))
    # evicting one makes room again, and nothing stored was harmed
    tier.delete(stored[0][0])
    data, meta = block(size, seed=len(stored))
    assert tier.put(key(f"k{len(stored)}"), data, meta)
    for k, d in stored[1:]:
        assert tier.get(k) == d


def test_block_larger_than_the_tier_is_refused(tier_factory):
    tier = tier_factory(1 << 20)
    data, meta = block(2 << 20)
    with pytest.raises(BlockTooLarge):
        tier.put(key("huge"), data, meta)
    assert tier.stats().blocks == 0 and tier.stats().used_bytes == 0


def test_stats_accounting(tier):
    empty = tier.stats()
    assert (empty.used_bytes, empty.blocks, empty.capacity_bytes) == (0, 0, tier.capacity_bytes)
    assert tier.capacity_bytes <= CAPACITY
    sizes = [4096, 5000, 70_000, 1 << 20]
    footprints = []
    for i, n in enumerate(sizes):
        before = tier.stats().used_bytes
        data, meta = block(n, seed=i)
        tier.put(key(f"k{i}"), data, meta)
        footprints.append(tier.stats().used_bytes - before)
        assert footprints[-1] >= n
    s = tier.stats()
    assert s.blocks == len(sizes)
    assert s.used_bytes == sum(footprints) <= s.capacity_bytes
    tier.delete(key("k1"))
    assert tier.stats().used_bytes == s.used_bytes - footprints[1]
    assert tier.stats().blocks == len(sizes) - 1
    for i in (0, 2, 3):
        tier.delete(key(f"k{i}"))
    assert tier.stats() == empty


def test_lru_order_follows_touch_and_get(tier):
    for name in "abcd":
        data, meta = block(4096, seed=ord(name))
        tier.put(key(name), data, meta)
    assert list(tier.lru()) == [key(n) for n in "abcd"]
    tier.touch(key("a"))
    assert list(tier.lru()) == [key(n) for n in "bcda"]
    tier.get(key("b"))
    assert list(tier.lru()) == [key(n) for n in "cdab"]
    tier.meta(key("c"))
    tier.contains(key("c"))
    assert list(tier.lru()) == [key(n) for n in "cdab"], "meta and contains are not uses"
    snapshot = tier.lru()
    tier.delete(key("c"))
    assert list(snapshot) == [key(n) for n in "cdab"], "lru() is a snapshot"
    assert list(tier.lru()) == [key(n) for n in "dab"]


def test_namespaces_are_isolated(tier):
    a, b = key("same", "tenant-a"), key("same", "tenant-b")
    data_a, meta_a = block(4096, seed=1)
    data_b, meta_b = block(6000, seed=2, layout="other")
    assert tier.put(a, data_a, meta_a)
    assert not tier.contains(b)
    assert tier.put(b, data_b, meta_b), "same key bytes in another namespace is another block"
    assert tier.get(a) == data_a and tier.get(b) == data_b
    assert tier.meta(b) == meta_b
    assert tier.stats().blocks == 2
    tier.delete(a)
    assert tier.get(a) is None and tier.get(b) == data_b
