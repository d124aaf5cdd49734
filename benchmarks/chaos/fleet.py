"""The fleet the chaos run breaks: daemons, a Redis index, an S3 server, the paths between them.

Everything is a real child process, built from the tests' harnesses rather
than anew: each daemon is a :class:`peer_cluster.PeerNode` (``strata
serve`` with the chain ram → disk → peer → object), Redis is
:class:`redis_servers.RedisServer`, the bucket is moto's server
(:class:`s3_servers.MotoServer`). Where network namespaces can be made
(root) each daemon gets a host of its own on a :class:`VirtualNetwork`, and
Redis and moto listen on its gateway; elsewhere everything is on loopback,
and the run says so.

- **Peer path.** The first daemon (n0) advertises a proxy in front of
  itself (:class:`benchmarks.chaos.path.PeerPath`, the tests' ``FlipProxy``
  in a process of its own), so its peers reach it through a path the run
  can damage; clients, and the other daemons' peer paths, go direct.
- **Copies.** Disk and object are written through: a block acknowledged by
  a daemon is in its RAM (crash-safe: re-adopted after a SIGKILL), on its
  disk, and soon in the bucket. RAM is small, so most reads of older blocks
  come from disk; disk is large, so nothing is evicted (a miss is a loss).
- **A small disk.** The last daemon's disk directory is a tmpfs of its own,
  so the disk-full fault fills a real filesystem. Where mounting is not
  permitted that fault is left out, saying why.
- **Restarts on the same places.** A daemon restarts on its directories (a
  new epoch), Redis and moto on their ports; moto keeps objects in memory,
  so a restarted moto has an empty bucket (see the faults).

Every child gets ``PR_SET_PDEATHSIG`` and must be started from the main
thread (the signal fires when the *thread* that started it exits); the
fleet's :class:`contextlib.ExitStack` kills them, unmounts the tmpfs and
removes the namespaces on the way out, also after a failure.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.chaos.counters import Counters
from benchmarks.chaos.path import PeerPath
from kvstore.block import BlockKey
from kvstore.client.sync import Client
from kvstore.remote.object.layout import KeyLayout
from kvstore.tiers.block_file import block_name
from tests.support import redis_servers, s3_servers
from tests.support.peer_cluster import Network, PeerNode

NS = "chaos"
PREFIX = "chaos"
CLIENT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class FleetPlan:
    daemons: int
    ram_bytes: str = "16MiB"  # small: older blocks are read from disk, where the corruption is
    disk_bytes: str = "1GiB"  # large: nothing is evicted, but while the disk-full fault lasts
    small_disk: str = "512m"  # the tmpfs under the last daemon's disk directory: room for every block


def _set(args: list[str], flag: str, value: str) -> None:
    """Replace a flag's value in a PeerNode's argument list, or add the flag."""
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]


class Fleet:
    def __init__(self, home: Path, plan: FleetPlan, stack: contextlib.ExitStack) -> None:
        self.home = home
        self.plan = plan
        self.net = Network(plan.daemons)
        stack.callback(self.net.close)
        self.moto = s3_servers.MotoServer(home / "moto", host=self.net.gateway)  # waited for below
        stack.callback(lambda: self.moto.stop())
        self.redis = self._redis()
        stack.callback(lambda: self.redis.stop())
        self.layout = KeyLayout(PREFIX)
        self.paths: dict[int, PeerPath] = {}  # daemon -> the proxy its peers reach it through
        self.nodes: list[PeerNode] = []
        self.small_disk: Path | None = None  # the disk directory on a tmpfs, when one could be mounted
        self.small_disk_note = ""
        stack.callback(self._kill_all)
        for i in range(plan.daemons):
            self.nodes.append(self._node(i, stack))
        for node in self.nodes:  # started together with moto (a daemon starts without its bucket), waited for
            node.spawn()
        self.s3 = s3_servers.S3Env(self.moto.wait_ready())  # creates the bucket
        for node in self.nodes:
            self.wait_serving(node)
        self.clients = [self.client(i) for i in range(plan.daemons)]
        stack.callback(lambda: [c.close() for c in self.clients])
        self.counters = Counters(self.nodes)
        self.bucket_lost_at: float | None = None  # when the S3 server was killed (the run's clock)
        self.bucket_at_kill: set[bytes] = set()  # acknowledged blocks the bucket held then

    # ---- parts ----------------------------------------------------------------

    @property
    def index_url(self) -> str:
        return f"redis://{self.net.gateway}:{self.redis.port}/0"

    def _redis(self, port: int | None = None) -> redis_servers.RedisServer:
        return redis_servers.RedisServer(self.home / "redis", "--protected-mode", "no", bind=self.net.gateway,
                                         port=port).wait_ready()

    def _node(self, i: int, stack: contextlib.ExitStack) -> PeerNode:
        port = self.net.port()
        advertise = ""
        if i == 0:
            self.paths[i] = PeerPath((self.net.host(i), port), self.net.gateway)
            stack.callback(self.paths[i].close)
            advertise = self.paths[i].address
        env = {"AWS_ACCESS_KEY_ID": s3_servers.ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": s3_servers.SECRET_KEY}
        bucket = s3_servers.S3Env.bucket
        node = PeerNode(self.home, f"n{i}", self.index_url, host=self.net.host(i), port=port,
                        advertise=advertise, netns=self.net.namespace(i), env=env, die_with_parent=True)
        for flag, value in (
            ("--tiers", "ram,disk,peer,object"), ("--ram-bytes", self.plan.ram_bytes),
            ("--disk-bytes", self.plan.disk_bytes), ("--max-block-bytes", "1MiB"),
            ("--disk-write-policy", "through"), ("--object-write-policy", "through"),
            ("--object-bucket", bucket), ("--object-prefix", PREFIX), ("--object-endpoint", self.moto.endpoint),
            ("--log-level", "WARNING"),
        ):
            _set(node.args, flag, value)
        if self.net.virtual is not None:  # a private virtual network: authentication is not what is tested
            node.args.append("--insecure")
        if i == self.plan.daemons - 1:
            self._mount_small_disk(node, stack)
        return node

    def _mount_small_disk(self, node: PeerNode, stack: contextlib.ExitStack) -> None:
        import pytest
        from tests.support.small_filesystem import tmpfs

        try:
            self.small_disk = stack.enter_context(tmpfs(node.home / "cache", self.plan.small_disk))
            self.small_disk_note = f"{node.name}'s disk directory is a {self.plan.small_disk} tmpfs"
        except pytest.skip.Exception as why:  # not permitted here: the disk-full fault is left out
            self.small_disk_note = str(why)

    def _kill_all(self) -> None:
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    node.proc.send_signal(signal.SIGCONT)  # a stalled one, too
            node.kill()

    def client(self, i: int) -> Client:
        return Client(self.nodes[i].target, use_shm=False, retries=0, timeout=CLIENT_TIMEOUT_S)

    # ---- state ----------------------------------------------------------------

    def wait_serving(self, node: PeerNode, timeout_s: float = 60.0) -> None:
        end = time.monotonic() + timeout_s
        while not node.healthy():  # raises if the process exited
            if time.monotonic() > end:
                raise RuntimeError(f"{node.name} did not serve in {timeout_s:.0f} s (log: {node.log})")
            time.sleep(0.05)

    def disk_serving(self, i: int) -> bool:
        """Whether node ``i`` says its disk tier serves (``strata.tier.disk`` health)."""
        try:
            with grpc.insecure_channel(self.nodes[i].target) as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service="strata.tier.disk"), timeout=2)
                return r.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def block_file(self, i: int, key: bytes) -> Path:
        """Where node ``i``'s disk tier keeps ``key`` (``<disk dir>/blocks/<xx>/<name>``)."""
        name = block_name(BlockKey(NS, key))
        return self.nodes[i].home / "cache" / "blocks" / name[:2] / name

    def in_bucket(self, key: bytes) -> bool:
        return self.s3.raw_get(self.layout.path(BlockKey(NS, key))) is not None

    def unexpected_exits(self) -> list[str]:
        return [f"{n.name} exited with {n.proc.returncode}" for n in self.nodes
                if n.proc is not None and n.proc.poll() is not None]

    # ---- restarts (main thread only: the death signal follows the starting thread) ----

    def restart_redis(self) -> None:
        self.redis = self._redis(self.redis.port)

    def restart_moto(self) -> None:
        self.moto = s3_servers.MotoServer(self.home / "moto", port=self.moto.port, host=self.net.gateway).wait_ready()
        self.s3 = s3_servers.S3Env(self.moto)  # an empty bucket: moto kept the old one in memory

    def log_tails(self, n: int = 1500) -> str:
        out = []
        for node in self.nodes:
            with contextlib.suppress(OSError):
                out.append(f"--- {node.name} ({node.log}) ---\n{node.log.read_text(errors='replace')[-n:]}")
        return "\n".join(out)


def fill(root: Path) -> Path:
    """Take a filesystem's last byte: its free space in one fallocate (``small_filesystem.fill``'s 4 KiB
    writes take seconds for hundreds of MiB on a busy machine, which would stretch the fault), then
    appends until it refuses."""
    filler = root / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        fs = os.statvfs(root)
        free = fs.f_bavail * fs.f_frsize
        try:
            os.posix_fallocate(fd, 0, max(free - (1 << 20), 1))
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)
    return filler


def pause(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


def resume(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)
