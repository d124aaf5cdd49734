"""The reference engine of the end-to-end benchmark: one model, one sequence at a time, prefix caches.

``python -m benchmarks.e2e.engine --model DIR --port P [--prefix-cache blocks] [--kv-events tcp://..]
[--strata ADDR --namespace NS]`` serves the OpenAI-compatible HTTP API of :mod:`benchmarks.e2e.server`
(the command is :mod:`benchmarks.e2e.engine.__main__`).

A request's prompt is keyed block by block with the vLLM hash chain
(:class:`kvstore.index.keys.BlockHasher`, ``--block-size``, ``--hash-seed`` as vLLM's
PYTHONHASHSEED), so the keys in this engine's KV events, in the shared pool and in a router's
``Score`` are one and the same. Then:

1. the engine's own cache (``--prefix-cache``) gives the KV of the longest prefix it holds;
2. the shared pool (``--strata``) gives the following full blocks that it holds;
3. the rest of the prompt is prefilled, the first token picked (greedy at temperature 0);
4. the prompt's full blocks go to the engine's cache (KV events published) and, queued, to the
   pool; decoding continues, and afterwards the blocks completed by generated tokens follow.

The first token and the greedy continuation do not depend on where the prefix's KV came from:
that is the property the tests check for every mode.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from kvstore.index.keys import BlockHasher

from benchmarks.e2e.events import EventSink, ZmqEventPublisher
from benchmarks.e2e.metrics import EngineMetrics
from benchmarks.e2e.pool import DEFAULT_MAX_PENDING_BLOCKS, BlockPool
from benchmarks.e2e.prefix_cache import PREFIX_CACHES, CacheOptions, make_prefix_cache
from benchmarks.e2e.runner import ModelRunner, PublishedModel, cache_of, kv_of

log = logging.getLogger(__name__)

HANDOFF_STORE_TIMEOUT_S = 10.0  # a remote-decode prefill waits this long for its blocks to reach the daemon


@dataclass(frozen=True)
class EngineConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    engine_id: str = "engine-0"
    served_model_name: str = ""  # "" → the model directory's name
    block_size: int = 16
    hash_seed: str = "0"
    prefix_cache: str = "blocks"
    cache_blocks: int = 4096
    kv_events: str = ""
    kv_events_replay: str = ""
    strata: str = ""
    namespace: str = ""
    pool_max_pending: int = DEFAULT_MAX_PENDING_BLOCKS
    max_queue: int = 64
    max_tokens_limit: int = 4096
    threads: int = 0  # torch threads; 0 keeps torch's default
    admin: bool = False  # serve POST /admin/reconfigure (the benchmark's reuse of an engine across phases)
    wait_for_model_s: float = 0.0  # wait this long for a model directory still being written (its marker file)
    # --model as a published revision (s3://bucket/prefix), streamed through the node's weight cache:
    model_digest: str = ""
    weights_cache: str = ""
    s3_endpoint: str = ""

    @property
    def published(self) -> PublishedModel | None:
        if not self.model_digest:
            return None
        return PublishedModel(self.model, self.model_digest, self.weights_cache, self.s3_endpoint)

    def __post_init__(self) -> None:
        if self.prefix_cache not in PREFIX_CACHES:
            raise ValueError(f"--prefix-cache {self.prefix_cache!r}: use one of {', '.join(PREFIX_CACHES)}")
        if bool(self.strata) != bool(self.namespace):
            raise ValueError("the shared pool needs both --strata ADDR and --namespace NS")
        if self.max_queue < 0:
            raise ValueError("--max-queue must be 0 or more (requests waiting beyond the one computing)")
        if self.max_tokens_limit < 1:
            raise ValueError("--max-tokens-limit must be at least 1")
        if bool(self.model_digest) != bool(self.weights_cache):
            raise ValueError("a published model needs both --model-digest and --weights-cache (the node cache)")


# What a running engine may change (Engine.reconfigure); the rest is fixed by the loaded model and the socket.
RECONFIGURABLE = frozenset({"engine_id", "prefix_cache", "cache_blocks", "kv_events", "kv_events_replay", "strata",
                            "namespace", "pool_max_pending", "max_queue"})


@dataclass
class Generation:
    """One request's outcome; ``tokens`` grows as it decodes."""

    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    cached_local: int = 0
    cached_pool: int = 0
    finish_reason: str = "length"
    prefill_s: float = 0.0
    prefill_cpu_s: float = 0.0  # CPU time of the computing thread (all of it with one torch thread)
    decode_s: float = 0.0
    kv_transfer_params: dict | None = None  # a prefill for remote decode: the handoff the decode side pulls
    pulled_blocks: int = 0  # a remote decode: blocks its handoff brought into this node's daemon


class Engine:
    """Model + caches + pool. :meth:`generate` runs on one compute thread at a time (the server's)."""

    def __init__(self, config: EngineConfig, metrics: EngineMetrics | None = None) -> None:
        self.config = config
        self.hasher = BlockHasher(config.block_size, config.hash_seed)
        self.runner = ModelRunner(config.model, config.block_size, config.threads or None, published=config.published)
        self._compute = threading.Lock()
        self._build(metrics or EngineMetrics())

    def _build(self, metrics: EngineMetrics) -> None:
        """What one configuration of the engine holds: metrics, the KV-event sink, the cache, the pool."""
        config = self.config
        self.metrics = metrics
        self.events: EventSink = (
            ZmqEventPublisher(config.kv_events, config.kv_events_replay or None) if config.kv_events else EventSink()
        )
        self.metrics.events_dropped.set_function(lambda: self.events.dropped_batches)
        self.cache = make_prefix_cache(config.prefix_cache, CacheOptions(config.cache_blocks, config.block_size, self.events))
        self.metrics.cache_blocks.set_function(self.cache.blocks_held)
        self.pool = (
            BlockPool(config.strata, config.namespace, self.runner.layout, self.metrics,
                      max_pending_blocks=config.pool_max_pending)
            if config.strata else None
        )

    def reconfigure(self, **changes) -> EngineConfig:
        """Start over as a fresh engine of another configuration, keeping only the loaded model.

        For the benchmark, which reuses one engine process across phases: the prefix cache is
        a new, empty one (of ``prefix_cache`` mode), the KV-event publisher and the pool client
        are closed and opened anew as ``changes`` says (a new namespace: an empty pool), and the
        metrics start from zero. Runs between requests (it takes the compute lock). Only the
        fields in :data:`RECONFIGURABLE` may change: the others are the loaded model's.
        """
        fixed = sorted(set(changes) - RECONFIGURABLE)
        if fixed:
            raise ValueError(f"{', '.join(fixed)} cannot change without a restart; "
                             f"reconfigurable: {', '.join(sorted(RECONFIGURABLE))}")
        config = replace(self.config, **changes)  # validated before anything is closed
        with self._compute:
            self.close()
            self.config = config
            self._build(EngineMetrics())
        log.info("engine reconfigured: %s (prefix cache %s, pool %s, KV events %s)", config.engine_id,
                 config.prefix_cache, config.namespace or "off", config.kv_events or "off")
        return config

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        self.events.close()

    def generate(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        temperature: float = 0.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        on_token: Callable[[Generation], None] | None = None,
        cancelled: Callable[[], bool] = lambda: False,
        remote_decode: bool = False,
        handoff: dict | None = None,
    ) -> Generation:
        """Generate up to ``max_tokens`` after ``prompt``; ``on_token`` sees each new token.

        Disaggregated serving, as vLLM's ``kv_transfer_params`` asks: ``remote_decode`` (a prefill
        engine's request) hands the prompt's full blocks off through the pool's daemon once the first
        token is picked (:attr:`Generation.kv_transfer_params`); ``handoff`` (a decode engine's request,
        those params) pulls them into this node's daemon first, where the pool load finds them."""
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        if (remote_decode or handoff is not None) and self.pool is None:
            raise ValueError("kv_transfer_params need the shared pool: start the engine with --strata and --namespace")
        with self._compute:
            return self._generate(list(prompt), max_tokens, temperature, seed, ignore_eos, on_token, cancelled,
                                  remote_decode, handoff)

    def _generate(self, prompt, max_tokens, temperature, seed, ignore_eos, on_token, cancelled, remote_decode=False,
                  handoff=None) -> Generation:
        m = self.metrics
        gen = Generation(len(prompt))
        t0, c0 = time.perf_counter(), time.thread_time()
        if handoff is not None:
            gen.pulled_blocks = self.pool.pull(handoff)
        chain = self.hasher.chain(prompt)
        kv, n_local, n_pool = self._cached_prefix(prompt, chain)
        gen.cached_local, gen.cached_pool = n_local, n_pool
        cache = cache_of(kv)
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        logits = self.runner.forward(prompt[n_local + n_pool :], cache)
        token = self.runner.pick(logits, temperature, generator)
        gen.prefill_s, gen.prefill_cpu_s = time.perf_counter() - t0, time.thread_time() - c0
        m.prefill_seconds.observe(gen.prefill_s)
        gen.tokens.append(token)
        if on_token is not None:
            on_token(gen)

        prompt_kv = kv_of(cache)
        self.cache.store(prompt, chain, prompt_kv)
        if self.pool is not None:
            self.pool.submit(chain, prompt_kv, (n_local + n_pool) // self.config.block_size)
        del prompt_kv
        if remote_decode:
            gen.kv_transfer_params = self.pool.hand_off(chain, HANDOFF_STORE_TIMEOUT_S)

        t1 = time.perf_counter()
        stop_ids = () if ignore_eos else self.runner.eos_token_ids
        if token in stop_ids:
            gen.finish_reason = "stop"
        while gen.finish_reason != "stop" and len(gen.tokens) < max_tokens and not cancelled():
            logits = self.runner.forward([token], cache)
            token = self.runner.pick(logits, temperature, generator)
            gen.tokens.append(token)
            if on_token is not None:
                on_token(gen)
            if token in stop_ids:
                gen.finish_reason = "stop"
        if cancelled() and gen.finish_reason != "stop" and len(gen.tokens) < max_tokens:
            gen.finish_reason = "abort"
        gen.decode_s = time.perf_counter() - t1
        m.decode_seconds.observe(gen.decode_s)

        # The KV now covers the prompt and every generated token but the last (never fed back).
        seen = prompt + gen.tokens[:-1]
        if len(seen) // self.config.block_size > len(chain) or self.cache.name == "last":
            full = self.hasher.chain(seen)
            seen_kv = kv_of(cache)
            self.cache.store(seen, full, seen_kv)
            if self.pool is not None:
                self.pool.submit(full, seen_kv, len(chain))
        m.prompt_tokens.inc(len(prompt))
        m.generation_tokens.inc(len(gen.tokens))
        return gen

    def _cached_prefix(self, prompt: list[int], chain: list[bytes]) -> tuple[torch.Tensor | None, int, int]:
        """(KV, tokens from the engine's cache, tokens from the pool) for the longest cached prefix."""
        bs = self.config.block_size
        limit = len(prompt) - 1  # at least one token is computed, for its logits
        hit = self.cache.match(prompt, chain, limit)
        kv, n_local, n_pool = hit.kv, hit.tokens, 0
        if self.pool is not None:
            start = n_local // bs
            blocks = self.pool.load(chain, start, limit // bs)
            if blocks and (start + len(blocks)) * bs > n_local:
                parts = ([kv[:, :, :, : start * bs]] if start else []) + blocks
                kv = torch.cat(parts, dim=3)
                n_local, n_pool = start * bs, len(blocks) * bs
        if n_local:
            self.metrics.cached_tokens.labels("local").inc(n_local)
            self.metrics.prefix_hits.labels("local").inc()
        if n_pool:
            self.metrics.cached_tokens.labels("pool").inc(n_pool)
            self.metrics.prefix_hits.labels("pool").inc()
        return kv, n_local, n_pool
