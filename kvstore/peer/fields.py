"""The fields of a peer request, each checked for the type the store takes.

A peer's frames are msgpack: any field may be any value. Every check
raises InvalidArgument naming the field, which the server answers as an
error frame of the request's id (a request with no usable id refuses the
connection).
"""

from __future__ import annotations

from kvstore.errors import InvalidArgument


def fields(value, n: int, what: str) -> list:
    if not isinstance(value, list) or len(value) != n:
        raise InvalidArgument(f"malformed peer {what}: expected {n} fields, got {value!r:.80}")
    return value


def request(meta) -> list:
    """``[op, id, args]`` with a positive id: anything else cannot be answered by its id."""
    op, rid, args = fields(meta, 3, "request")
    if not isinstance(rid, int) or isinstance(rid, bool) or rid <= 0:
        raise InvalidArgument("malformed peer request: its id is not a positive integer")
    return [op, rid, args]


def count(value, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgument(f"malformed peer request: {what} is not a non-negative integer")
    return value


def items(value, what: str) -> list:
    if not isinstance(value, list):
        raise InvalidArgument(f"malformed peer request: {what} is not a list")
    return value


def put_block(value) -> tuple[bytes, int, int, bytes | None, str]:
    """A PUT's ``[key, size, checksum, parent, layout]``, each field of the type the store takes."""
    key, size, sum_, parent, layout = fields(value, 5, "Put block")
    if not isinstance(key, bytes):
        raise InvalidArgument("malformed peer Put block: the key is not bytes")
    if parent is not None and not isinstance(parent, bytes):
        raise InvalidArgument("malformed peer Put block: the parent key is neither bytes nor nil")
    if not isinstance(layout, str):
        raise InvalidArgument(f"malformed peer Put block: the layout is a {type(layout).__name__}, not a string")
    return key, count(size, "size"), count(sum_, "checksum"), parent or None, layout
