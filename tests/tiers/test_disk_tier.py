"""Disk-tier behaviour under real faults: restarts, flipped bytes, SIGKILL, full and broken filesystems.

The shared Tier contract lives in test_tier_contract.py; these tests cover
what only a persistent tier has. Faults are real: bytes flipped in the files,
a child process killed with SIGKILL, a 1 MiB tmpfs that fills up, a
filesystem remounted read-only. The mount tests need root and skip without it.
"""

from __future__ import annotations

import inspect
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstore.block import BlockKey, BlockMeta, checksum
from kvstore.errors import CorruptBlock, DiskFull, TierFull, TierUnavailable
from kvstore.tiers.block_file import block_name
from kvstore.tiers.disk import DiskTier
from tests.support.block_files import file_of, flip
from tests.support.small_filesystem import tmpfs

REPO = Path(__file__).resolve().parents[2]
BIG = 1 << 40


def payload(i: int) -> bytes:
    """Block ``i``'s bytes: mostly small, every fifth a few MiB so a kill often lands mid-write."""
    size = 4096 * (1 + i % 7) + (i % 5 == 4) * (3 << 20) + i % 13
    return random.Random(i).randbytes(size)


def key(i: int | str, namespace: str = "ns") -> BlockKey:
    return BlockKey.checked(namespace, f"key-{i}".encode())


def meta_of(data: bytes, **kw) -> BlockMeta:
    return BlockMeta(len(data), checksum(data), **kw)


def put(tier: DiskTier, i: int | str, data: bytes | None = None, **kw) -> bytes:
    data = payload(i) if data is None else data
    tier.put(key(i), data, meta_of(data, **kw))
    return data


def temp_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.tmp"))


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "blocks"


# -- restart ------------------------------------------------------------------


@pytest.mark.parametrize("fsync", [False, True])
def test_a_new_instance_recovers_every_block(root, fsync):
    tier = DiskTier(root, BIG, fsync=fsync)
    blobs = {i: put(tier, i, parent=b"p" if i else None, layout=f"l{i}") for i in range(12)}
    other = b"x" * 5000
    tier.put(key(0, "tenant-b"), other, meta_of(other))
    tier.touch(key(3))
    tier.get(key(5))
    before, order = tier.stats(), list(tier.lru())
    assert order[-2:] == [key(3), key(5)], "a get moves the block in memory"
    tier.close()

    again = DiskTier(root, BIG)
    assert (again.recovered_blocks, again.dropped_on_recovery) == (13, 0)
    assert (again.stats().used_bytes, again.stats().blocks) == (before.used_bytes, before.blocks)
    written = [key(i) for i in range(12) if i != 3] + [key(0, "tenant-b"), key(3)]
    assert list(again.lru()) == written, "the order of puts and touches survives the restart; gets do not stamp"
    assert again.namespaces() == {"ns", "tenant-b"}
    for i, data in blobs.items():
        assert again.get(key(i)) == data
        assert again.meta(key(i)) == meta_of(data, parent=b"p" if i else None, layout=f"l{i}")
    assert again.get(key(0, "tenant-b")) == other
    again.close()


def test_a_directory_has_one_owner(root):
    tier = DiskTier(root, BIG)
    with pytest.raises(TierUnavailable, match="in use by another process"):
        DiskTier(root, BIG)
    tier.close()
    DiskTier(root, BIG).close()


def test_recovery_removes_temp_files_and_leaves_foreign_files(root):
    tier = DiskTier(root, BIG)
    data = put(tier, 1)
    tier.close()
    leftover = file_of(tier, key(1)).with_name(block_name(key(1)) + ".abc123.tmp")
    leftover.write_bytes(data[:100])
    foreign = root / "ab" / "README"
    foreign.write_text("not a block")

    again = DiskTier(root, BIG)
    assert temp_files(root) == []
    assert foreign.exists()
    assert (again.recovered_blocks, again.dropped_on_recovery) == (1, 0)
    assert again.get(key(1)) == data
    again.close()


# -- corruption -------------------------------------------------------------------


def test_a_flipped_payload_byte_is_caught_on_get_and_dropped(root):
    tier = DiskTier(root, BIG)
    keep = put(tier, 1)
    put(tier, 2)
    path = file_of(tier, key(2))
    used_before, file_bytes = tier.stats().used_bytes, path.stat().st_size
    flip(path, file_bytes - 1)

    with pytest.raises(CorruptBlock, match=str(key(2))):
        tier.get(key(2))
    assert not tier.contains(key(2))
    assert not path.exists()
    assert tier.stats().used_bytes == used_before - file_bytes
    assert tier.stats().blocks == 1
    assert tier.get(key(2)) is None
    assert tier.get(key(1)) == keep
    tier.close()


def test_used_bytes_equal_the_files_on_disk(root):
    tier = DiskTier(root, BIG)
    for i in range(6):
        put(tier, i)
    tier.delete(key(2))
    on_disk = sum(p.stat().st_size for p in root.glob("??/*"))
    assert tier.stats().used_bytes == on_disk
    tier.close()


@pytest.mark.parametrize("where", ["magic", "namespace", "header checksum"])
def test_a_flipped_header_byte_is_dropped_at_recovery(root, where):
    tier = DiskTier(root, BIG)
    keep, lost = put(tier, 1), put(tier, 2)
    path = file_of(tier, key(2))
    header_len = path.stat().st_size - len(lost)
    tier.close()
    flip(path, {"magic": 0, "namespace": 34, "header checksum": header_len - 1}[where])

    again = DiskTier(root, BIG)
    assert (again.recovered_blocks, again.dropped_on_recovery) == (1, 1)
    assert not path.exists()
    assert again.get(key(2)) is None
    assert again.get(key(1)) == keep
    again.close()


def test_a_truncated_file_is_dropped_at_recovery(root):
    tier = DiskTier(root, BIG)
    data = put(tier, 1)
    tier.close()
    path = file_of(tier, key(1))
    os.truncate(path, path.stat().st_size - len(data) // 2)

    again = DiskTier(root, BIG)
    assert (again.recovered_blocks, again.dropped_on_recovery) == (0, 1)
    assert again.stats().used_bytes == 0
    again.close()


def test_a_file_truncated_while_running_is_corrupt_on_get(root):
    tier = DiskTier(root, BIG)
    put(tier, 1)
    os.truncate(file_of(tier, key(1)), 1000)
    with pytest.raises(CorruptBlock):
        tier.get(key(1))
    assert tier.stats().blocks == 0 and tier.stats().used_bytes == 0
    tier.close()


def test_get_never_returns_another_keys_bytes(root):
    """A file holding another key (as after a hash collision) is a miss, not that key's data."""
    tier = DiskTier(root, BIG)
    put(tier, 1)
    other = put(tier, 2)
    shutil.copyfile(file_of(tier, key(2)), file_of(tier, key(1)))
    assert tier.get(key(1)) is None
    assert tier.get(key(2)) == other
    tier.close()
    again = DiskTier(root, BIG)
    assert again.dropped_on_recovery == 1, "a file whose name is not its key's hash is dropped"
    assert again.get(key(2)) == other
    again.close()


def test_a_vanished_file_is_a_miss(root):
    tier = DiskTier(root, BIG)
    put(tier, 1)
    file_of(tier, key(1)).unlink()
    assert tier.get(key(1)) is None
    assert tier.stats().blocks == 0 and tier.stats().used_bytes == 0
    tier.close()


# -- SIGKILL ------------------------------------------------------------------------

WRITER = f"""
import random, sys
from kvstore.block import BlockKey, BlockMeta, checksum
from kvstore.tiers.disk import DiskTier

{inspect.getsource(payload)}

tier = DiskTier(sys.argv[1], 1 << 40, fsync=sys.argv[2] == "1")
gated = sys.argv[3] == "1"
for i in range(400):
    if gated:
        sys.stdin.readline()  # wait for the test to say go
    data = payload(i)
    tier.put(BlockKey("ns", f"key-{{i}}".encode()), data, BlockMeta(len(data), checksum(data)))
    print(i, flush=True)
sys.stdin.read()  # wait to be killed
"""


def start_writer(root: Path, fsync: bool, gated: bool = False) -> subprocess.Popen:
    """A child putting blocks 0, 1, 2, ... and printing each index once its put returned.

    A gated writer waits for a line on stdin before each put.
    """
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(root), "1" if fsync else "0", "1" if gated else "0"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def kill(child: subprocess.Popen) -> list[int]:
    """SIGKILL the writer; every index it reported, including lines still in the pipe."""
    child.send_signal(signal.SIGKILL)
    child.wait()
    reported = [int(line) for line in child.stdout.read().split()]
    child.stdout.close()
    child.stdin.close()
    assert child.returncode == -signal.SIGKILL
    return reported


def check_after_kill(root: Path, reported: list[int]) -> None:
    """Nothing the writer reported is lost, nothing torn is visible, no temp file survives recovery."""
    tier = DiskTier(root, BIG)
    assert temp_files(root) == []
    present = {int(k.key.split(b"-")[1]) for k in tier.lru()}
    assert set(reported) <= present
    assert tier.recovered_blocks == len(present)
    for i in present:
        assert tier.get(key(i)) == payload(i)  # every present block verifies, byte for byte
    tier.close()


@pytest.mark.system
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fsync", [False, True], ids=["no-fsync", "fsync"])
@pytest.mark.parametrize("kill_after", [1, 4, 9, 30])
def test_sigkill_mid_stream_loses_nothing_committed_and_tears_nothing(root, kill_after, fsync):
    child = start_writer(root, fsync)
    seen = []
    try:
        while len(seen) < kill_after:
            line = child.stdout.readline()
            assert line, f"writer exited early with {child.wait()}"
            seen.append(int(line))
    finally:
        reported = seen + kill(child)
    check_after_kill(root, reported)


@pytest.mark.system
@pytest.mark.timeout(120)
def test_sigkill_while_a_block_is_half_written(root):
    """Kill the writer while a temp file provably exists, i.e. between create and rename.

    Where a plain kill lands is up to the scheduler. Here the writer is gated:
    the test lets it start block i, watches that block's folder until either
    a temp file or the finished file shows up, and on a temp file stops the
    writer (SIGSTOP), confirms the file is still there and only then kills.
    Multi-MiB blocks take long enough to write that one is always caught.
    """
    child = start_writer(root, fsync=False, gated=True)
    seen, in_flight = [], []
    try:
        for i in range(400):
            name = block_name(key(i))
            folder, final = root / name[:2], root / name[:2] / name
            child.stdin.write("go\n")
            child.stdin.flush()
            while not final.exists():  # ends: the gated writer is putting block i
                if folder.exists() and any(n.endswith(".tmp") for n in os.listdir(folder)):
                    os.kill(child.pid, signal.SIGSTOP)
                    os.waitpid(child.pid, os.WUNTRACED)
                    in_flight = temp_files(root)
                    if in_flight:
                        break
                    os.kill(child.pid, signal.SIGCONT)
                assert child.poll() is None, f"writer exited with {child.returncode}"
            if in_flight:
                break
            seen.append(int(child.stdout.readline()))
    finally:
        reported = seen + kill(child)
    assert in_flight, "no write was caught in flight"
    assert all(p.exists() for p in in_flight), "the killed writer left its temp file"
    check_after_kill(root, reported)


# -- broken filesystems --------------------------------------------------------------


@pytest.mark.system
@pytest.mark.parametrize("block_bytes", [3000, 100_000, 300_000])
def test_a_full_disk_raises_disk_full_and_keeps_what_was_written(tmp_path, block_bytes):
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        tier = DiskTier(mnt, BIG)
        stored = {}
        with pytest.raises(TierFull) as caught:  # DiskFull when the write found it, TierFull when the free space did
            for i in range(10_000):
                before = tier.stats()
                stored[i] = put(tier, i, random.Random(i).randbytes(block_bytes))
        message = str(caught.value)
        assert str(mnt) in message and "--disk-bytes" in message and "free space" in message
        assert isinstance(caught.value, TierFull), "a full filesystem is a full tier, not a failing one"
        assert not isinstance(caught.value, TierUnavailable)
        assert temp_files(mnt) == []
        after = tier.stats()
        assert (after.used_bytes, after.blocks) == (before.used_bytes, before.blocks)
        assert after.used_bytes <= after.capacity_bytes < after.used_bytes + block_bytes, "no room for one more"
        assert str(mnt) in after.degraded and "--disk-bytes" in after.degraded
        assert stored, "some blocks fit before the disk filled"
        for i, data in stored.items():
            assert tier.get(key(i)) == data
        # freeing space lets writes through again
        tier.delete(key(0))
        put(tier, "after", b"z" * min(block_bytes, 3000))
        tier.close()


@pytest.mark.system
def test_a_read_only_filesystem_makes_puts_unavailable_and_reads_still_work(tmp_path):
    with tmpfs(tmp_path / "mnt", "4m") as mnt:
        tier = DiskTier(mnt, BIG)
        data = put(tier, 1)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        before = tier.stats()
        with pytest.raises(TierUnavailable, match="Read-only file system") as caught:
            put(tier, 2)
        assert not isinstance(caught.value, DiskFull)
        assert str(mnt) in str(caught.value)
        assert tier.stats() == before
        assert tier.get(key(1)) == data
        tier.close()


def test_a_directory_replaced_by_a_file_is_unavailable(root):
    tier = DiskTier(root, BIG)
    put(tier, 1)
    shutil.rmtree(root)
    root.write_bytes(b"not a directory")
    with pytest.raises(TierUnavailable, match="Not a directory") as caught:
        put(tier, 2)
    assert str(root) in str(caught.value)
    with pytest.raises(TierUnavailable, match="Not a directory"):
        tier.get(key(1))
    tier.close()
    with pytest.raises(TierUnavailable, match="--disk-dir"):
        DiskTier(root, BIG)


# -- concurrency ------------------------------------------------------------------------


def test_concurrent_puts_of_one_key_store_it_once(root):
    tier = DiskTier(root, BIG)
    data = payload(4)  # a few MiB, so the writes overlap
    start = threading.Barrier(8)

    def one_put(_):
        start.wait()
        return tier.put(key(4), data, meta_of(data))

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one_put, range(8)))
    assert results.count(True) == 1
    assert tier.get(key(4)) == data
    assert tier.stats().used_bytes == file_of(tier, key(4)).stat().st_size
    assert temp_files(root) == []
    tier.close()


def test_concurrent_mixed_traffic_keeps_the_accounting(root):
    tier = DiskTier(root, BIG)

    def worker(w):
        rng = random.Random(w)
        for _ in range(60):
            i = rng.randrange(20)
            op = rng.choice("pgdt")
            if op == "p":
                put(tier, i)
            elif op == "g":
                got = tier.get(key(i))
                assert got is None or got == payload(i)
            elif op == "d":
                tier.delete(key(i))
            else:
                tier.touch(key(i))

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(worker, range(6)))
    files = sorted(root.glob("??/*"))
    assert temp_files(root) == []
    assert tier.stats().blocks == len(files)
    assert tier.stats().used_bytes == sum(p.stat().st_size for p in files)
    tier.close()


# -- model-based ------------------------------------------------------------------------


class DiskTierMachine(RuleBasedStateMachine):
    """Random puts, gets, touches, deletes and restarts against a dict-and-list model."""

    def __init__(self):
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="strata-disk-"))
        self.tier = DiskTier(self.dir, BIG)
        self.model: dict[int, bytes] = {}
        self.order: list[int] = []  # LRU first
        self.stamped: list[int] = []  # the order a restart recovers: puts and touches, not gets

    def _use(self, i, stamp: bool):
        self.order.remove(i)
        self.order.append(i)
        if stamp:
            self.stamped.remove(i)
            self.stamped.append(i)

    @rule(i=st.integers(0, 7), size=st.integers(1, 20_000))
    def put(self, i, size):
        data = random.Random(size).randbytes(size)
        added = self.tier.put(key(i), data, meta_of(data))
        assert added == (i not in self.model)
        if added:
            self.model[i] = data
            self.order.append(i)
            self.stamped.append(i)

    @rule(i=st.integers(0, 7))
    def get(self, i):
        assert self.tier.get(key(i)) == self.model.get(i)
        if i in self.model:
            self._use(i, stamp=False)

    @rule(i=st.integers(0, 7))
    def touch(self, i):
        self.tier.touch(key(i))
        if i in self.model:
            self._use(i, stamp=True)

    @rule(i=st.integers(0, 7))
    def delete(self, i):
        assert self.tier.delete(key(i)) == (i in self.model)
        if self.model.pop(i, None) is not None:
            self.order.remove(i)
            self.stamped.remove(i)

    @rule()
    def restart(self):
        self.tier.close()
        self.tier = DiskTier(self.dir, BIG)
        assert self.tier.recovered_blocks == len(self.model)
        self.order = list(self.stamped)

    @invariant()
    def matches_model(self):
        assert list(self.tier.lru()) == [key(i) for i in self.order]
        assert self.tier.stats().blocks == len(self.model)
        assert self.tier.stats().used_bytes == sum(file_of(self.tier, key(i)).stat().st_size for i in self.model)

    def teardown(self):
        assert len(list(self.dir.glob("??/*"))) == len(self.model), "no stray files"
        self.tier.close()
        shutil.rmtree(self.dir)


TestDiskTierMachine = pytest.mark.slow(DiskTierMachine.TestCase)  # real files, fsync on and off
TestDiskTierMachine.settings = settings(max_examples=20, stateful_step_count=30, deadline=None)
