"""The block table's room: every block the arena can hold is recorded, and one it cannot record is refused.

The table beside a crash-safe arena (:mod:`kvstore.shm.table`) grows with
the records it must hold, so one tenant's long keys and layouts cannot use
up the crash safety of another's blocks; a block that still cannot be
recorded (a full tmpfs, a failed table) is refused, never acknowledged.
Crashes are real where they can be (a daemon SIGKILLed), and otherwise the
Nth table write cut short, as in ``test_ram_crash``.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import struct
from pathlib import Path

import pytest
import xxhash

from kvstore.block import (
    MAX_KEY_BYTES,
    MAX_LAYOUT_CHARS,
    MAX_NAMESPACE_CHARS,
    BlockKey,
    BlockMeta,
    TierName,
    checksum,
)
from kvstore.errors import StrataError, TierFull, TierUnavailable
from kvstore.shm import table as block_table
from kvstore.shm.arena import ShmArena
from kvstore.shm.table import MAX_RECORD_UNITS, max_table_units, table_units
from kvstore.store.tiered import StoreLimits, TieredStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.ram import HostRamTier

PAGE = 4096
MiB = 1 << 20
LONGEST_LAYOUT = "\U0001d11e" * MAX_LAYOUT_CHARS  # 4 bytes of UTF-8 each: the longest layout in bytes


def value(i: int, size: int) -> bytes:
    seed = b"%08d" % i
    return (seed * (size // len(seed) + 1))[:size]


def long_key(i: int, length: int = MAX_KEY_BYTES) -> bytes:
    return (b"%06d" % i + b"k" * length)[:length]


def meta(data: bytes, parent: bytes | None = None, layout: str = "") -> BlockMeta:
    return BlockMeta(len(data), checksum(data), parent, layout)


def ram(d: Path, size: int = 64 * PAGE, **kw) -> HostRamTier:
    kw = {"crash_safe": True, "keep_on_exit": True, **kw}
    return HostRamTier(size, shm_dir=str(d), arena_name="arena", **kw)


# ---- a real daemon: one tenant must not use up another's crash safety ---------------------


def test_one_tenant_filling_the_table_loses_no_other_tenants_blocks_at_a_sigkill(daemon_process):
    """Tenant a stores many one-page blocks with the longest keys, parents and layouts (the records
    that take the most table room per arena page); tenant b then stores short ones. After a SIGKILL
    and a restart every acknowledged block of both reads back byte for byte: a put the table could
    not record must have been refused, never acknowledged."""
    from kvstore import BlockPut, Client

    daemon = daemon_process("--ram-bytes", "16MiB", "--namespaces", "a,b")  # 4096 pages: a first table of 1 MiB
    layout = "L" * MAX_LAYOUT_CHARS  # with the key and the parent, a record of 13 table units
    acked: dict[tuple[str, bytes], bytes] = {}
    refused: dict[tuple[str, bytes], str] = {}
    with Client(daemon.target, retries=0) as c:
        for ns, n, key_of, extra in (
            ("a", 700, long_key, lambda i: {"parent": long_key(i - 1) if i else None, "layout": layout}),
            ("b", 200, lambda i: b"b%d" % i, lambda i: {}),
        ):
            for start in range(0, n, 50):
                items = [BlockPut(key_of(i), value(i, PAGE), **extra(i)) for i in range(start, min(n, start + 50))]
                try:
                    c.put_many(ns, items)
                except StrataError as err:  # refused: never acknowledged, so never promised
                    refused.update({(ns, it.key): str(err) for it in items})
                    continue
                acked.update({(ns, it.key): bytes(it.value) for it in items})
        b_keys = [k for ns, k in acked if ns == "b"]
        assert b_keys and all(c.exists("b", [k]) == [TierName.HOST] for k in b_keys)  # in RAM only: no disk copy
    assert daemon.kill(signal.SIGKILL) == -signal.SIGKILL
    daemon.start()
    with Client(daemon.target, retries=0) as c:
        lost = {ns: sum(c.get(ns, k) != v for (n, k), v in acked.items() if n == ns) for ns in ("a", "b")}
    assert lost == {"a": 0, "b": 0}, f"acknowledged blocks gone after the SIGKILL, per namespace (of {len(acked)}): {lost}"
    assert not refused, f"{len(refused)} puts refused though the arena had room: {next(iter(refused.values()))}"


# ---- room: every block the arena can hold ---------------------------------------------------


def test_an_arena_full_of_the_longest_records_is_recorded_whole(tmp_path):
    """One-page blocks with the longest namespace, key, parent and layout, until the arena is full."""
    pages = 64
    t = ram(tmp_path, pages * PAGE)
    ns = "n" * MAX_NAMESPACE_CHARS
    metas = {}
    for i in range(pages):
        v = value(i, 1)
        metas[BlockKey(ns, long_key(i))] = meta(v, long_key(i + 10_000), LONGEST_LAYOUT)
        t.put(BlockKey(ns, long_key(i)), v, metas[BlockKey(ns, long_key(i))])
    with pytest.raises(TierFull):  # the arena is full: the table never was
        t.reserve(1)
    assert t.unrecorded_blocks == 0
    assert table_units(pages * PAGE, PAGE) < t._table.units <= max_table_units(pages * PAGE, PAGE)
    again = ram(tmp_path, pages * PAGE)  # as if the daemon died now
    try:
        assert again.recovery.adopted_blocks == pages and again.recovery.torn == 0
        assert {k: again.meta(k) for k in metas} == metas
        assert all(again.get(BlockKey(ns, long_key(i))) == value(i, 1) for i in range(pages))
    finally:
        again.close()


def random_layout(rng: random.Random) -> str:
    chars = "a\u00e9\u20ac\U0001d11e"  # 1 to 4 bytes of UTF-8
    return "".join(rng.choice(chars) for _ in range(rng.randrange(MAX_LAYOUT_CHARS + 1)))


def test_churn_of_short_and_long_records_never_refuses_a_block_the_arena_has_room_for(tmp_path):
    """Records of every length stored and deleted at random fragment the table's units; it still
    has room for every block the arena takes, and a restart finds every one of them."""
    rng = random.Random(7)
    pages = 48
    t = ram(tmp_path, pages * PAGE)
    live: dict[BlockKey, tuple[bytes, BlockMeta]] = {}
    for i in range(3000):
        if len(live) < pages and rng.random() < 0.6:
            name = b"%d." % i
            k = BlockKey("ns", (name + b"k" * MAX_KEY_BYTES)[: max(len(name), rng.choice([1, 8, 200, MAX_KEY_BYTES]))])
            v = value(i, rng.randrange(1, PAGE + 1))
            parent = long_key(i + 1, rng.randrange(1, MAX_KEY_BYTES + 1)) if rng.random() < 0.5 else None
            m = meta(v, parent, random_layout(rng) if rng.random() < 0.7 else "")
            assert t.put(k, v, m)  # never refused: the arena had a page for it
            live[k] = (v, m)
        elif live:
            k = rng.choice(sorted(live, key=lambda k: k.key))
            assert t.delete(k)
            del live[k]
    assert t.unrecorded_blocks == 0 and t._table.units <= max_table_units(pages * PAGE, PAGE)
    again = ram(tmp_path, pages * PAGE)
    try:
        assert again.recovery.adopted_blocks == len(live) and again.recovery.torn == 0
        for k, (v, m) in live.items():
            assert again.get(k) == v and again.meta(k) == m
    finally:
        again.close()


def test_the_largest_table_has_room_for_a_record_of_every_page_however_fragmented():
    """The bound the table's size rests on: at most one live record per arena page, and when no free
    extent fits, each free extent is shorter than a record and lies between two live ones."""
    for pages in (1, 2, 16, 4096):
        live = pages * MAX_RECORD_UNITS  # every page's record the longest
        stranded = (pages + 1) * (MAX_RECORD_UNITS - 1)  # a free extent one unit too short around each
        assert max_table_units(pages * PAGE, PAGE) > live + MAX_RECORD_UNITS + stranded + MAX_RECORD_UNITS


# ---- crash safety of a growing table ----------------------------------------------------------


class Crash(Exception):
    """The daemon dies here: the write in progress is cut short."""


def crash_at(monkeypatch, n: int, torn: bool) -> list[int]:
    """The table's ``n``-th write or growth (from 1) is where the daemon dies: a write lands in part
    (``torn``) or not at all; a growth (one ``ftruncate``) does not happen."""
    count = [0]
    real_pwrite, real_ftruncate = os.pwrite, os.ftruncate

    def pwrite(fd, data, offset):
        count[0] += 1
        if count[0] == n:
            if torn and len(data) > 1:
                real_pwrite(fd, bytes(data)[: len(data) // 2], offset)
            raise Crash
        return real_pwrite(fd, data, offset)

    def ftruncate(fd, length):
        count[0] += 1
        if count[0] == n:
            raise Crash
        return real_ftruncate(fd, length)

    monkeypatch.setattr(block_table.os, "pwrite", pwrite)
    monkeypatch.setattr(block_table.os, "ftruncate", ftruncate)
    return count


def growing_workload(t: HostRamTier, acked: dict, deleted: set) -> None:
    """Long records that make the table grow, between short ones, deletes and a lent slot."""
    def put(i: int, key_len: int, layout: str, size: int = 3000) -> None:
        k, v = BlockKey("ns", long_key(i, key_len)), value(i, size)
        t.put(k, v, meta(v, long_key(i - 1) if i else None, layout))
        acked[k] = v

    for i in range(4):
        put(i, 8, "short")
    for i in range(4, 9):
        put(i, MAX_KEY_BYTES, "L" * MAX_LAYOUT_CHARS)
    gone = BlockKey("ns", long_key(5, MAX_KEY_BYTES))
    acked.pop(gone)  # while a delete is in flight the block may be found or not
    t.delete(gone)
    deleted.add(gone)
    v = value(50, 2500)
    off = t.reserve(len(v))
    t.lend(off, 30.0)
    t.view(off, len(v))[:] = v
    k = BlockKey("ns", long_key(50, MAX_KEY_BYTES))
    t.commit(k, off, meta(v, None, LONGEST_LAYOUT))
    acked[k] = v
    for i in range(9, 13):
        put(i, MAX_KEY_BYTES, LONGEST_LAYOUT, size=PAGE)


@pytest.mark.parametrize("torn", [False, True], ids=["cut-before", "torn"])
def test_a_crash_at_every_write_or_growth_of_the_table_loses_no_acknowledged_block(tmp_path, monkeypatch, torn):
    with monkeypatch.context() as m:  # how many writes and growths the whole workload makes
        (tmp_path / "count").mkdir()
        t = ram(tmp_path / "count", 16 * PAGE)
        count = crash_at(m, 10**9, torn)
        growing_workload(t, {}, set())
        steps, grown = count[0], t._table.units
        t.close()
    assert grown >= 4 * table_units(16 * PAGE, PAGE)  # it grew more than once
    for n in range(1, steps + 1):
        d = tmp_path / f"n{n}"
        d.mkdir()
        acked: dict = {}
        deleted: set = set()
        t = ram(d, 16 * PAGE)
        with monkeypatch.context() as m:
            crash_at(m, n, torn)
            with pytest.raises(Crash):
                growing_workload(t, acked, deleted)
        # The crashed tier is abandoned as it stood (never closed); a new one starts on its files.
        again = ram(d, 16 * PAGE)
        try:
            assert again.recovery.kept, (n, again.recovery.reason)
            stored = {k: again.get(k) for k in list(again.lru())}
            for k, v in acked.items():
                assert stored.get(k) == v, (n, k)
            for k, v in stored.items():  # nothing torn is visible; a deleted block stays deleted
                assert k not in deleted and v is not None and checksum(v) == again.meta(k).checksum, (n, k)
            assert again.recovery.corrupt == 0
            v = value(77, 10)  # a table left as the crash found it, mid-growth or not, still grows
            again.put(BlockKey("ns", long_key(77)), v, meta(v, long_key(78), LONGEST_LAYOUT))
            assert again.unrecorded_blocks == 0
        finally:
            again.close()


# ---- a table from before tables grew ----------------------------------------------------------


def write_table_as_before(path: Path, arena: ShmArena, records: list[tuple[int, BlockKey, BlockMeta]]) -> None:
    """The table file as daemons wrote it before it could grow (format 1, one unit per arena page),
    laid out from its documented format rather than by the module under test."""
    secret = 0x5EC12E7
    units = max(64, arena.size // PAGE)
    raw = bytearray(4096 + units * 256)
    struct.pack_into("<8sII16sQQQ", raw, 0, b"STRATATB", 1, 256, arena.arena_id, arena.size, units, secret)
    pos = 0
    for seq, (offset, key, m) in enumerate(records, 1):
        ns, layout, parent = key.namespace.encode(), m.layout.encode(), m.parent
        body = struct.pack("<BxHHHHxxQQQQq", 1, len(ns), len(key.key), 0xFFFF if parent is None else len(parent),
                           len(layout), seq, offset, m.size, m.checksum, 0) + ns + key.key + (parent or b"") + layout
        sum_ = xxhash.xxh3_64_intdigest(struct.pack("<I", len(body)) + body, seed=secret) or 1
        record = struct.pack("<QQI", seq, sum_, len(body)) + body
        raw[4096 + pos : 4096 + pos + len(record)] = record
        pos += -(-len(record) // 256) * 256
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, raw)
    finally:
        os.close(fd)


def test_a_table_written_before_tables_grew_is_recovered_and_then_grows(tmp_path):
    size = 32 * PAGE
    arena = ShmArena.create(size, str(tmp_path), "arena")
    records = []
    for i in range(3):
        v = value(i, 5000)
        view = arena.view(2 * i * PAGE, len(v))
        view[:] = v
        view.release()
        records.append((2 * i * PAGE, BlockKey("old", b"k%d" % i), meta(v, b"k%d" % (i - 1) if i else None, f"L{i}")))
    write_table_as_before(tmp_path / "arena.table", arena, records)
    arena.close()  # the previous run's daemon is gone; its files stay
    t = ram(tmp_path, size)
    try:
        assert t.recovery.kept and t.recovery.adopted_blocks == 3 and t.recovery.torn == 0
        for offset, k, m in records:
            assert t.locate(k) == (offset, m) and t.get(k) == value(int(k.key[1:]), 5000)
        for i in range(20):  # then records it had no room for before: it grows
            v = value(100 + i, 100)
            t.put(BlockKey("new", long_key(i)), v, meta(v, None, LONGEST_LAYOUT))
        assert t._table.units > table_units(size, PAGE) and t.unrecorded_blocks == 0
    finally:
        t.close()
    t = ram(tmp_path, size)  # and a grown table is recovered as well
    try:
        assert t.recovery.adopted_blocks == 23 and t.recovery.torn == 0
    finally:
        t.close()


def test_a_table_whose_length_no_table_of_the_arena_can_have_starts_empty_and_says_why(tmp_path):
    t = ram(tmp_path)
    t.put(BlockKey("ns", b"k"), b"v", meta(b"v"))
    t.close()
    os.truncate(tmp_path / "arena.table", os.path.getsize(tmp_path / "arena.table") + 100)
    t = ram(tmp_path)
    try:
        assert not t.recovery.kept and "units of 256 bytes" in t.recovery.reason
        assert t.get(BlockKey("ns", b"k")) is None
    finally:
        t.close()


# ---- a block the table cannot record is refused ----------------------------------------------


def fail_table_writes(monkeypatch, err: int | None, short: bool = False) -> None:
    """Every table write from now fails with ``err`` (or, ``short``, lands only its first half)."""
    real = os.pwrite

    def pwrite(fd, data, offset):
        if short and len(data) > 8:
            return real(fd, bytes(data)[: len(data) // 2], offset)
        if err is not None:
            raise OSError(err, os.strerror(err))
        return real(fd, data, offset)

    monkeypatch.setattr(block_table.os, "pwrite", pwrite)


@pytest.mark.parametrize("short", [False, True], ids=["enospc", "short-write"])
def test_a_block_the_full_tmpfs_cannot_record_is_refused_not_stored(tmp_path, monkeypatch, short):
    t = ram(tmp_path)
    kept = value(1, 5000)
    t.put(BlockKey("ns", b"kept"), kept, meta(kept))
    used = t.stats().used_bytes
    v = value(2, 5000)
    with monkeypatch.context() as m:
        fail_table_writes(m, None if short else errno.ENOSPC, short=short)
        with pytest.raises(TierFull, match="shared-memory directory") as refused:
            t.put(BlockKey("ns", b"refused"), v, meta(v))
        off = t.reserve(len(v))  # the slot protocol: its commit is refused the same way
        t.view(off, len(v))[:] = v
        with pytest.raises(TierFull):
            t.commit(BlockKey("ns", b"slot"), off, meta(v))
    assert refused.value.retry_after_s >= 1.0
    assert not t.contains(BlockKey("ns", b"refused")) and not t.contains(BlockKey("ns", b"slot"))
    assert t.stats().used_bytes == used and t.unrecorded_blocks == 2  # the extents went back
    t.put(BlockKey("ns", b"later"), v, meta(v))  # room again: stored and recorded
    again = ram(tmp_path)
    try:
        assert again.recovery.torn == 0 and again.recovery.adopted_blocks == 2
        assert again.get(BlockKey("ns", b"kept")) == kept and again.get(BlockKey("ns", b"later")) == v
    finally:
        again.close()


def test_the_table_grows_only_while_the_tmpfs_keeps_room_for_the_arenas_pages(tmp_path, monkeypatch):
    t = ram(tmp_path, 64 * PAGE)
    try:
        assert t.arena.unbacked_bytes() >= 64 * PAGE  # nothing written yet
        monkeypatch.setattr(block_table, "_free_bytes", lambda directory: t.arena.unbacked_bytes() + 1000)
        stored = 0
        with pytest.raises(TierFull, match="kept for the arena's pages") as refused:
            for i in range(64):  # records of 21 units (no parent): the first table's 64 units hold three
                v = value(i, 10)
                t.put(BlockKey("ns", long_key(i)), v, meta(v, None, LONGEST_LAYOUT))
                stored += 1
        assert stored == 3 and refused.value.retry_after_s >= 1.0
        t.put(BlockKey("ns", b"short"), b"v", meta(b"v"))  # short records still fit the table as it is
        monkeypatch.undo()
        v = value(99, 10)
        t.put(BlockKey("ns", long_key(99)), v, meta(v, None, LONGEST_LAYOUT))  # room again: it grows
        assert t.unrecorded_blocks == 1 and t.contains(BlockKey("ns", long_key(99)))
    finally:
        t.close()


def test_a_failed_table_refuses_blocks_and_slots_until_a_restart(tmp_path, monkeypatch):
    t = ram(tmp_path)
    try:
        t.put(BlockKey("ns", b"a"), b"v", meta(b"v"))
        with monkeypatch.context() as m:
            fail_table_writes(m, errno.EIO)
            t.delete(BlockKey("ns", b"a"))  # its record cannot be cleared: the table is removed
        assert not (tmp_path / "arena.table").exists()
        with pytest.raises(TierUnavailable, match="until the daemon restarts"):
            t.put(BlockKey("ns", b"b"), b"v", meta(b"v"))
        off = t.reserve(PAGE)
        with pytest.raises(TierUnavailable):
            t.lend(off, 30.0)
        t.unreserve(off)
        assert not t.contains(BlockKey("ns", b"b")) and t.stats().used_bytes == 0
    finally:
        t.close()


# ---- the store gives back what a refused block held -------------------------------------------


def refuse_records(monkeypatch, tier: HostRamTier, after: int = 0) -> None:
    """The tier's table refuses every record after the first ``after`` (as a full tmpfs would)."""
    table, real, calls = tier._table, tier._table._write, [0]

    def write(*args):
        calls[0] += 1
        if calls[0] > after:
            raise TierFull("the block table's tmpfs is full (test)", retry_after_s=1.0)
        return real(*args)

    monkeypatch.setattr(table, "_write", write)


@pytest.fixture
def crash_safe_store(tmp_path):
    stores = []

    def make(ram_mib: int = 8) -> tuple[TieredStore, HostRamTier]:
        ram_tier = HostRamTier(ram_mib * MiB, shm_dir=str(tmp_path), arena_name=f"a{len(stores)}", crash_safe=True)
        disk = DiskTier(tmp_path / f"d{len(stores)}", 32 * MiB)
        store = TieredStore([ram_tier, disk], limits=StoreLimits.from_settings(max_block_bytes=2 * MiB,
                                                                               demotion_threads=0))
        stores.append(store)
        return store, ram_tier

    yield make
    for s in stores:
        s.close()


def test_a_refused_put_or_slot_commit_leaks_nothing_in_the_store(crash_safe_store, monkeypatch):
    store, ram_tier = crash_safe_store()
    v = value(1, 100_000)
    with monkeypatch.context() as m:
        refuse_records(m, ram_tier)
        with pytest.raises(TierFull):
            store.put(BlockKey("m", b"put"), v, meta(v))
    assert store.get(BlockKey("m", b"put")) is None and ram_tier.stats().used_bytes == 0
    grants = store.allocate("m", [(b"s%d" % i, len(v), None, "") for i in range(3)])
    for g in grants:
        ram_tier.write_extent(g.offset, v)
    with monkeypatch.context() as m:
        refuse_records(m, ram_tier, after=1)  # the first slot's block is recorded, the second refused
        with pytest.raises(TierFull):
            store.commit([(g.slot_id, checksum(v)) for g in grants])
    assert store.get(BlockKey("m", b"s0"))[0] == v
    assert store.get(BlockKey("m", b"s1")) is None and store.get(BlockKey("m", b"s2")) is None
    assert ram_tier.stats().blocks == 1  # the refused slot's extent and the one after it went back and ram_tier.stats().used_bytes == -(-len(v) // PAGE) * PAGE
    store.put(BlockKey("m", b"put"), v, meta(v))  # and the store goes on
    assert store.get(BlockKey("m", b"put"))[0] == v


def test_a_promotion_the_table_refuses_still_serves_the_read_from_below(crash_safe_store, monkeypatch):
    store, ram_tier = crash_safe_store(ram_mib=8)
    for i in range(20):
        v = value(i, MiB)
        store.put(BlockKey("m", b"k%d" % i), v, meta(v))
    store.flush_demotions()
    below = [i for i in range(20) if store.exists("m", [b"k%d" % i]) == [TierName.DISK]]
    assert below
    used = ram_tier.stats().used_bytes
    with monkeypatch.context() as m:
        refuse_records(m, ram_tier)
        data, _, tier = store.get(BlockKey("m", b"k%d" % below[0]))
    assert data == value(below[0], MiB) and tier is TierName.DISK
    assert store.exists("m", [b"k%d" % below[0]]) == [TierName.DISK] and ram_tier.stats().used_bytes <= used
