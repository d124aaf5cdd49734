"""The engine's own prefix-block cache: an LRU of full KV blocks keyed by the vLLM hash chain.

A block is the KV of ``block_size`` consecutive tokens for every layer, one tensor shaped
``[layers, 2 (K, V), kv_heads, block_size, head_dim]``, named by its 32-byte chain key
(:class:`kvstore.index.keys.BlockHasher`): the key covers every token before it, so equal keys
mean equal KV and a prompt reuses the longest run of leading keys it finds.

Eviction order follows vLLM's free-block queue: a chain's blocks are touched deepest first, so
a prefix is always more recently used than its descendants and the descendants go first (a
block whose parent was evicted could never be reached by a lookup). Every change is reported
to the event sink as vLLM reports it: ``BlockStored`` per run of new blocks with its parent,
``BlockRemoved`` per eviction, in the order they happened.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from kvstore.index.keys import event_key

from benchmarks.e2e.events import Event, EventSink, Removed, Stored


class BlockCache:
    """At most ``capacity`` blocks; thread-safe (the server reads its size for metrics)."""

    def __init__(self, capacity: int, block_size: int, sink: EventSink | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"the block cache holds {capacity} blocks; give --cache-blocks of at least 1")
        self.capacity = capacity
        self.block_size = block_size
        self._sink = sink or EventSink()
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def longest_prefix(self, keys: Sequence[bytes]) -> list[torch.Tensor]:
        """The blocks of the longest run of leading ``keys`` held here (touched, prefix last)."""
        with self._lock:
            found = []
            for key in keys:
                block = self._blocks.get(key)
                if block is None:
                    break
                found.append(block)
            for key in reversed(keys[: len(found)]):
                self._blocks.move_to_end(key)
            return found

    def store(self, keys: Sequence[bytes], tokens: Sequence[int], kv: torch.Tensor) -> int:
        """Hold the full blocks of ``kv`` (the KV of ``tokens`` from token 0) under ``keys``.

        Blocks already held are only touched; a new one is copied out of ``kv`` (a view would
        keep the whole request's KV alive). Returns how many were new.
        """
        bs = self.block_size
        keys = keys[: kv.shape[3] // bs]
        events: list[Event] = []
        new = 0
        with self._lock:
            run: list[int] = []

            def flush() -> None:
                if run:
                    first = run[0]
                    parent = event_key(keys[first - 1]) if first > 0 else None
                    events.append(Stored(
                        tuple(event_key(keys[i]) for i in run), parent,
                        tuple(tokens[first * bs : (run[-1] + 1) * bs]), bs,
                    ))
                    run.clear()

            for i, key in enumerate(keys):
                if key in self._blocks:
                    flush()
                    continue
                while len(self._blocks) >= self.capacity:
                    flush()  # what was stored before the eviction is reported before it
                    old, _ = self._blocks.popitem(last=False)
                    self.evicted += 1
                    events.append(Removed((event_key(old),)))
                self._blocks[key] = kv[:, :, :, i * bs : (i + 1) * bs].clone()
                run.append(i)
                new += 1
            flush()
            for key in reversed(keys):
                if key in self._blocks:
                    self._blocks.move_to_end(key)
        self._sink.publish(_merge_removals(events))
        return new


def _merge_removals(events: list[Event]) -> list[Event]:
    """Consecutive single-block removals as one ``BlockRemoved`` (vLLM batches them alike)."""
    out: list[Event] = []
    for e in events:
        if isinstance(e, Removed) and out and isinstance(out[-1], Removed):
            out[-1] = Removed(out[-1].block_hashes + e.block_hashes)
        else:
            out.append(e)
    return out
