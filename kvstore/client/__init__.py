from kvstore.client.codec import Block, BlockPut, PinLease, Stats
from kvstore.client.sync import Client

__all__ = ["Block", "BlockPut", "Client", "PinLease", "Stats"]
