"""The store's catalogue: every block it knows, where its copies are, its children, listings.

One :class:`Entry` per block, whatever tiers hold it: the tiers hold bytes,
the entry holds the facts the store decides on (which tiers have a copy,
pins, a copy in flight, a delete waiting for readers). Children are kept per
parent so that eviction can ask "is any descendant of this block cached?" in
O(children), and each namespace's keys are kept sorted so that a page of a
listing costs O(log n + page).

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from sortedcontainers import SortedList

from kvstore.block import BlockKey, BlockMeta, TierName


@dataclass(slots=True)
class Entry:
    meta: BlockMeta
    tiers: set[TierName] = field(default_factory=set)  # tiers holding a complete, verified copy
    pins: int = 0  # leases, readers and writers that need it to stay
    demoting: bool = False  # a copy of it is being written down the chain
    deleted: bool = False  # deleted while pinned: invisible, removed when the last pin goes
    stays_above: bool = False  # the tier below refused this block itself: it is dropped, never demoted

    @property
    def visible(self) -> bool:
        return not self.deleted and bool(self.tiers)


class Catalog:
    def __init__(self) -> None:
        self.entries: dict[BlockKey, Entry] = {}
        self._children: dict[BlockKey, set[BlockKey]] = {}
        self._ns_keys: dict[str, SortedList] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: BlockKey) -> Entry | None:
        return self.entries.get(key)

    def live(self, key: BlockKey) -> Entry | None:
        """The entry unless it is absent or deleted."""
        entry = self.entries.get(key)
        return None if entry is None or entry.deleted else entry

    def add(self, key: BlockKey, entry: Entry) -> None:
        self.entries[key] = entry
        keys = self._ns_keys.get(key.namespace)
        if keys is None:
            keys = self._ns_keys[key.namespace] = SortedList()
        keys.add(key.key)
        if entry.meta.parent:
            self._children.setdefault(BlockKey(key.namespace, entry.meta.parent), set()).add(key)

    def remove(self, key: BlockKey) -> Entry:
        entry = self.entries.pop(key)
        keys = self._ns_keys[key.namespace]
        keys.remove(key.key)
        if not keys:
            del self._ns_keys[key.namespace]
        if entry.meta.parent:
            parent = BlockKey(key.namespace, entry.meta.parent)
            siblings = self._children.get(parent)
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self._children[parent]
        return entry

    def has_children(self, key: BlockKey) -> bool:
        return bool(self._children.get(key))

    def has_child_in(self, key: BlockKey, tier: TierName) -> bool:
        return any(tier in self.entries[c].tiers for c in self._children.get(key, ()))

    def namespaces(self) -> list[str]:
        """Namespaces with at least one block, in order."""
        return sorted(self._ns_keys)

    def count(self, namespace: str) -> int:
        return len(self._ns_keys.get(namespace, ()))

    def keys_of(self, namespace: str) -> list[bytes]:
        return list(self._ns_keys.get(namespace, ()))

    def page(self, namespace: str, prefix: bytes, page_size: int, page_token: bytes) -> tuple[list[tuple[bytes, Entry]], bytes]:
        """Visible blocks of ``namespace`` starting with ``prefix``, after ``page_token``, in byte order.

        Returns the page and the next token: the last key returned, or empty
        after the last page. A token names a key, not a position, so a
        listing resumes correctly whatever was stored or evicted in between.
        """
        keys = self._ns_keys.get(namespace)
        if keys is None:
            return [], b""
        page: list[tuple[bytes, Entry]] = []
        for k in keys.irange(minimum=page_token or prefix, inclusive=(not page_token, True)):
            if not k.startswith(prefix):
                return page, b""
            entry = self.entries[BlockKey(namespace, k)]
            if not entry.visible:
                continue
            if len(page) == page_size:
                return page, page[-1][0]
            page.append((k, entry))
        return page, b""

    def visible(self) -> Iterator[tuple[BlockKey, Entry]]:
        return ((k, e) for k, e in self.entries.items() if e.visible)
