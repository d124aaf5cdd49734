"""The frames of the daemon's own socket protocols: length-prefixed msgpack control plus raw bytes.

The same-host socket (:mod:`kvstore.transport.samehost`) and the peer
protocol (:mod:`kvstore.peer.wire`, over TCP and UCX) speak the same frame;
each defines its own operations on it. Why not gRPC: a Python gRPC round
trip costs 0.5-0.8 ms here, a Unix-socket round trip about 20 us, and the
messages are small control messages (block bytes move through the shared
arena, or as the frame's payload). Why msgpack: it is already a dependency,
its C codec packs a small message in about a microsecond, and it refuses
truncated or malformed input with an exception instead of guessing.

A frame::

    u32 meta_len, u32 payload_len   (little-endian)
    meta_len bytes                  msgpack: a request [op, request_id, args]
                                    or a reply [request_id, status, result]
    payload_len bytes               raw block bytes

An error's result is ``[class name, message, retry_after_s]`` and the
client raises the same :mod:`kvstore.errors` class the daemon raised, as
``kvstore.rpc.status`` does for gRPC (:func:`error_result`,
:func:`raise_error`).

Limits: a meta part over :data:`MAX_META_BYTES` or a payload over
:data:`MAX_PAYLOAD_BYTES` (or the limits a reader is given) is refused
before it is read; the server then replies with an error and closes the
connection (the stream cannot be resynchronised).

Errors, beyond :mod:`kvstore.errors`::

    InvalidArgument
    └── FrameError    a frame broke the format or its limits (crosses the socket as InvalidArgument)
"""

from __future__ import annotations

import socket
import struct
import time

import msgpack

from kvstore import errors
from kvstore.errors import InvalidArgument, ResourceExhausted, StrataError

HEADER = struct.Struct("<II")
# 4096 keys of 1 KiB each plus their metadata fit; a client never needs more.
MAX_META_BYTES = 8 << 20
# Inline puts only (the same-host socket): bigger blocks go through the arena.
MAX_PAYLOAD_BYTES = 4 << 20
# Before its Hello a connection proved nothing: its first frame is small and carries no payload.
MAX_HELLO_BYTES = 8 << 10

_ERRORS: dict[str, type[StrataError]] = {
    name: cls for name, cls in vars(errors).items() if isinstance(cls, type) and issubclass(cls, StrataError)
}

_KEEP_BYTES = 1 << 20  # a read buffer grown past this is given back once empty
_WAITALL_BYTES = 16 << 10  # a frame's missing part above this is taken whole (MSG_WAITALL)
_IOV_MAX = 512  # buffers per sendmsg; Linux takes at most 1024

_pack = msgpack.Packer(use_bin_type=True).pack


class FrameError(InvalidArgument):
    """A frame that breaks the format or its limits; the connection cannot go on."""


def encode(meta, payload_len: int = 0) -> bytes:
    """Header and meta part of a frame (the payload, if any, is sent after it as is)."""
    body = _pack(meta)
    return HEADER.pack(len(body), payload_len) + body


def error_result(err: StrataError) -> list:
    retry = err.retry_after_s if isinstance(err, ResourceExhausted) else 0.0
    # The nearest class the other side knows (a module's own subclass travels as its base).
    name = next(c.__name__ for c in type(err).__mro__ if _ERRORS.get(c.__name__) is c)
    return [name, str(err), retry]


def raise_error(result) -> None:
    """Raise the error a reply carries, as the class the daemon raised."""
    try:
        name, message, retry = result
        cls = _ERRORS.get(str(name), StrataError)
        message = str(message)
    except (TypeError, ValueError):
        raise StrataError(f"the daemon sent a malformed error reply: {result!r}") from None
    if issubclass(cls, ResourceExhausted):
        raise cls(message, retry_after_s=float(retry) if retry else 0.1)
    raise cls(message)


class FrameReader:
    """Reads whole frames from a blocking socket through one reusable buffer.

    A frame is usually taken in one ``recv``. The payload view returned by
    :meth:`read` is valid until the next call (the buffer is reused).
    """

    def __init__(self, sock: socket.socket, *, max_meta: int = MAX_META_BYTES,
                 max_payload: int = MAX_PAYLOAD_BYTES, initial: int = 64 << 10) -> None:
        self._sock = sock
        self._max_meta = max_meta
        self._max_payload = max_payload
        self._initial = initial
        self._buf = bytearray(initial)
        self._view = memoryview(self._buf)
        self._start = 0  # first unconsumed byte
        self._end = 0  # end of received bytes
        self._deadline: float | None = None

    def limit(self, *, max_meta: int, max_payload: int) -> None:
        """Change the frame size limits (raised once the Hello is taken)."""
        self._max_meta, self._max_payload = max_meta, max_payload

    def _fill(self, need: int) -> None:
        """Make ``need`` bytes available from ``_start``; raises EOFError when the peer closed, and
        TimeoutError past the deadline of :meth:`read` (each ``recv`` waits only what is left of
        it: bytes that trickle in do not restart it)."""
        if self._end - self._start >= need:
            return
        if self._start + need > len(self._buf):
            pending = self._end - self._start
            if need > len(self._buf):
                grown = bytearray(max(need, 2 * len(self._buf)))
                grown[:pending] = self._view[self._start : self._end]
                self._buf, self._view = grown, memoryview(grown)  # views handed out keep the old one alive
            else:
                self._view[:pending] = self._view[self._start : self._end]
            self._start, self._end = 0, pending
        while self._end - self._start < need:
            if self._deadline is not None:
                left = self._deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the frame did not come whole in time")
                self._sock.settimeout(left)
            missing = need - (self._end - self._start)
            if missing > _WAITALL_BYTES:  # the rest of a big frame: one wait in the kernel, not one per segment
                n = self._sock.recv_into(self._view[self._end : self._end + missing], missing, socket.MSG_WAITALL)
            else:
                n = self._sock.recv_into(self._view[self._end :])
            if n == 0:
                raise EOFError("the peer closed the connection")
            self._end += n

    def read(self, deadline: float | None = None) -> tuple[object, memoryview]:
        """The next frame's decoded meta and its payload view, whole by ``deadline``
        (``time.monotonic()``; None: as the socket's own timeout says)."""
        if deadline is None:
            return self._read()
        self._deadline = deadline
        try:
            return self._read()
        finally:
            self._deadline = None

    def _read(self) -> tuple[object, memoryview]:
        if self._start == self._end:
            self._start = self._end = 0
            if len(self._buf) > _KEEP_BYTES:  # a big frame passed: an idle connection holds little
                self._buf = bytearray(self._initial)
                self._view = memoryview(self._buf)
        self._fill(HEADER.size)
        meta_len, payload_len = HEADER.unpack_from(self._buf, self._start)
        if meta_len > self._max_meta or payload_len > self._max_payload:
            raise FrameError(
                f"a frame of {meta_len} meta and {payload_len} payload bytes is over this connection's limits "
                f"({self._max_meta} and {self._max_payload}): send smaller batches"
            )
        total = HEADER.size + meta_len + payload_len
        self._fill(total)
        at = self._start + HEADER.size
        try:
            meta = msgpack.unpackb(self._view[at : at + meta_len], use_list=True, raw=False)
        except (ValueError, msgpack.UnpackException) as err:
            raise FrameError(f"a frame's control part is not valid msgpack ({err})") from None
        finally:
            self._start += total
        payload = self._view[at + meta_len : at + meta_len + payload_len]
        return meta, payload


def send(sock: socket.socket, head: bytes, payload: list | tuple = ()) -> None:
    """Send a frame's header and meta, then its payload parts, without joining them."""
    if not payload:
        sock.sendall(head)
        return
    parts = [head, *payload]
    while parts:
        sent = sock.sendmsg(parts[:_IOV_MAX])
        while parts and sent >= len(parts[0]):
            sent -= len(parts[0])
            parts.pop(0)
        if sent:
            parts[0] = memoryview(parts[0])[sent:]
