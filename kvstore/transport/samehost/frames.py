"""The same-host socket's protocol: its version, operations and replies, on the daemon's frames.

The frame itself (header, limits, errors, the reader) is
:mod:`kvstore.wire.frames`, shared with the peer protocol; its names are
re-exported here, so a same-host module needs one import.

A request with ``request_id`` 0 gets no reply (releases sent after a read,
so a get costs one round trip). Replies come in request order. ``status``
is :data:`OK` or :data:`ERROR`.
"""

from __future__ import annotations

from kvstore.wire.frames import (
    HEADER, MAX_HELLO_BYTES, MAX_META_BYTES, MAX_PAYLOAD_BYTES, FrameError, FrameReader, encode, error_result,
    raise_error, send,
)

__all__ = [
    "ABORT", "ALLOCATE", "COMMIT", "ERROR", "HEADER", "HELLO", "LOOKUP", "MAX_HELLO_BYTES", "MAX_META_BYTES",
    "MAX_PAYLOAD_BYTES", "MIN_PROTOCOL_VERSION", "OK", "OP_NAMES", "PROTOCOL_VERSION", "PUT", "RELEASE", "TOUCH",
    "FrameError", "FrameReader", "encode", "error_result", "raise_error", "send",
]

# 2: Hello carries the client's capabilities and its answer what the daemon's head is (see below);
# the daemon still serves 1, as 2 without capabilities.
PROTOCOL_VERSION = 2
MIN_PROTOCOL_VERSION = 1
OK, ERROR = 0, 1

# Request operations.
HELLO = 1  # [version, arena token(, [capability])] -> [max_meta_bytes, max_payload_bytes, max_batch_blocks,
#            removal page path(, head)]; version 2 sends capabilities and gets ``head`` back:
#            {"tier": the head's TierName, "regions": [handle], "prefault": bool, "exists": bool}
#            (kvstore.transport.samehost.regions; regions only for a client that declared "gpu", when the head
#            is the gpu tier; prefault: the daemon faults the arena's pages in, so a client may map them all;
#            exists: the daemon answers EXISTS, else a client asks the gRPC service)
LOOKUP = 2  # [ns, keys, lease_ms, timeout_ms, release_ids] -> [lease_deadline_unix_ms, [entry or None]]
#            entry: [size, checksum, parent, layout, offset, lease_id, tier(, region)]: region, the
#            index into Hello's regions, when the lease is on a gpu region (offset then inside it)
RELEASE = 3  # [lease_ids] -> [valid per lease]
PUT = 4  # [ns, timeout_ms, [[key, size, checksum, parent, layout]]] + payload -> [[stored, tier]]
ALLOCATE = 5  # [ns, lease_ms, timeout_ms, [[key, size, parent, layout]]] -> [deadline_ms, [[present, slot, offset
#            (, region)]]]: region as in Lookup
COMMIT = 6  # [slot_ids] -> [[stored, tier]]
ABORT = 7  # [slot_ids] -> None
TOUCH = 8  # [ns, keys] -> None: blocks read without asking (kvstore.transport.samehost.locations), for recency
EXISTS = 9  # [ns, keys] -> [tier of each leading present block]: a prefix chain's hits, without leases
OP_NAMES = {HELLO: "Hello", LOOKUP: "Lookup", RELEASE: "Release", PUT: "Put", ALLOCATE: "Allocate",
            COMMIT: "Commit", ABORT: "Abort", TOUCH: "Touch", EXISTS: "Exists"}
