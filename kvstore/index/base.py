"""The prefix index contract: which nodes hold which blocks, and who is alive.

Routers ask "for this chain of block keys, how many leading blocks does each
node hold, and in which tier?"; a decode node asks "who holds these blocks?".
Both answers come in one round trip and never name a holder that is not
current: a node that deregistered, missed its heartbeats, or restarted (its
epoch grew) drops out of every answer at once, before any background sweep
has removed its rows.

Two implementations pass one contract suite (``tests/index/test_index_contract.py``):
:class:`~kvstore.index.memory.MemoryIndex`, the daemon's embedded default,
and :class:`~kvstore.index.redis.RedisIndex` (single node or Cluster).

Keys are bytes (a 32-byte vLLM hash, its 8-byte event form, or any client
key); a namespace isolates tenants and models as in the store. Every backend
checks its input with the ``check_*`` functions at the bottom of this module,
so each refuses the same calls with the same messages.

Errors (in :mod:`kvstore.errors`, re-exported here)::

    StrataError
    └── PrefixIndexError
        ├── IndexUnavailable     the backing service cannot be reached (UNAVAILABLE)
        └── StaleEpoch           a write names an epoch older than the node's current one
"""

from __future__ import annotations

import abc
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvstore.block import MAX_KEY_BYTES, TierName, validate_key
from kvstore.errors import IndexUnavailable, InvalidArgument, PrefixIndexError, StaleEpoch

__all__ = ["Holder", "IndexUnavailable", "NodeInfo", "NodeMatch", "PrefixIndex", "PrefixIndexError", "StaleEpoch"]

MAX_CHAIN_BLOCKS = 4096  # keys, blocks or candidates in one call
MAX_NODE_ID_CHARS = 256
MAX_EPOCH = (1 << 63) - 1
MAX_TTL_S = 86400.0
MAX_ADDRESS_CHARS = 256  # an advertised address or one transport endpoint
MAX_TRANSPORTS = 16
MAX_COUNTER = (1 << 63) - 1
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]{0,31}")


@dataclass(frozen=True, slots=True)
class Holder:
    node_id: str
    tier: TierName
    epoch: int


@dataclass(frozen=True, slots=True)
class NodeMatch:
    """One node's answer to a chain lookup."""

    node_id: str
    blocks: int  # leading blocks of the chain this node holds
    tier: TierName  # the slowest tier among those leading blocks (what loading them costs)


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A node as the index knows it, with what a peer needs to reach it.

    ``address`` is the host:port of its gRPC service as other nodes reach it
    (the daemon's advertised address); ``transports`` are its data-plane
    endpoints, ``scheme://host:port``, in the node's order of preference
    (``grpc://10.0.0.2:50051``, ``tcp://10.0.0.2:50061``). Both are what the
    node gave at its latest ``join``; empty when it advertised none.
    ``served`` is what it reported at its latest ``heartbeat``.
    """

    node_id: str
    epoch: int
    alive: bool
    address: str = ""
    transports: tuple[str, ...] = ()
    # Block bytes its peer listeners served to other nodes since its epoch began, by transport
    # scheme, sorted: what its latest heartbeat carried (``()``: none reported, or none yet).
    served: tuple[tuple[str, int], ...] = ()

    @property
    def host(self) -> str:
        """The host part of ``address`` ("" when none): how a peer tells a node on its own host."""
        return address_host(self.address)

    @property
    def served_bytes(self) -> dict[str, int]:
        """``served`` as a dict: transport scheme -> bytes."""
        return dict(self.served)

    def endpoint(self, scheme: str) -> str | None:
        """The ``host:port`` of its first transport of ``scheme``, or None when it has none."""
        for t in self.transports:
            s, _, rest = t.partition("://")
            if s == scheme:
                return rest
        return None


class PrefixIndex(abc.ABC):
    """All methods are coroutines; implementations bound every batch they accept."""

    @abc.abstractmethod
    async def join(
        self, node_id: str, epoch: int, ttl_s: float, *, address: str = "", transports: Sequence[str] = ()
    ) -> None:
        """Register (or re-register) a node. A greater epoch than the known one means the
        node restarted: its older entries stop counting at once. A smaller one raises StaleEpoch.
        ``address`` and ``transports`` (see :class:`NodeInfo`) replace what the node advertised
        before, at every join; ``nodes`` reports them until the node leaves."""

    @abc.abstractmethod
    async def heartbeat(self, node_id: str, epoch: int, ttl_s: float, *, served: Mapping[str, int] | None = None) -> None:
        """Keep a node alive for ``ttl_s`` more seconds; StaleEpoch if the epoch is old.
        ``served`` (transport scheme -> block bytes its peer listeners served this epoch) replaces
        what the node's record reports; None leaves it. A new incarnation starts with none."""

    @abc.abstractmethod
    async def leave(self, node_id: str) -> None:
        """The node is gone: drop it from answers now and delete its entries (O(its blocks))."""

    @abc.abstractmethod
    async def add(self, namespace: str, node_id: str, epoch: int, blocks: Sequence[tuple[bytes, TierName]]) -> None:
        """Record that the node holds these blocks (a re-add updates the tier)."""

    @abc.abstractmethod
    async def remove(self, namespace: str, node_id: str, epoch: int, keys: Sequence[bytes]) -> None:
        """Record that the node no longer holds these blocks."""

    @abc.abstractmethod
    async def clear(self, node_id: str, namespace: str | None = None) -> None:
        """Drop every entry of the node (in one namespace, or all), in O(its blocks)."""

    @abc.abstractmethod
    async def lookup(
        self, namespace: str, keys: Sequence[bytes], candidates: Sequence[str] | None = None
    ) -> list[NodeMatch]:
        """Per live node (among ``candidates`` if given) the leading blocks of ``keys`` it holds,
        longest first; nodes holding none are left out. One round trip; stops at the first miss."""

    @abc.abstractmethod
    async def holders(self, namespace: str, keys: Sequence[bytes]) -> list[list[Holder]]:
        """For each key, its current holders (live nodes at their current epoch)."""

    @abc.abstractmethod
    async def nodes(self) -> list[NodeInfo]:
        """Known nodes with their epoch and liveness."""

    @abc.abstractmethod
    async def sweep(self, max_entries: int = 1000) -> int:
        """Delete up to ``max_entries`` rows of dead or stale holders; returns how many."""

    async def close(self) -> None:
        """Release connections."""


# ---- what every backend shares: input checks and the order of answers ------------


def sort_matches(matches: Iterable[NodeMatch]) -> list[NodeMatch]:
    """Longest prefix first; node id breaks ties so answers are deterministic."""
    return sorted(matches, key=lambda m: (-m.blocks, m.node_id))


def check_node_id(node_id: str) -> str:
    if not isinstance(node_id, str) or not node_id:
        raise InvalidArgument("node id must be a non-empty string (the daemon's node_id)")
    if len(node_id) > MAX_NODE_ID_CHARS:
        raise InvalidArgument(f"node id is {len(node_id)} characters; the limit is {MAX_NODE_ID_CHARS}")
    return node_id


def check_node(node_id: str, epoch: int) -> None:
    check_node_id(node_id)
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch <= MAX_EPOCH:
        raise InvalidArgument(f"epoch must be an integer from 0 to 2**63-1, not {epoch!r}")


def check_ttl(ttl_s: float) -> None:
    if not isinstance(ttl_s, (int, float)) or not math.isfinite(ttl_s) or not 0 < ttl_s <= MAX_TTL_S:
        raise InvalidArgument(f"ttl_s must be a number of seconds above 0 and at most {MAX_TTL_S:g}, not {ttl_s!r}")


def address_host(address: str) -> str:
    """``10.0.0.2:50051`` -> ``10.0.0.2``; ``[fd00::2]:50051`` -> ``fd00::2``; "" for ""."""
    host = address.rpartition(":")[0] if ":" in address else address
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def check_contact(address: str, transports: Sequence[str]) -> tuple[str, tuple[str, ...]]:
    """A node's advertised address and transports, as every backend stores them."""

    def plain(text: object, what: str) -> str:
        if not isinstance(text, str):
            raise InvalidArgument(f"{what} must be a string, not {type(text).__name__}")
        if len(text) > MAX_ADDRESS_CHARS:
            raise InvalidArgument(f"{what} is {len(text)} characters; the limit is {MAX_ADDRESS_CHARS}")
        if not text.isprintable() or any(c.isspace() for c in text):
            raise InvalidArgument(f"{what} {text!r} holds spaces or control characters: give host:port")
        return text

    address = plain(address, "the advertised address")
    if address and not address.rpartition(":")[2].isdigit():
        raise InvalidArgument(f"the advertised address {address!r} is not host:port")
    if isinstance(transports, (str, bytes)):
        raise InvalidArgument("transports must be a sequence of scheme://host:port strings, not one string")
    transports = tuple(transports)
    if len(transports) > MAX_TRANSPORTS:
        raise InvalidArgument(f"{len(transports)} transports; a node advertises at most {MAX_TRANSPORTS}")
    for t in transports:
        scheme, sep, rest = plain(t, "a transport").partition("://")
        if not sep or not scheme or not rest.rpartition(":")[2].isdigit():
            raise InvalidArgument(f"transport {t!r} is not scheme://host:port (e.g. grpc://10.0.0.2:50051)")
    return address, transports


def check_served(served: Mapping[str, int] | None) -> tuple[tuple[str, int], ...] | None:
    """A heartbeat's served-bytes counters, as every backend stores them: sorted (scheme, bytes)."""
    if served is None:
        return None
    if not isinstance(served, Mapping):
        raise InvalidArgument(f"served must be a mapping of transport scheme to bytes, not {type(served).__name__}")
    if len(served) > MAX_TRANSPORTS:
        raise InvalidArgument(f"{len(served)} served counters; a node reports at most {MAX_TRANSPORTS}")
    out = []
    for scheme, n in served.items():
        if not isinstance(scheme, str) or not _SCHEME.fullmatch(scheme):
            raise InvalidArgument(f"served counter {scheme!r} is not a transport scheme such as tcp or grpc")
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_COUNTER:
            raise InvalidArgument(f"served bytes of {scheme} must be an integer from 0 to 2**63-1, not {n!r}")
        out.append((scheme, n))
    return tuple(sorted(out))


def check_budget(max_entries: int) -> None:
    if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
        raise InvalidArgument(f"max_entries must be a positive integer, not {max_entries!r}")


def check_keys(keys: Sequence[bytes], *, allow_empty: bool = False) -> list[bytes]:
    if isinstance(keys, (bytes, bytearray, str)):
        raise InvalidArgument("pass a sequence of keys, not a single key")
    if not keys and not allow_empty:
        raise InvalidArgument("the chain is empty: pass at least one block key")
    if len(keys) > MAX_CHAIN_BLOCKS:
        raise InvalidArgument(f"{len(keys)} keys in one call; the limit is {MAX_CHAIN_BLOCKS}: split the batch")
    # Lookups are the hot path: a chain of plain, valid bytes passes in C-speed passes, not a call a key.
    if set(map(type, keys)) == {bytes} and min(map(len, keys)) > 0 and max(map(len, keys)) <= MAX_KEY_BYTES:
        return list(keys)
    return [validate_key(k) for k in keys]


def check_blocks(blocks: Sequence[tuple[bytes, TierName]]) -> list[tuple[bytes, TierName]]:
    if len(blocks) > MAX_CHAIN_BLOCKS:
        raise InvalidArgument(f"{len(blocks)} blocks in one call; the limit is {MAX_CHAIN_BLOCKS}: split the batch")
    out = []
    for key, tier in blocks:
        try:
            tier = TierName(tier)
        except ValueError:
            raise InvalidArgument(f"tier {tier!r} is not one of {[t.label for t in TierName]}") from None
        out.append((validate_key(key), tier))
    return out


def check_candidates(candidates: Sequence[str] | None) -> frozenset[str] | None:
    if candidates is None:
        return None
    if isinstance(candidates, str):
        raise InvalidArgument("candidates must be a sequence of node ids, not one string")
    if len(candidates) > MAX_CHAIN_BLOCKS:
        raise InvalidArgument(f"{len(candidates)} candidates; the limit is {MAX_CHAIN_BLOCKS}")
    return frozenset(check_node_id(c) for c in candidates)
