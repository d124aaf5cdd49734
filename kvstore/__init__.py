"""Strata KV store: a tiered block store for LLM prefix KV caches, its daemon and its client."""

from kvstore.block import BlockKey, BlockMeta, TierName
from kvstore.client import AsyncClient, Block, BlockInfo, BlockPut, Client, Listed, ListPage, PinLease, Stats

__all__ = [
    "AsyncClient", "Block", "BlockInfo", "BlockKey", "BlockMeta", "BlockPut", "Client", "ListPage", "Listed", "PinLease",
    "Stats", "TierName",
]
