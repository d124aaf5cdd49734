"""Private Redis servers for tests: one standalone, a Cluster (with replicas where asked).

Each server is Debian's ``redis-server`` on free loopback ports, in its own
directory, with persistence off; it dies with the test session (and, on
Linux, with this process even if pytest is killed). The machine's own Redis
on 6379 is never used. A server can require a password (``requirepass``) and
serve TLS only (Debian's build has TLS; certificates come from the test).
"""

from __future__ import annotations

import ctypes
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
START_TIMEOUT_S = 30.0


def available() -> bool:
    return Path(REDIS_SERVER).exists() and Path(REDIS_CLI).exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass(frozen=True)
class TLSFiles:
    """PEM files of a TLS server: its certificate and key, and the CA it trusts for clients."""

    cert: Path
    key: Path
    ca: Path
    client_cert: Path | None = None  # a client certificate and key the CA signed (for tests that connect)
    client_key: Path | None = None


class RedisServer:
    """``password``: the default user's (``requirepass``); ``tls``: serve TLS only, on ``port``."""

    def __init__(self, home: Path, *extra: str, password: str | None = None, tls: TLSFiles | None = None,
                 bind: str = "127.0.0.1", port: int | None = None) -> None:
        """``bind``: the addresses it listens on, space-separated (loopback is always among them);
        ``port``: a given one (a server started again where a killed one was), else a free one."""
        self.home = home
        self.port = port or _free_port()
        self.password = password
        self.tls = tls
        self.log = home / "redis.log"
        home.mkdir(parents=True, exist_ok=True)
        ports = ["--port", str(self.port)]
        if tls is not None:
            ports = [
                "--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(tls.cert),
                "--tls-key-file", str(tls.key), "--tls-ca-cert-file", str(tls.ca),
            ]
        auth = ["--requirepass", password] if password is not None else []
        args = [
            REDIS_SERVER, *ports, "--bind", *dict.fromkeys(["127.0.0.1", *bind.split()]), "--dir", str(home),
            "--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", str(self.log), *auth, *extra,
        ]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as raw:
                s = raw
                if self.tls is not None:
                    context = ssl.create_default_context(cafile=str(self.tls.ca))
                    if self.tls.client_cert is not None:
                        context.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
                    s = context.wrap_socket(raw, server_hostname="127.0.0.1")
                if self.password is not None:
                    s.sendall(f"AUTH {self.password}\r\n".encode())
                    if not s.recv(16).startswith(b"+OK"):
                        return False
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except (OSError, ssl.SSLError):
            return False

    def wait_ready(self) -> RedisServer:
        end = time.monotonic() + START_TIMEOUT_S
        while not self.ping():
            if self.proc.poll() is not None or time.monotonic() > end:
                log = self.log.read_text() if self.log.exists() else ""
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{log[-2000:]}")
            time.sleep(0.02)
        return self

    def cli(self, *args: str) -> str:
        auth = ["-a", self.password, "--no-auth-warning"] if self.password is not None else []
        out = subprocess.run(
            [REDIS_CLI, "-h", "127.0.0.1", "-p", str(self.port), *auth, *args],
            capture_output=True, text=True, timeout=30, check=True,
        )
        return out.stdout

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def _replicas_in_sync(masters: list[RedisServer], replicas: int) -> bool:
    """Every master sees ``replicas`` connected replicas, online."""
    for m in masters:
        info = m.cli("INFO", "replication")
        if info.count("state=online") < replicas:
            return False
    return True


def master_of(servers: list[RedisServer], key: str) -> RedisServer:
    """The server that is master of ``key``'s slot now."""
    slot = int(servers[0].cli("CLUSTER", "KEYSLOT", key).strip())
    for line in servers[0].cli("CLUSTER", "NODES").splitlines():
        fields = line.split()
        if "master" not in fields[2] or "fail" in fields[2]:
            continue
        port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
        for r in fields[8:]:
            lo, _, hi = r.partition("-")
            if r[0] != "[" and int(lo) <= slot <= int(hi or lo):
                return next(s for s in servers if s.port == port)
    raise RuntimeError(f"no master serves the slot of {key!r} ({slot})")


def start_standalone(home: Path) -> RedisServer:
    return RedisServer(home).wait_ready()


def start_cluster(home: Path, masters: int = 3, password: str | None = None, *, replicas: int = 0,
                  node_timeout_ms: int = 5000) -> list[RedisServer]:
    """A real Cluster: ``masters`` servers (the first ones returned), slots spread by
    ``redis-cli --cluster create``, each with ``replicas`` replicas (after the masters) that take
    over ``node_timeout_ms`` after their master stops answering; with ``password`` every node
    requires it (and uses it towards the others)."""
    servers: list[RedisServer] = []
    auth = ["-a", password, "--no-auth-warning"] if password is not None else []
    try:
        for i in range(masters * (1 + replicas)):
            d = home / f"node{i}"
            servers.append(
                RedisServer(
                    d, "--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf"),
                    "--cluster-port", str(_free_port()), "--cluster-node-timeout", str(node_timeout_ms),
                    *(["--masterauth", password] if password is not None else []),
                    password=password,
                )
            )
        for s in servers:
            s.wait_ready()
        subprocess.run(
            [REDIS_CLI, *auth, "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in servers),
             "--cluster-replicas", str(replicas), "--cluster-yes"],
            capture_output=True, text=True, timeout=60, check=True,
        )
        end = time.monotonic() + START_TIMEOUT_S
        while not all("cluster_state:ok" in s.cli("CLUSTER", "INFO") for s in servers) or \
                (replicas and not _replicas_in_sync(servers[:masters], replicas)):
            if time.monotonic() > end:
                raise RuntimeError("the Redis Cluster never reached cluster_state:ok with its replicas in sync")
            time.sleep(0.05)
        return servers
    except BaseException:
        for s in servers:
            s.stop()
        raise
