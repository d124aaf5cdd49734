"""LMCache server mode's L2: the Strata adapter against LMCache's own ``fs`` adapter, driven as the controllers drive them.

Run as ``python -m benchmarks.lmcache_l2 [--quick | --smoke]``. Each adapter
is built the way ``lmcache server --l2-adapter '<json>'`` builds it
(LMCache's argument parser, config registry and ``create_l2_adapter``):

- Strata: ``kvstore.integrations.lmcache_mp`` on a Strata daemon in its own
  process (2 GiB RAM tier, no disk tier), the same-host shared-memory path;
- LMCache's ``fs`` adapter on tmpfs (``/dev/shm``): its fastest case, the
  page cache only, no device;
- LMCache's ``fs`` adapter on the scratch disk (written to the page cache;
  its files are not synced).

The objects are what the server hands its adapters: MemoryObjs of LMCache's
own L1 memory manager, each a 256-token chunk of a small model's KV (8
layers, 4 KV heads of 64, bf16: 2 MiB). Per round and adapter, with fresh
keys: ``store`` (submit one task of every chunk, wait for its event fd and
result), ``lookup`` (lookup-and-lock of every chunk: all must hit), ``load``
(into zeroed destination objects: all must load), then the unlock; the
bytes are compared outside the timing, and the chunks deleted. Adapters take
turns in a rotating order after a warm-up round; medians over rounds. The
ratio is Strata's figure over ``fs`` on tmpfs (``fs`` on disk for context); the target is 1, never
slower than LMCache's own adapter on memory.
``--smoke`` runs two chunks once and writes no results.
"""

from __future__ import annotations

import os

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")

import contextlib  # noqa: E402
import logging  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

from benchmarks.harness import Case, UnitBenchmark, gbps, scratch_dir, settle, strata_daemon_process  # noqa: E402

NAME = "lmcache_l2"
MODEL = "bench/strata-lmcache-l2"
LAYERS, HEADS, HEAD_SIZE, CHUNK = 8, 4, 64, 256
STRATA = "Strata"
FS_TMPFS = "fs on tmpfs"
FS_DISK = "fs on disk"
TARGET = 1.0  # never slower than LMCache's own fs adapter on tmpfs (the page cache alone), in any operation


@dataclass(frozen=True)
class Plan:
    chunks: int  # objects per task
    rounds: int
    warmup: int
    timeout_s: float


FULL = Plan(chunks=64, rounds=7, warmup=1, timeout_s=60.0)
QUICK = Plan(chunks=32, rounds=5, warmup=1, timeout_s=30.0)
SMOKE = Plan(chunks=2, rounds=1, warmup=0, timeout_s=20.0)


@dataclass
class Adapter:
    name: str
    spec: dict
    adapter: object = None
    samples: dict[str, list[float]] = field(default_factory=lambda: {"store": [], "lookup": [], "load": []})
    failed: str = ""


def one_round(a: Adapter, keys, src, dst, timeout_s: float) -> dict[str, float]:
    from tests.support.lmcache_l2 import wait

    adapter = a.adapter
    for obj in dst:
        obj.tensor.zero_()
    t0 = time.perf_counter()
    stored = wait(adapter, "store", adapter.submit_store_task(keys, src), timeout_s)
    t1 = time.perf_counter()
    found = wait(adapter, "lookup", adapter.submit_lookup_and_lock_task(keys, {}), timeout_s)
    t2 = time.perf_counter()
    loaded = wait(adapter, "load", adapter.submit_load_task(keys, dst), timeout_s)
    t3 = time.perf_counter()
    adapter.submit_unlock(keys)
    if not stored.is_successful():
        raise RuntimeError("the store task failed")
    if found.popcount() != len(keys) or loaded.popcount() != len(keys):
        raise RuntimeError(f"{found.popcount()} of {len(keys)} found, {loaded.popcount()} loaded")
    if any(not s.tensor.equal(d.tensor) for s, d in zip(src, dst)):
        raise RuntimeError("a loaded object differs from the one stored")
    adapter.delete(keys)
    return {"store": t1 - t0, "lookup": t2 - t1, "load": t3 - t2}


def main(argv: list[str] | None = None) -> int:
    bench = UnitBenchmark(NAME, __doc__.splitlines()[0], argv)
    plan = bench.plan(FULL, QUICK, SMOKE)
    logging.getLogger("lmcache").setLevel(logging.ERROR)
    import torch
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.config import L1MemoryManagerConfig
    from lmcache.v1.distributed.memory_manager.l1_memory_manager import L1MemoryManager

    from kvstore.integrations.lmcache_mp import CLASS_NAME, MODULE_PATH
    from tests.support import lmcache_l2

    torch.set_num_threads(1)
    shape = torch.Size([2, LAYERS, CHUNK, HEADS * HEAD_SIZE])
    chunk_bytes = shape.numel() * 2
    l1 = L1MemoryManager(L1MemoryManagerConfig(size_in_bytes=2 * plan.chunks * chunk_bytes + (64 << 20),
                                               use_lazy=False, shm_name=""))
    _, src = l1.allocate(MemoryLayoutDesc([shape], [torch.bfloat16]), plan.chunks)
    _, dst = l1.allocate(MemoryLayoutDesc([shape], [torch.bfloat16]), plan.chunks)
    gen = torch.Generator().manual_seed(11)
    for obj in src:
        obj.tensor.copy_(torch.randn(shape, generator=gen).to(torch.bfloat16))
    print(f"{plan.chunks} chunks of {chunk_bytes >> 20} MiB a task; {plan.rounds} rounds after {plan.warmup} warm-up",
          flush=True)

    with contextlib.ExitStack() as stack:
        scratch = stack.enter_context(scratch_dir("lmcache-l2"))
        daemon = stack.enter_context(strata_daemon_process(disk_dir=scratch / "daemon", ram_bytes="2GiB", disk_bytes=0,
                                                   max_block_bytes="64MiB"))
        target = daemon.target
        tmpfs = tempfile.mkdtemp(prefix="strata-bench-fs-", dir="/dev/shm")
        stack.callback(shutil.rmtree, tmpfs, True)
        adapters = [
            Adapter(STRATA, {"type": "plugin", "module_path": MODULE_PATH, "class_name": CLASS_NAME,
                             "adapter_params": {"target": target, "shared_memory": "true",
                                                "timeout_s": plan.timeout_s}}),
            Adapter(FS_TMPFS, {"type": "fs", "base_path": tmpfs}),
            Adapter(FS_DISK, {"type": "fs", "base_path": str(scratch / "fs")}),
        ]
        for a in adapters:
            try:
                a.adapter = lmcache_l2.build(a.spec)
                stack.callback(a.adapter.close)
            except Exception as err:  # noqa: BLE001 - reported as the adapter's note, never dropped
                a.failed = f"could not be built: {type(err).__name__}: {err}"[:300]
        settle([daemon.pid])  # the daemon's arena faulted in (its GIL-holding prefault) before anything is timed
        for r in range(plan.warmup + plan.rounds):
            live = [a for a in adapters if not a.failed]
            shift = r % max(len(live), 1)
            for a in live[shift:] + live[:shift]:
                keys = [ObjectKey(f"{a.name}-{r}-{i}".encode().ljust(32, b"."), MODEL, 0) for i in range(plan.chunks)]
                try:
                    times = one_round(a, keys, src, dst, plan.timeout_s)
                except Exception as err:  # noqa: BLE001 - the adapter leaves the comparison, with the reason
                    a.failed = f"{type(err).__name__}: {err}"[:300]
                    continue
                if r >= plan.warmup:
                    for op, seconds in times.items():
                        a.samples[op].append(seconds)
        report(bench, adapters, plan.chunks * chunk_bytes, plan.chunks)
        bench.finish()
    for obj in src + dst:
        obj.ref_count_down()
    return 1 if adapters[0].failed else 0


def report(bench: UnitBenchmark, adapters: list[Adapter], nbytes: int, chunks: int) -> None:
    def median(a: Adapter, op: str) -> float | None:
        if a.failed or not a.samples[op]:
            return None
        seconds = statistics.median(a.samples[op])
        return seconds * 1000 if op == "lookup" else gbps(nbytes, seconds)

    strata = adapters[0]
    for op in ("store", "load", "lookup"):
        for other in adapters[1:]:
            why = "; ".join(f"{a.name} out: {a.failed}" for a in (strata, other) if a.failed)
            lookup = op == "lookup"
            bench.add(Case(f"{op} {chunks}x2MiB: {STRATA} vs {other.name}", median(strata, op), other.name,
                           median(other, op), higher_is_better=not lookup,
                           target_ratio=TARGET if other.name == FS_TMPFS else None,
                           metric="latency" if lookup else "throughput", unit="ms" if lookup else "GB/s",
                           note=why or ("lookup-and-lock of every chunk of the task" if lookup else "")))


if __name__ == "__main__":
    raise SystemExit(main())
