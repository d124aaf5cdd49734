from kvstore.client.aio import AsyncClient
from kvstore.client.codec import Block, BlockInfo, BlockPut, Listed, ListPage, PinLease, Stats
from kvstore.client.sync import Client

__all__ = ["AsyncClient", "Block", "BlockInfo", "BlockPut", "Client", "ListPage", "Listed", "PinLease", "Stats"]
