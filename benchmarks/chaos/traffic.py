"""Mixed traffic against the fleet while the faults run: client threads putting and reading blocks.

Each daemon has its own workers, as an engine beside it would: a worker
loops until stopped and, with probability ``put_share``, puts a new block
(a fresh key, ``MARKER`` then random bytes of a random size) to its daemon
and, once acknowledged, records its digest in the ledger; otherwise it
reads a random acknowledged block (put through any daemon) back from its
daemon, which is a local hit, a peer fetch, or a read through the bucket,
depending on who holds it and on what is broken at the moment. So while
one daemon is down or stalled, the others' workers go on, and what their
reads of its blocks meet is measured. Every answer is checked against the
ledger and counted (:class:`Tally`).

Clients call with no retries and a 5 s deadline, so each refusal is seen
as the fleet gave it; after one the worker waits ``REFUSED_PAUSE_S``, as a
client that backs off would, instead of spinning on a daemon that is down.
A worker that meets anything but a Strata or gRPC error stops the run: that
is a client or harness bug, not an outcome.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import grpc

from benchmarks.chaos.fleet import NS, Fleet
from benchmarks.chaos.ledger import MISS, OK, Acked, Ledger, Tally, digest, reason
from benchmarks.chaos.path import MARKER
from kvstore.errors import StrataError

REFUSED_PAUSE_S = 0.05


def block_bytes(rng: random.Random, size: int) -> bytes:
    return MARKER + rng.randbytes(size - len(MARKER))


class Traffic:
    def __init__(self, fleet: Fleet, ledger: Ledger, tally: Tally, clock: Callable[[], float], *,
                 workers_per_daemon: int, put_share: float, sizes: tuple[int, int], pace_s: float,
                 seed: int = 0) -> None:
        self.fleet, self.ledger, self.tally, self.clock = fleet, ledger, tally, clock
        self.put_share, self.sizes, self.pace_s, self.seed = put_share, sizes, pace_s, seed
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(w,), name=f"chaos-traffic-{w}", daemon=True)
                         for w in range(workers_per_daemon * len(fleet.nodes))]
        self.errors: list[BaseException] = []

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        if self.errors:
            raise RuntimeError(f"a traffic worker failed: {self.errors[0]!r}") from self.errors[0]

    def _run(self, worker: int) -> None:
        rng = random.Random(self.seed * 1000 + worker)
        node = worker % len(self.fleet.nodes)
        seq = 0
        try:
            while not self._stop.is_set():
                window = self.tally.window
                if len(self.ledger) < 8 or rng.random() < self.put_share:
                    seq += 1
                    self._put(rng, node, b"w%d-%d" % (worker, seq), window)
                else:
                    self._get(rng, node, window)
                if self.pace_s:
                    time.sleep(self.pace_s)
        except BaseException as e:  # noqa: BLE001 (handed to the main thread, which raises it)
            self.errors.append(e)

    def _put(self, rng: random.Random, node: int, key: bytes, window: str) -> None:
        data = block_bytes(rng, rng.randint(*self.sizes))
        began = time.monotonic()
        try:
            stored = self.fleet.clients[node].put(NS, key, data)
        except (grpc.RpcError, StrataError) as e:
            self.tally.record(window, "put", reason(e), time.monotonic() - began)
            time.sleep(REFUSED_PAUSE_S)
            return
        if not stored:  # a fresh key is never stored already
            self.tally.record(window, "put", "already_stored", time.monotonic() - began)
            return
        self.ledger.acknowledge(Acked(key, digest(data), len(data), node, self.clock()))
        self.tally.record(window, "put", OK, time.monotonic() - began)

    def _get(self, rng: random.Random, node: int, window: str) -> None:
        block = self.ledger.pick(rng)
        began = time.monotonic()
        try:
            got = self.fleet.clients[node].get(NS, block.key)
        except (grpc.RpcError, StrataError) as e:
            self.tally.record(window, "get", reason(e), time.monotonic() - began)
            time.sleep(REFUSED_PAUSE_S)
            return
        if check(self.tally, window, "get", node, block, got, time.monotonic() - began) is None:
            now = self.clock()
            self.tally.miss_age(window, node, block, now - block.at_s, now)


def check(tally: Tally, window: str, op: str, node: int, block: Acked, got, seconds: float = 0.0) -> bool | None:
    """Count one read's answer: True for the block's own bytes, None for a miss, False for wrong bytes."""
    if got is None:
        tally.record(window, op, MISS, seconds)
        if node == block.owner:
            tally.owner_miss(window)
        return None
    if len(got) != block.size or digest(got) != block.digest:
        tally.wrong_bytes(window, op, node, block, got)
        return False
    tally.record(window, op, OK, seconds)
    return True
