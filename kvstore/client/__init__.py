from kvstore.client.aio import AsyncClient
from kvstore.client.codec import Block, BlockPut, PinLease, Stats
from kvstore.client.sync import Client

__all__ = ["AsyncClient", "Block", "BlockPut", "Client", "PinLease", "Stats"]
