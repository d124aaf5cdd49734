"""Daemons for tests: the small settings every in-process daemon starts from, and ``strata serve``
as a real child process (the ``make_daemon`` and ``daemon_process`` fixtures of tests/conftest.py
start these)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.harness import free_port
from tests.support.wait import wait_until

SMALL = dict(ram_bytes="32MiB", disk_bytes="128MiB", max_block_bytes="8MiB", metrics_listen="")


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
