"""Hypothesis state machine over TieredStore on real RAM and disk tiers.

Invariants checked after every step:
- RAM accounting: the arena's used bytes equal the page-rounded sizes of the
  blocks it holds plus the open slots; used never exceeds capacity.
- Disk used never exceeds its capacity.
- A block pinned by a live lease is present.
- A prefix outlives its descendants: no step evicts a block while a child of
  it is cached (explicit deletes aside).
- Whatever is read is exactly what was written for that key.
- What the store's events said (the prefix index's feed) equals what it holds.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.block import BlockKey, BlockMeta, checksum
from kvstore.errors import TierFull
from kvstore.store.tiered import StoreLimits, TieredStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.ram import HostRamTier
from kvstore.tiers.remote import RemoteTier

pytestmark = pytest.mark.slow  # each machine runs tens of examples through real arenas and files

KiB = 1 << 10
PAGE = 4 * KiB
SIZES = [4 * KiB, 64 * KiB, 300 * KiB, 1024 * KiB]
KEYS = [b"k%d" % i for i in range(16)]


# Each example's tiers live in a scratch directory of their own, on tmpfs where the host has one:
# the disk tier makes its 256 fan-out folders at start, which on a disk costs tens of milliseconds
# an example to make and as many to remove (most of a run), on tmpfs well under one. The tiers are
# the same real arena and files either way.
SCRATCH = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


def size_of(key: bytes) -> int:
    return SIZES[int(key[1:]) % len(SIZES)]


def value_of(key: bytes) -> bytes:
    return (key * (size_of(key) // len(key) + 1))[: size_of(key)]


def round_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="store-machine-", dir=SCRATCH)
        self.now = 0.0
        self.published: dict = {}  # what the store's events said (the prefix index's feed)
        self.store = self.make_store()
        self.parents: dict[bytes, bytes | None] = {}  # every key ever stored -> its parent
        self.deleted: set[bytes] = set()
        self.last_present: set[bytes] = set()
        self.pins: list[tuple[int, float, list[bytes]]] = []
        self.slots: list[tuple[int, bytes]] = []

    def make_store(self) -> TieredStore:
        limits = StoreLimits.from_settings(max_block_bytes=1 << 20, demotion_threads=0, lease_s=5, pin_lease_s=5)
        return TieredStore(self.make_tiers(), limits=limits, namespaces=["ns"], clock=lambda: self.now, events=self)

    def make_tiers(self) -> list:
        return [HostRamTier(2 << 20, shm_dir=self.dir, arena_name="arena"), DiskTier(f"{self.dir}/disk", 3 << 20)]

    def publish(self, event) -> None:
        """The store's event sink, applied at once: where the store says each block is."""
        if event.best is None:
            self.published.pop(event.key, None)
        else:
            self.published[event.key] = event.best

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def present(self, key: bytes) -> bool:
        return bool(self.store.exists("ns", [key]))

    @rule(key=st.sampled_from(KEYS), data=st.data())
    def put(self, key, data):
        stored = [k for k in self.parents if k != key and self.present(k)]
        parent = data.draw(st.sampled_from([None, *stored])) if stored else None
        parent = self.parents.get(key, parent) if key in self.parents else parent
        try:
            self.store.put(BlockKey("ns", key), value_of(key), BlockMeta(size_of(key), checksum(value_of(key)), parent))
        except TierFull:
            return  # everything pinned: refusing is allowed, losing is not
        self.parents.setdefault(key, parent)
        self.deleted.discard(key)

    @rule(key=st.sampled_from(KEYS))
    def get(self, key):
        got = self.store.get(BlockKey("ns", key))
        if got is not None:
            assert got[0] == value_of(key)

    @rule(key=st.sampled_from(KEYS))
    def lookup_and_release(self, key):
        [loc] = self.store.lookup("ns", [key])
        if loc is None or not loc.lease_id:
            return
        view = self.store.head.view(loc.offset, loc.meta.size)
        try:
            assert bytes(view) == value_of(key)
        finally:
            view.release()
        assert self.store.release([loc.lease_id]) == [True]

    @precondition(lambda self: self.parents)
    @rule(data=st.data())
    def pin(self, data):
        keys = data.draw(st.lists(st.sampled_from(sorted(self.parents)), min_size=1, max_size=3, unique=True))
        lease, missing = self.store.pin("ns", keys)
        if not lease.keys:  # a pin that found none of its keys takes no lease
            assert lease.id == 0 and sorted(missing) == sorted(keys)
            return
        self.pins.append((lease.id, lease.deadline, [k.key for k in lease.keys]))

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        lease_id, deadline, _ = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        assert self.store.unpin(lease_id) == (deadline > self.now)

    @rule(seconds=st.sampled_from([1.0, 3.0, 6.0]))
    def advance_clock(self, seconds):
        self.now += seconds
        self.store.expire_leases()
        self.pins = [p for p in self.pins if p[1] > self.now]
        self.slots = [s for s in self.slots if s[0] in self.live_slot_ids()]

    def live_slot_ids(self) -> set[int]:
        return {lease_id for lease_id, lease in self.store._leases._leases.items()}

    @rule(key=st.sampled_from(KEYS))
    def delete(self, key):
        self.store.delete("ns", [key])
        self.deleted.add(key)

    @rule(key=st.sampled_from(KEYS))
    def allocate(self, key):
        try:
            [grant] = self.store.allocate("ns", [(key, size_of(key), self.parents.get(key), "")])
        except TierFull:
            return
        if not grant.present:
            view = self.store.head.view(grant.offset, grant.size)
            view[:] = value_of(key)
            view.release()
            self.slots.append((grant.slot_id, key))

    @precondition(lambda self: self.slots)
    @rule(commit=st.booleans())
    def finish_slot(self, commit):
        slot_id, key = self.slots.pop()
        if commit:
            self.store.commit([(slot_id, checksum(value_of(key)))])
            self.parents.setdefault(key, None)
            self.deleted.discard(key)
        else:
            self.store.abort([slot_id])

    @rule()
    def flush(self):
        self.store.flush_demotions()

    @invariant()
    def ram_accounting(self):
        ram = self.store.head
        stats = ram.stats()
        held = sum(round_up(e.meta.size) for k, e in self.store._catalog.entries.items() if ram.locate(k))
        slots = sum(round_up(lease.meta.size) for lease in self.store._leases._leases.values() if lease.meta is not None)
        # lapsed: extents of slots whose lease ran out, held while a stalled writer may still copy into them
        lapsed = sum(round_up(size) for _, _, size in self.store._s.lapsed)
        # held: extents a crashed run's slot writers may still write (a crash-safe head after a restart)
        assert stats.used_bytes == held + slots + lapsed + ram.held_bytes
        assert stats.used_bytes <= stats.capacity_bytes

    @invariant()
    def index_feed_matches_holdings(self):
        assert self.published == dict(self.store.holdings())

    @invariant()
    def listing_is_what_exists(self):
        present = sorted(k for k in KEYS if self.present(k))
        listed, token = [], b""
        while True:  # small pages, so resuming after a token is exercised too
            page, token = self.store.list_keys("ns", page_size=2, page_token=token)
            listed += [b.key for b in page]
            if not token:
                break
        assert listed == present
        # the sorted key index holds every entry (deleted-but-pinned ones included), no more
        assert self.store._catalog.keys_of("ns") == sorted(k.key for k in self.store._catalog.entries)

    @invariant()
    def disk_bounded(self):
        disk = self.store.tier_stats()[1]
        assert disk.used_bytes <= disk.capacity_bytes

    @invariant()
    def pinned_blocks_present(self):
        for _, deadline, keys in self.pins:
            if deadline > self.now:
                for key in keys:
                    assert self.present(key) or key in self.deleted, key

    @invariant()
    def prefixes_outlive_descendants(self):
        # A parent may go while no child of it is cached (a child put later
        # then names an absent parent); it must never go while one is.
        present = {k for k in self.parents if self.present(k)}
        for key, parent in self.parents.items():
            if parent is None or key not in present or parent in present or parent in self.deleted:
                continue
            assert parent not in self.last_present, f"{key!r} is cached but its parent {parent!r} was just evicted"
        self.last_present = present


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class CrashRestartStoreMachine(StoreMachine):
    """The same rules over a crash-safe RAM tier, and one more: the daemon dies (nothing is
    closed, nothing flushed) and a new store starts on the same arena, table and disk directory."""

    def make_tiers(self) -> list:
        ram = HostRamTier(2 << 20, shm_dir=self.dir, arena_name="arena", crash_safe=True, keep_on_exit=True,
                          clock=lambda: self.now)
        return [ram, DiskTier(f"{self.dir}/disk", 3 << 20)]

    @rule()
    def crash_and_restart(self):
        before = {k: self.store.exists("ns", [k]) for k in KEYS if self.present(k)}
        dead = self.store
        dead._closed.set()  # its lease reaper stops; its tiers are abandoned as they stand
        dead._reaper.join()
        for level in dead.chain:  # what the kernel does for a dead process: its file locks go
            if level.tier.persistent and not dead.chain.is_head(level.name):
                level.tier.close()
        self.store = self.make_store()
        self.published = dict(self.store.holdings())  # the index agent re-publishes everything at start
        self.pins, self.slots = [], []  # leases and slots do not survive a restart
        after = {k for k in KEYS if self.present(k)}
        assert set(before) <= after, f"lost across the restart: {set(before) - after}"
        assert after <= set(before) | self.deleted  # a block deleted while pinned may come back
        for k, tiers in before.items():  # a block in RAM before is in RAM after (and no entry twice)
            assert self.store.exists("ns", [k]) == tiers, k
        self.deleted -= after


TestCrashRestartStoreMachine = CrashRestartStoreMachine.TestCase
TestCrashRestartStoreMachine.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class RemoteStoreMachine(StoreMachine):
    """The same rules over RAM, disk and a small in-process remote tier at the bottom."""

    def make_tiers(self) -> list:
        remote = RemoteTier.open(f"memory://machine-{os.path.basename(self.dir)}", capacity_bytes=4 << 20)
        return [*super().make_tiers(), remote]


TestRemoteStoreMachine = RemoteStoreMachine.TestCase
TestRemoteStoreMachine.settings = settings(
    max_examples=50, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class GpuStoreMachine(StoreMachine):
    """The same rules with the GPU tier at the head (on the host stand-in for device memory), above RAM and disk."""

    def make_tiers(self) -> list:
        from kvstore.tiers.gpu import GpuTier

        return [GpuTier(2 << 20, memory="host", shm_dir=self.dir), *super().make_tiers()]


TestGpuStoreMachine = GpuStoreMachine.TestCase
TestGpuStoreMachine.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
