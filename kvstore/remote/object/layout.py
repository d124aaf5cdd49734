"""Where a block lives in a bucket: ``<prefix>/<namespace>/<key name>``.

One object per block, named by what the block is and nothing else (no node,
no time), so every daemon that computes the same block names the same
object: that is what makes conditional create deduplicate across a fleet.

- **The namespace is one path segment.** A namespace may hold ``/`` and
  ``:@+=`` (see :func:`kvstore.block.validate_namespace`); every character
  outside ``[A-Za-z0-9._-]`` is written ``~XX`` (its hex code), which is
  reversible because ``~`` is never in a namespace. So ``org/model`` is
  ``org~2Fmodel``: one segment, never a pseudo-folder that a listing of
  another namespace (``org``) would wander into, and no character that some
  S3-compatible servers or presigned URLs handle specially.
- **The key name is the key's hex** for keys up to 200 bytes (vLLM's 32-byte
  hashes, LMCache's key strings). A longer key (up to the 1024 bytes a key
  may have) would push the name past S3's 1024-byte limit, so it is named
  ``~`` + its BLAKE2b-256 digest; the object's header holds the whole key
  and a read checks it, so a name never answers for another key.
- **No shard folder.** S3 partitions a bucket by key range and splits hot
  ranges on its own, at any character position; the hex of hashed keys is
  uniform right after the namespace, so a shard prefix adds no request-rate
  headroom for them, while keeping ``ls`` of a namespace one listing. A
  layout change is a format change: every daemon sharing a prefix must name
  objects the same way, or they stop finding each other's blocks.

The prefix is configuration: a few ``/``-separated segments of
``[A-Za-z0-9._-]``, so ``ls``, lifecycle rules and IAM policies can be scoped
to it. Objects of other tools under the same prefix are not Strata's: a
listing skips names it cannot parse.
"""

from __future__ import annotations

import hashlib
import re
import string

from kvstore.block import BlockKey
from kvstore.errors import InvalidArgument

MAX_PREFIX_CHARS = 200
MAX_HEX_KEY_BYTES = 200  # longer keys are named by a digest (S3 names are at most 1024 bytes)
_SAFE = frozenset(string.ascii_letters + string.digits + "._-")
_SEGMENT_RE = re.compile(r"^[A-Za-z0-9._-]+$")
_ESCAPE_RE = re.compile(r"~([0-9A-F]{2})")
_HEX_RE = re.compile(r"^(?:[0-9a-f]{2})+$")
_DIGEST_RE = re.compile(r"^~[0-9a-f]{64}$")


def check_prefix(prefix: str) -> str:
    """The prefix without surrounding ``/``; raises InvalidArgument naming the fix."""
    stripped = prefix.strip("/")
    segments = stripped.split("/") if stripped else []
    if len(stripped) > MAX_PREFIX_CHARS or any(not _SEGMENT_RE.match(s) or s in (".", "..") for s in segments):
        raise InvalidArgument(
            f"object prefix {prefix!r}: use at most {MAX_PREFIX_CHARS} characters of '/'-separated segments of "
            "[A-Za-z0-9._-] (no empty, '.' or '..' segment), e.g. 'strata/kv'"
        )
    return stripped


def escape_namespace(namespace: str) -> str:
    return "".join(c if c in _SAFE else f"~{ord(c):02X}" for c in namespace)


def unescape_namespace(segment: str) -> str:
    return _ESCAPE_RE.sub(lambda m: chr(int(m.group(1), 16)), segment)


def key_name(key: bytes) -> str:
    if len(key) <= MAX_HEX_KEY_BYTES:
        return key.hex()
    return "~" + hashlib.blake2b(key, digest_size=32).hexdigest()


class KeyLayout:
    """Names of block objects under one prefix of one bucket."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = check_prefix(prefix)
        self.root = f"{self.prefix}/" if self.prefix else ""

    def path(self, key: BlockKey) -> str:
        return f"{self.root}{escape_namespace(key.namespace)}/{key_name(key.key)}"

    def namespace_root(self, namespace: str) -> str:
        """What every object of ``namespace`` starts with (a listing prefix)."""
        return f"{self.root}{escape_namespace(namespace)}/"

    def parse(self, path: str) -> tuple[str, bytes | None] | None:
        """(namespace, key) of a block object's path; key None when the name is a digest (read the
        header for it); None when the path is not a block object of this layout."""
        if not path.startswith(self.root):
            return None
        segment, sep, name = path[len(self.root):].partition("/")
        if not sep or not segment or "/" in name:
            return None
        namespace = unescape_namespace(segment)
        if escape_namespace(namespace) != segment:  # not a name this layout writes
            return None
        if _HEX_RE.match(name) and len(name) // 2 <= MAX_HEX_KEY_BYTES:
            return namespace, bytes.fromhex(name)
        if _DIGEST_RE.match(name):
            return namespace, None
        return None
