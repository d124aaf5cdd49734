"""The disk tier under failing file-system calls, in the style of SQLite's I/O-error tests.

For each kind of call (write, fsync, rename, unlink) and N = 1, 2, ... the
Nth call of that kind fails (EIO; ENOSPC for writes, once and from then on)
while a workload runs through the real store over a real RAM arena and a
real disk tier on real files: puts that demote to disk, reads that promote,
deletes, evictions, and a restart with recovery in the middle. The sweep
for a kind ends at the first N the workload never reaches.

After each run the directory is opened again with the real calls, and:

- *nothing committed is lost*: every block the disk tier held after a store
  operation returned (the store's own record of "on disk"; with ``fsync``
  a block counts only once its file and folder are synced) and that was not
  deleted reads back with the bytes written. A block that was only ever in
  RAM is not committed: the RAM tier here does not outlive its store, so a
  restart loses it, by design;
- *nothing torn is visible*: no temp file survives recovery, and every block
  the reopened tier holds reads back whole, its checksum sound;
- the store never raised anything but a refusal (``TierFull``, a put not
  acknowledged), never wedged, and a tier's health followed the rules: a
  full filesystem is a full tier, never a failing one; a failed unlink is
  one block's problem, never the tier's.

The decision on fsync: a failed fsync leaves the durability of the file (or
the rename) unknown, so the block is not counted as on disk: its temp file
goes, or its renamed file is unlinked again, and its copy stays in RAM. The
tier is then skipped for ``tier_retry_s`` like any failing device.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from kvstore.block import BlockKey, BlockMeta, TierName, checksum
from kvstore.errors import TierFull
from kvstore.fsops import REAL, Fault, FaultyFileOps
from kvstore.store import StoreLimits, TieredStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.ram import HostRamTier
from tests.support.store_blocks import Clock

BLOCK = 16 << 10
RAM = 16 * BLOCK  # room for 16 blocks: the workload's 40 make it demote
DISK = 4 << 20  # room for all of them: every block leaves the disk only by a delete
NS = "m"


def data_of(i: int) -> bytes:
    return (i.to_bytes(4, "big") * (BLOCK // 4 + 1))[:BLOCK]


class Run:
    """One workload under one fault: what was acknowledged, deleted, and seen on disk."""

    def __init__(self, home: Path, ops: FaultyFileOps) -> None:
        self.home, self.ops = home, ops
        self.acked: dict[int, bytes] = {}
        self.deleted: set[int] = set()
        self.on_disk: set[int] = set()  # committed: the disk tier held it once a store call had returned
        self.refused = 0
        self.arenas = 0
        self.store: TieredStore | None = None
        self.clock = Clock()

    def open(self, ops) -> TieredStore:
        self.arenas += 1
        tiers = [
            HostRamTier(RAM, shm_dir=str(self.home), arena_name=f"arena{self.arenas}"),
            DiskTier(self.home / "disk", DISK, fsync=True, ops=ops),
        ]
        limits = StoreLimits.from_settings(max_block_bytes=BLOCK, demotion_threads=0, put_wait_s=5.0)
        self.store = TieredStore(tiers, limits=limits, clock=self.clock)
        return self.store

    @property
    def disk(self) -> DiskTier:
        return self.store.chain.tier(TierName.DISK)

    def observe(self) -> None:
        for i in self.acked:
            if i not in self.deleted and self.disk.contains(BlockKey(NS, b"k%d" % i)):
                self.on_disk.add(i)

    def restarted(self) -> None:
        """Blocks only in RAM went with the old store's arena: not committed, so no longer expected."""
        for i in list(self.acked):
            if i not in self.on_disk:
                del self.acked[i]
        self.observe()

    def put(self, i: int) -> None:
        data = data_of(i)
        try:
            self.store.put(BlockKey(NS, b"k%d" % i), data, BlockMeta(len(data), checksum(data)))
        except TierFull as refused:
            assert refused.retry_after_s > 0
            self.refused += 1
        else:
            self.acked[i] = data
            self.deleted.discard(i)
        self.observe()

    def delete(self, i: int) -> None:
        self.store.delete(NS, [b"k%d" % i])
        self.deleted.add(i)
        self.on_disk.discard(i)
        self.observe()

    def read(self, i: int) -> None:
        got = self.store.get(BlockKey(NS, b"k%d" % i))
        if got is not None:
            assert got[0] == self.acked[i], f"block {i} came back with other bytes"
        self.observe()

    def check_held(self) -> None:
        """Every block the store still holds reads back intact; every block gone was counted as dropped."""
        missing = 0
        for i, data in self.acked.items():
            if i in self.deleted:
                continue
            got = self.store.get(BlockKey(NS, b"k%d" % i))
            if got is None:
                missing += 1
                assert i not in self.on_disk, f"block {i} was on disk and is gone"
            else:
                assert got[0] == data, f"block {i} came back with other bytes"
        assert missing <= self.store.metrics.drops._value.get(), "a block vanished without being dropped"

    def workload(self) -> None:
        self.open(self.ops)
        for i in range(24):
            self.put(i)
        for i in (1, 5, 20):
            self.delete(i)
        for i in (0, 2, 22):
            self.read(i)  # from disk: promoted, evicting again
        self.clock.now += 60  # past any skip period of a tier that failed
        self.check_held()
        self.store.close()
        self.open(self.ops)  # a restart: recovery, still under the fault
        self.restarted()
        for i in range(24, 40):
            self.put(i)
        for i in (3, 7, 8, 9, 30):
            self.delete(i)
        for i in (4, 6, 31):
            self.read(i)
        self.put(1)  # a deleted key written again
        self.clock.now += 60
        self.check_held()
        self.store.close()


def check_after(run: Run) -> None:
    root = run.home / "disk"
    store = run.open(REAL)
    try:
        assert not list(root.rglob("*.tmp")), "recovery left a temp file"
        for i in sorted(run.on_disk - run.deleted):
            got = store.get(BlockKey(NS, b"k%d" % i))
            assert got is not None, f"block {i} was committed to disk and is lost"
            assert got[0] == run.acked[i], f"block {i} is torn"
        for key in list(run.disk.lru()):
            data = run.disk.get(key)  # verifies the checksum; a torn file raises CorruptBlock
            assert data is not None
            assert bytes(data) == data_of(int(key.key[1:])), f"{key} holds another block's bytes"
        assert run.disk.dropped_on_recovery == 0, "recovery found a damaged block file"
    finally:
        store.close()


SWEEP = [
    ("write", errno.EIO, False),
    ("write", errno.ENOSPC, False),
    ("write", errno.ENOSPC, True),  # a disk that stays full
    ("fsync", errno.EIO, False),
    ("rename", errno.EIO, False),
    ("unlink", errno.EIO, False),
]


@pytest.mark.slow  # a full workload per N, for N = 1, 2, ... until the workload no longer reaches N
@pytest.mark.parametrize(("kind", "err", "persist"), SWEEP, ids=[f"{k}-{errno.errorcode[e]}{'-on' if p else ''}" for k, e, p in SWEEP])
def test_the_nth_failing_call_loses_nothing_committed_and_shows_nothing_torn(tmp_path, kind, err, persist):
    runs = 0
    for n in range(1, 400):
        home = tmp_path / f"n{n}"
        home.mkdir()
        ops = FaultyFileOps(Fault(kind, n, err, persist))
        run = Run(home, ops)
        run.workload()
        if not ops.injected:
            break  # the workload makes fewer than n calls of this kind: the sweep is complete
        runs += 1
        check_after(run)
        metrics = run.store.metrics
        failed = metrics.demotions.labels("failed")._value.get()
        if err == errno.ENOSPC:
            assert failed == 0, "a full filesystem made the disk tier count as failing"
            assert metrics.tier_errors.labels("disk")._value.get() == 0
        if kind == "unlink":
            assert failed == 0, "a failed unlink is one block's problem, never the tier's"
        if not persist:
            assert run.refused == 0, "one failed call made the store refuse puts"
    else:
        pytest.fail("the sweep never completed")
    assert runs >= 3, f"the workload made only {runs} {kind} calls"
