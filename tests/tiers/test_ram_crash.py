"""The host-RAM tier across a daemon crash: the block table beside the arena, and re-adoption.

A crash here is real where it can be (a child process that SIGKILLs itself
mid-run), and otherwise a fault injected into the table's own writes: the
Nth ``pwrite`` is cut short and the run abandoned where it stood, which is
what a SIGKILL at that instruction leaves. Each restart is a new tier on the
same files.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.block import BlockKey, BlockMeta, checksum
from kvstore.errors import TierFull
from kvstore.shm import table as block_table
from kvstore.shm.arena import FORMAT_VERSION, HEADER_BYTES, ArenaMismatch, ShmArena
from kvstore.shm.table import UNIT_BYTES, BlockTable
from kvstore.tiers.ram import HostRamTier

PAGE = 4096
REPO = Path(__file__).resolve().parents[2]


def value(i: int, size: int) -> bytes:
    seed = b"%08d" % i
    return (seed * (size // len(seed) + 1))[:size]


def key(i: int, ns: str = "ns") -> BlockKey:
    return BlockKey(ns, b"k%d" % i)


def meta(data: bytes, parent: bytes | None = None, layout: str = "") -> BlockMeta:
    return BlockMeta(len(data), checksum(data), parent, layout)


def ram(d: Path, size: int = 64 * PAGE, **kw) -> HostRamTier:
    kw = {"crash_safe": True, "keep_on_exit": True, **kw}
    return HostRamTier(size, shm_dir=str(d), arena_name="arena", **kw)


@pytest.mark.system
def test_blocks_survive_a_real_sigkill(tmp_path):
    """A child process stores blocks (streamed and through slots), deletes one, uses some, and SIGKILLs itself."""
    child = f"""
import os, signal, sys
sys.path.insert(0, {str(REPO)!r})
from kvstore.block import BlockKey, BlockMeta, checksum
from kvstore.tiers.ram import HostRamTier
t = HostRamTier(64 * 4096, shm_dir={str(tmp_path)!r}, arena_name="arena", crash_safe=True, keep_on_exit=True)
def value(i, size):
    seed = b"%08d" % i
    return (seed * (size // len(seed) + 1))[:size]
for i in range(12):
    v = value(i, 1000 + 3000 * i)
    t.put(BlockKey("ns" if i % 3 else "other", b"k%d" % i), v, BlockMeta(len(v), checksum(v), b"k%d" % (i - 1) if i else None, "L%d" % i))
v = value(99, 9000)
off = t.reserve(len(v))
t.view(off, len(v))[:] = v
t.commit(BlockKey("ns", b"slot"), off, BlockMeta(len(v), checksum(v)))
t.delete(BlockKey("ns", b"k4"))
t.touch(BlockKey("other", b"k0"))
os.kill(os.getpid(), signal.SIGKILL)
"""
    r = subprocess.run([sys.executable, "-c", child], timeout=60)
    assert r.returncode == -signal.SIGKILL
    t = ram(tmp_path)
    try:
        assert t.recovery.kept and t.recovery.adopted_blocks == 12
        assert (t.recovery.corrupt, t.recovery.torn, t.recovery.conflicting) == (0, 0, 0)
        assert list(t.lru())[-1] == BlockKey("other", b"k0")  # its use was recorded: the most recent
        for i in range(12):
            k = BlockKey("ns" if i % 3 else "other", b"k%d" % i)
            if i == 4:
                assert t.get(k) is None
                continue
            v = value(i, 1000 + 3000 * i)
            assert t.get(k) == v
            assert t.meta(k) == BlockMeta(len(v), checksum(v), b"k%d" % (i - 1) if i else None, "L%d" % i)
        assert t.get(BlockKey("ns", b"slot")) == value(99, 9000)
        held = sum(-(-(1000 + 3000 * i) // PAGE) * PAGE for i in range(12) if i != 4) + 3 * PAGE
        assert t.stats().used_bytes == held  # the allocator holds exactly the adopted extents
    finally:
        t.close()


class Crash(Exception):
    """The daemon dies here: the write in progress is cut short."""


def crash_at(monkeypatch, n: int, torn: bool) -> list[int]:
    """Make the table's ``n``-th pwrite (counting from 1) write only part of its bytes (or none), then crash."""
    count = [0]
    real = os.pwrite

    def pwrite(fd, data, offset):
        count[0] += 1
        if count[0] == n:
            if torn and len(data) > 1:
                real(fd, bytes(data)[: len(data) // 2], offset)
            raise Crash
        return real(fd, data, offset)

    monkeypatch.setattr(block_table.os, "pwrite", pwrite)
    return count


def workload(t: HostRamTier, acked: dict, deleted: set) -> None:
    """Puts, slot commits, deletes and reuse of freed extents; ``acked`` gets each block once its call returned."""
    for i in range(6):
        v = value(i, 2000 + 5000 * (i % 3))
        t.put(key(i), v, meta(v, b"k%d" % (i - 1) if i else None, "layout-%d" % i))
        acked[key(i)] = v
    acked.pop(key(1))  # while a delete is in flight the block may be found or not
    t.delete(key(1))
    deleted.add(key(1))
    v = value(50, 2500)  # reuses k1's extent (best fit, lowest offset)
    off = t.reserve(len(v))
    t.lend(off, 30.0)
    t.view(off, len(v))[:] = v
    t.commit(key(50), off, meta(v))
    acked[key(50)] = v
    t.touch(key(0))
    acked.pop(key(3))
    t.delete(key(3))
    deleted.add(key(3))
    off = t.reserve(PAGE)
    t.lend(off, 30.0)
    t.unreserve(off)
    for i in range(6, 9):
        v = value(i, 7000)
        t.put(key(i), v, meta(v))
        acked[key(i)] = v


ALL_KEYS = {b"k%d" % i for i in (*range(9), 50)}


@pytest.mark.parametrize("torn", [False, True], ids=["cut-before", "torn"])
def test_a_crash_at_every_table_write_loses_no_acknowledged_block(tmp_path, monkeypatch, torn):
    """SQLite-style sweep: for N = 1, 2, … the Nth table write is where the daemon dies."""
    with monkeypatch.context() as m:  # how many writes the whole workload makes
        count = crash_at(m, 10**9, torn)
        (tmp_path / "count").mkdir()
        t = ram(tmp_path / "count")
        workload(t, {}, set())
        writes = count[0]
        t.close()
    assert writes >= 18  # the table's header, then each record written, cleared or stamped
    for n in range(1, writes + 1):
        d = tmp_path / f"n{n}"
        d.mkdir()
        acked: dict = {}
        deleted: set = set()
        with monkeypatch.context() as m:
            crash_at(m, n, torn)
            with pytest.raises(Crash):
                workload(ram(d), acked, deleted)
        # The crashed tier is abandoned as it stood (never closed); a new one starts on its files.
        again = ram(d)
        try:
            stored = {k: again.get(k) for k in list(again.lru())}
            for k, v in acked.items():
                assert stored.get(k) == v, (n, k)
            for k, v in stored.items():  # nothing torn is visible; a deleted block stays deleted
                assert k not in deleted and k.key in ALL_KEYS, (n, k)
                assert v is not None and checksum(v) == again.meta(k).checksum
            assert again.recovery.corrupt == 0
            used = sum(-(-again.meta(k).size // PAGE) * PAGE for k in stored)
            assert again.stats().used_bytes == used + again.held_bytes
        finally:
            again.close()


def test_a_torn_record_is_discarded_and_counted(tmp_path):
    t = ram(tmp_path)
    for i in range(3):
        v = value(i, 3000)
        t.put(key(i), v, meta(v))
    t.close()
    path = tmp_path / "arena.table"
    raw = bytearray(path.read_bytes())
    # Records start at unit boundaries after the 4096-byte header; damage the second one's body.
    units = [u for u in range(0, len(raw) - block_table.HEADER_BYTES, UNIT_BYTES)
             if any(raw[block_table.HEADER_BYTES + u + 8 : block_table.HEADER_BYTES + u + 16])]
    assert len(units) == 3
    raw[block_table.HEADER_BYTES + units[1] + 40] ^= 0xFF
    path.write_bytes(bytes(raw))
    t = ram(tmp_path)
    try:
        assert t.recovery.torn == 1 and t.recovery.adopted_blocks == 2
        assert sum(t.get(key(i)) is not None for i in range(3)) == 2
        assert t.stats().used_bytes == 2 * PAGE  # the damaged record's extent is free again
    finally:
        t.close()
    t = ram(tmp_path)  # the torn record was cleared: it is not counted again
    try:
        assert t.recovery.torn == 0 and t.recovery.adopted_blocks == 2
    finally:
        t.close()


def test_a_record_is_cleared_before_its_extent_is_reused(tmp_path):
    """Delete A, store B in A's very extent: at no point does the table name A at that offset."""
    t = ram(tmp_path)
    a, b = value(1, 3000), value(2, 3000)
    t.put(key(1), a, meta(a))
    offset_a = t.locate(key(1))[0]
    t.delete(key(1))
    assert not t._table.recorded(offset_a)  # cleared before the allocator had it back
    t.put(key(2), b, meta(b))
    assert t.locate(key(2))[0] == offset_a
    t2 = ram(tmp_path)  # as if the daemon died now
    try:
        assert t2.get(key(1)) is None and t2.get(key(2)) == b
        assert t2.recovery.adopted_blocks == 1 and t2.recovery.corrupt == 0
    finally:
        t2.close()


def test_corrupt_bytes_in_the_arena_are_discarded_not_served(tmp_path):
    t = ram(tmp_path)
    good, bad = value(1, 5000), value(2, 5000)
    t.put(key(1), good, meta(good))
    t.put(key(2), bad, meta(bad))
    offset = t.locate(key(2))[0]
    t.close()
    with open(tmp_path / "arena", "r+b") as f:  # between runs, one byte of key 2 flips
        f.seek(HEADER_BYTES + offset + 777)
        byte = f.read(1)
        f.seek(HEADER_BYTES + offset + 777)
        f.write(bytes([byte[0] ^ 1]))
    t = ram(tmp_path)
    try:
        assert t.recovery.corrupt == 1 and t.recovery.adopted_blocks == 1
        assert t.get(key(2)) is None and not t.contains(key(2))
        assert t.get(key(1)) == good
        assert t.stats().used_bytes == 2 * PAGE
    finally:
        t.close()


def test_a_changed_size_or_format_starts_empty_and_says_why(tmp_path, caplog):
    t = ram(tmp_path)
    v = value(1, 100)
    t.put(key(1), v, meta(v))
    t.close()
    t = ram(tmp_path, 128 * PAGE)
    try:
        assert not t.recovery.kept and "configured for" in t.recovery.reason
        assert t.get(key(1)) is None
        assert "starts empty" in caplog.text
        t.put(key(1), v, meta(v))
    finally:
        t.close()
    with open(tmp_path / "arena", "r+b") as f:  # a future arena format
        f.seek(8)
        f.write((FORMAT_VERSION + 1).to_bytes(4, "little"))
    t = ram(tmp_path, 128 * PAGE)
    try:
        assert not t.recovery.kept and "format" in t.recovery.reason and t.get(key(1)) is None
    finally:
        t.close()
    t = ram(tmp_path, 128 * PAGE)
    t.put(key(1), v, meta(v))
    t.close()
    table = tmp_path / "arena.table"
    raw = bytearray(table.read_bytes())
    raw[8] += 1  # the table's own format
    table.write_bytes(bytes(raw))
    t = ram(tmp_path, 128 * PAGE)
    try:
        assert not t.recovery.kept and "table format" in t.recovery.reason and t.get(key(1)) is None
    finally:
        t.close()


def test_a_restart_gives_clients_a_new_token(tmp_path):
    t = ram(tmp_path)
    t.put(key(1), b"v", meta(b"v"))
    old = t.arena.token
    t.close()
    t = ram(tmp_path)
    try:
        assert t.arena.token != old
        with pytest.raises(ArenaMismatch, match="another daemon"):
            ShmArena.attach(t.arena.path, old)  # a client of the previous run attaches again
        ShmArena.attach(t.arena.path, t.arena.token).close()
    finally:
        t.close()


def test_a_lent_slot_is_held_from_reuse_until_its_lease_ends(tmp_path):
    """A writer of the previous run may still copy into its slot: a restart hands that extent to nobody."""
    now = [1000.0]
    clock = lambda: now[0]  # noqa: E731
    t = ram(tmp_path, 16 * PAGE, clock=clock)
    offset = t.reserve(4 * PAGE)
    t.lend(offset, 30.0)
    mine = t.reserve(4 * PAGE)  # the daemon's own reservation (a streamed put): not lent
    # the daemon dies here; both reservations were open
    t2 = ram(tmp_path, 16 * PAGE, clock=clock)
    try:
        assert t2.recovery.slots == 1 and t2.held_bytes == 4 * PAGE
        got = [t2.reserve(PAGE) for _ in range(12)]  # everything but the held extent
        assert all(not (offset <= o < offset + 4 * PAGE) for o in got)
        assert mine in got  # the daemon's own half-written reservation is simply free again
        with pytest.raises(TierFull):
            t2.reserve(PAGE)
        now[0] += 31.0
        again = t2.reserve(PAGE)
        assert offset <= again < offset + 4 * PAGE
        assert t2.held_bytes == 0
        t2.commit(key(1), again, meta(bytes(10)))
    finally:
        t2.close()
    t3 = ram(tmp_path, 16 * PAGE, clock=clock)  # the released slot's record went with it
    try:
        assert t3.recovery.kept and t3.recovery.slots == 0 and t3.stats().used_bytes == PAGE
    finally:
        t3.close()


def test_a_slot_committed_before_the_crash_is_a_block_not_a_held_slot(tmp_path):
    t = ram(tmp_path)
    v = value(7, 6000)
    offset = t.reserve(len(v))
    t.lend(offset, 30.0)
    t.view(offset, len(v))[:] = v
    assert t.commit(key(7), offset, meta(v))
    t2 = ram(tmp_path)
    try:
        assert t2.recovery.slots == 0 and t2.recovery.adopted_blocks == 1 and t2.get(key(7)) == v
    finally:
        t2.close()


def test_without_crash_safe_nothing_is_kept(tmp_path):
    t = ram(tmp_path)
    v = value(1, 100)
    t.put(key(1), v, meta(v))
    t.close()
    t = ram(tmp_path, crash_safe=False)
    try:
        assert not t.persistent and t.get(key(1)) is None
        assert not (tmp_path / "arena.table").exists()
    finally:
        t.close()
    assert not (tmp_path / "arena").exists()  # and it removes its arena at close


def test_keep_on_exit_off_removes_arena_and_table(tmp_path):
    t = ram(tmp_path, keep_on_exit=False)
    t.put(key(1), b"v", meta(b"v"))
    t.close()
    assert sorted(os.listdir(tmp_path)) == []


def test_an_empty_arena_is_not_kept(tmp_path):
    t = ram(tmp_path)
    v = value(1, 100)
    t.put(key(1), v, meta(v))
    t.delete(key(1))
    t.close()
    assert sorted(os.listdir(tmp_path)) == []


def test_a_table_of_another_arena_is_refused(tmp_path):
    a = ShmArena.create(16 * PAGE, str(tmp_path), "a")
    try:
        BlockTable.create(str(tmp_path / "t"), a.arena_id, a.size, PAGE).close()
        with pytest.raises(block_table.TableMismatch, match="another arena"):
            BlockTable.open(str(tmp_path / "t"), bytes(16), a.size, PAGE)
        with pytest.raises(block_table.TableMismatch, match="another arena"):
            BlockTable.open(str(tmp_path / "t"), a.arena_id, a.size * 2, PAGE)
    finally:
        a.close(unlink=True)


def test_a_close_retried_after_a_held_view_still_keeps_the_arena(tmp_path):
    t = ram(tmp_path)
    v = value(1, 5000)
    t.put(key(1), v, meta(v))
    view = t.view(0, 10)
    with pytest.raises(BufferError):
        t.close()
    view.release()
    t.close()  # what the store does after collecting the stray view
    t = ram(tmp_path)
    try:
        assert t.recovery.kept and t.get(key(1)) == v
    finally:
        t.close()
