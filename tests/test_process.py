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


from kvstore import Client, TierName
from conftest import wait_until

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
    daemon = daemon_process("--lease-seconds", "1", "--pin-lease-seconds", "1")
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
        assert after.tiers["host"]["used_bytes"] == baseline + 102400  # only the committed block (25 pages) remains
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
    """`strata serve` with no flags: only the ports move, so tests never collide with a real daemon."""
    from conftest import free_port

    port, metrics_port = free_port(), free_port()
    env = dict(os.environ, HOME=str(tmp_path), STRATA_LISTEN=f"127.0.0.1:{port}",
               STRATA_METRICS_LISTEN=f"127.0.0.1:{metrics_port}")
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
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
        assert 'strata_tier_capacity_bytes{tier="host"} 1.073741824e+09' in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    line = next(l for l in out.splitlines() if "strata serving" in l)
    assert json.loads(line)["level"] == "INFO"  # structured logs by default
