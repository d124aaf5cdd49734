"""Abandoned multipart uploads and Retry-After, against the real moto server and the fault proxy.

A multipart upload killed with its daemon is found by the sweep
(ListMultipartUploads) and aborted once older than its safe age; after the
GC pass, listing the bucket's objects and its uploads in progress under the
prefix shows nothing that is not a live block or a lease. A ``503
SlowDown`` with ``Retry-After: N`` is waited out: the next request the
server sees comes N seconds or more after the refused one (spacing measured
on the proxy's own clock), retries are bounded, and the wait closes the
object client's gate for obstore's requests too.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import boto3
import pytest
from botocore.config import Config

from kvstore.errors import TierUnavailable
from kvstore.remote.object.client import S3Client, S3Options
from kvstore.remote.object.credentials import StaticCredentials
from kvstore.remote.object.layout import KeyLayout
from kvstore.remote.object.lease import SweepLease
from kvstore.remote.object.lifecycle import LifecyclePolicy, Sweeper
from kvstore.remote.object.metrics import ObjectMetrics
from kvstore.remote.object.uploads import PendingUploads, retry_after_seconds
from tests.support import s3_servers
from tests.support.wait import wait_until

CREDS = StaticCredentials(s3_servers.ACCESS_KEY, s3_servers.SECRET_KEY)
HOURS = 3600.0


@pytest.fixture
def prefix(request) -> str:
    return "up-" + hashlib.blake2b(request.node.nodeid.encode(), digest_size=6).hexdigest()


def later(s: float = 30.0) -> float:
    return time.monotonic() + s


def client(endpoint: str, bucket: str, retries: int = 3) -> S3Client:
    return S3Client(S3Options(bucket=bucket, endpoint=endpoint, credentials=CREDS, retries=retries, backoff_s=0.01,
                              max_backoff_s=0.05), ObjectMetrics())


def boto(s3):
    return boto3.client("s3", endpoint_url=s3.endpoint, region_name=s3_servers.REGION,
                        aws_access_key_id=CREDS.access_key_id, aws_secret_access_key=CREDS.secret_access_key,
                        config=Config(s3={"addressing_style": "path"}))


def in_progress(s3, prefix: str) -> list[str]:
    """The names of the multipart uploads in progress under ``prefix``, from the server itself."""
    answer = boto(s3).list_multipart_uploads(Bucket=s3.bucket, Prefix=prefix)
    return [u["Key"] for u in answer.get("Uploads", [])]


def sweeper(c: S3Client, prefix: str, wall, ttl_s: float = 0.0) -> Sweeper:
    layout = KeyLayout(prefix)
    policy = LifecyclePolicy(ttl_s=ttl_s)
    return Sweeper(c, layout, policy, SweepLease(c, layout, "gc", 60.0, wall=wall), wall=wall,
                   uploads=PendingUploads(c, layout, policy.upload_age_s, wall=wall))


def test_a_daemon_killed_mid_multipart_leaves_no_orphan_after_gc(s3, prefix):
    """A real process is SIGKILLed between the parts of a multipart upload; a GC pass an hour later
    aborts it, and the bucket (objects and uploads in progress under the prefix) holds no orphan."""
    proxy = s3.proxy()
    proxy.delay_s = 0.3
    script = textwrap.dedent(f"""
        import asyncio, sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from kvstore.block import BlockKey, BlockMeta, checksum
        from kvstore.remote.object.client import S3Client, S3Options
        from kvstore.remote.object.credentials import StaticCredentials
        from kvstore.remote.object.layout import KeyLayout
        from kvstore.remote.object.source import ObjectLimits, ObjectSource
        c = S3Client(S3Options(bucket={s3.bucket!r}, endpoint={proxy.endpoint!r}, request_s=60,
                               credentials=StaticCredentials({s3_servers.ACCESS_KEY!r}, {s3_servers.SECRET_KEY!r}),
                               part_bytes=5 << 20, parts_in_flight=1))
        src = ObjectSource(c, KeyLayout({prefix!r}), limits=ObjectLimits(multipart_bytes=5 << 20,
                                                                          check_before_put=False))
        data = bytes(16 << 20)
        asyncio.run(src.write([(BlockKey("ns", b"big"), data, BlockMeta(len(data), checksum(data)))],
                              time.monotonic() + 120))
    """)
    child = subprocess.Popen([sys.executable, "-c", script])
    try:
        wait_until(lambda: proxy.count("PUT", "partNumber=") >= 1 or child.poll() is not None,
                   what="the first part of the upload")
        assert child.poll() is None, "the upload ended before it could be killed"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    assert in_progress(s3, prefix + "/") == [f"{prefix}/ns/{b'big'.hex()}"]

    async def gc(wall):
        return await sweeper(client(s3.endpoint, s3.bucket), prefix, wall).sweep_all(later())

    # Seconds old, not an hour: it may be live, it stays (whatever Initiated says: moto's is from 2010).
    [young] = asyncio.run(gc(time.time))
    assert young.swept and young.uploads == 0
    assert in_progress(s3, prefix + "/") != []
    [still] = asyncio.run(gc(lambda: time.time() + HOURS / 2))
    assert still.uploads == 0
    [report] = asyncio.run(gc(lambda: time.time() + 2 * HOURS))
    assert report.swept and report.uploads == 1
    assert in_progress(s3, prefix + "/") == []
    assert [k for k in s3.keys(prefix + "/") if not k.startswith(f"{prefix}/~lease/")] == []


def test_uploads_outside_the_prefix_or_not_named_as_blocks_are_left(s3, prefix):
    api = boto(s3)
    mine = api.create_multipart_upload(Bucket=s3.bucket, Key=f"{prefix}/ns/{b'k'.hex()}")["UploadId"]
    other = api.create_multipart_upload(Bucket=s3.bucket, Key=f"{prefix}-other/ns/{b'k'.hex()}")["UploadId"]
    foreign = api.create_multipart_upload(Bucket=s3.bucket, Key=f"{prefix}/not-a-namespace")["UploadId"]

    async def gc(wall):
        return await sweeper(client(s3.endpoint, s3.bucket), prefix, wall).sweep_all(later())

    assert sum(r.uploads for r in asyncio.run(gc(time.time))) == 0  # first seen now
    assert sum(r.uploads for r in asyncio.run(gc(lambda: time.time() + 2 * HOURS))) == 1
    assert in_progress(s3, prefix + "/") == [f"{prefix}/not-a-namespace"]
    assert in_progress(s3, f"{prefix}-other/") == [f"{prefix}-other/ns/{b'k'.hex()}"]
    for key, upload_id in ((f"{prefix}-other/ns/{b'k'.hex()}", other), (f"{prefix}/not-a-namespace", foreign)):
        api.abort_multipart_upload(Bucket=s3.bucket, Key=key, UploadId=upload_id)
    assert mine


def test_a_slowdown_with_retry_after_is_waited_out_before_the_next_attempt(s3, prefix):
    proxy = s3.proxy()
    proxy.slowdown, proxy.retry_after = 1, "2"

    async def main():
        c = client(proxy.endpoint, s3.bucket)
        uploads = PendingUploads(c, KeyLayout(prefix))

        async def data_path_read():  # obstore's request, sent once the SlowDown closed the gate
            while c.metrics.requests.labels("list_uploads", "SlowDown")._value.get() == 0:
                await asyncio.sleep(0.01)
            return await c.get_range(f"{prefix}/ns/absent", 0, 16, later())

        listed, got = await asyncio.gather(uploads.list(prefix + "/", later()), data_path_read())
        return listed, got, c.metrics

    listed, got, metrics = asyncio.run(main())
    assert listed == [] and got is None
    refused = [t for t, _, _, r in proxy.attempts if r]
    after = [(t, m, p) for t, m, p, r in proxy.attempts if not r]
    assert len(refused) == 1 and len(after) == 2, proxy.attempts
    assert all(t - refused[0] >= 2.0 for t, _, _ in after), (refused, after)  # what the server saw
    assert any("uploads" in p for _, _, p in after) and any(m == "GET" and "absent" in p for _, m, p in after)
    assert metrics.requests.labels("list_uploads", "SlowDown")._value.get() == 1
    assert metrics.retries.labels("list_uploads")._value.get() == 1


def test_retries_are_bounded_and_the_error_names_the_answer(s3, prefix):
    proxy = s3.proxy()
    proxy.slowdown, proxy.retry_after = 100, "0"

    async def main():
        return await PendingUploads(client(proxy.endpoint, s3.bucket, retries=2), KeyLayout(prefix)).list(
            prefix + "/", later())

    with pytest.raises(TierUnavailable, match=r"list_uploads answered SlowDown \(HTTP 503\) after 2 retries"):
        asyncio.run(main())
    assert proxy.refused == 3 and proxy.seen == []


def test_a_retry_after_past_the_deadline_fails_at_once_naming_it(s3, prefix):
    proxy = s3.proxy()
    proxy.slowdown, proxy.retry_after = 1, "120"

    async def main():
        return await PendingUploads(client(proxy.endpoint, s3.bucket), KeyLayout(prefix)).list(prefix + "/", later(5))

    with pytest.raises(TierUnavailable, match=r"Retry-After 120s is past the call's deadline"):
        asyncio.run(main())
    assert proxy.refused == 1


def test_retry_after_is_read_as_seconds_or_an_http_date():
    assert retry_after_seconds("3") == 3.0
    assert retry_after_seconds(None) is None and retry_after_seconds("soon") is None
    now = 1_780_000_000.0
    date = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now + 7))
    assert retry_after_seconds(date, now=now) == pytest.approx(7.0)
    assert retry_after_seconds("99999") == 300.0  # bounded; the deadline bounds it again
