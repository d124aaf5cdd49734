"""One contract suite over every origin: the local folder and S3 (moto, through the gate)."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.harness import free_port
from kvstore.errors import InvalidArgument
from tests.support.weights_s3 import s3_options
from weightcache.errors import ManifestError, ManifestMismatch, OriginThrottled, OriginUnavailable
from weightcache.origin import ORIGINS, S3OriginOptions, open_origin

FILES = {"model.safetensors": bytes(range(256)) * 600, "config.json": b'{"a": 1}', "sub/tok.txt": b"tokens"}


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.system)])
def origin(request, tmp_path):
    if request.param == "local":
        root = tmp_path / "rev"
        for k, v in FILES.items():
            (root / k).parent.mkdir(parents=True, exist_ok=True)
            (root / k).write_bytes(v)
        (root / ".strata").mkdir()
        (root / ".strata" / "latest").write_text("x")
        o = open_origin(str(root))
    else:
        bucket = request.getfixturevalue("make_bucket")()
        for k, v in FILES.items():
            bucket.put(f"org/m/rev/{k}", v)
        bucket.put("org/m/rev/.strata/latest", b"x")
        bucket.put("org/m/revision2/config.json", b"{}")  # a sibling prefix is not this revision
        o = open_origin(f"s3://{bucket.name}/org/m/rev", s3=s3_options(request.getfixturevalue("s3_gate")().endpoint))
    yield o
    asyncio.run(o.close())


def test_list_files_is_the_revision_without_its_catalog(origin):
    assert asyncio.run(origin.list_files()) == sorted((k, len(v)) for k, v in FILES.items())
    assert asyncio.run(origin.list_files(catalog=True)) == [(".strata/latest", 1)]


def test_read_returns_exactly_the_range(origin):
    buf = memoryview(bytearray(70_000))
    view = asyncio.run(origin.read("model.safetensors", 1000, 65536, buf))
    assert bytes(view) == FILES["model.safetensors"][1000:66536]
    assert bytes(asyncio.run(origin.read("sub/tok.txt", 2, 4, buf))) == b"kens"


def test_a_short_or_missing_file_is_a_manifest_mismatch(origin):
    buf = memoryview(bytearray(1 << 20))
    size = len(FILES["model.safetensors"])
    with pytest.raises(ManifestMismatch, match="publish again"):
        asyncio.run(origin.read("model.safetensors", size - 10, 100, buf))
    with pytest.raises(ManifestMismatch, match="gone"):
        asyncio.run(origin.read("nope.safetensors", 0, 10, buf))


def test_get_and_put_small_files(origin):
    assert asyncio.run(origin.get("config.json", 100)) == b'{"a": 1}'
    assert asyncio.run(origin.get(".strata/none", 100)) is None
    with pytest.raises(ManifestError, match="over 4 bytes"):
        asyncio.run(origin.get("config.json", 4))
    asyncio.run(origin.put(".strata/manifests/x.json", b"{}"))
    assert asyncio.run(origin.get(".strata/manifests/x.json", 100)) == b"{}"
    assert (".strata/manifests/x.json", 2) in asyncio.run(origin.list_files(catalog=True))


def test_an_unreachable_s3_is_unavailable_and_a_throttling_one_says_so(make_bucket, s3_gate):
    o = open_origin("s3://bucket/x", s3=S3OriginOptions(endpoint=f"http://127.0.0.1:{free_port()}", allow_http=True,
                                                 access_key_id="a", secret_access_key="b", region="us-east-1",
                                                 connect_timeout_s=2))
    with pytest.raises(OriginUnavailable):
        asyncio.run(o.read("f", 0, 4, memoryview(bytearray(4))))
    bucket = make_bucket()
    bucket.put("p/f", b"data")
    gate = s3_gate()
    gate.throttle(1)
    o = open_origin(f"s3://{bucket.name}/p", s3=s3_options(gate.endpoint))
    with pytest.raises(OriginThrottled, match="throttling"):
        asyncio.run(o.read("f", 0, 4, memoryview(bytearray(4))))
    assert bytes(asyncio.run(o.read("f", 0, 4, memoryview(bytearray(4))))) == b"data"


def test_origins_are_found_by_scheme(tmp_path):
    assert set(ORIGINS) == {"", "file", "s3"}
    assert open_origin(f"file://{tmp_path}").location == str(tmp_path)
    with pytest.raises(InvalidArgument, match="unknown scheme 'gs'.*s3://"):
        open_origin("gs://bucket/x")
    with pytest.raises(InvalidArgument, match="not a directory"):
        open_origin(str(tmp_path / "missing"))
