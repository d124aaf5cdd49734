"""S3 (or any S3-compatible store) as an origin, through obstore.

A revision is a prefix: ``s3://bucket/org/model/<revision>/``, its revision
label the last segment unless the publisher names one. obstore's own
retries are turned off (``max_retries=0``): the fetch planner is the one
place that retries, backs off and shrinks its concurrency when S3 answers
``503 SlowDown``, so a throttled bucket sees fewer requests, not a burst of
hidden retries on top of ours.

obstore hands back its own buffer for a ranged GET (no read into a caller's
buffer), so :meth:`read` returns a view of it and ignores ``into``; the
planner hashes and writes from that view without another copy.

Errors are told apart by what obstore reports: ``FileNotFoundError`` is a
file gone since publishing (:class:`ManifestMismatch`); a 503 or an S3
``SlowDown`` code is throttling (:class:`OriginThrottled`); anything else,
including refused connections and other 5xx, is the origin being
unavailable for now (:class:`OriginUnavailable`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlsplit

from kvstore.errors import InvalidArgument
from weightcache.errors import ManifestError, ManifestMismatch, OriginThrottled, OriginUnavailable
from weightcache.origin.base import CATALOG_DIR, Origin

THROTTLE_RETRY_AFTER_S = 1.0
MAX_LIST_FILES = 100_000
_THROTTLED = re.compile(r"\b503\b|SlowDown|\b429\b|TooManyRequests")


@dataclass(frozen=True)
class S3OriginOptions:
    """How to reach the bucket. Credentials left empty are found by obstore the usual AWS way
    (environment, profile, instance role)."""

    endpoint: str | None = None  # http://127.0.0.1:9000 for MinIO or moto; None for AWS
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    allow_http: bool = False
    virtual_hosted_style: bool = False
    request_timeout_s: float = 60.0
    connect_timeout_s: float = 5.0


class S3Origin(Origin):
    def __init__(self, location: str, options: S3OriginOptions, revision: str | None = None) -> None:
        import obstore
        from obstore.store import S3Store

        parts = urlsplit(location)
        if not parts.netloc:
            raise InvalidArgument(f"{location!r}: an S3 location is s3://bucket/prefix/")
        self._obstore = obstore
        self.bucket = parts.netloc
        self.prefix = parts.path.strip("/")
        self.location = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        segments = self.prefix.split("/") if self.prefix else [self.bucket]
        self.default_revision = revision or segments[-1]
        self.default_model = "/".join(segments[:-1]) or self.bucket  # s3://b/acme/tiny/rev1: acme/tiny
        config = {
            k: v
            for k, v in {
                "endpoint": options.endpoint,
                "region": options.region,
                "access_key_id": options.access_key_id,
                "secret_access_key": options.secret_access_key,
                "session_token": options.session_token,
            }.items()
            if v
        }
        self._store = S3Store(
            self.bucket,
            **config,
            virtual_hosted_style_request=options.virtual_hosted_style,
            client_options={
                "allow_http": options.allow_http,
                "timeout": f"{options.request_timeout_s}s",
                "connect_timeout": f"{options.connect_timeout_s}s",
            },
            retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=options.request_timeout_s)},
        )

    def _key(self, path: str) -> str:
        return f"{self.prefix}/{path}" if self.prefix else path

    async def list_files(self, catalog: bool = False) -> list[tuple[str, int]]:
        out = []
        base = f"{self.prefix}/" if self.prefix else ""
        try:
            async for batch in self._obstore.list(self._store, prefix=self.prefix or None):
                for meta in batch:
                    rel = meta["path"][len(base):]
                    if rel and rel.startswith(f"{CATALOG_DIR}/") == catalog:
                        out.append((rel, meta["size"]))
                if len(out) > MAX_LIST_FILES:
                    raise InvalidArgument(f"{self.location}: over {MAX_LIST_FILES} files; is this one model revision?")
        except Exception as err:  # noqa: BLE001 - translated, not swallowed
            raise self._translate(err, "(listing)") from None
        return sorted(out)

    async def read(self, path: str, start: int, length: int, into: memoryview) -> memoryview:
        try:
            data = await self._obstore.get_range_async(self._store, self._key(path), start=start, length=length)
        except Exception as err:  # noqa: BLE001 - translated, not swallowed
            raise self._translate(err, path) from None
        view = memoryview(data)
        if len(view) != length:
            raise ManifestMismatch(
                f"{self.where(path)}: {len(view)} bytes from {start}, but its manifest expects {length}: the object "
                "changed since publishing; publish again (strata weights publish)"
            )
        return view

    async def get(self, path: str, limit: int) -> bytes | None:
        try:
            result = await self._obstore.get_async(self._store, self._key(path))
            if result.meta["size"] > limit:
                raise ManifestError(f"{self.where(path)} is over {limit} bytes")
            return bytes(await result.bytes_async())
        except ManifestError:
            raise
        except FileNotFoundError:
            return None
        except Exception as err:  # noqa: BLE001 - translated, not swallowed
            raise self._translate(err, path) from None

    async def put(self, path: str, data: bytes) -> None:
        try:
            await self._obstore.put_async(self._store, self._key(path), data)
        except Exception as err:  # noqa: BLE001 - translated, not swallowed
            raise self._translate(err, path) from None

    async def close(self) -> None:
        pass

    def _translate(self, err: Exception, path: str) -> Exception:
        where = self.where(path)
        if isinstance(err, FileNotFoundError):
            return ManifestMismatch(f"{where} is gone: the origin no longer holds what its manifest lists; publish again")
        text = str(err).split("\n\nDebug source:", 1)[0]
        if _THROTTLED.search(text):
            return OriginThrottled(f"{where}: the origin is throttling requests ({text[:200]})", THROTTLE_RETRY_AFTER_S)
        return OriginUnavailable(f"{where}: {text[:500]}")
