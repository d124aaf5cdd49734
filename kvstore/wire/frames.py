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

One reader, :class:`FrameReader`, serves both protocols: the same-host
socket takes whole frames (:meth:`FrameReader.read`), the peer protocol a
frame's control part first and its payload straight into the buffer it
chose (:meth:`FrameReader.read_meta`, :meth:`FrameReader.read_into`).

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
from kvstore.block import Checksummer
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
# Bytes received per system call and hashed per step by a reader that verifies
# as it receives (FrameReader.read_into): large enough that Python's per-call
# cost vanishes, small enough to still be in the core's cache (1 MiB of L2
# here) when hashed. On loopback the reader's CPU per byte was the same for
# 256 KiB to 1 MiB within the noise; the kernel's copy is most of it, the hash
# of a cached chunk ~10%.
CHUNK_BYTES = 256 << 10
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
    """Reads frames from a blocking socket through one reusable buffer, in one of two ways.

    - :meth:`read`: a whole frame, its payload a view into the buffer, valid
      until the next call (the buffer is reused). The same-host socket's
      frames are small control messages, usually taken in one ``recv``.
    - :meth:`read_meta`, then :meth:`read_into` or :meth:`skip`: the frame's
      control part only, its payload left in the socket, so the caller
      receives it straight into the buffer it chose (an arena slot, a
      caller's tensor) with ``recv_into``, hashing each chunk while it is
      still in cache. The peer protocol's blocks are never copied into a
      frame buffer. A recv for a frame's head may take payload bytes with
      it; those wait in the buffer and are handed out first.

    Deadlines: a ``deadline`` (``time.monotonic()``) given to a read bounds
    the frame whole, waiting included, however slowly its bytes come: each
    wait is cut to what is left (the socket's timeout is set to it), and
    TimeoutError after. ``frame_s``: without such a deadline, once a frame's
    first byte has come, the rest of it (its payload too) must come within
    this long. The socket's own timeout bounds each wait, and restarts with
    every byte that comes, so without this a peer sending a byte now and
    then would hold the connection, and what the frame holds (slots,
    budget), for ever. It is checked before each wait, so a frame ends
    within ``frame_s`` and one such wait. None: no limit.

    ``keep_bytes``: a buffer grown past this by a big frame is given back
    (to ``initial``) once it is empty, so an idle connection holds little.
    """

    def __init__(self, sock: socket.socket, *, max_meta: int = MAX_META_BYTES,
                 max_payload: int | None = MAX_PAYLOAD_BYTES, frame_s: float | None = None,
                 initial: int = 64 << 10, keep_bytes: int = _KEEP_BYTES) -> None:
        self.sock = sock
        self.limit(max_meta=max_meta, max_payload=max_payload)
        self.frame_s = frame_s
        self._initial = initial
        self._keep = keep_bytes
        self._buf = bytearray(initial)
        self._view = memoryview(self._buf)
        self._start = 0  # first unconsumed byte
        self._end = 0  # end of received bytes
        self._deadline: float | None = None  # the frame being read must be whole by then
        self._cut = False  # each wait is cut to the deadline (the socket's timeout set to what is left)
        self.pending = 0  # payload bytes of the last frame (read_meta) not yet taken

    def limit(self, *, max_meta: int, max_payload: int | None = None) -> None:
        """The frames taken from now on (raised once the Hello is taken): a control part of at most
        ``max_meta`` bytes, a payload of at most ``max_payload`` (None: any). A frame over either
        is refused from its header (FrameError), before a byte more of it is read or a buffer is
        sized to it."""
        self._max_meta = max_meta
        self._max_payload = max_payload

    @property
    def buffer_bytes(self) -> int:
        """The bytes this reader's frame buffer holds (what it costs beyond its socket)."""
        return len(self._buf)

    # ---- whole frames --------------------------------------------------------------

    def read(self, deadline: float | None = None) -> tuple[object, memoryview]:
        """The next frame's decoded meta and its payload view, whole by ``deadline``
        (None: as the socket's own timeout and ``frame_s`` say)."""
        self._begin(deadline)
        try:
            meta_len, payload_len = HEADER.unpack_from(self._buf, self._start)
            if meta_len > self._max_meta or (self._max_payload is not None and payload_len > self._max_payload):
                raise FrameError(
                    f"a frame of {meta_len} meta and {payload_len} payload bytes is over this connection's limits "
                    f"({self._max_meta} and {self._max_payload}): send smaller batches"
                )
            total = HEADER.size + meta_len + payload_len
            self._fill(total)
            at = self._start + HEADER.size
            try:
                meta = decode_meta(self._view[at : at + meta_len])
            finally:
                self._start += total
            return meta, self._view[at + meta_len : at + meta_len + payload_len]
        finally:
            self._deadline = None

    # ---- control part first, payload in place --------------------------------------

    def read_meta(self, deadline: float | None = None) -> tuple[object, int]:
        """The next frame's decoded meta and its payload length (the payload is still to be taken,
        by ``deadline`` too when one is given)."""
        self._begin(deadline)
        meta_len, payload_len = HEADER.unpack_from(self._buf, self._start)
        check_lengths(meta_len, payload_len, self._max_meta, self._max_payload)
        self._fill(HEADER.size + meta_len)
        at = self._start + HEADER.size
        self._start = at + meta_len
        self.pending = payload_len  # also when the control part is refused: its payload is never read as frames
        meta = decode_meta(self._view[at : at + meta_len])
        if not payload_len:
            self._deadline = None
        return meta, payload_len

    def read_into(self, dst: memoryview, hasher: Checksummer | None = None, before=None) -> None:
        """Take ``len(dst)`` payload bytes into ``dst``, hashing each chunk as it lands;
        ``before()`` runs before each wait on the socket (a deadline's check, a slot's lease).
        ``pending`` counts down as the bytes are taken, so after a ``before`` that raised it
        still says how much of the frame is left (for :meth:`skip`).

        Without a hasher or ``before`` there is nothing to do between chunks:
        the bytes are taken in one ``recv_into`` (``MSG_WAITALL``)."""
        n = len(dst)
        if n > self.pending:
            raise FrameError(f"{n} payload bytes asked of a frame that has {self.pending} left")
        at = 0
        held = min(self._end - self._start, n)
        if held:
            dst[:held] = self._view[self._start : self._start + held]
            if hasher is not None:
                hasher.update(dst[:held])
            self._start += held
            self.pending -= held
            at = held
        step = CHUNK_BYTES if hasher is not None or before is not None else n
        while at < n:
            if before is not None:
                before()
            end = min(n, at + step)
            got = self._recv_into(dst[at:end], end - at, socket.MSG_WAITALL)
            if got == 0:
                raise EOFError("the peer closed the connection in the middle of a block")
            if hasher is not None:
                hasher.update(dst[at : at + got])
            at += got
            self.pending -= got
        if not self.pending:
            self._deadline = None

    def skip(self, n: int | None = None) -> None:
        """Throw away ``n`` payload bytes (all that is left of the frame when None)."""
        n = self.pending if n is None else n
        scratch = memoryview(bytearray(min(n, CHUNK_BYTES) or 1))
        while n:
            step = min(n, len(scratch))
            self.read_into(scratch[:step])
            n -= step

    # ---- the buffer ------------------------------------------------------------------

    def _begin(self, deadline: float | None) -> None:
        """Start a frame: its deadline set, and its header in the buffer."""
        if self.pending:
            raise FrameError(f"{self.pending} payload bytes of the last frame were not taken")
        if self._start == self._end:
            self._start = self._end = 0
            if len(self._buf) > self._keep:  # a big frame passed: an idle connection holds little
                self._buf = bytearray(self._initial)
                self._view = memoryview(self._buf)
        self._deadline, self._cut = deadline, deadline is not None
        if deadline is None and self.frame_s is not None:
            self._fill(1)
            self._deadline = time.monotonic() + self.frame_s
        self._fill(HEADER.size)

    def _recv_into(self, view: memoryview, nbytes: int = 0, flags: int = 0) -> int:
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the frame did not come whole before its deadline")
            if self._cut:
                self.sock.settimeout(left)
        return self.sock.recv_into(view, nbytes, flags)

    def _fill(self, need: int) -> None:
        """Make ``need`` bytes available from ``_start``; raises EOFError when the peer closed."""
        if self._end - self._start >= need:
            return
        if self._start + need > len(self._buf):
            held = self._end - self._start
            if need > len(self._buf):
                grown = bytearray(max(need, 2 * len(self._buf)))
                grown[:held] = self._view[self._start : self._end]
                self._buf, self._view = grown, memoryview(grown)  # views handed out keep the old one alive
            else:
                self._view[:held] = self._view[self._start : self._end]
            self._start, self._end = 0, held
        while self._end - self._start < need:
            missing = need - (self._end - self._start)
            if missing > _WAITALL_BYTES:  # the rest of a big frame: one wait in the kernel, not one per segment
                n = self._recv_into(self._view[self._end : self._end + missing], missing, socket.MSG_WAITALL)
            else:
                n = self._recv_into(self._view[self._end :])
            if n == 0:
                raise EOFError("the peer closed the connection")
            self._end += n


def check_lengths(meta_len: int, payload_len: int, max_meta: int, max_payload: int | None) -> None:
    """FrameError for a frame head over the limits of a reader that takes payloads in place."""
    if meta_len > max_meta:
        raise FrameError(f"a frame's control part of {meta_len} bytes is over the limit of {max_meta}: send smaller batches")
    if max_payload is not None and payload_len > max_payload:
        raise FrameError(f"a frame's payload of {payload_len} bytes is over the limit of {max_payload} here")


def decode_meta(view) -> object:
    """A frame's control part, decoded; FrameError when it is not msgpack."""
    try:
        return msgpack.unpackb(view, use_list=True, raw=False)
    except (ValueError, msgpack.UnpackException) as err:
        raise FrameError(f"a frame's control part is not valid msgpack ({err})") from None


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
