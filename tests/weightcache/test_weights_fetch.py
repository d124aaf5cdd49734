"""The fetch planner's plug points: sources tried before the origin (where peers go), a source that
gives corrupt bytes passed over for the next, a miss that is not an error; and the adaptive limit."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import weightcache
from tests.support.weights_models import layered_tensors, write_numpy_model
from weightcache.fetch import FetchLimits
from weightcache.sources import AdaptiveLimit, ChunkRef, ChunkSource

CHUNK = 64 << 10
FAST = FetchLimits(max_in_flight=4, origin_concurrency=4, backoff_base_s=0.001, backoff_max_s=0.01)


class FolderSource(ChunkSource):
    """Another copy of the revision's files (what a peer's cache is): serves, corrupts, or misses."""

    kind = "peer"

    def __init__(self, folder, mode: str = "serve") -> None:
        self.folder = folder
        self.mode = mode
        self.name = f"folder:{mode}"
        self.limit = AdaptiveLimit(4)
        self.reads = 0

    async def read(self, ref: ChunkRef, into: memoryview):
        self.reads += 1
        if self.mode == "miss":
            return None
        with open(self.folder / ref.path, "rb") as f:
            f.seek(ref.start)
            data = bytearray(f.read(ref.length))
        if self.mode == "corrupt":
            data[0] ^= 1
        into[: ref.length] = data
        return into[: ref.length]


@pytest.fixture
def model(tmp_path):
    t = layered_tensors(seed=9, layers=3)
    folder = write_numpy_model(tmp_path / "m", [t])
    return folder, weightcache.publish_model(str(folder), chunk_bytes=CHUNK), t


@pytest.mark.parametrize("mode,from_origin", [("serve", False), ("corrupt", True), ("miss", True)])
def test_sources_before_the_origin(tmp_path, model, mode, from_origin):
    folder, m, t = model
    peer = FolderSource(folder, mode)
    with weightcache.open_model(str(folder), m.digest, cache_dir=tmp_path / "c", sources=[peer], limits=FAST) as r:
        got = dict(r)
        stats = r.stats
    for k, v in t.items():
        np.testing.assert_array_equal(got[k], v)
    planned = stats.planned
    assert stats.fetched["origin"] == (planned if from_origin else 0)
    assert stats.fetched["peer"] == (0 if from_origin else planned)
    # a corrupt copy is fetched again from the next source at once (the origin), not from the same one
    assert peer.reads == planned
    assert stats.corrupt == (planned if mode == "corrupt" else 0)


def test_the_adaptive_limit_halves_on_throttling_and_grows_back():
    async def go():
        limit = AdaptiveLimit(8)
        limit.throttled()
        limit.throttled()
        assert limit.current == 2
        for _ in range(2):
            limit.succeeded()
        assert limit.current == 3
        for _ in range(3 + 4 + 5 + 6 + 7):
            limit.succeeded()
        assert limit.current == 8
        for _ in range(10):
            limit.throttled()
        assert limit.current == 1
        async with limit:
            blocked = asyncio.ensure_future(limit.__aenter__())
            await asyncio.sleep(0.01)
            assert not blocked.done()  # one in flight is the whole window
        await asyncio.wait_for(blocked, 5)

    asyncio.run(go())


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_in_flight"):
        FetchLimits(max_in_flight=0)
    with pytest.raises(ValueError, match="back-off"):
        FetchLimits(backoff_base_s=2, backoff_max_s=1)
