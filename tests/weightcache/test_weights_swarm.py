"""Weight nodes as a swarm, as real processes against a real S3 server (moto) through a counting
gate: four nodes fetching one model at once ask the origin for each chunk about once and read the
rest from each other; a peer killed while another waits on it leaves that node to the origin."""

from __future__ import annotations

import signal
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

import weightcache
from benchmarks.harness import free_port
from tests.support.wait import wait_until
from tests.support.weight_nodes import origin_bytes, spawn_node, stub, up
from tests.support.weights_models import layered_tensors, write_numpy_model
from tests.support.weights_s3 import s3_options
from weightcache.api.v1 import weights_pb2 as pb
from weightcache.fetch import FetchLimits
from weightcache.peers import Swarm
from weightcache.prefetch import Prefetcher
from weightcache.service import serve

pytestmark = pytest.mark.system

CHUNK = 64 << 10


@pytest.fixture
def published(tmp_path, make_bucket, s3_gate):
    t = layered_tensors(seed=11, layers=6)
    url = make_bucket().upload(write_numpy_model(tmp_path / "src", [t]), "acme/swarm/rev1")
    gate = s3_gate()
    m = weightcache.publish_model(url, s3=s3_options(gate.endpoint), chunk_bytes=CHUNK)
    gate.reset_counts()
    return url, m, t, gate


def start_node(cache: Path, address: str, members: list[str], endpoint: str) -> subprocess.Popen:
    """A node whose swarm is the static list ``members``."""
    return spawn_node(cache, address, endpoint, *(arg for m in members for arg in ("--peer", m)))


def test_four_nodes_fetching_one_model_ask_the_origin_for_it_about_once(tmp_path, published):
    url, m, t, gate = published
    members = [f"127.0.0.1:{free_port()}" for _ in range(4)]
    nodes = [start_node(tmp_path / f"n{i}", a, members, gate.endpoint) for i, a in enumerate(members)]
    try:
        for a in members:
            wait_until(lambda: up(a), what=f"node {a} up")
        threads = [threading.Thread(target=lambda a=a: stub(a).Prefetch(
            pb.PrefetchRequest(location=url, digest=m.digest), timeout=60)) for a in members]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        status = {}
        for a in members:
            def complete(a=a):
                status[a] = stub(a).Status(pb.StatusRequest(digest=m.digest), timeout=10)
                assert status[a].state != pb.PREFETCH_STATE_FAILED, status[a].error
                return status[a].state == pb.PREFETCH_STATE_COMPLETE
            wait_until(complete, timeout=120, what=f"node {a} warm")
        ratio = origin_bytes(gate) / m.total_bytes
        assert ratio <= 1.1, f"the origin served {ratio:.2f}x the model"
        for a in members:  # every node read from peers, and every node took a share from the origin
            assert status[a].bytes_by_source["peer"] > 0 and status[a].bytes_by_source["origin"] > 0
            assert sum(status[a].bytes_by_source.values()) == m.total_bytes
    finally:
        for p in nodes:
            p.send_signal(signal.SIGTERM)
        for p in nodes:
            p.wait(30)
    with weightcache.open_model(url, m.digest, cache_dir=tmp_path / "n2", s3=s3_options(gate.endpoint)) as r:
        got = dict(r)
        assert r.stats.cached == r.stats.planned
    for k, v in t.items():
        np.testing.assert_array_equal(got[k], v)


def test_a_node_joining_a_swarm_that_holds_the_model_takes_its_own_chunks_from_a_member(tmp_path, published):
    """A scale-up: the swarm's member holds the whole model; this node joins it and owns about half the
    chunks, which nobody fetches from the origin again: every byte comes from the member."""
    url, m, t, gate = published
    peer, me = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    child = start_node(tmp_path / "peer", peer, [peer], gate.endpoint)  # alone, before this node joins
    prefetcher = None
    try:
        wait_until(lambda: up(peer), what="the member up")
        stub(peer).Prefetch(pb.PrefetchRequest(location=url, digest=m.digest), timeout=60)
        wait_until(lambda: stub(peer).Status(pb.StatusRequest(digest=m.digest), timeout=10).state
                   == pb.PREFETCH_STATE_COMPLETE, timeout=120, what="the member warm")
        gate.reset_counts()
        swarm = Swarm([peer, me], me, wait_s=60)
        assert 0 < sum(1 for f in m.files for c in f.chunks if swarm.owner(c) == me) < sum(len(f.chunks) for f in m.files)
        prefetcher = Prefetcher(tmp_path / "me", s3=s3_options(gate.endpoint), swarm=swarm)
        prefetcher.prefetch(url, m.digest)
        wait_until(lambda: prefetcher.status(m.digest).state == "complete", timeout=120, what="this node warm")
        s = prefetcher.status(m.digest)
        assert s.bytes_by_source.get("peer") == m.total_bytes and not s.bytes_by_source.get("origin")
        assert origin_bytes(gate) == 0
    finally:
        child.send_signal(signal.SIGTERM)
        child.wait(30)
        if prefetcher is not None:
            prefetcher.close()
    with weightcache.open_model(url, m.digest, cache_dir=tmp_path / "me", s3=s3_options(gate.endpoint)) as r:
        got = dict(r)
    for k, v in t.items():
        np.testing.assert_array_equal(got[k], v)


def test_a_peer_killed_while_a_node_waits_on_it_leaves_that_node_to_the_origin(tmp_path, published, s3_gate):
    url, m, t, gate = published
    stuck = s3_gate()
    stuck.hold_after(0)  # the other node's origin answers nothing: it will own chunks it never gets
    peer, me = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    child = start_node(tmp_path / "peer", peer, [peer, me], stuck.endpoint)
    limits = FetchLimits(max_in_flight=4, origin_concurrency=4, backoff_base_s=0.001, backoff_max_s=0.01,
                         poll_interval_s=0.005)
    prefetcher = Prefetcher(tmp_path / "me", limits=limits, s3=s3_options(gate.endpoint),
                            swarm=Swarm([peer, me], me, wait_s=60))
    server, _ = serve(prefetcher, me)
    try:
        wait_until(lambda: up(peer), what="the peer up")
        stub(peer).Prefetch(pb.PrefetchRequest(location=url, digest=m.digest), timeout=60)
        prefetcher.prefetch(url, m.digest)
        swarm = Swarm([peer, me], me)
        mine = sum(1 for f in m.files for c in f.chunks if swarm.owner(c) == me)
        wait_until(lambda: prefetcher.status(m.digest).verified_chunks == mine and stuck.held > 0,
                   what="this node done with its own chunks, waiting on the peer's")
        assert prefetcher.status(m.digest).state == "running"
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        wait_until(lambda: prefetcher.status(m.digest).state == "complete", timeout=120, what="the rest from the origin")
        s = prefetcher.status(m.digest)
        assert s.bytes_by_source["origin"] == m.total_bytes and not s.bytes_by_source.get("peer")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
        stuck.release()
        server.stop(0).wait()
        prefetcher.close()
    with weightcache.open_model(url, m.digest, cache_dir=tmp_path / "me", s3=s3_options(gate.endpoint)) as r:
        got = dict(r)
    for k, v in t.items():
        np.testing.assert_array_equal(got[k], v)


def test_a_hung_peer_times_out_per_chunk_and_the_prefetch_completes_from_the_origin(tmp_path, published, s3_gate):
    """A swarm member stopped (SIGSTOP: its port still accepts, nothing answers) while this node waits
    on the chunks it owns: each read of it ends at its own deadline, the chunk comes from the origin
    in the same round, the member is passed over, and the prefetch completes with the right bytes."""
    url, m, t, gate = published
    stuck = s3_gate()
    stuck.hold_after(0)  # the member owns chunks it never gets: this node waits on it, as on a slow owner
    peer, me = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    child = start_node(tmp_path / "peer", peer, [peer, me], stuck.endpoint)
    limits = FetchLimits(max_in_flight=4, origin_concurrency=4, backoff_base_s=0.001, backoff_max_s=0.01,
                         poll_interval_s=0.005)
    prefetcher = Prefetcher(tmp_path / "me", limits=limits, s3=s3_options(gate.endpoint),
                            swarm=Swarm([peer, me], me, wait_s=60))
    server, _ = serve(prefetcher, me)
    try:
        wait_until(lambda: up(peer), what="the peer up")
        stub(peer).Prefetch(pb.PrefetchRequest(location=url, digest=m.digest), timeout=60)
        prefetcher.prefetch(url, m.digest)
        mine = sum(1 for f in m.files for c in f.chunks if Swarm([peer, me], me).owner(c) == me)
        wait_until(lambda: prefetcher.status(m.digest).verified_chunks == mine and stuck.held > 0,
                   what="this node done with its own chunks, waiting on the peer's")
        child.send_signal(signal.SIGSTOP)
        wait_until(lambda: prefetcher.status(m.digest).state == "complete", timeout=120,
                   what="the hung peer's chunks from the origin")
        s = prefetcher.status(m.digest)
        assert s.bytes_by_source["origin"] == m.total_bytes and not s.bytes_by_source.get("peer")
        assert child.poll() is None  # still there, still stopped: nothing here depended on it ending
    finally:
        child.send_signal(signal.SIGCONT)
        child.kill()
        child.wait(30)
        stuck.release()
        server.stop(0).wait()
        prefetcher.close()
    with weightcache.open_model(url, m.digest, cache_dir=tmp_path / "me", s3=s3_options(gate.endpoint)) as r:
        got = dict(r)
        assert r.stats.cached == r.stats.planned
    for k, v in t.items():
        np.testing.assert_array_equal(got[k], v)


def test_a_peer_read_waits_past_one_poll_for_a_chunk_its_owner_is_still_fetching(tmp_path, published, s3_gate):
    """The owner's origin answers nothing for a while: the reader's short calls keep asking (the owner
    says "not yet") and take the chunk from the owner once it has it, not from the origin."""
    import asyncio
    import time

    from weightcache.peers import POLL_S, PeerChunkSource
    from weightcache.sources import ChunkRef

    url, m, t, _ = published
    stuck = s3_gate()
    stuck.hold_after(0)
    limits = FetchLimits(max_in_flight=4, origin_concurrency=4, poll_interval_s=0.005)
    owner = Prefetcher(tmp_path / "owner", limits=limits, s3=s3_options(stuck.endpoint))
    server, port = serve(owner, "127.0.0.1:0")
    got = {}
    f = m.file_index(next(e.path for e in m.files if e.path.endswith(".safetensors")))
    ref = ChunkRef.of(m, f, 2)

    def read():
        async def go():
            source = PeerChunkSource(f"127.0.0.1:{port}", m.digest, wait_s=60)
            try:
                view = await source.read(ref, memoryview(bytearray(ref.length)))
                got["data"] = None if view is None else bytes(view)
            finally:
                await source.close()

        asyncio.run(go())

    reader = threading.Thread(target=read)
    try:
        owner.prefetch(url, m.digest)
        wait_until(lambda: stuck.held > 0, what="the owner's fetch held at its origin")
        reader.start()
        time.sleep(POLL_S * 2.5)  # sequencing, not a claim: the read outlives more than one poll
        assert reader.is_alive() and "data" not in got
        stuck.release()
        reader.join(60)
        wait_until(lambda: owner.status(m.digest).state == "complete", what="the owner's prefetch")
    finally:
        stuck.release()
        reader.join(60)
        server.stop(0).wait()
        owner.close()
    source = (tmp_path / "src" / m.files[f].path).read_bytes()
    assert got["data"] == source[ref.start:ref.start + ref.length]  # from the owner: the reader has no origin
