"""The engine's prefix-cache modes, behind one small interface and a name → constructor registry.

- ``none``: every prompt is prefilled in full (the baseline).
- ``last``: one slot, the KV of the last request (its prompt and what it generated); a new
  prompt reuses the longest common token prefix with it. What a simple one-session server does.
- ``blocks``: :class:`~benchmarks.e2e.kv_blocks.BlockCache`, full blocks keyed by the vLLM hash
  chain, shared by every session of the replica (what vLLM's automatic prefix caching does).

KV tensors here are shaped ``[layers, 2, kv_heads, tokens, head_dim]``. ``match`` never
returns more than ``limit`` tokens: the engine must still run at least one prompt token through
the model to get the logits of the next token.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from benchmarks.e2e.events import EventSink
from benchmarks.e2e.kv_blocks import BlockCache


@dataclass(frozen=True, slots=True)
class Hit:
    tokens: int  # leading prompt tokens whose KV is in ``kv``
    kv: torch.Tensor | None


MISS = Hit(0, None)


class PrefixCache(abc.ABC):
    """Contract: ``match`` returns KV equal to what a prefill of ``tokens[:hit.tokens]`` computes;
    ``store`` is given the KV of ``tokens[:kv.shape[3]]`` and may keep any part of it."""

    name: str

    @abc.abstractmethod
    def match(self, tokens: Sequence[int], keys: Sequence[bytes], limit: int) -> Hit: ...

    @abc.abstractmethod
    def store(self, tokens: Sequence[int], keys: Sequence[bytes], kv: torch.Tensor) -> None: ...

    def blocks_held(self) -> int:
        return 0


class NoPrefixCache(PrefixCache):
    name = "none"

    def match(self, tokens, keys, limit) -> Hit:
        return MISS

    def store(self, tokens, keys, kv) -> None:
        pass


class LastPromptCache(PrefixCache):
    name = "last"

    def __init__(self) -> None:
        self._tokens: tuple[int, ...] = ()
        self._kv: torch.Tensor | None = None
        self._lock = threading.Lock()

    def match(self, tokens, keys, limit) -> Hit:
        with self._lock:
            held, kv = self._tokens, self._kv
        if kv is None:
            return MISS
        n = 0
        for a, b in zip(held, tokens[:limit]):
            if a != b:
                break
            n += 1
        return Hit(n, kv[:, :, :, :n]) if n else MISS

    def store(self, tokens, keys, kv) -> None:
        with self._lock:
            self._tokens = tuple(tokens[: kv.shape[3]])
            self._kv = kv


class BlockPrefixCache(PrefixCache):
    name = "blocks"

    def __init__(self, capacity: int, block_size: int, sink: EventSink | None = None) -> None:
        self.blocks = BlockCache(capacity, block_size, sink)
        self.block_size = block_size

    def match(self, tokens, keys, limit) -> Hit:
        found = self.blocks.longest_prefix(keys[: limit // self.block_size])
        if not found:
            return MISS
        return Hit(len(found) * self.block_size, torch.cat(found, dim=3))

    def store(self, tokens, keys, kv) -> None:
        self.blocks.store(keys, tokens, kv)

    def blocks_held(self) -> int:
        return len(self.blocks)


@dataclass(frozen=True)
class CacheOptions:
    capacity_blocks: int
    block_size: int
    sink: EventSink | None = None


PREFIX_CACHES: dict[str, Callable[[CacheOptions], PrefixCache]] = {
    "none": lambda o: NoPrefixCache(),
    "last": lambda o: LastPromptCache(),
    "blocks": lambda o: BlockPrefixCache(o.capacity_blocks, o.block_size, o.sink),
}


def make_prefix_cache(name: str, options: CacheOptions) -> PrefixCache:
    try:
        factory = PREFIX_CACHES[name]
    except KeyError:
        raise ValueError(f"unknown prefix-cache mode {name!r}: use one of {', '.join(PREFIX_CACHES)}") from None
    return factory(options)
