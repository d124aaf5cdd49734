"""Where a same-host client last saw blocks in the arena: reads that skip the round trip.

A block's bytes are immutable and every read is verified against the
block's checksum, so a client that once looked a block up may read it again
from the same arena extent without asking the daemon: if the extent has
since been given to another block (eviction, then reuse), the checksum
fails and the client asks the daemon after all. What a checksum cannot
tell is a block *deleted* while its bytes still lie intact; for that the
daemon keeps removal counts in a small shared page (:data:`HEADER`), bumped
before each Delete answers: one per bucket of keys (a key's bucket is the
CRC-32 of its namespace and key, modulo :data:`BUCKETS`), and one for the
whole arena (the daemon stopping). A remembered location holds while its
key's *stamp* (the whole-arena count plus its bucket's) stands: a read
takes the stamp before and after its copy and keeps the copy only if it
did not move, so a Delete costs the other clients only the locations that
share its keys' buckets, not everything they remember.

What such a read gives up, and why it is acceptable: it takes no lease, so
the extent may be overwritten during the copy (the checksum catches it); it
does not refresh the block's recency in the daemon, so the client reports
the keys it read in batches (Touch); a block evicted but still intact in
RAM may be served after the daemon forgot it (its bytes are the ones that
were stored under that key, checksum-verified).

Page layout (little-endian): 16-byte arena token, u64 count of every
removal, u64 count of whole-arena removals, then at :data:`BUCKETS_AT` a
u64 count per bucket. The first count is the one clients of the first page
layout (4096 bytes, no buckets) watch; a client that finds a page of that
size (an older daemon) stamps every key with it, as they did.
"""

from __future__ import annotations

import functools
import hmac
import logging
import mmap
import os
import struct
import threading
import zlib
from collections.abc import Iterable

from kvstore.errors import ArenaUnusable

log = logging.getLogger(__name__)

HEADER = struct.Struct("<16sQQ")  # token, every removal, whole-arena removals
_COUNT = struct.Struct("<Q")
EVERY_AT, WHOLE_AT = 16, 24
BUCKETS = 4096
BUCKETS_AT = 64
PAGE_BYTES = BUCKETS_AT + 8 * BUCKETS
FIRST_LAYOUT_BYTES = 4096  # the page without buckets: an older daemon's
SUPERSEDED = (1 << 64) - 1  # both counts of a page a later daemon replaced
# Locations remembered per client (about 150 bytes each).
DEFAULT_CAPACITY = 65536


@functools.lru_cache(maxsize=1024)
def _seed(namespace: str) -> int:
    return zlib.crc32(namespace.encode())


def bucket(namespace: str, key: bytes) -> int:
    """The removal-count bucket of a key: the same in the daemon and every client."""
    return zlib.crc32(key, _seed(namespace)) % BUCKETS


def supersede(path: str) -> None:
    """Mark the page a previous daemon left at ``path`` (killed, so it never closed it) as dead: the
    clients still mapping it stop reading from what they remember of its arena at their next read.
    A page that cannot be opened is left alone: no client can have mapped it either."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        size = os.fstat(fd).st_size
        if size < FIRST_LAYOUT_BYTES:
            return
        with mmap.mmap(fd, FIRST_LAYOUT_BYTES) as old:
            _COUNT.pack_into(old, EVERY_AT, SUPERSEDED)
            _COUNT.pack_into(old, WHOLE_AT, SUPERSEDED)
    except (OSError, ValueError) as err:
        log.warning("could not mark the removal page %s of a previous daemon as dead (%s): its clients "
                    "notice the restart at their next call to this daemon instead", path, err)
    finally:
        os.close(fd)


class RemovalPage:
    """The daemon's side: the shared page and its counts. Thread-safe."""

    def __init__(self, path: str, token: bytes) -> None:
        self.path = path
        supersede(path)
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
        self._every = self._whole = 0
        self._buckets = [0] * BUCKETS
        self._lock = threading.Lock()
        HEADER.pack_into(self._map, 0, bytes(token), 0, 0)

    def bump(self, namespace: str | None = None, keys: Iterable[bytes] = ()) -> None:
        """Called before a Delete answers: the clients' remembered locations of these keys go stale
        (of every key without ``namespace``). Each count is one aligned 8-byte store."""
        with self._lock:
            if namespace is None:
                self._whole += 1
                _COUNT.pack_into(self._map, WHOLE_AT, self._whole)
            else:
                for b in {bucket(namespace, key) for key in keys}:
                    self._buckets[b] += 1
                    _COUNT.pack_into(self._map, BUCKETS_AT + 8 * b, self._buckets[b])
            self._every += 1
            _COUNT.pack_into(self._map, EVERY_AT, self._every)

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._map.close()


class Locations:
    """The client's side: remembered (namespace, key) → (arena extent, stamp), and the page that voids them.

    Safe to share between threads: lookups are plain dict reads; inserts and
    the bound are taken under a lock.
    """

    def __init__(self, page_path: str, token: bytes, capacity: int = DEFAULT_CAPACITY) -> None:
        try:
            fd = os.open(page_path, os.O_RDONLY)
        except OSError as err:
            raise ArenaUnusable(f"cannot open the daemon's removal page {page_path}: {err}") from None
        try:
            size = os.fstat(fd).st_size
            self._bucketed = size >= PAGE_BYTES
            self._map = mmap.mmap(fd, PAGE_BYTES if self._bucketed else FIRST_LAYOUT_BYTES, prot=mmap.PROT_READ)
        except (OSError, ValueError) as err:
            raise ArenaUnusable(f"cannot map the daemon's removal page {page_path}: {err}") from None
        finally:
            os.close(fd)
        if not hmac.compare_digest(self._map[:16], bytes(token)):
            self._map.close()
            raise ArenaUnusable(f"{page_path} belongs to another daemon: attach again")
        self._path = page_path
        self._inode = os.stat(page_path).st_ino
        self._capacity = capacity
        self._table: dict[tuple[str, bytes], tuple[tuple, int]] = {}
        self._whole = self._whole_count()
        self._lock = threading.Lock()

    def _whole_count(self) -> int:
        return _COUNT.unpack_from(self._map, WHOLE_AT if self._bucketed else EVERY_AT)[0]

    def check(self) -> None:
        """Once per read call: empty the table when the whole arena's count moved, or when the daemon
        restarted. Even after SIGKILL, a new daemon marks the page it replaces :data:`SUPERSEDED`
        before it makes its own under the same name: this client's mapping of the old one, and of the
        old arena, then says nothing more, so nothing is remembered until the client attaches again.
        A daemon of the first page layout marks nothing: with its page, one ``stat`` tells."""
        now = self._whole_count()
        if now != self._whole or (not self._bucketed and not self._current()):
            with self._lock:
                self._table.clear()
                self._whole = now
                if now == SUPERSEDED:
                    self._capacity = 0  # learn nothing more either

    def _current(self) -> bool:
        try:
            current = os.stat(self._path).st_ino == self._inode
        except OSError:
            current = False
        if not current:
            self._capacity = 0  # learn nothing more either
        return current

    def stamp(self, namespace: str, key: bytes) -> int:
        """The key's removal stamp now: it moves when a Delete of the key (or one sharing its bucket)
        answers, or the whole arena's count moves. Both counts only grow, so their sum moves iff one did."""
        whole = self._whole_count()
        if not self._bucketed:
            return whole
        return whole + _COUNT.unpack_from(self._map, BUCKETS_AT + 8 * bucket(namespace, key))[0]

    def get(self, namespace: str, key: bytes) -> tuple[tuple, int] | None:
        """((offset, size, checksum, parent, layout), stamp) while no Delete of the key answered since
        it was learned; None otherwise."""
        found = self._table.get((namespace, key))
        if found is None:
            return None
        if self.stamp(namespace, key) != found[1]:
            self.forget(namespace, key)
            return None
        return found

    def learn(self, stamp: int, namespace: str, key: bytes, location: tuple) -> None:
        """Remember a location seen by a Lookup sent when the key's stamp was ``stamp``."""
        with self._lock:
            if self.stamp(namespace, key) != stamp:
                return  # a Delete answered meanwhile: the Lookup's answer may be stale already
            if not self._capacity:
                return
            if len(self._table) >= self._capacity:
                self._table.pop(next(iter(self._table)))  # the oldest learned
            self._table[(namespace, key)] = (location, stamp)

    def forget(self, namespace: str, key: bytes) -> None:
        with self._lock:
            self._table.pop((namespace, key), None)

    def clear(self) -> None:
        with self._lock:
            self._table.clear()

    def close(self) -> None:
        self._map.close()
