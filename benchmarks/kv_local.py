"""Same-host block throughput: the daemon's transports, Redis, the disk tier.

Run as ``python -m benchmarks.kv_local [--quick | --smoke] [--auth]``.

First, the calls the README shows (:data:`CALL_CASES`: each row of issue 27's
first table by a name that says what it is, with the issue's target), through
the same-host client against a daemon in its own process: ``put()`` of fresh
keys one call per block and ``put_many()`` batched, ``get()`` and
``get_many()`` that return new bytes, ``get_into()`` the caller's buffers,
against Redis SET/GET/MGET, a numpy copy, and ``bytes(view)`` of the same
size (allocation + copy: what a call that returns bytes cannot avoid). Their
blocks and their destinations are pools of distinct blocks and distinct
preallocated buffers (256 MiB each in the full run, several times the CPU's
last-level cache), walked through round after round: an engine's KV buffers
are many, and one reused buffer stays in cache. The smoke run takes these
at the issue's sizes too (64 KiB, 1 MiB, 16 MiB), with tiny pools.

Then, for each block size (64 KiB, 1 MiB, 4 MiB, 16 MiB; ``--smoke``: 64 KiB and 1 MiB,
which take every path: inline puts and puts in place, the targets of 1 MiB
and up) it measures, alternately in the same rounds:

- puts and gets through a daemon running in its own process, through each
  transport a client can take (:mod:`kvstore.transport`): ``shm``, the
  same-host path (bytes through the shared arena, control over the
  daemon's Unix socket); ``grpc-arena``, the arena with control as gRPC
  calls (the same-host path before the socket existed); and ``grpc``,
  bytes streamed over gRPC (any host). Each one block per call and in
  batches (``put_many`` / ``get_many``);
- a numpy copy of the same bytes into a preallocated buffer, the memory
  bandwidth a copy can reach here;
- Redis SET/GET and MSET/MGET of the same values through redis-py against a
  private ``redis-server``;
- the disk tier (:class:`kvstore.tiers.disk.DiskTier`, in this process)
  against plain sequential writes and reads of the same bytes to files on
  the same filesystem.

With ``--auth`` it measures instead what authentication costs per call:
the same one-block gets and puts of 64 KiB over gRPC (streamed) against
three daemons, alternately in the same rounds: no authentication, a bearer
token checked against a policy file, and mTLS (TLS with a client
certificate, identity from the certificate). Results go to
``results/kv_local_auth.json``.

Every put round writes fresh keys (a repeated put is a no-op) and deletes
them afterwards, outside the timed part, so the RAM tier never fills and no
demotion to disk runs during a measurement. Each measurement also counts the
client's minor page faults in its timed part: a path that hands back freshly
allocated buffers pays for them, and on a VM that can cost more than the copy.

Every case that goes through the daemon is charged with the daemon's CPU
seconds per GB it moved (its timed parts only, warm-up rounds included:
:mod:`benchmarks.daemon_cpu`), and after the daemon cases the daemon's idle
CPU is read over a few seconds with every client still connected and no
traffic, as a share of one core.
"""

from __future__ import annotations

import contextlib
import itertools
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.harness import (
    GiB,
    KiB,
    MiB,
    Benchmark,
    Case,
    RoundFn,
    ServerUnavailable,
    compare,
    filesystem_of,
    interleave,
    private_redis,
    scratch_dir,
    settle,
    size_label,
    strata_daemon,
    strata_daemon_process,
)
from benchmarks.daemon_cpu import CpuUse, DaemonCpu, DaemonMeter
from kvstore import BlockKey, BlockMeta, BlockPut, Client
from kvstore.block import checksum
from kvstore.errors import StrataError
from kvstore.transport import Deadline, Transport, open_transport, placement
from kvstore.tiers.disk import DiskTier

NAME = "kv_local"
NS = "bench"
SIZES = (64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)
BATCH_BYTES = 64 * MiB  # a batch holds at most this many bytes ...
BATCH_BLOCKS = 16  # ... and at most this many blocks
SHM_SINGLE_GET_TARGET = 0.5  # same-host get vs numpy copy, one block of 1 MiB and up per call
SHM_BATCH_TARGET = 0.8  # same-host batched get and put vs numpy copy, blocks of 1 MiB and up
SHM_TARGET_MIN_BYTES = 1 * MiB
REDIS_TARGET = 2.0  # same-host path vs Redis, one block per call (the goal is 3x)
REDIS_GOAL = 3.0
PATHS = ("shm", "grpc-arena", "grpc")  # case label -> Client(transport=...)
TRANSPORT_OF = {"shm": "same-host", "grpc-arena": "grpc-arena", "grpc": "grpc"}
DISK_TARGET = 0.9  # disk tier vs plain file I/O (issue 27)


@dataclass(frozen=True)
class Plan:
    round_bytes: int  # bytes a one-block-per-call measurement moves per round; batched ones move whole batches
    max_calls: int  # ... but at most this many calls: small blocks cost ~1 ms of RPCs per call
    rounds: int
    warmup: int
    sizes: tuple[int, ...] = SIZES
    floor_calls: int = 200  # bare messages timed for the RPC floors the notes quote
    pool_bytes: int = 256 * MiB  # the README calls' pools of distinct blocks and of destination buffers, per size
    idle_s: float = 5.0  # seconds of no traffic the daemon's idle CPU is read over


FULL = Plan(round_bytes=64 * MiB, max_calls=256, rounds=9, warmup=2)
QUICK = Plan(round_bytes=8 * MiB, max_calls=128, rounds=5, warmup=1, pool_bytes=128 * MiB, idle_s=3.0)
# Every case once, in seconds: the smallest size (inline puts) and the smallest with targets (puts in place);
# the README calls at their own sizes, with pools too small to mean anything.
SMOKE = Plan(round_bytes=1 * MiB, max_calls=2, rounds=5, warmup=0, sizes=(64 * KiB, SHM_TARGET_MIN_BYTES),
             floor_calls=5, pool_bytes=4 * MiB, idle_s=1.0)


class Workload:
    """The blocks of one size: distinct random values, their keys, a preallocated copy destination."""

    def __init__(self, size: int, plan: Plan, seed: int) -> None:
        self.size = size
        self.label = size_label(size)
        self.batch = max(1, min(BATCH_BLOCKS, BATCH_BYTES // size))
        self.n_single = max(1, min(plan.max_calls, -(-plan.round_bytes // size)))
        self.n_batched = -(-self.n_single // self.batch) * self.batch  # whole batches only
        n = max(self.n_single, self.n_batched)
        # Page-aligned values, as an engine's KV tensors and the arena's slots are: on some
        # CPUs a copy into a file whose offset and source disagree modulo a page runs at
        # half speed, and unaligned Python bytes would bias every file-write case.
        raw = np.empty(n * size + 4096, dtype=np.uint8)
        start = -raw.ctypes.data % 4096
        src = raw[start : start + n * size]
        src[:] = np.frombuffer(np.random.default_rng(seed).bytes(n * size), dtype=np.uint8)
        view = memoryview(src)
        self.values = [view[i * size : (i + 1) * size] for i in range(n)]
        self.metas = [BlockMeta(size, checksum(v)) for v in self.values]
        self.stored = [b"get-%d-%d" % (size, i) for i in range(n)]  # keys the get rounds read
        dst = np.zeros(self.n_single * size, dtype=np.uint8)  # touched now: no round pays its page faults
        self.copies = [(dst[i * size : (i + 1) * size], src[i * size : (i + 1) * size]) for i in range(self.n_single)]
        self._fresh = itertools.count()

    def count(self, batched: bool) -> int:
        return self.n_batched if batched else self.n_single

    def fresh_keys(self, kind: str, n: int) -> list[bytes]:
        """Keys never used before, for one put round."""
        r = next(self._fresh)
        return [b"put-%s-%d-%d-%d" % (kind.encode(), self.size, r, i) for i in range(n)]

    def batches(self, seq: list) -> Iterator[list]:
        for i in range(0, len(seq), self.batch):
            yield seq[i : i + self.batch]


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class Meter:
    """Times the measured part of a round and counts this process's minor page faults in it; for
    a round that goes through the daemon (``daemon`` given), the daemon's CPU in it too."""

    def __init__(self, daemon: DaemonCpu | None = None, op: str = "") -> None:
        self.faults = 0
        self.clock = DaemonMeter(daemon, op)

    @property
    def nbytes(self) -> int:
        return self.clock.nbytes

    def measure(self, nbytes: int, run: Callable[[], None]) -> tuple[int, float]:
        self.clock.start()
        f0 = _minor_faults()
        run()
        self.faults += _minor_faults() - f0
        return nbytes, self.clock.stop(nbytes)

    def daemon_cpu(self) -> CpuUse | None:
        return self.clock.use()

    def faults_note(self) -> str:
        per_mib = self.faults / (self.nbytes / MiB) if self.nbytes else 0.0
        return f"{per_mib:.0f} client page faults per MiB (256: every page fresh)"


def numpy_copy(w: Workload, m: Meter) -> RoundFn:
    def run() -> None:
        for dst, src in w.copies:
            np.copyto(dst, src)

    return lambda: m.measure(w.n_single * w.size, run)


# ---- Strata daemon -----------------------------------------------------------


def strata_put(w: Workload, client: Client, batched: bool, m: Meter) -> RoundFn:
    kind = ("b" if batched else "s") + client.transport_name
    n = w.count(batched)

    def round_() -> tuple[int, float]:
        keys = w.fresh_keys(kind, n)
        stored: list[bool] = []
        if batched:
            batches = [[BlockPut(k, v) for k, v in b] for b in w.batches(list(zip(keys, w.values)))]

            def run() -> None:
                for items in batches:
                    stored.extend(client.put_many(NS, items))
        else:

            def run() -> None:
                for k, v in zip(keys, w.values):
                    stored.append(client.put(NS, k, v))

        result = m.measure(n * w.size, run)
        if len(stored) != n or not all(stored):
            raise AssertionError(f"{kind}: {n - sum(stored)} of {n} fresh puts were not stored")
        client.delete(NS, keys)  # the RAM tier never fills: no demotion runs under a measurement
        return result

    return round_


def strata_get(w: Workload, client: Client, batched: bool, m: Meter) -> RoundFn:
    """Gets as an engine does them: over shared memory into buffers it owns (like the numpy
    baseline's preallocated destination); streamed gets hand back new buffers."""
    keys = w.stored[: w.count(batched)]
    into = client.shared_memory
    buffers = [bytearray(w.size) for _ in range(w.batch if batched else 1)] if into else []
    missed = 0

    def fetch(batch: list[bytes]) -> list:
        return client.get_into(NS, batch, buffers[: len(batch)]) if into else client.get_many(NS, batch)

    def run_batched() -> None:
        nonlocal missed
        for batch in w.batches(keys):
            for block in fetch(batch):
                if block is None or len(block.data) != w.size:
                    missed += 1

    def run_single() -> None:
        nonlocal missed
        for k in keys:
            [block] = fetch([k])
            if block is None or len(block.data) != w.size:
                missed += 1

    def round_() -> tuple[int, float]:
        result = m.measure(len(keys) * w.size, run_batched if batched else run_single)
        if missed:
            raise AssertionError(f"{missed} gets missed blocks that were stored")
        return result

    return round_


def transport_get(w: Workload, transport: Transport, m: Meter) -> RoundFn:
    """One block per call straight through a transport, into one preallocated buffer."""
    keys = w.stored[: w.n_single]
    buf = bytearray(w.size)
    missed = 0

    def run() -> None:
        nonlocal missed
        for k in keys:
            [block] = transport.get_into(NS, [k], placement([k], [buf]), Deadline.after(60))
            if block is None or len(block.data) != w.size:
                missed += 1

    def round_() -> tuple[int, float]:
        result = m.measure(len(keys) * w.size, run)
        if missed:
            raise AssertionError(f"{missed} gets missed blocks that were stored")
        return result

    return round_


def check_same_bytes(w: Workload, client: Client) -> None:
    """Once, untimed: what each path returns is what was stored."""
    for k, v in zip(w.stored[: w.batch], w.values):
        got = client.get(NS, k)
        if got is None or got != v:
            raise AssertionError(f"{k!r} came back different over {client.transport_name}")


def control_rpc_us(client: Client, n: int = 200) -> float:
    """Median round trip of a tiny control RPC (Stats): the floor under every gRPC call."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.stats()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def socket_round_trip_us(client: Client, n: int = 500) -> float:
    """Median round trip of the smallest same-host message (a Release of nothing): the floor under every
    same-host call.

    No public call sends a bare message, so this reaches into the client's same-host transport of the
    benchmark's namespace (the one its rounds use) and one of its connections.
    """
    from kvstore.transport.samehost import frames

    transport = client._data(NS)
    conn = transport._take()
    times = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            conn.call(frames.RELEASE, [[]], deadline=Deadline.after(10))
            times.append(time.perf_counter() - t0)
    finally:
        transport._give(conn)
    return statistics.median(times) * 1e6


def rpc_floor(path: str, rpc_us: dict[str, float]) -> str:
    if path == "shm":
        return f"a bare same-host message takes {rpc_us['socket']:.0f} us here"
    return f"a bare control RPC takes {rpc_us['grpc']:.0f} us here"


# ---- Redis -------------------------------------------------------------------


class RedisSide:
    """The Redis baseline, or why it cannot run here."""

    def __init__(self, port: int | None, why_not: str = "") -> None:
        self.why_not = why_not
        self.client = None
        self.parser = ""
        if port is not None:
            import redis
            from redis.utils import HIREDIS_AVAILABLE

            self.client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=60)
            self.client.ping()
            self.parser = "hiredis" if HIREDIS_AVAILABLE else "redis-py's pure-Python parser (hiredis not installed)"


@contextlib.contextmanager
def redis_baseline() -> Iterator[RedisSide]:
    """The private redis-server, or a RedisSide that says why it cannot run (the cases then say so)."""
    try:
        import redis  # noqa: F401
    except ImportError:
        yield RedisSide(None, "redis-py is not installed (pip install -e '.[bench]')")
        return
    server = private_redis()
    try:
        port = server.__enter__()
    except ServerUnavailable as err:
        yield RedisSide(None, str(err))
        return
    try:
        yield RedisSide(port)
    finally:
        server.__exit__(None, None, None)


def redis_set(w: Workload, r, batched: bool, m: Meter) -> RoundFn:
    kind = "bredis" if batched else "sredis"
    n = w.count(batched)

    def round_() -> tuple[int, float]:
        keys = w.fresh_keys(kind, n)
        if batched:
            mappings = [dict(b) for b in w.batches(list(zip(keys, w.values)))]

            def run() -> None:
                for mapping in mappings:
                    r.mset(mapping)
        else:

            def run() -> None:
                for k, v in zip(keys, w.values):
                    r.set(k, v)

        result = m.measure(n * w.size, run)
        r.delete(*keys)
        return result

    return round_


def redis_get(w: Workload, r, batched: bool, m: Meter) -> RoundFn:
    keys = w.stored[: w.count(batched)]
    missed = 0

    def run_batched() -> None:
        nonlocal missed
        for batch in w.batches(keys):
            missed += sum(1 for v in r.mget(batch) if v is None or len(v) != w.size)

    def run_single() -> None:
        nonlocal missed
        for k in keys:
            v = r.get(k)
            if v is None or len(v) != w.size:
                missed += 1

    def round_() -> tuple[int, float]:
        result = m.measure(len(keys) * w.size, run_batched if batched else run_single)
        if missed:
            raise AssertionError(f"{missed} Redis GETs missed")
        return result

    return round_


# ---- disk tier ---------------------------------------------------------------


def disk_put(w: Workload, tier: DiskTier, m: Meter) -> RoundFn:
    def round_() -> tuple[int, float]:
        keys = [BlockKey(NS, k) for k in w.fresh_keys("disk", w.n_single)]
        stored: list[bool] = []

        def run() -> None:
            for key, v, meta in zip(keys, w.values, w.metas):
                stored.append(tier.put(key, v, meta))

        result = m.measure(w.n_single * w.size, run)
        if not all(stored):
            raise AssertionError("a fresh disk-tier put was not stored")
        for key in keys:
            tier.delete(key)
        return result

    return round_


def file_write(w: Workload, folder: Path, m: Meter) -> RoundFn:
    def round_() -> tuple[int, float]:
        paths = [folder / k.decode() for k in w.fresh_keys("file", w.n_single)]

        def run() -> None:
            for path, v in zip(paths, w.values):
                with open(path, "wb") as f:
                    f.write(v)

        result = m.measure(w.n_single * w.size, run)
        for path in paths:
            path.unlink()
        return result

    return round_


def disk_get(w: Workload, tier: DiskTier, m: Meter) -> RoundFn:
    keys = [BlockKey(NS, k) for k in w.stored[: w.n_single]]

    def run() -> None:
        for key in keys:
            data = tier.get(key)
            if data is None or len(data) != w.size:
                raise AssertionError(f"disk-tier get of {key} missed")

    return lambda: m.measure(len(keys) * w.size, run)


def file_read(w: Workload, paths: list[Path], m: Meter) -> RoundFn:
    def run() -> None:
        for path in paths:
            with open(path, "rb") as f:
                if len(f.read()) != w.size:
                    raise AssertionError(f"{path} is short")

    return lambda: m.measure(len(paths) * w.size, run)


# ---- cases -------------------------------------------------------------------

_HOW = {
    ("put", "shm"): "blocks up to 256 KiB: one Put message on the same-host socket carrying the bytes (the client "
                    "computes the xxh3, the daemon verifies it while copying into the arena); larger: an Allocate "
                    "message, the client copies into the arena and Commits in up to 3 groups, each Commit in "
                    "flight while the next group is copied; the daemon checksums each slot in place",
    ("get", "shm"): "no message at all for a block this client read before: it copies from the arena extent "
                    "it remembers into its own preallocated buffer (get_into) while computing the xxh3 it "
                    "verifies, and the daemon's shared removal count voids what a Delete removed (the first read "
                    "of a block is one Lookup message: see the 'first read' case)",
    ("get", "shm first read"): "every read asks: one Lookup message on the same-host socket per call (its Release "
                               "rides on the next Lookup), then the copy and xxh3 into preallocated buffers "
                               "(a same-host transport without its location table)",
    ("put", "grpc-arena"): "the same-host path before the socket: an Allocate RPC, copies into the arena, Commit RPCs",
    ("get", "grpc-arena"): "the same-host path before the socket: one Lookup RPC per call (the Release RPC is not "
                           "waited for), copies out of the arena into preallocated buffers",
    ("put", "grpc"): "one client stream of 1 MiB chunks per call; protobuf copies on both sides, "
                     "the daemon assembles, then copies into the arena",
    ("get", "grpc"): "one server stream of 1 MiB chunks per call; the daemon copies out of the arena, "
                     "protobuf copies, the client reassembles into a new bytearray and verifies",
}


def targets(op: str, path: str, size: int) -> tuple[float | None, float | None]:
    """(one block per call, batched) targets against the numpy copy."""
    if path != "shm" or size < SHM_TARGET_MIN_BYTES:
        return None, None
    return (SHM_SINGLE_GET_TARGET if op == "get" else None), SHM_BATCH_TARGET


def bench_daemon(bench: Benchmark, plan: Plan, w: Workload, clients: dict[str, Client], asking: Transport,
                 redis_: RedisSide, rpc_us: dict[str, float], daemon: DaemonCpu) -> None:
    L, N = w.label, w.batch
    xN = f"x{N} batch"
    shm = clients["shm"]

    shm.put_many(NS, [BlockPut(k, v) for k, v in zip(w.stored, w.values)])
    for client in clients.values():
        check_same_bytes(w, client)
    r = redis_.client
    if r is not None:
        r.mset(dict(zip(w.stored, w.values)))

    for op in ("put", "get"):
        cmd = "SET" if op == "put" else "GET"
        single_redis, batch_redis = f"redis {cmd} {L}", f"redis M{cmd} {L} x{N}"
        strata = strata_put if op == "put" else strata_get
        redis_fn = redis_set if op == "put" else redis_get
        meters: dict[str, Meter] = {}

        def meter(name: str, through_daemon: bool = False) -> Meter:
            return meters.setdefault(name, Meter(daemon if through_daemon else None, op))

        def cpu(name: str) -> CpuUse | None:
            return meters[name].daemon_cpu()

        fns: dict[str, RoundFn] = {f"numpy copy {L}": numpy_copy(w, meter(f"numpy copy {L}"))}
        for path, client in clients.items():
            fns[f"{op} {L} {path}"] = strata(w, client, False, meter(f"{op} {L} {path}", True))
            fns[f"{op} {L} {path} {xN}"] = strata(w, client, True, meter(f"{op} {L} {path} {xN}", True))
        first = f"get {L} shm first read"
        if op == "get":
            fns[first] = transport_get(w, asking, meter(first, True))
        if r is not None:
            fns[single_redis] = redis_fn(w, r, False, meter(single_redis))
            fns[batch_redis] = redis_fn(w, r, True, meter(batch_redis))
        s = interleave(fns, rounds=plan.rounds, warmup=plan.warmup)
        med = {name: statistics.median(v) for name, v in s.items()}

        def us(name: str, blocks: int = 1) -> str:
            return f"{w.size * blocks / (med[name] * 1e3):.0f} us per call"

        base = f"numpy copy {L}"
        for path in clients:
            single, batch = f"{op} {L} {path}", f"{op} {L} {path} {xN}"
            single_target, batch_target = targets(op, path, w.size)
            bench.add(compare(s, single, base, target_ratio=single_target, daemon_cpu=cpu(single), note=(
                f"{_HOW[op, path]}; {us(single)} ({rpc_floor(path, rpc_us)}); {meters[single].faults_note()}")))
            grouped = "one stream" if path == "grpc" else "one set of control messages"
            target = batch_target
            slower = (" Slower per byte than one block per call: the batch's fresh output buffers are "
                      "page-faulted in on every call" if op == "get" and med[batch] < med[single] else "")
            bench.add(compare(s, batch, base, target_ratio=target, daemon_cpu=cpu(batch), note=(
                f"{grouped} per {N} blocks; {us(batch, N)}; {meters[batch].faults_note()}.{slower}")))
        if op == "get":
            bench.add(compare(s, first, base, daemon_cpu=cpu(first), note=(
                f"{_HOW['get', 'shm first read']}; {us(first)} ({rpc_floor('shm', rpc_us)}); "
                f"{meters[first].faults_note()}")))
        if r is not None:
            if op == "get":
                bench.add(compare(s, first, single_redis, case=f"{first} vs redis", daemon_cpu=cpu(first), note=(
                    "no target asked, for context: a read that pays the round trip (first read of a block)")))
            bench.add(compare(s, f"{op} {L} shm", single_redis, case=f"{op} {L} shm vs redis",
                              target_ratio=REDIS_TARGET, daemon_cpu=cpu(f"{op} {L} shm"), note=(
                                  f"one block per call on both sides (goal {REDIS_GOAL:g}x); Redis {cmd} through "
                                  f"{redis_.parser}: {us(single_redis)}, {meters[single_redis].faults_note()}")))
            bench.add(compare(s, f"{op} {L} shm {xN}", batch_redis, case=f"{op} {L} shm {xN} vs redis",
                              daemon_cpu=cpu(f"{op} {L} shm {xN}"), note=(
                f"no target asked, for context: one Strata batch of {N} vs one M{cmd} of {N} values; "
                f"Redis {meters[batch_redis].faults_note()}")))
        else:
            for case, baseline, target in ((f"{op} {L} shm vs redis", single_redis, REDIS_TARGET),
                                           (f"{op} {L} shm {xN} vs redis", batch_redis, None)):
                ours = case.removesuffix(" vs redis")
                bench.add(Case(case, med[ours], baseline, None, target_ratio=target,
                               daemon_cpu=cpu(ours), note=f"the Redis baseline could not run here: {redis_.why_not}"))

    shm.delete(NS, w.stored)
    if r is not None:
        r.delete(*w.stored)


# ---- the calls the README shows (issue 27's first table) ----------------------


@dataclass(frozen=True)
class CallCase:
    """One row of the calls' table: a client call at one size against a baseline, with its target.

    ``against``: ``redis`` (SET, MSET, GET or MGET, as the call is), ``copy`` (a numpy copy from the
    pool of blocks into the pool of buffers: the memory bandwidth), ``bytes`` (``bytes(view)`` of a
    stored value: the allocation and copy that a call returning new bytes cannot avoid).
    """

    call: str  # the Client method: put, put_many, get, get_many, get_into
    size: int
    against: str
    target: float | None
    batched: bool = False  # get_into of a batch per call (put_many and get_many always are)

    @property
    def many(self) -> bool:
        return self.batched or self.call in ("put_many", "get_many")

    @property
    def op(self) -> str:
        return "put" if self.call.startswith("put") else "get"

    @property
    def batch(self) -> int:
        """Blocks per call of a batched call (the transport matrix's batches)."""
        return max(1, min(BATCH_BLOCKS, BATCH_BYTES // self.size))

    @property
    def label(self) -> str:
        return size_label(self.size) + (f" x{self.batch}" if self.many else "")

    @property
    def round_name(self) -> str:
        """The candidate's rounds: the call and its size."""
        return f"{self.call}() {self.label}"

    @property
    def versus(self) -> str:
        if self.against == "copy":
            return "numpy copy"
        if self.against == "bytes":
            return "bytes(view)"
        return "redis " + ("M" if self.many else "") + ("SET" if self.op == "put" else "GET")

    @property
    def baseline_name(self) -> str:
        """The baseline's rounds (a copy and bytes(view) move blocks one by one, batched or not)."""
        if self.against == "redis":
            return f"{self.versus} {self.label}"
        return f"{self.versus} {size_label(self.size)}" + (" distinct" if self.against == "copy" else "")

    @property
    def name(self) -> str:
        """The row: what is called, at what size, on what, against what."""
        return f"{self.round_name} {_WHAT[self.call]} vs {self.versus}"


CALL_CASES = (
    CallCase("put", 64 * KiB, "redis", 2.0),
    CallCase("put", 1 * MiB, "copy", 0.6),
    CallCase("put_many", 1 * MiB, "copy", 0.8),
    CallCase("get", 64 * KiB, "redis", 1.5),
    CallCase("get", 1 * MiB, "bytes", 0.7),
    CallCase("get_into", 64 * KiB, "redis", 5.0),
    CallCase("get_into", 1 * MiB, "copy", 0.85),
    CallCase("get_into", 16 * MiB, "copy", 0.9, batched=True),
    CallCase("get_many", 16 * MiB, "bytes", 0.7),
    # For context, no target: each call that returns bytes against the other baseline.
    CallCase("get", 64 * KiB, "bytes", None),
    CallCase("get", 1 * MiB, "redis", None),
    CallCase("get_many", 16 * MiB, "redis", None),
)
_WHAT = {"put": "fresh keys", "put_many": "fresh keys", "get": "bytes", "get_many": "bytes",
         "get_into": "distinct buffers"}


def _page_aligned(nbytes: int) -> np.ndarray:
    """Page-aligned, as an engine's KV tensors are, and written once so that no round pays its page
    faults (``np.zeros`` would map untouched zero pages: the first write to each one faults)."""
    raw = np.empty(nbytes + 4096, dtype=np.uint8)
    raw.fill(0)
    start = -raw.ctypes.data % 4096
    return raw[start : start + nbytes]


def last_level_cache_bytes() -> int | None:
    """The largest data cache of CPU 0 (from sysfs), or None where it cannot be read."""
    best = None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": KiB, "M": MiB, "G": GiB}.get(text[-1:], 1)
        size = int(text.rstrip("KMG")) * scale
        best = max(best or 0, size)
    return best


class Walk:
    """Indices 0 .. n-1 in turn, wrapping: each round takes the next ones, so a round's blocks
    and buffers are the ones touched longest ago."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.at = 0

    def take(self, k: int) -> list[int]:
        out = [(self.at + i) % self.n for i in range(k)]
        self.at = (self.at + k) % self.n
        return out


class CallPool:
    """One size's blocks for the README calls: ``n`` distinct stored blocks and ``n`` distinct
    preallocated destination buffers, each pool ``plan.pool_bytes`` (bigger than the CPU's
    last-level cache in the full and quick plans), walked through round after round.

    Why pools: an engine's KV buffers are many, and one reused destination (or one value put
    over and over) stays in cache and flatters every path. The stored values are slices of
    ``source``, a page-aligned random buffer the sizes share.
    """

    def __init__(self, size: int, plan: Plan, source: np.ndarray) -> None:
        self.size = size
        self.batch, self.per_round, self.per_round_batched, self.n = self.shape(size, plan)
        self.value_arrays = [source[i * size : (i + 1) * size] for i in range(self.n)]
        self.values = [memoryview(a) for a in self.value_arrays]
        dst = _page_aligned(self.n * size)
        self.buffer_arrays = [dst[i * size : (i + 1) * size] for i in range(self.n)]
        self.buffers = [memoryview(a) for a in self.buffer_arrays]
        self.keys = [b"call-%d-%d" % (size, i) for i in range(self.n)]
        self._fresh = itertools.count()

    @staticmethod
    def shape(size: int, plan: Plan) -> tuple[int, int, int, int]:
        """(blocks per batch, blocks per round one per call, blocks per batched round, blocks in each pool)."""
        batch = CallCase("", size, "", None).batch
        per_round = max(1, min(plan.max_calls, -(-plan.round_bytes // size)))
        per_round_batched = -(-per_round // batch) * batch
        return batch, per_round, per_round_batched, max(plan.pool_bytes // size, per_round_batched)

    def count(self, many: bool) -> int:
        return self.per_round_batched if many else self.per_round

    def fresh_keys(self, kind: str, n: int) -> list[bytes]:
        r = next(self._fresh)
        return [b"put-call-%s-%d-%d-%d" % (kind.encode(), self.size, r, i) for i in range(n)]

    def groups(self, seq: list, many: bool) -> list[list]:
        step = self.batch if many else 1
        return [seq[i : i + step] for i in range(0, len(seq), step)]


def call_put(pool: CallPool, client: Client, c: CallCase, m: Meter) -> RoundFn:
    n, walk = pool.count(c.many), Walk(pool.n)

    def round_() -> tuple[int, float]:
        keys = pool.fresh_keys(c.call, n)
        values = [pool.values[i] for i in walk.take(n)]
        stored: list[bool] = []
        if c.many:
            batches = [[BlockPut(k, v) for k, v in zip(ks, vs)]
                       for ks, vs in zip(pool.groups(keys, True), pool.groups(values, True))]

            def run() -> None:
                for items in batches:
                    stored.extend(client.put_many(NS, items))
        else:

            def run() -> None:
                for k, v in zip(keys, values):
                    stored.append(client.put(NS, k, v))

        result = m.measure(n * pool.size, run)
        if len(stored) != n or not all(stored):
            raise AssertionError(f"{c.call}: {n - sum(stored)} of {n} fresh puts were not stored")
        client.delete(NS, keys)  # untimed: the RAM tier never fills
        return result

    return round_


def call_get(pool: CallPool, client: Client, c: CallCase, m: Meter) -> RoundFn:
    n, keys_walk, buffers_walk = pool.count(c.many), Walk(pool.n), Walk(pool.n)
    size = pool.size

    def round_() -> tuple[int, float]:
        keys = [pool.keys[i] for i in keys_walk.take(n)]
        groups = pool.groups(keys, c.many)
        into = pool.groups([pool.buffers[j] for j in buffers_walk.take(n)], c.many) if c.call == "get_into" else []
        missed = 0

        def run() -> None:
            nonlocal missed
            if c.call == "get":
                for k in keys:
                    data = client.get(NS, k)
                    if data is None or len(data) != size:
                        missed += 1
            elif c.call == "get_many":
                for group in groups:
                    missed += sum(1 for b in client.get_many(NS, group) if b is None or len(b.data) != size)
            else:
                for group, buffers in zip(groups, into):
                    missed += sum(1 for b in client.get_into(NS, group, buffers) if b is None or len(b.data) != size)

        result = m.measure(n * size, run)
        if missed:
            raise AssertionError(f"{c.call}: {missed} gets missed blocks that were stored")
        return result

    return round_


def pool_copy(pool: CallPool, m: Meter) -> RoundFn:
    n, sources, destinations = pool.per_round, Walk(pool.n), Walk(pool.n)

    def round_() -> tuple[int, float]:
        pairs = [(pool.buffer_arrays[j], pool.value_arrays[i]) for i, j in zip(sources.take(n), destinations.take(n))]

        def run() -> None:
            for dst, src in pairs:
                np.copyto(dst, src)

        return m.measure(n * pool.size, run)

    return round_


def pool_bytes(pool: CallPool, m: Meter) -> RoundFn:
    n, walk = pool.per_round, Walk(pool.n)

    def round_() -> tuple[int, float]:
        views = [pool.values[i] for i in walk.take(n)]

        def run() -> None:
            for view in views:
                if len(bytes(view)) != pool.size:
                    raise AssertionError("bytes(view) came back short")

        return m.measure(n * pool.size, run)

    return round_


def pool_redis(pool: CallPool, r, c: CallCase, m: Meter) -> RoundFn:
    n, walk = pool.count(c.many), Walk(pool.n)

    def round_() -> tuple[int, float]:
        idx = walk.take(n)
        if c.op == "put":
            keys = pool.fresh_keys("redis" + c.call, n)
            pairs = pool.groups(list(zip(keys, (pool.values[i] for i in idx))), c.many)

            def run() -> None:
                for group in pairs:
                    if c.many:
                        r.mset(dict(group))
                    else:
                        r.set(*group[0])

            result = m.measure(n * pool.size, run)
            r.delete(*keys)
            return result
        groups = pool.groups([pool.keys[i] for i in idx], c.many)
        missed = 0

        def run() -> None:
            nonlocal missed
            for group in groups:
                got = r.mget(group) if c.many else [r.get(group[0])]
                missed += sum(1 for v in got if v is None or len(v) != pool.size)

        result = m.measure(n * pool.size, run)
        if missed:
            raise AssertionError(f"{missed} Redis GETs missed")
        return result

    return round_


_CALL_HOW = {
    "put": "one put() per block, fresh keys (deleted untimed after each round), values from the pool of "
           "distinct blocks",
    "put_many": "one put_many() per batch, fresh keys (deleted untimed), values from the pool",
    "get": "one get() per block: new bytes per call (allocation, copy out of the arena, verification)",
    "get_many": "one get_many() per batch: new bytes per block",
    "get_into": "get_into() the caller's buffers: each call's destinations are the next of the pool of "
                "distinct preallocated buffers, never one reused buffer",
}
_BASELINE_HOW = {
    "copy": "the baseline copies the same number of blocks from the pool of values into the pool of buffers",
    "bytes": "the baseline is bytes(view) of stored values from the pool: allocation + copy",
    "redis": "Redis through redis-py ({parser}) on the same keys",
}


def bench_calls(bench: Benchmark, plan: Plan, client: Client, redis_: RedisSide, daemon: DaemonCpu) -> None:
    """The calls the README shows first, each case of issue 27's first table by name with its target,
    against its baseline in the same rounds; one size at a time, its puts and then its gets.

    Why puts and gets in rounds of their own: a put round deletes its fresh keys afterwards, and a
    Delete voids the locations the same-host client remembers of every key that shares a removal
    bucket with one it deleted (kvstore.transport.samehost.locations): few, but a get round should
    read what it measures the same way every round.
    """
    sizes = sorted({c.size for c in CALL_CASES})
    largest = max(CallPool.shape(size, plan)[3] * size for size in sizes)
    source = _page_aligned(largest)
    source[:] = np.frombuffer(np.random.default_rng(27).bytes(largest), dtype=np.uint8)
    llc = last_level_cache_bytes()
    r = redis_.client
    for size in sizes:
        pool = CallPool(size, plan, source)
        for i in range(0, pool.n, pool.batch):
            client.put_many(NS, [BlockPut(k, v) for k, v in zip(pool.keys[i : i + pool.batch],
                                                                 pool.values[i : i + pool.batch])])
        if r is not None:
            for i in range(0, pool.n, pool.batch):
                r.mset(dict(zip(pool.keys[i : i + pool.batch], pool.values[i : i + pool.batch])))
        for op in ("put", "get"):
            cases = [c for c in CALL_CASES if c.size == size and c.op == op]
            if not cases:
                continue
            if op == "get":
                for k, v in zip(pool.keys, pool.values):  # untimed: right bytes, and every block read once
                    got = client.get(NS, k)
                    if got is None or got != v:
                        raise AssertionError(f"{k!r} came back different")
            _call_rounds(bench, plan, pool, cases, client, redis_, daemon, llc)
        client.delete(NS, pool.keys)
        if r is not None:
            r.delete(*pool.keys)


def _call_rounds(bench: Benchmark, plan: Plan, pool: CallPool, cases: list[CallCase], client: Client,
                 redis_: RedisSide, daemon: DaemonCpu, llc: int | None) -> None:
    r = redis_.client
    meters: dict[str, Meter] = {}
    fns: dict[str, RoundFn] = {}
    for c in cases:
        ours, theirs = c.round_name, c.baseline_name
        if ours not in fns:
            meters[ours] = Meter(daemon, c.op)
            fns[ours] = (call_put if c.op == "put" else call_get)(pool, client, c, meters[ours])
        if theirs not in fns and (c.against != "redis" or r is not None):
            meters[theirs] = Meter()
            fns[theirs] = (pool_copy(pool, meters[theirs]) if c.against == "copy" else
                           pool_bytes(pool, meters[theirs]) if c.against == "bytes" else
                           pool_redis(pool, r, c, meters[theirs]))
    s = interleave(fns, rounds=plan.rounds, warmup=plan.warmup)
    pooled = pool.n * pool.size
    cache = (f"{pooled / llc:.1f}x the {size_label(llc)} last-level cache" if llc
             else "the last-level cache's size unknown")
    for c in cases:
        ours, theirs = c.round_name, c.baseline_name
        per_call = pool.size * (pool.batch if c.many else 1) / (statistics.median(s[ours]) * 1e3)
        note = (f"{_CALL_HOW[c.call]}; {per_call:.0f} us per call; pools of {pool.n} blocks and {pool.n} "
                f"buffers, {size_label(pooled)} each ({cache}); "
                f"{_BASELINE_HOW[c.against].format(parser=redis_.parser)}; {meters[ours].faults_note()}")
        if theirs in s:
            bench.add(compare(s, ours, theirs, case=c.name, target_ratio=c.target, note=note,
                              daemon_cpu=meters[ours].daemon_cpu()))
        else:
            bench.add(Case(c.name, statistics.median(s[ours]), theirs, None, target_ratio=c.target,
                           daemon_cpu=meters[ours].daemon_cpu(),
                           note=f"the Redis baseline could not run here: {redis_.why_not}; {note}"))


def bench_disk(bench: Benchmark, plan: Plan, w: Workload, tier: DiskTier, folder: Path, fs: str) -> None:
    L = w.label
    keys = [BlockKey(NS, k) for k in w.stored[: w.n_single]]
    for key, v, meta in zip(keys, w.values, w.metas):
        tier.put(key, v, meta)
    plain = folder / f"read-{w.size}"
    plain.mkdir()
    paths = [plain / k.decode() for k in w.stored[: w.n_single]]
    for path, v in zip(paths, w.values):
        path.write_bytes(v)

    s = interleave({f"file write {L}": file_write(w, folder, Meter()), f"disk write {L}": disk_put(w, tier, Meter())},
                   rounds=plan.rounds, warmup=plan.warmup)
    bench.add(compare(s, f"disk write {L}", f"file write {L}", target_ratio=DISK_TARGET, note=(
        f"{fs}; no fsync (the tier's default), so both land in the page cache and are deleted before writeback: "
        "this is the tier's CPU cost. Per block the tier also verifies the xxh3 (a separate full pass over the "
        "bytes before the write), writes a header, and does mkstemp + utime + rename")))
    s = interleave({f"file read {L}": file_read(w, paths, Meter()), f"disk read {L}": disk_get(w, tier, Meter())},
                   rounds=plan.rounds, warmup=plan.warmup)
    bench.add(compare(s, f"disk read {L}", f"file read {L}", target_ratio=DISK_TARGET, note=(
        f"{fs}; both read from the page cache (dropping it needs root and hits the whole machine), so this is "
        "the tier's CPU cost, not the device's. Per block the tier also verifies the xxh3 (a second full pass "
        "over the bytes, about as costly as the page-cache copy itself), parses the header and stamps the mtime")))

    for key in keys:
        tier.delete(key)
    for path in paths:
        path.unlink()
    plain.rmdir()


AUTH_SIZE = 64 * KiB
AUTH_TOKEN = "bench-token-0123456789abcdef0123"
AUTH_MODES = ("no auth", "token", "mTLS")


def auth_daemons(scratch: Path, stack: contextlib.ExitStack) -> dict[str, Client]:
    """One daemon per mode, in its own process, and a streamed client of each."""
    import trustme

    ca = trustme.CA()
    ca_pem, server_pem, server_key, client_pem, client_key = (scratch / n for n in (
        "ca.pem", "server.pem", "server.key", "client.pem", "client.key"))
    ca.cert_pem.write_to_path(str(ca_pem))
    server = ca.issue_cert("127.0.0.1", "localhost")
    server.cert_chain_pems[0].write_to_path(str(server_pem))
    server.private_key_pem.write_to_path(str(server_key))
    client = ca.issue_cert("bench-client", common_name="bench-client")
    client.cert_chain_pems[0].write_to_path(str(client_pem))
    client.private_key_pem.write_to_path(str(client_key))
    policy = scratch / "policy.toml"
    policy.write_text(f'[[token]]\nname = "bench"\ntoken = "{AUTH_TOKEN}"\nnamespaces = ["*"]\n')
    common = dict(ram_bytes="512MiB", disk_bytes="1GiB", max_block_bytes="16MiB")
    settings = {
        "no auth": {},
        "token": dict(auth_file=policy),
        "mTLS": dict(tls_cert=server_pem, tls_key=server_key, tls_client_ca=ca_pem),
    }
    options = {
        "no auth": {},
        "token": dict(token=AUTH_TOKEN),
        "mTLS": dict(tls_ca=str(ca_pem), tls_cert=str(client_pem), tls_key=str(client_key)),
    }
    clients = {}
    for mode in AUTH_MODES:
        target = stack.enter_context(strata_daemon(disk_dir=scratch / mode.replace(" ", "-"), **common, **settings[mode]))
        clients[mode] = stack.enter_context(Client(target, transport="grpc", **options[mode]))
        clients[mode].stats()  # connected (and the TLS handshake done) before any round
    return clients


def bench_auth(bench: Benchmark, plan: Plan) -> None:
    w = Workload(AUTH_SIZE, plan, seed=0)
    L = w.label
    with scratch_dir("kv-auth") as scratch, contextlib.ExitStack() as stack:
        clients = auth_daemons(scratch, stack)
        for client in clients.values():
            client.put_many(NS, [BlockPut(k, v) for k, v in zip(w.stored, w.values)])
            check_same_bytes(w, client)
        for op in ("get", "put"):
            strata = strata_get if op == "get" else strata_put
            fns = {f"{op} {L} grpc {mode}": strata(w, c, False, Meter()) for mode, c in clients.items()}
            s = interleave(fns, rounds=plan.rounds, warmup=plan.warmup)
            base = f"{op} {L} grpc no auth"
            per_call = {name: w.size / (statistics.median(v) * 1e3) for name, v in s.items()}
            for mode in AUTH_MODES[1:]:
                name = f"{op} {L} grpc {mode}"
                how = ("the daemon's interceptor reads the authorization metadata, hashes the token (SHA-256), "
                       "looks it up and checks the namespace; the client adds the metadata in a channel interceptor"
                       if mode == "token" else
                       "TLS 1.3 on the connection (handshake done before the rounds), the identity read from "
                       "the verified client certificate per call, then the namespace check")
                bench.add(compare(s, name, base, note=(
                    f"one block per call; {how}; {per_call[name]:.0f} us per call vs {per_call[base]:.0f} us "
                    "without authentication")))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--auth" in argv:
        argv.remove("--auth")
        bench = Benchmark(NAME + "_auth", "What authentication costs per call (--auth)", argv)
        bench.command = f"python -m benchmarks.{NAME} --auth" + bench.mode_flag
        bench_auth(bench, bench.plan(FULL, QUICK, SMOKE))
        bench.finish()
        return 0
    bench = Benchmark(NAME, __doc__.splitlines()[0], argv, daemon_cpu=True)
    plan = bench.plan(FULL, QUICK, SMOKE)
    with scratch_dir("kv") as scratch:
        fs = f"on {filesystem_of(scratch)}"
        with redis_baseline() as redis_side, strata_daemon_process(
            disk_dir=scratch / "daemon", ram_bytes="1GiB", disk_bytes="4GiB", max_block_bytes="64MiB",
        ) as process, contextlib.ExitStack() as stack:
            target, daemon = process.target, DaemonCpu([process.pid])
            try:
                clients = {path: stack.enter_context(Client(target, transport=TRANSPORT_OF[path])) for path in PATHS}
                for client in clients.values():
                    client.stats()
                    client.transport_name  # attaches now, so no round pays for it
                asking = stack.enter_context(open_transport("same-host", target=target, locations=0))
            except StrataError as err:
                raise SystemExit(f"a transport cannot be measured here: {err}") from None
            settle([process.pid])  # the arena's pages faulted in, by the daemon and by each client
            rpc_us = {"grpc": control_rpc_us(clients["shm"], plan.floor_calls),
                      "socket": socket_round_trip_us(clients["shm"], 5 * plan.floor_calls // 2)}
            bench_calls(bench, plan, clients["shm"], redis_side, daemon)
            for seed, size in enumerate(plan.sizes):  # one size's buffers at a time
                bench_daemon(bench, plan, Workload(size, plan, seed), clients, asking, redis_side, rpc_us, daemon)
            bench.add_idle(daemon.idle(plan.idle_s))
        tier = DiskTier(scratch / "tier", 4 * GiB, fsync=False)
        files = scratch / "files"
        files.mkdir()
        try:
            for seed, size in enumerate(plan.sizes):
                bench_disk(bench, plan, Workload(size, plan, seed), tier, files, fs)
        finally:
            tier.close()
    bench.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
