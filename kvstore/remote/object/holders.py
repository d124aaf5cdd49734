"""ObjectHolders: when an object leaves the bucket, its ``object`` holders leave the shared index.

Every daemon that uploaded a block, or read it through and kept only the
bucket's copy, is recorded in the prefix index as a holder of that block
with tier ``object`` (its best copy is the bucket's). When a sweep expires
the object, or a read finds it corrupt and deletes it, the daemon that did
it removes, for each such block, the ``object`` holder of **every** node
(``holders`` then ``remove`` at each holder's epoch), so routers and peers
stop counting the block at once, not at each node's next read of it. A
holder whose best tier is local (RAM, disk) is left: that node still has
the bytes.

A node whose store still lists the bucket copy forgets it at its next read
(a miss); if it re-publishes its whole holdings before that (an index
outage, a restart of its agent) the entry comes back until that read.
Removals run on the index agent's loop, batched by namespace, and never
hold up the sweep; an index that cannot be reached is logged and skipped
(the entries then go the old way, at the next read).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Sequence

from kvstore.block import BlockKey, TierName
from kvstore.errors import StrataError
from kvstore.index.base import MAX_CHAIN_BLOCKS, PrefixIndex

log = logging.getLogger(__name__)


class ObjectHolders:
    def __init__(self, index: PrefixIndex, loop: asyncio.AbstractEventLoop, timeout_s: float = 30.0) -> None:
        """``loop``: the one the index client belongs to (the daemon's index agent loop)."""
        self._index, self._loop, self._timeout_s = index, loop, timeout_s

    def forget(self, keys: Sequence[BlockKey]):
        """Schedule the removal of every node's ``object`` holding of ``keys`` (from any thread);
        the returned future completes with how many entries went."""
        future = asyncio.run_coroutine_threadsafe(
            asyncio.wait_for(self.remove(list(keys)), self._timeout_s), self._loop
        )
        future.add_done_callback(_log_failure)
        return future

    async def remove(self, keys: list[BlockKey]) -> int:
        """On the index's loop: remove the ``object`` holders of ``keys``; how many entries went."""
        by_ns: dict[str, list[bytes]] = defaultdict(list)
        for key in dict.fromkeys(keys):
            by_ns[key.namespace].append(key.key)
        removed = 0
        for namespace, names in by_ns.items():
            for i in range(0, len(names), MAX_CHAIN_BLOCKS):
                batch = names[i:i + MAX_CHAIN_BLOCKS]
                try:
                    removed += await self._remove_batch(namespace, batch)
                except StrataError as err:
                    log.warning("could not remove %d swept blocks of %r from the index: %s", len(batch),
                                namespace, err)
        return removed

    async def _remove_batch(self, namespace: str, keys: list[bytes]) -> int:
        per_node: dict[tuple[str, int], list[bytes]] = defaultdict(list)
        for key, holders in zip(keys, await self._index.holders(namespace, keys)):
            for h in holders:
                if h.tier is TierName.OBJECT:
                    per_node[(h.node_id, h.epoch)].append(key)
        for (node_id, epoch), names in per_node.items():
            await self._index.remove(namespace, node_id, epoch, names)
        return sum(len(v) for v in per_node.values())


def _log_failure(future) -> None:
    err = None if future.cancelled() else future.exception()
    if isinstance(err, TimeoutError):
        log.warning("removing swept blocks from the index took too long; their entries go at the next read")
    elif err is not None:
        log.error("removing swept blocks from the index failed: %r", err)
