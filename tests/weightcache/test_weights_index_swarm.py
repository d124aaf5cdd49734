"""Weight nodes that find each other and each chunk's holders through the prefix index: real
processes sharing a real redis-server index and a real S3 server (moto) behind a counting gate.
Three nodes fetch one model from the origin about once; a node that joins later reads every chunk
from the holders the index names; one killed (SIGKILL) mid-fetch drops out, and the others still
complete with the origin serving about one model's bytes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

import weightcache
from benchmarks.harness import free_port
from kvstore.index.redis import RedisIndex
from tests.support.wait import wait_until
from tests.support.weight_nodes import origin_bytes, spawn_node, stub, up
from tests.support.weights_models import layered_tensors, write_numpy_model
from tests.support.weights_s3 import s3_options
from weightcache.api.v1 import weights_pb2 as pb
from weightcache.index_swarm import MEMBER_KEY, chunk_key, namespace_of

pytestmark = pytest.mark.system

CHUNK = 64 << 10


@pytest.fixture
def published(tmp_path, make_bucket, s3_gate):
    t = layered_tensors(seed=int.from_bytes(os.urandom(2), "little"), layers=6)  # a digest of this test's own
    url = make_bucket().upload(write_numpy_model(tmp_path / "src", [t]), f"acme/indexed/{tmp_path.name}")
    gate = s3_gate()
    m = weightcache.publish_model(url, s3=s3_options(gate.endpoint), chunk_bytes=CHUNK)
    gate.reset_counts()
    return url, m, t, gate


def start_node(cache: Path, address: str, index: str, endpoint: str) -> subprocess.Popen:
    """A node that finds its peers and each chunk's holders through the index at ``index``."""
    return spawn_node(cache, address, endpoint, "--index-url", index, "--index-ttl", "3s")


def prefetch_all(addresses: list[str], url: str, digest: str) -> None:
    threads = [threading.Thread(target=lambda a=a: stub(a).Prefetch(
        pb.PrefetchRequest(location=url, digest=digest), timeout=60)) for a in addresses]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def status(address: str, digest: str):
    return stub(address).Status(pb.StatusRequest(digest=digest), timeout=10)


def complete(address: str, digest: str) -> bool:
    s = status(address, digest)
    assert s.state != pb.PREFETCH_STATE_FAILED, s.error
    return s.state == pb.PREFETCH_STATE_COMPLETE


def stop(nodes: list[subprocess.Popen]) -> None:
    for p in nodes:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in nodes:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(30)


def test_three_nodes_share_the_origin_and_a_late_node_reads_only_from_holders(tmp_path, published, redis_url):
    url, m, t, gate = published
    members = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    nodes = [start_node(tmp_path / f"n{i}", a, redis_url, gate.endpoint) for i, a in enumerate(members)]
    try:
        for a in members:
            wait_until(lambda a=a: up(a), what=f"node {a} up")
        prefetch_all(members, url, m.digest)
        for a in members:
            wait_until(lambda a=a: complete(a, m.digest), timeout=120, what=f"node {a} warm")
        ratio = origin_bytes(gate) / m.total_bytes
        assert ratio <= 1.05, f"the origin served {ratio:.2f}x the model"
        for a in members:
            s = status(a, m.digest)
            assert s.bytes_by_source["peer"] > 0 and sum(s.bytes_by_source.values()) == m.total_bytes

        # Every chunk is in the index now, each with its three holders.
        async def holders():
            ix = RedisIndex.from_url(redis_url)
            try:
                ns = namespace_of(m.digest)
                keys = [chunk_key(f, c) for f, e in enumerate(m.files) for c in range(len(e.chunks))]
                return await ix.holders(ns, [MEMBER_KEY]), await ix.holders(ns, keys)
            finally:
                await ix.close()

        def announced() -> bool:  # each node announces what it verified every refresh (0.5 s)
            who, per_chunk = asyncio.run(holders())
            assert sorted(h.node_id for h in who[0]) == sorted(members)
            return all(sorted(h.node_id for h in hs) == sorted(members) for hs in per_chunk)

        wait_until(announced, timeout=30, what="every chunk's three holders in the index")

        gate.reset_counts()
        late = f"127.0.0.1:{free_port()}"
        nodes.append(start_node(tmp_path / "late", late, redis_url, gate.endpoint))
        wait_until(lambda: up(late), what="the late node up")
        prefetch_all([late], url, m.digest)
        wait_until(lambda: complete(late, m.digest), timeout=120, what="the late node warm")
        assert dict(status(late, m.digest).bytes_by_source) == {"peer": m.total_bytes}
        assert origin_bytes(gate) == 0
    finally:
        stop(nodes)
    with weightcache.open_model(url, m.digest, cache_dir=tmp_path / "late", s3=s3_options(gate.endpoint)) as r:
        got = dict(r)
    for k, v in t.items():
        np.testing.assert_array_equal(got[k], v)


def test_a_node_killed_mid_fetch_drops_out_and_the_others_complete_from_about_one_origin_copy(
        tmp_path, published, s3_gate, redis_url):
    url, m, t, gate = published
    stuck = s3_gate()
    stuck.hold_after(2)  # the doomed node gets two of its chunks, then its origin answers nothing
    survivors = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    doomed = f"127.0.0.1:{free_port()}"
    nodes = [start_node(tmp_path / f"n{i}", a, redis_url, gate.endpoint) for i, a in enumerate(survivors)]
    victim = start_node(tmp_path / "doomed", doomed, redis_url, stuck.endpoint)
    try:
        for a in [*survivors, doomed]:
            wait_until(lambda a=a: up(a), what=f"node {a} up")
        prefetch_all([*survivors, doomed], url, m.digest)
        members = sorted([*survivors, doomed])

        def owner(digest: bytes) -> str:
            return members[int.from_bytes(digest[:8], "little") % len(members)]

        share = {a: sum(1 for f in m.files for c in f.chunks if owner(c) == a) for a in survivors}
        wait_until(lambda: stuck.held > 0 and all(status(a, m.digest).verified_chunks >= share[a] for a in survivors),
                   timeout=120, what="the survivors done with their own shares, the doomed node stuck on its own")
        assert all(status(a, m.digest).state == pb.PREFETCH_STATE_RUNNING for a in survivors)
        victim.send_signal(signal.SIGKILL)
        victim.wait(30)
        for a in survivors:
            wait_until(lambda a=a: complete(a, m.digest), timeout=120, what=f"survivor {a} warm")
        ratio = origin_bytes(gate) / m.total_bytes
        assert ratio <= 1.05, f"the survivors' origin served {ratio:.2f}x the model"
        for a in survivors:
            assert sum(status(a, m.digest).bytes_by_source.values()) == m.total_bytes
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(30)
        stuck.release()
        stop(nodes)
    with weightcache.open_model(url, m.digest, cache_dir=tmp_path / "n0", s3=s3_options(gate.endpoint)) as r:
        got = dict(r)
        assert r.stats.cached == r.stats.planned
    for k, v in t.items():
        np.testing.assert_array_equal(got[k], v)
