"""S3Client: the object tier's requests to an S3-compatible endpoint, over obstore.

obstore (Rust ``object_store`` under Python) is the data path: about 3-4x
boto3's throughput, multipart uploads, conditional create (``If-None-Match:
*``: ``mode="create"``). What this module adds around it:

- **Its own retries, within the caller's deadline.** obstore's retries are
  off (``max_retries=0``): it would retry on its own clock, past a call's
  deadline. Here a request answered 5xx, 429, 409 (a conditional write in
  flight) or not answered at all is sent again after an exponential
  back-off with full jitter (``backoff_s`` doubling up to ``max_backoff_s``,
  at most ``retries`` times), never sleeping past the deadline.
- **Slowing down together.** A ``503 SlowDown`` (or 429) closes a gate for
  every request of this client for the back-off, so one node stops
  hammering a prefix S3 is re-partitioning instead of each request backing
  off alone; the gate's wait doubles with every SlowDown in a row and
  resets on the first success. obstore 0.12 (``object_store`` 0.14) turns
  a failed response into its status and body, without headers, so a
  server's ``Retry-After`` cannot be read here; the control path of
  :mod:`~kvstore.remote.object.uploads` (botocore) reads it and closes this
  gate for that long (:meth:`S3Client.hold_off`). AWS S3 sends none with
  SlowDown.
- **Bounded concurrency.** At most ``max_requests`` requests at once (a
  streamed GET holds its turn until its body is read).
- **Answers are not errors.** A missing object is ``None``; a conditional
  create that found the object is ``False``. Errors cross into Strata's
  tree: ``TierUnavailable`` (unreachable, 5xx after the retries, access
  denied, a missing bucket, with the fix), ``InvalidArgument`` (a path or a
  request S3 refuses as malformed). Because a HEAD answer has no body, a
  missing bucket would look like a missing key there: this client never
  uses HEAD, only GETs (a ranged one for metadata), whose errors say which.
- **Metrics** by op and S3 error code, per attempt.

A client is used from one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta

import obstore
import obstore.exceptions as obx
from obstore.store import S3Store

from kvstore.errors import InvalidArgument, TierUnavailable
from kvstore.remote.object.credentials import StaticCredentials
from kvstore.remote.object.metrics import ObjectMetrics, code_label

READ_CHUNK_BYTES = 1 << 20  # a streamed GET hands over at least this much at a time
_STATUS_RE = re.compile(r"status code: (\d{3})")
_CODE_RE = re.compile(r"<Code>([A-Za-z]+)</Code>")
_HTTP_KIND_RE = re.compile(r"HttpError \{\s*kind: (\w+)")  # object_store's transport failure kinds
_RETRY_STATUS = frozenset({409, 429, 500, 502, 503, 504})
_SLOW_STATUS = frozenset({429, 503})


@dataclass(frozen=True)
class S3Options:
    """How to reach the bucket; built once from ``[tiers.object]`` (see kvstore.config.tiers)."""

    bucket: str
    endpoint: str = ""  # "" = AWS's endpoint for the region; http://... allows plain HTTP (MinIO, moto)
    region: str = "us-east-1"
    virtual_hosted: bool = False  # bucket.host/key instead of host/bucket/key
    credentials: StaticCredentials | None = field(default=None, repr=False)  # None: obstore's chain
    request_s: float = 10.0  # one request, answer and body
    connect_s: float = 2.0
    max_requests: int = 32
    retries: int = 4
    backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    part_bytes: int = 8 << 20  # multipart uploads: bytes per part
    parts_in_flight: int = 4  # multipart uploads: parts sent at once, per upload

    def __post_init__(self) -> None:
        if not self.bucket or not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", self.bucket):
            raise InvalidArgument(
                f"object bucket {self.bucket!r} is not an S3 bucket name: 3-63 characters of [a-z0-9.-], "
                "starting and ending with a letter or digit (set [tiers.object] bucket)"
            )
        if self.endpoint and not re.match(r"^https?://[^/\s]+/?$", self.endpoint):
            raise InvalidArgument(
                f"object endpoint {self.endpoint!r}: give scheme and host only, e.g. https://s3.us-east-1.amazonaws.com "
                "or http://minio:9000"
            )
        if self.max_requests < 1 or self.retries < 0 or self.parts_in_flight < 1:
            raise InvalidArgument("object client: max_requests and parts_in_flight must be >= 1, retries >= 0")
        if min(self.request_s, self.connect_s, self.backoff_s, self.max_backoff_s) <= 0:
            raise InvalidArgument("object client: request, connect and back-off seconds must be positive")
        if self.part_bytes < 5 << 20:
            raise InvalidArgument(f"object part size {self.part_bytes} is under S3's minimum part of 5MiB")


@dataclass(frozen=True, slots=True)
class Failure:
    """What one failed attempt says: S3's code (or a transport outcome), and what to do next."""

    code: str
    status: int | None
    retryable: bool
    slow_down: bool


def classify(err: BaseException) -> Failure:
    text = str(err)
    status_match, code_match = _STATUS_RE.search(text), _CODE_RE.search(text)
    status = int(status_match.group(1)) if status_match else None
    if isinstance(err, (FileNotFoundError, obx.NotFoundError)):
        code = code_match.group(1) if code_match else "NoSuchKey"
        return Failure(code, 404, False, False)
    if code_match and code_match.group(1) == "ConditionalRequestConflict":  # a delete raced the create: again
        return Failure("ConditionalRequestConflict", 409, True, False)
    if isinstance(err, (obx.AlreadyExistsError, obx.PreconditionError)):
        return Failure("PreconditionFailed", 412, False, False)
    if isinstance(err, (obx.PermissionDeniedError, obx.UnauthenticatedError)):
        return Failure(code_match.group(1) if code_match else "AccessDenied", status, False, False)
    if status is not None:
        code = code_match.group(1) if code_match else f"HTTP{status}"
        return Failure(code, status, status in _RETRY_STATUS, status in _SLOW_STATUS)
    kind = _HTTP_KIND_RE.search(text)
    if (kind is not None and kind.group(1) == "Timeout") or "timed out" in text.lower():
        return Failure("timeout", None, True, False)
    return Failure("connection", None, True, False)


class _Missing:
    pass


MISSING = _Missing()


class S3Client:
    def __init__(self, options: S3Options, metrics: ObjectMetrics | None = None) -> None:
        self.options = options
        self.metrics = metrics or ObjectMetrics()
        self.name = f"s3://{options.bucket}"
        config: dict = {"region": options.region, "virtual_hosted_style_request": options.virtual_hosted}
        if options.endpoint:
            config["endpoint"] = options.endpoint.rstrip("/")
        if options.credentials is not None:
            config.update(options.credentials.obstore_config())
        client = {
            "timeout": timedelta(seconds=options.request_s), "connect_timeout": timedelta(seconds=options.connect_s),
            "allow_http": options.endpoint.startswith("http://"),
        }
        try:
            self.store = S3Store(options.bucket, client_options=client, retry_config={"max_retries": 0}, **config)
        except obx.BaseError as err:
            raise InvalidArgument(f"object store for {self.name} cannot be configured: {_first_line(err)}") from None
        self._turns = asyncio.Semaphore(options.max_requests)
        self._calm_until = 0.0  # the slow-down gate: no request starts before this (monotonic)
        self._slow_streak = 0

    # Requests. Each takes the caller's deadline (time.monotonic()).

    async def get_range(self, path: str, start: int, end: int, deadline: float, op: str = "probe") -> bytes | None:
        """Bytes [start, end) of an object (fewer if it is shorter), or None when it does not exist."""
        got = await self.get_range_sized(path, start, end, deadline, op)
        return None if got is None else got[0]

    async def get_range_sized(self, path: str, start: int, end: int, deadline: float,
                              op: str = "probe") -> tuple[bytes, int] | None:
        """Bytes [start, end) of an object (fewer if it is shorter) and the object's whole length (the
        total of S3's ``Content-Range``, from the same answer), or None when it does not exist."""
        async def attempt():
            result = await obstore.get_async(self.store, path, options={"range": (start, end)})
            return bytes(await result.bytes_async()), int(result.meta["size"])

        async with self._turns:
            got = await self._retried(op, deadline, attempt)
        if got is MISSING:
            return None
        if isinstance(got, bytes):  # a range of an empty object (416): no bytes at all
            return got, 0
        self.metrics.bytes.labels("received").inc(len(got[0]))
        return got

    @contextlib.asynccontextmanager
    async def reading(self, path: str, deadline: float) -> AsyncIterator[_Body | None]:
        """``async with client.reading(path, deadline) as body``: the object's size and chunks, or None
        when it does not exist. The request's turn is held until the block is left."""
        async with self._turns:
            result = await self._retried("get", deadline, lambda: obstore.get_async(self.store, path))
            yield None if result is MISSING else _Body(self, result)

    async def put(self, path: str, data: bytearray, deadline: float, *, create: bool) -> bool:
        """Store an object. ``create``: only if absent (one conditional PUT; False when it existed);
        otherwise a multipart upload in ``part_bytes`` parts that replaces any object there."""
        opts = self.options
        if create:
            op, call = "put", lambda: obstore.put_async(self.store, path, data, mode="create")
        else:
            op, call = "put_multipart", lambda: obstore.put_async(
                self.store, path, data, use_multipart=True, chunk_size=opts.part_bytes,
                max_concurrency=opts.parts_in_flight,
            )
        async with self._turns:
            done = await self._retried(op, deadline, call)
        if done is MISSING:  # the bucket itself answered NoSuchKey for a PUT: it is not there
            raise TierUnavailable(f"{self.name}: PUT answered not found: does the bucket exist?")
        if done is False:
            return False
        self.metrics.bytes.labels("sent").inc(len(data))
        return True

    async def get_small(self, path: str, deadline: float, limit: int = 64 << 10) -> tuple[bytes, str] | None:
        """A small control object (a lease) and its ETag, or None when absent; longer than ``limit``
        is InvalidArgument (it is not one of ours)."""
        async def attempt():
            result = await obstore.get_async(self.store, path)
            if result.meta["size"] > limit:
                raise InvalidArgument(f"{self.name}: {path} is {result.meta['size']} bytes, not a control object")
            return bytes(await result.bytes_async()), result.meta.get("e_tag") or ""

        async with self._turns:
            got = await self._retried("lease", deadline, attempt)
        return None if got is MISSING else got

    async def put_control(self, path: str, data: bytes, deadline: float, *, etag: str | None = None,
                          overwrite: bool = False) -> str | None:
        """Write a small control object (a lease, a read marker) in one PUT: ``overwrite``, or only if
        absent (``etag`` None: If-None-Match), or only if still the version ``etag`` names (If-Match).
        Its new ETag, or None when the condition failed (another writer won)."""
        mode = "overwrite" if overwrite else "create" if etag is None else {"e_tag": etag}
        async with self._turns:
            done = await self._retried("lease", deadline, lambda: obstore.put_async(self.store, path, data, mode=mode))
        if done is False or done is MISSING:
            return None
        return done.get("e_tag") or ""

    async def list_segments(self, prefix: str, deadline: float, limit: int = 100_000) -> list[str]:
        """The next path segments under ``prefix`` (a listing with delimiter ``/``), at most ``limit``."""
        async with self._turns:
            got = await self._retried(
                "list", deadline, lambda: obstore.list_with_delimiter_async(self.store, prefix=prefix or None)
            )
        if got is MISSING:
            return []
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in got["common_prefixes"][:limit]]

    async def delete(self, paths: list[str], deadline: float) -> None:
        """Remove objects (absent ones are no error)."""
        if paths:
            async with self._turns:
                await self._retried("delete", deadline, lambda: obstore.delete_async(self.store, paths))

    async def list(self, prefix: str, deadline: float) -> AsyncIterator[list[dict]]:
        """Pages of ObjectMeta dicts (path, size, last_modified, e_tag) under ``prefix``."""
        stream = obstore.list(self.store, prefix=prefix, chunk_size=1000)
        while True:
            async with self._turns:
                page = await self._retried("list", deadline, lambda: _next_page(stream))
            if page is None or page is MISSING:
                return
            yield page

    # Retries, the slow-down gate, errors.

    async def _retried(self, op: str, deadline: float, attempt: Callable[[], Awaitable]):
        tries = 0
        while True:
            await self._calm(deadline)
            started = time.monotonic()
            try:
                result = await attempt()
            except obx.BaseError as err:
                failure = classify(err)
            except (FileNotFoundError, ConnectionError, TimeoutError) as err:  # obstore maps some to builtins
                failure = classify(err)
            else:
                self._observe(op, "ok", started)
                self._slow_streak = 0
                return result
            self._observe(op, failure.code, started)
            if failure.status == 404 and failure.code in ("NoSuchKey", "HTTP404"):
                return MISSING
            if failure.code == "PreconditionFailed" and op in ("put", "lease"):
                return False
            if failure.status == 416 and op == "probe":  # a range of an empty object: it has no bytes
                return b""
            delay = self._backoff(tries, failure)
            if not failure.retryable or tries >= self.options.retries or time.monotonic() + delay >= deadline:
                raise self._error(op, failure, tries)
            tries += 1
            self.metrics.retries.labels(op).inc()
            await asyncio.sleep(delay)

    def _backoff(self, tries: int, failure: Failure) -> float:
        o = self.options
        delay = random.uniform(0, min(o.max_backoff_s, o.backoff_s * 2**tries))
        if failure.slow_down:
            self._slow_streak += 1
            gate = min(o.max_backoff_s, o.backoff_s * 2 ** self._slow_streak)
            self._calm_until = max(self._calm_until, time.monotonic() + gate)
            delay = max(delay, gate)
        return delay

    def hold_off(self, seconds: float) -> None:
        """Close the slow-down gate for at least ``seconds`` (a server's ``Retry-After``, read where a
        request's headers can be seen: the control path of :mod:`~kvstore.remote.object.uploads`)."""
        self._calm_until = max(self._calm_until, time.monotonic() + seconds)

    async def calm(self, deadline: float) -> None:
        """Wait for the slow-down gate to open (never past ``deadline``)."""
        await self._calm(deadline)

    def observe(self, op: str, code: str, started: float) -> None:
        """Count one attempt of ``op`` answered ``code`` (a request sent outside this client)."""
        self._observe(op, code, started)

    async def _calm(self, deadline: float) -> None:
        wait = self._calm_until - time.monotonic()
        if wait > 0:
            await asyncio.sleep(min(wait, max(0.0, deadline - time.monotonic())))

    def _observe(self, op: str, code: str, started: float) -> None:
        self.metrics.requests.labels(op, code_label(code)).inc()
        self.metrics.seconds.labels(op).observe(time.monotonic() - started)

    def _error(self, op: str, failure: Failure, tries: int) -> TierUnavailable | InvalidArgument:
        if failure.code in ("connection", "timeout"):
            where = f"{self.name}: {op} got no answer ({'timed out' if failure.code == 'timeout' else 'connection failed'})"
        else:
            where = f"{self.name}: {op} answered {failure.code}" + (f" (HTTP {failure.status})" if failure.status else "")
        if failure.code == "NoSuchBucket":
            return TierUnavailable(f"{where}: create the bucket or fix [tiers.object] bucket")
        if failure.code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken") or (
            failure.status in (401, 403)
        ):
            return TierUnavailable(
                f"{where}: check the credentials (AWS_* variables, the credentials file, or the role) and the "
                "bucket policy"
            )
        if failure.status is not None and 400 <= failure.status < 500 and not failure.retryable:
            return InvalidArgument(f"{where}: the request was refused as invalid")
        again = f" after {tries} retries" if tries else ""
        return TierUnavailable(f"{where}{again}; local tiers keep serving")


class _Body:
    """A streamed GET's answer: its size and its chunks (errors mid-body are TierUnavailable)."""

    def __init__(self, client: S3Client, result) -> None:
        self._client = client
        self._result = result
        self.size: int = result.meta["size"]

    async def whole(self):
        """The whole body in one buffer (obstore's, read-only; no copy): one wake-up of this loop
        instead of one per chunk."""
        try:
            data = await self._result.bytes_async()
        except obx.BaseError as err:
            failure = classify(err)
            self._client._observe("get", failure.code, time.monotonic())
            raise TierUnavailable(f"{self._client.name}: a read broke off mid-object ({failure.code})") from None
        self._client.metrics.bytes.labels("received").inc(len(data))
        return data

    async def chunks(self) -> AsyncIterator[bytes]:
        stream = self._result.stream(min_chunk_size=READ_CHUNK_BYTES)
        while True:
            try:
                chunk = await stream.__anext__()
            except StopAsyncIteration:
                return
            except obx.BaseError as err:
                failure = classify(err)
                self._client._observe("get", failure.code, time.monotonic())
                raise TierUnavailable(f"{self._client.name}: a read broke off mid-object ({failure.code})") from None
            self._client.metrics.bytes.labels("received").inc(len(chunk))
            yield chunk


async def _next_page(stream) -> list[dict] | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0][:300] if str(err) else type(err).__name__
