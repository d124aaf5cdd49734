"""The first tensor waits on its own chunks only: not on the flush that makes them durable, and not on
buffers set up for every other chunk in flight; and fetching does not wait on flushes either."""

from __future__ import annotations

import asyncio
import mmap
import os
import threading
import tracemalloc

import numpy as np

import weightcache
from tests.support.weights_models import layered_tensors, write_numpy_model
from weightcache.cache import NodeCache
from weightcache.fetch import FetchLimits
from weightcache.record import HEADER_BYTES
from weightcache.sources import AdaptiveLimit, ChunkRef, ChunkSource

CHUNK = 64 << 10


def test_tensors_are_served_and_fetching_goes_on_while_flushes_wait(tmp_path, monkeypatch):
    t = layered_tensors(seed=3, layers=2)
    folder = write_numpy_model(tmp_path / "m", [t])
    m = weightcache.publish_model(str(folder), chunk_bytes=CHUNK)
    flush = threading.Event()
    real_fdatasync = os.fdatasync

    def slow_disk(fd):  # a disk whose flushes of model files take until the test says so
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".safetensors"):
            assert flush.wait(60), "the flush was never let through"
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", slow_disk)
    try:
        limits = FetchLimits(max_in_flight=2, origin_concurrency=2)
        with weightcache.open_model(str(folder), m.digest, cache_dir=tmp_path / "c", limits=limits,
                                    deadline_s=10) as r:
            assert len(r.plan) > 2 * limits.max_in_flight
            # every tensor, verified and in the files, while not one flush has finished: the two
            # workers fetched on instead of waiting on the disk
            got = dict(r)
            assert os.path.getsize(r.model.record.path) == HEADER_BYTES
            flush.set()
            r.wait()  # returns once every chunk is durable
        for k, v in t.items():
            np.testing.assert_array_equal(got[k], v)
    finally:
        flush.set()
    # what was served before its flush is recorded now: a warm open needs no origin
    for p in folder.glob("*.safetensors"):
        p.unlink()
    with weightcache.open_model(str(folder), m.digest, cache_dir=tmp_path / "c") as r:
        assert {k for k, _ in r} == set(t)
        assert r.stats.cached == r.stats.planned


class MappedSource(ChunkSource):
    """A source that hands back buffers of its own, as S3 (obstore) does: views of a file mapping."""

    kind = "peer"
    name = "mapped"

    def __init__(self, folder) -> None:
        self.folder = folder
        self.limit = AdaptiveLimit(8)

    async def read(self, ref: ChunkRef, into: memoryview):
        with open(self.folder / ref.path, "rb") as f:
            mapping = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        return memoryview(mapping)[ref.start: ref.start + ref.length]


def test_a_source_with_its_own_buffers_costs_no_chunk_buffers(tmp_path):
    rng = np.random.default_rng(5)
    t = {f"w{i}": rng.standard_normal((1024, 256)).astype(np.float32) for i in range(4)}  # 1 MiB each
    folder = write_numpy_model(tmp_path / "m", [t])
    chunk = 1 << 20
    m = weightcache.publish_model(str(folder), chunk_bytes=chunk)
    limits = FetchLimits(max_in_flight=8, origin_concurrency=8)
    cache = NodeCache(tmp_path / "c", 1 << 30)
    cache.open(m).close()  # the manifest is on the node already: the origin is not asked for it
    cache.close()
    tracemalloc.start()
    try:
        with weightcache.open_model(str(folder), m.digest, cache_dir=tmp_path / "c", sources=[MappedSource(folder)],
                                    limits=limits) as r:
            names = [k for k, _ in r]
            stats = r.wait()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sorted(names) == sorted(t) and stats.fetched["peer"] == stats.planned
    # eight in-flight slots of 1 MiB: none is zero-filled on the heap when no read lands in it
    assert peak < 2 * chunk, f"{peak} bytes allocated on the heap"


class SlowFirstSource(MappedSource):
    """Serves every chunk; the chunks of ``slow`` take a while, and each request notes what was back by then."""

    def __init__(self, folder, slow: set) -> None:
        super().__init__(folder)
        self.slow = slow
        self.back: set = set()
        self.early: list = []  # other chunks asked for before every slow one was back

    async def read(self, ref: ChunkRef, into: memoryview):
        item = (ref.file, ref.chunk)
        if item in self.slow:
            await asyncio.sleep(0.2)
        elif not self.slow <= self.back:
            self.early.append(item)
        view = await super().read(ref, into)
        self.back.add(item)
        return view


def test_the_first_tensors_chunks_are_fetched_before_any_other(tmp_path):
    t = layered_tensors(seed=4, layers=3)
    folder = write_numpy_model(tmp_path / "m", [t])
    m = weightcache.publish_model(str(folder), chunk_bytes=CHUNK)
    limits = FetchLimits(max_in_flight=8, origin_concurrency=8)
    with weightcache.open_model(str(folder), m.digest, cache_dir=tmp_path / "probe", names=["embed.weight"]) as r:
        lead = set(r.plan)  # the header's chunks and the first tensor's (the embedding is first in the table)
    assert 0 < len(lead) < len(m.files[-1].chunks) - limits.max_in_flight
    source = SlowFirstSource(folder, lead)
    with weightcache.open_model(str(folder), m.digest, cache_dir=tmp_path / "c", sources=[source], limits=limits) as r:
        first, _ = next(iter(r))
        got = r.wait()
    assert first == "embed.weight" and got.fetched["peer"] == got.planned
    # nothing else shared the source (or this host) with the first tensor's chunks
    assert source.early == []
