"""PendingUploads: multipart uploads in progress under the prefix, listed and aborted by the sweep.

A daemon killed in the middle of a multipart upload leaves its parts in S3:
billed, and shown by no object listing. obstore (0.12, over Rust
``object_store``) can abort only an upload it holds and has no request
for a bucket's pending uploads, so this control path speaks S3's
``ListMultipartUploads`` and ``AbortMultipartUpload`` through botocore
(boto3's client), in a worker thread, off the data path.

- **Only abandoned uploads, only ours.** An upload is aborted when its name
  parses as a block of the layout and it is older than ``safe_age_s``
  (default one hour, well past any upload's deadline, so a live upload is
  never cut off), its age counted from the **later** of S3's ``Initiated``
  and the first sweep that saw it (remembered in the namespace's sweep
  lease, so it survives a change of sweeper). Taking the later never
  makes an upload look older than it is: a server whose ``Initiated`` is
  wrong (moto reports a fixed date in 2010) or a sweeper's fast clock
  cannot abort a live upload; the price is at most one sweep interval of
  extra wait. Past the lease's memory (``MAX_UPLOADS_REMEMBERED``) the
  server's ``Initiated`` alone is used. Others are left alone.
- **Retry-After honoured.** botocore's own retries are off; here a
  ``503 SlowDown``, a 429, another 5xx or a dropped connection is sent again
  up to the client's ``retries``, after the server's ``Retry-After`` when it
  gave one (seconds or an HTTP date), else the client's jittered back-off.
  A ``Retry-After`` also closes the object client's slow-down gate
  (:meth:`~kvstore.remote.object.client.S3Client.hold_off`) for that long,
  so every request of the node waits it out, obstore's data path included
  (whose errors carry no headers, see :mod:`kvstore.remote.object.client`).
  A wait the call's deadline cannot afford, or retries spent, is
  ``TierUnavailable`` naming the answer and the wait asked for.
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from botocore import exceptions as bx

from kvstore.errors import InvalidArgument, TierUnavailable
from kvstore.remote.object.client import S3Client
from kvstore.remote.object.layout import KeyLayout
from kvstore.remote.object.lease import MAX_UPLOADS_REMEMBERED

log = logging.getLogger(__name__)
MAX_UPLOADS_LISTED = 100_000  # one sweep looks at no more pending uploads than this
MAX_RETRY_AFTER_S = 300.0  # a longer Retry-After is taken as this (the deadline still bounds it)
_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True, slots=True)
class Upload:
    path: str
    upload_id: str
    initiated: float  # unix seconds, S3's Initiated


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """A ``Retry-After`` header's wait in seconds (delta-seconds or an HTTP date), None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return min(float(value), MAX_RETRY_AFTER_S)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    wait = when.timestamp() - (time.time() if now is None else now)
    return min(max(wait, 0.0), MAX_RETRY_AFTER_S)


def upload_digest(upload_id: str) -> str:
    """A short stable name for an upload id (AWS's are ~100 characters) in the lease."""
    return hashlib.blake2b(upload_id.encode(), digest_size=8).hexdigest()


def _boto_client(client: S3Client):
    import boto3
    from botocore.config import Config

    o = client.options
    session = boto3.session.Session()
    kwargs = {}
    if o.credentials is not None:
        kwargs = {"aws_access_key_id": o.credentials.access_key_id,
                  "aws_secret_access_key": o.credentials.secret_access_key,
                  "aws_session_token": o.credentials.session_token or None}
    config = Config(
        region_name=o.region, connect_timeout=o.connect_s, read_timeout=o.request_s,
        retries={"mode": "standard", "total_max_attempts": 1},  # ours, below: they honour Retry-After
        s3={"addressing_style": "virtual" if o.virtual_hosted else "path"},
    )
    return session.client("s3", endpoint_url=o.endpoint.rstrip("/") or None, config=config, **kwargs)


@dataclass(frozen=True, slots=True)
class _Answer:
    code: str
    status: int | None
    retry_after_s: float | None

    @property
    def retryable(self) -> bool:
        return self.status in _RETRY_STATUS or self.code in ("connection", "timeout")


def _answer(err: Exception) -> _Answer | None:
    """What a failed botocore call says; None when it is not an S3 or transport failure."""
    if isinstance(err, bx.ClientError):
        meta = err.response.get("ResponseMetadata", {})
        headers = {k.lower(): v for k, v in (meta.get("HTTPHeaders") or {}).items()}
        status = meta.get("HTTPStatusCode")
        code = err.response.get("Error", {}).get("Code") or (f"HTTP{status}" if status else "other")
        return _Answer(str(code), status, retry_after_seconds(headers.get("retry-after")))
    if isinstance(err, (bx.ReadTimeoutError, bx.ConnectTimeoutError)):
        return _Answer("timeout", None, None)
    if isinstance(err, (bx.EndpointConnectionError, bx.ConnectionClosedError, bx.HTTPClientError)):
        return _Answer("connection", None, None)
    return None


class PendingUploads:
    """The multipart uploads in progress under a layout's prefix (see the module). One event loop."""

    def __init__(self, client: S3Client, layout: KeyLayout, safe_age_s: float = 3600.0,
                 wall: Callable[[], float] = time.time) -> None:
        if safe_age_s <= 0:
            raise InvalidArgument("abandoned_upload_seconds must be positive (an upload younger is never aborted)")
        self._client, self._layout, self.safe_age_s, self._wall = client, layout, safe_age_s, wall
        self._s3 = None  # made on first use, in the worker thread's first call

    def _api(self):
        if self._s3 is None:
            self._s3 = _boto_client(self._client)
        return self._s3

    async def list(self, prefix: str, deadline: float) -> list[Upload]:
        """Uploads in progress whose object name starts with ``prefix`` (at most MAX_UPLOADS_LISTED)."""
        out: list[Upload] = []
        marker: dict[str, str] = {}
        bucket = self._client.options.bucket
        while len(out) < MAX_UPLOADS_LISTED:
            args = {"Bucket": bucket, "Prefix": prefix, **marker}
            page = await self._call("list_uploads", deadline, lambda a=args: self._api().list_multipart_uploads(**a))
            for u in page.get("Uploads", []):
                out.append(Upload(u["Key"], u["UploadId"], u["Initiated"].timestamp()))
            if not page.get("IsTruncated"):
                break
            marker = {"KeyMarker": page.get("NextKeyMarker", ""), "UploadIdMarker": page.get("NextUploadIdMarker", "")}
        return out[:MAX_UPLOADS_LISTED]

    def abandoned(self, uploads: list[Upload], seen: dict[str, float]) -> tuple[list[Upload], dict[str, float]]:
        """Of ``uploads``, those named as blocks of this layout and older than ``safe_age_s``, and
        when each younger one was first seen (``seen`` as the lease remembered it, updated)."""
        now = self._wall()
        out: list[Upload] = []
        remembered: dict[str, float] = {}
        for u in uploads:
            if self._layout.parse(u.path) is None:
                continue
            d = upload_digest(u.upload_id)
            first = seen.get(d, now if len(remembered) < MAX_UPLOADS_REMEMBERED else u.initiated)
            if now - max(u.initiated, first) > self.safe_age_s:
                out.append(u)
            elif len(remembered) < MAX_UPLOADS_REMEMBERED:
                remembered[d] = first
        return out, remembered

    async def abort(self, upload: Upload, deadline: float) -> bool:
        """Abort one upload, freeing its parts; False when it was gone already (completed or aborted)."""
        bucket = self._client.options.bucket
        try:
            await self._call("abort_upload", deadline, lambda: self._api().abort_multipart_upload(
                Bucket=bucket, Key=upload.path, UploadId=upload.upload_id))
        except _Gone:
            return False
        return True

    async def _call(self, op: str, deadline: float, call: Callable[[], dict]) -> dict:
        o = self._client.options
        tries = 0
        while True:
            await self._client.calm(deadline)
            if time.monotonic() >= deadline:
                raise TierUnavailable(f"{self._client.name}: {op} ran out of its deadline waiting to be sent")
            started = time.monotonic()
            try:
                result = await asyncio.to_thread(call)
            except (bx.ClientError, bx.BotoCoreError) as err:
                answer = _answer(err)
                if answer is None:
                    raise
            else:
                self._client.observe(op, "ok", started)
                return result
            self._client.observe(op, answer.code, started)
            if answer.code == "NoSuchUpload":
                raise _Gone()
            if answer.retry_after_s is not None:
                self._client.hold_off(answer.retry_after_s)  # every request of this node waits it out
            wait = answer.retry_after_s
            if wait is None:
                wait = random.uniform(0, min(o.max_backoff_s, o.backoff_s * 2**tries))
            where = f"{self._client.name}: {op} answered {answer.code}" + (
                f" (HTTP {answer.status})" if answer.status else "")
            if not answer.retryable:
                raise TierUnavailable(f"{where}: check the credentials, the bucket and its policy")
            if tries >= o.retries:
                raise TierUnavailable(f"{where} after {tries} retries; the next sweep tries again")
            if time.monotonic() + wait >= deadline:
                asked = f"Retry-After {answer.retry_after_s:g}s" if answer.retry_after_s is not None else "back-off"
                raise TierUnavailable(f"{where}; its {asked} is past the call's deadline; the next sweep tries again")
            tries += 1
            self._client.metrics.retries.labels(op).inc()
            log.info("%s; retrying in %.2fs (%d of %d)", where, wait, tries, o.retries)
            await asyncio.sleep(wait)


class _Gone(Exception):
    pass
