"""LMCache's own server (``lmcache server``) with Strata as its L2, shared by two servers, on CPU.

Two real ``lmcache server`` processes load the Strata adapter through their
``--l2-adapter '{"type": "plugin", ...}'`` argument and share one real daemon.
The engine side is LMCache's own stand-in for vLLM's worker adapter, the
client of ``lmcache bench server --mode cpu`` (``ServerBenchClient``: paged
CPU KV caches registered with the server, STORE / LOOKUP / RETRIEVE over its
real protocol, engine-driven transfers). What server A stores reaches the
daemon through its L2 store controller; server B, whose L1 has never seen
those chunks, finds them through its prefetch controller's lookup-and-lock
and loads them from Strata, into KV blocks zeroed first, and they must equal
what A stored, byte for byte (checked by the client's own per-chunk digests).
Server B's HTTP API lists them through the adapter's ``list_l2_keys``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

pytest.importorskip("torch", reason="torch is not installed (tests/install.py installs its CPU build)")
pytest.importorskip("lmcache", reason="lmcache is not installed (tests/install.py installs it)")

from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient  # noqa: E402
from lmcache.cli.commands.bench.server_bench.config import BenchConfig  # noqa: E402

from benchmarks.harness import free_port  # noqa: E402
from kvstore import Client  # noqa: E402
from kvstore.integrations.lmcache_mp import CLASS_NAME, MODULE_PATH  # noqa: E402
from tests.support.wait import wait_until  # noqa: E402

pytestmark = pytest.mark.system

SEQUENCES = 3
SHAPE_SPEC = "(2,256,16,2,64):float16:4"  # 4 layers, 2 heads of 64: 32 KiB a block of 16 tokens


class LMCacheServer:
    def __init__(self, tmp_path, name: str, daemon_target: str) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.log = tmp_path / f"lmcache-{name}.log"
        adapter = {"type": "plugin", "module_path": MODULE_PATH, "class_name": CLASS_NAME,
                   "adapter_params": {"target": daemon_target, "timeout_s": 5}}
        env = dict(os.environ, LMCACHE_DISABLE_BANNER="1", LMCACHE_TRACK_USAGE="false", PYTHONUNBUFFERED="1")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1", "--port", str(self.port),
                 "--http-host", "127.0.0.1", "--http-port", str(self.http_port), "--l1-size-gb", "0.05",
                 "--eviction-policy", "LRU", "--supported-transfer-mode", "auto", "--disable-observability",
                 "--l2-adapter", json.dumps(adapter)],
                stdout=log, stderr=subprocess.STDOUT, env=env)

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"lmcache server exited with {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(self.http + "/", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.http + path, timeout=10) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def bench_client(server: LMCacheServer) -> ServerBenchClient:
    config = BenchConfig(rpc_url=f"tcp://127.0.0.1:{server.port}", http_url=server.http, mode="cpu",
                         transfer_mode="auto", tp_size=1, use_mla=False, num_tokens=512,
                         kvcache_shape_spec=SHAPE_SPEC, num_blocks=256, block_size=16)
    client = ServerBenchClient(config, log=lambda message: None)
    client.start()
    return client


def test_a_second_server_loads_what_the_first_stored_byte_for_byte(make_daemon, tmp_path):
    daemon = make_daemon(ram_bytes="64MiB")
    servers = [LMCacheServer(tmp_path, name, daemon.target) for name in ("a", "b")]
    clients: list[ServerBenchClient] = []
    try:
        for server in servers:
            wait_until(server.ready, timeout=120, what=f"lmcache server to serve (log: {server.log})")
        a, b = bench_client(servers[0]), bench_client(servers[1])
        clients += [a, b]

        stored: dict[int, list[str]] = {}
        chunks = 0
        for seq in range(SEQUENCES):
            req = a.create_request(seq, f"a-{seq}", "cold")
            assert a.lookup(req).is_full_miss
            stored[seq] = a.compute_checksums(req, 0, req.num_full_tokens)
            assert a.store(req, 0, req.num_full_tokens).succeeded
            a.end_session(req)
            chunks += req.total_chunks
        strata = Client(daemon.target)
        wait_until(lambda: strata.stats().blocks >= chunks, timeout=30, what="server A's L2 stores to reach Strata")

        for seq in range(SEQUENCES):
            req = b.create_request(seq, f"b-{seq}", "cold")
            b.zero_destination(req, 0, req.num_full_tokens)
            assert b.compute_checksums(req, 0, req.num_full_tokens) != stored[seq]
            found = b.lookup(req)  # B's L1 is empty: a hit can only come from Strata
            assert found.is_full_hit, found
            assert b.retrieve(req, 0, req.num_full_tokens).succeeded
            assert b.compute_checksums(req, 0, req.num_full_tokens) == stored[seq]
            b.end_session(req)

        listed = servers[1].get("/cache/objects?tier=l2&page_size=100")
        assert len(listed["entries"]) == chunks and listed["next_page_token"] is None
        assert {e["key"]["model_name"] for e in listed["entries"]} == {strata.stats().namespaces[0].split("/", 1)[1]}
        wait_until(lambda: strata.stats().pinned_blocks == 0, timeout=30, what="server B to unlock what it loaded")
    finally:
        for client in clients:
            client.close()
        for server in servers:
            server.stop()
