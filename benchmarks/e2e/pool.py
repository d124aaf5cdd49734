"""The shared KV pool: full blocks stored to and loaded from the node's Strata daemon.

Keys: a block is put under the 8-byte event form of its vLLM chain key
(:func:`kvstore.index.keys.event_key_bytes`), the form a Strata daemon's ``Score`` hashes token
ids into. The daemon publishes the keys it holds as its own holdings in the prefix index, so a
router that scores a prompt's tokens credits this node for every block any replica stored here.
Each block names the previous block's key as its parent, so the daemon keeps a prefix at least
as long as its descendants.

Stores never delay a response: the compute thread hands the request's KV (an immutable tensor)
to a bounded queue and returns; one worker thread copies blocks to bytes and puts them in
batches. Beyond ``max_pending_blocks`` a request's blocks are dropped (counted), not waited
for: the pool is a cache. Loads run on the compute thread, before the prefill they replace,
with the client's deadline; a daemon that fails or times out is a miss for that request.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.client.codec import BlockPut
from kvstore.client.sync import Client
from kvstore.errors import StrataError
from kvstore.index.keys import event_key_bytes

from benchmarks.e2e.kv_layout import KVLayout
from benchmarks.e2e.metrics import EngineMetrics

log = logging.getLogger(__name__)

DEFAULT_MAX_PENDING_BLOCKS = 1024
PUT_BATCH_BLOCKS = 16
DEFAULT_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class _Store:
    keys: tuple[bytes, ...]  # 8-byte pool keys of the whole chain from block 0
    kv: torch.Tensor  # [layers, 2, kv_heads, tokens, head_dim]
    start: int  # first block to store
    stop: int


class BlockPool:
    def __init__(self, target: str, namespace: str, layout: KVLayout, metrics: EngineMetrics, *,
                 max_pending_blocks: int = DEFAULT_MAX_PENDING_BLOCKS, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if max_pending_blocks < 1:
            raise ValueError("the pool's store queue must allow at least one block (--pool-max-pending)")
        self.namespace = namespace
        self.layout = layout
        self._m = metrics
        self._client = Client(target, timeout=timeout_s, retries=1)
        self._max_pending = max_pending_blocks
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queue: queue.Queue[_Store | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="pool-store", daemon=True)
        self._thread.start()
        metrics.pool_pending.set_function(lambda: self._pending)

    @staticmethod
    def keys(chain: Sequence[bytes]) -> tuple[bytes, ...]:
        return tuple(event_key_bytes(h) for h in chain)

    # ---- loads (compute thread) ------------------------------------------------

    def load(self, chain: Sequence[bytes], start: int, stop: int) -> list[torch.Tensor]:
        """Blocks ``start, start+1, ...`` (before ``stop``) present in the pool, up to the first miss."""
        if stop <= start:
            return []
        keys = self.keys(chain[:stop])[start:]
        try:
            # get_many, not exists first: the daemon's Exists answers from its local tiers only, while a
            # read falls through to the peer tier, which fetches a block another node holds.
            found = self._client.get_many(self.namespace, list(keys))
        except StrataError as e:
            log.warning("pool load from %s failed (%s): prefilling instead", self.namespace, e)
            self._m.pool_blocks.labels("load", "error").inc()
            return []
        out = []
        for block in found:
            if block is None:
                break
            if block.layout != self.layout.tag:
                log.warning("a pool block of layout %r is not this engine's %r: ignored", block.layout, self.layout.tag)
                self._m.pool_blocks.labels("load", "layout").inc()
                break
            out.append(self.layout.from_bytes(block.data))
        if not out:
            self._m.pool_blocks.labels("load", "miss").inc()
            return []
        self._m.pool_blocks.labels("load", "hit").inc(len(out))
        return out

    # ---- prefill/decode handoff ---------------------------------------------------

    def hand_off(self, chain: Sequence[bytes], timeout_s: float) -> dict | None:
        """The prefill side: once every queued block is stored, hold the prompt's full blocks (``chain``)
        for a decode node to pull; the handoff's params as a JSON dict (the response's
        ``kv_transfer_params``), or None where the daemon could not open one."""
        if not chain:
            return None
        if not self.flush(timeout_s):
            log.warning("the pool's store queue did not drain within %.1f s: no handoff", timeout_s)
            self._m.pool_blocks.labels("handoff", "error").inc()
            return None
        try:
            params, missing = self._client.open_handoff(self.namespace, list(self.keys(chain)))
        except StrataError as e:
            log.warning("open handoff on %s failed (%s)", self.namespace, e)
            self._m.pool_blocks.labels("handoff", "error").inc()
            return None
        self._m.pool_blocks.labels("handoff", "opened").inc(len(params.blocks))
        if missing:
            self._m.pool_blocks.labels("handoff", "missing").inc(len(missing))
        return params.to_dict()

    def pull(self, params: dict) -> int:
        """The decode side: pull a handoff's blocks into this node's daemon (a later :meth:`load` finds
        them there); blocks stored, 0 where the pull failed (the prompt is computed instead)."""
        try:
            result = self._client.pull_handoff(params)
        except (StrataError, ValueError, TypeError, KeyError) as e:
            log.warning("pull handoff %s failed (%s): prefilling instead", params.get("handoff_id"), e)
            self._m.pool_blocks.labels("pull", "error").inc()
            return 0
        self._m.pool_blocks.labels("pull", "stored").inc(result.stored + result.present)
        return result.stored + result.present

    # ---- stores (queued) -------------------------------------------------------

    def submit(self, chain: Sequence[bytes], kv: torch.Tensor, start: int) -> None:
        """Queue the full blocks of ``kv`` from block ``start`` for storing; never blocks."""
        stop = min(len(chain), kv.shape[3] // self.layout.block_size)
        n = stop - start
        if n <= 0:
            return
        with self._lock:
            if self._pending + n > self._max_pending:
                self._m.pool_blocks.labels("store", "dropped").inc(n)
                log.debug("pool store queue full: %s blocks dropped", n)
                return
            self._pending += n
        self._queue.put(_Store(self.keys(chain[:stop]), kv, start, stop))

    def flush(self, timeout: float) -> bool:
        """Wait until every queued block was stored (or failed); for tests and shutdown."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)
        self._client.close()

    def _run(self) -> None:
        bs = self.layout.block_size
        while (job := self._queue.get()) is not None:
            for lo in range(job.start, job.stop, PUT_BATCH_BLOCKS):
                hi = min(lo + PUT_BATCH_BLOCKS, job.stop)
                puts = [
                    BlockPut(job.keys[i], self.layout.to_bytes(job.kv[:, :, :, i * bs : (i + 1) * bs]),
                             job.keys[i - 1] if i > 0 else None, self.layout.tag)
                    for i in range(lo, hi)
                ]
                try:
                    stored = self._client.put_many(self.namespace, puts)
                    self._m.pool_blocks.labels("store", "stored").inc(sum(stored))
                    self._m.pool_blocks.labels("store", "present").inc(len(stored) - sum(stored))
                except StrataError as e:
                    log.warning("pool store to %s failed (%s): %s blocks not stored", self.namespace, e, hi - lo)
                    self._m.pool_blocks.labels("store", "error").inc(hi - lo)
                with self._idle:
                    self._pending -= hi - lo
                    self._idle.notify_all()
