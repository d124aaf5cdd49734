"""Strata KV store: a tiered block store for LLM prefix KV caches, its daemon and its client."""

from kvstore.block import BlockKey, BlockMeta, TierName
from kvstore.client import AsyncClient, Block, BlockPut, Client, PinLease, Stats

__all__ = ["AsyncClient", "Block", "BlockKey", "BlockMeta", "BlockPut", "Client", "PinLease", "Stats", "TierName"]
