"""Shared fixtures: real daemons on real ports, in-process and as subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, settings

# The same examples on every run: CI must not find (and then spend minutes
# shrinking) a case that no developer run can reproduce. Hunt with a fresh
# seed locally: HYPOTHESIS_PROFILE=explore python -m pytest ...
settings.register_profile("ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", deadline=None, max_examples=500, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

from kvstore.config import load_settings
from kvstore.server.daemon import Daemon


if str(Path(__file__).resolve().parent.parent) not in sys.path:  # a test module run as a script: the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import free_port  # noqa: E402  (one way to pick a port, outside the ephemeral range)


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.02, what: str = "condition"):
    """Poll until ``predicate()`` is truthy; fail the test (not assert a timing) if it never is."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


SMALL = dict(ram_bytes="32MiB", disk_bytes="128MiB", max_block_bytes="8MiB", metrics_listen="")


@pytest.fixture
def make_daemon(tmp_path):
    """Start in-process daemons; each gets its own cache dir and arena under tmp_path."""
    started: list[Daemon] = []

    def start(**overrides) -> Daemon:
        n = len(started)
        cfg = dict(SMALL, listen="127.0.0.1:0", disk_dir=str(tmp_path / f"d{n}"), shm_dir=str(tmp_path))
        cfg.update(overrides)
        daemon = Daemon(load_settings(**cfg)).start()
        daemon.target = f"127.0.0.1:{daemon.port}"
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop(0)


@pytest.fixture
def daemon(make_daemon):
    return make_daemon()


class DaemonProcess:
    """``strata serve`` as a real child process."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.disk_dir = tmp_path / "daemon"
        self.args = [
            "--listen", self.target, "--metrics-listen", "", "--disk-dir", str(self.disk_dir),
            "--shm-dir", str(tmp_path), "--ram-bytes", "32MiB", "--disk-bytes", "256MiB",
            "--max-block-bytes", "8MiB", "--log-format", "text", *args,
        ]
        self.proc: subprocess.Popen | None = None
        self.log = tmp_path / "daemon.log"

    def start(self) -> DaemonProcess:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvstore.cli.main", "serve", *self.args], stdout=log, stderr=subprocess.STDOUT
            )
        wait_until(self.healthy, what=f"daemon on {self.target} to serve (log: {self.log})")
        return self

    def healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            pytest.fail(f"daemon exited with {self.proc.returncode}:\n{self.log.read_text()}")
        try:
            with grpc.insecure_channel(self.target) as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                return r.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def kill(self, sig: int = signal.SIGKILL) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill(signal.SIGKILL)


@pytest.fixture
def daemon_process(tmp_path):
    procs: list[DaemonProcess] = []

    def start(*args: str) -> DaemonProcess:
        p = DaemonProcess(tmp_path, *args).start()
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()


# ---- nothing left in /dev/shm (tests/shm_guard.py) ---------------------------------
# Per module (module-scoped daemons stop at its end) and per test (to name the test).


@pytest.fixture(autouse=True, scope="module")
def _shm_clean_module(request, tmp_path_factory):
    import shm_guard

    before, since = shm_guard.entries(), shm_guard.now()
    yield
    leak = shm_guard.check(before, lambda: shm_guard.recent(tmp_path_factory.getbasetemp(), since), request.node.nodeid)
    if leak:
        pytest.fail(leak, pytrace=False)


@pytest.fixture(autouse=True)
def _shm_clean(request, tmp_path_factory):
    import shm_guard

    before, since = shm_guard.entries(), shm_guard.now()
    yield
    leak = shm_guard.check(before, lambda: shm_guard.recent(tmp_path_factory.getbasetemp(), since), request.node.nodeid)
    if leak:
        pytest.fail(leak, pytrace=False)


@pytest.fixture(autouse=True, scope="session")
def _no_proxy():
    # gRPC honours http_proxy; tests talk to loopback only.
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "grpc_proxy"):
        os.environ.pop(var, None)
    os.environ["NO_PROXY"] = "127.0.0.1,localhost"


# ---- private Redis servers (the prefix index contract) -------------------------
# Session-scoped: started on first use, killed at the end. Tests isolate
# themselves with a key prefix of their own instead of flushing.


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    import redis_servers

    if not redis_servers.available():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = redis_servers.start_standalone(tmp_path_factory.mktemp("redis"))
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory):
    import redis_servers

    if not redis_servers.available():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    servers = redis_servers.start_cluster(tmp_path_factory.mktemp("redis-cluster"))
    yield f"redis+cluster://127.0.0.1:{servers[0].port}"
    for s in servers:
        s.stop()


# ---- a private S3-compatible server (the object tier) ---------------------------
# moto's server in a child process, one bucket; tests isolate themselves with a
# prefix of their own (tests/s3_servers.py).


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    import s3_servers

    if not s3_servers.available():
        pytest.skip("moto_server is not installed (pip install 'moto[server]')")
    env = s3_servers.S3Env(s3_servers.start_moto(tmp_path_factory.mktemp("moto")))
    yield env
    env.close()
