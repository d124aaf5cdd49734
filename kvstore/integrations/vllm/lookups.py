"""Lookups that never wait: vLLM's own asynchronous lookup front end, asking Strata once per request and step.

vLLM's scheduler looks chunks up one by one and must get an answer at
once. :class:`~vllm.v1.kv_offload.tiering.async_lookup.AsyncLookupManager`
(the front end vLLM's file-system and object-store tiers use) answers from
what it already knows, or RETRY, and collects the unknown keys of a step;
at the end of the step it hands each request's keys to its own thread as
one batch. Here a batch is one Pin call per KV cache group
(:meth:`ChunkStore.present`): the daemon's per-key answer, with the found
chunks held until the request finishes (or ``lookup_hold_s``), so a hit is
still there when its load runs. The next step's lookups see the answers.

The pins of a request are given back when vLLM says it finished. A batch
still running then records its lease afterwards; such a lease just
expires. At most ``MAX_REQUESTS_HELD`` requests' leases are remembered.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager

from kvstore.integrations.vllm.chunks import ChunkStore

MAX_REQUESTS_HELD = 65536


class StrataLookups(AsyncLookupManager):
    """Batched, pinned presence checks on the lookup thread (see the module docstring)."""

    def __init__(self, chunks: ChunkStore, tier_type: str,
                 before_batch: Callable[[list[OffloadKey], ReqContext], None] | None = None) -> None:
        self._chunks = chunks
        self._before_batch = before_batch  # the tier's hints: a request's chunks, and a prefetch of them
        self._held: OrderedDict[str, list[int]] = OrderedDict()  # req_id -> pin lease ids
        self._held_lock = threading.Lock()
        super().__init__(tier_type=tier_type)  # starts the lookup thread: everything it uses is set

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        if self._before_batch is not None:
            self._before_batch(keys, req_context)
        found, leases = self._chunks.present(keys)
        if leases:
            with self._held_lock:
                self._held.setdefault(req_context.req_id, []).extend(leases)
                self._held.move_to_end(req_context.req_id)
                while len(self._held) > MAX_REQUESTS_HELD:
                    self._held.popitem(last=False)  # those leases expire by themselves
        return found

    def release(self, req_id: str) -> list[int]:
        """The pin leases of a finished request, to give back."""
        with self._held_lock:
            return self._held.pop(req_id, [])
