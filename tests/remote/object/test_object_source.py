"""The S3 object source against a real moto server, through a proxy that fails on purpose.

What the contract suite (tests/remote/test_remote_contract.py) cannot ask of every
kind: S3 answering 503 SlowDown, S3 down and back, objects damaged in the
bucket in every way, two writers racing on one block, multipart uploads,
and what the object in the bucket looks like. Counts come from the proxy
(what reached S3) and from the metrics, never from timings.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time

import pytest

from kvstore.block import BlockKey, BlockMeta, checksum
from kvstore.errors import CorruptBlock, TierUnavailable
from kvstore.remote.base import ReadStatus, WriteStatus
from kvstore.remote.object.credentials import StaticCredentials
from kvstore.remote.object.format import VERSION, decode_header, encode, header_length
from kvstore.remote.object.metrics import ObjectMetrics
from kvstore.remote.object.source import ObjectSource
from tests.support import s3_servers

pytestmark = pytest.mark.system

CREDS = StaticCredentials(s3_servers.ACCESS_KEY, s3_servers.SECRET_KEY)


def later() -> float:
    return time.monotonic() + 30.0


def block(n: int, seed: int = 0) -> tuple[bytes, BlockMeta]:
    data = random.Random(seed).randbytes(n)
    return data, BlockMeta(n, checksum(data), None, "bf16")


def key(name: str, namespace: str = "model-a") -> BlockKey:
    return BlockKey(namespace, name.encode())


class Buffers:
    def __init__(self) -> None:
        self.given: dict[int, bytearray] = {}

    def __call__(self, i: int, meta: BlockMeta) -> memoryview:
        self.given[i] = bytearray(meta.size)
        return memoryview(self.given[i])


@pytest.fixture
def prefix(request) -> str:
    return "src-" + hashlib.blake2b(request.node.nodeid.encode(), digest_size=6).hexdigest()


@pytest.fixture
def proxy(s3):
    p = s3.proxy()
    yield p
    p.close()


def source(s3, prefix: str, endpoint: str | None = None, metrics: ObjectMetrics | None = None, **options):
    return ObjectSource.open(f"{s3.bucket}/{prefix}", endpoint=endpoint or s3.endpoint, credentials=CREDS,
                             metrics=metrics, **options)


def run(body):
    asyncio.run(body())


def sample(metrics: ObjectMetrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return value or 0.0


# ---- what is in the bucket ---------------------------------------------------------------------------


def test_a_block_is_one_object_named_by_namespace_and_key_and_carrying_its_meta(s3, prefix):
    async def body():
        src = source(s3, prefix)
        data, meta = block(3000)
        k = BlockKey("org/llama", bytes.fromhex("ab01"))
        [result] = await src.write([(k, data, BlockMeta(meta.size, meta.checksum, b"\x07par", "f16[2]"))], later())
        assert result.status is WriteStatus.STORED
        await src.close()

    before = time.time()
    run(body)
    assert s3.keys(prefix + "/") == [f"{prefix}/org~2Fllama/ab01"]
    obj = s3.raw_get(f"{prefix}/org~2Fllama/ab01")
    header = decode_header(obj[:header_length(obj)], BlockKey("org/llama", bytes.fromhex("ab01")))
    assert header.meta.parent == b"\x07par" and header.meta.layout == "f16[2]" and header.meta.size == 3000
    assert before - 1 <= header.written_at <= time.time() + 1
    assert obj[header.header_bytes:] == block(3000)[0]


# ---- dedup: one object per block, however many writers -------------------------------------------------


def test_a_second_writer_of_a_stored_block_uploads_nothing(s3, prefix, proxy):
    async def body():
        one, two = source(s3, prefix, proxy.endpoint), source(s3, prefix, proxy.endpoint)
        data, meta = block(50_000)
        assert (await one.write([(key("k"), data, meta)], later()))[0].status is WriteStatus.STORED
        puts = proxy.count("PUT")
        assert (await two.write([(key("k"), data, meta)], later()))[0].status is WriteStatus.PRESENT
        assert proxy.count("PUT") == puts, "the block was sent again"
        assert two.stats().written_bytes == 0
        await one.close()
        await two.close()

    run(body)


@pytest.mark.parametrize("check_before_put", [True, False], ids=["asking-first", "conditional-put-only"])
def test_two_writers_racing_on_one_block_make_one_object_and_one_is_told_present(s3, prefix, proxy,
                                                                                  check_before_put):
    async def body():
        writers = [source(s3, prefix, proxy.endpoint, check_before_put=check_before_put) for _ in range(2)]
        data, meta = block(200_000, seed=3)
        if not check_before_put:
            proxy.delay_s = 0.2  # both PUTs are in flight together: S3's condition decides
        results = await asyncio.gather(*(w.write([(key("race"), data, meta)], later()) for w in writers))
        assert sorted(r[0].status.value for r in results) == ["present", "stored"]
        proxy.delay_s = 0.0
        for w in writers:
            await w.close()
        reader = source(s3, prefix)
        buffers = Buffers()
        [got] = await reader.read([key("race")], buffers, later())
        assert got.is_hit and bytes(buffers.given[0]) == data
        await reader.close()

    run(body)
    assert len(s3.keys(prefix + "/")) == 1


def test_a_large_block_goes_up_in_parts_and_reads_back_whole(s3, prefix, proxy):
    async def body():
        src = source(s3, prefix, proxy.endpoint, multipart_bytes=5 << 20, part_bytes=5 << 20)
        data, meta = block((5 << 20) + 12345, seed=9)
        assert (await src.write([(key("big"), data, meta)], later()))[0].status is WriteStatus.STORED
        assert proxy.count("POST", "uploads") == 1, "a multipart upload was started"
        buffers = Buffers()
        [got] = await src.read([key("big")], buffers, later())
        assert got.is_hit and bytes(buffers.given[0]) == data
        await src.close()

    run(body)


# ---- S3 unwell ----------------------------------------------------------------------------------------


def test_slowdown_is_backed_off_and_retried_until_it_passes(s3, prefix, proxy):
    metrics = ObjectMetrics()

    async def body():
        src = source(s3, prefix, proxy.endpoint, metrics, retries=4, backoff_s=0.01, max_backoff_s=0.05)
        data, meta = block(10_000)
        proxy.slowdown, proxy.retry_after = 3, "1"
        [result] = await src.write([(key("k"), data, meta)], later())
        assert result.status is WriteStatus.STORED
        assert proxy.refused == 3 and proxy.slowdown == 0
        assert sample(metrics, "strata_object_requests_total", op="probe", code="SlowDown") == 3
        assert sample(metrics, "strata_object_retries_total", op="probe") == 3
        assert src._client._calm_until > 0, "a SlowDown closed the gate for every request"
        buffers = Buffers()
        [got] = await src.read([key("k")], buffers, later())
        assert got.is_hit and bytes(buffers.given[0]) == data
        await src.close()

    run(body)


def test_slowdown_past_the_retries_fails_the_key_and_stores_nothing(s3, prefix, proxy):
    async def body():
        src = source(s3, prefix, proxy.endpoint, retries=2, backoff_s=0.01, max_backoff_s=0.02,
                     check_before_put=False)
        data, meta = block(10_000)
        proxy.slowdown = 100
        [result] = await src.write([(key("k"), data, meta)], later())
        assert result.status is WriteStatus.FAILED and isinstance(result.error, TierUnavailable)
        assert "SlowDown" in str(result.error) and proxy.refused == 3, "one try and two retries, no more"
        proxy.slowdown = 0
        assert await src.lookup([key("k")], later()) == [None]
        assert src.stats().errors >= 1
        await src.close()

    run(body)


def test_s3_down_then_back(s3, prefix, proxy):
    async def body():
        src = source(s3, prefix, proxy.endpoint, retries=1, backoff_s=0.01, max_backoff_s=0.02)
        held, held_meta = block(4000, seed=1)
        await src.write([(key("held"), held, held_meta)], later())
        proxy.down = True
        data, meta = block(4000, seed=2)
        [wrote] = await src.write([(key("new"), data, meta)], later())
        assert isinstance(wrote.error, TierUnavailable) and "local tiers keep serving" in str(wrote.error)
        [read] = await src.read([key("held")], Buffers(), later())
        assert read.status is ReadStatus.FAILED and isinstance(read.error, TierUnavailable)
        with pytest.raises(TierUnavailable):
            await src.lookup([key("held")], later())
        proxy.down = False
        assert (await src.write([(key("new"), data, meta)], later()))[0].status is WriteStatus.STORED
        buffers = Buffers()
        results = await src.read([key("held"), key("new")], buffers, later())
        assert all(r.is_hit for r in results) and bytes(buffers.given[1]) == data
        await src.close()

    run(body)


def test_a_missing_bucket_is_an_outage_that_names_the_fix_not_a_miss(s3):
    async def body():
        src = ObjectSource.open("no-such-bucket-here/p", endpoint=s3.endpoint, credentials=CREDS, retries=0)
        [read] = await src.read([key("k")], Buffers(), later())
        assert isinstance(read.error, TierUnavailable) and "create the bucket" in str(read.error)
        with pytest.raises(TierUnavailable, match="NoSuchBucket"):
            await src.lookup([key("k")], later())
        await src.close()

    run(body)


# ---- damage in the bucket: detected, deleted, a miss -------------------------------------------------


def _stored(s3, prefix: str, k: BlockKey, n: int = 5000) -> tuple[str, bytes, BlockMeta, bytearray]:
    data, meta = block(n, seed=n)
    obj = encode(k, data, meta, time.time())
    path = f"{prefix}/{k.namespace}/{k.key.hex()}"
    s3.raw_put(path, bytes(obj))
    return path, data, meta, obj


def _damage(kind: str, obj: bytearray, k: BlockKey, s3, prefix: str) -> bytes:
    start = header_length(obj)
    if kind == "payload-bit":
        obj[start + 17] ^= 0x10
    elif kind == "header-bit":
        obj[start - 2] ^= 0x01
    elif kind == "truncated":
        del obj[-1]
    elif kind == "extended":
        obj += b"\x00"
    elif kind == "empty":
        del obj[:]
    elif kind == "not-ours":
        obj[:] = b"<html>not a block</html>"
    elif kind == "another-block":
        data, meta = block(5000, seed=5000)
        obj[:] = encode(BlockKey(k.namespace, b"other"), data, meta, 0.0)
    return bytes(obj)


@pytest.mark.parametrize("kind", ["payload-bit", "header-bit", "truncated", "extended", "empty", "not-ours",
                                  "another-block"])
def test_a_damaged_object_is_reported_corrupt_deleted_and_then_a_miss(s3, prefix, kind):
    metrics = ObjectMetrics()
    k = key("victim")
    path, data, meta, obj = _stored(s3, prefix, k)
    s3.raw_put(path, _damage(kind, obj, k, s3, prefix))

    async def body():
        src = source(s3, prefix, metrics=metrics)
        buffers = Buffers()
        [got] = await src.read([k], buffers, later())
        assert got.status is ReadStatus.FAILED and isinstance(got.error, CorruptBlock) and not got.is_hit
        assert s3.raw_get(path) is None, "the damaged object was deleted"
        assert sample(metrics, "strata_object_corrupt_objects_total") == 1
        [again] = await src.read([k], Buffers(), later())
        assert again.status is ReadStatus.MISS
        assert (await src.write([(k, data, meta)], later()))[0].status is WriteStatus.STORED
        [fixed] = await src.read([k], buffers, later())
        assert fixed.is_hit and bytes(buffers.given[0]) == data
        await src.close()

    run(body)


def test_a_damaged_header_found_by_a_lookup_is_deleted_too(s3, prefix):
    k = key("probed")
    path, _, _, obj = _stored(s3, prefix, k)
    s3.raw_put(path, _damage("header-bit", obj, k, s3, prefix))

    async def body():
        src = source(s3, prefix)
        assert await src.lookup([k], later()) == [None]
        assert s3.raw_get(path) is None
        await src.close()

    run(body)


def test_an_object_of_a_newer_format_is_a_miss_and_is_left_alone(s3, prefix):
    k = key("future")
    path, _, _, obj = _stored(s3, prefix, k)
    obj[4] = VERSION + 1
    s3.raw_put(path, bytes(obj))

    async def body():
        src = source(s3, prefix)
        assert await src.lookup([k], later()) == [None]
        [got] = await src.read([k], Buffers(), later())
        assert got.status is ReadStatus.MISS
        await src.close()

    run(body)
    assert s3.raw_get(path) == bytes(obj), "a newer daemon's object is not ours to delete"


def test_a_block_larger_than_this_daemon_takes_is_a_miss_and_is_left_alone(s3, prefix):
    async def body():
        writer, reader = source(s3, prefix), source(s3, prefix, max_block_bytes=8192)
        data, meta = block(10_000)
        await writer.write([(key("big"), data, meta)], later())
        asked = []
        [got] = await reader.read([key("big")], lambda i, m: asked.append(m), later())
        assert got.status is ReadStatus.MISS and asked == [], "no buffer was asked for"
        [again] = await writer.read([key("big")], Buffers(), later())
        assert again.is_hit, "another daemon's block is not deleted for being large"
        await writer.close()
        await reader.close()

    run(body)
