"""One vLLM engine's scheduler side, on CPU: vLLM's real TieringOffloadingSpec and manager, driven as its scheduler does.

The spec is built from an ``OffloadingConfig`` (what vLLM's connector builds
from the engine's config), so the primary tier is vLLM's own CPU tier over
its shared-memory region and each secondary tier comes from vLLM's
``SecondaryTierFactory`` by ``type`` + ``module_path``. What needs a GPU
(the worker copying GPU blocks into and out of the primary tier) is done
here by writing and reading the primary tier's rows directly. Calls hold
the manager's lock, as vLLM's scheduler does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

ROW = 512 << 10  # bytes of one chunk row (one block of 16 tokens per chunk): over the same-host inline limit
MODEL = "acme/tiny-llm"


def strata_entry(target: str, **options) -> dict:
    return {"type": "strata", "module_path": "kvstore.integrations.vllm", "target": target, **options}


def offloading_config(tiers: list[dict], *, engine_id: str | None = None, model: str = MODEL, dtype: str = "bfloat16",
                      tp: int = 1, row: int = ROW, primary_chunks: int = 8, blocks_per_chunk: int = 1,
                      events: bool = True, extra: dict | None = None) -> OffloadingConfig:
    per_worker = row // tp
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.0", "layers.1"), group_id=0),),
        worker_kv_bytes_per_block=per_worker // blocks_per_chunk,
        enable_kv_cache_events=events,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": primary_chunks * row,
                      "secondary_tiers": tiers, **(extra or {})},
        engine_id=engine_id or f"strata-test-{uuid.uuid4().hex[:10]}",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(rank=0, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=False),
    )


def chunk_keys(n: int, seed: int = 0, group: int = 0) -> list[OffloadKey]:
    rng = np.random.default_rng(seed)
    return [make_offload_key(rng.bytes(32), group) for _ in range(n)]


def chunk_bytes(keys: Iterable[OffloadKey], row: int = ROW) -> dict[OffloadKey, bytes]:
    return {k: np.random.default_rng(list(k)).bytes(row) for k in keys}


class Engine:
    """The scheduler side of one engine: a TieringOffloadingManager with its tiers (see the module docstring)."""

    def __init__(self, tiers: list[dict], **config) -> None:
        self.config = offloading_config(tiers, **config)
        self.spec = TieringOffloadingSpec(self.config)
        self.manager = self.spec.get_manager()
        self.row = self.spec.kv_bytes_per_chunk
        self._requests = 0

    @property
    def tier(self):
        return self.manager.secondary_tiers[0]

    def _rows(self) -> np.ndarray:
        """The primary tier's buffer as rows; let go of it before close()."""
        view = self.manager.primary_tier.get_kv_memoryview()
        return np.frombuffer(view, dtype=np.uint8).reshape(len(view), -1)

    def _request(self, hints=None) -> ReqContext:
        self._requests += 1
        ctx = ReqContext(req_id=f"req-{self._requests}", kv_hints=hints)
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        return ctx

    def step(self) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def settle(self, timeout: float = 30.0) -> None:
        """Step until no transfer is in flight."""
        end = time.monotonic() + timeout
        while True:
            self.step()
            with self.manager.lock:
                if not self.manager.has_pending_work():
                    return
            if time.monotonic() > end:
                raise TimeoutError("the tiering manager still has work in flight")
            time.sleep(0.005)

    def store(self, chunks: dict[OffloadKey, bytes], settle: bool = True, hints=None) -> list[OffloadKey]:
        """GPU -> primary (the rows written here), then vLLM cascades to every secondary tier; the keys stored.
        ``hints``: the request's ``KvHintsEnvelope``."""
        ctx = self._request(hints)
        keys = list(chunks)
        with self.manager.lock:
            out = self.manager.prepare_store(keys, ctx)
            assert out is not None, "the primary tier had no room"
            rows = self._rows()
            for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids):
                rows[chunk, : len(chunks[key])] = np.frombuffer(chunks[key], dtype=np.uint8)
            del rows
            self.manager.complete_store(keys, ctx)
            self.manager.on_request_finished(ctx)
        if settle:
            self.settle()
        return list(out.keys_to_store)

    def evict(self, seed: int = 999) -> None:
        """Push every chunk out of the primary tier by storing as many others (vLLM's LRU evicts)."""
        n = self.manager.primary_tier._num_chunks
        self.store(chunk_bytes(chunk_keys(n, seed=seed), self.row))

    def in_primary(self, key: OffloadKey) -> bool:
        with self.manager.lock:
            return self.manager.primary_tier.lookup(key, ReqContext("probe")) is LookupResult.HIT

    def fetch(self, keys: list[OffloadKey], timeout: float = 30.0, hints=None) -> dict[OffloadKey, bytes | None]:
        """Look chunks up as the scheduler does, step until each is a hit or a miss, read the hits."""
        ctx = self._request(hints)
        end = time.monotonic() + timeout
        while True:
            with self.manager.lock:
                results = {k: self.manager.lookup(k, ctx) for k in keys}
                self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in results.values()):
                break
            if time.monotonic() > end:
                raise TimeoutError(f"lookups did not settle: {results}")
            time.sleep(0.005)
        got: dict[OffloadKey, bytes | None] = {k: None for k in keys}
        hits = [k for k, r in results.items() if r is LookupResult.HIT]
        with self.manager.lock:
            if hits:
                spec = self.manager.prepare_load(hits, ctx)
                rows = self._rows()
                for key, chunk in zip(hits, spec.chunk_ids):
                    got[key] = rows[chunk].tobytes()
                del rows
                self.manager.complete_load(hits, ctx)
            self.manager.on_request_finished(ctx)
        return got

    def close(self) -> None:
        self.manager.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
