"""The indexer HTTP API's requests and answers, in the shapes gateways share (Mooncake RFC #1403).

Mooncake Conductor and Dynamo's standalone indexer serve one API to gateways:
``POST /query`` with a prompt's token ids, ``POST /query_by_hash`` with its
block hashes, and ``POST /register`` / ``/unregister`` for the engines whose KV
events the indexer follows. This module reads those bodies and computes the
answers from Strata's own :class:`~kvstore.index.base.PrefixIndex`; the HTTP
server around it is :mod:`kvstore.indexer.server`.

Keys. The token ids are hashed exactly as the engines hash them
(:class:`~kvstore.index.keys.BlockHasher`: vLLM's ``sha256_cbor`` with the
engines' ``PYTHONHASHSEED``, the request's ``lora_name`` and ``cache_salt``)
and folded to the 8-byte form KV events carry (:func:`~kvstore.index.keys.event_key_bytes`),
the form the subscriber records; ``seq_hashes`` are taken in that form already
(64-bit ints as vLLM publishes them, or hex of the 8- or 32-byte hash).

Columns. One per Strata tier: ``GPU``, ``CPU`` (the host-RAM tier), ``DISK``,
``PEER``, ``OBJECT``. A column is cumulative, in tokens: the longest prefix the
instance holds in that tier *or a faster one* (so ``GPU <= CPU <= DISK <= PEER
<= OBJECT``), which is what loading from that tier at worst would reuse. The
index keeps one tier per (holder, block), its fastest copy, so "held in T or
faster" is what it can answer. ``longest_matched`` is the prefix held at all.

Instances and DP ranks. An engine registered with a ``dp_rank`` is recorded as
holder ``<instance_id>@dp<rank>``; any other holder id is an instance of its
own at rank 0. An instance's columns are the best of its ranks (a request goes
to one rank), and ``DP`` gives each rank's ``longest_matched``.

Namespaces. Blocks are looked up in the namespace ``namespace`` names when the
body gives it (a Strata extension), else ``<tenant_id>/<model>`` with a
tenant, else ``<model>``; ``/register`` records an engine's events under the
same rule, so a registered engine and the queries about it agree.

Limits: ``token_ids`` at most :data:`MAX_QUERY_TOKENS` (413), hashed up to the
index's chain limit (:data:`~kvstore.index.base.MAX_CHAIN_BLOCKS` blocks, a
longer prompt is answered on its head); ``seq_hashes`` at most that many (413).

Errors are the HTTP answers of :mod:`kvstore.router.errors` (the router's
tree; the server turns each into a JSON error body), plus two of its own::

    RequestRefused
    ├── BadRequest         400   a field missing, of the wrong type or out of range
    ├── Unauthorized       401   no bearer token, or not the server's
    ├── NotFound           404   /unregister of an instance not registered
    ├── Conflict           409   /register of an id registered with another endpoint
    └── BodyTooLarge       413   token_ids or seq_hashes over their caps
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.block import TierName, validate_namespace
from kvstore.errors import InvalidArgument
from kvstore.index.base import MAX_CHAIN_BLOCKS, MAX_NODE_ID_CHARS, Holder
from kvstore.index.keys import MAX_BLOCK_SIZE, BlockHasher, event_key_bytes
from kvstore.router.errors import BadRequest, BodyTooLarge, RequestRefused
from kvstore.router.prompt import encodable

__all__ = ["COLUMNS", "Conflict", "Query", "Registration", "Unauthorized", "instance_answers"]

MAX_QUERY_TOKENS = 1 << 18
MAX_SEQ_HASHES = MAX_CHAIN_BLOCKS
MAX_DP_RANK = 1023
DP_MARK = "@dp"
COLUMNS: tuple[tuple[str, TierName], ...] = (
    ("GPU", TierName.GPU), ("CPU", TierName.HOST), ("DISK", TierName.DISK),
    ("PEER", TierName.PEER), ("OBJECT", TierName.OBJECT),
)
_U64 = (1 << 64) - 1
_HEX = re.compile(r"(0x)?([0-9a-fA-F]{16}|[0-9a-fA-F]{64})")
_TCP = re.compile(r"tcp://[A-Za-z0-9.\-]{1,253}:[0-9]{1,5}|tcp://\[[0-9A-Fa-f:.]{2,45}\]:[0-9]{1,5}")
_DP_SUFFIX = re.compile(r"(.+)@dp([0-9]{1,4})")


class Unauthorized(RequestRefused):
    status = 401
    kind = "authentication_error"


class Conflict(RequestRefused):
    status = 409
    kind = "invalid_request_error"


@dataclass(frozen=True, slots=True)
class Query:
    """A lookup: the chain in event-key form, its namespace, and how to count its tokens."""

    namespace: str
    keys: tuple[bytes, ...]
    block_size: int
    instance_id: str | None = None
    # The node daemons' copies through vLLM's Strata tier: its namespace and its chunks' 32-byte keys (the
    # hash of each chunk's last block), blocks_per_chunk blocks each. Empty: not asked.
    tier_namespace: str = ""
    tier_keys: tuple[bytes, ...] = ()
    blocks_per_chunk: int = 1


@dataclass(frozen=True, slots=True)
class Registration:
    """An engine's event stream as ``/register`` gave it."""

    instance_id: str
    dp_rank: int | None
    endpoint: str
    namespace: str
    replay_endpoint: str | None = None
    topic: str = ""

    @property
    def holder_id(self) -> str:
        return self.instance_id if self.dp_rank is None else f"{self.instance_id}{DP_MARK}{self.dp_rank}"

    def as_json(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "dp_rank": self.dp_rank, "endpoint": self.endpoint,
                "replay_endpoint": self.replay_endpoint, "namespace": self.namespace, "topic": self.topic}


def split_holder(node_id: str) -> tuple[str, int]:
    """``vllm-0@dp1`` -> (``vllm-0``, 1); any other id is its own instance at rank 0."""
    m = _DP_SUFFIX.fullmatch(node_id)
    return (m.group(1), int(m.group(2))) if m else (node_id, 0)


# ---- reading bodies ------------------------------------------------------------------------


def _field(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], what: str, *, required: bool = False):
    value = body.get(name)
    if value is None:
        if required:
            raise BadRequest(f"'{name}' is required: {what}")
        return None
    if isinstance(value, bool) or not isinstance(value, kind):
        raise BadRequest(f"'{name}' must be {what}, not {type(value).__name__}")
    return value


def _int_field(body: Mapping[str, Any], name: str, low: int, high: int, what: str, *, required: bool = False):
    value = _field(body, name, int, what, required=required)
    if value is not None and not low <= value <= high:
        raise BadRequest(f"'{name}' is {value}; give {what} ({low}..{high})")
    return value


def namespace_of(body: Mapping[str, Any]) -> str:
    """The namespace a body's blocks are recorded in: ``namespace``, else ``tenant_id/model``, else ``model``."""
    given = _field(body, "namespace", str, "a Strata namespace")
    if given is None:
        model = _field(body, "model", str, "the served model's name (the namespace its engines' events use)",
                       required=True)
        tenant = _field(body, "tenant_id", (str, int), "a tenant id (string or integer)")
        given = model if tenant is None else f"{tenant}/{model}"
    try:
        return validate_namespace(given)
    except InvalidArgument as err:
        raise BadRequest(f"{err} (from 'namespace', or 'tenant_id' and 'model')") from None


def _instance_id(body: Mapping[str, Any], *, required: bool) -> str | None:
    value = _field(body, "instance_id", (str, int), "the engine instance's id (string or integer)", required=required)
    if value is None:
        return None
    text = str(value)
    if not text or len(text) > MAX_NODE_ID_CHARS - len(DP_MARK) - 4 or not text.isprintable():
        raise BadRequest(f"'instance_id' must be 1..{MAX_NODE_ID_CHARS - 8} printable characters")
    return text


def _block_size(body: Mapping[str, Any]) -> int:
    return _int_field(body, "block_size", 1, MAX_BLOCK_SIZE, "tokens per block, the engines' --block-size",
                      required=True)


def parse_query(body: Mapping[str, Any], hash_seed: str, default_tier_namespace: str = "",
                default_blocks_per_chunk: int = 1) -> tuple[Query, list[int], BlockHasher, str | None]:
    """``/query``'s body checked: the query without its keys yet, the tokens to hash, the hasher, the salt.

    Hashing is left to the caller, which may run it off the event loop (a SHA-256 per block).
    """
    namespace = namespace_of(body)
    block_size = _block_size(body)
    tokens = body.get("token_ids")
    if not isinstance(tokens, list):
        raise BadRequest("'token_ids' is required: the prompt's token ids, a list of integers")
    if len(tokens) > MAX_QUERY_TOKENS:
        raise BodyTooLarge(f"'token_ids' holds {len(tokens)} ids; the limit is {MAX_QUERY_TOKENS}: "
                           "send the prompt's head (only its leading full blocks can match)")
    if not all(type(t) is int and 0 <= t <= _U64 for t in tokens):
        pos = next(i for i, t in enumerate(tokens) if not (type(t) is int and 0 <= t <= _U64))
        raise BadRequest(f"token_ids[{pos}] is {tokens[pos]!r}; token ids are integers in 0..2**64-1")
    lora = _field(body, "lora_name", str, "the LoRA adapter's name, as the engine was asked for it") or None
    salt = _field(body, "cache_salt", str, "the request's cache_salt") or None
    salt = encodable(salt) if salt is not None else None  # as the router scores it: U+FFFD for a lone surrogate
    full = min(len(tokens) // block_size, MAX_CHAIN_BLOCKS) * block_size
    hasher = BlockHasher(block_size, hash_seed, lora)
    tier_namespace = _field(body, "tier_namespace", str, "the namespace of vLLM's Strata tier, "
                            "vllm/<model>@<layout>/g0 (the daemon log names it)") or default_tier_namespace
    if tier_namespace:
        validate_tier_namespace(tier_namespace)
    per_chunk = _int_field(body, "blocks_per_chunk", 1, MAX_CHAIN_BLOCKS, "blocks per chunk of vLLM's offloading "
                           "(its block_size over the engine's)")
    query = Query(namespace, (), block_size, _instance_id(body, required=False), tier_namespace,
                  blocks_per_chunk=per_chunk or default_blocks_per_chunk)
    return query, tokens[:full], hasher, salt


def validate_tier_namespace(name: str) -> str:
    try:
        return validate_namespace(name)
    except InvalidArgument as err:
        raise BadRequest(f"'tier_namespace': {err}") from None


def hash_chain(query: Query, tokens: list[int], hasher: BlockHasher, salt: str | None) -> Query:
    """The query with its keys: the tokens' block hashes in event form, and (with a tier namespace) the
    32-byte key of each chunk's last block, as vLLM's offloading names a chunk."""
    chain = hasher.chain(tokens, cache_salt=salt)
    keys = tuple(event_key_bytes(h) for h in chain)
    tier_keys = tuple(chain[query.blocks_per_chunk - 1::query.blocks_per_chunk]) if query.tier_namespace else ()
    return Query(query.namespace, keys, query.block_size, query.instance_id, query.tier_namespace, tier_keys,
                 query.blocks_per_chunk)


def _seq_hash(value: Any, pos: int) -> bytes:
    if type(value) is int and 0 <= value <= _U64:
        return event_key_bytes(value)
    if type(value) is int and -(1 << 63) <= value < 0:  # a signed 64-bit form of the same hash
        return event_key_bytes(value & _U64)
    if isinstance(value, str) and (m := _HEX.fullmatch(value)):
        raw = bytes.fromhex(m.group(2))
        return raw if len(raw) == 8 else event_key_bytes(raw)
    raise BadRequest(f"seq_hashes[{pos}] is {str(value)[:80]!r}; give the 64-bit block hash as an integer "
                     "(as KV events carry it) or as hex of its 8 or 32 bytes")


def parse_query_by_hash(body: Mapping[str, Any]) -> Query:
    namespace = namespace_of(body)
    block_size = _block_size(body)
    hashes = body.get("seq_hashes", body.get("block_hashes"))
    if not isinstance(hashes, list) or not hashes:
        raise BadRequest("'seq_hashes' is required: the chain's block hashes, head first, a non-empty list")
    if len(hashes) > MAX_SEQ_HASHES:
        raise BodyTooLarge(f"'seq_hashes' holds {len(hashes)} hashes; the limit is {MAX_SEQ_HASHES}: "
                           "send the chain's head")
    keys = tuple(_seq_hash(h, i) for i, h in enumerate(hashes))
    return Query(namespace, keys, block_size, _instance_id(body, required=False))


def parse_registration(body: Mapping[str, Any]) -> Registration:
    instance = _instance_id(body, required=True)
    dp_rank = _int_field(body, "dp_rank", 0, MAX_DP_RANK, "the engine's data-parallel rank")
    endpoints = []
    for name in ("endpoint", "replay_endpoint"):
        value = _field(body, name, str, "the engine's ZMQ socket as tcp://HOST:PORT", required=name == "endpoint")
        if value is not None and not _TCP.fullmatch(value):
            raise BadRequest(f"'{name}' is {value[:80]!r}; give the engine's ZMQ socket as tcp://HOST:PORT "
                             "(only tcp:// is followed)")
        endpoints.append(value)
    topic = _field(body, "topic", str, "the engine's KVEventsConfig.topic") or ""
    if len(topic) > 256:
        raise BadRequest(f"'topic' is {len(topic)} characters; the limit is 256")
    return Registration(instance, dp_rank, endpoints[0], namespace_of(body), endpoints[1], topic)


def parse_unregistration(body: Mapping[str, Any]) -> tuple[str, int | None]:
    instance = _instance_id(body, required=True)
    return instance, _int_field(body, "dp_rank", 0, MAX_DP_RANK, "the engine's data-parallel rank")


# ---- answers -------------------------------------------------------------------------------


def _runs(tiers: Sequence[TierName | None]) -> dict[TierName, int]:
    """Leading blocks held in each tier or a faster one (the first miss ends every run)."""
    runs = dict.fromkeys(TierName, 0)
    worst = 0
    for i, tier in enumerate(tiers):
        if tier is None:
            break
        worst = max(worst, tier)
        for t in TierName:
            if t >= worst:
                runs[t] = i + 1
    return runs


def instance_answers(holders: Sequence[Sequence[Holder]], block_size: int,
                     instance_id: str | None = None) -> dict[str, dict[str, Any]]:
    """Per instance, its columns in tokens (see the module docstring), from each key's holders.

    Instances holding none of the chain's first block are left out, except ``instance_id``
    when asked for (a miss is an answer: zeros).
    """
    per_holder: dict[str, list[TierName | None]] = {}
    for i, found in enumerate(holders):
        for h in found:
            tiers = per_holder.setdefault(h.node_id, [None] * len(holders))
            tiers[i] = h.tier if tiers[i] is None else min(tiers[i], h.tier)
    by_instance: dict[str, dict[int, dict[TierName, int]]] = {}
    for node_id, tiers in per_holder.items():
        instance, rank = split_holder(node_id)
        if instance_id is not None and instance != instance_id:
            continue
        runs = _runs(tiers)
        if runs[TierName.OBJECT]:
            by_instance.setdefault(instance, {})[rank] = runs
    if instance_id is not None:
        by_instance.setdefault(instance_id, {})
    out: dict[str, dict[str, Any]] = {}
    for instance in sorted(by_instance):
        ranks = by_instance[instance]
        answer: dict[str, Any] = {
            "longest_matched": max((r[TierName.OBJECT] for r in ranks.values()), default=0) * block_size}
        for column, tier in COLUMNS:
            answer[column] = max((r[tier] for r in ranks.values()), default=0) * block_size
        answer["DP"] = {str(rank): ranks[rank][TierName.OBJECT] * block_size for rank in sorted(ranks)}
        out[instance] = answer
    return out


def merged(engines: dict[str, dict[str, Any]], nodes: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The engines' answers and the node daemons' (through vLLM's Strata tier) in one: an id in both gets the
    better of each column."""
    out = {k: dict(v) for k, v in engines.items()}
    for instance, answer in nodes.items():
        mine = out.setdefault(instance, answer)
        if mine is not answer:
            for column, value in answer.items():
                if column == "DP":
                    for rank, tokens in value.items():
                        mine["DP"][rank] = max(mine["DP"].get(rank, 0), tokens)
                else:
                    mine[column] = max(mine[column], value)
    return dict(sorted(out.items()))

