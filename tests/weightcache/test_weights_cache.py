"""The node cache: the record of verified chunks survives torn and zeroed tails, claims exclude,
capacity is bounded with eviction by model (never one in use), and a cached manifest is trusted
only under its digest."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import weightcache
from tests.support.weights_models import layered_tensors, write_numpy_model
from weightcache.cache import NodeCache
from weightcache.claims import Claims
from weightcache.errors import CacheFull
from weightcache.fetch import FetchLimits
from weightcache.record import ENTRY_BYTES, HEADER_BYTES, ChunkRecord

CHUNK = 64 << 10
FAST = FetchLimits(max_in_flight=4, origin_concurrency=4, poll_interval_s=0.005)


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    folder = write_numpy_model(tmp_path_factory.mktemp("m"), [layered_tensors(seed=1, layers=4)])
    return folder, weightcache.publish_model(str(folder), chunk_bytes=CHUNK)


def every_chunk(m):
    return [(f, c) for f, e in enumerate(m.files) for c in range(len(e.chunks))]


def test_the_record_keeps_what_was_committed(tmp_path, manifest):
    _, m = manifest
    chunks = every_chunk(m)
    rec = ChunkRecord(tmp_path / "log", m)
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT)
    rec.commit(fd, chunks[:3])
    rec.commit(fd, chunks[3:5])
    other = ChunkRecord(tmp_path / "log", m)  # another process's view
    assert other.load() == set(chunks[:5])
    rec.commit(fd, chunks[5:6])
    assert other.tail() == [chunks[5]]
    rec.close(), other.close()
    os.close(fd)


@settings(max_examples=60)
@given(st.data())
def test_a_torn_or_zeroed_tail_loses_only_the_entries_it_touched(tmp_path_factory, manifest, data):
    _, m = manifest
    chunks = every_chunk(m)
    path = tmp_path_factory.mktemp("rec") / "log"
    picked = data.draw(st.lists(st.sampled_from(chunks), min_size=1, max_size=20, unique=True))
    rec = ChunkRecord(path, m)
    fd = os.open(path.with_name("data"), os.O_RDWR | os.O_CREAT)
    rec.commit(fd, picked)
    rec.close()
    os.close(fd)
    raw = bytearray(path.read_bytes())
    cut = data.draw(st.integers(HEADER_BYTES, len(raw)))
    damage = data.draw(st.sampled_from(["truncate", "zeros", "garbage"]))
    if damage == "truncate":
        raw = raw[:cut]
    elif damage == "zeros":
        raw[cut:] = bytes(len(raw) - cut)  # a power cut after the size grew but before the data
    else:
        raw[cut:cut] = data.draw(st.binary(min_size=1, max_size=15))  # a torn entry, then more appended
    path.write_bytes(bytes(raw))
    found = ChunkRecord(path, m).load()
    whole = (cut - HEADER_BYTES) // ENTRY_BYTES
    assert found <= set(picked)
    assert set(picked[:whole]) <= found
    if damage == "garbage":
        assert found >= set(picked) - set(picked[whole:whole + 1])  # resynchronised after the torn entry


def test_a_record_of_another_manifest_starts_over(tmp_path, manifest):
    folder, m = manifest
    other = weightcache.publish_model(str(folder), chunk_bytes=2 * CHUNK)
    rec = ChunkRecord(tmp_path / "log", other)
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT)
    rec.commit(fd, every_chunk(other)[:2])
    rec.close()
    assert ChunkRecord(tmp_path / "log", m).load() == set()
    os.close(fd)


def test_claims_exclude_each_other_until_released(tmp_path):
    a, b = Claims(tmp_path / "claims"), Claims(tmp_path / "claims")
    assert a.try_claim(7) and not b.try_claim(7) and b.try_claim(8)
    a.release(7)
    assert b.try_claim(7)
    a.close()
    assert not Claims(tmp_path / "claims").try_claim(8)  # b still holds it
    b.close()


def _fetch(folder, m, cache, cache_bytes):
    with weightcache.open_model(str(folder), m.digest, cache_dir=cache, cache_bytes=cache_bytes, limits=FAST) as r:
        return dict(r)


def test_capacity_evicts_the_least_recently_used_model_and_never_one_in_use(tmp_path):
    models = []
    for i in range(3):
        folder = write_numpy_model(tmp_path / f"m{i}", [layered_tensors(seed=i, layers=3)])
        models.append((folder, weightcache.publish_model(str(folder), chunk_bytes=CHUNK)))
    size = models[0][1].files[-1].size
    cache = tmp_path / "cache"
    bound = int(size * 2.5)
    _fetch(*models[0], cache, bound)
    _fetch(*models[1], cache, bound)
    _fetch(*models[2], cache, bound)  # the oldest (m0) makes room
    held = sorted(p.name for p in (cache / "models").iterdir())
    assert held == sorted([models[1][1].digest, models[2][1].digest])
    assert not list((cache / "trash").iterdir())
    with weightcache.open_model(str(models[1][0]), models[1][1].digest, cache_dir=cache, cache_bytes=bound) as busy:
        with weightcache.open_model(str(models[2][0]), models[2][1].digest, cache_dir=cache,
                                    cache_bytes=bound) as busy2:
            with weightcache.open_model(str(models[0][0]), models[0][1].digest, cache_dir=cache, cache_bytes=bound,
                                        limits=FAST) as blocked:
                with pytest.raises(CacheFull, match="raise the cache's capacity"):
                    dict(blocked)
            assert len(dict(busy2)) and len(dict(busy))
    entries = {e.digest: e for e in NodeCache(cache, bound).entries()}
    assert entries[models[1][1].digest].verified_chunks == entries[models[1][1].digest].total_chunks - 1  # no config
    assert not any(e.in_use for e in entries.values())


def test_a_cached_manifest_is_trusted_only_under_its_digest(tmp_path, manifest):
    folder, m = manifest
    got = _fetch(folder, m, tmp_path / "c", None)
    stored = tmp_path / "c" / "models" / m.digest / "manifest.json"
    stored.write_bytes(stored.read_bytes().replace(b'"chunk_bytes":65536', b'"chunk_bytes":131072'))
    cache = NodeCache(tmp_path / "c", 1 << 30)
    assert cache.stored_manifest(m.digest) is None  # the origin's copy is used instead
    cache.close()
    again = _fetch(folder, m, tmp_path / "c", None)
    for k, v in got.items():
        np.testing.assert_array_equal(again[k], v)


def test_an_unpinned_handle_does_not_hold_its_model_and_a_partial_fetch_is_never_evicted(tmp_path):
    """A serving handle (``pinned=False``) leaves its complete model idle: the cache evicts it for a
    new model and the handle then says so (``leased()`` is False), even though the folder is fetched
    again with a new life. A partial model whose fetch has it open is never evicted: the cache is full."""
    models = []
    for i in range(3):
        folder = write_numpy_model(tmp_path / f"m{i}", [layered_tensors(seed=30 + i, layers=3)])
        models.append((folder, weightcache.publish_model(str(folder), chunk_bytes=CHUNK)))
    cache_dir = tmp_path / "cache"
    bound = int(models[0][1].files[-1].size * 2.5)
    _fetch(*models[0], cache_dir, bound)
    cache = NodeCache(cache_dir, bound)
    try:
        served = cache.open(models[0][1], pinned=False)
        with served.leased() as here:
            assert here and served.read(1, 0, 8) == (models[0][0] / models[0][1].files[1].path).read_bytes()[:8]
        partial = cache.open(models[1][1])  # pinned, as a fetch holds it: one chunk written of many
        f = len(models[1][1].files) - 1
        start, end = models[1][1].files[f].chunk_span(0, CHUNK)
        data = (models[1][0] / models[1][1].files[f].path).read_bytes()[start:end]
        assert partial.store(f, 0, memoryview(data))
        with cache.locked():
            cache.reserve(models[2][1].digest, models[2][1].files[-1].size)  # evicts m0: idle though served
        assert not served.current()
        with served.leased() as here:
            assert not here
        assert (cache_dir / "models" / models[1][1].digest).is_dir()
        with cache.locked(), pytest.raises(CacheFull) as info:
            cache.reserve(models[0][1].digest, models[0][1].files[-1].size * 2)
        assert f"{models[1][1].digest[:12]} ({models[1][1].model} @ {models[1][1].revision}" in str(info.value)
        assert "in use" in str(info.value) and f"bound of {bound} bytes (--cache-bytes)" in str(info.value)
        partial.close()
        again = cache.open(models[0][1])  # m0's folder back, a new life: the old handle stays stale
        with served.leased() as here:
            assert not here
        again.close()
        served.close()
    finally:
        cache.close()
