"""The contract of an origin: where a published model revision's files live.

An origin is the source of truth for a revision's bytes (an S3 prefix, a
local directory) and the place its manifests are stored beside the files
(:mod:`weightcache.catalog`). It is read by byte range and is slow, far and
fallible, which shapes the interface:

``list_files(catalog=False) -> list[(path, size)]``
    Every file of the revision, by path relative to its root, sorted,
    leaving out the catalog folder (:data:`CATALOG_DIR`): what publish
    chunks. With ``catalog=True``, only the files inside that folder.
``read(path, start, length, into) -> memoryview``
    Exactly ``length`` bytes of ``path`` from ``start``. An origin that can
    read into a buffer fills ``into`` (a reused one: reading into fresh
    memory is several times slower) and returns a view of it; one whose
    client hands back its own buffer (obstore) returns a view of that.
    Fewer bytes than asked (the file shrank), or a file that is gone, raise
    :class:`~weightcache.errors.ManifestMismatch`: the origin no longer holds
    what was published.
``get(path, limit) -> bytes | None``
    A small whole file (a manifest, the ``latest`` pointer): ``None`` when
    absent, :class:`~weightcache.errors.ManifestError` when over ``limit``.
``put(path, data)``
    Store a small file, visible whole or not at all.
``close()``
    Release clients and threads. Idempotent.

Errors. A call that could not be served raises one of::

    OriginThrottled      the origin asked to slow down (S3 503 SlowDown): back off, retry
    OriginUnavailable    it cannot be reached or failed this request (5xx, connection): retry later
    ManifestMismatch     the file is missing or shorter than asked: retrying will not help

Retrying is the caller's job (the fetch planner backs off, shrinks its
concurrency and counts tries), so implementations do not retry themselves:
two layers of retries multiply a throttled origin's load instead of
relieving it.

Every method is a coroutine run on one event loop; blocking I/O goes to a
thread. Implementations register by URL scheme in :mod:`weightcache.origin`
and pass ``tests/weightcache/test_weights_origin.py``: the local directory (in-process,
what tests and single hosts use) and S3 through obstore.
"""

from __future__ import annotations

import abc

CATALOG_DIR = ".strata"


class Origin(abc.ABC):
    location: str  # for messages: "s3://bucket/prefix", "/models/llama"
    default_model: str  # what a manifest is labelled when the publisher names none
    default_revision: str

    @abc.abstractmethod
    async def list_files(self, catalog: bool = False) -> list[tuple[str, int]]: ...

    @abc.abstractmethod
    async def read(self, path: str, start: int, length: int, into: memoryview) -> memoryview: ...

    @abc.abstractmethod
    async def get(self, path: str, limit: int) -> bytes | None: ...

    @abc.abstractmethod
    async def put(self, path: str, data: bytes) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    def where(self, path: str) -> str:
        return f"{self.location.rstrip('/')}/{path}"
