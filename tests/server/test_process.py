"""The daemon and its clients as real processes, killed with real signals."""

from __future__ import annotations

import hashlib
import json
import os
import urllib.request
import signal
import subprocess
import sys
import threading
from pathlib import Path


import pytest

from benchmarks.harness import free_port
from kvstore import BlockPut, Client, TierName
from kvstore.config.tiers import arena_name
from kvstore.errors import InvalidArgument
from kvstore.transport.samehost import frames
from kvstore.wire.unix import connect_unix
from tests.support.wait import wait_until

pytestmark = pytest.mark.system

MiB = 1 << 20


def value(i: int, size: int = 512 << 10) -> bytes:
    seed = hashlib.sha256(b"%d" % i).digest()
    return (seed * (size // len(seed) + 1))[:size]


def test_sigkill_mid_stream_then_restart_loses_nothing_on_disk(daemon_process):
    daemon = daemon_process()
    with Client(daemon.target) as c:
        first_epoch = c.stats().epoch
    acked: list[int] = []
    stop = threading.Event()
    on_disk_before_kill: list[int] = []

    def writer():
        with Client(daemon.target, use_shm=False, retries=0, timeout=5) as c:
            i = 0
            while not stop.is_set():
                try:
                    c.put("m", b"k%d" % i, value(i))
                except Exception:
                    return  # the daemon died under us
                acked.append(i)
                i += 1

    t = threading.Thread(target=writer)
    t.start()
    wait_until(lambda: len(acked) >= 120, what="120 acknowledged puts")  # 60 MiB: well past the 32 MiB RAM tier
    with Client(daemon.target, use_shm=False) as c:
        snapshot = list(acked)
        tiers = [c.exists("m", [b"k%d" % i]) for i in snapshot]
        on_disk_before_kill = [i for i, t_ in zip(snapshot, tiers) if t_ == [TierName.DISK]]
    assert on_disk_before_kill, "RAM pressure should have demoted blocks to disk"
    assert daemon.kill(signal.SIGKILL) == -signal.SIGKILL  # puts still streaming
    stop.set()
    t.join(10)

    daemon.start()  # same cache directory
    with Client(daemon.target) as c:
        for i in on_disk_before_kill:  # everything that had reached disk survived, byte for byte
            assert c.get("m", b"k%d" % i) == value(i), i
        present = 0
        for i in range(max(acked) + 2):  # and nothing present is torn
            got = c.get("m", b"k%d" % i)
            if got is not None:
                assert got == value(i)
                present += 1
        assert present >= len(on_disk_before_kill)
        assert c.stats().epoch > first_epoch
    assert not list(Path(daemon.disk_dir).rglob("*.tmp"))


def blob(key: bytes, size: int) -> bytes:
    seed = hashlib.sha256(key).digest()
    return (seed * (size // len(seed) + 1))[:size]


# name, bytes per block, blocks per call, use_shm: the same-host path in place (slots: above
# 256 KiB), inline in the request, in batches, and the gRPC stream.
WRITERS = [("slots", 320 << 10, 1, True), ("inline", 64 << 10, 1, True), ("batch", 96 << 10, 6, True),
           ("stream", 64 << 10, 1, False)]


def test_sigkill_then_restart_loses_no_acknowledged_block_repeated(daemon_process):
    """Writers on every path while the daemon is SIGKILLed, round after round: every put that was
    acknowledged is there after the restart, byte for byte, whether it had reached disk or was only in RAM."""
    # Room on disk for every block: capacity must lose none. A declared namespace: a miss is an answer.
    daemon = daemon_process("--disk-bytes", "1GiB", "--namespaces", "m")
    acked: dict[bytes, bytes] = {}
    attempted: dict[bytes, bytes] = {}
    lock = threading.Lock()
    ram_only_at_kill = 0
    for round_ in range(4):
        stop = threading.Event()

        def writer(name: str, size: int, per_call: int, use_shm: bool) -> None:
            with Client(daemon.target, use_shm=use_shm, retries=0, timeout=5) as c:
                i = 0
                while not stop.is_set():
                    keys = [b"r%d-%s-%d" % (round_, name.encode(), i + j) for j in range(per_call)]
                    values = [blob(k, size) for k in keys]
                    with lock:
                        attempted.update(zip(keys, values))
                    try:
                        if per_call == 1:
                            c.put("m", keys[0], values[0])
                        else:
                            c.put_many("m", [BlockPut(k, v) for k, v in zip(keys, values)])
                    except Exception:
                        return  # the daemon died under us: this call was never acknowledged
                    with lock:
                        acked.update(zip(keys, values))
                    i += per_call

        threads = [threading.Thread(target=writer, args=w) for w in WRITERS]
        for t in threads:
            t.start()
        goal = 150 * (round_ + 1)
        wait_until(lambda: len(acked) >= goal, timeout=120, what=f"{goal} acknowledged puts")
        with Client(daemon.target, use_shm=False) as c:
            with lock:
                snapshot = list(acked)
            for at in range(0, len(snapshot), 200):
                ram_only_at_kill += c.exists("m", snapshot[at : at + 200]).count(TierName.HOST)
        assert daemon.kill(signal.SIGKILL) == -signal.SIGKILL  # writers still writing
        stop.set()
        for t in threads:
            t.join(30)
        daemon.start()
        with Client(daemon.target) as c:
            lost = [k for k, v in acked.items() if c.get("m", k) != v]
            assert not lost, f"round {round_}: {len(lost)} of {len(acked)} acknowledged blocks lost, e.g. {lost[:3]}"
            for k in attempted.keys() - acked.keys():  # in flight at the kill: there whole, or not at all
                got = c.get("m", k)
                assert got is None or got == attempted[k], k
    assert ram_only_at_kill > 0, "some acknowledged blocks should have been in RAM only when the daemon died"
    assert not list(Path(daemon.disk_dir).rglob("*.tmp"))


def arena_file(daemon) -> Path:
    return daemon.disk_dir.parent / arena_name(daemon.disk_dir.resolve())


def test_a_block_damaged_in_the_arena_between_runs_is_discarded_not_served(daemon_process):
    metrics_port = free_port()
    daemon = daemon_process("--metrics-listen", f"127.0.0.1:{metrics_port}", "--namespaces", "m")
    keys = [b"k%d" % i for i in range(5)]
    with Client(daemon.target) as c:
        for k in keys:
            c.put("m", k, blob(k, 100_000))
        assert all(c.exists("m", [k]) == [TierName.HOST] for k in keys)  # only in RAM
    assert daemon.kill(signal.SIGKILL) == -signal.SIGKILL
    path = arena_file(daemon)
    raw = path.read_bytes()
    at = raw.find(blob(keys[2], 100_000))
    assert at > 0
    with open(path, "r+b") as f:
        f.seek(at + 5000)
        f.write(bytes([raw[at + 5000] ^ 0x40]))
    del raw
    daemon.start()
    with Client(daemon.target) as c:
        assert c.get("m", keys[2]) is None  # never served: it had no other copy
        for k in keys[:2] + keys[3:]:
            assert c.get("m", k) == blob(k, 100_000)
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
    assert 'strata_ram_recovered_blocks_total{arena="default",outcome="corrupt"} 1.0' in metrics
    assert 'strata_ram_recovered_blocks_total{arena="default",outcome="adopted"} 4.0' in metrics
    assert 'strata_ram_recovered_bytes_total{arena="default"} 400000.0' in metrics
    assert 'strata_ram_arena_readopted{arena="default"} 1.0' in metrics
    assert "re-adopted 4 blocks" in daemon.log.read_text()


def test_stop_and_start_keeps_the_ram_cache_warm(daemon_process):
    """An upgrade: SIGTERM, start again. The RAM blocks are still in RAM (and copied to disk for a reboot)."""
    daemon = daemon_process()
    keys = [b"k%d" % i for i in range(20)]
    stale = Client(daemon.target)  # a same-host client of the first run, still open across the restart
    with Client(daemon.target) as c:
        assert c.shared_memory
        for k in keys:
            c.put("m", k, blob(k, 200_000))
        assert stale.get("m", keys[0]) == blob(keys[0], 200_000)
    old_token = same_host_token(stale)
    assert daemon.kill(signal.SIGTERM) == 0
    assert arena_file(daemon).exists()
    daemon.start()
    with Client(daemon.target) as c:
        assert all(c.exists("m", [k]) == [TierName.HOST] for k in keys)
        assert all(c.get("m", k) == blob(k, 200_000) for k in keys)
        assert c.stats().tiers["disk"]["blocks"] == len(keys)
        new_token = same_host_token(c)
    assert new_token != old_token
    # The new daemon refuses the first run's token (StaleAttachment on the client's side); the
    # client attaches again and is served under the new token, never under the old one.
    try:
        assert stale.get("m", keys[1]) == blob(keys[1], 200_000)
        assert same_host_token(stale) == new_token
    finally:
        stale.close()
    with pytest.raises(InvalidArgument, match="attach again"):  # the daemon's side: the old token is refused
        with connect_unix(same_host_path(daemon), 30) as raw:  # the path may pass sun_path's 107 bytes
            frames.send(raw, frames.encode([frames.HELLO, 1, [frames.PROTOCOL_VERSION, old_token]]))
            _, status, result = frames.FrameReader(raw).read()[0]
            assert status == frames.ERROR
            frames.raise_error(result)


def same_host_token(client: Client) -> bytes:
    [transport] = {id(t): t for t in client._transports.values()}.values()
    return transport._token


def same_host_path(daemon) -> str:
    with Client(daemon.target) as c:
        c.stats()
        [transport] = {id(t): t for t in (c._data(""),)}.values()
        return transport._path


def test_ram_keep_on_exit_off_removes_the_arena_at_stop(daemon_process):
    daemon = daemon_process("--no-ram-keep-on-exit")
    with Client(daemon.target) as c:
        c.put("m", b"k", b"v" * 1000)
    assert arena_file(daemon).exists()
    assert daemon.kill(signal.SIGTERM) == 0
    assert not arena_file(daemon).exists() and not Path(str(arena_file(daemon)) + ".table").exists()
    daemon.start()
    with Client(daemon.target) as c:
        assert c.exists("m", [b"k"]) == [TierName.DISK]  # written down before exit, as before


def test_sigterm_drains_and_keeps_ram_blocks(daemon_process):
    daemon = daemon_process()
    with Client(daemon.target) as c:
        for i in range(10):
            c.put("m", b"k%d" % i, value(i))
    assert daemon.kill(signal.SIGTERM) == 0
    daemon.start()
    with Client(daemon.target) as c:
        for i in range(10):
            assert c.get("m", b"k%d" % i) == value(i)


CLIENT_HOLDING_LEASES = r"""
import sys, time
from kvstore.api.v1 import kv_pb2 as pb
from kvstore.client.sync import Client
with Client(sys.argv[1], use_shm=True) as c:
    assert c.shared_memory
    c.put("m", b"kept", b"x" * 100000)
    stub = c._stub
    stub.Allocate(pb.AllocateRequest(namespace="m", blocks=[pb.BlockHeader(key=b"slot%d" % i, size=1 << 20) for i in range(8)]))
    stub.Lookup(pb.LookupRequest(namespace="m", keys=[b"kept"]))
    c.pin("m", [b"kept"])
    print("holding", flush=True)
    time.sleep(600)
"""


def test_client_killed_holding_leases_gives_its_space_back(daemon_process, tmp_path):
    daemon = daemon_process("--lease-seconds", "1", "--pin-lease-seconds", "1", "--lapsed-slot-hold-seconds", "1")
    with Client(daemon.target) as c:
        c.put("m", b"warm", b"w")
        baseline = c.stats().tiers["host"]["used_bytes"]
    child = subprocess.Popen(
        [sys.executable, "-c", CLIENT_HOLDING_LEASES, daemon.target], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "holding"
    with Client(daemon.target) as c:
        held = c.stats()
        assert held.open_slots == 8 and held.active_leases >= 10
        assert held.tiers["host"]["used_bytes"] >= baseline + 8 * MiB
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        wait_until(lambda: c.stats().active_leases == 0, what="the dead client's leases to expire")
        after = c.stats()
        assert after.open_slots == 0 and after.pinned_blocks == 0
        # its lapsed slots' extents are held a second more (a stalled writer may still copy), then freed:
        # only the committed block (25 pages) remains
        wait_until(lambda: c.stats().tiers["host"]["used_bytes"] == baseline + 102400,
                   what="the lapsed slots' extents to be given back")
        assert c.get("m", b"kept") == b"x" * 100000


def test_cli_against_a_running_daemon(daemon_process, tmp_path):
    daemon = daemon_process()
    src = tmp_path / "blob.bin"
    src.write_bytes(value(5, 300_000))
    cli = [sys.executable, "-m", "kvstore.cli.main"]

    def run(*args, **kw):
        return subprocess.run([*cli, *args, "--target", daemon.target], capture_output=True, **kw)

    r = run("kv", "put", "m", "blob", str(src))
    assert r.returncode == 0 and b"stored" in r.stdout
    r = run("kv", "get", "m", "blob")
    assert r.returncode == 0 and r.stdout == value(5, 300_000)
    r = run("kv", "stat", "m", "blob", "nothing")
    assert r.returncode == 3 and b"blob\thost" in r.stdout and b"nothing\tabsent" in r.stdout
    r = run("kv", "get", "m", "nothing")
    assert r.returncode == 3 and b"no block" in r.stderr
    r = run("stats")
    assert r.returncode == 0 and b"1 blocks" in r.stdout
    r = run("kv", "get", "typo-ns", "blob")
    assert r.returncode == 1 and b"unknown to this daemon" in r.stderr
    d = tmp_path / "many"
    d.mkdir()
    for i in range(5):
        (d / f"f{i}").write_bytes(value(i, 1000))
    r = run("kv", "put", "m", "--from-dir", str(d))
    assert r.returncode == 0 and b"stored 5 new blocks" in r.stdout
    r = run("kv", "list", "m", "--prefix", "f", "--limit", "3")
    assert r.returncode == 0 and r.stdout == b"f0\t1000\thost\nf1\t1000\thost\nf2\t1000\thost\n"
    many = subprocess.Popen([*cli, "kv", "list", "m", "--target", daemon.target], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    many.stdout.close()  # as `| head -0` would: the listing meets a closed pipe
    assert many.wait(timeout=60) == 0 and b"Traceback" not in many.stderr.read()
    r = run("kv", "list", "m", "--json")
    assert [json.loads(line)["key"] for line in r.stdout.splitlines()] == ["blob", "f0", "f1", "f2", "f3", "f4"]


def test_serve_refuses_bad_settings_with_the_fix(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "kvstore.cli.main", "serve", "--ram-bytes", "lots", "--disk-dir", str(tmp_path)],
        capture_output=True, text=True,
    )
    assert r.returncode == 2
    assert "ram_bytes (flag --ram-bytes, env STRATA_RAM_BYTES)" in r.stderr


def test_second_daemon_on_the_same_directory_is_refused(daemon_process, tmp_path):
    first = daemon_process()
    r = subprocess.run(
        [sys.executable, "-m", "kvstore.cli.main", "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "",
         "--disk-dir", str(first.disk_dir), "--shm-dir", str(tmp_path), "--ram-bytes", "32MiB", "--max-block-bytes", "8MiB"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 1
    assert "another strata daemon is using" in r.stderr


def test_serve_starts_with_embedded_defaults(tmp_path):
    """`strata serve` with no flags: only the ports and the arena's directory move (by environment),
    so tests never collide with a real daemon nor leave an arena in the host's /dev/shm."""
    from benchmarks.harness import free_port

    port, metrics_port = free_port(), free_port()
    env = dict(os.environ, HOME=str(tmp_path), STRATA_LISTEN=f"127.0.0.1:{port}",
               STRATA_METRICS_LISTEN=f"127.0.0.1:{metrics_port}", STRATA_SHM_DIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli.main", "serve"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def up():
            try:
                with Client(f"127.0.0.1:{port}", timeout=1, retries=0) as c:
                    return c.stats()
            except Exception:
                assert proc.poll() is None, proc.stdout.read()
                return None

        stats = wait_until(up, what="strata serve with defaults")
        assert stats.tiers["host"]["capacity_bytes"] == 1 << 30
        assert stats.tiers["disk"]["capacity_bytes"] == 10 << 30
        assert (tmp_path / ".cache" / "strata" / "epoch").exists()
        assert (tmp_path / arena_name((tmp_path / ".cache" / "strata").resolve())).exists()  # STRATA_SHM_DIR
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
        assert 'strata_tier_capacity_bytes{tier="host"} 1.073741824e+09' in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    line = next(l for l in out.splitlines() if "strata serving" in l)
    assert json.loads(line)["level"] == "INFO"  # structured logs by default
