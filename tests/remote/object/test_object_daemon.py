"""``strata serve`` with the chain ram -> disk -> object, as real processes, against a moto bucket.

Blocks evicted from a daemon's disk land in the bucket; a second daemon
with empty RAM and disk (another pod, or the first one rescheduled) serves
them by reading through, verified; a block damaged in the bucket is never
served. Credentials travel the standard way: AWS_* variables.
"""

from __future__ import annotations

import hashlib

import pytest

from kvstore import Client, TierName
from kvstore.block import BlockKey
from kvstore.errors import CorruptBlock
from kvstore.remote.object.format import header_length
from kvstore.remote.object.layout import KeyLayout
from tests.support import s3_servers
from tests.support.daemons import DaemonProcess
from tests.support.wait import wait_until

pytestmark = pytest.mark.system

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

    def start(*extra: str) -> DaemonProcess:
        home = tmp_path / f"node{len(started)}"
        home.mkdir()
        d = DaemonProcess(
            home, "--tiers", "ram,disk,object", "--ram-bytes", "16MiB", "--disk-bytes", "8MiB",
            "--max-block-bytes", "2MiB", "--object-bucket", s3.bucket, "--object-prefix", prefix,
            "--object-endpoint", s3.endpoint, "--object-read-seconds", "10", "--log-level", "DEBUG", *extra,
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


def test_a_sweep_removes_every_nodes_object_holding_of_the_blocks_it_expired(s3, daemons, redis_url):
    """Two daemons share a Redis index and a bucket; both wrote the same blocks, evicted to the bucket
    (holder tier ``object`` on each). Whichever sweeps expires them and removes both nodes' entries
    at once: neither node ever reads them again, so nothing else would."""
    args = ("--index-url", redis_url, "--object-ttl-seconds", "10", "--object-sweep-seconds", "1")
    a, b = daemons("--node-id", "sweep-a", *args), daemons("--node-id", "sweep-b", *args)
    ns = "swept-" + daemons.prefix
    keys = [b"k%d" % i for i in range(BLOCKS)]
    with Client(a.target, use_shm=False) as ca, Client(b.target, use_shm=False) as cb:
        for i, k in enumerate(keys):
            ca.put(ns, k, value(i))
            cb.put(ns, k, value(i))

        def object_holders() -> dict[bytes, set[str]]:
            return {k: {h.node_id for h in hs if h.tier is TierName.OBJECT}
                    for k, hs in zip(keys, ca.holders(ns, keys=keys))}

        wait_until(lambda: any(v == {"sweep-a", "sweep-b"} for v in object_holders().values()),
                   what="a block whose best copy is the bucket's on both nodes")
        wait_until(lambda: not s3.keys(f"{daemons.prefix}/{ns}/"), timeout=60, what="the sweep to expire the blocks")
        wait_until(lambda: not any(object_holders().values()), timeout=15,
                   what="every node's object holding of the expired blocks to leave the index")
        assert all(s.tier is not TierName.OBJECT for e in cb.holders(ns, keys=keys) for s in e)


def test_a_new_daemon_with_empty_disks_serves_every_block_its_namespace_has_in_the_bucket(s3, daemons):
    """A fleet of two daemons writes a namespace through to the bucket and is SIGKILLed; a new daemon
    (empty RAM, empty disk) serves every block the bucket lists for that namespace, byte for byte."""
    fleet = [daemons("--disk-write-policy", "through", "--object-write-policy", "through") for _ in range(2)]
    n = 24
    for j, d in enumerate(fleet):
        with Client(d.target, use_shm=False) as c:
            for i in range(j, n, 2):
                c.put("warm", b"k%d" % i, value(i))
    layout = KeyLayout(daemons.prefix)
    wait_until(lambda: len(s3.keys(f"{daemons.prefix}/warm/")) == n, timeout=60, what="every block in the bucket")
    for d in fleet:
        d.kill()
    listed = [layout.parse(name) for name in s3.keys(f"{daemons.prefix}/warm/")]
    assert len(listed) == n and all(p is not None and p[0] == "warm" for p in listed)
    fresh = daemons()
    with Client(fresh.target, use_shm=False) as c:
        assert c.stats().blocks == 0, "the new daemon has blocks of its own"
        for _, key in listed:
            assert c.get("warm", key) == value(int(key[1:])), key


def test_a_corrupt_object_found_by_one_node_leaves_the_index_for_every_node(s3, daemons, redis_url):
    """Both daemons' best copy of a block is the bucket's; one reads it, finds it damaged and deletes it:
    the other node's ``object`` entry leaves the shared index too, though that node never reads it."""
    a, b = (daemons("--node-id", f"corrupt-{n}", "--index-url", redis_url) for n in "ab")
    ns = "corrupt-" + daemons.prefix
    keys = [b"k%d" % i for i in range(BLOCKS)]
    with Client(a.target, use_shm=False) as ca, Client(b.target, use_shm=False) as cb:
        for i, k in enumerate(keys):
            ca.put(ns, k, value(i))
            cb.put(ns, k, value(i))

        def object_holders(k: bytes) -> set[str]:
            return {h.node_id for h in ca.holders(ns, keys=[k])[0] if h.tier is TierName.OBJECT}

        victim = wait_until(lambda: next((k for k in keys if object_holders(k) == {"corrupt-a", "corrupt-b"}), None),
                            what="a block whose best copy is the bucket's on both nodes")
        path = KeyLayout(daemons.prefix).path(BlockKey(ns, victim))
        obj = bytearray(s3.raw_get(path))
        obj[header_length(obj) + 100] ^= 0x01
        s3.raw_put(path, bytes(obj))
        with pytest.raises(CorruptBlock):  # its one copy was damaged: the reader learns why it is gone
            ca.get(ns, victim)
        wait_until(lambda: object_holders(victim) == set(), timeout=15, what="both nodes' entries to leave the index")
        assert s3.raw_get(path) is None
