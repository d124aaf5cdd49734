"""The prefix index: block keys (vLLM-aligned), the index contract and its backends,
vLLM KV-event ingestion, and the daemon's agent."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlsplit

from kvstore.errors import InvalidArgument
from kvstore.index.base import PrefixIndex
from kvstore.index.redis_url import redact


def _memory(url: str) -> PrefixIndex:
    from kvstore.index.memory import MemoryIndex

    return MemoryIndex()


def _redis(url: str) -> PrefixIndex:
    from kvstore.index.redis import RedisIndex

    return RedisIndex.from_url(url)


# URL scheme → constructor; a new backend registers here.
BACKENDS: dict[str, Callable[[str], PrefixIndex]] = {
    "memory": _memory,
    "redis": _redis,
    "rediss": _redis,
    "redis+cluster": _redis,
    "rediss+cluster": _redis,
    "unix": _redis,
}


def open_index(url: str) -> PrefixIndex:
    try:
        scheme = urlsplit(url).scheme
    except ValueError as err:
        raise InvalidArgument(f"prefix index URL {redact(url)!r} is not a URL ({err})") from None
    try:
        factory = BACKENDS[scheme]
    except KeyError:
        raise InvalidArgument(
            f"prefix index URL {redact(url)!r}: unknown scheme {scheme!r}; use one of "
            + ", ".join(f"{s}://" for s in BACKENDS)
        ) from None
    return factory(url)
