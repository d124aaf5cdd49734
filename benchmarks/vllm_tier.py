"""Strata as a vLLM secondary tier against vLLM's own fs tier and a plain memory copy, through vLLM's real tiering manager.

Run as ``python -m benchmarks.vllm_tier [--quick | --smoke]`` (needs vLLM's Python
layers: see docs/integrations/vllm.md, the ``vllm`` extra). One ``TieringOffloadingManager``
per candidate, built by vLLM's ``TieringOffloadingSpec`` on CPU, each with a
CPU primary tier of exactly the chunks loaded and one secondary tier:

- Strata: ``kvstore.integrations.vllm`` on a Strata daemon in its own process
  (same-host shared-memory path, checked), its RAM holding every chunk;
- vLLM's ``fs`` tier, its ``root_dir`` on the same filesystem as the
  daemon's disk directory (the repository's, not a tmpfs), its own defaults
  (16 read threads; ``O_DIRECT`` where the filesystem takes it, as here);
- the floor: a plain memory copy (numpy) of the same bytes into the same
  number of primary-tier rows, no manager.

A chunk is 2 MiB (one 16-token block of a model with 128 KiB of KV per
token, Llama-3-8B in bf16). Each round: every chunk is evicted from the
primary (``reset_cache``, outside the timing), then one request looks all
of them up as vLLM's scheduler does, stepping every ``STEP_S`` (an engine
step), until every lookup is a hit: the tier's asynchronous lookup, the
promotion job and the copy into the primary all inside the timing. The
first round checks every byte. Load throughput is chunk bytes over that
time. Lookup cost is the scheduler thread's time inside the tier's own
``lookup()`` per call the manager makes (the first, RETRY, and the one
that finds the chunk), over the same rounds. Candidates take turns in a rotating order after a warm-up
round; medians are reported. ``--smoke`` loads 4 chunks in one round (the
one that checks every byte) and writes no results.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from benchmarks.harness import Case, ServerUnavailable, UnitBenchmark, filesystem_of, scratch_dir, strata_daemon

NAME = "vllm_tier"
MiB = 1 << 20
CHUNK = 2 * MiB
STEP_S = 0.001
STRATA, FS, COPY = "Strata tier", "vLLM fs tier", "memory copy"


@dataclass(frozen=True)
class Plan:
    chunks: tuple[int, ...]
    rounds: int
    warmup: int


FULL = Plan(chunks=(64, 256), rounds=7, warmup=1)
QUICK = Plan(chunks=(64,), rounds=5, warmup=1)
SMOKE = Plan(chunks=(4,), rounds=1, warmup=0)


def _config(tier: dict, chunks: int):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=tuple(f"layers.{i}" for i in range(32)),
                                      group_id=0),),
        worker_kv_bytes_per_block=CHUNK, enable_kv_cache_events=False,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": chunks * CHUNK,
                      "secondary_tiers": [tier]},
        engine_id=f"strata-bench-{uuid.uuid4().hex[:10]}",
        model=OffloadingModelConfig(name="bench/llama-3-8b", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=False),
    )


class Engine:
    """One manager with one secondary tier, driven as vLLM's scheduler does."""

    def __init__(self, tier: dict, chunks: int, data) -> None:
        import numpy as np
        from vllm.v1.kv_offload.base import make_offload_key
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        self._np = np
        self.spec = TieringOffloadingSpec(_config(tier, chunks))
        self.manager = self.spec.get_manager()
        assert self.spec.kv_bytes_per_chunk == CHUNK
        self.keys = [make_offload_key(uuid.uuid4().bytes * 2, 0) for _ in range(chunks)]
        self.data = data  # (chunks, CHUNK) uint8
        self._n = 0
        self._store()
        # Time inside the tier's own lookup() (the scheduler thread's cost of asking this tier),
        # measured around the call the manager makes.
        self.tier_lookup_s, self.tier_lookup_calls = 0.0, 0
        inner = self.tier.lookup

        def timed_lookup(key, req_context):
            t = time.perf_counter()
            try:
                return inner(key, req_context)
            finally:
                self.tier_lookup_s += time.perf_counter() - t
                self.tier_lookup_calls += 1

        self.tier.lookup = timed_lookup

    @property
    def tier(self):
        return self.manager.secondary_tiers[0]

    def _ctx(self):
        from vllm.v1.kv_offload.base import ReqContext

        self._n += 1
        ctx = ReqContext(req_id=f"bench-{self._n}")
        self.manager.on_new_request(ctx)
        return ctx

    def _step(self) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.manager.on_schedule_end(ScheduleEndContext((), ()))

    def _rows(self):
        view = self.manager.primary_tier.get_kv_memoryview()
        return self._np.frombuffer(view, dtype=self._np.uint8).reshape(len(view), -1)

    def _store(self) -> None:
        with self.manager.lock:
            ctx = self._ctx()
            out = self.manager.prepare_store(self.keys, ctx)
            rows = self._rows()
            for i, chunk in enumerate(out.store_spec.chunk_ids):
                rows[chunk] = self.data[i]
            del rows
            self.manager.complete_store(self.keys, ctx)
            self.manager.on_request_finished(ctx)
        self._settle()

    def _settle(self, timeout_s: float = 300.0) -> None:
        end = time.monotonic() + timeout_s
        while True:
            with self.manager.lock:
                self._step()
                if not self.manager.has_pending_work():
                    return
            if time.monotonic() > end:
                raise RuntimeError("the tier did not finish its transfers")
            time.sleep(STEP_S)

    def load(self, check: bool, timeout_s: float = 120.0) -> tuple[float, float, int]:
        """Evict every chunk, then look them all up until they are hits:
        (seconds, seconds inside the tier's lookup(), its calls)."""
        from vllm.v1.kv_offload.base import LookupResult

        with self.manager.lock:
            self.manager.reset_cache()
            self.manager.on_reset_flushed()
            ctx = self._ctx()
        self.tier_lookup_s, self.tier_lookup_calls = 0.0, 0
        started = time.perf_counter()
        end = time.monotonic() + timeout_s
        while True:
            with self.manager.lock:
                hits = 0
                for key in self.keys:
                    r = self.manager.lookup(key, ctx)
                    hits += r is LookupResult.HIT
                    if r is LookupResult.MISS:
                        raise RuntimeError(f"{self.tier.tier_type} lost a chunk (lookup answered miss)")
                self._step()
            if hits == len(self.keys):
                break
            if time.monotonic() > end:
                raise RuntimeError(f"{self.tier.tier_type}: lookups did not settle in {timeout_s}s")
            time.sleep(STEP_S)
        seconds = time.perf_counter() - started
        with self.manager.lock:
            if check:
                spec = self.manager.prepare_load(self.keys, ctx)
                rows = self._rows()
                same = all((rows[c] == self.data[i]).all() for i, c in enumerate(spec.chunk_ids))
                del rows
                self.manager.complete_load(self.keys, ctx)
                if not same:
                    raise RuntimeError(f"{self.tier.tier_type} loaded other bytes than were stored")
            self.manager.on_request_finished(ctx)
        return seconds, self.tier_lookup_s, self.tier_lookup_calls

    def close(self) -> None:
        self.manager.shutdown()


def _memory_copy(data, target) -> float:
    started = time.perf_counter()
    for i in range(len(data)):
        target[i] = data[i]
    return time.perf_counter() - started


@contextlib.contextmanager
def _engines(plan_chunks: int, target: str, fs_root: str, data) -> Iterator[dict[str, Engine]]:
    engines: dict[str, Engine] = {}
    try:
        engines[STRATA] = Engine({"type": "strata", "module_path": "kvstore.integrations.vllm", "target": target,
                                  "timeout_s": 30.0, "job_timeout_s": 60.0}, plan_chunks, data)
        engines[FS] = Engine({"type": "fs", "root_dir": fs_root}, plan_chunks, data)
        yield engines
    finally:
        for e in engines.values():
            e.close()


def run(bench: UnitBenchmark, plan: Plan) -> None:
    import numpy as np

    with scratch_dir("vllm-tier") as scratch:
        fstype = filesystem_of(scratch)
        biggest = max(plan.chunks)
        with strata_daemon(ram_bytes=f"{biggest * CHUNK // MiB * 2 + 64}MiB", disk_bytes="4GiB",
                           disk_dir=scratch / "strata", max_block_bytes="8MiB") as target:
            for n in plan.chunks:
                data = np.random.default_rng(n).integers(0, 255, size=(n, CHUNK), dtype=np.uint8)
                target_rows = np.empty_like(data)
                with _engines(n, target, str(scratch / f"fs-{n}"), data) as engines:
                    strata = engines[STRATA].tier
                    namespace = strata.layout.namespace(0)
                    transport = strata._chunks.client().transport_for(namespace)
                    o_direct = getattr(engines[FS].tier, "_use_o_direct", None)
                    names = [STRATA, FS, COPY]
                    loads: dict[str, list[float]] = {k: [] for k in names}
                    lookups: dict[str, list[float]] = {STRATA: [], FS: []}
                    for r in range(plan.warmup + plan.rounds):
                        shift = r % len(names)
                        for name in names[shift:] + names[:shift]:
                            if name == COPY:
                                seconds = _memory_copy(data, target_rows)
                            else:
                                seconds, in_lookup, calls = engines[name].load(check=(r == 0))
                            if r < plan.warmup:
                                continue
                            loads[name].append(n * CHUNK / seconds / 1e9)
                            if name != COPY:
                                lookups[name].append(in_lookup / calls * 1e6)
                    med = {k: statistics.median(v) for k, v in loads.items()}
                    size = f"{n}x2MiB"
                    note = f"Strata over {transport}; fs on {fstype}, O_DIRECT {o_direct}"
                    bench.add(Case(f"load {size}: {STRATA}", med[STRATA], f"{FS} ({'O_DIRECT' if o_direct else 'buffered'})",
                                   med[FS], note=note))
                    bench.add(Case(f"load {size}: {STRATA}", med[STRATA], COPY, med[COPY], note=note))
                    bench.add(Case(f"load {size}: {FS}", med[FS], COPY, med[COPY], note=note))
                    bench.add(Case(f"lookup per chunk {size}: {STRATA}", statistics.median(lookups[STRATA]),
                                   f"{FS} lookup per chunk", statistics.median(lookups[FS]), higher_is_better=False,
                                   metric="latency", unit="us",
                                   note="scheduler thread: time inside the tier's lookup() per call the manager makes"))


def main(argv: list[str] | None = None) -> int:
    bench = UnitBenchmark(NAME, __doc__.splitlines()[0], argv)
    try:
        import vllm.v1.kv_offload.tiering.spec  # noqa: F401
    except ImportError as err:
        print(f"vLLM's tiering code cannot be imported ({err}): install the vllm extra (docs/integrations/vllm.md)", file=sys.stderr)
        return 2
    try:
        run(bench, bench.plan(FULL, QUICK, SMOKE))
    except ServerUnavailable as err:
        print(err, file=sys.stderr)
        return 2
    bench.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
