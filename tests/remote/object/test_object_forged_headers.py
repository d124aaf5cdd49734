"""Objects whose header checks out (magic, version, its own xxh3) but lies, in a real moto bucket.

A damaged or forged object can carry a well-formed header whose fields do
not describe the object: a size 1 GiB past the object's end, a map longer
than the object, another block's key, a size or a time out of range. Each
must go the way of every corrupt object (tests/remote/object/test_object_source.py):
never served, never allocated at the size it claims, counted in
``strata_object_corrupt_objects_total``, deleted from the bucket, handed to
``on_dropped`` (the tier then drops the block's ``object`` holders from the
prefix index), and then a plain miss. Whichever call meets it first (a
read, a whole-object fetch, a lookup's probe, a write's check before its
PUT) does this, and nothing else in the bucket is touched.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import struct
import time

import msgpack
import pytest
import xxhash

from kvstore.block import BlockKey, BlockMeta, checksum
from kvstore.errors import CorruptBlock
from kvstore.remote.base import ReadStatus, WriteStatus
from kvstore.remote.object.credentials import StaticCredentials
from kvstore.remote.object.format import MAGIC, MAX_MAP_BYTES, VERSION, encode
from kvstore.remote.object.metrics import ObjectMetrics
from kvstore.remote.object.source import ObjectSource
from tests.support import s3_servers

pytestmark = pytest.mark.system

CREDS = StaticCredentials(s3_servers.ACCESS_KEY, s3_servers.SECRET_KEY)
GiB = 1 << 30
PAYLOAD = 3000


def later() -> float:
    return time.monotonic() + 30.0


def block(n: int, seed: int) -> tuple[bytes, BlockMeta]:
    data = random.Random(seed).randbytes(n)
    return data, BlockMeta(n, checksum(data), None, "bf16")


def forged(fields: dict, payload: bytes, map_bytes: int | None = None) -> bytes:
    """An object with a header map of ``fields`` that passes its own checksum, then ``payload``;
    ``map_bytes``: the map length the fixed header claims (default: the map's own)."""
    packed = msgpack.packb(fields, use_bin_type=True)
    n = len(packed) if map_bytes is None else map_bytes
    return struct.pack("<4sBBHIQ", MAGIC, VERSION, 0, 0, n, xxhash.xxh3_64_intdigest(packed)) + packed + payload


def lie(kind: str, k: BlockKey) -> bytes:
    data, meta = block(PAYLOAD, seed=1)
    fields = {"ns": k.namespace, "key": k.key, "size": meta.size, "xxh3": meta.checksum, "parent": None,
              "layout": "bf16", "at": 1_700_000_000.0}
    if kind == "size-1GiB-past-the-object":  # the finding: also over the daemon's 1 GiB max block
        fields["size"] = meta.size + GiB
    elif kind == "size-past-the-object":
        fields["size"] = meta.size + 1000
    elif kind == "size-short-of-the-object":
        fields["size"] = meta.size - 1000
    elif kind == "map-past-the-object":
        return forged(fields, b"", map_bytes=MAX_MAP_BYTES)[:200]
    elif kind == "map-over-the-limit":
        return forged(fields, data, map_bytes=0xFFFF_FFFF)
    elif kind == "another-key":
        fields["key"] = b"someone-else"
    elif kind == "negative-size":
        fields["size"] = -1
    elif kind == "size-of-64-bits":
        fields["size"] = (1 << 64) - 1
    elif kind == "negative-checksum":
        fields["xxh3"] = -meta.checksum - 1
    elif kind == "time-not-a-number":
        fields["at"] = float("nan")
    elif kind == "time-infinite":
        fields["at"] = float("inf")
    elif kind == "time-as-text":
        fields["at"] = "1e999"
    return forged(fields, data)


LIES = ["size-1GiB-past-the-object", "size-past-the-object", "size-short-of-the-object", "map-past-the-object",
        "map-over-the-limit", "another-key", "negative-size", "size-of-64-bits", "negative-checksum",
        "time-not-a-number", "time-infinite", "time-as-text"]


@pytest.fixture
def prefix(request) -> str:
    return "forged-" + hashlib.blake2b(request.node.nodeid.encode(), digest_size=6).hexdigest()


class Planted:
    """A forged object and a good block beside it in the same namespace, put straight into the bucket."""

    def __init__(self, s3, prefix: str, kind: str) -> None:
        self.s3, self.prefix = s3, prefix
        self.forged_key, self.good_key = BlockKey("model-a", b"forged"), BlockKey("model-a", b"good")
        self.good_data, self.good_meta = block(PAYLOAD, seed=2)
        self.forged_path, self.good_path = self.path(self.forged_key), self.path(self.good_key)
        self.good_object = bytes(encode(self.good_key, self.good_data, self.good_meta, time.time()))
        s3.raw_put(self.good_path, self.good_object)
        s3.raw_put(self.forged_path, lie(kind, self.forged_key))

    def path(self, k: BlockKey) -> str:
        return f"{self.prefix}/{k.namespace}/{k.key.hex()}"

    def source(self, metrics: ObjectMetrics, dropped: list, **options) -> ObjectSource:
        src = ObjectSource.open(f"{self.s3.bucket}/{self.prefix}", endpoint=self.s3.endpoint, credentials=CREDS,
                                metrics=metrics, **options)
        src._on_dropped = dropped.extend  # what ObjectTier.open wires to the index's holders
        return src

    def check_dropped_alone(self, metrics: ObjectMetrics, dropped: list) -> None:
        assert self.s3.raw_get(self.forged_path) is None, "the forged object was deleted"
        assert metrics.registry.get_sample_value("strata_object_corrupt_objects_total") == 1
        assert dropped == [self.forged_key], "its holders leave the index, and only its"
        assert self.s3.keys(self.prefix + "/") == [self.good_path], "nothing else was deleted"
        assert self.s3.raw_get(self.good_path) == self.good_object


async def then_a_miss_and_the_good_block_reads(src: ObjectSource, planted: Planted) -> None:
    asked: list[BlockMeta] = []
    given: dict[int, bytearray] = {}

    def place(i: int, meta: BlockMeta) -> memoryview:
        asked.append(meta)
        given[i] = bytearray(meta.size)
        return memoryview(given[i])

    again, good = await src.read([planted.forged_key, planted.good_key], place, later())
    assert again.status is ReadStatus.MISS
    assert good.is_hit and bytes(given[1]) == planted.good_data and asked == [planted.good_meta]


@pytest.mark.parametrize("kind", LIES)
def test_a_forged_header_met_by_a_read_is_corrupt_never_allocated_and_deleted(s3, prefix, kind, caplog):
    planted, metrics, dropped = Planted(s3, prefix, kind), ObjectMetrics(), []
    caplog.set_level(logging.WARNING, logger="kvstore.remote.object")

    async def body():
        src = planted.source(metrics, dropped)
        asked: list[BlockMeta] = []
        [got] = await src.read([planted.forged_key], lambda i, meta: asked.append(meta), later())
        assert not got.is_hit and got.status is ReadStatus.FAILED and isinstance(got.error, CorruptBlock)
        assert asked == [], "no buffer was asked for at the size the header claims"
        planted.check_dropped_alone(metrics, dropped)
        await then_a_miss_and_the_good_block_reads(src, planted)
        await src.close()

    asyncio.run(body())
    said = [r.getMessage() for r in caplog.records if r.name.startswith("kvstore.remote.object")]
    assert len(said) == 1 and planted.forged_path in said[0] and "corrupt" in said[0], said
    assert repr(lie(kind, planted.forged_key)[-PAYLOAD:][:16])[2:-1] not in said[0], "no payload bytes in the log"


@pytest.mark.parametrize("kind", LIES)
def test_a_forged_header_met_by_a_fetch_is_corrupt_and_deleted(s3, prefix, kind):
    planted, metrics, dropped = Planted(s3, prefix, kind), ObjectMetrics(), []

    async def body():
        src = planted.source(metrics, dropped)
        with pytest.raises(CorruptBlock):
            await src.fetch(planted.forged_key, later())
        planted.check_dropped_alone(metrics, dropped)
        assert await src.fetch(planted.forged_key, later()) is None
        payload, meta = await src.fetch(planted.good_key, later())
        assert bytes(payload) == planted.good_data and meta == planted.good_meta
        await src.close()

    asyncio.run(body())


@pytest.mark.parametrize("kind", LIES)
def test_a_forged_header_met_by_a_lookup_is_not_reported_and_is_deleted(s3, prefix, kind):
    planted, metrics, dropped = Planted(s3, prefix, kind), ObjectMetrics(), []

    async def body():
        src = planted.source(metrics, dropped)
        assert await src.lookup([planted.forged_key, planted.good_key], later()) == [None, planted.good_meta]
        planted.check_dropped_alone(metrics, dropped)
        await then_a_miss_and_the_good_block_reads(src, planted)
        await src.close()

    asyncio.run(body())


@pytest.mark.parametrize("kind", ["size-1GiB-past-the-object", "size-past-the-object", "time-not-a-number"])
def test_a_forged_header_does_not_stop_the_real_block_from_being_written(s3, prefix, kind):
    planted, metrics, dropped = Planted(s3, prefix, kind), ObjectMetrics(), []
    data, meta = block(PAYLOAD, seed=3)

    async def body():
        src = planted.source(metrics, dropped)
        [written] = await src.write([(planted.forged_key, data, meta)], later())
        assert written.status is WriteStatus.STORED, "the probe before the PUT took the forged object for the block"
        assert metrics.registry.get_sample_value("strata_object_corrupt_objects_total") == 1
        assert dropped == [planted.forged_key]
        given: dict[int, bytearray] = {}
        [got] = await src.read([planted.forged_key], lambda i, m: given.setdefault(i, bytearray(m.size)), later())
        assert got.is_hit and bytes(given[0]) == data
        await src.close()

    asyncio.run(body())
    assert s3.raw_get(planted.good_path) == planted.good_object


def test_a_whole_block_over_this_daemons_limit_is_left_alone_and_a_forged_one_of_that_size_is_not(s3, prefix):
    """Over ``max_block_bytes`` (and past what a fetch takes into memory), only the header, read on its
    own, tells another fleet's block (a miss, kept) from a damaged object (deleted)."""
    planted, metrics, dropped = Planted(s3, prefix, "size-past-the-object"), ObjectMetrics(), []
    big_key, big_data = BlockKey("model-a", b"big"), random.Random(4).randbytes(40_000)
    big_meta = BlockMeta(len(big_data), checksum(big_data))
    big = bytes(encode(big_key, big_data, big_meta, time.time()))
    s3.raw_put(planted.path(big_key), big)
    cut = bytes(encode(planted.forged_key, big_data, big_meta, time.time()))[:-1000]  # its header: 1000 bytes more
    s3.raw_put(planted.forged_path, cut)

    async def body():
        src = planted.source(metrics, dropped, max_block_bytes=8192)
        assert await src.fetch(big_key, later()) is None
        assert await src.lookup([big_key], later()) == [None], "a block this daemon will not read is not offered"
        with pytest.raises(CorruptBlock):
            await src.fetch(planted.forged_key, later())
        await src.close()

    asyncio.run(body())
    assert s3.raw_get(planted.path(big_key)) == big, "another fleet's block is not deleted for being large"
    assert s3.raw_get(planted.forged_path) is None
    assert metrics.registry.get_sample_value("strata_object_corrupt_objects_total") == 1
    assert dropped == [BlockKey("model-a", b"forged")]
