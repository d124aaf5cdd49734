"""SGLang HiCache L3: the Strata backend against SGLang's own ``file`` backend and a memory copy of the same pages.

Run as ``python -m benchmarks.sglang_backend [--quick | --smoke]``. Both
backends are built by SGLang's own ``StorageBackendFactory`` from a real
``HiCacheStorageConfig`` and attached to the same host pool (the stand-in of
``tests/support/sglang_pool.py``: ``MHATokenToKVPoolHost``'s ``page_first``
buffer, here 64-token pages of 8 layers, 4 KV heads of 64, bf16: 512 KiB a
page, K and V), and called the way SGLang 0.5.23's cache controller calls
each:

- Strata (``kvstore.integrations.sglang``, ``interface_v1``): a backup is
  ``batch_set_v1(keys, host_indices)``, pages copied in place from the pool
  into the daemon's arena; a prefetch is ``batch_exists`` then
  ``batch_get_v1`` into other pages of the pool. The daemon runs in its own
  process (2 GiB RAM tier, no disk tier), reached through shared memory.
- SGLang's ``file`` backend (``HiCacheFile``, no ``interface_v1``): a backup
  gathers each page into a flat tensor (``get_data_page``) and
  ``batch_set``\\ s them, one ``.bin`` file each; a prefetch is
  ``batch_exists``, ``batch_get`` into flat pages, then each scattered into
  the pool (``set_from_flat_data_page``). On tmpfs (``/dev/shm``: memory
  only) and on the scratch disk (its page cache).
- The floor: the same pages copied from the pool into a second buffer and
  back (two ``torch`` copies per page), what any L3 must at least do.

Per round, fresh page keys (a SHA-256 chain, as SGLang's): ``set`` all the
round's pages in batches of 128 (SGLang's ``STORAGE_BATCH_SIZE``), then
``exists``, then ``get`` them into pages zeroed first; bytes compared after
every round outside the timing; stored pages removed between rounds.
Backends take turns in a rotating order after a warm-up round; medians. The
ratio is Strata's figure over the ``file`` backend on tmpfs; the target is 1,
never slower than SGLang's own backend on memory. ``--smoke`` runs a few
small pages once and writes no results.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

from benchmarks.harness import Case, UnitBenchmark, gbps, scratch_dir, settle, strata_daemon_process

NAME = "sglang_backend"
MODEL = "bench/strata-sglang"
BATCH = 128  # SGLang's STORAGE_BATCH_SIZE: pages per storage call of a backup or prefetch
STRATA, FILE_TMPFS, FILE_DISK, FLOOR = "Strata", "file on tmpfs", "file on disk", "memory copy"
TARGET = 1.0


@dataclass(frozen=True)
class Plan:
    pages: int  # per round
    page_size: int
    rounds: int
    warmup: int


FULL = Plan(pages=256, page_size=64, rounds=7, warmup=1)
QUICK = Plan(pages=128, page_size=64, rounds=5, warmup=1)
SMOKE = Plan(pages=4, page_size=16, rounds=1, warmup=0)


@dataclass
class Backend:
    name: str
    storage: object = None
    samples: dict[str, list[float]] = field(default_factory=lambda: {"set": [], "exists": [], "get": []})
    failed: str = ""


def page_keys(n: int, salt: str) -> list[str]:
    keys, prev = [], salt.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "big")).digest()
        keys.append(prev.hex())
    return keys


def main(argv: list[str] | None = None) -> int:
    bench = UnitBenchmark(NAME, __doc__.splitlines()[0], argv)
    plan = bench.plan(FULL, QUICK, SMOKE)
    import torch

    from tests.support.sglang_pool import PageFirstPool, sglang_storage

    storage, factory = sglang_storage()  # SGLang's storage modules, without its front end (before the backend)
    from kvstore.integrations.sglang import BACKEND_NAME, CLASS_NAME, MODULE_PATH
    torch.set_num_threads(1)
    pool = PageFirstPool(2 * plan.pages, page_size=plan.page_size, layer_num=8, head_num=4, head_dim=64)
    page_bytes = 2 * plan.page_size * pool.token_bytes
    src_pages, dst_pages = list(range(plan.pages)), list(range(plan.pages, 2 * plan.pages))
    for p in src_pages:
        pool.fill(p, seed=p + 1)
    expected = {p: pool.page_bytes(p) for p in src_pages}
    print(f"{plan.pages} pages of {page_bytes >> 10} KiB a round (batches of {BATCH}); {plan.rounds} rounds after "
          f"{plan.warmup} warm-up", flush=True)

    def config(extra: dict):
        return storage.HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
            enable_storage_metrics=False, is_page_first_layout=True, model_name=MODEL, extra_config=extra)

    def attach(name: str, extra: dict):
        backend = factory.StorageBackendFactory.create_backend(name, config(extra), pool)
        backend.register_mem_pool_host(pool)
        backend.on_host_pools_registered()
        return backend

    with contextlib.ExitStack() as stack:
        scratch = stack.enter_context(scratch_dir("sglang-l3"))
        daemon = stack.enter_context(strata_daemon_process(disk_dir=scratch / "daemon", ram_bytes="2GiB", disk_bytes=0,
                                                   max_block_bytes="64MiB"))
        target = daemon.target
        tmpfs = tempfile.mkdtemp(prefix="strata-bench-hicache-", dir="/dev/shm")
        stack.callback(shutil.rmtree, tmpfs, True)
        backends = [Backend(STRATA), Backend(FILE_TMPFS), Backend(FILE_DISK), Backend(FLOOR)]
        specs = {
            STRATA: ("dynamic", {"backend_name": BACKEND_NAME, "module_path": MODULE_PATH, "class_name": CLASS_NAME,
                                 "interface_v1": 1, "strata": {"target": target, "shared_memory": "true",
                                                               "timeout_s": 30}}),
            FILE_TMPFS: ("file", {"file_storage_path": tmpfs}),
            FILE_DISK: ("file", {"file_storage_path": str(scratch / "hicache")}),
        }
        for b in backends:
            if b.name in specs:
                try:
                    b.storage = attach(*specs[b.name])
                except ModuleNotFoundError as err:  # the file backend imports SGLang's runtime (triton, orjson...)
                    b.failed = (f"could not be attached: {err}: SGLang's file backend needs SGLang's runtime; "
                                "pip install orjson pybase64 triton (or all of sglang) to compare with it")
                except Exception as err:  # noqa: BLE001 - reported as the backend's note, never dropped
                    b.failed = f"could not be attached: {type(err).__name__}: {err}"[:300]
        floor_buffer = torch.empty((plan.pages, 2 * plan.page_size * pool.token_bytes), dtype=torch.uint8)
        settle([daemon.pid])  # the daemon's arena faulted in (its GIL-holding prefault) before anything is timed
        for r in range(plan.warmup + plan.rounds):
            live = [b for b in backends if not b.failed]
            shift = r % len(live)
            for b in live[shift:] + live[:shift]:
                keys = page_keys(plan.pages, f"{b.name}-{r}")
                try:
                    times = one_round(b, keys, pool, src_pages, dst_pages, floor_buffer)
                    for p_src, p_dst in zip(src_pages, dst_pages):
                        if pool.page_bytes(p_dst) != expected[p_src]:
                            raise RuntimeError(f"page {p_dst} differs from page {p_src} after the get")
                except Exception as err:  # noqa: BLE001 - the backend leaves the comparison, with the reason
                    b.failed = f"{type(err).__name__}: {err}"[:300]
                    continue
                finally:
                    if b.name in (FILE_TMPFS, FILE_DISK):
                        b.storage.clear()
                if r >= plan.warmup:
                    for op, seconds in times.items():
                        b.samples[op].append(seconds)
        report(bench, backends, plan.pages * page_bytes, plan.pages)
        bench.finish()
        for b in backends:
            if b.storage is not None and hasattr(b.storage, "close"):
                b.storage.close()
    sys.stdout.flush()
    return 1 if backends[0].failed else 0


def one_round(b: Backend, keys: list[str], pool, src_pages: list[int], dst_pages: list[int], floor_buffer) -> dict:
    ps = pool.page_size
    pool.kv_buffer[:, dst_pages[0] * ps:(dst_pages[-1] + 1) * ps] = 0
    t0 = time.perf_counter()
    if b.name == FLOOR:
        for i, p in enumerate(src_pages):
            floor_buffer[i].copy_(pool.get_data_page(p * ps).view(-1).view(__import__("torch").uint8))
        t1 = t2 = time.perf_counter()
        for i, p in enumerate(dst_pages):
            pool.set_from_flat_data_page(p * ps, floor_buffer[i].view(pool.dtype))
        return {"set": t1 - t0, "exists": 0.0, "get": time.perf_counter() - t2}
    batches = [(keys[i:i + BATCH], src_pages[i:i + BATCH], dst_pages[i:i + BATCH]) for i in range(0, len(keys), BATCH)]
    storage = b.storage
    for k, src, _ in batches:
        if b.name == STRATA:
            ok = all(storage.batch_set_v1(k, pool.indices(src)))
        else:
            ok = storage.batch_set(k, [pool.get_data_page(p * ps) for p in src])
        if not ok:
            raise RuntimeError("a set batch failed")
    t1 = time.perf_counter()
    found = sum(storage.batch_exists(k) for k, _, _ in batches)
    t2 = time.perf_counter()
    if found != len(keys):
        raise RuntimeError(f"exists found {found} of {len(keys)} pages")
    for k, _, dst in batches:
        if b.name == STRATA:
            got = storage.batch_get_v1(k, pool.indices(dst))
            if not all(got):
                raise RuntimeError("a get batch missed")
        else:
            pages = storage.batch_get(k, [pool.get_dummy_flat_data_page() for _ in k])
            if any(p is None for p in pages):
                raise RuntimeError("a get batch missed")
            for p, data in zip(dst, pages):
                pool.set_from_flat_data_page(p * ps, data)
    t3 = time.perf_counter()
    if b.name == STRATA:
        client = storage.client()
        client.delete(storage.layout.namespace, [bk for key in keys for bk in storage.layout.block_keys(key)])
    return {"set": t1 - t0, "exists": t2 - t1, "get": t3 - t2}


def report(bench: UnitBenchmark, backends: list[Backend], nbytes: int, pages: int) -> None:
    def median(b: Backend, op: str) -> float | None:
        if b.failed or not b.samples[op]:
            return None
        seconds = statistics.median(b.samples[op])
        return seconds * 1000 if op == "exists" else gbps(nbytes, seconds)

    for b in backends:
        if b.failed:
            print(f"{b.name} left out: {b.failed}", flush=True)
    strata = backends[0]
    for op in ("set", "get", "exists"):
        for other in backends[1:]:
            if op == "exists" and other.name == FLOOR:
                continue
            why = "; ".join(f"{b.name} out: {b.failed}" for b in (strata, other) if b.failed)
            lookup = op == "exists"
            bench.add(Case(f"{op} {pages} pages: {STRATA} vs {other.name}", median(strata, op), other.name,
                           median(other, op), higher_is_better=not lookup,
                           target_ratio=TARGET if other.name == FILE_TMPFS else None,
                           metric="latency" if lookup else "throughput", unit="ms" if lookup else "GB/s",
                           note=why or ("batch_exists of every page, in batches of 128" if lookup else
                                        "the pool to the backend and back, as SGLang's controller calls it")))


if __name__ == "__main__":
    raise SystemExit(main())
