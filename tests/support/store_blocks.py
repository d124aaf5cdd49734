"""What the store suites share: a settable clock and recognisable block values."""

from __future__ import annotations

MiB = 1 << 20


class Clock:
    """time.monotonic for a store under test: moves only when the test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def value(tag: int, size: int = MiB) -> bytes:
    """``size`` bytes that name ``tag`` throughout, so a mixed-up block is seen at once."""
    return (tag.to_bytes(4, "big") * (size // 4 + 1))[:size]
