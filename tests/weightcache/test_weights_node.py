"""A weight node (WeightService over real gRPC): prefetch into a node cache, status, the init
container's `strata weights wait` (exit 0 warm, 4 at the deadline), metrics by source, and peer
chunk reads: a miss is an answer, a peer's corrupt chunk is refetched from the origin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

import weightcache
from benchmarks.harness import free_port
from tests.support.wait import wait_until
from tests.support.weights_models import layered_tensors, write_numpy_model
from weightcache.api.v1 import weights_pb2 as pb
from weightcache.api.v1 import weights_pb2_grpc as pb_grpc
from weightcache.fetch import FetchLimits
from weightcache.metrics import WeightMetrics
from weightcache.peers import PeerChunkSource
from weightcache.prefetch import Prefetcher
from weightcache.service import serve

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 64 << 10
FAST = FetchLimits(max_in_flight=4, origin_concurrency=4, backoff_base_s=0.001, backoff_max_s=0.01, poll_interval_s=0.005)


@pytest.fixture
def model(tmp_path):
    t = layered_tensors(seed=3, layers=4)
    folder = write_numpy_model(tmp_path / "src", [t])
    return str(folder), weightcache.publish_model(str(folder), chunk_bytes=CHUNK), t


@pytest.fixture
def node(tmp_path):
    """A started weight node: (prefetcher, address, stub, metrics)."""
    metrics = WeightMetrics()
    prefetcher = Prefetcher(tmp_path / "node", limits=FAST, metrics=metrics)
    server, port = serve(prefetcher, "127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield prefetcher, f"127.0.0.1:{port}", pb_grpc.WeightServiceStub(channel), metrics
    channel.close()
    server.stop(0).wait()
    prefetcher.close()


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "weightcache", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_prefetch_fills_the_cache_and_wait_exits_zero_when_warm(tmp_path, model, node):
    folder, m, t = model
    _, address, stub, metrics = node
    done = cli("prefetch", folder, m.digest, "--node", address, "--wait", "60s", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == m.digest
    s = stub.Status(pb.StatusRequest(digest=m.digest), timeout=10)
    assert s.state == pb.PREFETCH_STATE_COMPLETE
    assert s.verified_chunks == s.total_chunks == m.total_chunks and s.verified_bytes == m.total_bytes
    assert s.bytes_by_source["origin"] == m.total_bytes
    assert metrics.registry.get_sample_value("strata_weights_fetched_bytes_total", {"source": "origin"}) == m.total_bytes
    assert metrics.registry.get_sample_value("strata_weights_time_to_complete_seconds_count") == 1
    again = stub.Prefetch(pb.PrefetchRequest(location=folder, digest=m.digest), timeout=30)
    assert (again.digest, again.started) == (m.digest, False)
    warm = cli("wait", m.digest, "--node", address, "--deadline", "5s", "--no-progress", "--json")
    assert warm.returncode == 0, warm.stderr
    # the node cache holds the model: a reader on this node needs no origin at all (an empty one)
    (tmp_path / "gone").mkdir()
    with weightcache.open_model(str(tmp_path / "gone"), m.digest, cache_dir=tmp_path / "node", limits=FAST) as r:
        got = dict(r)
        assert r.stats.cached == r.stats.planned
    for k, v in t.items():
        np.testing.assert_array_equal(got[k], v)


def test_wait_gives_up_at_its_deadline_with_a_clear_message(node):
    _, address, _, _ = node
    digest = "0" * 64
    done = cli("wait", digest, "--node", address, "--deadline", "0.3s", "--interval", "0.1s", "--no-progress")
    assert done.returncode == 4
    assert "is not warm" in done.stderr and "strata weights prefetch" in done.stderr


def test_wait_on_a_node_that_is_not_up_says_so_at_the_deadline(tmp_path):
    done = cli("wait", "0" * 64, "--node", f"127.0.0.1:{free_port()}", "--deadline", "0.5s", "--interval", "0.1s",
               "--no-progress")
    assert done.returncode == 4 and "the node answered" in done.stderr


def test_wait_for_a_digest_the_node_rejects_fails_at_once(node):
    """A typo in an init container's digest must not cost the whole deadline: the node rejects it at once."""
    _, address, _, _ = node
    done = cli("wait", "0000", "--node", address, "--deadline", "10m", "--interval", "0.1s", "--no-progress",
               timeout=60)
    assert done.returncode == 2, done.stderr
    assert "digest" in done.stderr and "longer --deadline" not in done.stderr


def test_prefetches_stuck_on_an_origin_that_does_not_answer_hold_at_most_their_share_of_the_workers(
        tmp_path, monkeypatch):
    """A Prefetch resolves its manifest before it answers; an origin that never answers would hold its
    worker for all its retries. Beyond max_resolving such calls the next is refused at once with a retry
    delay, and Status keeps answering. The origin here is a stand-in that blocks until released."""
    import threading

    import weightcache.reader

    release, entered = threading.Event(), threading.Semaphore(0)

    def unreachable_origin(*_args, **_kw):
        entered.release()
        release.wait(30)
        raise weightcache.errors.OriginUnavailable("the origin did not answer")

    monkeypatch.setattr(weightcache.reader, "open_model", unreachable_origin)
    prefetcher = Prefetcher(tmp_path / "node", limits=FAST, max_resolving=2)
    server, port = serve(prefetcher, "127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.WeightServiceStub(channel)
    stuck = [stub.Prefetch.future(pb.PrefetchRequest(location="s3://nowhere/m/r"), timeout=60) for _ in range(2)]
    try:
        for _ in stuck:
            assert entered.acquire(timeout=30), "the stuck prefetches never reached the origin"
        with pytest.raises(grpc.RpcError) as refused:
            stub.Prefetch(pb.PrefetchRequest(location="s3://nowhere/m/r"), timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "resolving their manifest" in refused.value.details()
        assert stub.Status(pb.StatusRequest(digest="0" * 64), timeout=10).state == pb.PREFETCH_STATE_UNKNOWN
    finally:
        release.set()
        for call in stuck:
            with pytest.raises(grpc.RpcError):
                call.result(timeout=30)
        channel.close()
        server.stop(0).wait()
        prefetcher.close()
    assert prefetcher._resolving.acquire(blocking=False), "a failed resolution kept its place"


def test_bad_input_is_invalid_argument(node):
    _, _, stub, _ = node
    with pytest.raises(grpc.RpcError) as err:
        stub.Status(pb.StatusRequest(digest="not-a-digest"), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        stub.Prefetch(pb.PrefetchRequest(location="/nowhere/at/all"), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_read_chunk_serves_verified_chunks_and_misses_what_it_lacks(model, node):
    folder, m, _ = model
    prefetcher, _, stub, metrics = node
    miss = stub.ReadChunk(pb.ReadChunkRequest(digest=m.digest, file=0, chunk=0), timeout=10)
    assert not miss.found
    prefetcher.prefetch(folder, m.digest)
    wait_until(lambda: prefetcher.status(m.digest).state == "complete", what="the prefetch to complete")
    f = m.file_index(next(e.path for e in m.files if e.path.endswith(".safetensors")))
    hit = stub.ReadChunk(pb.ReadChunkRequest(digest=m.digest, file=f, chunk=1), timeout=10)
    start, end = m.files[f].chunk_span(1, m.chunk_bytes)
    assert hit.found and hit.data == (Path(folder) / m.files[f].path).read_bytes()[start:end]
    assert metrics.registry.get_sample_value("strata_weights_served_bytes_total") == end - start
    with pytest.raises(grpc.RpcError) as err:
        stub.ReadChunk(pb.ReadChunkRequest(digest=m.digest, file=f, chunk=10_000), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_peer_is_read_first_and_its_corrupt_chunk_is_refetched_from_the_origin(tmp_path, model, node):
    folder, m, t = model
    prefetcher, address, _, _ = node
    prefetcher.prefetch(folder, m.digest)
    wait_until(lambda: prefetcher.status(m.digest).state == "complete", what="the peer's prefetch")
    # damage one chunk at rest in the peer's cache: the peer serves it as recorded, unverified
    f = m.file_index(next(e.path for e in m.files if e.path.endswith(".safetensors")))
    path = tmp_path / "node" / "models" / m.digest / "files" / m.files[f].path
    with open(path, "r+b") as fh:
        fh.seek(2 * CHUNK + 5)
        b = fh.read(1)
        fh.seek(2 * CHUNK + 5)
        fh.write(bytes([b[0] ^ 0xFF]))
    peer = PeerChunkSource(address, m.digest)
    with weightcache.open_model(folder, m.digest, cache_dir=tmp_path / "other", limits=FAST, sources=[peer]) as r:
        got = dict(r)
        stats = r.stats
    for k, v in t.items():
        np.testing.assert_array_equal(got[k], v)
    assert stats.corrupt == 1  # the peer's copy failed its digest once; the same round asked the origin
    assert stats.fetched["origin"] == 1 and stats.fetched["peer"] == stats.planned - 1


def test_a_node_at_its_upload_bound_refuses_as_overloaded(model, node):
    folder, m, _ = model
    prefetcher, _, stub, _ = node
    prefetcher.prefetch(folder, m.digest)
    wait_until(lambda: prefetcher.status(m.digest).state == "complete", what="the prefetch to complete")
    held = 0
    while prefetcher._uploads.acquire(blocking=False):  # every upload slot busy, as under load
        held += 1
    try:
        with pytest.raises(grpc.RpcError) as err:
            stub.ReadChunk(pb.ReadChunkRequest(digest=m.digest, file=0, chunk=0), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        for _ in range(held):
            prefetcher._uploads.release()
    assert held == 8 and stub.ReadChunk(pb.ReadChunkRequest(digest=m.digest, file=0, chunk=0), timeout=10).found


def test_a_swarm_member_never_asked_for_the_model_costs_only_its_join_wait(tmp_path, model):
    """The other member is up but never told to prefetch: this node's requests to it miss after
    join_wait_s (not the whole peer wait) and the origin serves everything."""
    from weightcache.peers import Swarm

    folder, m, t = model
    idle = Prefetcher(tmp_path / "idle", limits=FAST, join_wait_s=0.05)
    idle_server, idle_port = serve(idle, "127.0.0.1:0")
    me_server = None
    try:
        me = f"127.0.0.1:{free_port()}"
        peer = f"127.0.0.1:{idle_port}"
        prefetcher = Prefetcher(tmp_path / "me", limits=FAST, swarm=Swarm([peer, me], me, wait_s=600))
        me_server, _ = serve(prefetcher, me)
        prefetcher.prefetch(folder, m.digest)
        wait_until(lambda: prefetcher.status(m.digest).state == "complete", timeout=60, what="all from the origin")
        s = prefetcher.status(m.digest)
        assert s.bytes_by_source["origin"] == m.total_bytes and not s.bytes_by_source.get("peer")
        prefetcher.close()
    finally:
        if me_server is not None:
            me_server.stop(0).wait()
        idle_server.stop(0).wait()
        idle.close()


def test_waiting_chunk_reads_are_bounded_so_status_and_prefetch_always_answer(tmp_path, model):
    """200 peers wait on a model this node does not have: the first ``max_waiting`` wait, the rest are
    refused at once as overloaded (with a retry delay), and Status and Prefetch still get a worker."""
    import time

    from kvstore.errors import ResourceExhausted
    from kvstore.rpc.status import from_rpc_error

    folder, m, _ = model
    prefetcher = Prefetcher(tmp_path / "node", limits=FAST, join_wait_s=600)  # waits that would never end
    server, port = serve(prefetcher, "127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.WeightServiceStub(channel)
    calls, refused = [], []
    try:
        absent = "a" * 64
        calls = [stub.ReadChunk.future(pb.ReadChunkRequest(digest=absent, file=0, chunk=i, wait_ms=60_000), timeout=90)
                 for i in range(200)]
        time.sleep(1.0)  # sequencing, not a claim: the reads reach the node before Status does
        s = stub.Status(pb.StatusRequest(digest=m.digest), timeout=10)  # a worker is free for it
        assert s.state == pb.PREFETCH_STATE_UNKNOWN
        cap = prefetcher.max_waiting
        wait_until(lambda: sum(c.done() for c in calls) >= len(calls) - cap, timeout=60,
                   what="the reads past the waiting bound refused")
        refused = [c for c in calls if c.done()]
        assert len(refused) == len(calls) - cap
        for c in refused:
            assert c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            err = from_rpc_error(c.exception())
            assert isinstance(err, ResourceExhausted) and err.retry_after_s > 0
            assert "ask again" in c.details()
        started = stub.Prefetch(pb.PrefetchRequest(location=folder, digest=m.digest), timeout=30)
        assert started.digest == m.digest
        wait_until(lambda: stub.Status(pb.StatusRequest(digest=m.digest), timeout=10).state
                   == pb.PREFETCH_STATE_COMPLETE, what="the prefetch beside the waiting reads")
        assert not any(c.done() for c in calls if c not in refused)  # the waiting ones still wait
    finally:
        prefetcher.close()  # ends every wait: the waiting reads answer "not here"
        for c in calls:
            if c not in refused:
                assert not c.result(timeout=30).found
        channel.close()
        server.stop(0).wait()


def test_a_wait_that_runs_out_says_pending_and_the_join_window_counts_from_the_first_ask(tmp_path):
    """A caller asks again every few seconds while it waits: "not yet" is an answer of its own, and a
    node never asked for the model stops saying it once the caller has waited ``join_wait_s`` in all."""
    prefetcher = Prefetcher(tmp_path / "node", limits=FAST, join_wait_s=30)
    try:
        absent = "b" * 64
        first = prefetcher.read_chunk(absent, 0, 0, wait_s=0.01)
        assert first.data is None and first.pending
        late = prefetcher.read_chunk(absent, 0, 0, wait_s=0.01, waited_s=30)
        assert late.data is None and not late.pending
    finally:
        prefetcher.close()


@pytest.fixture
def three_models(tmp_path):
    out = []
    for i in range(3):
        t = layered_tensors(seed=20 + i, layers=3)
        folder = write_numpy_model(tmp_path / f"src{i}", [t])
        out.append((str(folder), weightcache.publish_model(str(folder), chunk_bytes=CHUNK), t))
    return out


def _warm(stub, folder: str, digest: str) -> pb.StatusResponse:
    stub.Prefetch(pb.PrefetchRequest(location=folder, digest=digest), timeout=30)

    def done():
        s = stub.Status(pb.StatusRequest(digest=digest), timeout=10)
        return s if s.state in (pb.PREFETCH_STATE_COMPLETE, pb.PREFETCH_STATE_FAILED) else None

    return wait_until(done, timeout=60, what=f"the prefetch of {digest[:12]} to end")


def test_a_node_evicts_idle_models_for_the_next_prefetch_and_never_one_in_use(tmp_path, three_models):
    """Two complete models no engine uses fill the node cache: a third is prefetched by evicting the
    least recently used one (the node serving them to peers does not hold them); with both in use by
    engines, the prefetch fails naming the bound (--cache-bytes) and the models holding it."""
    bound = int(three_models[0][1].total_bytes * 2.5)
    prefetcher = Prefetcher(tmp_path / "node", cache_bytes=bound, limits=FAST)
    server, port = serve(prefetcher, "127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.WeightServiceStub(channel)
    (a, ma, ta), (b, mb, tb), (c, mc, tc) = three_models
    try:
        for folder, m, _ in three_models[:2]:
            assert _warm(stub, folder, m.digest).state == pb.PREFETCH_STATE_COMPLETE
            assert stub.ReadChunk(pb.ReadChunkRequest(digest=m.digest, file=0, chunk=0), timeout=10).found
        s = _warm(stub, c, mc.digest)
        assert s.state == pb.PREFETCH_STATE_COMPLETE, s.error
        assert stub.Status(pb.StatusRequest(digest=ma.digest), timeout=10).state == pb.PREFETCH_STATE_UNKNOWN
        assert not stub.ReadChunk(pb.ReadChunkRequest(digest=ma.digest, file=0, chunk=0), timeout=10).found
        assert stub.Status(pb.StatusRequest(digest=mb.digest), timeout=10).state == pb.PREFETCH_STATE_COMPLETE
        again = _warm(stub, a, ma.digest)  # evicted, so asked for again it is fetched again (b goes)
        assert again.state == pb.PREFETCH_STATE_COMPLETE, again.error
        with weightcache.open_model(a, ma.digest, cache_dir=tmp_path / "node", cache_bytes=bound) as engine_a, \
                weightcache.open_model(c, mc.digest, cache_dir=tmp_path / "node", cache_bytes=bound) as engine_c:
            refused = _warm(stub, b, mb.digest)
            assert refused.state == pb.PREFETCH_STATE_FAILED
            assert f"bound of {bound} bytes (--cache-bytes)" in refused.error
            assert f"{ma.digest[:12]} ({ma.model} @ {ma.revision}" in refused.error and "in use" in refused.error
            assert mc.digest[:12] in refused.error
            for reader, want in ((engine_a, ta), (engine_c, tc)):  # the models in use are whole
                got = dict(reader)
                assert reader.stats.cached == reader.stats.planned
                for k, v in want.items():
                    np.testing.assert_array_equal(got[k], v)
        retried = _warm(stub, b, mb.digest)  # nothing in use now: a failed prefetch is retried, and evicts
        assert retried.state == pb.PREFETCH_STATE_COMPLETE, retried.error
        with weightcache.open_model(b, mb.digest, cache_dir=tmp_path / "node", cache_bytes=bound) as r:
            got = dict(r)
        for k, v in tb.items():
            np.testing.assert_array_equal(got[k], v)
    finally:
        channel.close()
        server.stop(0).wait()
        prefetcher.close()
