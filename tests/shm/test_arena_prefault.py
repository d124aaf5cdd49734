"""Faulting the arena's pages in ahead of the writes (MADV_POPULATE_WRITE): every page becomes backed,
no byte changes (a kept arena's blocks survive it), a close stops it within a chunk, and a tmpfs that
runs out of room stops it with a warning while the tier keeps serving."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from kvstore.block import BlockKey, BlockMeta, checksum
from kvstore.shm.arena import Prefault, ShmArena, filesystem_of
from kvstore.tiers.ram import HostRamTier
from tests.support.small_filesystem import tmpfs
from tests.support.wait import wait_until

MiB = 1 << 20


def block(n: int, seed: int) -> tuple[BlockKey, bytes, BlockMeta]:
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    return BlockKey("ns", b"k%d" % seed), data, BlockMeta(len(data), checksum(data))


def test_a_prefaulted_arena_is_backed_to_its_last_page_and_its_bytes_are_unchanged(tmp_path):
    with tmpfs(tmp_path / "shm", "64m") as shm:
        arena = ShmArena.create(32 * MiB, str(shm), "arena")
        view = arena.view(5 * MiB, 4096)
        view[:] = b"x" * 4096  # written before the prefault reaches it
        view.release()
        assert arena.unbacked_bytes() > 30 * MiB  # sparse: only the header and that page
        arena.prefault()
        assert arena.unbacked_bytes() == 0
        view = arena.view(5 * MiB, 4096)
        assert bytes(view) == b"x" * 4096
        view.release()
        arena.close(unlink=True)


def test_a_kept_arena_reopened_with_prefault_keeps_every_block(tmp_path):
    with tmpfs(tmp_path / "shm", "64m") as shm:
        first = HostRamTier(16 * MiB, shm_dir=str(shm), arena_name="a", crash_safe=True, keep_on_exit=True)
        blocks = [block(300_000, seed) for seed in range(8)]
        for key, data, meta in blocks:
            assert first.put(key, data, meta)
        first.close()
        again = HostRamTier(16 * MiB, shm_dir=str(shm), arena_name="a", crash_safe=True, keep_on_exit=False,
                            prefault=True)
        wait_until(lambda: again.arena.unbacked_bytes() == 0, what="the reopened arena to be faulted in")
        assert [again.get(key) for key, _, _ in blocks] == [data for _, data, _ in blocks]
        again.close()
        assert os.listdir(shm) == []


def test_an_arena_kept_at_a_graceful_stop_gives_back_the_pages_no_block_uses(tmp_path):
    """A trial's kept arena takes the memory of its blocks, not its whole size: the prefault is undone
    where nothing is stored, and the next start still finds every block."""
    with tmpfs(tmp_path / "shm", "64m") as shm:
        tier = HostRamTier(32 * MiB, shm_dir=str(shm), arena_name="a", crash_safe=True, keep_on_exit=True,
                           prefault=True)
        wait_until(lambda: tier.arena.unbacked_bytes() == 0, what="the arena to be faulted in")
        blocks = [block(1 * MiB, seed) for seed in range(3)]
        for key, data, meta in blocks:
            assert tier.put(key, data, meta)
        arena_path = tier.arena.path
        tier.close()
        st = os.stat(arena_path)
        assert st.st_blocks * 512 < 5 * MiB  # about the 3 MiB of blocks and the header, not 32 MiB
        again = HostRamTier(32 * MiB, shm_dir=str(shm), arena_name="a", crash_safe=True, keep_on_exit=False)
        assert [again.get(key) for key, _, _ in blocks] == [data for _, data, _ in blocks]
        again.close()


def test_closing_the_tier_stops_the_prefault_within_a_chunk(tmp_path):
    with tmpfs(tmp_path / "shm", "600m") as shm:
        tier = HostRamTier(512 * MiB, shm_dir=str(shm), arena_name="a", prefault=True)
        key, data, meta = block(64 << 10, 1)
        assert tier.put(key, data, meta) and tier.get(key) == data  # serving while it runs
        tier.close()  # joins the thread: nothing touches the mapping after
        assert tier._prefault.done_bytes <= 512 * MiB
        assert os.listdir(shm) == []


def test_a_tmpfs_that_runs_out_of_room_stops_the_prefault_with_a_warning(tmp_path, caplog):
    with tmpfs(tmp_path / "shm", "40m") as shm:
        arena = ShmArena.create(32 * MiB, str(shm), "arena")
        filler = shm / "other"
        filler.write_bytes(b"\0" * (30 * MiB))  # someone else takes the room the arena was going to use
        with caplog.at_level(logging.WARNING, logger="kvstore.shm.arena"):
            run = Prefault(arena, chunk=4 * MiB)
            wait_until(lambda: not run._thread.is_alive(), what="the prefault to give up")
        assert run.done_bytes < 32 * MiB
        assert "stopped faulting its pages in" in caplog.text and "ram.prefault = false" in caplog.text
        view = arena.view(0, 4096)  # what it did populate stays usable
        view[:] = b"y" * 4096
        assert bytes(view) == b"y" * 4096
        view.release()
        arena.close(unlink=True)


def test_an_arena_on_a_disks_file_system_is_not_prefaulted(tmp_path):
    """A page faulted in there would be a disk block allocated and written back: the first write pays instead."""
    if filesystem_of(tmp_path) == "tmpfs":
        pytest.skip("the temporary directory is a tmpfs here")
    tier = HostRamTier(32 * MiB, shm_dir=str(tmp_path), arena_name="a", prefault=True)
    assert tier.prefaults is False
    assert tier.arena.unbacked_bytes() > 30 * MiB
    tier.close()


def test_prefault_is_the_daemons_default_and_a_setting():
    from kvstore.config import load_settings

    assert load_settings(environ={}).tiers.ram.prefault is True
    assert load_settings(environ={}, ram_prefault=False).tiers.ram.prefault is False
    assert load_settings(environ={}).tiers.ram.tier_options(Path("state"))["prefault"] is True
