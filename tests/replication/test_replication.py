"""Replication: k copies of a namespace's blocks on distinct live nodes, restored when a holder dies.

The planning rules are checked as plain functions; the behaviour across
real ``strata serve`` processes (one real Redis index, each daemon with its
TCP peer listener, holders killed with SIGKILL). Waits are bounded polls;
no assertion is about how long anything took.
"""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys

import pytest

from benchmarks.harness import free_port
from kvstore.block import TierName
from kvstore.client.sync import Client
from kvstore.config import SettingsError, load_settings
from kvstore.replication.policy import ReplicationPolicy
from kvstore.replication.replicator import plan, rank
from tests.support import redis_servers
from tests.support.peer_cluster import PeerNode
from tests.support.wait import wait_until

R, WIDE, PLAIN = "r", "wide", "plain"
INTERVAL = "0.2"


def value(tag: str, size: int) -> bytes:
    return random.Random(hashlib.blake2b(tag.encode()).digest()).randbytes(size)


def keys_of(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(n)]


# ---- the rules -------------------------------------------------------------------------


def test_only_the_smallest_holder_pushes_and_every_holder_picks_the_same_targets():
    key = b"block"
    fleet = ["a", "b", "c", "d", "e"]
    seen = []
    for me in ("b", "d"):
        short, p = plan(key, 3, me, {"b", "d"}, [n for n in fleet if n != me])
        seen.append(p)
        assert short == 1 and p.pusher == "b" and p.holders == {"b", "d"}
    assert seen[0].targets == seen[1].targets  # the same target, whichever holder computes it
    assert seen[0].targets[0] in {"a", "c", "e"}
    short, p = plan(key, 2, "a", {"b"}, ["b", "c"])  # this node counts even before the index names it
    assert short == 0 and p.targets == () and p.pusher == "a"
    short, p = plan(key, 5, "a", set(), ["b"])  # more copies asked than nodes: the shortfall stays
    assert short == 4 and p.targets == ("b",)


def test_targets_spread_over_the_fleet():
    fleet = [f"n{i}" for i in range(8)]
    firsts = {rank(k, fleet)[0] for k in keys_of("spread", 64)}
    assert len(firsts) >= 4  # not every block's copy goes to one neighbour


def test_the_most_specific_rule_wins():
    p = ReplicationPolicy({"*": 2, "team-*": 3, "team-a-*": 4, "team-a-x": 5})
    assert p.replicas("other").k == 2
    assert p.replicas("team-b").k == 3
    assert p.replicas("team-a-y").k == 4 and p.replicas("team-a-y").rule == "team-a-*"
    assert p.replicas("team-a-x").k == 5
    assert ReplicationPolicy({"r": 2}).replicas("rr") is None
    assert not ReplicationPolicy({})


def test_replication_settings_from_flags_and_file(tmp_path):
    s = load_settings(replicate="r:2, team-*:3", replication_interval_seconds="0.5")
    assert s.replication.namespaces == {"r": 2, "team-*": 3} and s.replication.interval_seconds == 0.5
    config = tmp_path / "s.toml"
    config.write_text('[replication]\nnamespaces = { "r" = 2, "*" = 1 }\nbytes_per_round = "64MiB"\n')
    s = load_settings(config)
    assert s.replication.namespaces == {"r": 2, "*": 1} and int(s.replication.bytes_per_round) == 64 << 20
    for bad, why in [("r", "is not NAMESPACE:K"), ("r:0", "from 1 to 16"), ("r:17", "from 1 to 16"),
                     ("a*b:2", "may only end"), ("r:2,r:3", "given twice")]:
        with pytest.raises(SettingsError, match=why) as err:
            load_settings(replicate=bad)
        assert "--replicate" in str(err.value)


# ---- real daemons ----------------------------------------------------------------------


@pytest.fixture
def index_url(tmp_path):
    """A Redis of each test's own: a node killed by the test before stays alive in a shared
    index until its heartbeats lapse, and would be a target that refuses every push."""
    if not redis_servers.available():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = redis_servers.start_standalone(tmp_path / "redis")
    yield server.url
    server.stop()


@pytest.fixture
def nodes(tmp_path, index_url):
    started: list[PeerNode] = []

    def start(name: str, *extra: str) -> PeerNode:
        node = PeerNode(tmp_path, name, index_url, "--peer-listen", f"127.0.0.1:{free_port()}",
                        "--replicate", f"{R}:2,{WIDE}:5", "--replication-interval-seconds", INTERVAL, *extra)
        started.append(node)
        return node.start()

    yield start
    for node in started:
        node.kill()


def holders(client: Client, namespace: str, keys: list[bytes]) -> list[set[str]]:
    return [{h.node_id for h in held} for held in client.holders(namespace, keys=keys)]


def replication(target: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "kvstore.cli.main", "replication", "--target", target, "--json"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def rounds_after(node: PeerNode, n: int) -> None:
    """Wait until ``node`` has ended ``n`` more replication rounds than it has now."""
    start = node.metric("strata_replication_rounds_total", outcome="ok")
    wait_until(lambda: node.metric("strata_replication_rounds_total", outcome="ok") >= start + n,
               what=f"{node.name} to run {n} replication rounds")


def test_blocks_get_k_copies_and_a_killed_holder_s_copies_are_restored(nodes):
    a, b, c = nodes("a"), nodes("b"), nodes("c")
    keys = keys_of("r", 6)
    data = [value(f"r/{i}", 1 << 18) for i in range(6)]
    plain = keys_of("plain", 3)
    with Client(a.target, use_shm=False) as ca:
        for k, v in zip(keys, data):
            ca.put(R, k, v)
        for k in plain:
            ca.put(PLAIN, k, b"p" * 4096)
        wait_until(lambda: all(len(h) == 2 and "a" in h for h in holders(ca, R, keys)),
                   what="every block of r to have two holders")
        rounds_after(a, 3)  # rounds enough to have pushed the other namespace too, if it were pushed
        assert holders(ca, PLAIN, plain) == [{"a"}] * 3  # not replicated: never pushed
        assert all(len(h) == 2 for h in holders(ca, R, keys))  # exactly k: nothing pushed twice
        assert a.metric("strata_replication_copies_total", outcome="made") == 6
        assert a.metric("strata_replication_copies_total", outcome="failed") == 0

        by_node = {"b": b, "c": c}
        on = {name: [i for i, h in enumerate(holders(ca, R, keys)) if name in h] for name in by_node}
        victim = max(on, key=lambda name: len(on[name]))  # the node holding most second copies
        survivor = by_node["c" if victim == "b" else "b"]
        lost = on[victim]
        assert lost, "one of b and c holds second copies"
        by_node[victim].kill()

        # Once the index drops the dead holder, a pushes the lost copies to the survivor.
        wait_until(lambda: all(h == {"a", survivor.name} for i, h in enumerate(holders(ca, R, keys)) if i in lost)
                   and all(len(h) == 2 for h in holders(ca, R, keys)), timeout=60,
                   what="the killed holder's copies to be restored on the survivor")
    with Client(survivor.target, use_shm=False) as cs:
        assert all(t in (TierName.HOST, TierName.DISK) for t in cs.exists(R, keys))  # its own copies
        for k, v in zip(keys, data):
            assert cs.get(R, k) == v  # the bytes that were put
    wait_until(lambda: a.metric("strata_replication_under_replicated_blocks", rule=R) == 0
               and survivor.metric("strata_replication_under_replicated_blocks", rule=R) == 0,
               what="no block of r reported under-replicated")
    report = {n["namespace"]: n for n in replication(a.target)["namespaces"]}
    assert report[R]["blocks"] == 6 and report[R]["under_replicated"] == 0 and report[R]["replicas"] == 2
    assert PLAIN not in report


def test_more_copies_asked_than_live_nodes_are_reported_without_pushing_again(nodes):
    a, b = nodes("a"), nodes("b")
    keys = keys_of("wide", 4)
    with Client(a.target, use_shm=False) as ca:
        for k in keys:
            ca.put(WIDE, k, value(k.hex(), 1 << 16))
        wait_until(lambda: all(h == {"a", "b"} for h in holders(ca, WIDE, keys)), what="a copy of each on b")
        wait_until(lambda: a.metric("strata_replication_under_replicated_blocks", rule=WIDE) == 4
                   and b.metric("strata_replication_under_replicated_blocks", rule=WIDE) == 4,
                   what="both holders to report the blocks short of k=5")
        made = a.metric("strata_replication_copies_total", outcome="made")
        assert made == 4
        rounds_after(a, 5)
        rounds_after(b, 5)
        # Still short, and nothing more to do: no push repeated, none failed, the rounds go on.
        assert a.metric("strata_replication_copies_total", outcome="made") == made
        assert b.metric("strata_replication_copies_total", outcome="made") == 0
        assert a.metric("strata_replication_copies_total", outcome="failed") == 0
        assert a.metric("strata_replication_under_replicated_blocks", rule=WIDE) == 4
    report = replication(b.target)
    assert report["enabled"] and report["rounds"] >= 5 and report["last_error"] == ""
    [wide] = [n for n in report["namespaces"] if n["namespace"] == WIDE]
    assert wide == {"namespace": WIDE, "rule": WIDE, "replicas": 5, "blocks": 4, "under_replicated": 4,
                    "copies_made": 0, "copies_failed": 0}
    text = subprocess.run(
        [sys.executable, "-m", "kvstore.cli.main", "replication", "--target", b.target, "--check"],
        capture_output=True, text=True, timeout=60,
    )
    assert text.returncode == 4 and "4 under-replicated" in text.stdout


def test_a_lone_node_reports_its_blocks_short_and_stops_cleanly(make_daemon):
    """With the embedded index there are no peers: every block is short of k, and no push is tried."""
    d = make_daemon(replicate=f"{R}:2", replication_interval_seconds="0.05")
    keys = keys_of("lone", 3)
    with Client(d.target, use_shm=False) as c:
        assert c.replication().namespaces == []  # nothing held yet
        for k in keys:
            c.put(R, k, b"x" * 1024)
        c.put(PLAIN, b"other", b"y")
        wait_until(lambda: [(n.namespace, n.blocks, n.under_replicated) for n in c.replication().namespaces]
                   == [(R, 3, 3)], what="the replicator to check the blocks")
        r = c.replication()
        assert r.enabled and r.node_id == d.node.node_id and r.last_error == ""
        assert r.namespaces[0].copies_made == r.namespaces[0].copies_failed == 0
    d.stop(0)
    assert not d.replicator._thread.is_alive()


def test_a_daemon_without_replication_says_so(make_daemon):
    pins_only = make_daemon()  # no namespace rule; pins may still ask for replicas
    off = make_daemon(replication_max_pin_replicas="1")
    with Client(pins_only.target, use_shm=False) as c:
        r = c.replication()
    assert not r.enabled and r.namespaces == [] and r.pins == [] and r.max_pin_replicas == 4
    with Client(off.target, use_shm=False) as c:
        r = c.replication()
    assert not r.enabled and r.namespaces == [] and r.max_pin_replicas == 0 and off.replicator is None
