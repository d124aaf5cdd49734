"""Remote sources: tiers on other machines (peers, object storage), and the bridge the store calls.

``open_remote`` builds a source from a URL whose scheme names its kind; a
new kind registers its constructor in ``SOURCES``. The contract is in
:mod:`kvstore.remote.base`.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.errors import InvalidArgument
from kvstore.remote.base import RemoteSource


def _memory(rest: str, **options) -> RemoteSource:
    from kvstore.remote.memory import MemoryRemote

    return MemoryRemote(rest or None, **options)


def _peer(rest: str, **options) -> RemoteSource:
    from kvstore.peer.source import PeerSource

    return PeerSource.from_options(rest, **options)


def _s3(rest: str, **options) -> RemoteSource:
    from kvstore.remote.object import ObjectSource

    return ObjectSource.open(rest, **options)


# URL scheme -> constructor(the part after "scheme://", **options); a new kind registers here.
SOURCES: dict[str, Callable[..., RemoteSource]] = {
    "memory": _memory,
    "peer": _peer,
    "s3": _s3,
}


def open_remote(url: str, **options) -> RemoteSource:
    """A source for ``url``: ``memory://NAME`` (shared in-process), ``memory://`` or ``memory`` (private),
    ``peer://`` (the peer tier: other daemons' blocks, found through the prefix index),
    ``s3://BUCKET/PREFIX`` (the object tier: one object per block in an S3-compatible bucket).

    ``options`` go to the kind's constructor (for memory: capacity_bytes,
    evict, tier, latency_s, bytes_per_s; for peer: see ``PeerSource.from_options``;
    for s3: see ``ObjectSource.open``).
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = url, ""
    try:
        factory = SOURCES[scheme]
    except KeyError:
        raise InvalidArgument(
            f"remote source {url!r}: unknown kind {scheme!r}; use one of "
            + ", ".join(f"{s}://" for s in SOURCES)
        ) from None
    return factory(rest, **options)
