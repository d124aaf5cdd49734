"""What an operator sees of a fleet: ``strata peers``, ``strata stats`` and ``/metrics``, on real daemons.

Separate ``strata serve`` processes on one real Redis index move real bytes
(peer reads over TCP and gRPC, a stale entry repaired, handoffs pulled and
one left to expire, blocks replicated), then the operator's views are read
the way an operator reads them: the ``strata`` CLI as a process, and each
daemon's Prometheus endpoint over HTTP. Waits are bounded polls; nothing
asserts a timing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import re
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.harness import free_port
from kvstore.block import TierName
from kvstore.client.sync import Client
from kvstore.peer.registry import schemes
from tests.support import redis_servers
from tests.support.peer_cluster import PeerNode
from tests.support.wait import wait_until

pytestmark = pytest.mark.system

NS = "ops-kv"
REPLICATED, SHORT = "ops-rep", "ops-short"  # k=2 on a fleet of two: met; k=3: short
# Label names a Strata metric may carry: each names a bounded set (STYLE.md), never a key or a request.
BOUNDED_LABELS = {"tier", "op", "code", "outcome", "reason", "transport", "kind", "subscriber", "arena", "rule"}
SCHEMES = set(schemes())  # the peer transports: a bounded label, from the registry


def value(tag: str, size: int) -> bytes:
    return random.Random(hashlib.blake2b(tag.encode()).digest()).randbytes(size)


def key_of(tag: str) -> bytes:
    return hashlib.blake2b(tag.encode(), digest_size=16).digest()


def strata(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "kvstore.cli.main", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def held_by(client: Client, namespace: str, key: bytes, *names: str) -> bool:
    return set(names) <= {h.node_id for h in client.holders(namespace, keys=[key])[0]}


def scrape(node: PeerNode) -> dict:
    """The daemon's /metrics as Prometheus parses it: family name -> family."""
    with urllib.request.urlopen(f"http://{node.host}:{node.metrics_port}/metrics", timeout=5) as r:
        return {f.name: f for f in text_string_to_metric_families(r.read().decode())}


def sample(families: dict, family: str, suffix: str = "", **labels: str) -> float:
    for s in families[family].samples:
        if s.name == family + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no sample {family}{suffix}{labels}")


def add_stale_entry(url: str, node: str, epoch: int, key: bytes) -> None:
    from kvstore.index.redis import RedisIndex

    async def main():
        ix = RedisIndex.from_url(url)
        try:
            await ix.add(NS, node, epoch, [(key, TierName.HOST)])
        finally:
            await ix.close()

    asyncio.run(main())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """p (a TCP peer listener), g (gRPC only) and d, sharing a Redis index; d reads a block from
    each and is sent to p once for a block p lacks (a stale entry, repaired)."""
    if not redis_servers.available():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    home = tmp_path_factory.mktemp("ops")
    redis = redis_servers.start_standalone(home / "redis")
    started = []
    try:
        p = PeerNode(home, "p", redis.url, "--peer-listen", f"127.0.0.1:{free_port()}")
        g = PeerNode(home, "g", redis.url)
        d = PeerNode(home, "d", redis.url)
        for node in (p, g, d):
            started.append(node.start())
        with Client(p.target, use_shm=False) as pc, Client(g.target, use_shm=False) as gc, \
                Client(d.target, use_shm=False) as dc:
            pc.put(NS, key_of("from-p"), value("from-p", 1 << 20))
            gc.put(NS, key_of("from-g"), value("from-g", 512 << 10))
            wait_until(lambda: held_by(dc, NS, key_of("from-p"), "p") and held_by(dc, NS, key_of("from-g"), "g"),
                       what="p and g to publish their blocks")
            assert dc.get(NS, key_of("from-p")) == value("from-p", 1 << 20)  # over p's TCP listener
            assert dc.get(NS, key_of("from-g")) == value("from-g", 512 << 10)  # over g's gRPC service
            epoch = {n.node_id: n.epoch for n in dc.nodes()}["p"]
            add_stale_entry(redis.url, "p", epoch, key_of("never-on-p"))
            assert dc.get(NS, key_of("never-on-p")) is None  # p answers miss: repaired
        yield p, g, d
    finally:
        for node in started:
            node.kill()
        redis.stop()


def test_strata_peers_shows_the_bytes_each_node_served_by_transport(fleet):
    p, g, d = fleet

    def served() -> dict:
        return {n["node_id"]: n["served_bytes"] for n in json.loads(strata("peers", "--target", d.target, "--json"))}

    # Each node's heartbeat (every ttl/3) carries its counters into its index record: any daemon answers.
    wait_until(lambda: served() == {"p": {"tcp": 1 << 20}, "g": {"grpc": 512 << 10}, "d": {}},
               what="the heartbeats to carry what p and g served")
    assert json.loads(strata("peers", "--target", g.target, "--json")) == \
        json.loads(strata("peers", "--target", d.target, "--json")), "the same fleet, asked of another daemon"
    lines = {line.split("\t")[0]: line for line in strata("peers", "--target", d.target).splitlines()}
    assert lines["p"].endswith("served: tcp 1.0 MiB") and lines["g"].endswith("served: grpc 512.0 KiB")
    assert lines["d"].endswith("served: nothing reported")
    # The counters behind the heartbeat, by transport: whole blocks only, at least the reads above.
    # g's gRPC counter was once seen at 9 blocks just after a heartbeat said 1. Counted there are
    # local_only Gets only (peer-tier fetches, one per holder tried, never retried; handoff pulls),
    # of which this fleet makes one. One way a node's counter grew with reads its direct readers
    # never made is closed: a TCP listener read a block it lacked through its own peer tier (see
    # test_peer_tier's stale-entry test). Until the 9 are reproduced, exact equality stays the
    # heartbeat check's above.
    tcp = p.metric("strata_peer_served_bytes_total", transport="tcp")
    grpc = g.metric("strata_peer_served_bytes_total", transport="grpc")
    assert tcp >= 1 << 20 and tcp % (1 << 20) == 0, tcp
    assert grpc >= 512 << 10 and grpc % (512 << 10) == 0, grpc
    assert g.metric("strata_peer_served_bytes_total", transport="tcp") == 0  # g has no TCP listener
    assert d.metric("strata_peer_served_bytes_total", transport="tcp") == 0


def test_the_metrics_of_a_real_daemon_have_units_and_bounded_labels(fleet):
    p, g, d = fleet
    m = scrape(d)
    # Bytes by source: local tiers by tier, the peer tier's by transport.
    assert m["strata_kv_bytes_out"].type == "counter"
    assert sample(m, "strata_kv_bytes_out", "_total", tier="peer") == (1 << 20) + (512 << 10)
    assert m["strata_peer_fetched_bytes"].type == "counter"
    assert sample(m, "strata_peer_fetched_bytes", "_total", transport="tcp") == 1 << 20
    assert sample(m, "strata_peer_fetched_bytes", "_total", transport="grpc") == 512 << 10
    # Fetch latency: a histogram in seconds, by transport.
    h = m["strata_peer_fetch_duration_seconds"]
    assert h.type == "histogram"
    assert {s.labels["le"] for s in h.samples if s.name.endswith("_bucket")} >= {"0.001", "1.0", "+Inf"}
    for transport in ("tcp", "grpc"):
        assert sample(m, "strata_peer_fetch_duration_seconds", "_count", transport=transport) == 1
        assert sample(m, "strata_peer_fetch_duration_seconds", "_sum", transport=transport) > 0
    # Fallbacks and repairs: the stale entry on p.
    assert sample(m, "strata_peer_fallbacks", "_total", reason="miss") == 1
    assert sample(m, "strata_peer_index_repairs", "_total", outcome="removed") == 1
    assert sample(m, "strata_handoff_pull_fallbacks", "_total", transport="tcp", reason="unavailable") == 0
    assert m["strata_handoff_pulled_bytes"].type == "counter"
    assert m["strata_handoff_pull_duration_seconds"].type == "histogram"
    assert m["strata_peer_served_bytes"].type == "counter"

    for node in (p, g, d):
        for family in scrape(node).values():
            if not family.name.startswith("strata_"):
                continue
            if family.type == "histogram":
                assert family.name.endswith(("_seconds", "_bytes")), f"{family.name}: a histogram names its unit"
            if "bytes" in family.name:
                assert re.search(r"_bytes($|_)", family.name), f"{family.name}: bytes are _bytes"
            for s in family.samples:
                if family.type == "counter" and not s.name.endswith("_created"):
                    assert s.name.endswith("_total"), f"{s.name}: a counter ends in _total"
                extra = set(s.labels) - BOUNDED_LABELS - {"le", "quantile"}
                assert not extra, f"{s.name} carries unbounded labels {extra}"
                if "transport" in s.labels:
                    assert s.labels["transport"] in SCHEMES, s
                for label, v in s.labels.items():
                    assert len(v) <= 32 and not re.fullmatch(r"[0-9a-f]{16,}", v), f"{s.name}{{{label}={v!r}}}"


def test_strata_stats_shows_handoffs_and_replication(tmp_path):
    """Two daemons replicating (k=2 met, k=3 short) and handing off: one handoff pulled and
    completed, one left to expire; ``strata stats`` on each shows both sides."""
    if not redis_servers.available():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    redis = redis_servers.start_standalone(tmp_path / "redis")
    rules = ("--replicate", f"{REPLICATED}:2,{SHORT}:3", "--replication-interval-seconds", "0.2")
    started = []
    try:
        p = PeerNode(tmp_path, "p", redis.url, "--peer-listen", f"127.0.0.1:{free_port()}", *rules)
        d = PeerNode(tmp_path, "d", redis.url, "--peer-listen", f"127.0.0.1:{free_port()}", *rules)
        for node in (p, d):
            started.append(node.start())
        with Client(p.target, use_shm=False) as pc, Client(d.target, use_shm=False) as dc:
            for i in range(2):
                pc.put(REPLICATED, key_of(f"rep/{i}"), value(f"rep/{i}", 64 << 10))
            pc.put(SHORT, key_of("short"), value("short", 64 << 10))
            keys = [key_of(f"handoff/{i}") for i in range(3)]
            for k in keys:
                pc.put(NS, k, value(k.hex(), 256 << 10))
            params, _ = pc.open_handoff(NS, keys)
            assert dc.pull_handoff(params).completed
            pc.open_handoff(NS, keys[:1], lease_s=0.3)  # nobody pulls it

            def stats(node: PeerNode) -> dict:
                return json.loads(strata("stats", "--target", node.target, "--json"))

            wait_until(lambda: stats(p)["handoffs"]["expired"] == 1, what="the second handoff to expire")
            wait_until(lambda: stats(p)["replication"]["copies_made"] >= 2 and
                       stats(p)["replication"]["under_replicated"] == 1, what="p to copy what it can")
        ps, ds = stats(p), stats(d)
        assert ps["handoffs"] == {"open": 0, "opened": 2, "completed": 1, "expired": 1, "pulls_ok": 0,
                                  "pulls_failed": 0, "pulled_bytes": 0, "pull_fallbacks": 0}
        assert ds["handoffs"] == {"open": 0, "opened": 0, "completed": 0, "expired": 0, "pulls_ok": 1,
                                  "pulls_failed": 0, "pulled_bytes": 3 * (256 << 10), "pull_fallbacks": 0}
        r = ps["replication"]
        assert r["enabled"] and r["copies_failed"] == 0 and r["rounds"] > 0 and r["last_round_unix_seconds"] > 0
        assert r["last_error"] == ""
        text = strata("stats", "--target", p.target)
        assert "handoffs: 0 open, 2 opened, 1 completed, 1 expired; pulls here: 0 ok, 0 failed" in text
        assert re.search(r"replication: 1 blocks under-replicated, \d+ copies pushed \(0 failed\)", text), text
        assert "pulls here: 1 ok, 0 failed, 768.0 KiB pulled, 0 fallbacks" in strata("stats", "--target", d.target)
    finally:
        for node in started:
            node.kill()
        redis.stop()


def test_strata_stats_of_a_daemon_that_replicates_nothing(fleet):
    # No namespace rule and no pin with replicas: replication is on (pins may ask
    # for copies by default) and has nothing to report.
    p, g, d = fleet
    s = json.loads(strata("stats", "--target", g.target, "--json"))
    assert s["replication"]["enabled"] is True and s["handoffs"]["opened"] == 0
    assert s["replication"].get("under_replicated", 0) == 0 and s["replication"].get("copies_made", 0) == 0
    assert "replication: 0 blocks under-replicated" in strata("stats", "--target", g.target)
