"""``strata serve`` with the chain ram -> disk -> object, as real processes, against a moto bucket.

Blocks evicted from a daemon's disk land in the bucket; a second daemon
with empty RAM and disk (another pod, or the first one rescheduled) serves
them by reading through, verified; a block damaged in the bucket is never
served. Credentials travel the standard way: AWS_* variables.
"""

from __future__ import annotations

import hashlib

import pytest

import s3_servers
from conftest import DaemonProcess, wait_until
from kvstore import Client, TierName
from kvstore.block import BlockKey
from kvstore.remote.object.format import header_length
from kvstore.remote.object.layout import KeyLayout

BLOCK = 512 << 10
BLOCKS = 64  # 32 MiB through 16 MiB of RAM and 8 MiB of disk


def value(i: int) -> bytes:
    seed = hashlib.sha256(b"object-%d" % i).digest()
    return (seed * (BLOCK // len(seed) + 1))[:BLOCK]


@pytest.fixture
def daemons(s3, tmp_path, monkeypatch, request):
    """Start daemons on one bucket prefix, each with a home of its own; all killed at the end."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_servers.ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_servers.SECRET_KEY)
    prefix = "daemon-" + hashlib.blake2b(request.node.nodeid.encode(), digest_size=6).hexdigest()
    started: list[DaemonProcess] = []

    def start() -> DaemonProcess:
        home = tmp_path / f"node{len(started)}"
        home.mkdir()
        d = DaemonProcess(
            home, "--tiers", "ram,disk,object", "--ram-bytes", "16MiB", "--disk-bytes", "8MiB",
            "--max-block-bytes", "2MiB", "--object-bucket", s3.bucket, "--object-prefix", prefix,
            "--object-endpoint", s3.endpoint, "--object-read-seconds", "10", "--log-level", "DEBUG",
        )
        started.append(d.start())
        return d

    start.prefix = prefix
    yield start
    for d in started:
        d.stop()


def test_blocks_evicted_from_disk_land_in_s3_and_a_new_daemon_serves_them_verified(s3, daemons):
    first = daemons()
    with Client(first.target, use_shm=False) as c:
        for i in range(BLOCKS):
            c.put("llama", b"k%d" % i, value(i))
    layout = KeyLayout(daemons.prefix)

    def in_bucket() -> list[int]:
        names = set(s3.keys(daemons.prefix + "/"))
        return [i for i in range(BLOCKS) if layout.path(BlockKey("llama", b"k%d" % i)) in names]

    uploaded = wait_until(lambda: len(in_bucket()) >= 8 and in_bucket(), what="evicted blocks in the bucket")
    with Client(first.target, use_shm=False) as c:
        assert all(c.exists("llama", [b"k%d" % i]) == [TierName.OBJECT] for i in uploaded[:4])
    first.stop()  # SIGKILL: what is in the bucket stays

    damaged = uploaded[0]
    path = layout.path(BlockKey("llama", b"k%d" % damaged))
    obj = bytearray(s3.raw_get(path))
    obj[header_length(obj) + 1234] ^= 0x40
    s3.raw_put(path, bytes(obj))

    second = daemons()  # empty RAM, empty disk, the same bucket
    with Client(second.target, use_shm=False) as c:
        for i in uploaded[1:]:
            assert c.get("llama", b"k%d" % i) == value(i)
            assert c.exists("llama", [b"k%d" % i]) == [TierName.HOST], "read through, then promoted into RAM"
        assert c.get("llama", b"k%d" % damaged) is None, "a damaged object was served"
        assert c.get("llama", b"never-written") is None
    assert s3.raw_get(path) is None, "the damaged object was deleted"
    for d in (first, second):
        assert s3_servers.SECRET_KEY not in d.log.read_text(), "a credential was logged"
