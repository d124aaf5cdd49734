"""ExtentAllocator: unit tests and a state machine over its invariants."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.shm.allocator import ExtentAllocator

PAGE = 4096


def test_capacity_rounds_down_to_pages():
    a = ExtentAllocator(10 * PAGE + 123)
    assert a.capacity_bytes == 10 * PAGE
    assert a.free_bytes == 10 * PAGE
    assert a.free_extent_count == 1
    assert a.largest_free_bytes == 10 * PAGE


@pytest.mark.parametrize("capacity", [0, PAGE - 1, -PAGE])
def test_capacity_below_one_page_is_refused(capacity):
    with pytest.raises(ValueError):
        ExtentAllocator(capacity)


@pytest.mark.parametrize("size", [0, -1])
def test_non_positive_size_is_refused(size):
    with pytest.raises(ValueError):
        ExtentAllocator(4 * PAGE).allocate(size)


def test_allocations_round_up_to_pages():
    a = ExtentAllocator(8 * PAGE)
    off = a.allocate(1)
    assert off == 0
    assert a.size_of(off) == PAGE
    off2 = a.allocate(PAGE + 1)
    assert off2 == PAGE
    assert a.size_of(off2) == 2 * PAGE
    assert a.used_bytes == 3 * PAGE
    assert a.allocation_count == 2


def test_full_returns_none_not_raise():
    a = ExtentAllocator(2 * PAGE)
    assert a.allocate(2 * PAGE) == 0
    assert a.allocate(1) is None
    assert a.allocate(3 * PAGE) is None


def test_best_fit_picks_smallest_extent_that_fits():
    a = ExtentAllocator(16 * PAGE)
    offs = [a.allocate(PAGE) for _ in range(16)]
    # Free a 3-page hole at pages 1..3 and a 2-page hole at pages 10..11.
    for i in (1, 2, 3, 10, 11):
        a.free(offs[i])
    assert a.free_extent_count == 2
    assert a.allocate(2 * PAGE) == 10 * PAGE  # the exact 2-page hole, not the 3-page one
    assert a.allocate(3 * PAGE) == PAGE


def test_free_coalesces_with_both_neighbours():
    a = ExtentAllocator(3 * PAGE)
    left, mid, right = (a.allocate(PAGE) for _ in range(3))
    a.free(left)
    a.free(right)
    assert a.free_extent_count == 2
    assert a.free(mid) == PAGE
    assert a.free_extent_count == 1
    assert a.largest_free_bytes == 3 * PAGE
    assert a.allocate(3 * PAGE) == 0


def test_free_returns_rounded_size():
    a = ExtentAllocator(4 * PAGE)
    off = a.allocate(PAGE + 5)
    assert a.free(off) == 2 * PAGE


def test_double_free_names_the_offset():
    a = ExtentAllocator(4 * PAGE)
    off = a.allocate(10)
    a.free(off)
    with pytest.raises(ValueError, match=str(off)):
        a.free(off)


def test_unknown_offset_is_refused():
    a = ExtentAllocator(4 * PAGE)
    a.allocate(2 * PAGE)
    with pytest.raises(ValueError, match="4096"):
        a.free(PAGE)  # inside an allocation, not its start
    with pytest.raises(ValueError):
        a.size_of(PAGE)


def test_custom_page():
    a = ExtentAllocator(1000, page=100)
    assert a.allocate(150) == 0
    assert a.size_of(0) == 200
    assert a.allocate(1) == 200


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free sequences against a reference of live extents."""

    def __init__(self) -> None:
        super().__init__()
        self.page = 512
        self.a = ExtentAllocator(64 * self.page + 7, page=self.page)
        self.live: dict[int, int] = {}  # offset -> requested size

    @rule(size=st.integers(min_value=1, max_value=20 * 512))
    def allocate(self, size):
        rounded = -(-size // self.page) * self.page
        largest = self.a.largest_free_bytes
        off = self.a.allocate(size)
        if off is None:
            assert largest < rounded
            return
        assert largest >= rounded
        assert off % self.page == 0
        assert 0 <= off and off + rounded <= self.a.capacity_bytes
        assert self.a.size_of(off) == rounded
        assert off not in self.live
        self.live[off] = size

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        off = data.draw(st.sampled_from(sorted(self.live)))
        size = self.live.pop(off)
        assert self.a.free(off) == -(-size // self.page) * self.page

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def double_free_is_refused(self, data):
        off = data.draw(st.sampled_from(sorted(self.live)))
        self.a.free(off)
        with pytest.raises(ValueError):
            self.a.free(off)
        del self.live[off]

    @rule()
    def free_everything(self):
        for off in list(self.live):
            self.a.free(off)
        self.live.clear()
        assert self.a.free_extent_count == 1
        assert self.a.largest_free_bytes == self.a.capacity_bytes
        assert self.a.used_bytes == 0

    @invariant()
    def used_plus_free_is_capacity(self):
        assert self.a.used_bytes + self.a.free_bytes == self.a.capacity_bytes
        assert self.a.used_bytes == sum(self.a.size_of(o) for o in self.live)
        assert self.a.allocation_count == len(self.live)

    @invariant()
    def live_extents_do_not_overlap(self):
        end = 0
        for off in sorted(self.live):
            assert off >= end
            end = off + self.a.size_of(off)
        assert end <= self.a.capacity_bytes

    @invariant()
    def free_extents_are_the_maximal_gaps(self):
        # Coalescing means the free extents are exactly the gaps between live
        # allocations, each gap one extent.
        gaps, end = [], 0
        for off in sorted(self.live):
            if off > end:
                gaps.append(off - end)
            end = off + self.a.size_of(off)
        if end < self.a.capacity_bytes:
            gaps.append(self.a.capacity_bytes - end)
        assert self.a.free_extent_count == len(gaps)
        assert self.a.largest_free_bytes == max(gaps, default=0)

TestAllocatorMachine = pytest.mark.slow(AllocatorMachine.TestCase)  # 200 examples of 60 steps
TestAllocatorMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
