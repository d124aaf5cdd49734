"""The kv_pool benchmark's Mooncake Store driver: a clear note where Mooncake cannot run, and rounds that
move what they claim where it can (a real master, holder process and client; skipped where not installed).

No timings are judged here: the figures live in ``benchmarks/results/kv_pool.json``.
"""

from __future__ import annotations

import sys

import pytest

from benchmarks import mooncake_store
from benchmarks.harness import ServerUnavailable

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _keep_env(monkeypatch):
    for key in mooncake_store.CLIENT_ENV:  # available() sets them; give them back afterwards
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # the import fails as if it were missing


def test_unavailable_says_why_and_how_to_enable(not_installed):
    ok, why = mooncake_store.available()
    assert not ok
    assert "mooncake.store cannot be imported" in why
    assert "pip install mooncake-transfer-engine-non-cuda" in why and "libibverbs1" in why
    assert "--no-mooncake" in why


def test_auto_mode_yields_the_reason_and_a_row_that_records_it(not_installed):
    with mooncake_store.optional_cluster("auto", 64 * MiB) as (client, why):
        assert client is None
        assert "pip install mooncake-transfer-engine-non-cuda" in why
    row = mooncake_store.left_out(why).to_json()
    assert row["value"] is None and row["meets_target"] is None
    assert why in row["note"]


def test_on_mode_refuses_to_run_without_it(not_installed):
    with pytest.raises(SystemExit, match="--mooncake: Mooncake Store cannot run here: mooncake.store"):
        with mooncake_store.optional_cluster("on", 64 * MiB):
            pass


def test_off_mode_starts_nothing(not_installed):
    with mooncake_store.optional_cluster("off", 64 * MiB) as (client, why):
        assert client is None and "--no-mooncake" in why


@pytest.mark.system
def test_a_master_that_exits_is_reported_not_waited_for(tmp_path):
    exe = tmp_path / "mooncake_master"
    exe.write_text("#!/bin/sh\necho 'E1201 bind failed: address in use' >&2\nexit 3\n")
    exe.chmod(0o755)
    with pytest.raises(ServerUnavailable, match="mooncake_master did not start: .*bind failed"):
        with mooncake_store.master(str(exe), start_timeout_s=5):
            pass


@pytest.mark.system
@pytest.mark.slow
def test_rounds_move_their_bytes_through_a_holder_process():
    ok, why = mooncake_store.available()
    if not ok:
        pytest.skip(why)
    size, batch = 1 * MiB, 2
    with mooncake_store.cluster(64 * MiB) as client:
        for _ in range(2):  # the second round finds the put keys removed, so it moves the bytes again
            rounds = client.rounds("1MiB", size, batch, single_calls=3, batch_calls=2)
            assert set(rounds) == {mooncake_store.name(op, "1MiB", n) for op in ("get", "put") for n in (1, batch)}
            moved = {name: fn()[0] for name, fn in rounds.items() for _ in range(2)}
            assert moved == {
                mooncake_store.name("get", "1MiB", 1): 3 * size,
                mooncake_store.name("get", "1MiB", batch): 2 * batch * size,
                mooncake_store.name("put", "1MiB", 1): 3 * size,
                mooncake_store.name("put", "1MiB", batch): 2 * batch * size,
            }
