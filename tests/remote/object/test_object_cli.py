"""``strata object ls|du|gc`` against the real moto server: what an operator sees, and a sweep it runs."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

import pytest

from kvstore.block import BlockKey, BlockMeta, checksum
from kvstore.remote.object.client import S3Client, S3Options
from kvstore.remote.object.credentials import StaticCredentials
from kvstore.remote.object.layout import KeyLayout
from kvstore.remote.object.source import ObjectSource
from tests.support import s3_servers

pytestmark = pytest.mark.system


@pytest.fixture
def prefix(request) -> str:
    return "cli-" + hashlib.blake2b(request.node.nodeid.encode(), digest_size=6).hexdigest()


@pytest.fixture(autouse=True)
def aws(monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_servers.ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_servers.SECRET_KEY)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("STRATA_CONFIG", raising=False)


def strata_object(s3, prefix, *argv) -> object:
    from kvstore.cli.main import build_parser

    parser = build_parser()  # the strata command's own parser: `strata object` is registered there
    args = parser.parse_args(["object", argv[0], "--bucket", s3.bucket, "--prefix", prefix,
                              "--endpoint", s3.endpoint, "--json", *argv[1:]])
    return args


def run(capsys, args) -> object:
    assert args.func(args) == 0
    return json.loads(capsys.readouterr().out)


def fill(s3, prefix, n: int) -> None:
    client = S3Client(S3Options(bucket=s3.bucket, endpoint=s3.endpoint,
                                credentials=StaticCredentials(s3_servers.ACCESS_KEY, s3_servers.SECRET_KEY)))
    blocks = []
    for i in range(n):
        data = bytes([i]) * 1000
        blocks.append((BlockKey("org/model" if i % 2 else "chat", b"k%d" % i), data, BlockMeta(1000, checksum(data))))
    asyncio.run(ObjectSource(client, KeyLayout(prefix)).write(blocks, time.monotonic() + 30))


def test_ls_du_and_gc(s3, prefix, capsys):
    fill(s3, prefix, 6)
    assert sorted(run(capsys, strata_object(s3, prefix, "ls"))) == ["chat", "org/model"]
    listed = run(capsys, strata_object(s3, prefix, "ls", "chat"))
    assert sorted(r["key"] for r in listed) == sorted((b"k%d" % i).hex() for i in (0, 2, 4))
    du = run(capsys, strata_object(s3, prefix, "du"))
    assert {r["namespace"]: r["objects"] for r in du["namespaces"]} == {"chat": 3, "org/model": 3}
    kept = run(capsys, strata_object(s3, prefix, "gc", "--ttl-seconds", "3600"))
    assert {r["namespace"]: (r["swept"], r["expired"], r["kept"]) for r in kept} == {
        "chat": (True, 0, 3), "org/model": (True, 0, 3)}
    gone = run(capsys, strata_object(s3, prefix, "gc", "chat", "--ttl-seconds", "1e-9"))
    assert gone == [{"namespace": "chat", "swept": True, "expired": 3, "expired_bytes": gone[0]["expired_bytes"],
                     "markers_deleted": 0, "kept": 0, "kept_bytes": 0}]
    assert not s3.keys(f"{prefix}/chat/")
    assert len(s3.keys(f"{prefix}/org~2Fmodel/")) == 3
