"""How much the disk tier may hold: its configured size, bounded by what its filesystem has
free (asked at start, by ``upkeep`` and when a put does not fit), and "degraded" while full.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_LOW_SPACE_BYTES = 1 << 20  # a filesystem with less free than this (and a tier below its size) is full


class _Room:
    """:class:`~kvstore.tiers.disk.DiskTier`'s room (a mixin of it)."""

    def _fits_locked(self, size: int) -> bool:
        """Whether ``size`` more bytes fit now; below the configured size, asks the filesystem again first."""
        if self._used + self._reserved + size <= self._limit:
            return True
        if self._limit < self._configured:
            try:
                self._refresh_locked(self._ops.free_bytes(self._root_str))
            except OSError as e:
                log.warning("disk tier %s: cannot read its filesystem's free space: %s", self._root, e.strerror)
        return self._used + self._reserved + size <= self._limit

    @property
    def degraded(self) -> str:
        """Why the tier cannot take the blocks it was configured for (its filesystem is full); "" when it can."""
        with self._lock:
            return self._degraded_locked()

    def _degraded_locked(self) -> str:
        if not self._full:
            return ""
        return (
            f"the filesystem of {self._root} is full ({self._full}): the disk tier holds {self._used} of its "
            f"{self._configured} bytes and takes more only as it evicts; free space there or lower --disk-bytes"
        )

    def upkeep(self) -> None:
        """Ask the filesystem again how much it holds (space may have come back, or gone to another
        writer), and retry the unlinks of deleted blocks that failed. The store calls this about
        once a second; it is how a tier degraded by a full filesystem recovers."""
        with self._lock:
            doomed = list(self._doomed.items())
        for name, size in doomed:
            try:
                self._ops.unlink(self._path(name))
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("disk tier: still cannot remove deleted block file %s: %s", self._path(name), e.strerror)
                continue
            with self._lock:
                if self._doomed.get(name) == size:
                    del self._doomed[name]
                    self._used -= size
        try:
            free = self._ops.free_bytes(self._root_str)
        except OSError as e:
            log.warning("disk tier %s: cannot read its filesystem's free space: %s", self._root, e.strerror)
            return
        with self._lock:
            self._refresh_locked(free)

    def _refresh_locked(self, free: int) -> None:
        """Bound the capacity by what the filesystem holds: what the tier has plus the free space, never
        more than configured and never less than what it holds (those blocks are safe where they are)."""
        self._limit = min(self._configured, self._used + free)  # never below what it holds: those blocks stay
        was = self._full
        if free >= _LOW_SPACE_BYTES or self._limit >= self._configured:
            self._full = ""
        elif not self._full:
            self._full = f"{free} bytes free"
        if was and not self._full:
            log.warning(
                "disk tier %s: its filesystem has room again (%d bytes free); capacity %d of %d configured bytes",
                self._root, free, self._limit, self._configured,
                extra={"disk_dir": self._root_str, "free_bytes": free, "capacity_bytes": self._limit},
            )
        elif self._full and not was:
            self._log_degraded_locked()

    def _filled_locked(self, e: OSError, pending: int) -> None:
        """A write found the filesystem full: the tier now holds what it has (and the puts still in flight)."""
        self._limit = min(self._limit, max(self._used + self._reserved - pending, self._used))
        was, self._full = self._full, e.strerror or "no space left on device"
        if not was:
            self._log_degraded_locked()

    def _log_degraded_locked(self) -> None:
        log.warning(
            "disk tier degraded: %s; blocks stay in RAM while it has room",
            self._degraded_locked(),
            extra={"disk_dir": self._root_str, "capacity_bytes": self._limit, "configured_bytes": self._configured},
        )

    def _bound_by_filesystem(self) -> None:
        """At start: the capacity is at most what the tier holds plus the filesystem's free space."""
        try:
            free = self._ops.free_bytes(self._root_str)
        except OSError as e:
            log.warning("disk tier %s: cannot read its filesystem's free space: %s", self._root, e.strerror)
            return
        with self._lock:
            self._refresh_locked(free)
            if self._limit < self._configured:
                log.warning(
                    "disk tier %s: --disk-bytes is %d but its filesystem holds only %d more bytes beside the %d "
                    "it has: the tier holds at most %d; lower --disk-bytes or free space there",
                    self._root, self._configured, free, self._used, self._limit,
                    extra={"disk_dir": self._root_str, "configured_bytes": self._configured,
                           "capacity_bytes": self._limit, "free_bytes": free},
                )
