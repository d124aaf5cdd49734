"""What nodes hold, written to the Redis prefix index: add, remove and clear a node's blocks
(a node's first write to a namespace attaches it there), and the purge of retired holders' rows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvstore.block import TierName, validate_namespace
from kvstore.errors import PrefixIndexError, StaleEpoch
from kvstore.index.base import check_blocks, check_keys, check_node, check_node_id
from kvstore.index.redis_membership import ATTACH, SPREAD, _older
from kvstore.index.redis_scripts import PURGE, RETIRE, WRITE, _chain

PURGE_BATCH = 4096  # rows one script deletes for leave/clear (each call is short; Redis stays responsive)


class _Holdings:
    """:class:`~kvstore.index.redis.RedisIndex`'s writes (a mixin of it)."""

    # ---- writes ----------------------------------------------------------------

    async def add(self, namespace: str, node_id: str, epoch: int, blocks: Sequence[tuple[bytes, TierName]]) -> None:
        validate_namespace(namespace)
        check_node(node_id, epoch)
        checked = check_blocks(blocks)
        if checked:
            keys = [key for key, _ in checked]
            await self._write(namespace, "add", node_id, epoch, [*_chain(keys), bytes(int(t) for _, t in checked)])

    async def remove(self, namespace: str, node_id: str, epoch: int, keys: Sequence[bytes]) -> None:
        validate_namespace(namespace)
        check_node(node_id, epoch)
        checked = check_keys(keys, allow_empty=True)
        if checked:
            await self._write(namespace, "del", node_id, epoch, _chain(checked))

    async def clear(self, node_id: str, namespace: str | None = None) -> None:
        check_node_id(node_id)
        if namespace is not None:
            namespaces = [validate_namespace(namespace)]
        else:
            namespaces = [n.decode() for n in await self._global(SPREAD, node_id)]
        lids = await asyncio.gather(*(self._ns(RETIRE, ns, node_id, "") for ns in namespaces))
        await asyncio.gather(*(self._purge(ns, lid) for ns, lid in zip(namespaces, lids) if lid))


    # ---- internals -------------------------------------------------------------

    async def _write(self, namespace: str, op: str, node_id: str, epoch: int, data: list) -> None:
        args = [op, node_id, str(epoch), "", 0, *data]
        r = await self._ns(WRITE, namespace, *args)
        if r[0] == b"NOJOIN":  # the namespace's mirror does not know this incarnation yet (or lapsed)
            a = await self._global(ATTACH, node_id, str(epoch), namespace)
            self._raise_refusal(node_id, epoch, a)
            args[3], args[4] = a[1], a[2]
            r = await self._ns(WRITE, namespace, *args)
        if r[0] == b"STALE":
            raise StaleEpoch(_older(node_id, epoch, r[1]))
        if r[0] in (b"NEWER", b"GONE"):
            raise StaleEpoch(f"node {node_id!r} at epoch {epoch} ended while writing: join again and re-add its blocks")
        if r[0] != b"OK":
            raise PrefixIndexError(f"unexpected answer from the index script: {r!r}")

    async def _purge(self, namespace: str, lid: int) -> None:
        while True:
            _, more = await self._ns(PURGE, namespace, lid, PURGE_BATCH)
            if not more:
                return
