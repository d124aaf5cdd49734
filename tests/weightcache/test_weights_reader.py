"""open_model over a local origin: every dtype tensor for tensor against what safetensors wrote,
subsets, zero-copy views, and the faults: a corrupt or truncated origin file, a manifest that does
not describe its bytes, two revisions at once, two readers of one model, a warm node with no origin."""

from __future__ import annotations

import json
import shutil
import threading

import numpy as np
import pytest

import weightcache
from kvstore.errors import InvalidArgument
from tests.support.weightcache_helpers import run
from tests.support.weights_models import f6_file, layered_tensors, numpy_tensors, torch_tensors, write_numpy_model, write_torch_model
from weightcache import catalog
from weightcache.errors import CorruptChunk, ManifestMismatch
from weightcache.fetch import FetchLimits
from weightcache.manifest import Manifest
from weightcache.origin import open_origin

CHUNK = 64 << 10
FAST = FetchLimits(max_in_flight=4, origin_concurrency=4, backoff_base_s=0.001, backoff_max_s=0.01, poll_interval_s=0.005)


def open_model(location, digest=None, **kw):
    kw.setdefault("limits", FAST)
    return weightcache.open_model(str(location), digest, **kw)


@pytest.fixture
def every_dtype(tmp_path):
    folder = write_numpy_model(tmp_path / "all", [numpy_tensors(seed=2, scale=40)], prefix="np")
    pytest.importorskip("torch")
    pt = torch_tensors(seed=2, scale=40)
    write_torch_model(folder, pt, "pt.safetensors")
    f6 = f6_file(folder / "f6.safetensors")
    m = weightcache.publish_model(str(folder), chunk_bytes=CHUNK)
    return folder, m, pt, f6


def test_every_dtype_as_numpy_matches_what_was_written(every_dtype, tmp_path):
    from safetensors.numpy import load_file

    folder, m, pt, f6 = every_dtype
    want = load_file(str(folder / "np.safetensors"))
    with open_model(folder, m.digest, cache_dir=tmp_path / "cache") as model:
        got = dict(model)
        entries = model.entries
    assert set(got) == set(want) | set(pt) | {"a.f6_e2m3", "b.f6_e3m2"}
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        np.testing.assert_array_equal(got[name], value)
    for name, value in pt.items():  # numpy lacks bf16, fp8, fp4: the raw storage, same bytes
        assert got[name].tobytes() == value.contiguous().view(_torch().uint8).numpy().tobytes(), name
    assert entries["pt.bf16"].dtype == "BF16" and got["pt.bf16"].dtype == np.uint16
    assert entries["pt.f8_e4m3"].dtype == "F8_E4M3" and got["pt.f8_e4m3"].dtype == np.uint8
    assert got["pt.f4"].shape == (5, 6) and entries["pt.f4"].shape == (5, 12)
    assert got["a.f6_e2m3"].tobytes() + got["b.f6_e3m2"].tobytes() == f6


def test_every_dtype_as_torch_matches_safe_open(every_dtype, tmp_path):
    torch = _torch()
    from safetensors import safe_open

    folder, m, pt, _ = every_dtype
    with open_model(folder, m.digest, cache_dir=tmp_path / "cache", framework="pt") as model:
        got = dict(model)
    for name, value in pt.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert torch.equal(got[name].view(torch.uint8), value.view(torch.uint8)), name
    with safe_open(str(folder / "np.safetensors"), framework="pt") as f:
        for name in f.keys():
            assert torch.equal(got[name], f.get_tensor(name)), name
    assert got["a.f6_e2m3"].dtype == torch.uint8  # torch has no F6: its packed bytes


def _torch():
    return pytest.importorskip("torch")


@pytest.fixture
def sharded(tmp_path):
    t = layered_tensors(seed=5, layers=6)
    names = sorted(t)
    half = len(names) // 2
    folder = write_numpy_model(tmp_path / "m", [{k: t[k] for k in names[:half]}, {k: t[k] for k in names[half:]}])
    return folder, weightcache.publish_model(str(folder), chunk_bytes=CHUNK), t


def test_a_name_filter_fetches_only_the_chunks_those_tensors_touch(sharded, tmp_path):
    folder, m, t = sharded
    with open_model(folder, m.digest, cache_dir=tmp_path / "c", names="layers.2.*") as model:
        got = dict(model)
        stats = model.stats
    assert sorted(got) == sorted(k for k in t if k.startswith("layers.2."))
    for k, v in got.items():
        np.testing.assert_array_equal(v, t[k])
    assert stats.fetched["origin"] == stats.planned < m.total_chunks
    # the rest later: what is already verified is not fetched again
    with open_model(folder, m.digest, cache_dir=tmp_path / "c") as model:
        assert len(dict(model)) == len(t)
        assert model.stats.cached == stats.planned
        assert model.stats.fetched["origin"] == model.stats.planned - stats.planned


def test_a_file_filter_takes_one_ranks_shards(sharded, tmp_path):
    folder, m, t = sharded
    with open_model(folder, m.digest, cache_dir=tmp_path / "c", files="model-00002-of-*.safetensors",
                    include=["config.json"]) as model:
        got = dict(model)
        config = json.loads(model.path("config.json").read_text())
    shard2 = {e.name for f in m.files if f.path.startswith("model-00002") for e in f.header.tensors}
    assert set(got) == shard2 and config["hidden_size"] == 256
    with pytest.raises(InvalidArgument, match="not in manifest"):
        open_model(folder, m.digest, cache_dir=tmp_path / "c", names=["no.such.tensor"])
    with pytest.raises(InvalidArgument, match="framework"):
        open_model(folder, m.digest, cache_dir=tmp_path / "c", framework="jax")


def test_views_are_zero_copy_private_and_outlive_the_reader(sharded, tmp_path):
    folder, m, t = sharded
    with open_model(folder, m.digest, cache_dir=tmp_path / "c") as model:
        got = dict(model)
    a = got["layers.0.attn.weight"]
    base = a
    while getattr(base, "base", None) is not None:
        base = base.base
    assert type(base).__name__ == "mmap"  # a view of the cache file, not a copy
    a[:] = 0  # copy-on-write: this process only
    np.testing.assert_array_equal(got["layers.0.mlp.weight"], t["layers.0.mlp.weight"])
    with open_model(folder, m.digest, cache_dir=tmp_path / "c") as model:
        np.testing.assert_array_equal(dict(model)["layers.0.attn.weight"], t["layers.0.attn.weight"])


def test_a_warm_node_needs_no_origin(sharded, tmp_path):
    folder, m, t = sharded
    with open_model(folder, m.digest, cache_dir=tmp_path / "c") as model:
        model.wait()
    shutil.rmtree(folder / ".strata")
    for f in folder.glob("*.safetensors"):
        f.unlink()
    with open_model(folder, m.digest, cache_dir=tmp_path / "c") as model:
        got = dict(model)
        assert model.stats.requests["origin"] == 0
    np.testing.assert_array_equal(got["embed.weight"], t["embed.weight"])


def test_a_chunk_corrupted_at_the_origin_fails_only_its_tensors(sharded, tmp_path):
    folder, m, t = sharded
    shard = next(f for f in m.files if f.path.startswith("model-00001"))
    victim = max(shard.header.tensors, key=lambda e: e.nbytes)
    at = shard.header.data_start + victim.begin + 100
    path = folder / shard.path
    blob = bytearray(path.read_bytes())
    blob[at] ^= 0x01
    path.write_bytes(bytes(blob))
    got = {}
    with open_model(folder, m.digest, cache_dir=tmp_path / "c") as model:
        with pytest.raises(CorruptChunk, match="publish the model again") as info:
            for name, value in model:
                got[name] = value
        stats = model.stats
    assert victim.name not in got and len(got) >= len(t) - 3
    for k, v in got.items():
        np.testing.assert_array_equal(v, t[k])
    assert stats.corrupt == 1 + FAST.corrupt_retries  # fetched again, then given up
    assert str(at // CHUNK) in str(info.value)
    record = tmp_path / "c" / "models" / m.digest / "verified.log"
    assert record.exists()


def test_a_truncated_origin_file_is_a_manifest_mismatch(sharded, tmp_path):
    folder, m, t = sharded
    shard = next(f for f in m.files if f.path.startswith("model-00002"))
    path = folder / shard.path
    path.write_bytes(path.read_bytes()[: shard.size // 2])
    with open_model(folder, m.digest, cache_dir=tmp_path / "c", files=shard.path) as model:
        with pytest.raises(ManifestMismatch, match="changed since publishing"):
            dict(model)


def test_a_manifest_whose_table_is_not_the_header_is_refused(tmp_path):
    rng = np.random.default_rng(0)
    folder = write_numpy_model(tmp_path / "m", [{"a": rng.standard_normal((64, 64)).astype(np.float32),
                                                 "b": rng.standard_normal((64, 64)).astype(np.float32)}])
    m = weightcache.publish_model(str(folder), chunk_bytes=CHUNK)
    doc = json.loads(m.encoded)
    table = next(f for f in doc["files"] if "safetensors" in f)["safetensors"]["tensors"]
    table[0][0], table[1][0] = table[1][0], table[0][0]  # same chunks, names swapped
    forged = Manifest.from_bytes(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())

    async def store():
        origin = open_origin(str(folder))
        await catalog.store(origin, forged)
        await origin.close()

    run(store())
    with open_model(folder, forged.digest, cache_dir=tmp_path / "c") as model:
        with pytest.raises(ManifestMismatch, match="tensor table is not this file's header"):
            next(iter(model))


def test_two_revisions_fetched_at_once_never_mix(tmp_path):
    revs = {}
    for rev in ("rev1", "rev2"):
        t = layered_tensors(seed=int(rev[-1]), layers=4)
        folder = write_numpy_model(tmp_path / "models" / rev, [t])
        revs[rev] = (folder, weightcache.publish_model(str(folder), chunk_bytes=CHUNK), t)
    results, errors = {}, []

    def load(rev):
        folder, m, _ = revs[rev]
        try:
            with open_model(folder, m.digest, cache_dir=tmp_path / "c") as model:
                results[rev] = (dict(model), model.digest)
        except Exception as err:  # noqa: BLE001 - reported by the assert below
            errors.append(err)

    threads = [threading.Thread(target=load, args=(r,)) for r in revs]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors
    for rev, (folder, m, t) in revs.items():
        got, digest = results[rev]
        assert digest == m.digest
        for k, v in t.items():
            np.testing.assert_array_equal(got[k], v)
    assert revs["rev1"][1].digest != revs["rev2"][1].digest
    # one revision's digest is not found at the other's location: never served from the wrong files
    with pytest.raises(weightcache.errors.NotPublished):
        open_model(revs["rev2"][0], revs["rev1"][1].digest, cache_dir=tmp_path / "other")


def test_two_readers_of_one_model_fetch_each_chunk_once(sharded, tmp_path):
    folder, m, t = sharded
    readers = [open_model(folder, m.digest, cache_dir=tmp_path / "c") for _ in range(2)]
    out = [None, None]

    def drain(i):
        out[i] = dict(readers[i])

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    fetched = sum(r.stats.fetched["origin"] for r in readers)
    for r in readers:
        r.close()
    assert fetched == m.total_chunks - _unplanned(m)  # each chunk once, between the two
    for got in out:
        assert set(got) == set(t)
        for k, v in t.items():
            np.testing.assert_array_equal(got[k], v)


def _unplanned(m: Manifest) -> int:
    """Chunks of files no tensor needs (config, index): a reader without include never fetches them."""
    return sum(len(f.chunks) for f in m.files if f.header is None)
