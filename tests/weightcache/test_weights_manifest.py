"""Manifests: built by publish from a local origin, stored beside the model, found by digest,
and refused when altered or malformed."""

from __future__ import annotations

import json
import os

import pytest

import weightcache
from tests.support.weightcache_helpers import run
from tests.support.weights_models import layered_tensors, safetensors_file, write_numpy_model
from weightcache import catalog
from weightcache.errors import HeaderError, ManifestError, ManifestMismatch, NotPublished
from weightcache.manifest import Manifest
from weightcache.origin import open_origin

CHUNK = 64 << 10


@pytest.fixture
def model_dir(tmp_path):
    t = layered_tensors(seed=3, layers=4)
    names = sorted(t)
    return write_numpy_model(tmp_path / "llama", [{k: t[k] for k in names[:7]}, {k: t[k] for k in names[7:]}])


def resolve(location, digest=None):
    async def go():
        origin = open_origin(str(location))
        try:
            return await catalog.resolve(origin, digest)
        finally:
            await origin.close()

    return run(go())


def test_publish_chunks_hashes_and_indexes_every_file(model_dir):
    m = weightcache.publish_model(str(model_dir), chunk_bytes=CHUNK)
    paths = [f.path for f in m.files]
    assert paths == sorted(p.name for p in model_dir.iterdir() if p.is_file())
    for f in m.files:
        data = (model_dir / f.path).read_bytes()
        assert f.size == len(data) and len(f.chunks) == -(-len(data) // CHUNK)
        assert f.chunks[-1] == weightcache.manifest.digest_of(data[(len(f.chunks) - 1) * CHUNK:])
        assert (f.header is not None) == f.path.endswith(".safetensors")
    assert sum(1 for _ in m.tensors()) == 1 + 4 * 3
    assert (model_dir / ".strata" / "manifests" / f"{m.digest}.json").read_bytes() == m.encoded
    assert (model_dir / ".strata" / "latest").read_text().strip() == m.digest
    assert resolve(model_dir) == m and resolve(model_dir, m.digest).digest == m.digest


def test_the_same_bytes_give_the_same_digest(model_dir):
    a = weightcache.publish_model(str(model_dir), chunk_bytes=CHUNK)
    b = weightcache.publish_model(str(model_dir), chunk_bytes=CHUNK)
    assert a.digest == b.digest
    assert Manifest.from_bytes(a.encoded, expect_digest=a.digest) == a
    assert weightcache.publish_model(str(model_dir), chunk_bytes=2 * CHUNK).digest != a.digest


def test_a_republish_keeps_the_old_manifest_findable(model_dir):
    old = weightcache.publish_model(str(model_dir), chunk_bytes=CHUNK)
    (model_dir / "config.json").write_text('{"changed": true}')
    new = weightcache.publish_model(str(model_dir), chunk_bytes=CHUNK)
    assert new.digest != old.digest
    assert resolve(model_dir).digest == new.digest
    assert resolve(model_dir, old.digest).digest == old.digest

    async def listed():
        origin = open_origin(str(model_dir))
        try:
            return [(p.manifest.digest, p.latest) for p in await catalog.published(origin)]
        finally:
            await origin.close()

    assert run(listed()) == [(new.digest, True), (old.digest, False)]


def test_an_altered_manifest_is_refused(model_dir):
    m = weightcache.publish_model(str(model_dir), chunk_bytes=CHUNK)
    stored = model_dir / ".strata" / "manifests" / f"{m.digest}.json"
    stored.write_bytes(stored.read_bytes().replace(b'"size":', b'"size": ', 1))
    with pytest.raises(ManifestMismatch, match="altered"):
        resolve(model_dir, m.digest)


def test_nothing_published_says_how_to_publish(model_dir):
    with pytest.raises(NotPublished, match="strata weights publish"):
        resolve(model_dir)
    with pytest.raises(NotPublished, match="strata weights ls"):
        resolve(model_dir, "0" * 64)
    with pytest.raises(ManifestError, match="64 lowercase hex"):
        resolve(model_dir, "abc")


def test_a_broken_safetensors_file_stops_the_publish(model_dir):
    (model_dir / "extra.safetensors").write_bytes(safetensors_file(b'{"a": {"dtype": "F32"'))
    with pytest.raises(HeaderError, match="extra.safetensors"):
        weightcache.publish_model(str(model_dir), chunk_bytes=CHUNK)
    assert not (model_dir / ".strata" / "latest").exists()


def test_a_shard_index_naming_a_missing_tensor_stops_the_publish(model_dir):
    index = model_dir / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["layers.9.ghost"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="layers.9.ghost"):
        weightcache.publish_model(str(model_dir), chunk_bytes=CHUNK)


def _doc(m: Manifest) -> dict:
    return json.loads(m.encoded)


def _edit(m: Manifest, change) -> bytes:
    doc = _doc(m)
    change(doc)
    return json.dumps(doc).encode()


def _shift(tensor: list, by: int) -> None:
    tensor[3] += by
    tensor[4] += by


def _set(path, value):
    def change(doc):
        node = doc
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value

    return change


@pytest.mark.parametrize("change,match", [
    (_set(["format"], "strata.weights.manifest/9"), "format"),
    (_set(["chunk_bytes"], 1000), "multiple of 64 KiB"),
    (_set(["files", 0, "path"], "../../etc/passwd"), "normalized relative path"),
    (_set(["files", 0, "path"], "/etc/passwd"), "normalized relative path"),
    (_set(["files", 0, "size"], 10 ** 9), "chunk digests"),
    (_set(["files", 0, "chunks", 0], "zz"), "hex"),
    (lambda doc: _shift(doc["files"][1]["safetensors"]["tensors"][0], 10 ** 12), "past the end"),
    (lambda doc: _shift(doc["files"][1]["safetensors"]["tensors"][1], -8), "overlap"),
    (_set(["files", 1, "safetensors", "data_start"], 3), "data_start"),
    (_set(["model"], ""), "model"),
])
def test_malformed_manifests_are_refused(model_dir, change, match):
    m = weightcache.publish_model(str(model_dir), chunk_bytes=CHUNK)
    with pytest.raises(ManifestError, match=match):
        Manifest.from_bytes(_edit(m, change))


def test_a_hostile_manifest_or_shard_index_is_refused_not_a_recursion_error(model_dir):
    deep = b'{"format": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(ManifestError, match="nests too deeply"):
        Manifest.from_bytes(deep)
    with pytest.raises(ManifestError, match="not JSON"):
        Manifest.from_bytes(b'{"chunk_bytes": ' + b"9" * 5000 + b"}")
    (model_dir / "model.safetensors.index.json").write_bytes(b'{"weight_map": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    with pytest.raises(ManifestError, match="weight_map"):
        weightcache.publish_model(str(model_dir), chunk_bytes=CHUNK)


def test_a_manifest_with_a_shape_no_framework_can_describe_is_refused(model_dir):
    m = weightcache.publish_model(str(model_dir), chunk_bytes=CHUNK)
    doc = _doc(m)
    shard = next(f for f in doc["files"] if "safetensors" in f)
    shard["safetensors"]["tensors"].append(["ghost", "F32", [0, 2 ** 70], 0, 0])
    with pytest.raises(ManifestError, match="over 1 PiB"):
        Manifest.from_bytes(json.dumps(doc).encode())


def test_one_tensor_in_two_files_is_refused(model_dir):
    m = weightcache.publish_model(str(model_dir), chunk_bytes=CHUNK)
    doc = _doc(m)
    shards = [f for f in doc["files"] if "safetensors" in f and not f["path"].endswith(".json")]
    shards[1]["safetensors"]["tensors"][0][0] = shards[0]["safetensors"]["tensors"][0][0]
    with pytest.raises(ManifestError, match="is in both"):
        Manifest.from_bytes(json.dumps(doc).encode())


def test_a_hugging_face_cache_repo_publishes_its_snapshot(tmp_path):
    repo = tmp_path / "hub" / "models--acme--tiny"
    staging = write_numpy_model(tmp_path / "staging", [layered_tensors(seed=1, layers=2)])
    commit = "3f1c" * 10
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for f in staging.iterdir():
        blob = repo / "blobs" / f"sha-{f.name}"
        blob.write_bytes(f.read_bytes())
        os.symlink(os.path.relpath(blob, repo / "snapshots" / commit), repo / "snapshots" / commit / f.name)
    m = weightcache.publish_model(str(repo), revision="main", chunk_bytes=CHUNK)
    assert (m.model, m.revision) == ("acme/tiny", commit)
    assert {f.path for f in m.files} == {"model.safetensors", "config.json"}
    assert (repo / "snapshots" / commit / ".strata" / "latest").exists()
    # the snapshot folder itself is the same origin
    assert weightcache.publish_model(str(repo / "snapshots" / commit), chunk_bytes=CHUNK).digest == m.digest
    # a symlink out of the repo is never followed
    os.symlink("/etc/hostname", repo / "snapshots" / commit / "leak.txt")
    with pytest.raises(ManifestMismatch, match="outside"):
        weightcache.publish_model(str(repo), chunk_bytes=CHUNK)
