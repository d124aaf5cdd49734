"""``strata doctor`` against a healthy host and a misconfigured one.

The host is real: small tmpfs mounts (as tests/tiers/test_full_disk.py does; tests
run as root in CI and skip, saying why, where mounting is not permitted), a
real redis-server with and without a password, a real HTTP server standing
in for an S3 endpoint, ports held by real sockets, a real daemon holding its
cache directory. Only the memory limit is read from files a test writes,
laid out as the kernel's cgroup files are (a cgroup of a chosen size cannot
be made for one test without moving this process into it).
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from benchmarks.harness import free_port
from kvstore.config import load_settings
from kvstore.doctor import Host, Status, failed, run_checks
from tests.support import redis_servers
from tests.support.small_filesystem import tmpfs

pytestmark = pytest.mark.system

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def redis_server(tmp_path):
    if not redis_servers.available():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = redis_servers.RedisServer(tmp_path / "redis", password="doctor-secret-pw").wait_ready()
    yield server
    server.stop()


class _S3Like(http.server.BaseHTTPRequestHandler):
    """Answers as S3 answers an anonymous GET of its root: 403 with an XML error."""

    def do_GET(self):  # noqa: N802 - the stdlib's name
        body = b"<Error><Code>AccessDenied</Code></Error>"
        self.send_response(403)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def s3_endpoint():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _S3Like)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def doctor(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "kvstore.cli.main", "doctor", *args],
                          capture_output=True, text=True, timeout=180, env=environ)


def by_check(findings) -> dict[str, list]:
    out: dict[str, list] = {}
    for f in findings:
        out.setdefault(f["check"], []).append(f)
    return out


def test_a_healthy_host_passes_every_check(tmp_path, redis_server, s3_endpoint):
    with tmpfs(tmp_path / "shm", "48m") as shm, tmpfs(tmp_path / "nvme", "160m") as nvme:
        url = f"redis://:{redis_server.password}@127.0.0.1:{redis_server.port}/0"
        out = doctor("--json", "--shm-dir", str(shm), "--ram-bytes", "32MiB", "--disk-dir", str(nvme / "strata"),
                     "--disk-bytes", "128MiB", "--listen", f"127.0.0.1:{free_port()}",
                     "--metrics-listen", f"127.0.0.1:{free_port()}", "--index-url", url,
                     "--s3-endpoint", s3_endpoint)
    assert out.returncode == 0, out.stdout + out.stderr
    found = by_check(json.loads(out.stdout))
    assert [f["status"] for f in found["shm"]] == ["ok"]
    assert "32MiB" in found["shm"][0]["summary"] and "tmpfs" in found["shm"][0]["summary"]
    # the table's start (a 256-byte unit per 4 KiB page) and its worst case (25 units a record, twice a page)
    assert "block table 2MiB" in found["shm"][0]["summary"] and "up to 100MiB at worst" in found["shm"][0]["summary"]
    assert [f["status"] for f in found["ports"]] == ["ok", "ok"]
    assert found["redis"][0]["status"] == "ok" and redis_server.password not in out.stdout  # shown as ***
    assert found["s3"][0]["status"] == "ok" and "403" in found["s3"][0]["summary"]
    assert found["ucx"][0]["status"] == "skip"  # not configured
    # the disk tier on a tmpfs is allowed, with a warning that says why it should not be
    assert [f["status"] for f in found["disk"]] == ["ok", "warn"]


def test_a_misconfigured_host_fails_with_advice(tmp_path, redis_server):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    busy = held.getsockname()[1]
    dead = free_port()
    with held, tmpfs(tmp_path / "shm", "16m") as shm, tmpfs(tmp_path / "nvme", "32m") as nvme:
        out = doctor("--shm-dir", str(shm), "--ram-bytes", "64MiB", "--disk-dir", str(nvme / "strata"),
                     "--disk-bytes", "1GiB", "--listen", f"127.0.0.1:{busy}", "--metrics-listen", "",
                     "--index-url", f"redis://127.0.0.1:{dead}/0", "--s3-endpoint", f"http://127.0.0.1:{dead}")
    text = out.stdout
    assert out.returncode == 1, text + out.stderr
    lines = text.splitlines()

    def line(check: str, status: str) -> int:
        return next(i for i, l in enumerate(lines) if l.split()[:2] == [status, check])

    shm_line = line("shm", "FAIL")
    assert "64MiB" in lines[shm_line] and "SIGBUS" in lines[shm_line]
    assert "sizeLimit" in lines[shm_line + 1] and lines[shm_line + 1].strip().startswith("fix:")
    disk_line = line("disk", "FAIL")
    assert "1GiB" in lines[disk_line] and "lower --disk-bytes" in lines[disk_line + 1]
    assert "in use" in lines[line("ports", "FAIL")]
    assert "cannot reach" in lines[line("redis", "FAIL")]
    assert "cannot reach" in lines[line("s3", "FAIL")]
    assert lines[-1].startswith("5 failed")


def test_settings_the_daemon_would_refuse_exit_2():
    out = doctor("--ram-bytes", "1MiB")
    assert out.returncode == 2
    assert "ram_bytes" in out.stderr and "16MiB" in out.stderr


def settings(tmp_path, **overrides):
    cfg = dict(ram_bytes="32MiB", shm_dir=str(tmp_path), disk_dir=str(tmp_path / "d"), disk_bytes="64MiB",
               metrics_listen="")
    cfg.update(overrides)
    return load_settings(environ={}, **cfg)


def test_redis_that_refuses_the_password_or_wants_one(tmp_path, redis_server):
    wrong = run_checks(settings(tmp_path, index_url=f"redis://:wrong-password@127.0.0.1:{redis_server.port}/0"),
                       Host(), ["redis"])
    assert wrong[0].status is Status.FAIL and "refused the credentials" in wrong[0].summary
    assert "wrong-password" not in wrong[0].summary
    missing = run_checks(settings(tmp_path, index_url=redis_server.url), Host(), ["redis"])
    assert missing[0].status is Status.FAIL and "requires a password" in missing[0].summary
    assert "redis://:PASSWORD@" in missing[0].fix


def test_a_redis_cluster_is_checked_whole(tmp_path, redis_cluster_url):
    found = run_checks(settings(tmp_path, index_url=redis_cluster_url), Host(), ["redis"])
    assert found[0].status is Status.OK and "Cluster" in found[0].summary


def test_a_memory_limit_below_the_arena_fails(tmp_path):
    cgroup = tmp_path / "cgroup"
    (cgroup / "kubepods" / "pod1").mkdir(parents=True)
    (cgroup / "kubepods" / "pod1" / "memory.max").write_text(f"{48 << 20}\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/kubepods/pod1\n")
    host = Host(proc_cgroup=proc, cgroup_root=cgroup)
    low = run_checks(settings(tmp_path), host, ["memory"])
    # 32MiB of arena (and its header), a 2MiB block table and 512MiB for the daemon, in 256MiB steps
    assert low[0].status is Status.FAIL and "768MiB" in low[0].fix
    (cgroup / "kubepods" / "pod1" / "memory.max").write_text("max\n")
    assert run_checks(settings(tmp_path), host, ["memory"])[0].status is Status.OK


def test_protected_mode_and_missing_secret_files_fail(tmp_path):
    exposed = run_checks(settings(tmp_path, listen="0.0.0.0:50051"), Host(), ["auth"])
    assert exposed[0].status is Status.FAIL and "--auth-file" in exposed[0].fix
    policy = tmp_path / "policy.toml"
    policy.write_text("")
    unmounted = run_checks(settings(tmp_path, listen="0.0.0.0:50051", auth_file=str(policy),
                                    peer_token_file=str(tmp_path / "missing.token")), Host(), ["auth"])
    assert [f.status for f in unmounted] == [Status.OK, Status.FAIL]
    assert "missing.token" in unmounted[1].summary and "Secret" in unmounted[1].fix


def test_every_listener_reachable_beyond_loopback_without_authentication_is_named(tmp_path):
    """--insecure starts the daemon, and the doctor still warns, per listener; the UCX listener binds
    every interface whatever host it names; /metrics has no authentication at all."""
    found = run_checks(settings(tmp_path, listen="0.0.0.0:50051", peer_listen="0.0.0.0:50061", insecure=True,
                                metrics_listen="0.0.0.0:9464"), Host(), ["auth"])
    warned = [f.summary for f in found if f.status is Status.WARN]
    assert not [f for f in found if f.status is Status.FAIL]
    assert any("--listen 0.0.0.0:50051" in w and "--insecure" in w for w in warned), warned
    assert any("--peer-listen 0.0.0.0:50061" in w for w in warned), warned
    assert any("--metrics-listen 0.0.0.0:9464" in w for w in warned), warned
    ucx = run_checks(settings(tmp_path, peer_ucx_listen="127.0.0.1:50071"), Host(), ["auth"])
    assert ucx[0].status is Status.FAIL and "--peer-ucx-listen" in ucx[0].summary
    local = run_checks(settings(tmp_path, metrics_listen="127.0.0.1:9464"), Host(), ["auth"])
    assert [f.status for f in local] == [Status.OK]


def test_doctor_beside_the_daemon_it_describes_reports_it_running_not_failing(tmp_path, daemon_process):
    """Its own lock and ports are the daemon's: doctor run beside it (the same settings) finds it running."""
    d = daemon_process()
    found = run_checks(settings(tmp_path, disk_dir=str(d.disk_dir), listen=d.target), Host(), ["disk", "ports"])
    assert not failed(found), [f.summary for f in found]
    assert any(f.check == "disk" and "is running" in f.summary for f in found)
    assert any(f.check == "ports" and "served by the running strata daemon" in f.summary for f in found)
    # another process on the port, with no daemon of these settings running, is still a failure
    other = run_checks(settings(tmp_path, disk_dir=str(tmp_path / "elsewhere"), listen=d.target), Host(), ["ports"])
    assert failed(other) and any("in use by another process" in f.summary for f in other)


def test_an_shm_dir_that_is_not_a_tmpfs_is_a_warning(tmp_path):
    plain = Path(tmp_path) / "not-tmpfs"
    plain.mkdir()
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n")
    found = run_checks(settings(tmp_path, shm_dir=str(plain)), Host(mountinfo=mountinfo), ["shm"])
    assert [f.status for f in found] == [Status.OK, Status.WARN] and "ext4" in found[1].summary
    gone = run_checks(settings(tmp_path, shm_dir=str(tmp_path / "nowhere")), Host(), ["shm"])
    assert gone[0].status is Status.FAIL and "emptyDir" in gone[0].fix


def test_ucx_configured_reports_transports_and_a_ucx_tls_that_names_a_missing_one(tmp_path):
    import importlib.util

    if importlib.util.find_spec("ucxx") is None:
        pytest.skip('ucxx is not installed (pip install -e ".[ucx]"): nothing to list')
    s = settings(tmp_path, peer_transports="ucx,tcp")
    found = run_checks(s, Host(environ=dict(os.environ)), ["ucx"])
    assert found[0].status in (Status.OK, Status.WARN) and "tcp" in found[0].summary
    bad = run_checks(s, Host(environ={**os.environ, "UCX_TLS": "tcp,rc_mlx5"}), ["ucx"])
    if "rc_mlx5" in found[0].summary:
        pytest.skip("this host has rc_mlx5: no missing transport to name")
    assert bad[0].status is Status.FAIL and "rc_mlx5" in bad[0].summary
