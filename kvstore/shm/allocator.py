"""Extents carved out of one fixed byte range.

The host tier owns one shared-memory arena and never calls ``malloc`` per
block: a block is an extent (offset, size) of that arena, handed out here.

Why best-fit with page rounding:

- every extent is a whole number of pages, so a block wastes less than one
  page (internal fragmentation < 1 page per block) and every offset is
  page-aligned, which keeps copies into and out of the arena aligned;
- best-fit (the smallest free extent that fits, lowest offset on ties) keeps
  large free extents whole for large blocks;
- ``free`` coalesces with both neighbours, so free space never stays split at
  a boundary between two free extents: external fragmentation is bounded by
  the live allocations between them;
- when no single extent fits, ``allocate`` returns ``None`` and the store
  evicts (least recently used first) and retries; the allocator never
  compacts, because clients may be reading blocks in place.

Every operation is O(log n) in the number of free extents: a ``SortedList`` of
``(size, offset)`` finds the best fit, and two dicts keyed by start and end
offset find the neighbours to merge with.

Not thread-safe: the tier that owns it holds its own lock around every call,
and a second lock here would only be taken under that one.
"""

from __future__ import annotations

from sortedcontainers import SortedList

DEFAULT_PAGE_BYTES = 4096


class ExtentAllocator:
    """Best-fit, page-granular, coalescing allocator over ``[0, capacity)``."""

    def __init__(self, capacity: int, page: int = DEFAULT_PAGE_BYTES) -> None:
        if page <= 0:
            raise ValueError(f"page size must be positive, got {page}")
        capacity = capacity // page * page
        if capacity < page:
            raise ValueError(f"capacity must hold at least one {page}-byte page")
        self._page = page
        self._capacity = capacity
        self._free_by_size: SortedList = SortedList()  # (size, offset)
        self._free_by_start: dict[int, int] = {}  # start -> size
        self._free_by_end: dict[int, int] = {}  # end -> start
        self._allocated: dict[int, int] = {}  # start -> rounded size
        self._used = 0
        self._add_free(0, capacity)

    # ---- allocation ------------------------------------------------------

    def allocate(self, size: int) -> int | None:
        """Offset of a fresh extent of at least ``size`` bytes, or None when none fits."""
        if size <= 0:
            raise ValueError(f"allocation size must be positive, got {size}")
        need = self.rounded(size)
        i = self._free_by_size.bisect_left((need, -1))
        if i == len(self._free_by_size):
            return None
        extent, offset = self._free_by_size[i]
        self._remove_free(offset, extent)
        if extent > need:
            self._add_free(offset + need, extent - need)
        self._allocated[offset] = need
        self._used += need
        return offset

    def claim_all(self, extents: list[tuple[int, int]]) -> list[bool]:
        """Take each ``(offset, size)`` exactly, on an allocator with nothing allocated yet.

        For a restart that adopts the extents a previous run left (the host
        tier's committed-block table). Per extent, whether it was taken:
        False when it is not page aligned, leaves the capacity, or overlaps
        an extent taken before it in the list's order (so the caller lists
        what it trusts most first). O(n log n); the free space is rebuilt
        from the gaps in one pass.
        """
        if self._allocated:
            raise ValueError("claim_all needs an allocator with nothing allocated")
        taken: SortedList = SortedList()  # (start, end)
        out = []
        for offset, size in extents:
            end = offset + self.rounded(size)
            ok = size > 0 and offset >= 0 and offset % self._page == 0 and end <= self._capacity
            if ok:
                i = taken.bisect_left((offset, offset))
                ok = (i == len(taken) or taken[i][0] >= end) and (i == 0 or taken[i - 1][1] <= offset)
            if ok:
                taken.add((offset, end))
                self._allocated[offset] = end - offset
                self._used += end - offset
            out.append(ok)
        for start, size in list(self._free_by_start.items()):
            self._remove_free(start, size)
        at = 0
        for start, end in taken:
            if start > at:
                self._add_free(at, start - at)
            at = end
        if at < self._capacity:
            self._add_free(at, self._capacity - at)
        return out

    def free(self, offset: int) -> int:
        """Return an extent to the free space; the bytes freed (its rounded size)."""
        size = self._allocated.pop(offset, None)
        if size is None:
            raise ValueError(f"offset {offset} is not an allocated extent (double free or never allocated)")
        self._used -= size
        start, end = offset, offset + size
        right = self._free_by_start.get(end)
        if right is not None:
            self._remove_free(end, right)
            end += right
        left = self._free_by_end.get(start)
        if left is not None:
            self._remove_free(left, start - left)
            start = left
        self._add_free(start, end - start)
        return size

    def size_of(self, offset: int) -> int:
        """Rounded size of the live extent at ``offset``."""
        try:
            return self._allocated[offset]
        except KeyError:
            raise ValueError(f"offset {offset} is not an allocated extent") from None

    def rounded(self, size: int) -> int:
        """``size`` rounded up to whole pages: what an allocation of it uses."""
        return -(-size // self._page) * self._page

    # ---- accounting ------------------------------------------------------

    @property
    def page_bytes(self) -> int:
        return self._page

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return self._capacity - self._used

    @property
    def largest_free_bytes(self) -> int:
        return self._free_by_size[-1][0] if self._free_by_size else 0

    def free_extents(self) -> list[tuple[int, int]]:
        """Every free extent as (start, size), in address order."""
        return sorted(self._free_by_start.items())

    @property
    def free_extent_count(self) -> int:
        return len(self._free_by_size)

    @property
    def allocation_count(self) -> int:
        return len(self._allocated)

    # ---- free-extent index -----------------------------------------------

    def _add_free(self, start: int, size: int) -> None:
        self._free_by_size.add((size, start))
        self._free_by_start[start] = size
        self._free_by_end[start + size] = start

    def _remove_free(self, start: int, size: int) -> None:
        self._free_by_size.remove((size, start))
        del self._free_by_start[start]
        del self._free_by_end[start + size]
