"""In-process transport: a client's calls go straight to a :class:`TieredStore` in this process.

For tests and for embedding the store in an engine's process: the same
contract as the socket transports, with no daemon. Reads are copied out of
the store and verified again after they land in the caller's buffer, as a
remote read would be.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.block import BlockKey, BlockMeta, checksum, copy_and_checksum
from kvstore.errors import CorruptBlock
from kvstore.store.tiered import TieredStore
from kvstore.transport.base import Block, BlockInfo, BlockPut, Deadline, Place, Transport


class InProcessTransport(Transport):
    """Calls ``store`` directly; the store stays the caller's to close."""

    name = "in-process"
    shared_memory = False

    def __init__(self, store: TieredStore) -> None:
        self._store = store

    def close(self) -> None:
        pass  # nothing held between calls

    def put(self, namespace: str, blocks: Sequence[BlockPut], deadline: Deadline) -> list[bool]:
        self._store.check_batch(blocks)
        keys = [BlockKey.checked(namespace, b.key) for b in blocks]
        out = []
        for key, block in zip(keys, blocks):
            deadline.check()
            view = memoryview(block.value).cast("B")
            meta = BlockMeta(len(view), checksum(view), block.parent, block.layout)
            stored, _ = self._store.put(key, view, meta, deadline.at)
            out.append(stored)
        return out

    def get_into(self, namespace: str, keys: Sequence[bytes], place: Place | None, deadline: Deadline,
                 ) -> list[Block | None]:
        self._store.check_batch(keys)
        checked = [BlockKey.checked(namespace, k) for k in keys]
        out: list[Block | None] = []
        for i, key in enumerate(checked):
            deadline.check()
            found = self._store.get(key)
            if found is None:
                out.append(None)
                continue
            data, meta, tier = found
            if place is None:
                buf = memoryview(bytearray(meta.size))
            else:
                buf = place(i, BlockInfo(key.key, meta.size, meta.layout, meta.parent))
                if buf is None:
                    out.append(None)
                    continue
                buf = buf[: meta.size]
            if copy_and_checksum(buf, data) != meta.checksum:
                raise CorruptBlock(f"block {key} changed while it was copied out: read it again")
            out.append(Block(key.key, buf.obj if place is None else buf, meta.layout, meta.parent, tier))
        return out
