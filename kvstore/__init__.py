"""Strata KV store: a tiered block store for LLM prefix KV caches, its daemon and its client.

``from kvstore import Client`` is the front door. The client is imported on
first use of one of its names (a module ``__getattr__``), so ``import
kvstore.errors`` or ``kvstore.config`` (the weight pipeline, the engine
integrations, the CLI's start-up) does not load gRPC's asyncio layer, the
transports and shared memory.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvstore.block import BlockKey, BlockMeta, TierName

if TYPE_CHECKING:
    from kvstore.client import AsyncClient, Block, BlockInfo, BlockPut, Client, Listed, ListPage, PinLease, Stats

_CLIENT_NAMES = ("AsyncClient", "Block", "BlockInfo", "BlockPut", "Client", "ListPage", "Listed", "PinLease", "Stats")

__all__ = [*_CLIENT_NAMES, "BlockKey", "BlockMeta", "TierName"]


def __getattr__(name: str):
    if name in _CLIENT_NAMES:
        value = getattr(importlib.import_module("kvstore.client"), name)
        globals()[name] = value  # once: later lookups do not come here
        return value
    raise AttributeError(f"module 'kvstore' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_CLIENT_NAMES])
