"""Bounded polls: the suite waits for a condition, never asserts how long it took."""

from __future__ import annotations

import time

import pytest


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.02, what: str = "condition"):
    """Poll until ``predicate()`` is truthy; fail the test (not assert a timing) if it never is."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
