"""Blocks moved up or down a store's chain on request (an engine's Prefetch and Demote hints, the ``Place`` RPC).

A warm is a read that sends nothing back (a read promotes what it finds below
the head, and reads through the remote tiers); a demotion is the copy down
the write-behind queue does, run now for the named blocks and evicting the
head's copy. The keys are checked by the caller (:meth:`TieredStore.place`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvstore.block import BlockKey
from kvstore.errors import InvalidArgument
from kvstore.store.copies import CopyDown
from kvstore.store.demotion import Copy
from kvstore.store.state import StorePart, StoreState


@dataclass(frozen=True, slots=True)
class Placed:
    """What :meth:`BlockMoves.place` did: blocks now where asked, keys not held, blocks kept for their pins."""

    placed: int
    missing: list[bytes]
    pinned: int


class BlockMoves(StorePart):
    def __init__(self, state: StoreState, copies: CopyDown,
                 read: Callable[[str, Sequence[bytes]], Iterable[object | None]]) -> None:
        super().__init__(state)
        self._copies = copies
        self._read = read  # the store's get_many: a warm is a read whose bytes go nowhere

    def place(self, namespace: str, keys: list[bytes], warm: bool) -> Placed:
        """Move held blocks up or down the chain, for an engine's hint (Prefetch, Demote).

        ``warm``: read each block into the head tier from wherever it is (a
        lower tier, or through a remote one), as a read would, without sending
        it anywhere. Otherwise move each block held in the head down to the
        tier below it (written there first if it is not), freeing its room in
        the head; a pinned block stays (it counts as ``pinned``). Raises
        InvalidArgument when there is no tier below the head to move to.
        """
        head = self._head.name
        if warm:
            placed, missing = 0, []
            for k, got in zip(keys, self._read(namespace, keys)):
                if got is None:
                    missing.append(k)
                    continue
                with self._s.locked():
                    entry = self._catalog.live(BlockKey(namespace, k))
                    placed += entry is not None and head in entry.tiers
            return Placed(placed, missing, 0)
        below = self._chain.below(head)
        if below is None or below.name in {level.name for level in self._chain.remote()}:
            raise InvalidArgument("this daemon has no local tier below its head to demote to: give it a disk "
                                  "tier ([tiers.disk])")
        placed, pinned, missing = 0, 0, []
        for k in keys:
            key = BlockKey(namespace, k)
            with self._cond:
                self._s.readable_namespace(namespace)
                entry = self._catalog.live(key)
                if entry is None:
                    missing.append(k)
                    continue
                if head not in entry.tiers:
                    placed += 1  # already below
                    continue
                if entry.pins:
                    pinned += 1
                    continue
                if below.name in entry.tiers:
                    self._s.drop_copy_locked(key, entry, head)
                    placed += 1
                    continue
                if not self._s.mark_copy_locked(key, below.name):
                    continue  # a copy is on its way already
            self._copies.copy_down(Copy(key, head, below.name, evict=True))
            with self._s.locked():
                placed += below.name in entry.tiers and head not in entry.tiers
        return Placed(placed, missing, pinned)
