"""The TCP peer protocol: frames of msgpack control, block bytes read and written in place.

The frame is the same-host socket's (:mod:`kvstore.wire.frames`:
``u32 meta_len, u32 payload_len``, msgpack meta, raw payload) and errors
travel the same way (``[class name, message, retry_after_s]``, raised on the
other side as the daemon's own class). What differs is where a payload
goes: a :class:`Wire` (the frames' one reader,
:class:`~kvstore.wire.frames.FrameReader`, with the peer's defaults) reads a
frame's meta and leaves its payload in the socket, so the caller receives it
straight into the buffer it chose (an arena slot, a caller's tensor) with
``recv_into``, hashing each chunk while it is still in cache, and a sender
hands a block to the kernel straight out of the arena in one ``sendmsg`` with
its frame head. No block is ever copied into a frame buffer.

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

from kvstore.wire.frames import (
    CHUNK_BYTES, HEADER, MAX_META_BYTES, FrameError, FrameReader, encode, error_result, raise_error, send,
)

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

_BUFFER_BYTES = 64 << 10  # a buffer grown past this by a big control part is given back once empty


class Wire(FrameReader):
    """The peer protocol's reader: :class:`~kvstore.wire.frames.FrameReader` with the peer's
    defaults. Payloads are blocks taken in place (:meth:`read_meta`, :meth:`read_into`), never
    into the buffer, so none is limited unless the caller says (:meth:`limit`), and the buffer
    holds control parts only: one grown past 64 KiB is given back once empty."""

    def __init__(self, sock: socket.socket, *, max_meta: int = MAX_META_BYTES, max_payload: int | None = None,
                 frame_s: float | None = None) -> None:
        super().__init__(sock, max_meta=max_meta, max_payload=max_payload, frame_s=frame_s,
                         initial=_BUFFER_BYTES, keep_bytes=_BUFFER_BYTES)


def send_block(sock: socket.socket, head: bytes, data: memoryview) -> None:
    """Send a frame head and ``data`` (a block straight out of the arena) in one ``sendmsg``.

    Not a chunk at a time: on loopback, 4-16 MiB blocks sent in 256 KiB
    ``sendall`` s cost the sender about a third more CPU per byte, and its
    thread took the GIL back once per chunk. A call cut short by the
    socket's send timeout returns what it took and the rest goes in the
    next, so only a reader that takes nothing for a whole timeout fails it.
    """
    send(sock, head, [data])
