"""The bytes of one block object: a small self-describing header, then the block's payload.

::

    offset  size  field
    0       4     magic  b"SKVB"
    4       1     format version (1)
    5       1     flags (0; a reader refuses bits it does not know)
    6       2     reserved (0)
    8       4     n: length of the header map, little-endian
    12      8     xxh3-64 of the header map, little-endian
    20      n     header map (msgpack): ns, key, size, xxh3, parent, layout, at
    20 + n  size  the block's bytes

Why a header in the object rather than S3 user metadata: the block's
metadata (key up to 1 KiB, parent up to 1 KiB, a free-form layout of up to
1024 characters) does not fit S3's 2 KiB of ASCII user metadata, not every
S3-compatible server keeps metadata alike, and metadata in the object is
written atomically with the bytes it describes, by the same conditional
PUT. A reader learns the metadata from the first bytes of the same GET
that brings the payload (one round trip, as the remote-source contract
asks), and :data:`PROBE_BYTES` from a small ranged GET when it wants only
the metadata.

The header map's fields: ``ns`` (namespace) and ``key`` (the whole key, so
an object named by a digest still says whose it is, and a misplaced object
is caught), ``size`` and ``xxh3`` (the payload's length and xxh3-64, as in
:class:`~kvstore.block.BlockMeta`), ``parent`` (bytes or nil), ``layout``,
and ``at`` (unix seconds when it was written: what a TTL from last write or
a GC sweep reads without a listing of its own). Unknown fields are ignored,
so later writers may add fields without a new version; a newer version is
refused as :class:`UnknownFormat` (a miss, never deleted: a newer daemon
wrote it), a broken header as :class:`~kvstore.errors.CorruptBlock`.

A header that parses and passes its own checksum can still lie (a damaged
or forged object): a ``size`` past the object's end, a map longer than the
object, another block's key, a field out of range. Each of these is
``CorruptBlock`` too, and :func:`decode_header` checks ``size`` against
the object's real length (which every reader learns from S3 before any
payload) so that no reader sizes a buffer, or compares against its largest
block, by a number the object itself contradicts.
"""

from __future__ import annotations

import math
import struct
import time
from dataclasses import dataclass

import msgpack
import xxhash

from kvstore.block import MAX_KEY_BYTES, MAX_LAYOUT_CHARS, BlockKey, BlockMeta, copy_and_checksum
from kvstore.errors import CorruptBlock, InvalidArgument

MAGIC = b"SKVB"
VERSION = 1
_FIXED = struct.Struct("<4sBBHIQ")
FIXED_BYTES = _FIXED.size  # 20
MAX_MAP_BYTES = 16 << 10  # the largest map a valid block can have is ~6 KiB
PROBE_BYTES = 4096  # what a metadata-only read asks for first; enough for every usual header


class UnknownFormat(Exception):
    """An object of a newer format (or with flags this reader does not know): not ours to judge."""


@dataclass(frozen=True, slots=True)
class Header:
    key: BlockKey
    meta: BlockMeta
    written_at: float  # unix seconds
    header_bytes: int  # where the payload starts

    @property
    def object_bytes(self) -> int:
        return self.header_bytes + self.meta.size


def encode(key: BlockKey, data: bytes | bytearray | memoryview, meta: BlockMeta, written_at: float) -> bytearray:
    """The object for a block; copies ``data`` once, checking it against ``meta`` in the same pass.

    Raises CorruptBlock when the bytes do not match their meta (nothing should be stored)."""
    src = memoryview(data).cast("B")
    if src.nbytes != meta.size:
        raise CorruptBlock(f"block {key} has {src.nbytes} bytes but its meta says {meta.size}: nothing stored")
    fields = {
        "ns": key.namespace, "key": key.key, "size": meta.size, "xxh3": meta.checksum,
        "parent": meta.parent, "layout": meta.layout, "at": float(written_at),
    }
    packed = msgpack.packb(fields, use_bin_type=True)
    if len(packed) > MAX_MAP_BYTES:
        raise InvalidArgument(f"block {key}: its metadata packs to {len(packed)} bytes, over {MAX_MAP_BYTES}")
    start = FIXED_BYTES + len(packed)
    out = bytearray(start + meta.size)
    _FIXED.pack_into(out, 0, MAGIC, VERSION, 0, 0, len(packed), xxhash.xxh3_64_intdigest(packed))
    out[FIXED_BYTES:start] = packed
    if copy_and_checksum(memoryview(out)[start:], src) != meta.checksum:
        raise CorruptBlock(
            f"block {key}'s bytes do not match the checksum in its meta: nothing stored; recompute the meta"
        )
    return out


def header_length(head: bytes | bytearray | memoryview) -> int:
    """How many leading bytes of the object hold its header (at least FIXED_BYTES must be given)."""
    if len(head) < FIXED_BYTES:
        raise CorruptBlock(f"object is {len(head)} bytes, shorter than a block header ({FIXED_BYTES})")
    magic, version, flags, _reserved, n, _digest = _FIXED.unpack_from(head, 0)
    if magic != MAGIC:
        raise CorruptBlock("object does not start with a Strata block header (wrong magic)")
    if version > VERSION or flags:
        raise UnknownFormat(f"block object of format {version} (flags {flags:#x}); this daemon reads {VERSION}")
    if version < 1 or n > MAX_MAP_BYTES:
        raise CorruptBlock(f"block header of format {version} with a {n}-byte map is not valid")
    return FIXED_BYTES + n


def decode_header(head: bytes | bytearray | memoryview, expect: BlockKey, object_bytes: int | None = None) -> Header:
    """The header at the start of an object; ``head`` holds at least :func:`header_length` bytes;
    ``object_bytes``: the object's whole length as the server reports it (readers always pass it).

    Raises CorruptBlock when it is damaged, names another block or describes an object of another
    length, UnknownFormat when newer."""
    end = header_length(head)
    if len(head) < end:
        raise CorruptBlock(f"object is {len(head)} bytes, shorter than its own header ({end})")
    packed = bytes(head[FIXED_BYTES:end])
    if xxhash.xxh3_64_intdigest(packed) != _FIXED.unpack_from(head, 0)[5]:
        raise CorruptBlock("block header failed its checksum")
    try:
        fields = msgpack.unpackb(packed, raw=False)
        key = BlockKey.checked(fields["ns"], fields["key"])
        parent, layout = fields.get("parent"), fields.get("layout", "")
        size, digest, at = fields["size"], fields["xxh3"], fields.get("at", 0.0)
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as err:
        raise CorruptBlock(f"block header does not parse: {type(err).__name__}") from None
    except InvalidArgument as err:
        raise CorruptBlock(f"block header holds an invalid key: {err}") from None
    valid = (
        isinstance(size, int) and 0 <= size < 1 << 48 and isinstance(digest, int) and 0 <= digest < 1 << 64
        and (parent is None or (isinstance(parent, bytes) and len(parent) <= MAX_KEY_BYTES))
        and isinstance(layout, str) and len(layout) <= MAX_LAYOUT_CHARS
        and isinstance(at, (int, float)) and not isinstance(at, bool) and math.isfinite(at) and at >= 0
    )
    if not valid:
        raise CorruptBlock("block header holds values outside their limits")
    if key != expect:
        raise CorruptBlock(f"object at the name of {expect} holds block {key}")
    if object_bytes is not None and object_bytes != end + size:
        raise CorruptBlock(f"object is {object_bytes} bytes; its header says {end + size}")
    return Header(key, BlockMeta(size, digest, parent, layout), float(at), end)


class Framed:
    """A block already encoded as its object (header, then payload): what the write-back queue holds
    and :class:`~kvstore.remote.object.source.ObjectSource` uploads as it is, without encoding again."""

    __slots__ = ("obj", "start")

    def __init__(self, obj: bytearray, start: int) -> None:
        self.obj, self.start = obj, start


def frame(key: BlockKey, data: bytes | bytearray | memoryview, meta: BlockMeta,
          written_at: float | None = None) -> tuple[Framed, memoryview]:
    """The block's object, copied once and checked in that pass (see :func:`encode`), and a view of
    the block's bytes in it."""
    obj = encode(key, data, meta, time.time() if written_at is None else written_at)
    start = len(obj) - meta.size
    return Framed(obj, start), memoryview(obj)[start:]
