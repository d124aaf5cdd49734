"""Block identity, metadata and checksums.

A block is immutable bytes addressed by ``(namespace, key)``. The namespace is
the isolation boundary (a tenant, a model): nothing in one namespace can see,
confirm or time a block of another. Keys are opaque bytes; the prefix index
derives them from token ids, the LMCache plugin from its cache keys.

Every block carries an xxh3-64 checksum of its payload, computed once by the
writer and verified whenever the bytes cross a tier or a process boundary.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

import xxhash

from kvstore.errors import InvalidKey, InvalidNamespace

MAX_KEY_BYTES = 1024
MAX_NAMESPACE_CHARS = 128
MAX_LAYOUT_CHARS = 1024
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+=-]*$")


class TierName(enum.IntEnum):
    """Where a block lives; the values match ``strata.kv.v1.Tier``."""

    GPU = 1
    HOST = 2
    DISK = 3
    PEER = 4
    OBJECT = 5

    @property
    def label(self) -> str:
        return self.name.lower()


def validate_namespace(namespace: str) -> str:
    if not isinstance(namespace, str):
        raise InvalidNamespace(f"namespace must be a string, not {type(namespace).__name__}")
    if not namespace:
        raise InvalidNamespace("namespace is empty: pass a model or tenant name such as 'llama-3-8b'")
    if len(namespace) > MAX_NAMESPACE_CHARS:
        raise InvalidNamespace(
            f"namespace is {len(namespace)} characters; the limit is {MAX_NAMESPACE_CHARS}"
        )
    if not _NAMESPACE_RE.match(namespace):
        raise InvalidNamespace(
            f"namespace {namespace!r} has characters outside [A-Za-z0-9._:/@+=-] "
            "or does not start with a letter or digit"
        )
    return namespace


def validate_key(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray)):
        raise InvalidKey(f"key must be bytes, not {type(key).__name__}")
    if not key:
        raise InvalidKey("key is empty: every block needs a non-empty key")
    if len(key) > MAX_KEY_BYTES:
        raise InvalidKey(f"key is {len(key)} bytes; the limit is {MAX_KEY_BYTES}: hash long keys first")
    return bytes(key)


@dataclass(frozen=True, slots=True)
class BlockKey:
    namespace: str
    key: bytes

    @classmethod
    def checked(cls, namespace: str, key: bytes) -> BlockKey:
        return cls(validate_namespace(namespace), validate_key(key))

    def __str__(self) -> str:
        return f"{self.namespace}/{self.key.hex()[:16]}"


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What travels with a block through every tier."""

    size: int
    checksum: int
    parent: bytes | None = None  # key of the previous block of a prefix chain
    layout: str = ""  # free-form tag the writer uses to rebuild the value (shape, dtype)


def checksum(data: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


class Checksummer:
    """Incremental xxh3-64, for bytes that arrive in chunks."""

    __slots__ = ("_h",)

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, chunk: bytes | bytearray | memoryview) -> None:
        self._h.update(chunk)

    def value(self) -> int:
        return self._h.intdigest()


# A copy's pieces: small enough that a piece just copied is still in the last-level cache when it
# is hashed, large enough for memcpy's fastest path. In an isolated test on the AMD EPYC hosts this
# was measured on (64 MiB of 2 MiB blocks out of a tmpfs mapping into heap buffers), 256 KiB pieces
# took 25.7 ms and 1 MiB pieces 10.1 ms, against 8.2 ms for the bare copy; in the node benchmark's
# reads and writes the two sizes differ by less than its run-to-run noise.
COPY_CHUNK = 1 << 20


def copy_and_checksum(dst: memoryview, src: bytes | bytearray | memoryview) -> int:
    """Copy ``src`` into ``dst`` and return its checksum in one cache-friendly pass.

    Hashing each chunk right after copying it reads the chunk from cache rather
    than from memory, so the checksum costs much less than a second full pass.
    """
    src = memoryview(src).cast("B")
    try:
        n = len(src)
        h = xxhash.xxh3_64()
        for off in range(0, n, COPY_CHUNK):
            end = min(off + COPY_CHUNK, n)
            dst[off:end] = src[off:end]
            h.update(dst[off:end])
        return h.intdigest()
    finally:
        src.release()
