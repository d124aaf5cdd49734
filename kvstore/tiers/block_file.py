"""The disk tier's block file: a self-describing, self-checking header, then the payload.

One file per block. The header carries the full namespace and key (so a
128-bit name collision is detected on read and answered as a miss, never with
another key's bytes), the block's metadata, the payload's xxh3-64 and its own
xxh3-64 in its last 8 bytes::

    magic "STRATABK" | version u16 | flags u16 | header length u32 | payload size u64 | payload xxh3 u64
    namespace, key, parent, layout      each a u16 length then bytes
    header xxh3-64 u64                  of everything above

A file's name is :func:`block_name` of its key. Nothing here does I/O beyond
reading a header from an open file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from kvstore.block import BlockKey, BlockMeta
from kvstore.errors import InvalidArgument

MAGIC = b"STRATABK"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<8sHHIQQ")  # magic, version, flags, header length, payload size, payload xxh3
_LEN = struct.Struct("<H")
_HEADER_SUM = struct.Struct("<Q")
_HAS_PARENT = 1
_MAX_FIELD = 0xFFFF
_MAX_HEADER = _FIXED.size + 4 * (_LEN.size + _MAX_FIELD) + _HEADER_SUM.size


class BadHeader(ValueError):
    """A block file whose header cannot be trusted."""


@dataclass(frozen=True, slots=True)
class BlockHeader:
    key: BlockKey
    meta: BlockMeta
    length: int  # bytes before the payload
    checksum: int  # the header's own xxh3-64, its last 8 bytes


def block_name(key: BlockKey) -> str:
    """The file name of a block: hex xxh3-128 of namespace and key.

    Namespaces cannot contain NUL, so ``namespace NUL key`` is unambiguous.
    """
    return xxhash.xxh3_128_hexdigest(key.namespace.encode() + b"\0" + key.key)


def header_checksum(header: bytes | bytearray) -> int:
    """The checksum a whole header carries in its last 8 bytes (not verified)."""
    (stored,) = _HEADER_SUM.unpack_from(header, len(header) - _HEADER_SUM.size)
    return stored


def header_matches(header: bytes | bytearray, checksum: int) -> bool:
    """Whether ``header`` (exactly one header's bytes) carries ``checksum`` and its bytes agree with it."""
    return header_checksum(header) == checksum and xxhash.xxh3_64_intdigest(header[: -_HEADER_SUM.size]) == checksum


def encode_header(key: BlockKey, meta: BlockMeta) -> bytes:
    """Fixed fields, then namespace, key, parent and layout (u16 length each), then xxh3-64 of all that."""
    fields = [key.namespace.encode(), key.key, meta.parent or b"", meta.layout.encode()]
    for field in fields:
        if len(field) > _MAX_FIELD:
            raise InvalidArgument(
                f"{key}: a header field is {len(field)} bytes; the disk format allows {_MAX_FIELD}"
            )
    body = b"".join(_LEN.pack(len(f)) + f for f in fields)
    length = _FIXED.size + len(body) + _HEADER_SUM.size
    flags = _HAS_PARENT if meta.parent is not None else 0
    head = _FIXED.pack(MAGIC, FORMAT_VERSION, flags, length, meta.size, meta.checksum) + body
    return head + _HEADER_SUM.pack(xxhash.xxh3_64_intdigest(head))


def decode_header(data: bytes | bytearray) -> BlockHeader:
    """Parse and verify the header at the start of ``data``; raise BadHeader.

    ``data`` may run past the header (into the payload): the header's own
    length field says where it ends.
    """
    if len(data) < _FIXED.size:
        raise BadHeader("file shorter than a header")
    magic, version, flags, length, size, payload_sum = _FIXED.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise BadHeader(f"not a version-{FORMAT_VERSION} block file")
    if not _FIXED.size + 4 * _LEN.size + _HEADER_SUM.size <= length <= _MAX_HEADER:
        raise BadHeader(f"header length {length} out of range")
    if len(data) < length:
        raise BadHeader("file ends inside the header")
    head = bytes(data[: length - _HEADER_SUM.size])
    (stored_sum,) = _HEADER_SUM.unpack_from(data, length - _HEADER_SUM.size)
    if xxhash.xxh3_64_intdigest(head) != stored_sum:
        raise BadHeader("header checksum mismatch")
    fields, pos = [], _FIXED.size
    for _ in range(4):
        if pos + _LEN.size > len(head):
            raise BadHeader("header fields run past its length")
        (n,) = _LEN.unpack_from(head, pos)
        fields.append(head[pos + _LEN.size : pos + _LEN.size + n])
        pos += _LEN.size + n
    if pos != len(head):
        raise BadHeader("header fields do not add up to its length")
    namespace, key, parent, layout = fields
    try:
        meta = BlockMeta(size, payload_sum, parent if flags & _HAS_PARENT else None, layout.decode())
        return BlockHeader(BlockKey(namespace.decode(), key), meta, length, stored_sum)
    except UnicodeDecodeError as e:
        raise BadHeader(f"header text is not UTF-8: {e}") from None


def read_header(f) -> BlockHeader:
    """Read and verify the header at the start of the binary file ``f``; raise BadHeader."""
    fixed = f.read(_FIXED.size)
    if len(fixed) < _FIXED.size:
        raise BadHeader("file shorter than a header")
    length = _FIXED.unpack(fixed)[3]
    if length > _MAX_HEADER:
        raise BadHeader(f"header length {length} out of range")
    return decode_header(fixed + f.read(max(0, length - _FIXED.size)))
