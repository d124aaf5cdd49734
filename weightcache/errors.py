"""Errors raised by the weight pipeline (manifests, the node cache, the fetch planner, the reader).

One tree, rooted in Strata's own (:mod:`kvstore.errors`), so each class
already stands for one status code when it crosses a boundary: bad input
INVALID_ARGUMENT, full RESOURCE_EXHAUSTED, bytes that are not the published
ones DATA_LOSS, an origin that cannot be reached UNAVAILABLE. Every message
names the file, the chunk or the tensor, and what to do.

    StrataError                                   (kvstore.errors)
    ├── InvalidArgument
    │   ├── HeaderError          a safetensors header that is truncated, not JSON, or breaks the
    │   │                        format (offsets overlapping or past the file, unknown dtype)
    │   ├── ManifestError        a manifest that does not parse or breaks its limits
    │   └── NotPublished         no manifest at the location (run ``strata weights publish``)
    ├── CorruptBlock             (DATA_LOSS)
    │   └── ManifestMismatch     the bytes are not the ones the manifest describes
    │       └── CorruptChunk     a chunk failed its digest from every source, every try
    ├── ResourceExhausted
    │   ├── TierFull
    │   │   ├── CacheFull        the node cache cannot hold the files even after evicting
    │   │   │                    every model not in use
    │   │   └── DiskFull         the cache's filesystem is full      (kvstore.errors)
    │   └── OriginThrottled      the origin asked to slow down (S3 503 SlowDown); the
    │                            planner backs off and retries, so callers rarely see it
    └── TierUnavailable
        └── OriginUnavailable    the origin cannot be reached, or a file is gone from it

``DiskFull`` is kvstore's own class: a full disk is a full disk, whichever
package found it. A class here is defined here and nowhere else; the test
``tests/weightcache/test_weights_errors.py`` checks this docstring against the classes.

A message quotes bad input through :func:`quoted`: a digest or a location
comes from the caller and may be any length, and a message as long as its
input is no help to a reader and too big for a gRPC status's metadata.
"""

from __future__ import annotations

from kvstore.errors import CorruptBlock, InvalidArgument, ResourceExhausted, TierFull, TierUnavailable

__all__ = [
    "CacheFull",
    "CorruptChunk",
    "HeaderError",
    "ManifestError",
    "ManifestMismatch",
    "NotPublished",
    "OriginThrottled",
    "OriginUnavailable",
]

QUOTED_CHARS = 64  # of a bad input an error message quotes; the rest is counted


class HeaderError(InvalidArgument):
    pass


class ManifestError(InvalidArgument):
    pass


class NotPublished(InvalidArgument):
    pass


class ManifestMismatch(CorruptBlock):
    pass


class CorruptChunk(ManifestMismatch):
    pass


class CacheFull(TierFull):
    pass


class OriginThrottled(ResourceExhausted):
    pass


class OriginUnavailable(TierUnavailable):
    pass


def quoted(value: object, limit: int = QUOTED_CHARS) -> str:
    """``value`` as an error message quotes it: its repr, or when that is longer than ``limit``
    characters, the head of it and its length (``'xxxx…' (20000 chars)``)."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return repr(value)
    head = repr(text[:limit]) if isinstance(value, str) else text[:limit]
    return f"{head}… ({len(text)} chars)"
