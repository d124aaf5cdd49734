"""Where a same-host client last saw blocks in the arena: reads that skip the round trip.

A block's bytes are immutable and every read is verified against the
block's checksum, so a client that once looked a block up may read it again
from the same arena extent without asking the daemon: if the extent has
since been given to another block (eviction, then reuse), the checksum
fails and the client asks the daemon after all. What a checksum cannot
tell is a block *deleted* while its bytes still lie intact; for that the
daemon keeps a removal count in a small shared page (:data:`PAGE`), bumped
before each Delete answers. The table is valid only while the count stands:
a read takes the count before and after its copies and keeps them only if
it did not move.

What such a read gives up, and why it is acceptable: it takes no lease, so
the extent may be overwritten during the copy (the checksum catches it); it
does not refresh the block's recency in the daemon, so the client reports
the keys it read in batches (Touch); a block evicted but still intact in
RAM may be served after the daemon forgot it (its bytes are the ones that
were stored under that key, checksum-verified).

Page layout (little-endian): 16-byte arena token, then u64 removal count.
"""

from __future__ import annotations

import hmac
import mmap
import os
import struct
import threading

from kvstore.errors import ArenaUnusable

PAGE = struct.Struct("<16sQ")
_COUNT = struct.Struct("<Q")
PAGE_BYTES = 4096
# Locations remembered per client (about 150 bytes each).
DEFAULT_CAPACITY = 65536


class RemovalPage:
    """The daemon's side: the shared page and its count. Thread-safe."""

    def __init__(self, path: str, token: bytes) -> None:
        self.path = path
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, PAGE_BYTES)
            self._map = mmap.mmap(fd, PAGE_BYTES)
        finally:
            os.close(fd)
        self._count = 0
        self._lock = threading.Lock()
        PAGE.pack_into(self._map, 0, bytes(token), 0)

    def bump(self) -> None:
        """Called before a Delete answers: every client's remembered locations go stale."""
        with self._lock:
            self._count += 1
            _COUNT.pack_into(self._map, 16, self._count)  # one aligned 8-byte store

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._map.close()


class Locations:
    """The client's side: remembered (namespace, key) → arena extent, and the page that voids them.

    Safe to share between threads: lookups are plain dict reads; inserts and
    the bound are taken under a lock.
    """

    def __init__(self, page_path: str, token: bytes, capacity: int = DEFAULT_CAPACITY) -> None:
        try:
            fd = os.open(page_path, os.O_RDONLY)
        except OSError as err:
            raise ArenaUnusable(f"cannot open the daemon's removal page {page_path}: {err}") from None
        try:
            self._map = mmap.mmap(fd, PAGE_BYTES, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        if not hmac.compare_digest(self._map[:16], bytes(token)):
            self._map.close()
            raise ArenaUnusable(f"{page_path} belongs to another daemon: attach again")
        self._path = page_path
        self._inode = os.stat(page_path).st_ino
        self._capacity = capacity
        self._table: dict[tuple[str, bytes], tuple] = {}
        self._epoch = self._read()
        self._lock = threading.Lock()

    def _read(self) -> int:
        return PAGE.unpack_from(self._map, 0)[1]

    def epoch(self) -> int:
        """The removal count now; the table is emptied when it moved since the last look.

        A daemon that restarted (even after SIGKILL) made a new page under the
        same name: this client's mapping of the old one, and of the old arena,
        no longer says anything, so nothing is remembered until the client
        attaches again (one ``stat`` per read call).
        """
        now = self._read()
        if now != self._epoch or not self._current():
            with self._lock:
                self._table.clear()
                self._epoch = now
        return now

    def _current(self) -> bool:
        try:
            current = os.stat(self._path).st_ino == self._inode
        except OSError:
            current = False
        if not current:
            self._capacity = 0  # learn nothing more either
        return current

    def still(self, epoch: int) -> bool:
        """Whether no Delete answered since ``epoch`` was taken."""
        return self._read() == epoch

    def get(self, namespace: str, key: bytes) -> tuple | None:
        """(offset, size, checksum, parent, layout), or None."""
        return self._table.get((namespace, key))

    def learn(self, epoch: int, namespace: str, key: bytes, location: tuple) -> None:
        """Remember a location seen by a Lookup sent when the count was ``epoch``."""
        with self._lock:
            if self._read() != epoch or epoch != self._epoch:
                return  # a Delete answered meanwhile: the Lookup's answer may be stale already
            if not self._capacity:
                return
            if len(self._table) >= self._capacity:
                self._table.pop(next(iter(self._table)))  # the oldest learned
            self._table[(namespace, key)] = location

    def forget(self, namespace: str, key: bytes) -> None:
        with self._lock:
            self._table.pop((namespace, key), None)

    def clear(self) -> None:
        with self._lock:
            self._table.clear()

    def close(self) -> None:
        self._map.close()
