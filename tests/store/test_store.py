"""TieredStore over real tiers: placement, demotion, promotion, chains, pins, leases, faults."""

from __future__ import annotations

import subprocess

import pytest

from kvstore.block import BlockKey, BlockMeta, TierName, checksum
from kvstore.errors import (
    BlockTooLarge,
    CorruptBlock,
    InvalidArgument,
    InvalidKey,
    LeaseExpired,
    SlotAlreadyCommitted,
    TierFull,
    UnknownLease,
    UnknownNamespace,
)
from kvstore.store.tiered import StoreLimits, TieredStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.ram import HostRamTier
from tests.support.store_blocks import Clock, MiB, value

HOST, DISK = TierName.HOST, TierName.DISK


def meta_of(data: bytes, parent: bytes | None = None, layout: str = "") -> BlockMeta:
    return BlockMeta(len(data), checksum(data), parent, layout)


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def make_store(tmp_path, clock):
    stores = []

    def make(ram_mib: int = 8, disk_mib: int | None = 32, disk_dir=None, **limits) -> TieredStore:
        limits.setdefault("max_block_bytes", 2 * MiB)
        limits.setdefault("demotion_threads", 0)
        ram = HostRamTier(ram_mib * MiB, shm_dir=str(tmp_path), arena_name=f"arena{len(stores)}")
        disk = DiskTier(disk_dir or tmp_path / f"disk{len(stores)}", disk_mib * MiB) if disk_mib else None
        store = TieredStore([ram] + ([disk] if disk else []), limits=StoreLimits.from_settings(**limits), clock=clock)
        stores.append(store)
        return store

    yield make
    for s in stores:
        s.close()


def put(store: TieredStore, ns: str, key: bytes, data: bytes, parent: bytes | None = None):
    return store.put(BlockKey(ns, key), data, meta_of(data, parent))


def test_put_get_round_trip_and_repeat_is_noop(make_store):
    store = make_store()
    assert put(store, "m", b"a", value(1)) == (True, HOST)
    assert put(store, "m", b"a", value(1)) == (False, HOST)
    data, meta, tier = store.get(BlockKey("m", b"a"))
    assert data == value(1) and tier is HOST and meta.size == MiB


def test_miss_is_an_answer(make_store):
    store = make_store()
    put(store, "m", b"a", value(1))
    assert store.get(BlockKey("m", b"zz")) is None
    assert store.exists("m", [b"zz"]) == []


def test_namespaces_isolate(make_store):
    store = make_store()
    put(store, "tenant-a", b"k", value(1))
    put(store, "tenant-b", b"x", value(2))
    assert store.get(BlockKey("tenant-b", b"k")) is None
    assert store.exists("tenant-b", [b"k"]) == []
    assert store.delete("tenant-b", [b"k"]) == 0
    lease, missing = store.pin("tenant-b", [b"k"])
    assert missing == [b"k"] and lease.keys == []
    assert store.stats("tenant-b").blocks == 1
    with pytest.raises(UnknownNamespace, match="unknown to this daemon"):
        store.get(BlockKey("tenant-c", b"k"))


def test_bad_input_is_refused_with_reason(make_store):
    store = make_store()
    with pytest.raises(BlockTooLarge, match="split the value"):
        put(store, "m", b"big", value(1, 3 * MiB))
    with pytest.raises(InvalidKey, match="empty"):
        store.exists("m", [b""])
    with pytest.raises(InvalidArgument, match="declares"):
        store.put(BlockKey("m", b"k"), value(1), BlockMeta(10, 0))
    with pytest.raises(CorruptBlock, match="do not match"):
        store.put(BlockKey("m", b"k"), value(1), BlockMeta(MiB, 12345))
    assert store.stats().tiers[0].used_bytes == 0  # nothing leaked


def test_ram_pressure_demotes_to_disk_and_reads_promote(make_store):
    store = make_store(ram_mib=8)
    for i in range(20):
        put(store, "m", b"k%d" % i, value(i))
    store.flush_demotions()
    ram, disk = store.tier_stats()
    assert ram.used_bytes <= ram.capacity_bytes
    assert disk.blocks >= 12  # nothing was dropped: it went down a tier
    for i in range(20):
        data, _, tier = store.get(BlockKey("m", b"k%d" % i))
        assert data == value(i)
    assert store.metrics.promotions._value.get() > 0
    assert store.metrics.demotions.labels("ok")._value.get() >= 12


def test_without_disk_eviction_drops_lru(make_store):
    store = make_store(ram_mib=4, disk_mib=None)
    for i in range(10):
        put(store, "m", b"k%d" % i, value(i))
    present = [i for i in range(10) if store.get(BlockKey("m", b"k%d" % i))]
    assert present == list(range(6, 10)) or len(present) == 4
    assert 9 in present


def test_parent_outlives_children_under_pressure(make_store):
    store = make_store(ram_mib=4, disk_mib=None)
    chain = [b"c%d" % i for i in range(3)]
    parent = None
    for i, key in enumerate(chain):
        put(store, "m", key, value(i), parent)
        parent = key
    for i in range(10):  # unrelated blocks push the chain out
        put(store, "m", b"x%d" % i, value(100 + i))
    # Whatever of the chain survives is a prefix: never a child without its parent.
    present = store.exists("m", chain)
    held = [store.get(BlockKey("m", k)) is not None for k in chain]
    assert held == [True] * len(present) + [False] * (len(chain) - len(present))


def test_pins_protect_and_expire(make_store, clock):
    store = make_store(ram_mib=4, disk_mib=None, pin_lease_s=10)
    put(store, "m", b"keep", value(1))
    lease, missing = store.pin("m", [b"keep"])
    assert not missing
    for i in range(10):
        put(store, "m", b"x%d" % i, value(i + 2))
    assert store.get(BlockKey("m", b"keep"))[0] == value(1)
    clock.now += 11  # the pin's lease ends by itself
    for i in range(10, 20):
        put(store, "m", b"x%d" % i, value(i + 2))
    assert store.get(BlockKey("m", b"keep")) is None
    assert store.unpin(lease.id) is False


def tiers_of(store: TieredStore, ns: str, key: bytes) -> set[TierName]:
    """The tiers the store's holdings name for a block (its best one)."""
    return {t for k, t in store.holdings() if k == BlockKey(ns, key)}


def test_place_demotes_out_of_ram_and_warms_back_in_keeping_the_bytes(make_store):
    store = make_store(ram_mib=8, disk_mib=32)
    for i in range(3):
        put(store, "m", b"k%d" % i, value(i))
    lease, _ = store.pin("m", [b"k2"])
    placed = store.place("m", [b"k0", b"k1", b"k2", b"absent"], warm=False)
    assert (placed.placed, placed.missing, placed.pinned) == (2, [b"absent"], 1)
    assert [tiers_of(store, "m", k) for k in (b"k0", b"k1", b"k2")] == [{DISK}, {DISK}, {HOST}]
    assert store.place("m", [b"k0"], warm=False).placed == 1  # already below: nothing to do
    placed = store.place("m", [b"k0", b"absent"], warm=True)
    assert (placed.placed, placed.missing) == (1, [b"absent"]) and HOST in tiers_of(store, "m", b"k0")
    assert store.get(BlockKey("m", b"k0"))[0] == value(0) and store.get(BlockKey("m", b"k1"))[0] == value(1)
    store.unpin(lease.id)


def test_place_without_a_tier_below_is_refused_with_the_fix(make_store):
    store = make_store(disk_mib=None)
    put(store, "m", b"k", value(1))
    with pytest.raises(InvalidArgument, match="no local tier below"):
        store.place("m", [b"k"], warm=False)
    assert store.place("m", [b"k"], warm=True).placed == 1


def test_a_pin_finding_nothing_takes_no_lease(make_store):
    # Engines pin to look up (vLLM's tier, LMCache's L2): a cold lookup must not hold a lease slot
    # for its whole lease, or a burst of misses fills the lease table.
    store = make_store(ram_mib=4, disk_mib=None, pin_lease_s=60)
    put(store, "m", b"there", value(1))
    for i in range(50):
        lease, missing = store.pin("m", [b"absent%d" % i])
        assert (lease.id, missing) == (0, [b"absent%d" % i])
    assert store.stats().active_leases == 0
    assert store.unpin(0) is False
    lease, missing = store.pin("m", [b"there", b"absent"])
    assert lease.id and missing == [b"absent"] and store.stats().active_leases == 1


def test_all_pinned_is_resource_exhausted_with_retry(make_store):
    store = make_store(ram_mib=4, disk_mib=None)
    for i in range(4):
        put(store, "m", b"k%d" % i, value(i))
    store.pin("m", [b"k%d" % i for i in range(4)])
    with pytest.raises(TierFull) as info:
        put(store, "m", b"more", value(9))
    assert info.value.retry_after_s > 0
    assert "unpin" in str(info.value)


def test_slots_commit_once_and_expire(make_store, clock):
    store = make_store(lease_s=5)
    data = value(7)
    [grant] = store.allocate("m", [(b"s", len(data), None, "fp16")])
    view = store.head.view(grant.offset, grant.size)
    view[:] = data
    view.release()
    assert store.commit([(grant.slot_id, checksum(data))]) == [(BlockKey("m", b"s"), True, HOST)]
    with pytest.raises(SlotAlreadyCommitted):
        store.commit([(grant.slot_id, checksum(data))])
    with pytest.raises(UnknownLease, match="never issued"):
        store.commit([(424242, 0)])
    got, meta, _ = store.get(BlockKey("m", b"s"))
    assert got == data and meta.layout == "fp16"
    # a slot left open past its lease is reclaimed, and a late commit is refused
    used = store.tier_stats()[0].used_bytes
    [late] = store.allocate("m", [(b"late", MiB, None, "")])
    assert store.tier_stats()[0].used_bytes == used + MiB
    clock.now += 6
    store.expire_leases()
    with pytest.raises(LeaseExpired):
        store.commit([(late.slot_id, 0)])
    # its extent is held a while (its writer may still be copying), then given back
    assert store.tier_stats()[0].used_bytes == used + MiB
    clock.now += store.limits.lapsed_slot_hold_s
    store.expire_leases()
    assert store.tier_stats()[0].used_bytes == used


def test_a_writer_late_into_its_lapsed_slot_destroys_no_other_tenants_block(make_store, clock):
    """A same-host writer copies into its slot with no lock of the daemon's; one that stalled past its
    lease and then finishes its copy must land in an extent no other block has been given."""
    store = make_store(ram_mib=8, disk_mib=None, lease_s=1, lapsed_slot_hold_s=10)
    [stalled] = store.allocate("tenant-a", [(b"slow", MiB, None, "")])
    clock.now += 2
    store.expire_leases()  # A's lease ran out: A is still mid-copy
    theirs = {b"b%d" % i: value(100 + i, MiB) for i in range(4)}
    for key, data in theirs.items():
        put(store, "tenant-b", key, data)
    late = store.head.view(stalled.offset, stalled.size)
    late[:] = b"\xaa" * stalled.size  # the stalled copy lands
    late.release()
    with pytest.raises(LeaseExpired):
        store.commit([(stalled.slot_id, checksum(b"\xaa" * MiB))])
    for key, data in theirs.items():
        got, _, _ = store.get(BlockKey("tenant-b", key))
        assert got == data, key
    held = store.tier_stats()[0].used_bytes
    clock.now += 10
    store.expire_leases()  # the hold is over: the extent is anyone's again
    assert store.tier_stats()[0].used_bytes == held - MiB


def test_commit_of_wrong_bytes_is_data_loss_and_frees_slot(make_store):
    store = make_store()
    used = store.tier_stats()[0].used_bytes
    [grant] = store.allocate("m", [(b"s", MiB, None, "")])
    with pytest.raises(CorruptBlock, match="write the blocks again"):
        store.commit([(grant.slot_id, 99)])
    assert store.tier_stats()[0].used_bytes == used
    assert store.get(BlockKey("m", b"s")) is None


def test_read_lease_expiry_is_reported_on_release(make_store, clock):
    store = make_store(lease_s=2)
    put(store, "m", b"a", value(1))
    [loc] = store.lookup("m", [b"a"])
    assert store.stats().pinned_blocks == 1
    clock.now += 3
    assert store.release([loc.lease_id]) == [False]
    assert store.stats().pinned_blocks == 0
    [loc] = store.lookup("m", [b"a"])
    assert store.release([loc.lease_id]) == [True]


def test_lookup_promotes_disk_blocks_into_the_arena(make_store):
    store = make_store(ram_mib=4)
    for i in range(8):
        put(store, "m", b"k%d" % i, value(i))
    store.flush_demotions()
    on_disk = [i for i in range(8) if store.exists("m", [b"k%d" % i]) == [DISK]]
    assert on_disk
    [loc] = store.lookup("m", [b"k%d" % on_disk[0]])
    assert loc.tier is DISK and loc.lease_id
    view = store.head.view(loc.offset, loc.meta.size)
    assert bytes(view) == value(on_disk[0])
    view.release()
    store.release([loc.lease_id])


def test_deleting_a_block_being_read_waits_for_the_reader(make_store):
    store = make_store()
    put(store, "m", b"a", value(1))
    [loc] = store.lookup("m", [b"a"])
    assert store.delete("m", [b"a"]) == 1
    assert store.get(BlockKey("m", b"a")) is None  # invisible at once
    view = store.head.view(loc.offset, loc.meta.size)
    assert bytes(view) == value(1)  # but its bytes stay until the lease ends
    view.release()
    used = store.tier_stats()[0].used_bytes
    assert store.release([loc.lease_id]) == [True]
    assert store.tier_stats()[0].used_bytes == used - MiB


def test_corrupt_disk_block_is_dropped_never_returned(make_store, tmp_path):
    store = make_store(ram_mib=4, disk_dir=tmp_path / "disk")
    for i in range(8):
        put(store, "m", b"k%d" % i, value(i))
    store.flush_demotions()
    victim = next(i for i in range(8) if store.exists("m", [b"k%d" % i]) == [DISK])
    files = [p for p in (tmp_path / "disk").rglob("*") if p.is_file() and p.stat().st_size > MiB]
    for path in files:  # flip the last byte of every block file's payload
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(raw)
    with pytest.raises(CorruptBlock):
        store.get(BlockKey("m", b"k%d" % victim))
    assert store.get(BlockKey("m", b"k%d" % victim)) is None  # dropped, now a miss
    assert store.metrics.corrupt.labels("disk")._value.get() >= 1


def test_restart_recovers_disk_blocks_and_chains(make_store, tmp_path):
    disk_dir = tmp_path / "persist"
    store = make_store(ram_mib=4, disk_dir=disk_dir)
    parent = None
    for i in range(8):
        put(store, "m", b"c%d" % i, value(i), parent)
        parent = b"c%d" % i
    store.flush_demotions()
    on_disk = store.tier_stats()[1].blocks
    store.close()
    again = make_store(ram_mib=4, disk_dir=disk_dir)
    assert again.namespaces() == ["m"]
    assert again.stats().blocks == on_disk
    assert again.tier_stats()[1].blocks == on_disk


@pytest.mark.system
def test_disk_full_keeps_serving_from_ram(make_store, tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill ({r.stderr.strip()}); needs root")
    try:
        # The disk tier believes it has 64 MiB; the filesystem holds 3 MiB.
        store = make_store(ram_mib=4, disk_mib=64, disk_dir=mnt)
        for i in range(12):
            put(store, "m", b"k%d" % i, value(i))
            store.flush_demotions()
        # A full filesystem is a full tier, never a failing one: the tier holds what the filesystem
        # can, and evicts its least recently used blocks like a tier at its configured size.
        assert store.metrics.tier_errors.labels("disk")._value.get() == 0
        assert store.metrics.demotions.labels("failed")._value.get() == 0
        disk = store.tier_stats()[1]
        assert disk.used_bytes <= disk.capacity_bytes <= 3 * MiB
        assert disk.blocks >= 1
        assert store.get(BlockKey("m", b"k11"))[0] == value(11)  # the newest block, from RAM
        assert not list(mnt.rglob("*.tmp"))
        for i in range(12):
            got = store.get(BlockKey("m", b"k%d" % i))
            assert got is None or got[0] == value(i)
        store.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
