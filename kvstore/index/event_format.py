"""The vLLM KV-event wire format: what each engine publishes about its prefix cache, parsed.

vLLM (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``)
publishes every change of its prefix cache on a ZMQ PUB socket
(``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``)::

    multipart  (topic, seq, payload)      topic: KVEventsConfig.topic ("" by default)
                                          seq:   8 bytes, big-endian, 0, 1, 2, ... per publisher
                                          payload: msgpack of one EventBatch (msgspec encoder)

    EventBatch       [ts, events, data_parallel_rank]        array_like (older releases: [ts, events])
                  or {"ts": .., "events": [..], "data_parallel_rank": ..}   (newest: a map)
    event, older     ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                      lora_id, medium, lora_name, extra_keys, group_idx, ...]   (tag first)
    event, newer     {"type": "BlockStored", "block_hashes": .., ...}           (tagged map)
                     ["BlockRemoved", block_hashes, medium, group_idx] / {"type": "BlockRemoved", ..}
                     ["AllBlocksCleared"] / {"type": "AllBlocksCleared"}

The two levels changed form in different releases (an array batch of map events exists
too); each level is accepted in either form. Newer fields (``kv_cache_spec_kind``,
``kv_cache_spec_sliding_window``, ``locality``, ...) follow ``group_idx`` and are
ignored, as are unknown map keys.

``group_idx`` names the KV-cache group of a hybrid model (full attention, sliding window,
Mamba state, ...): the same block hash is stored once per group and removed per group, a
sliding window dropping old blocks from its group only. An engine's key stays in the index
while any (medium, group, copy) holds it (:class:`kvstore.index.holdings.EngineHoldings`); ``AllBlocksCleared`` empties
every group. Events without ``group_idx`` (older releases, one group) count as group 0.

Block hashes are 64-bit ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, the default) or the
raw digest bytes; both become the same 8-byte key (vLLM's own conversion,
``int.from_bytes(h, "big") & (2**64 - 1)``, as :mod:`kvstore.index.keys` computes it), so
events and router-computed keys name a block alike. ``medium`` is ``"GPU"``, ``"CPU"`` or
``"Disk"`` (``vllm/v1/kv_offload/mediums.py``); absent means GPU.

Replay (``replay_endpoint``): a ROUTER socket. A client sends ``(b"", start_seq)`` (8 bytes
big-endian; a REQ socket adds the empty frame itself) and receives, for every buffered batch
with ``seq >= start_seq``, ``(b"", seq, payload)``, then the end marker
``(b"", (-1).to_bytes(8, "big", signed=True), b"")``. The buffer holds the last
``buffer_steps`` batches (10 000 by default), so a replay can come back short.

:func:`decode_batch` is the pure parser; :mod:`kvstore.index.events` applies what it reads.

Errors, beyond :mod:`kvstore.errors`::

    InvalidArgument
    └── MalformedEvent        a message that is not a vLLM KV-event batch; ``reason`` says how
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from kvstore.block import TierName
from kvstore.errors import InvalidArgument

SEQ_BYTES = 8
REPLAY_END = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
MAX_PAYLOAD_BYTES = 64 << 20
MAX_HASH_BYTES = 64
MAX_KV_CACHE_GROUPS = 256  # group_idx bound (hybrid models have a few groups; each costs bits per key)
_U64 = (1 << 64) - 1

# Bounded label values of strata_kv_events_malformed_total.
R_FRAMES = "frames"  # not three frames
R_SEQ = "seq"  # the seq frame is not 8 bytes
R_TOO_LARGE = "too_large"  # payload over the configured limit
R_MSGPACK = "msgpack"  # not msgpack, truncated, or trailing bytes
R_BATCH = "batch"  # msgpack, but not an EventBatch
R_EVENT = "event"  # an event of a known type with missing or mistyped fields
R_HASH = "hash"  # a block hash that is neither a 64-bit int nor digest bytes
REASONS = (R_FRAMES, R_SEQ, R_TOO_LARGE, R_MSGPACK, R_BATCH, R_EVENT, R_HASH)


class MalformedEvent(InvalidArgument):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"malformed KV-event message ({reason}): {message}")
        self.reason = reason


# ---------------------------------------------------------------------------------------------
# The parser


BlockHash = int | bytes


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None
    unknown_events: int = 0  # events of a type this parser does not know, left out of ``events``


def _hashes(v: Any) -> tuple[BlockHash, ...]:
    if not isinstance(v, list):
        raise MalformedEvent(R_EVENT, f"block_hashes is {type(v).__name__}, not a list")
    return tuple(_hash(h) for h in v)


def _hash(h: Any) -> BlockHash:
    if isinstance(h, int) and not isinstance(h, bool):
        if 0 <= h <= _U64:
            return h
        if -(1 << 63) <= h < 0:  # a signed 64-bit form (other engines): the same 64 bits
            return h & _U64
        raise MalformedEvent(R_HASH, f"block hash {h} does not fit in 64 bits")
    if isinstance(h, bytes) and 0 < len(h) <= MAX_HASH_BYTES:
        return h
    raise MalformedEvent(R_HASH, f"block hash is {type(h).__name__}, not a 64-bit int or digest bytes")


def _opt_hash(v: Any) -> BlockHash | None:
    return None if v is None else _hash(v)


def _int(v: Any) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise MalformedEvent(R_EVENT, f"expected an int, got {type(v).__name__}")


def _opt_int(v: Any) -> int | None:
    return None if v is None else _int(v)


def _opt_str(v: Any) -> str | None:
    if v is None or isinstance(v, str):
        return v
    raise MalformedEvent(R_EVENT, f"expected a str or nil, got {type(v).__name__}")


def _ints(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise MalformedEvent(R_EVENT, f"token_ids is {type(v).__name__}, not a list")
    return tuple(v)  # not used to key anything; element types are not checked


def _opt_group(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_KV_CACHE_GROUPS:
        return v
    raise MalformedEvent(R_EVENT, f"group_idx is {v!r}, not a KV-cache group index from 0 to {MAX_KV_CACHE_GROUPS - 1}")


def _opt_list(v: Any) -> tuple[Any, ...] | None:
    if v is None:
        return None
    if isinstance(v, list):
        return tuple(v)
    raise MalformedEvent(R_EVENT, f"expected a list or nil, got {type(v).__name__}")


# Per event type: the fields in vLLM's declaration order (the positional form's order), how
# to check each, and how many lead fields have no default (msgspec always writes those).
_EVENT_SPECS: dict[str, tuple[type, tuple[tuple[str, Any], ...], int]] = {
    "BlockStored": (
        BlockStored,
        (
            ("block_hashes", _hashes),
            ("parent_block_hash", _opt_hash),
            ("token_ids", _ints),
            ("block_size", _int),
            ("lora_id", _opt_int),
            ("medium", _opt_str),
            ("lora_name", _opt_str),
            ("extra_keys", _opt_list),
            ("group_idx", _opt_group),
        ),
        4,
    ),
    "BlockRemoved": (BlockRemoved, (("block_hashes", _hashes), ("medium", _opt_str), ("group_idx", _opt_group)), 1),
    "AllBlocksCleared": (AllBlocksCleared, (), 0),
}


def _decode_event(raw: Any) -> KVEvent | None:
    """One event in either encoding; ``None`` for a type this parser does not know."""
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise MalformedEvent(R_EVENT, "a positional event does not start with its type name")
        tag, values = raw[0], raw[1:]
        spec = _EVENT_SPECS.get(tag)
        if spec is None:
            return None
        cls, fields, required = spec
        if len(values) < required:
            raise MalformedEvent(R_EVENT, f"{tag} has {len(values)} fields; at least {required} expected")
        kwargs = {name: check(v) for (name, check), v in zip(fields, values)}  # extra trailing fields ignored
        return cls(**kwargs)
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise MalformedEvent(R_EVENT, "a map event has no str 'type'")
        spec = _EVENT_SPECS.get(tag)
        if spec is None:
            return None
        cls, fields, required = spec
        kwargs = {}
        for i, (name, check) in enumerate(fields):
            if name in raw:
                kwargs[name] = check(raw[name])
            elif i < required:
                raise MalformedEvent(R_EVENT, f"{tag} has no {name!r}")
        return cls(**kwargs)
    raise MalformedEvent(R_EVENT, f"an event is {type(raw).__name__}, not an array or a map")


def decode_batch(payload: bytes, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> EventBatch:
    """The batch in one message's payload, in either of vLLM's encodings.

    Unknown event types are counted in ``unknown_events`` and left out; unknown extra
    fields (trailing positional ones, or extra map keys) are ignored. Anything else that
    does not match raises :class:`MalformedEvent`.
    """
    if len(payload) > max_bytes:
        raise MalformedEvent(R_TOO_LARGE, f"payload is {len(payload)} bytes; the limit is {max_bytes}")
    try:
        raw = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=True)
    except (msgpack.UnpackException, ValueError, TypeError) as e:  # ExtraData, truncation, bad utf-8
        raise MalformedEvent(R_MSGPACK, f"{type(e).__name__}: {e}") from None
    if isinstance(raw, list):
        if len(raw) < 2:
            raise MalformedEvent(R_BATCH, f"a positional batch has {len(raw)} fields; [ts, events, dp_rank] expected")
        ts, events, dp = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        if "ts" not in raw or "events" not in raw:
            raise MalformedEvent(R_BATCH, "a map batch lacks 'ts' or 'events'")
        ts, events, dp = raw["ts"], raw["events"], raw.get("data_parallel_rank")
    else:
        raise MalformedEvent(R_BATCH, f"the payload is a msgpack {type(raw).__name__}, not a batch")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise MalformedEvent(R_BATCH, f"ts is {type(ts).__name__}, not a number")
    if not isinstance(events, list):
        raise MalformedEvent(R_BATCH, f"events is {type(events).__name__}, not a list")
    if dp is not None and (isinstance(dp, bool) or not isinstance(dp, int)):
        raise MalformedEvent(R_BATCH, f"data_parallel_rank is {type(dp).__name__}, not an int")
    decoded: list[KVEvent] = []
    unknown = 0
    for raw_event in events:
        event = _decode_event(raw_event)
        if event is None:
            unknown += 1
        else:
            decoded.append(event)
    return EventBatch(float(ts), tuple(decoded), dp, unknown)


def split_message(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """``(topic, seq, payload)`` of one multipart message from the PUB socket."""
    if len(frames) != 3:
        raise MalformedEvent(R_FRAMES, f"{len(frames)} frames; (topic, seq, payload) expected")
    topic, seq, payload = frames
    if len(seq) != SEQ_BYTES:
        raise MalformedEvent(R_SEQ, f"the seq frame is {len(seq)} bytes; {SEQ_BYTES} expected")
    return bytes(topic), int.from_bytes(seq, "big"), bytes(payload)


def block_key(block_hash: BlockHash) -> bytes:
    """The index key of an event's block hash: 8 bytes big-endian of the 64-bit form.

    A digest in bytes is folded the way vLLM folds it for int events, so both forms name
    the block alike (and equal :func:`kvstore.index.keys.event_key_bytes`).
    """
    if isinstance(block_hash, bytes):
        block_hash = int.from_bytes(block_hash, "big") & _U64
    return block_hash.to_bytes(8, "big")


_MEDIUM_TIERS = {"GPU": TierName.GPU, "CPU": TierName.HOST, "DISK": TierName.DISK}


def medium_tier(medium: str | None) -> TierName | None:
    """The tier of a vLLM medium; absent means GPU (vLLM's default); ``None`` if unknown."""
    if medium is None:
        return TierName.GPU
    return _MEDIUM_TIERS.get(medium.upper())
