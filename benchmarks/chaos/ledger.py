"""What the run put, what the fleet acknowledged, and what every operation met.

- :class:`Ledger`: a block's digest (BLAKE2b-128 of its bytes) is recorded
  only once its put is acknowledged, so a block the fleet refused or lost
  in flight is never expected back; it keeps digests, not bytes. It also
  records the blocks whose copies the run itself damaged (a block file
  overwritten on a daemon's disk), so that the audit can tell a copy the
  run destroyed from one the fleet lost.
- :class:`Tally`: one count per (window, operation, outcome). A window is
  the fault running when the operation started (from its injection until
  its probe succeeds), or ``steady`` between faults. An outcome is ``ok``
  (a get that returned the block's own bytes, an acknowledged put),
  ``miss`` (a get answered "not here"), ``wrong_bytes`` (a get that
  returned other bytes: the figure that must be 0), or a refusal: the
  class of the error the client raised (``DaemonUnavailable``,
  ``DeadlineExceeded``, ``TierFull``, …).
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections import Counter
from dataclasses import dataclass

import grpc

OK, MISS, WRONG = "ok", "miss", "wrong_bytes"
STEADY = "steady"


def digest(data) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def reason(err: BaseException) -> str:
    """A refusal's reason: the Strata error class the client raised (a bare gRPC error by its code)."""
    if isinstance(err, grpc.RpcError) and hasattr(err, "code"):
        return f"grpc.{err.code().name}"
    return type(err).__name__


@dataclass(frozen=True, slots=True)
class Acked:
    key: bytes
    digest: bytes
    size: int
    owner: int  # the daemon that acknowledged it
    at_s: float  # on the run's clock


class Ledger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: dict[bytes, Acked] = {}
        self._keys: list[bytes] = []
        self.damaged: dict[bytes, int] = {}  # key -> the daemon whose disk copy the run overwrote

    def acknowledge(self, block: Acked) -> None:
        with self._lock:
            self._blocks[block.key] = block
            self._keys.append(block.key)

    def pick(self, rng: random.Random) -> Acked | None:
        with self._lock:
            return self._blocks[rng.choice(self._keys)] if self._keys else None

    def get(self, key: bytes) -> Acked:
        with self._lock:
            return self._blocks[key]

    def blocks(self) -> list[Acked]:
        with self._lock:
            return list(self._blocks.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)


class Tally:
    """Outcome counts per window; thread-safe. ``window`` is set by the fault runner."""

    MAX_EXAMPLES = 20

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.window = "warm-up"
        self.counts: Counter[tuple[str, str, str]] = Counter()
        self.wrong: list[dict] = []  # the first few wrong answers, in full
        self.slowest: dict[str, float] = {}  # window -> the longest a traffic operation took in it, seconds
        self.owner_misses: Counter[str] = Counter()  # window -> misses from the daemon that acknowledged the block
        self.miss_ages: Counter[str] = Counter()  # a traffic miss by the missed block's age: under 1 s, 1-5 s, older
        self.misses: list[dict] = []  # the first traffic misses, in full

    def record(self, window: str, op: str, outcome: str, seconds: float = 0.0) -> None:
        with self._lock:
            self.counts[(window, op, outcome)] += 1
            if seconds > self.slowest.get(window, 0.0):
                self.slowest[window] = seconds

    def miss_age(self, window: str, node: int, block: Acked, age_s: float, at_s: float) -> None:
        with self._lock:
            self.miss_ages["under 1 s" if age_s < 1 else "1-5 s" if age_s < 5 else "older"] += 1
            if sum(m["window"] == window for m in self.misses) < self.MAX_EXAMPLES // 2:  # a few per window
                self.misses.append({"window": window, "node": f"n{node}", "owner": f"n{block.owner}",
                                    "key": block.key.hex(), "age_s": round(age_s, 2), "at_s": round(at_s, 2)})

    def owner_miss(self, window: str) -> None:
        with self._lock:
            self.owner_misses[window] += 1

    def wrong_bytes(self, window: str, op: str, node: int, block: Acked, got) -> None:
        with self._lock:
            self.counts[(window, op, WRONG)] += 1
            if len(self.wrong) < self.MAX_EXAMPLES:
                self.wrong.append({"window": window, "op": op, "node": f"n{node}", "key": block.key.hex(),
                                   "owner": f"n{block.owner}", "size": block.size, "got_size": len(got)})

    def total(self, op: str | None = None, outcome: str | None = None, window: str | None = None) -> int:
        with self._lock:
            return sum(n for (w, o, r), n in self.counts.items()
                       if (op is None or o == op) and (outcome is None or r == outcome)
                       and (window is None or w == window))

    def refusals(self, window: str | None = None) -> dict[str, int]:
        """Refused operations by reason (every outcome that is not ok, a miss or wrong bytes)."""
        out: Counter[str] = Counter()
        with self._lock:
            for (w, op, r), n in self.counts.items():
                if r not in (OK, MISS, WRONG) and (window is None or w == window):
                    out[f"{op} {r}"] += n
        return dict(sorted(out.items()))

    def window_summary(self, window: str) -> dict:
        return {
            "puts": self.total("put", window=window),
            "acknowledged": self.total("put", OK, window),
            "gets": self.total("get", window=window),
            "served": self.total("get", OK, window),
            "misses": self.total("get", MISS, window),
            "misses_at_own_daemon": self.owner_misses[window],
            "wrong_bytes": self.total(outcome=WRONG, window=window),
            "refused": self.refusals(window),
            "slowest_op_s": round(self.slowest.get(window, 0.0), 3),
        }
