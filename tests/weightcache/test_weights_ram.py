"""The node's host-RAM copy: one copy per node in a real tmpfs, mapped read-only by several real
engine processes (zero-copy: their mappings are the copy's files), bounded, evicted by model,
never holding a byte that failed its digest, surviving its readers, cleaned on eviction."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest

import weightcache
from tests.support.wait import wait_until
from tests.support.weights_models import layered_tensors, write_numpy_model
from weightcache.api.v1 import weights_pb2 as pb
from weightcache.api.v1 import weights_pb2_grpc as pb_grpc
from weightcache.cache import NodeCache
from weightcache.fetch import FetchLimits
from weightcache.metrics import WeightMetrics
from weightcache.prefetch import Prefetcher
from weightcache.ram_copy import RamCopy
from weightcache.service import serve

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 64 << 10
FAST = FetchLimits(max_in_flight=4, origin_concurrency=4, backoff_base_s=0.001, backoff_max_s=0.01, poll_interval_s=0.005)

# One engine process: open the model with the RAM copy, read every tensor, report what it saw, and
# hold the tensors until its stdin closes (so several readers map the copy at the same time).
READER = r"""
import hashlib, json, sys
import weightcache
location, digest, cache, ram = sys.argv[1:5]
with weightcache.open_model(location, digest, cache_dir=cache, ram_dir=ram) as r:
    held = dict(r)
    stats = r.stats
maps = [line.split()[-1] for line in open("/proc/self/maps") if ram in line]
print(json.dumps({
    "sha": {k: hashlib.sha256(v.tobytes()).hexdigest() for k, v in held.items()},
    "writeable": sum(bool(v.flags.writeable) for v in held.values() if v.size),
    "by_source": dict(stats.fetched_bytes), "mapped": sorted(set(maps)),
}), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def shm_dir():
    """A scratch directory on the real tmpfs, removed afterwards."""
    path = Path("/dev/shm") / f"strata-test-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def model(tmp_path):
    shards = [layered_tensors(seed=21, layers=3), {f"extra.{k}": v for k, v in layered_tensors(22, layers=2).items()}]
    folder = write_numpy_model(tmp_path / "src", shards)
    return str(folder), weightcache.publish_model(str(folder), chunk_bytes=CHUNK), {k: v for s in shards for k, v in s.items()}


def allocated(path: Path) -> int:
    """What the tmpfs really holds under ``path``: allocated blocks, not file sizes."""
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def sha(a: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(a.tobytes()).hexdigest()


def prefetched(tmp_path, model, shm_dir, capacity: int = 64 << 20, metrics=None):
    folder, m, _ = model
    prefetcher = Prefetcher(tmp_path / "cache", limits=FAST, metrics=metrics, ram=RamCopy(shm_dir, capacity))
    prefetcher.prefetch(folder, m.digest)
    wait_until(lambda: prefetcher.status(m.digest).state == "complete", what="the prefetch complete")
    return prefetcher


def test_three_engine_processes_map_one_copy_and_read_identical_tensors(tmp_path, model, shm_dir):
    folder, m, tensors = model
    metrics = WeightMetrics()
    prefetcher = prefetched(tmp_path, model, shm_dir, metrics=metrics)
    try:
        assert prefetcher.status(m.digest).ram_bytes == m.total_bytes
        assert metrics.registry.get_sample_value("strata_weights_ram_bytes") == m.total_bytes
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        readers = [subprocess.Popen([sys.executable, "-c", READER, folder, m.digest, str(tmp_path / "cache"), str(shm_dir)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
                   for _ in range(3)]
        try:
            seen = [json.loads(p.stdout.readline()) for p in readers]
            # All three hold their tensors now: the tmpfs holds the model once, not three times.
            held = allocated(shm_dir)
            assert m.total_bytes <= held <= m.total_bytes + 64 * 4096, held
        finally:
            for p in readers:
                p.stdin.close()
            for p in readers:
                assert p.wait(60) == 0
        want = {k: sha(v) for k, v in tensors.items()}
        safetensors = sorted(str(shm_dir / "models" / m.digest / "files" / f.path) for f in m.files
                             if f.path.endswith(".safetensors"))
        for s in seen:
            assert s["sha"] == want
            assert s["by_source"] == {"ram": sum(f.size for f in m.files if f.path.endswith(".safetensors"))}
            assert s["mapped"] == safetensors  # the tensors are views of the copy's files, not of private memory
            assert s["writeable"] == 0  # read-only: no engine can change the node's one copy
        # The copy outlives its readers, untouched.
        assert allocated(shm_dir) == held
        with weightcache.open_model(folder, m.digest, cache_dir=tmp_path / "cache", ram_dir=shm_dir) as r:
            assert {k: sha(v) for k, v in r} == want
    finally:
        prefetcher.close()


def test_a_reader_with_the_copy_counts_ram_and_one_without_counts_disk(tmp_path, model, shm_dir):
    folder, m, tensors = model
    prefetched(tmp_path, model, shm_dir).close()
    metrics = WeightMetrics()
    with weightcache.open_model(folder, m.digest, cache_dir=tmp_path / "cache", ram_dir=shm_dir, metrics=metrics) as r:
        got = {k: np.array(v) for k, v in r}
    for k, v in tensors.items():
        np.testing.assert_array_equal(got[k], v)
    assert metrics.registry.get_sample_value("strata_weights_fetched_bytes_total", {"source": "ram"}) > 0
    assert metrics.registry.get_sample_value("strata_weights_fetched_bytes_total", {"source": "disk"}) is None
    with weightcache.open_model(folder, m.digest, cache_dir=tmp_path / "cache", metrics=metrics) as r:
        dict(r)
        assert set(r.stats.fetched_bytes) == {"disk"}


def path_in(path: Path, root: Path) -> bool:
    return Path(path).resolve().is_relative_to(Path(root).resolve())


def test_included_files_resolve_to_the_copy(tmp_path, model, shm_dir):
    folder, m, _ = model
    prefetched(tmp_path, model, shm_dir).close()
    with weightcache.open_model(folder, m.digest, cache_dir=tmp_path / "cache", ram_dir=shm_dir, include="*.json") as r:
        assert path_in(r.path("config.json"), shm_dir)
        assert json.loads(r.path("config.json").read_text())["hidden_size"] == 256


def test_the_budget_bounds_the_copy_and_the_rest_is_read_from_disk(tmp_path, model, shm_dir):
    folder, m, tensors = model
    capacity = 1 << 20  # the smaller shard fits, the larger does not
    sizes = {f.path: f.size for f in m.files}
    assert min(sizes.values()) < capacity < max(sizes.values())
    prefetched(tmp_path, model, shm_dir, capacity=capacity).close()
    copy = RamCopy(shm_dir)
    try:
        assert 0 < copy.used_bytes() <= capacity
    finally:
        copy.close()
    with weightcache.open_model(folder, m.digest, cache_dir=tmp_path / "cache", ram_dir=shm_dir) as r:
        got = dict(r)
        by = dict(r.stats.fetched_bytes)
    for k, v in tensors.items():
        np.testing.assert_array_equal(got[k], v)
    assert by["ram"] > 0 and by["disk"] > 0


def test_a_second_model_evicts_the_first_unless_it_is_open(tmp_path, model, shm_dir):
    folder, m, _ = model
    other = write_numpy_model(tmp_path / "src2", [layered_tensors(seed=5, layers=3)])
    m2 = weightcache.publish_model(str(other), chunk_bytes=CHUNK)
    capacity = max(m.total_bytes, m2.total_bytes) + (64 << 10)
    ram = RamCopy(shm_dir, capacity)
    prefetcher = Prefetcher(tmp_path / "cache", limits=FAST, ram=ram)
    try:
        prefetcher.prefetch(folder, m.digest)
        wait_until(lambda: prefetcher.status(m.digest).state == "complete", what="the first model")
        assert ram.model_bytes(m.digest) == m.total_bytes
        reader = weightcache.open_model(folder, m.digest, cache_dir=tmp_path / "cache", ram_dir=shm_dir)
        held = dict(reader)
        prefetcher.prefetch(str(other), m2.digest)  # the first is open: the second stays on disk
        wait_until(lambda: prefetcher.status(m2.digest).state == "complete", what="the second model")
        assert ram.model_bytes(m.digest) == m.total_bytes and ram.model_bytes(m2.digest) < m2.total_bytes
        assert not ram.evict(m.digest)  # in use
        reader.close()
        assert ram.evict(m.digest)  # cleaned on eviction: its files are gone from the tmpfs
        assert not (shm_dir / "models" / m.digest).exists() and ram.used_bytes() == ram.model_bytes(m2.digest)
        for k, v in held.items():  # a tensor an engine still holds is unchanged: its pages live on
            assert v.size == 0 or np.isfinite(v.astype(np.float64)).all()
    finally:
        prefetcher.close()


def test_a_chunk_that_rotted_on_disk_never_reaches_the_copy(tmp_path, model, shm_dir):
    folder, m, tensors = model
    with weightcache.open_model(folder, m.digest, cache_dir=tmp_path / "cache", include="*") as r:
        r.wait()
    bad = next(i for i, f in enumerate(m.files) if f.path.endswith(".safetensors"))
    path = tmp_path / "cache" / "models" / m.digest / "files" / m.files[bad].path
    with open(path, "r+b") as f:  # a verified, recorded chunk changes on disk afterwards
        f.seek(m.files[bad].size - 3)
        f.write(b"\xff\xfe\xfd")
    cache = NodeCache(tmp_path / "cache", 1 << 40)
    copy = RamCopy(shm_dir, 64 << 20)
    cached = cache.open(m)
    try:
        copied = copy.admit(cached)
    finally:
        cached.close()
        cache.close()
    assert copied == m.total_bytes - m.files[bad].size
    assert not (shm_dir / "models" / m.digest / "files" / m.files[bad].path).exists()
    assert not list((shm_dir / "models" / m.digest).glob(".*"))  # nothing half-copied left behind
    ram = copy.open(m)
    try:
        assert not ram.has(bad) and all(ram.has(i) for i in range(len(m.files)) if i != bad)
    finally:
        ram.close()
        copy.close()


def test_serve_with_a_ram_dir_reports_the_copy_in_status_and_wait(tmp_path, model, shm_dir):
    folder, m, _ = model
    prefetcher = Prefetcher(tmp_path / "cache", limits=FAST, ram=RamCopy(shm_dir, 64 << 20))
    server, port = serve(prefetcher, "127.0.0.1:0")
    try:
        stub = pb_grpc.WeightServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        stub.Prefetch(pb.PrefetchRequest(location=folder, digest=m.digest), timeout=30)
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        done = subprocess.run([sys.executable, "-m", "weightcache", "wait", m.digest, "--node", f"127.0.0.1:{port}",
                               "--deadline", "60s", "--json", "--no-progress", "--interval", "0.1"],
                              capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout)
        assert out["ram_bytes"] == m.total_bytes and out["bytes_by_source"] == {"origin": m.total_bytes}
        listed = subprocess.run([sys.executable, "-m", "weightcache", "ls", "--ram-dir", str(shm_dir), "--json"],
                                capture_output=True, text=True, env=env, timeout=60)
        assert json.loads(listed.stdout.splitlines()[0])["bytes"] == m.total_bytes
        both = subprocess.run([sys.executable, "-m", "weightcache", "ls", "--cache", str(tmp_path / "cache"),
                               "--ram-dir", str(shm_dir), "--json"], capture_output=True, text=True, env=env, timeout=60)
        row = json.loads(both.stdout.splitlines()[0])
        assert row["ram_bytes"] == m.total_bytes and row["verified_chunks"] == m.total_chunks
    finally:
        server.stop(0).wait()
        prefetcher.close()
    evicted = subprocess.run([sys.executable, "-m", "weightcache", "evict", m.digest, "--cache", str(tmp_path / "cache"),
                              "--ram-dir", str(shm_dir)], capture_output=True, text=True, env=env, timeout=60)
    assert evicted.returncode == 0, evicted.stderr
    assert allocated(shm_dir) == 0


def test_a_reader_writes_nothing_and_a_copy_never_made_reads_from_disk(tmp_path, model, shm_dir):
    folder, m, tensors = model
    prefetched(tmp_path, model, shm_dir).close()
    before = sorted(p.relative_to(shm_dir) for p in shm_dir.rglob("*"))
    empty = shm_dir / "never-filled"
    with weightcache.open_model(folder, m.digest, cache_dir=tmp_path / "cache", ram_dir=empty) as r:
        got = dict(r)
        assert set(r.stats.fetched_bytes) == {"disk"}
    for k, v in tensors.items():
        np.testing.assert_array_equal(got[k], v)
    assert not empty.exists()  # a reader creates nothing
    with weightcache.open_model(folder, m.digest, cache_dir=tmp_path / "cache", ram_dir=shm_dir) as r:
        dict(r)
    after = sorted(p.relative_to(shm_dir) for p in shm_dir.rglob("*"))
    assert after == before


def test_the_weight_node_drops_what_a_crashed_copy_left(tmp_path, model, shm_dir):
    folder, m, _ = model
    prefetched(tmp_path, model, shm_dir).close()
    left = shm_dir / "models" / m.digest / ".0123456789ab.copying"
    left.write_bytes(b"\0" * 4096)  # a copy a SIGKILL interrupted: never visible to readers
    copy = RamCopy(shm_dir, 64 << 20)
    try:
        assert copy.used_bytes() == m.total_bytes + 4096
        assert copy.drop_stale_copies() == 1 and copy.used_bytes() == m.total_bytes
    finally:
        copy.close()
