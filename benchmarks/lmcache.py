"""LMCache on Strata against LMCache's own remote backends: store, lookup, retrieve through LMCacheEngine.

Run as ``python -m benchmarks.lmcache [--quick | --smoke]``. One LMCacheEngine per
backend, all built the same way (LMCache's own engine on CPU, its
``MockGPUConnector`` made to copy into and out of a CPU tensor, as in
``tests/integrations/test_lmcache.py``), each with one remote backend:

- Strata: the remote-storage plugin (``kvstore.integrations.lmcache``) on a
  Strata daemon in its own process, shared-memory path (checked), no disk tier;
- LMCache's ``redis://`` to a private ``redis-server`` (never 6379);
- LMCache's ``resp://`` (its native RESP client) to the same ``redis-server``;
- LMCache's own ``lm://`` server (``lmcache_server 127.0.0.1 PORT cpu``);
- the floor: an in-process plugin that keeps chunks in a dict and copies
  them once each way (``benchmarks.lmcache_floor``). No remote backend can
  beat it; each one's ratio to it shows how much of an operation is
  LMCache's own work and how much the backend adds.

LMCache's ``local_cpu`` is off, so its CPU backend is only an allocator and
every lookup and retrieve goes to the remote backend. The workload is a
token sequence of 8k, 16k and 32k tokens (8k only with ``--quick``; 512, two
chunks, in one round and no warm-up with ``--smoke``, which writes no results) in
256-token chunks of a small model's KV (8 layers, 4 KV heads of 64, bf16:
8 KiB a token, 2 MiB a chunk). Per backend and size: ``store`` (timed until
the remote backend has no put task left), ``lookup`` (hit tokens must equal
the sequence), ``retrieve`` (must return every token, byte for byte; checked
outside the timed part); then the stored chunks are deleted, outside the
timing. Each round uses fresh tokens; backends take turns in a rotating order
(A B C D, B C D A …) after a warm-up round; the medians over rounds are
reported. Every operation runs in a worker thread with a deadline: a backend
that hangs or fails is reported with value null and a note, never dropped,
and is not called again. ``close()`` is also run under a deadline (LMCache's
``redis://`` and ``resp://`` are known to hang there).
"""

from __future__ import annotations

import os

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")

import contextlib  # noqa: E402
import logging  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

from benchmarks.harness import (  # noqa: E402
    Case, ServerUnavailable, UnitBenchmark, free_port, private_redis, scratch_dir, settle, strata_daemon_process,
)

NAME = "lmcache"
MODEL = "bench/strata-lmcache"
LAYERS, HEADS, HEAD_SIZE, CHUNK = 8, 4, 64, 256
TOKEN_BYTES = 2 * LAYERS * HEADS * HEAD_SIZE * 2  # K and V, bf16
TARGET = 2.0  # Strata's retrieve >= 2x the best of LMCache's backends
FLOOR_TARGET = 0.95  # Strata's retrieve >= 0.95x the in-process floor (LMCache's own work plus one copy)
STRATA = "Strata"
FLOOR = "floor"


@dataclass(frozen=True)
class Plan:
    sizes: tuple[int, ...]  # tokens per sequence
    rounds: int
    warmup: int
    op_timeout_s: float  # deadline of one store / lookup / retrieve
    close_timeout_s: float
    # Each engine's CPU buffer (LMCache's max_local_cpu_size, GB): only an allocator here (local_cpu
    # is off), sized for the largest sequence with room to spare. Five engines each allocating 1 GB
    # took most of a smoke run, whose two chunks need 4 MiB.
    cpu_buffer_gb: float = 1.0


FULL = Plan(sizes=(8192, 16384, 32768), rounds=5, warmup=1, op_timeout_s=120.0, close_timeout_s=10.0)
QUICK = Plan(sizes=(8192,), rounds=3, warmup=1, op_timeout_s=10.0, close_timeout_s=3.0)
SMOKE = Plan(sizes=(2 * CHUNK,), rounds=1, warmup=0, op_timeout_s=5.0, close_timeout_s=1.0, cpu_buffer_gb=0.05)


class LMCacheBenchmark(UnitBenchmark):
    baseline_width = 30


class Hung(RuntimeError):
    pass


def with_deadline(fn: Callable[[], object], timeout_s: float, what: str):
    """``fn()`` in a daemon thread; :class:`Hung` when it is not done by the deadline."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            box["error"] = err

    t = threading.Thread(target=run, name=f"bench-{what}", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise Hung(f"{what} hung (no answer in {timeout_s:g} s)")
    if "error" in box:
        raise box["error"]
    return box["value"]


# ---- the engine ------------------------------------------------------------------


def _lmcache():
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
    from lmcache.v1.metadata import LMCacheMetadata

    return torch, LMCacheEngineBuilder, LMCacheEngineConfig, MockGPUConnector, LMCacheMetadata


def make_kv_connector(kv):
    _, _, _, MockGPUConnector, _ = _lmcache()

    class CPUKVConnector(MockGPUConnector):
        """The mock GPU connector, made to copy: the "GPU" KV is a CPU tensor [2, layers, tokens, heads*head]."""

        def __init__(self, kv) -> None:
            super().__init__((LAYERS, 2, CHUNK, HEADS, HEAD_SIZE))
            self.kv = kv

        def from_gpu(self, memory_obj, start, end, **kwargs):
            memory_obj.tensor.copy_(self.kv[:, :, start:end])

        def to_gpu(self, memory_obj, start, end, **kwargs):
            self.kv[:, :, start:end].copy_(memory_obj.tensor)

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
            for obj, start, end in zip(memory_objs, starts, ends):
                self.from_gpu(obj, start, end)

        def batched_to_gpu(self, memory_objs, starts, ends, **kwargs):
            for obj, start, end in zip(memory_objs, starts, ends):
                self.to_gpu(obj, start, end)

    return CPUKVConnector(kv)


@dataclass
class Backend:
    name: str
    remote_url: str | None = None
    plugin: dict | None = None  # extra_config of a remote-storage plugin
    plugin_name: str = "strata"
    cleanup: Callable[[list], None] | None = None  # deletes the chunks of these keys, untimed
    failed: str = ""  # why it is out (hung / failed); empty while it runs
    notes: list[str] = field(default_factory=list)
    engine: object = None
    instance_id: str = ""
    kv_conn: object = None
    remote: object = None  # LMCache's RemoteBackend of this engine
    samples: dict = field(default_factory=dict)  # (op, size) -> [values]

    def build(self, max_tokens: int, timeout_s: float, cpu_buffer_gb: float) -> None:
        torch, Builder, Config, _, Metadata = _lmcache()
        extra = dict(self.plugin or {})
        config = Config.from_defaults(
            chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=cpu_buffer_gb, remote_url=self.remote_url,
            remote_serde="naive", remote_storage_plugins=[self.plugin_name] if self.plugin else None,
            save_unfull_chunk=False, blocking_timeout_secs=int(timeout_s), extra_config=extra or None,
        )
        metadata = Metadata(
            model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
            kv_dtype=torch.bfloat16, kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_SIZE), chunk_size=CHUNK,
        )
        self.kv_conn = make_kv_connector(torch.zeros(2, LAYERS, max_tokens, HEADS * HEAD_SIZE, dtype=torch.bfloat16))
        self.instance_id = f"bench-{self.name.strip(':/')}-{uuid.uuid4().hex[:6]}"

        def create():
            engine = Builder.get_or_create(self.instance_id, config, metadata, self.kv_conn,
                                           lambda *a: None, lambda *a: None)
            engine.post_init()
            return engine

        self.engine = with_deadline(create, timeout_s, f"{self.name} engine start")
        remotes = [b for n, b in self.engine.storage_manager.storage_backends.items() if n.startswith("RemoteBackend")]
        if len(remotes) != 1 or getattr(remotes[0], "connection", None) is None:
            raise RuntimeError(f"no remote backend connected (backends: {list(self.engine.storage_manager.storage_backends)})")
        self.remote = remotes[0]
        self._track_puts()

    def _track_puts(self) -> None:
        """Count the remote puts in flight: LMCache submits them to its event loop and returns
        (a batched put leaves no trace in ``put_tasks``), so a timed store waits for this to be 0."""
        conn = self.remote.connection
        self._pending = 0
        lock = threading.Lock()

        def wrap(orig):
            def call(*args, **kwargs):
                with lock:
                    self._pending += 1

                async def run():
                    try:
                        return await orig(*args, **kwargs)
                    finally:
                        with lock:
                            self._pending -= 1

                return run()

            return call

        for name in ("put", "batched_put"):
            setattr(conn, name, wrap(getattr(conn, name)))

    def connector(self):
        """The plugin or connector object under LMCache's instrumentation wrapper."""
        conn = self.remote.connection
        return conn.getWrappedConnector() if hasattr(conn, "getWrappedConnector") else conn

    def keys(self, tokens) -> list:
        return [key for _, _, key in self.engine.token_database.process_tokens(tokens)]

    # ---- the three operations (each returns its measurement) ------------------

    def store(self, tokens, kv, timeout_s: float) -> float:
        self.kv_conn.kv = kv
        failed_before = getattr(self.remote, "_put_failed_count", 0)

        def run() -> float:
            t0 = time.perf_counter()
            self.engine.store(tokens)
            while self._pending or self.remote.put_tasks:  # puts are asynchronous: wait until the remote has them
                time.sleep(0.0005)
            return time.perf_counter() - t0

        seconds = with_deadline(run, timeout_s, f"{self.name} store")
        if getattr(self.remote, "_put_failed_count", 0) != failed_before:
            raise RuntimeError("LMCache logged failed puts")
        return len(tokens) / seconds

    def lookup(self, tokens, timeout_s: float) -> float:
        def run():
            t0 = time.perf_counter()
            hits = self.engine.lookup(tokens)
            return hits, time.perf_counter() - t0

        hits, seconds = with_deadline(run, timeout_s, f"{self.name} lookup")
        if hits != len(tokens):
            raise RuntimeError(f"lookup found {hits} of {len(tokens)} tokens")
        return seconds * 1e3

    def retrieve(self, tokens, source, timeout_s: float) -> float:
        torch = _lmcache()[0]
        self.kv_conn.kv = torch.zeros_like(source)

        def run():
            t0 = time.perf_counter()
            mask = self.engine.retrieve(tokens)
            return int(mask.sum()), time.perf_counter() - t0

        got, seconds = with_deadline(run, timeout_s, f"{self.name} retrieve")
        if got != len(tokens):
            raise RuntimeError(f"retrieve returned {got} of {len(tokens)} tokens")
        if not torch.equal(self.kv_conn.kv.view(torch.int16), source.view(torch.int16)):
            raise RuntimeError("retrieve returned different bytes")
        return len(tokens) / seconds

    def close(self, timeout_s: float) -> None:
        if self.engine is None:
            return
        _, Builder, _, _, _ = _lmcache()
        try:
            with_deadline(lambda: Builder.destroy(self.instance_id), timeout_s, f"{self.name} close")
        except Hung as err:
            self.notes.append(f"close() {err}")
        except Exception as err:  # noqa: BLE001
            self.notes.append(f"close() failed: {type(err).__name__}: {err}")
        self.engine = None


# ---- servers -----------------------------------------------------------------------


def _wait_port(port: int, proc: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
        time.sleep(0.1)
    return False


@contextlib.contextmanager
def lm_server(timeout_s: float = 30.0) -> Iterator[int]:
    """LMCache's own server, ``lmcache_server 127.0.0.1 PORT cpu``, as a child process; yields its port."""
    exe = shutil.which("lmcache_server")
    cmd = [exe] if exe else [sys.executable, "-m", "lmcache.v1.server"]
    port = free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd + ["127.0.0.1", str(port), "cpu"], stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, env=dict(os.environ, LMCACHE_TRACK_USAGE="false"))
    try:
        if not _wait_port(port, proc, timeout_s):
            log.seek(0)
            raise ServerUnavailable("lmcache_server did not start: " + log.read().decode(errors="replace")[-500:])
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def redis_flush(port: int) -> Callable[[list], None]:
    def flush(_keys: list) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"FLUSHALL\r\n")
            if not s.recv(16).startswith(b"+OK"):
                raise RuntimeError("FLUSHALL failed")

    return flush


def strata_delete(target: str) -> Callable[[list], None]:
    from kvstore import Client
    from kvstore.integrations.lmcache import block_key, namespace_of

    def delete(keys: list) -> None:
        with Client(target, use_shm=False, timeout=30) as c:
            c.delete(namespace_of(MODEL), [block_key(k) for k in keys])

    return delete


# ---- the run -----------------------------------------------------------------------


def run_rounds(backends: list[Backend], plan: Plan, source_full) -> None:
    torch = _lmcache()[0]
    seq = 0
    for r in range(-plan.warmup, plan.rounds):
        sizes = plan.sizes[:1] if r < 0 else plan.sizes
        shift = r % len(backends)
        order = backends[shift:] + backends[:shift]
        for size in sizes:
            seq += 1
            # fresh tokens every round (LMCache would skip chunks it already holds); same for every backend
            tokens = torch.arange(seq * 1_000_000, seq * 1_000_000 + size)
            source = source_full[:, :, :size].contiguous()
            for b in order:
                if b.failed:
                    continue
                op = "store"
                try:
                    store = b.store(tokens, source, plan.op_timeout_s)
                    op = "lookup"
                    lookup = b.lookup(tokens, plan.op_timeout_s)
                    op = "retrieve"
                    retrieve = b.retrieve(tokens, source, plan.op_timeout_s)
                    op = "cleanup"
                    if b.cleanup is not None:
                        b.cleanup(b.keys(tokens))
                except Hung as err:
                    b.failed = str(err)
                except Exception as err:  # noqa: BLE001 - reported, not raised
                    b.failed = f"{op} failed: {type(err).__name__}: {err}"[:300]
                else:
                    if r >= 0:
                        for name, value in (("store", store), ("lookup", lookup), ("retrieve", retrieve)):
                            b.samples.setdefault((name, size), []).append(value)
                if b.failed:
                    print(f"  {b.name}: {b.failed}", flush=True)
        done = "warm-up" if r < 0 else f"round {r + 1}/{plan.rounds}"
        print(f"{done}: " + ", ".join(
            f"{b.name} " + (f"retrieve {statistics.median(b.samples[('retrieve', sizes[-1])]) / 1e6:.2f} Mtok/s"
                            if r >= 0 and ("retrieve", sizes[-1]) in b.samples else ("out" if b.failed else "ok"))
            for b in backends), flush=True)


def median(b: Backend, op: str, size: int) -> float | None:
    values = b.samples.get((op, size))
    if b.failed or not values:
        return None
    return statistics.median(values)


def floor_clear(backend: Backend) -> Callable[[list], None]:
    return lambda keys: backend.connector().clear(keys)


def report(bench: LMCacheBenchmark, backends: list[Backend], plan: Plan) -> None:
    strata, floor = backends[0], backends[-1]
    others = backends[1:-1]
    for size in plan.sizes:
        label = f"{size // 1024}k tokens" if size % 1024 == 0 else f"{size} tokens"
        for op, unit, higher in (("store", "tokens/s", True), ("lookup", "ms", False), ("retrieve", "tokens/s", True)):
            mine = median(strata, op, size)
            for b in others:
                theirs = median(b, op, size)
                why = "; ".join(filter(None, [
                    f"{b.name} out: {b.failed}" if b.failed else "",
                    f"{STRATA} out: {strata.failed}" if strata.failed else "",
                    *(f"{x.name}: {n}" for x in (strata, b) for n in x.notes),
                ]))
                bench.add(Case(f"{op} {label}: {STRATA} vs {b.name}", mine, f"LMCache {b.name}", theirs,
                               higher_is_better=higher, metric="latency" if op == "lookup" else "throughput",
                               unit=unit, note=why))
            if op == "retrieve":
                alive = [(median(b, op, size), b.name) for b in others if median(b, op, size) is not None]
                best, best_name = max(alive) if alive else (None, "none ran")
                out = [f"{b.name} ({b.failed})" for b in others if b.failed]
                note = (f"target: {STRATA}'s retrieve >= {TARGET:g}x the best of LMCache's backends that ran"
                        + (f"; not in the comparison: {', '.join(out)}" if out else ""))
                bench.add(Case(f"retrieve {label}: {STRATA} vs best", mine, f"best of LMCache's ({best_name})", best,
                               target_ratio=TARGET, unit="tokens/s", note=note))
        for op, unit, higher in (("store", "tokens/s", True), ("lookup", "ms", False), ("retrieve", "tokens/s", True)):
            theirs = median(floor, op, size)
            for b in (strata, *others):
                target = FLOOR_TARGET if (b is strata and op == "retrieve") else None
                bench.add(Case(f"{op} {label}: {b.name} vs floor", median(b, op, size), "in-process floor", theirs,
                               higher_is_better=higher, metric="latency" if op == "lookup" else "throughput", unit=unit,
                               target_ratio=target,
                               note="the floor is LMCache's own work plus one copy; no remote backend reaches 1.0"
                               + (f"; {b.name} out: {b.failed}" if b.failed else "")
                               + (f"; floor out: {floor.failed}" if floor.failed else "")))


def main(argv: list[str] | None = None) -> int:
    bench = LMCacheBenchmark(NAME, __doc__.splitlines()[0], argv)
    plan = bench.plan(FULL, QUICK, SMOKE)
    logging.getLogger("lmcache").setLevel(logging.ERROR)
    torch = _lmcache()[0]
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(7)
    source = torch.randn(2, LAYERS, max(plan.sizes), HEADS * HEAD_SIZE, generator=g).to(torch.bfloat16)
    print(f"KV: {TOKEN_BYTES} B a token, {TOKEN_BYTES * CHUNK >> 20} MiB a chunk; sizes {plan.sizes}; "
          f"{plan.rounds} rounds after {plan.warmup} warm-up", flush=True)
    exit_stack = contextlib.ExitStack()
    backends: list[Backend] = []
    with exit_stack:
        scratch = exit_stack.enter_context(scratch_dir("lmcache"))
        daemon = exit_stack.enter_context(strata_daemon_process(
            disk_dir=scratch / "daemon", ram_bytes="2GiB", disk_bytes=0, max_block_bytes="64MiB"))
        target = daemon.target
        backends.append(Backend(STRATA, plugin={
            "remote_storage_plugin.strata.module_path": "kvstore.integrations.lmcache",
            "remote_storage_plugin.strata.class_name": "StrataConnector",
            "remote_storage_plugin.strata.target": target,
            "remote_storage_plugin.strata.timeout_s": plan.op_timeout_s,
            "remote_storage_plugin.strata.shared_memory": "true",
        }, cleanup=strata_delete(target)))
        try:
            rport = exit_stack.enter_context(private_redis())
            backends.append(Backend("redis://", remote_url=f"redis://127.0.0.1:{rport}", cleanup=redis_flush(rport)))
            backends.append(Backend("resp://", remote_url=f"resp://127.0.0.1:{rport}", cleanup=redis_flush(rport)))
        except ServerUnavailable as err:
            backends += [Backend("redis://", failed=f"no redis-server: {err}"),
                         Backend("resp://", failed=f"no redis-server: {err}")]
        try:
            lport = exit_stack.enter_context(lm_server())
            backends.append(Backend("lm://", remote_url=f"lm://127.0.0.1:{lport}"))
        except ServerUnavailable as err:
            backends.append(Backend("lm://", failed=str(err)))
        floor = Backend(FLOOR, plugin_name="floor", plugin={
            "remote_storage_plugin.floor.module_path": "benchmarks.lmcache_floor",
            "remote_storage_plugin.floor.class_name": "InProcessFloor",
        })
        floor.cleanup = floor_clear(floor)
        backends.append(floor)

        for b in backends:
            if b.failed:
                continue
            try:
                b.build(max(plan.sizes), max(plan.op_timeout_s, 30.0), plan.cpu_buffer_gb)
            except Hung as err:
                b.failed = str(err)
            except Exception as err:  # noqa: BLE001
                b.failed = f"engine start failed: {type(err).__name__}: {err}"[:300]
        settle([daemon.pid])  # the daemon's arena and the plugin's mapping of it faulted in before anything is timed
        run_rounds(backends, plan, source)
        strata = backends[0]
        if strata.engine is not None:
            conn = strata.remote.connection.getWrappedConnector()
            sync = conn._sync_client()
            strata.notes.append("shared-memory path" if sync.shared_memory else "NOT on the shared-memory path")
        for b in backends:
            b.close(plan.close_timeout_s)
        report(bench, backends, plan)
        bench.finish()
    sys.stdout.flush()
    sys.stderr.flush()
    # Hung LMCache close() threads and LMCache's idle periodic threads would hold the interpreter.
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
