"""The TCP peer protocol: frames of msgpack control, block bytes read and written in place.

The frame is the same-host socket's (:mod:`kvstore.wire.frames`:
``u32 meta_len, u32 payload_len``, msgpack meta, raw payload) and errors
travel the same way (``[class name, message, retry_after_s]``, raised on the
other side as the daemon's own class). What differs is where a payload
goes: a :class:`Wire` reads a frame's meta and leaves its payload in the
socket, so the caller receives it straight into the buffer it chose (an
arena slot, a caller's tensor) with ``recv_into``, hashing each chunk while
it is still in cache, and a sender hands a block to the kernel straight out
of the arena in one ``sendmsg`` with its frame head. No block is ever copied
into a frame buffer.

Requests ``[op, request_id, args]`` and their replies ``[request_id, status, result]``::

    HELLO  [version, bearer token or ""]
           -> OK [max_meta_bytes, max_block_bytes, max_batch_blocks, request_bytes]
    READ   [namespace, keys, timeout_ms, with_bytes]
           -> per key, in order, one of
                BLOCK  [i, size, checksum, parent, layout, tier]  + size bytes (none without with_bytes)
                MISS   i
                FAILED [i, error]                                  (that key only)
              then OK n, or at any point ERROR error: the keys not yet answered fail with it
    PUT    [namespace, timeout_ms, [[key, size, checksum, parent, layout], ...]]
           -> OK [present per block]   (slots are reserved for the others)
           DATA  [] + the bytes of the blocks not present, in order
           -> OK [[stored, tier] or [None, error] per block sent]
    CHECK  [namespace, keys]   (after a read whose bytes failed their checksum)
           -> OK [sound per key]: the holder verified its copy, and dropped it if corrupt
    HOLD   [namespace, keys, lease_ms]   (a copy made for another node's pin, or one it found here)
           -> OK [lease_id, granted_ms, [held per key]]: the held keys are pinned here under one
              lease for granted_ms (at most the lease asked for, and this daemon's longest);
              lease_id 0 when none of the keys is here
    RELEASE [lease_ids]   (the pin ended: its copies here become ordinary cache)
           -> OK [released per id]: False for a hold that already ended, or another caller's

A reply of request id 0 is a refusal of the connection (too many of them,
a bad Hello, a frame over the limits); the stream cannot go on after it.

Before its Hello a connection may send only the Hello, a frame of at most
:data:`MAX_HELLO_BYTES` and no payload: the daemon reads nothing more of a
frame whose header claims more (see :meth:`Wire.limit`).
"""

from __future__ import annotations

import socket
import time

import msgpack

from kvstore.block import Checksummer
from kvstore.wire.frames import HEADER, MAX_META_BYTES, FrameError, encode, error_result, raise_error, send

__all__ = [
    "BLOCK", "CHECK", "CHUNK_BYTES", "DATA", "ERROR", "FAILED", "HEADER", "HELLO", "HOLD", "MAX_HELLO_BYTES",
    "MAX_META_BYTES", "MISS", "OK",
    "OP_NAMES", "PROTOCOL_VERSION", "PUT", "READ", "RELEASE", "FrameError", "Wire", "encode", "error_result", "raise_error", "send",
]

PROTOCOL_VERSION = 1

# Reply statuses.
OK, ERROR, BLOCK, MISS, FAILED = 0, 1, 2, 3, 4
# Request operations.
HELLO, READ, PUT, DATA, CHECK, HOLD, RELEASE = 1, 2, 3, 4, 5, 6, 7
OP_NAMES = {HELLO: "PeerHello", READ: "PeerRead", PUT: "PeerPut", DATA: "PeerData", CHECK: "PeerCheck",
            HOLD: "PeerHold", RELEASE: "PeerRelease"}

# The most a Hello's control part may take (version and bearer token): what gRPC's default
# metadata limit lets a token be, so a token good for the daemon's gRPC port is good here.
# A connection not yet authenticated gets no more than this of the daemon's memory.
MAX_HELLO_BYTES = 8 << 10

# Bytes received per system call and hashed per step by a reader that verifies
# as it receives: large enough that Python's per-call cost vanishes, small
# enough to still be in the core's cache (1 MiB of L2 here) when hashed. On
# loopback the reader's CPU per byte was the same for 256 KiB to 1 MiB within
# the noise; the kernel's copy is most of it, the hash of a cached chunk ~10%.
CHUNK_BYTES = 256 << 10
_BUFFER_BYTES = 64 << 10


class Wire:
    """One blocking socket's frames: meta parts through a small buffer, payloads in place.

    A recv for a frame's head may take payload bytes with it; those wait in
    the buffer and are handed out first by :meth:`read_into`.

    ``frame_s``: once a frame's first byte has come, the rest of it (its
    payload too) must come within this long, or the next wait on the socket
    raises TimeoutError. The socket's own timeout bounds each wait, and
    restarts with every byte that comes, so without this a peer sending a
    byte now and then would hold the connection, and what the frame holds
    (slots, budget), for ever. It is checked before each wait, so a frame
    ends within ``frame_s`` and one such wait. None: no limit.
    """

    def __init__(self, sock: socket.socket, *, max_meta: int = MAX_META_BYTES, max_payload: int | None = None,
                 frame_s: float | None = None) -> None:
        self.sock = sock
        self.limit(max_meta=max_meta, max_payload=max_payload)
        self.frame_s = frame_s
        self._buf = bytearray(_BUFFER_BYTES)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._deadline: float | None = None  # the frame being read must be whole by then
        self._cut = False  # each wait is cut to the deadline (the socket's timeout set to what is left)
        self.pending = 0  # payload bytes of the last frame not yet taken

    def limit(self, *, max_meta: int, max_payload: int | None = None) -> None:
        """The frames taken from now on: a control part of at most ``max_meta`` bytes, a payload
        of at most ``max_payload`` (None: any). A frame over either is refused from its header
        (FrameError), before a byte more of it is read or a buffer is sized to it."""
        self._max_meta = max_meta
        self._max_payload = max_payload

    @property
    def buffer_bytes(self) -> int:
        """The bytes this link's frame buffer holds (what it costs beyond its socket)."""
        return len(self._buf)

    def _recv_into(self, view: memoryview, nbytes: int = 0, flags: int = 0) -> int:
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the rest of the frame did not come before its deadline")
            if self._cut:
                self.sock.settimeout(left)
        return self.sock.recv_into(view, nbytes, flags)

    def _fill(self, need: int) -> None:
        if self._end - self._start >= need:
            return
        if self._start + need > len(self._buf):
            held = self._end - self._start
            if need > len(self._buf):
                grown = bytearray(max(need, 2 * len(self._buf)))
                grown[:held] = self._view[self._start : self._end]
                self._buf, self._view = grown, memoryview(grown)
            else:
                self._view[:held] = self._view[self._start : self._end]
            self._start, self._end = 0, held
        while self._end - self._start < need:
            n = self._recv_into(self._view[self._end :])
            if n == 0:
                raise EOFError("the peer closed the connection")
            self._end += n

    def read_meta(self, deadline: float | None = None) -> tuple[object, int]:
        """The next frame's decoded meta and its payload length (the payload is still to be taken).

        ``deadline`` (``time.monotonic()``): the frame's head and control part must be in by
        then, waiting included, however slowly its bytes come: each wait on the socket is cut
        to what is left (the socket's timeout is set to it), TimeoutError after. Without one, the
        wait for the frame's first byte is the socket's own (idle) and ``frame_s`` runs from it."""
        if self.pending:
            raise FrameError(f"{self.pending} payload bytes of the last frame were not taken")
        if self._start == self._end:
            self._start = self._end = 0
            if len(self._buf) > _BUFFER_BYTES:
                self._buf = bytearray(_BUFFER_BYTES)
                self._view = memoryview(self._buf)
        self._deadline, self._cut = deadline, deadline is not None
        if deadline is None and self.frame_s is not None:
            self._fill(1)
            self._deadline = time.monotonic() + self.frame_s
        self._fill(HEADER.size)
        meta_len, payload_len = HEADER.unpack_from(self._buf, self._start)
        if meta_len > self._max_meta:
            raise FrameError(
                f"a frame's control part of {meta_len} bytes is over the limit of {self._max_meta}: send smaller batches"
            )
        if self._max_payload is not None and payload_len > self._max_payload:
            raise FrameError(f"a frame's payload of {payload_len} bytes is over the limit of {self._max_payload} here")
        self._fill(HEADER.size + meta_len)
        at = self._start + HEADER.size
        self._start = at + meta_len
        self.pending = payload_len  # also when the control part is refused: its payload is never read as frames
        try:
            meta = msgpack.unpackb(self._view[at : at + meta_len], use_list=True, raw=False)
        except (ValueError, msgpack.UnpackException) as err:
            raise FrameError(f"a frame's control part is not valid msgpack ({err})") from None
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


def send_block(sock: socket.socket, head: bytes, data: memoryview) -> None:
    """Send a frame head and ``data`` (a block straight out of the arena) in one ``sendmsg``.

    Not a chunk at a time: on loopback, 4-16 MiB blocks sent in 256 KiB
    ``sendall`` s cost the sender about a third more CPU per byte, and its
    thread took the GIL back once per chunk. A call cut short by the
    socket's send timeout returns what it took and the rest goes in the
    next, so only a reader that takes nothing for a whole timeout fails it.
    """
    send(sock, head, [data])
