"""Pages of SGLang's host pool as writable views: where the daemon's bytes land, in place.

The pool says where a page's pieces are as raw addresses
(``get_page_buffer_meta``). Raw addresses are trusted here only inside the
pool's own tensors: each piece is resolved to a slice of a ``uint8`` view of
the tensor that holds it, or the call is refused (:class:`PagesOutOfPool`),
so a wrong index or a pool this module does not understand costs a miss,
never a write outside the pool. The views are memory the pool owns (pinned
host memory on a GPU node, a memfd with ``"allocator": "shm"``), so the
client copies a block straight between them and the daemon's arena: one
copy each way, verified on landing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from kvstore.integrations.sglang.layout import PageLayout

# The pool attributes that hold page memory (MHA: kv_buffer; MLA's split layout: k, v and indexer buffers).
_BUFFER_ATTRIBUTES = ("kv_buffer", "k_buffer", "v_buffer", "index_k_buffer", "index_k_scale_buffer")


class PagesOutOfPool(ValueError):
    """The pool named memory this module cannot vouch for: the pages are a miss."""


class HostPages:
    """Writable views of the pieces of the pages the controller names by their host indices."""

    def __init__(self, host_pool: Any, layout: PageLayout) -> None:
        self._pool = host_pool
        self._layout = layout
        self._regions = sorted(_regions(host_pool), key=lambda r: r[0])  # (address, uint8 array)
        if not self._regions:
            raise ValueError(f"the host pool {type(host_pool).__name__} has no contiguous CPU buffer "
                             "the Strata HiCache backend can read and write")

    def pieces(self, host_indices: torch.Tensor, pages: int) -> list[list[memoryview]]:
        """Per page (in order), a view of each of its pieces; raises :class:`PagesOutOfPool`."""
        tokens = self._layout.page_tokens
        if host_indices.numel() != pages * tokens:
            raise PagesOutOfPool(f"{host_indices.numel()} host indices for {pages} pages of {tokens} tokens")
        ptrs, sizes = self._pool.get_page_buffer_meta(host_indices)
        per_page = len(self._layout.pieces)
        if len(ptrs) != pages * per_page or len(sizes) != len(ptrs):
            raise PagesOutOfPool(f"the pool gave {len(ptrs)} pieces for {pages} pages of {per_page}")
        out: list[list[memoryview]] = []
        for page in range(pages):
            views = []
            for p in range(per_page):
                i = page * per_page + p
                size = int(sizes[i])
                if size != self._layout.pieces[p]:
                    raise PagesOutOfPool(f"piece {p} of a page is {size} bytes; the layout says {self._layout.pieces[p]}")
                views.append(self._view(int(ptrs[i]), size))
            out.append(views)
        return out

    def _view(self, address: int, size: int) -> memoryview:
        for base, array in self._regions:
            if base <= address and address + size <= base + array.size:
                return memoryview(array[address - base:address - base + size])
        raise PagesOutOfPool(f"a page piece of {size} bytes at {address:#x} is outside the host pool's buffers")


def _regions(host_pool: Any) -> Iterable[tuple[int, np.ndarray]]:
    seen: set[tuple[int, int]] = set()
    for name in _BUFFER_ATTRIBUTES:
        try:
            value = getattr(host_pool, name, None)
        except (AttributeError, RuntimeError, IndexError):  # a property over a buffer this pool lacks
            continue
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or not tensor.is_contiguous():
                continue
            span = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
            if span[1] == 0 or span in seen:
                continue
            seen.add(span)
            yield span[0], tensor.view(-1).view(torch.uint8).numpy()
