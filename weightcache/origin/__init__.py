"""Origins: where published model revisions live. A name → constructor registry by URL scheme.

``open_origin("s3://bucket/org/model/rev")``, ``open_origin("/models/llama")``
or ``open_origin("file:///models/llama")``. A new origin (GCS, HTTP) is one
entry in :data:`ORIGINS` and one module implementing
:class:`~weightcache.origin.base.Origin`.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlsplit

from kvstore.errors import InvalidArgument
from weightcache.errors import quoted
from weightcache.origin.base import CATALOG_DIR, Origin
from weightcache.origin.s3 import S3OriginOptions

__all__ = ["CATALOG_DIR", "ORIGINS", "Origin", "S3OriginOptions", "open_origin"]


def _local(location: str, revision: str | None, s3: S3OriginOptions | None) -> Origin:
    from weightcache.origin.local import LocalOrigin

    path = urlsplit(location).path if location.startswith("file://") else location
    return LocalOrigin.open(path, revision)


def _s3(location: str, revision: str | None, s3: S3OriginOptions | None) -> Origin:
    from weightcache.origin.s3 import S3Origin

    return S3Origin(location, s3 or S3OriginOptions(), revision)


# URL scheme → constructor; "" is a plain path.
ORIGINS: dict[str, Callable[[str, str | None, S3OriginOptions | None], Origin]] = {
    "": _local, "file": _local, "s3": _s3,
}


def open_origin(location: str, *, revision: str | None = None, s3: S3OriginOptions | None = None) -> Origin:
    scheme = urlsplit(str(location)).scheme if "://" in str(location) else ""
    try:
        factory = ORIGINS[scheme]
    except KeyError:
        raise InvalidArgument(
            f"model location {quoted(location)}: unknown scheme {quoted(scheme)}; use a path, or one of "
            + ", ".join(f"{s}://" for s in ORIGINS if s)
        ) from None
    return factory(str(location), revision, s3)
