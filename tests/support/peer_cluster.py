"""Several ``strata serve`` processes sharing one Redis index: the peer tier's test harness.

- :class:`PeerNode`: one daemon as a real child process, with its own ports,
  cache directory and log, optionally inside a network namespace
  (``ip netns exec``); killed with SIGKILL, restarted on the same directory
  (a new epoch), its Prometheus metrics scraped over HTTP.
- :class:`FlipProxy`: a TCP proxy in front of a daemon that flips one byte
  after every occurrence of a marker in what the daemon sends back: a peer
  whose bytes are damaged in transit (gRPC's framing is untouched, the
  block's payload is not).
- :class:`VirtualNetwork`: network namespaces joined by veth pairs to one
  bridge on the host, each with its own address on a private /24, so each
  daemon has a host of its own and the bytes cross a (virtual) network.
  Names are unique per run; everything is removed on :meth:`close`, also
  after a failure.
- What a fleet's tests put and ask: seeded values and keys of a tag in the
  namespace :data:`NS`, which nodes the index names as holders, and
  ``strata peers`` as an operator runs it.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.harness import free_port
from kvstore.client.sync import Client
from tests.support.wait import wait_until

REPO = Path(__file__).resolve().parents[2]


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class PeerNode:
    """``strata serve`` with a peer tier, as a child process (in ``netns`` when given).

    ``advertise``: its --advertise-address; ``{port}`` in it is replaced by its own port. ``env``:
    variables added to the daemon's environment (the object tier's AWS credentials)."""

    def __init__(self, home: Path, name: str, index_url: str, *extra: str, host: str = "127.0.0.1",
                 port: int | None = None, advertise: str = "", netns: str = "", env: dict[str, str] | None = None,
                 die_with_parent: bool = False) -> None:
        self.name = name
        self.die_with_parent = die_with_parent  # PR_SET_PDEATHSIG: a benchmark's daemons die with it, even SIGKILLed
        self.env = dict(env or {})
        self.home = home / name
        self.home.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.port = port or free_port()
        self.metrics_port = free_port() if not netns else 9464
        self.target = f"{host}:{self.port}"
        self.netns = netns
        self.log = self.home / "daemon.log"
        self.args = [
            "--node-id", name, "--listen", self.target, "--metrics-listen", f"{host}:{self.metrics_port}",
            "--disk-dir", str(self.home / "cache"), "--shm-dir", str(self.home), "--ram-bytes", "192MiB",
            "--disk-bytes", "256MiB", "--max-block-bytes", "8MiB", "--index-url", index_url,
            "--index-ttl-seconds", "6", "--tiers", "ram,disk,peer", "--log-format", "text",
            *(["--advertise-address", advertise.format(port=self.port)] if advertise else []), *extra,
        ]
        self.proc: subprocess.Popen | None = None

    def start(self) -> PeerNode:
        self.spawn()
        wait_until(self.healthy, timeout=60, what=f"{self.name} to serve on {self.target} (log: {self.log})")
        return self

    def spawn(self) -> PeerNode:
        """The process, not yet waited for (several nodes then start at once); :meth:`start` waits.

        ``ip netns exec`` execs the daemon in place, so its pid (and a death signal) is the daemon's."""
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        env = {**os.environ, **self.env,
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", "kvstore.cli.main", "serve", *self.args],
                stdout=log, stderr=subprocess.STDOUT, env=env,
                preexec_fn=_die_with_parent if self.die_with_parent else None,
            )
        return self

    def healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
        try:
            with grpc.insecure_channel(self.target) as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                return r.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def restart(self) -> PeerNode:
        self.kill()
        return self.start()

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample: (name, sorted labels) -> value."""
        with urllib.request.urlopen(f"http://{self.host}:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def fallbacks(self) -> dict[str, float]:
        return {dict(k[1])["reason"]: v for k, v in self.metrics().items() if k[0] == "strata_peer_fallbacks_total"}


class FlipProxy:
    """Forwards TCP to ``upstream``; in the replies, flips the byte after each ``marker`` (or, with ``every``,
    one byte every ``every`` bytes)."""

    def __init__(self, upstream: tuple[str, int], marker: bytes, host: str = "127.0.0.1", *, every: int = 0,
                 limit: int = 0) -> None:
        self.upstream = upstream
        self.marker = marker
        # every > 0 (with no marker): flip the byte at every ``every``-th offset of each reply stream instead,
        # for traffic with no marker of its own (blocks of KV); the first ``every`` bytes carry the
        # handshake and are left whole.
        self.every = every
        self.limit = limit  # > 0: mend the path by itself after this many flips
        self.enabled = True  # False: forwards unchanged (the path is mended)
        self.flipped = 0
        self._server = socket.create_server((host, 0))
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                down, _ = self._server.accept()
                up = socket.create_connection(self.upstream, timeout=10)
                up.settimeout(None)
            except OSError:
                return
            self._sockets += [down, up]
            threading.Thread(target=self._pump, args=(down, up, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, True), daemon=True).start()

    def _count(self) -> None:
        self.flipped += 1
        if self.limit and self.flipped >= self.limit:
            self.enabled = False

    def _pump(self, src: socket.socket, dst: socket.socket, flip: bool) -> None:
        tail = b""  # the end of what was sent, so a marker split across reads is still found
        pending_flip = False
        offset = 0  # bytes of this stream forwarded so far (the every-mode's position)
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if flip and self.enabled and self.every:
                    buf = bytearray(data)
                    at = -offset % self.every if offset else self.every
                    while at < len(buf) and self.enabled:
                        buf[at] ^= 0xFF
                        self._count()
                        at += self.every
                    data = bytes(buf)
                elif flip and self.enabled:
                    buf = bytearray(data)
                    if pending_flip and buf:
                        buf[0] ^= 0xFF
                        self._count()
                        pending_flip = False
                    seen = tail + bytes(buf)
                    start = 0
                    while (at := seen.find(self.marker, start)) >= 0:
                        pos = at + len(self.marker) - len(tail)  # the byte after the marker, in buf
                        if pos < len(buf):
                            buf[pos] ^= 0xFF
                            self._count()
                        else:
                            pending_flip = True
                        start = at + 1
                    tail = seen[-(len(self.marker) - 1):]
                    data = bytes(buf)
                offset += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop = True
        self._server.close()
        for s in self._sockets:
            s.close()


def netns_unavailable() -> str | None:
    """Why network-namespace tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); CI runs these tests as root"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed (apt-get install iproute2)"
    probe = f"stp{random.randrange(1 << 24):06x}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "ip netns add is not permitted here (a container without CAP_SYS_ADMIN?)"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class VirtualNetwork:
    """``count`` namespaces on one bridge; the host side is ``gateway`` (10.77.S.1), namespace i is ``address(i)``."""

    def __init__(self, count: int) -> None:
        self.tag = f"{random.randrange(1 << 24):06x}"  # unique per run: interface names are at most 15 characters
        self.bridge = f"stb{self.tag}"
        self.namespaces = [f"st{self.tag}n{i}" for i in range(count)]
        self._links: list[str] = []
        self._created_ns: list[str] = []
        self.subnet = self._free_subnet()
        self.gateway = f"10.77.{self.subnet}.1"
        try:
            self._ip("link", "add", self.bridge, "type", "bridge")
            self._links.append(self.bridge)
            self._ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            self._ip("link", "set", self.bridge, "up")
            for i, ns in enumerate(self.namespaces):
                self._ip("netns", "add", ns)
                self._created_ns.append(ns)
                host_end, ns_end = f"st{self.tag}h{i}", f"st{self.tag}v{i}"
                self._ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
                self._links.append(host_end)
                self._ip("link", "set", ns_end, "netns", ns)
                self._ip("link", "set", host_end, "master", self.bridge)
                self._ip("link", "set", host_end, "up")
                self._ip("netns", "exec", ns, "ip", "addr", "add", f"{self.address(i)}/24", "dev", ns_end)
                self._ip("netns", "exec", ns, "ip", "link", "set", ns_end, "up")
                self._ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def address(self, i: int) -> str:
        return f"10.77.{self.subnet}.{10 + i}"

    @staticmethod
    def _free_subnet() -> int:
        used = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
        free = [s for s in range(256) if f"10.77.{s}." not in used]
        if not free:
            raise RuntimeError("every 10.77.S.0/24 subnet is in use on this machine")
        return random.choice(free)

    @staticmethod
    def _ip(*args: str) -> None:
        r = subprocess.run(["ip", *args], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)} failed: {r.stderr.strip()}")

    def close(self) -> None:
        """Remove every namespace and link this network made (deleting a namespace removes its veth ends)."""
        for ns in self._created_ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for link in reversed(self._links):
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        self._created_ns, self._links = [], []


NETNS_PORT = 50051  # each namespace is a host of its own: every daemon can listen on the same port


class Network:
    """Where each part of a fleet listens: hosts of their own on a :class:`VirtualNetwork`, or loopback.

    ``loopback=True``, or a machine where network namespaces cannot be made (:func:`netns_unavailable`),
    puts every part on 127.0.0.1; :attr:`note` says which it is and why."""

    def __init__(self, hosts: int, *, loopback: bool = False) -> None:
        why = "asked for (--loopback)" if loopback else netns_unavailable()
        self.virtual: VirtualNetwork | None = VirtualNetwork(hosts) if why is None else None
        self.note = (f"{hosts} hosts, each a network namespace of its own, joined by veth pairs to one bridge"
                     if why is None else f"loopback only (no network namespaces: {why})")

    @property
    def gateway(self) -> str:
        """The host's address as the namespaces see it: where shared services (Redis, S3, a router) listen."""
        return self.virtual.gateway if self.virtual else "127.0.0.1"

    def host(self, i: int) -> str:
        return self.virtual.address(i) if self.virtual else "127.0.0.1"

    def namespace(self, i: int) -> str:
        return self.virtual.namespaces[i] if self.virtual else ""

    def port(self) -> int:
        return NETNS_PORT if self.virtual else free_port()

    def command(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run on host ``i``: inside its namespace (``ip netns exec`` execs it: the pid, and a
        ``PR_SET_PDEATHSIG`` set before, are the command's own)."""
        return ["ip", "netns", "exec", self.namespace(i), *argv] if self.virtual else list(argv)

    def close(self) -> None:
        if self.virtual is not None:
            self.virtual.close()


# ---- what a fleet holds ----------------------------------------------------------------

NS = "model-a"


def value(tag: str, size: int, prefix: bytes = b"") -> bytes:
    body = random.Random(hashlib.blake2b(tag.encode()).digest()).randbytes(size - len(prefix))
    return prefix + body


def keys_of(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(n)]


def holders_of(client: Client, keys: list[bytes]) -> list[set[str]]:
    return [{h.node_id for h in held} for held in client.holders(NS, keys=keys)]


def held_by(client: Client, keys: list[bytes], *names: str) -> bool:
    return all(set(names) <= h for h in holders_of(client, keys))


def peers(target: str, *auth: str) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-m", "kvstore.cli.main", "peers", "--target", target, "--json", *auth],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)
