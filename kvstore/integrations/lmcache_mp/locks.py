"""LMCache's lookup-and-lock as Strata pin leases.

A lookup pins the keys it finds with one lease per namespace; LMCache then
unlocks keys by name, one or a few at a time, possibly after several lookups
locked the same key. So each lease remembers the keys it still holds, each
key the leases holding it (oldest first), and a lease is given back (Unpin)
once LMCache has unlocked every key it holds. A lease LMCache never finishes
(a lost request, a restarted server) expires in the daemon after
``lock_lease_s``, and is forgotten here once past its deadline.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

BlockName = tuple[str, bytes]  # (namespace, block key)


@dataclass
class _Lease:
    lease_id: int
    expires: float  # monotonic
    keys: dict[BlockName, int] = field(default_factory=dict)  # key -> times still locked under this lease


class LeaseBook:
    """Which pin lease holds each locked key. Thread-safe."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._leases: dict[int, _Lease] = {}
        self._holders: dict[BlockName, deque[int]] = {}
        self._lock = threading.Lock()

    def add(self, lease_id: int, namespace: str, keys: list[bytes], lease_s: float) -> None:
        with self._lock:
            lease = self._leases.setdefault(lease_id, _Lease(lease_id, self._clock() + lease_s))
            for key in keys:
                name = (namespace, key)
                lease.keys[name] = lease.keys.get(name, 0) + 1
                self._holders.setdefault(name, deque()).append(lease_id)

    def unlock(self, names: list[BlockName]) -> list[int]:
        """Release one lock on each key; the leases now holding nothing, to give back."""
        done: list[int] = []
        with self._lock:
            for name in names:
                holders = self._holders.get(name)
                if not holders:
                    continue  # never locked here, or its lease expired: nothing to do
                lease_id = holders.popleft()
                if not holders:
                    del self._holders[name]
                lease = self._leases.get(lease_id)
                if lease is None:
                    continue
                left = lease.keys[name] - 1
                if left:
                    lease.keys[name] = left
                else:
                    del lease.keys[name]
                if not lease.keys:
                    del self._leases[lease_id]
                    done.append(lease_id)
        return done

    def expire(self) -> int:
        """Forget the leases past their deadline (the daemon has ended them); how many."""
        now = self._clock()
        with self._lock:
            gone = [lease for lease in self._leases.values() if lease.expires <= now]
            for lease in gone:
                del self._leases[lease.lease_id]
                for name in lease.keys:
                    holders = self._holders.get(name)
                    if holders is None:
                        continue
                    try:
                        while True:
                            holders.remove(lease.lease_id)
                    except ValueError:
                        pass
                    if not holders:
                        del self._holders[name]
        return len(gone)

    def drain(self) -> list[int]:
        """Every lease still held (at close), forgotten here."""
        with self._lock:
            ids = list(self._leases)
            self._leases.clear()
            self._holders.clear()
        return ids

    def __len__(self) -> int:
        with self._lock:
            return len(self._holders)
