"""ShmArena (create, attach, close, cross-process) and HostRamTier on top of it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

from kvstore.block import BlockKey, BlockMeta, checksum
from kvstore.errors import BlockTooLarge, CorruptBlock, InvalidArgument, TierFull, TierUnavailable
from kvstore.shm.arena import HEADER_BYTES, MAGIC, ArenaMismatch, ShmArena
from kvstore.tiers.ram import HostRamTier

PAGE = 4096
REPO = Path(__file__).resolve().parents[2]

# A client process: attach, write bytes at an offset, close without unlinking.
CHILD_WRITER = """
import sys
from kvstore.shm.arena import ShmArena
path, token, offset, payload = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3]), bytes.fromhex(sys.argv[4])
arena = ShmArena.attach(path, token)
view = arena.view(offset, len(payload))
view[:] = payload
view.release()
arena.close()
"""


def run_child_writer(path: str, token: bytes, offset: int, payload: bytes) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run(
        [sys.executable, "-c", CHILD_WRITER, path, token.hex(), str(offset), payload.hex()],
        check=True,
        env=env,
        timeout=60,
    )


def random_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def key(name: str) -> BlockKey:
    return BlockKey("test-ns", name.encode())


def meta_of(data: bytes) -> BlockMeta:
    return BlockMeta(size=len(data), checksum=checksum(data))


# ---- ShmArena ---------------------------------------------------------------


@pytest.fixture
def arena(tmp_path):
    a = ShmArena.create(16 * PAGE, str(tmp_path), "arena")
    yield a
    a.close(unlink=True)


def test_create_writes_header_and_sizes_file(arena, tmp_path):
    assert arena.path == str(tmp_path / "arena")
    assert arena.size == 16 * PAGE
    assert len(arena.token) == 16
    assert os.path.getsize(arena.path) == HEADER_BYTES + 16 * PAGE
    assert Path(arena.path).read_bytes()[:8] == MAGIC
    assert os.stat(arena.path).st_mode & 0o777 == 0o600


def test_view_is_bounds_checked(arena):
    for offset, length in [(-1, 1), (0, -1), (16 * PAGE, 1), (16 * PAGE - 1, 2)]:
        with pytest.raises(ValueError):
            arena.view(offset, length)
    v = arena.view(16 * PAGE - 1, 1)  # the last byte is fine
    v.release()


def test_attach_shares_bytes_both_ways(arena):
    client = ShmArena.attach(arena.path, arena.token)
    try:
        assert client.size == arena.size
        w = arena.view(100, 5)
        w[:] = b"hello"
        r = client.view(100, 5)
        assert bytes(r) == b"hello"
        r[:] = b"HELLO"
        assert bytes(w) == b"HELLO"
        w.release()
        r.release()
    finally:
        client.close()
    assert os.path.exists(arena.path)  # a client's close never unlinks


def test_attach_with_wrong_token_is_refused(arena):
    with pytest.raises(ArenaMismatch, match="token"):
        ShmArena.attach(arena.path, bytes(16))


def test_attach_refuses_files_that_are_not_arenas(tmp_path):
    short = tmp_path / "short"
    short.write_bytes(b"x" * 100)
    with pytest.raises(ArenaMismatch):
        ShmArena.attach(str(short), bytes(16))
    other = tmp_path / "other"
    other.write_bytes(b"\0" * (HEADER_BYTES + PAGE))
    with pytest.raises(ArenaMismatch, match="magic"):
        ShmArena.attach(str(other), bytes(16))
    with pytest.raises(FileNotFoundError):
        ShmArena.attach(str(tmp_path / "missing"), bytes(16))


def test_attach_refuses_a_file_whose_size_differs_from_its_header(arena):
    os.truncate(arena.path, HEADER_BYTES + 32 * PAGE)
    with pytest.raises(ArenaMismatch, match="bytes"):
        ShmArena.attach(arena.path, arena.token)


def test_create_replaces_a_stale_file(tmp_path):
    stale = tmp_path / "arena"
    stale.write_bytes(b"left by a dead daemon")
    a = ShmArena.create(PAGE, str(tmp_path), "arena")
    try:
        assert os.path.getsize(a.path) == HEADER_BYTES + PAGE
        ShmArena.attach(a.path, a.token).close()
    finally:
        a.close(unlink=True)


def test_create_in_missing_directory_names_the_setting(tmp_path):
    with pytest.raises(TierUnavailable, match="--shm-dir") as e:
        ShmArena.create(PAGE, str(tmp_path / "nope"))
    assert str(tmp_path / "nope") in str(e.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_create_in_unwritable_directory_names_the_setting(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    try:
        with pytest.raises(TierUnavailable, match="--shm-dir"):
            ShmArena.create(PAGE, str(ro))
    finally:
        ro.chmod(0o700)


def test_create_larger_than_free_space_names_the_setting(tmp_path):
    with pytest.raises(TierUnavailable, match="--shm-dir"):
        ShmArena.create(1 << 62, str(tmp_path))
    assert not (tmp_path / "strata-arena").exists()


def test_close_with_live_view_raises_then_succeeds(tmp_path):
    a = ShmArena.create(PAGE, str(tmp_path), "arena")
    v = a.view(0, 10)
    with pytest.raises(BufferError, match="release"):
        a.close()
    assert not a.closed
    v.release()
    a.close(unlink=True)
    assert a.closed
    assert not os.path.exists(a.path)
    a.close(unlink=True)  # twice is fine
    with pytest.raises(ValueError, match="closed"):
        a.view(0, 1)


@pytest.mark.system
def test_separate_process_writes_and_leaves_the_file(arena):
    run_child_writer(arena.path, arena.token, 4096, b"from the child")
    v = arena.view(4096, 14)
    assert bytes(v) == b"from the child"
    v.release()
    # The child attached and exited: nothing (no resource tracker) unlinked the file.
    assert os.path.exists(arena.path)
    ShmArena.attach(arena.path, arena.token).close()


@pytest.mark.system
@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_default_directory_is_dev_shm():
    name = f"strata-test-{uuid.uuid4().hex}"
    a = ShmArena.create(PAGE, name=name)
    try:
        assert a.path == f"/dev/shm/{name}"
        run_child_writer(a.path, a.token, 0, b"x")
        v = a.view(0, 1)
        assert bytes(v) == b"x"
        v.release()
        assert os.path.exists(a.path)
    finally:
        a.close(unlink=True)
    assert not os.path.exists(f"/dev/shm/{name}")


# ---- HostRamTier --------------------------------------------------------------


@pytest.fixture
def tier(tmp_path):
    t = HostRamTier(16 * PAGE, shm_dir=str(tmp_path), arena_name="ram")
    yield t
    t.close()


def test_put_get_roundtrip_and_repeated_put(tier):
    data = random_bytes(5000)
    assert tier.put(key("a"), data, meta_of(data))
    assert tier.contains(key("a"))
    assert tier.meta(key("a")) == meta_of(data)
    assert tier.get(key("a")) == data
    assert not tier.put(key("a"), b"other", meta_of(b"other"))  # present: no-op
    assert tier.get(key("a")) == data
    assert tier.stats().blocks == 1
    assert tier.stats().used_bytes == 2 * PAGE
    assert tier.get(key("missing")) is None
    assert tier.meta(key("missing")) is None


def test_put_with_bad_checksum_or_size_raises_and_frees(tier):
    data = b"payload"
    with pytest.raises(CorruptBlock):
        tier.put(key("a"), data, BlockMeta(len(data), checksum(data) ^ 1))
    with pytest.raises(CorruptBlock):
        tier.put(key("a"), data, BlockMeta(len(data) + 1, checksum(data)))
    assert not tier.contains(key("a"))
    assert tier.stats().used_bytes == 0
    assert tier.largest_free_bytes == tier.capacity_bytes


def test_get_of_corrupted_bytes_drops_the_block(tier):
    data = random_bytes(PAGE)
    tier.put(key("a"), data, meta_of(data))
    offset, _ = tier.locate(key("a"))
    v = tier.view(offset, 1)
    v[0] ^= 0xFF
    v.release()
    with pytest.raises(CorruptBlock):
        tier.get(key("a"))
    assert not tier.contains(key("a"))
    assert tier.stats().used_bytes == 0


def test_tier_full_until_something_is_deleted(tier):
    big = random_bytes(12 * PAGE)
    tier.put(key("big"), big, meta_of(big))
    other = random_bytes(8 * PAGE, seed=1)
    with pytest.raises(TierFull):
        tier.put(key("other"), other, meta_of(other))
    assert tier.stats().used_bytes == 12 * PAGE  # the failed put left nothing behind
    assert tier.delete(key("big"))
    assert not tier.delete(key("big"))
    assert tier.put(key("other"), other, meta_of(other))


def test_block_larger_than_the_tier_is_refused(tier):
    with pytest.raises(BlockTooLarge):
        tier.reserve(tier.capacity_bytes + 1)


def test_lru_order_get_and_touch(tier):
    for name in "abc":
        tier.put(key(name), name.encode(), meta_of(name.encode()))
    assert list(tier.lru()) == [key("a"), key("b"), key("c")]
    tier.get(key("a"))
    assert list(tier.lru()) == [key("b"), key("c"), key("a")]
    tier.touch(key("b"))
    tier.touch(key("missing"))
    tier.meta(key("c"))  # does not count as a use
    tier.locate(key("c"))
    assert list(tier.lru()) == [key("c"), key("a"), key("b")]
    for k in tier.lru():  # a snapshot: deleting while iterating is safe
        tier.delete(k)
    assert tier.stats().blocks == 0


def test_reserve_commit_locate(tier):
    data = random_bytes(3 * PAGE + 1)
    offset = tier.reserve(len(data))
    assert tier.stats().used_bytes == 4 * PAGE  # reserved counts as used
    assert tier.stats().blocks == 0
    v = tier.view(offset, len(data))
    v[:] = data
    v.release()
    assert tier.commit(key("a"), offset, meta_of(data))
    assert tier.locate(key("a")) == (offset, meta_of(data))
    assert tier.get(key("a")) == data
    assert tier.locate(key("missing")) is None


def test_one_region_addresses_every_offset(tier):
    """The arena is one region: a reader in another process maps it whole, offsets unchanged."""
    for name in "ab":
        data = random_bytes(PAGE, seed=ord(name))
        tier.put(key(name), data, meta_of(data))
    offsets = [tier.locate(key(name))[0] for name in "ab"]
    assert offsets[1] != 0 and [tier.handle_of(o) for o in offsets] == [(0, o) for o in offsets]


def test_commit_of_present_key_frees_the_extent(tier):
    tier.put(key("a"), b"first", meta_of(b"first"))
    used = tier.stats().used_bytes
    offset = tier.reserve(PAGE)
    assert not tier.commit(key("a"), offset, meta_of(b"first"))
    assert tier.stats().used_bytes == used
    assert tier.get(key("a")) == b"first"


def test_commit_of_corrupted_bytes_raises_and_frees(tier):
    data = random_bytes(2 * PAGE)
    offset = tier.reserve(len(data))
    v = tier.view(offset, len(data))
    v[:] = data
    v[7] ^= 1  # torn write
    v.release()
    with pytest.raises(CorruptBlock):
        tier.commit(key("a"), offset, meta_of(data))
    assert not tier.contains(key("a"))
    assert tier.stats().used_bytes == 0
    with pytest.raises(ValueError):
        tier.unreserve(offset)  # the reservation was consumed


def test_commit_without_verify_trusts_the_writer(tier):
    offset = tier.reserve(10)
    assert tier.commit(key("a"), offset, BlockMeta(10, 0), verify=False)
    with pytest.raises(CorruptBlock):  # caught on the way out instead
        tier.get(key("a"))


def test_commit_larger_than_the_extent_is_refused_and_frees(tier):
    offset = tier.reserve(PAGE)
    with pytest.raises(InvalidArgument):
        tier.commit(key("a"), offset, BlockMeta(PAGE + 1, 0))
    assert tier.stats().used_bytes == 0


def test_unreserve_and_unknown_offsets(tier):
    offset = tier.reserve(PAGE)
    tier.unreserve(offset)
    assert tier.stats().used_bytes == 0
    with pytest.raises(ValueError):
        tier.unreserve(offset)
    with pytest.raises(ValueError):
        tier.commit(key("a"), offset, meta_of(b""))
    tier.put(key("b"), b"x", meta_of(b"x"))
    block_offset, _ = tier.locate(key("b"))
    with pytest.raises(ValueError):
        tier.unreserve(block_offset)  # a block is not a reservation
    assert tier.get(key("b")) == b"x"


def test_empty_block_takes_one_page(tier):
    assert tier.put(key("empty"), b"", meta_of(b""))
    assert tier.get(key("empty")) == b""
    assert tier.stats().used_bytes == PAGE


@pytest.mark.system
def test_client_process_writes_a_reserved_slot(tier):
    data = random_bytes(PAGE + 17)
    offset = tier.reserve(len(data))
    run_child_writer(tier.arena.path, tier.arena.token, offset, data)
    assert tier.commit(key("a"), offset, meta_of(data))
    assert tier.get(key("a")) == data


@pytest.mark.parametrize("size", [4 << 10, 64 << 20])
def test_small_and_large_blocks_roundtrip(tmp_path, size):
    t = HostRamTier(size + PAGE, shm_dir=str(tmp_path), arena_name="ram")
    try:
        data = random_bytes(size, seed=size)
        assert t.put(key("put"), data, meta_of(data))
        assert t.get(key("put")) == data
        assert t.delete(key("put"))
        offset = t.reserve(size)
        v = t.view(offset, size)
        v[:] = data
        v.release()
        assert t.commit(key("slot"), offset, meta_of(data))
        offset, meta = t.locate(key("slot"))
        v = t.view(offset, meta.size)
        assert checksum(v) == meta.checksum
        v.release()
    finally:
        t.close()


def test_concurrent_puts_and_gets_keep_accounting(tmp_path):
    t = HostRamTier(256 * PAGE, shm_dir=str(tmp_path), arena_name="ram")
    blocks = {key(f"k{i}"): random_bytes(PAGE * (1 + i % 3), seed=i) for i in range(48)}
    errors: list[BaseException] = []

    def worker(keys):
        try:
            for k in keys:
                t.put(k, blocks[k], meta_of(blocks[k]))
                assert t.get(k) == blocks[k]
        except BaseException as e:  # surfaced below
            errors.append(e)

    items = list(blocks)
    threads = [threading.Thread(target=worker, args=(items[i::4],)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    try:
        assert not errors
        stats = t.stats()
        assert stats.blocks == len(blocks)
        assert stats.used_bytes == sum(len(b) for b in blocks.values())
    finally:
        t.close()


def test_close_removes_the_arena_file(tmp_path):
    t = HostRamTier(4 * PAGE, shm_dir=str(tmp_path), arena_name="ram")
    path = t.arena.path
    assert os.path.exists(path)
    t.close()
    assert not os.path.exists(path)


def test_tier_in_missing_directory_is_unavailable(tmp_path):
    with pytest.raises(TierUnavailable, match="--shm-dir"):
        HostRamTier(4 * PAGE, shm_dir=str(tmp_path / "nope"))
