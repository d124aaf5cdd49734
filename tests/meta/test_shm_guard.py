"""The /dev/shm guard of tests/conftest.py (tests/support/shm_guard.py): what a test leaves there is named and removed;
what another process on the host made there is only reported."""

from __future__ import annotations

import os
import warnings

import pytest

from kvstore.config.tiers import arena_name
from tests.support import shm_guard

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")


def test_a_daemons_leftovers_under_this_runs_directories_are_named_and_removed(tmp_path):
    before = shm_guard.entries()
    name = arena_name((tmp_path / "state").resolve())
    left = [name, f"{name}.table", f"samehost-{name}.sock", f"{name}-team"]
    for n in left:
        (shm_guard.SHM / n).write_bytes(b"")
    (tmp_path / "state").mkdir()
    message = shm_guard.check(before, [tmp_path], "tests/x.py::test_y")
    assert message is not None and message.startswith("tests/x.py::test_y left ")
    assert all(n in message for n in left) and "--shm-dir" in message
    assert not any((shm_guard.SHM / n).exists() for n in left)


def test_an_entry_no_directory_of_this_run_explains_is_warned_about_and_left(tmp_path):
    before = shm_guard.entries()
    foreign = shm_guard.SHM / "strata-00112233445566ff"
    foreign.write_bytes(b"")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert shm_guard.check(before, [tmp_path], "tests/x.py::test_y") is None
        assert any("strata-00112233445566ff" in str(w.message) for w in seen)
        assert foreign.exists()
    finally:
        foreign.unlink()


def test_nothing_new_and_a_tests_own_named_arena_are_not_leaks(tmp_path):
    before = shm_guard.entries()
    assert shm_guard.check(before, [tmp_path], "t") is None
    own = shm_guard.SHM / "strata-test-0123abcd"  # a test's own arena (test_arena_ram), removed by it
    own.write_bytes(b"")
    try:
        assert shm_guard.check(before, [tmp_path], "t") is None
    finally:
        own.unlink()


def test_only_directories_made_since_the_test_began_are_walked(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    os.utime(old, (0, 0))  # mtime only: ctime cannot be set back, so compare against a later start
    since = shm_guard.now() + 3600
    assert shm_guard.recent(tmp_path, since) == []
    new.mkdir()
    assert set(shm_guard.recent(tmp_path, shm_guard.now() - 1)) == {old, new}
    # a disk tier's fan-out folders are not walked
    (new / "disk" / "ab" / "deeper").mkdir(parents=True)
    assert new / "disk" / "ab" not in set(shm_guard._directories(new))
