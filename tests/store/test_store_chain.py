"""The store over several chains of tiers, edge policies, recency, lease kinds.

``CHAINS`` is the row a new tier adds: one suite of chain-agnostic
behaviour runs over each (RAM only; RAM + disk; more as tiers join).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from kvstore.block import BlockKey, BlockMeta, TierName, checksum
from kvstore.errors import InvalidArgument, LeaseOwnedElsewhere, TierFull
from kvstore.remote.memory import MemoryRemote
from kvstore.store import EdgePolicy, LeaseKind, StoreLimits, TierChain, TieredStore
from kvstore.tiers import known_tiers, open_tier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.object import ObjectTier
from kvstore.tiers.ram import HostRamTier
from kvstore.tiers.remote import RemoteTier
from tests.support.store_blocks import Clock, MiB, value

HOST, DISK = TierName.HOST, TierName.DISK


def put(store: TieredStore, key: bytes, data: bytes, parent: bytes | None = None, ns: str = "m"):
    return store.put(BlockKey(ns, key), data, BlockMeta(len(data), checksum(data), parent))


def ram_only(tmp_path, n):
    return [HostRamTier(4 * MiB, shm_dir=str(tmp_path), arena_name=f"a{n}")]


def ram_disk(tmp_path, n):
    return [HostRamTier(4 * MiB, shm_dir=str(tmp_path), arena_name=f"a{n}"), DiskTier(tmp_path / f"d{n}", 32 * MiB)]


def ram_disk_remote(tmp_path, n):
    return ram_disk(tmp_path, n) + [RemoteTier.open(f"memory://chain-{tmp_path.name}-{n}")]


def ram_disk_object(tmp_path, n, s3):
    environ = {"AWS_ACCESS_KEY_ID": "chain", "AWS_SECRET_ACCESS_KEY": "chain", "HOME": str(tmp_path)}
    tier = ObjectTier.open(bucket=s3.bucket, prefix=f"chain-{tmp_path.name}-{n}", endpoint=s3.endpoint,
                           environ=environ, retries=0)
    return ram_disk(tmp_path, n) + [tier]


def gpu_ram_disk(tmp_path, n):
    """The GPU tier at the head on the host stand-in for device memory (the device check runs it on CUDA)."""
    from kvstore.tiers.gpu import GpuTier

    return [GpuTier(4 * MiB, memory="host", shm_dir=str(tmp_path))] + ram_disk(tmp_path, n)


def device_ram(tmp_path, n):
    """The GPU tier's stand-in refusing host views, as device memory does: the store copies in and out."""
    from kvstore.tiers.gpu import GpuTier

    ram = HostRamTier(16 * MiB, shm_dir=str(tmp_path), arena_name=f"a{n}")
    return [GpuTier(4 * MiB, memory="host", shm_dir=str(tmp_path), addressable=False), ram]


CHAINS = {"gpu+ram+disk": gpu_ram_disk, "gpu-unmapped+ram": device_ram, "ram": ram_only, "ram+disk": ram_disk, "ram+disk+remote": ram_disk_remote, "ram+disk+object": ram_disk_object}
NEEDS = {"ram+disk+object": "s3"}  # a session fixture a chain's row needs


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def stores():
    made: list[TieredStore] = []
    yield made
    for s in made:
        s.close()


@pytest.fixture(params=[pytest.param(n, marks=pytest.mark.system) if n in NEEDS else n for n in sorted(CHAINS)])
def store(request, tmp_path, clock, stores):
    needs = [request.getfixturevalue(NEEDS[request.param])] if request.param in NEEDS else []
    s = TieredStore(CHAINS[request.param](tmp_path, len(stores), *needs), limits=StoreLimits.from_settings(max_block_bytes=2 * MiB, demotion_threads=0), clock=clock)
    stores.append(s)
    return s


# ---- one suite over every chain ------------------------------------------------


def test_round_trip_and_repeat(store):
    assert put(store, b"a", value(1)) == (True, store.head.name)
    assert put(store, b"a", value(1))[0] is False
    data, meta, tier = store.get(BlockKey("m", b"a"))
    assert data == value(1) and tier is store.head.name


def test_pressure_loses_only_what_the_chain_cannot_hold(store):
    for i in range(12):
        put(store, b"k%d" % i, value(i))
    store.flush_demotions()
    present = [i for i in range(12) if store.exists("m", [b"k%d" % i])]
    if len(store.chain) > 1:
        assert present == list(range(12)), "a chain with room below never drops"
    else:
        assert 11 in present and len(present) < 12
    for i in present:
        assert store.get(BlockKey("m", b"k%d" % i))[0] == value(i)


def test_pin_protects_under_pressure(store):
    put(store, b"p", value(99))
    lease, _ = store.pin("m", [b"p"])
    for i in range(12):
        try:
            put(store, b"k%d" % i, value(i))
        except TierFull:
            pass
        store.flush_demotions()
    assert store.get(BlockKey("m", b"p"))[0] == value(99)
    assert store.unpin(lease.id)


def test_lookup_in_place_then_release(store):
    put(store, b"a", value(7))
    [loc] = store.lookup("m", [b"a"])
    with store.head.readable(loc.offset, loc.meta.size) as view:
        assert bytes(view) == value(7)
    assert store.release([loc.lease_id]) == [True]


def test_delete_and_listing(store):
    for k in (b"a", b"b", b"c"):
        put(store, k, value(1))
    assert store.delete("m", [b"b", b"zz"]) == 1
    page, token = store.list_keys("m")
    assert [b.key for b in page] == [b"a", b"c"] and token == b""


def test_holdings_name_best_tiers(store):
    put(store, b"a", value(1))
    assert list(store.holdings()) == [(BlockKey("m", b"a"), store.head.name)]


# ---- chain construction and the tier registry ------------------------------------


def test_chain_head_must_be_mappable(tmp_path):
    with pytest.raises(ValueError, match="put 'ram' first"):
        TierChain([DiskTier(tmp_path / "d", 8 * MiB)])


def test_chain_refuses_a_tier_twice_and_extra_edges(tmp_path):
    ram = HostRamTier(4 * MiB, shm_dir=str(tmp_path), arena_name="a")
    try:
        with pytest.raises(ValueError, match="twice"):
            TierChain([ram, ram])
        with pytest.raises(ValueError, match="at most one per edge"):
            TierChain([ram], [EdgePolicy()])
    finally:
        ram.close()


def test_tier_registry_builds_by_name_and_lists_known(tmp_path):
    assert {"ram", "disk", "remote"} <= set(known_tiers())
    disk = open_tier("disk", directory=tmp_path / "d", capacity_bytes=8 * MiB)
    assert disk.name is DISK and disk.persistent
    disk.close()
    remote = open_tier("remote", url=f"memory://registry-{tmp_path.name}")
    assert remote.name is TierName.OBJECT and remote.remote
    remote.close()
    with pytest.raises(InvalidArgument, match="known tiers are disk, gpu, object, peer, ram, remote"):
        open_tier("tape")


# ---- edge policies ------------------------------------------------------------------


def make(tmp_path, clock, stores, edge: EdgePolicy, ram_mib: int = 4, name: str = "x") -> TieredStore:
    tiers = [HostRamTier(ram_mib * MiB, shm_dir=str(tmp_path), arena_name=f"a-{name}"), DiskTier(tmp_path / f"d-{name}", 32 * MiB)]
    s = TieredStore(tiers, edges=[edge], limits=StoreLimits.from_settings(max_block_bytes=2 * MiB, demotion_threads=0), clock=clock)
    stores.append(s)
    return s


def test_write_through_copies_down_at_once_and_eviction_is_then_free(tmp_path, clock, stores):
    store = make(tmp_path, clock, stores, EdgePolicy(write_through=True))
    put(store, b"a", value(1))
    store.flush_demotions()
    ram, disk = store.tier_stats()
    assert ram.blocks == 1 and disk.blocks == 1, "the copy below exists while the block is still in RAM"
    copies = store.metrics.demotions.labels("ok")._value.get()
    for i in range(8):
        put(store, b"k%d" % i, value(i))
        store.flush_demotions()
    assert store.exists("m", [b"a"]) == [DISK]
    assert store.get(BlockKey("m", b"a"))[0] == value(1)
    # every block was copied once on its way in; RAM eviction needed no further copy
    assert store.metrics.demotions.labels("ok")._value.get() == copies + 8


def test_no_promotion_edge_serves_from_below(tmp_path, clock, stores):
    store = make(tmp_path, clock, stores, EdgePolicy(promote=False))
    for i in range(8):
        put(store, b"k%d" % i, value(i))
    store.flush_demotions()
    assert store.exists("m", [b"k0"]) == [DISK]
    data, _, tier = store.get(BlockKey("m", b"k0"))
    assert data == value(0) and tier is DISK
    assert store.exists("m", [b"k0"]) == [DISK]
    assert store.metrics.promotions._value.get() == 0
    [loc] = store.lookup("m", [b"k0"])
    assert loc.tier is DISK and loc.lease_id == 0, "not brought into the arena: the client streams it"


def test_no_demotion_edge_drops_instead(tmp_path, clock, stores):
    store = make(tmp_path, clock, stores, EdgePolicy(demote=False))
    for i in range(8):
        put(store, b"k%d" % i, value(i))
    store.flush_demotions()
    assert store.tier_stats()[1].blocks == 0
    assert store.exists("m", [b"k7"]) == [HOST] and store.exists("m", [b"k0"]) == []


# ---- recency -------------------------------------------------------------------------


def test_disk_recency_survives_a_restart(tmp_path, clock, stores):
    """Reads move blocks to the recent end of the disk tier's order, and a restart keeps that order."""
    store = make(tmp_path, clock, stores, EdgePolicy(promote=False), name="r")
    for i in range(8):
        put(store, b"k%d" % i, value(i))
    store.flush_demotions()
    on_disk = [i for i in range(8) if store.exists("m", [b"k%d" % i]) == [DISK]]
    assert len(on_disk) >= 3
    first = on_disk[0]
    store.get(BlockKey("m", b"k%d" % first))  # the oldest write is now the newest use
    assert store.flush_recency() >= 1
    stores.remove(store)
    store.close()
    disk = DiskTier(tmp_path / "d-r", 32 * MiB)
    try:
        order = [k.key for k in disk.lru()]
        assert order[-1] == b"k%d" % first, order
    finally:
        disk.close()


def test_recovered_store_evicts_least_recently_used_first(tmp_path, clock, stores):
    store = make(tmp_path, clock, stores, EdgePolicy(promote=False), name="e")
    for i in range(8):
        put(store, b"k%d" % i, value(i))
    store.flush_demotions()
    on_disk = [i for i in range(8) if store.exists("m", [b"k%d" % i]) == [DISK]]
    store.get(BlockKey("m", b"k%d" % on_disk[0]))
    stores.remove(store)
    store.close()  # writes recency back
    again = TieredStore(
        [HostRamTier(4 * MiB, shm_dir=str(tmp_path), arena_name="a-e2"), DiskTier(tmp_path / "d-e", 32 * MiB)],
        edges=[EdgePolicy(promote=False)], limits=StoreLimits.from_settings(max_block_bytes=2 * MiB, demotion_threads=0), clock=clock,
    )
    stores.append(again)
    assert [k.key for k in again._recency.oldest(DISK)][-1] == b"k%d" % on_disk[0]


# ---- deletes run outside the store lock -----------------------------------------------


class WatchedDisk(DiskTier):
    """A disk tier that checks, at each delete, whether the store lock is free."""

    store: TieredStore | None = None
    under_lock: list[bool]

    def delete(self, key):
        if self.store is not None:
            got = self.store._cond.acquire(timeout=2)  # the store lock is not re-entrant: held here, this times out
            self.under_lock.append(not got)
            if got:
                self.store._cond.release()
        return super().delete(key)


def test_disk_deletes_run_outside_the_store_lock(tmp_path, clock, stores):
    disk = WatchedDisk(tmp_path / "w", 32 * MiB)
    disk.under_lock = []
    store = TieredStore(
        [HostRamTier(4 * MiB, shm_dir=str(tmp_path), arena_name="a-w"), disk],
        limits=StoreLimits.from_settings(max_block_bytes=2 * MiB, demotion_threads=0), clock=clock,
    )
    stores.append(store)
    disk.store = store
    for i in range(8):
        put(store, b"k%d" % i, value(i))
    store.flush_demotions()
    victims = [b"k%d" % i for i in range(8) if store.exists("m", [b"k%d" % i]) == [DISK]]
    assert store.delete("m", victims) == len(victims)
    assert disk.stats().blocks == 0, "deleted before delete() returned"
    assert disk.under_lock == [False] * len(victims)


# ---- lease kinds and owners -----------------------------------------------------------


def test_a_new_lease_kind_needs_no_store_change(store, clock):
    handoff = LeaseKind("handoff")
    put(store, b"a", value(1))
    lease, missing = store.lease("m", [b"a", b"gone"], handoff, lease_s=30, owner="decode-7")
    assert missing == [b"gone"] and lease.kind == handoff
    with pytest.raises(LeaseOwnedElsewhere, match="another client"):
        store.end_lease(lease.id, handoff, owner="someone-else")
    assert store.end_lease(lease.id, LeaseKind.PIN, owner="decode-7") is False, "a lease is ended by its own kind"
    assert store.end_lease(lease.id, handoff, owner="decode-7") is True
    assert store.end_lease(lease.id, handoff, owner="decode-7") is False
    late, _ = store.lease("m", [b"a"], handoff, lease_s=5)
    clock.now += 10
    store.expire_leases()
    assert store.metrics.leases_expired.labels("handoff")._value.get() == 1
    assert store.stats().pinned_blocks == 0


def test_lease_kinds_are_fixed_words():
    with pytest.raises(InvalidArgument, match="lowercase word"):
        LeaseKind("Req 42!")


def test_reads_and_slots_are_not_generic_leases(store):
    put(store, b"a", value(1))
    with pytest.raises(InvalidArgument, match="come from lookup and allocate"):
        store.lease("m", [b"a"], LeaseKind.READ)


# ---- remote tiers at the bottom of the chain ------------------------------------------------


def remote_store(tmp_path, clock, stores, name: str, remote: str, disk_mib: int = 3, **remote_options) -> TieredStore:
    tiers = [
        HostRamTier(4 * MiB, shm_dir=str(tmp_path), arena_name=f"a-{name}"),
        DiskTier(tmp_path / f"d-{name}", disk_mib * MiB),
        RemoteTier.open(remote, **remote_options),
    ]
    s = TieredStore(tiers, limits=StoreLimits.from_settings(max_block_bytes=2 * MiB, demotion_threads=0), clock=clock)
    stores.append(s)
    return s


def test_a_full_disk_demotes_to_the_remote_tier_and_reads_come_back(tmp_path, clock, stores):
    store = remote_store(tmp_path, clock, stores, "full", f"memory://full-{tmp_path.name}")
    for i in range(12):
        put(store, b"k%d" % i, value(i))
        store.flush_demotions()
    tiers = {i: store.exists("m", [b"k%d" % i]) for i in range(12)}
    assert all(tiers[i] for i in range(12)), "nothing was dropped: the chain had room below"
    remote_only = [i for i in range(12) if tiers[i] == [TierName.OBJECT]]
    assert remote_only, tiers
    data, _, tier = store.get(BlockKey("m", b"k%d" % remote_only[0]))
    assert data == value(remote_only[0]) and tier is TierName.OBJECT
    assert store.exists("m", [b"k%d" % remote_only[0]]) == [HOST], "promoted on read"


def test_a_block_written_by_one_node_is_read_through_by_another(tmp_path, clock, stores):
    shared = f"memory://fleet-{tmp_path.name}"
    writer = remote_store(tmp_path, clock, stores, "w", shared)
    for i in range(12):
        put(writer, b"k%d" % i, value(i), ns="llama")
        writer.flush_demotions()
    on_remote = [i for i in range(12) if writer.exists("llama", [b"k%d" % i]) == [TierName.OBJECT]]
    assert on_remote
    reader = remote_store(tmp_path, clock, stores, "r", shared)
    k = b"k%d" % on_remote[0]
    assert reader.exists("llama", [k]) == [], "unknown locally until read"
    [loc] = reader.lookup("llama", [k])
    assert loc is not None and loc.lease_id and loc.tier is TierName.OBJECT
    view = reader.head.view(loc.offset, loc.meta.size)
    try:
        assert bytes(view) == value(on_remote[0])
    finally:
        view.release()
    reader.release([loc.lease_id])
    assert reader.exists("llama", [k]) == [HOST]
    assert reader.get(BlockKey("llama", b"never-written")) is None


def test_a_remote_tier_that_is_too_slow_is_a_miss_and_local_tiers_keep_serving(tmp_path, clock, stores):
    store = remote_store(tmp_path, clock, stores, "slow", f"memory://slow-{tmp_path.name}", call_s=0.05, latency_s=1.0)
    put(store, b"local", value(1))
    assert store.get(BlockKey("m", b"local"))[0] == value(1)
    assert store.get(BlockKey("m", b"elsewhere")) is None
    assert store.metrics.tier_errors.labels("object")._value.get() >= 1
    for i in range(12):  # demotions to the slow tier fail; nothing local is lost
        put(store, b"k%d" % i, value(i))
        store.flush_demotions()
    assert store.get(BlockKey("m", b"k11"))[0] == value(11)


def test_write_through_on_a_lower_edge_copies_a_block_on_down_as_soon_as_it_lands(tmp_path, clock, stores):
    tiers = [
        HostRamTier(4 * MiB, shm_dir=str(tmp_path), arena_name="a-through"),
        DiskTier(tmp_path / "d-through", 8 * MiB),
        RemoteTier.open(f"memory://through-{tmp_path.name}"),
    ]
    store = TieredStore(tiers, edges=[EdgePolicy(write_through=True), EdgePolicy(write_through=True)], clock=clock,
                        limits=StoreLimits.from_settings(max_block_bytes=2 * MiB, demotion_threads=0))
    stores.append(store)
    put(store, b"k", value(1))
    store.flush_demotions()
    remote = MemoryRemote(f"through-{tmp_path.name}")
    assert asyncio.run(remote.lookup([BlockKey("m", b"k")], time.monotonic() + 5)) == [BlockMeta(MiB, checksum(value(1)))]
    assert store.exists("m", [b"k"]) == [HOST], "every copy above stays"


def test_a_copy_the_remote_tier_no_longer_has_is_forgotten_when_read(tmp_path, clock, stores):
    shared = f"lost-{tmp_path.name}"
    store = remote_store(tmp_path, clock, stores, "lost", f"memory://{shared}")
    for i in range(12):
        put(store, b"k%d" % i, value(i))
        store.flush_demotions()
    gone = next(i for i in range(12) if store.exists("m", [b"k%d" % i]) == [TierName.OBJECT])
    other = MemoryRemote(shared)  # another node deletes it, or a lifecycle rule expires it
    assert asyncio.run(other.delete([BlockKey("m", b"k%d" % gone)], time.monotonic() + 5)) == 1
    assert store.get(BlockKey("m", b"k%d" % gone)) is None
    assert store.exists("m", [b"k%d" % gone]) == [], "the store still offers a block no tier holds"


def _held_elsewhere(name: str, key: BlockKey, data: bytes, tier: TierName = TierName.OBJECT) -> MemoryRemote:
    """A copy of ``key`` in the shared in-process source ``name``, as another node would have put it."""
    remote = MemoryRemote(name, tier=tier)
    [done] = asyncio.run(remote.write([(key, data, BlockMeta(len(data), checksum(data)))], time.monotonic() + 5))
    assert done.error is None
    return remote


def test_a_block_whose_listed_remote_copy_is_gone_is_read_from_a_remote_tier_the_store_did_not_list(
        tmp_path, clock, stores):
    """[ram, peer, object]: read from a peer, evicted from RAM, so listed as the peer's only; the peer has
    lost it (it went down, or evicted it) while the bucket holds it. A hit, not a miss."""
    peer, bucket, k = f"gone-peer-{tmp_path.name}", f"gone-object-{tmp_path.name}", BlockKey("m", b"k")
    lost = _held_elsewhere(peer, k, value(7), TierName.PEER)
    _held_elsewhere(bucket, k, value(7))
    tiers = [HostRamTier(4 * MiB, shm_dir=str(tmp_path), arena_name="a-gone"),
             RemoteTier.open(f"memory://{peer}", tier=TierName.PEER), RemoteTier.open(f"memory://{bucket}")]
    store = TieredStore(tiers, edges=[EdgePolicy(demote=False), EdgePolicy()], clock=clock,
                        limits=StoreLimits.from_settings(max_block_bytes=2 * MiB, demotion_threads=0))
    stores.append(store)
    assert store.get(k)[2] is TierName.PEER
    for i in range(5):  # RAM's 4 MiB: k's head copy is evicted, the peer's is what the store lists
        put(store, b"f%d" % i, value(i))
    assert store.exists("m", [b"k"]) == [TierName.PEER]
    assert asyncio.run(lost.delete([k], time.monotonic() + 5)) == 1
    data, _, tier = store.get(k)
    assert data == value(7) and tier is TierName.OBJECT


def test_a_corrupt_local_copy_is_read_again_from_a_remote_tier_that_holds_the_block(tmp_path, clock, stores):
    """[ram, disk, peer]: the store's only copy, on disk, is damaged; a peer holds the block. The read is
    a hit from the peer (the damaged copy dropped), not DATA_LOSS."""
    from tests.support.block_files import file_of, flip

    peer, k = f"sound-peer-{tmp_path.name}", BlockKey("m", b"k")
    _held_elsewhere(peer, k, value(3), TierName.PEER)
    disk = DiskTier(tmp_path / "d-sound", 32 * MiB)
    tiers = [HostRamTier(4 * MiB, shm_dir=str(tmp_path), arena_name="a-sound"), disk,
             RemoteTier.open(f"memory://{peer}", tier=TierName.PEER)]
    store = TieredStore(tiers, edges=[EdgePolicy(), EdgePolicy(demote=False)], clock=clock,
                        limits=StoreLimits.from_settings(max_block_bytes=2 * MiB, demotion_threads=0))
    stores.append(store)
    put(store, b"k", value(3))
    for i in range(5):
        put(store, b"f%d" % i, value(i))
        store.flush_demotions()
    assert store.exists("m", [b"k"]) == [DISK]
    path = file_of(disk, k)
    flip(path, path.stat().st_size - 1)
    data, _, tier = store.get(k)
    assert data == value(3) and tier is TierName.PEER
    assert store.metrics.corrupt.labels("disk")._value.get() == 1


def test_a_read_only_remote_tier_in_the_middle_is_passed_over_on_the_way_down(tmp_path, clock, stores):
    """[ram, disk, peer, object]: the peer tier takes no copies, so disk evictions go on to the bucket."""
    tiers = [
        HostRamTier(4 * MiB, shm_dir=str(tmp_path), arena_name="a-skip"),
        DiskTier(tmp_path / "d-skip", 3 * MiB),
        RemoteTier.open(f"memory://skip-peer-{tmp_path.name}", tier=TierName.PEER),
        RemoteTier.open(f"memory://skip-object-{tmp_path.name}"),
    ]
    store = TieredStore(tiers, edges=[EdgePolicy(), EdgePolicy(demote=False), EdgePolicy()], clock=clock,
                        limits=StoreLimits.from_settings(max_block_bytes=2 * MiB, demotion_threads=0))
    stores.append(store)
    for i in range(12):
        put(store, b"k%d" % i, value(i))
        store.flush_demotions()
    where = [store.exists("m", [b"k%d" % i]) for i in range(12)]
    assert all(where), "a block was dropped though the bucket had room"
    assert [TierName.OBJECT] in where and [TierName.PEER] not in where
    assert not store.chain.target_below(DISK, through=True), "no edge below disk writes through"


def test_remote_tiers_come_last(tmp_path):
    ram = HostRamTier(4 * MiB, shm_dir=str(tmp_path), arena_name="a-last")
    remote = RemoteTier.open(f"memory://last-{tmp_path.name}")
    disk = DiskTier(tmp_path / "d-last", 8 * MiB)
    try:
        with pytest.raises(ValueError, match="after every local tier"):
            TierChain([ram, remote, disk])
    finally:
        for t in (ram, remote, disk):
            t.close()


# ---- typed events ------------------------------------------------------------------------------


class Sink:
    """The store's event sink, recording in order (publish runs under the store lock)."""

    def __init__(self) -> None:
        self.events: list = []

    def publish(self, event) -> None:
        self.events.append(event)


def test_the_store_says_what_it_did(tmp_path, clock, stores):
    from kvstore.events import Evicted, Moved, Removed, Stored

    sink = Sink()
    tiers = [HostRamTier(4 * MiB, shm_dir=str(tmp_path), arena_name="a-ev"), DiskTier(tmp_path / "d-ev", 8 * MiB)]
    store = TieredStore(tiers, limits=StoreLimits.from_settings(max_block_bytes=2 * MiB, demotion_threads=0),
                        clock=clock, events=sink)
    stores.append(store)
    k = [BlockKey("m", b"k%d" % i) for i in range(20)]
    put(store, b"k0", value(0))
    assert sink.events == [Stored(k[0], HOST, MiB, HOST)]
    for i in range(1, 6):
        put(store, b"k%d" % i, value(i))
        store.flush_demotions()
    assert Moved(k[0], HOST, DISK, HOST) in sink.events, "the disk copy is complete while RAM still holds it"
    assert Evicted(k[0], HOST, DISK) in sink.events, "then the RAM copy goes"
    sink.events.clear()
    store.get(k[0])
    assert Moved(k[0], DISK, HOST, HOST) in sink.events, "a promotion adds the RAM copy"
    for i in range(6, 20):  # more than RAM and disk hold: old blocks leave the store
        put(store, b"k%d" % i, value(i))
        store.flush_demotions()
    assert any(isinstance(e, Removed) and e.dropped for e in sink.events)
    sink.events.clear()
    present = next(key for key in k if store.exists("m", [key.key]))
    store.delete("m", [present.key])
    assert sink.events == [Removed(present, dropped=False)], "a delete is told once"


def test_holdings_are_read_a_page_at_a_time(store):
    for ns in ("a", "b"):
        for i in range(5):
            put(store, b"k%d" % i, value(i, 4096), ns=ns)
    store.delete("a", [b"k2"])
    got = list(store.holdings(page_blocks=2))
    assert [(k.namespace, k.key) for k, _ in got] == [("a", b"k0"), ("a", b"k1"), ("a", b"k3"), ("a", b"k4")] + [
        ("b", b"k%d" % i) for i in range(5)
    ]


def test_a_lease_outlives_a_corrupt_copy_dropped_under_it(tmp_path, clock, stores):
    """Reader A holds a read lease; reader B finds the only copy corrupt and drops it; A's release
    and a later put of the same key still work, and the block is gone meanwhile."""
    store = TieredStore([HostRamTier(4 * MiB, shm_dir=str(tmp_path), arena_name="a-tomb")],
                        limits=StoreLimits.from_settings(max_block_bytes=2 * MiB, demotion_threads=0), clock=clock)
    stores.append(store)
    put(store, b"a", value(1))
    [loc] = store.lookup("m", [b"a"])
    view = store.head.view(loc.offset, 1)
    view[0] ^= 0xFF  # damage the arena copy under the lease
    view.release()
    from kvstore.errors import CorruptBlock

    with pytest.raises(CorruptBlock):
        store.get(BlockKey("m", b"a"))
    assert store.exists("m", [b"a"]) == [] and list(store.holdings()) == []
    assert store.release([loc.lease_id]) == [True]
    assert put(store, b"a", value(1)) == (True, HOST)
    assert store.get(BlockKey("m", b"a"))[0] == value(1)


def test_touch_marks_blocks_used(tmp_path, clock, stores):
    store = TieredStore([HostRamTier(4 * MiB, shm_dir=str(tmp_path), arena_name="a-touch")],
                        limits=StoreLimits.from_settings(max_block_bytes=2 * MiB, demotion_threads=0), clock=clock)
    stores.append(store)
    put(store, b"a", value(1))
    put(store, b"b", value(2))
    assert store.touch("m", [b"a", b"zz"]) == 1
    assert [k.key for k in store._recency.oldest(HOST)] == [b"b", b"a"]
