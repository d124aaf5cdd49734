"""A streamed block written in place: its chunks land in the head's extent as they arrive.

A streamed Put knows its block's size at the header, before the bytes come.
The writer reserves the block's extent in the head then and copies each
chunk straight into it, checksumming as it goes: the bytes are copied once
(message to arena) and the daemon never holds a second copy of them. Commit
checks the writer's declared checksum and adopts the extent as the block;
abort (a broken, cancelled or idle stream) gives the extent back, so nothing
partial is ever stored.

Why not a slot of the slot protocol: a slot lease expires by itself, and its
extent may then go to another block while this stream still writes into it.
The writer's extent is reserved for as long as the stream lasts, and a
stream always ends (its handler's ``finally`` aborts the writer; the
server's stream watchdog ends a stream that stops sending).

When the head has no room at once (what is there is pinned, leased or still
being demoted), the writer does not wait at the header: it buffers the bytes
and stores them at commit as a plain :meth:`TieredStore.put`, which waits for
room until its deadline, as every streamed put did before. The server's byte
budget bounds what such buffers hold. A head the host cannot address in
place (device memory) is always written that way.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.block import BlockKey, BlockMeta, Checksummer, TierName
from kvstore.errors import CorruptBlock, InvalidArgument, TierFull
from kvstore.store.placement import HeadPlacement
from kvstore.store.state import StorePart, StoreState

Put = Callable[..., tuple[bool, TierName]]  # TieredStore.put


class StreamedWrites(StorePart):
    def __init__(self, state: StoreState, placement: HeadPlacement, put: Put) -> None:
        super().__init__(state)
        self._place = placement
        self._put = put

    def open(self, key: BlockKey, meta: BlockMeta) -> BlockWriter:
        """A writer for ``key``'s bytes: into a head extent reserved now, else into a buffer.

        A key already stored gets a writer that drops what it is sent and
        commits as (False, its tier), as a repeated put does.
        """
        self._s.checks.check_block(key, meta)
        with self._cond:
            self._s.known_namespace(key.namespace, write=True)
            entry = self._catalog.live(key)
            if entry is not None:
                self._s.touch_locked(key, entry)
                return BlockWriter(self, key, meta, present=self._s.best(entry))
            parent = self._s.pin_parent_locked(key, meta)
        if not self._head.host_addressable:  # device memory: buffered, then copied in by put
            self._unpin(parent)
            return BlockWriter(self, key, meta, buffer=bytearray(meta.size))
        try:
            offset = self._place.reserve(meta.size, deadline=self._clock())  # room now, or none: no wait
        except TierFull:
            self._unpin(parent)
            return BlockWriter(self, key, meta, buffer=bytearray(meta.size))
        except BaseException:
            self._unpin(parent)
            raise
        return BlockWriter(self, key, meta, offset=offset, parent=parent)

    def _unpin(self, keys: list[BlockKey]) -> None:
        if keys:
            with self._s.locked():
                for key in keys:
                    self._s.unpin_locked(key, self._catalog.entries[key])

    def _unreserve(self, offset: int) -> None:
        with self._cond:
            self._head.unreserve(offset)
            self._cond.notify_all()


class BlockWriter:
    """One block's bytes as a stream delivers them: :meth:`write` each chunk, then
    :meth:`commit`; :meth:`abort` in any case afterwards (a no-op once committed)."""

    def __init__(self, writes: StreamedWrites, key: BlockKey, meta: BlockMeta, *, offset: int | None = None,
                 parent: list[BlockKey] | None = None, buffer: bytearray | None = None,
                 present: TierName | None = None) -> None:
        self._writes = writes
        self.key = key
        self.meta = meta
        self.filled = 0
        self._offset = offset
        self._parent = parent or []
        self._buffer = buffer
        self._present = present
        self._view = None if offset is None else writes._head.view(offset, meta.size)
        self._sum = Checksummer()
        self._landed_verified = False

    @property
    def present(self) -> bool:
        """The key was already stored: the bytes are dropped, and the block is not stored again."""
        return self._present is not None

    @property
    def in_place(self) -> bool:
        return self._offset is not None

    def write(self, chunk: bytes | bytearray | memoryview) -> None:
        end = self.filled + len(chunk)
        if end > self.meta.size:
            raise InvalidArgument(
                f"block {self.key} declared {self.meta.size} bytes but at least {end} were sent; nothing of it was stored"
            )
        if self._view is not None:
            dst = self._view[self.filled : end]
            dst[:] = chunk
            self._sum.update(dst)  # the bytes as they now are in the arena, read back from cache
        elif self._buffer is not None:
            self._buffer[self.filled : end] = chunk
        self.filled = end

    def landing(self) -> memoryview:
        """Where a transport that lands bytes itself (``recv_into``) puts the whole block: the
        extent in the head, or the buffer. Call :meth:`landed` once it is filled, then commit."""
        if self._present is not None:
            raise InvalidArgument(f"block {self.key} is already stored: there is nothing to land")
        view = self._view if self._view is not None else memoryview(self._buffer)
        return view[: self.meta.size]

    def landed(self, verified: bool = False) -> None:
        """The whole block was written into :meth:`landing`. ``verified``: the transport hashed the
        bytes as they landed there and they matched ``meta.checksum`` (the TCP peer client does), so
        commit does not hash them a second time; otherwise they are checksummed here, as they are."""
        if verified:
            self._landed_verified = True
        elif self._view is not None:
            self._sum.update(self._view[: self.meta.size])
        self.filled = self.meta.size

    def commit(self, deadline: float | None) -> tuple[bool, TierName]:
        """Store the block; (stored, tier) as :meth:`TieredStore.put` returns."""
        if self.filled != self.meta.size:
            raise InvalidArgument(
                f"the stream ended block {self.key} after {self.filled} of its {self.meta.size} bytes; "
                "nothing of it was stored: send it again"
            )
        if self._present is not None:
            return False, self._present
        if self._buffer is not None:
            buffer, self._buffer = self._buffer, None
            return self._writes._put(self.key, buffer, self.meta, deadline)
        self._release_view()
        got = self.meta.checksum if self._landed_verified else self._sum.value()
        if got != self.meta.checksum:
            self.abort()
            self._writes._s.metrics.corrupt.labels(self._writes._head.name.label).inc()
            raise CorruptBlock(
                f"block {self.key}: the bytes received do not match the checksum the writer declared "
                f"({got:#018x} != {self.meta.checksum:#018x}); nothing was stored: send it again"
            )
        offset, self._offset = self._offset, None
        try:
            return self._writes._place.adopt(self.key, offset, self.meta, verify=False)
        finally:
            self._end_pins()

    def abort(self) -> None:
        """Give back what the writer holds; nothing of the block is stored."""
        self._release_view()
        self._buffer = None
        if self._offset is not None:
            offset, self._offset = self._offset, None
            self._writes._unreserve(offset)
        self._end_pins()

    def _release_view(self) -> None:
        if self._view is not None:
            self._view.release()
            self._view = None

    def _end_pins(self) -> None:
        parent, self._parent = self._parent, []
        self._writes._unpin(parent)
