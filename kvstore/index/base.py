"""The prefix index contract: which nodes hold which blocks, and who is alive.

Routers ask "for this chain of block keys, how many leading blocks does each
node hold, and in which tier?"; a decode node asks "who holds these blocks?".
Both answers come in one round trip and never name a holder that is not
current: a node that deregistered, missed its heartbeats, or restarted (its
epoch grew) drops out of every answer at once, before any background sweep
has removed its rows.

Two implementations pass one contract suite (``tests/test_index_contract.py``):
:class:`~kvstore.index.memory.MemoryIndex`, the daemon's embedded default,
and :class:`~kvstore.index.redis.RedisIndex` (single node or Cluster).

Keys are bytes (a 32-byte vLLM hash, its 8-byte event form, or any client
key); a namespace isolates tenants and models as in the store.

Errors (in :mod:`kvstore.errors`, re-exported here)::

    StrataError
    └── PrefixIndexError
        ├── IndexUnavailable     the backing service cannot be reached (UNAVAILABLE)
        └── StaleEpoch           a write names an epoch older than the node's current one
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.block import TierName
from kvstore.errors import IndexUnavailable, PrefixIndexError, StaleEpoch

__all__ = ["Holder", "IndexUnavailable", "NodeInfo", "NodeMatch", "PrefixIndex", "PrefixIndexError", "StaleEpoch"]

MAX_CHAIN_BLOCKS = 4096


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
    node_id: str
    epoch: int
    alive: bool


class PrefixIndex(abc.ABC):
    """All methods are coroutines; implementations bound every batch they accept."""

    @abc.abstractmethod
    async def join(self, node_id: str, epoch: int, ttl_s: float) -> None:
        """Register (or re-register) a node. A greater epoch than the known one means the
        node restarted: its older entries stop counting at once. A smaller one raises StaleEpoch."""

    @abc.abstractmethod
    async def heartbeat(self, node_id: str, epoch: int, ttl_s: float) -> None:
        """Keep a node alive for ``ttl_s`` more seconds; StaleEpoch if the epoch is old."""

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
