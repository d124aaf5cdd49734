"""SGLang's HiCache storage classes on CPU, and the smallest stand-in for its host KV pool.

``sglang_storage()`` imports SGLang's real ``hicache_storage`` and
``storage.backend_factory`` modules. They need only torch, but
``sglang/__init__.py`` imports SGLang's whole front end (IPython, triton,
torchvision, every model config...), which a CPU test machine does not
install; so when ``sglang`` is not imported yet, its package is entered
without running that ``__init__`` (a package module whose ``__path__`` is the
installed one), and the modules below it are SGLang's own files, unchanged.
In a real SGLang server ``sglang`` is fully imported first and nothing here runs.

``PageFirstPool`` and ``MlaPool`` stand in for ``MHATokenToKVPoolHost`` and
``MLATokenToKVPoolHost`` with ``--hicache-mem-layout page_first``: the real
classes cannot be built on CPU (their module imports SGLang's model configs
and GPU kernels, and their constructor wants a device pool). The stand-ins
have the real ones' buffer shapes and the attributes the backend reads
(``page_size``, ``dtype``, ``layout``, ``kv_buffer``, ``layer_num``...), and
compute ``get_page_buffer_meta`` from those shapes: per page, MHA's K piece
then its V piece, MLA's one latent piece. ``PageFirstPool`` also gathers and
scatters flat pages as the real MHA pool does, for backends without
``interface_v1`` (SGLang's ``file`` backend, in ``benchmarks.sglang_backend``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import pytest
import torch

SGLANG_VERSION = "0.5.23"


def sglang_storage():
    """``(hicache_storage, backend_factory)`` modules of the installed sglang; skips when it is absent."""
    if "sglang" not in sys.modules:
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            pytest.skip(f"sglang {SGLANG_VERSION} is not installed (tests/install.py installs it; "
                        "docs/integrations/sglang.md)", allow_module_level=True)
        package = types.ModuleType("sglang")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        sys.modules["sglang"] = package
    storage = importlib.import_module("sglang.srt.mem_cache.hicache_storage")
    factory = importlib.import_module("sglang.srt.mem_cache.storage.backend_factory")
    return storage, factory


class PageFirstPool:
    """MHA host pool, page_first: ``kv_buffer[2, tokens, layers, heads, head_dim]``."""

    layout = "page_first"
    storage_format_tag = None

    def __init__(self, pages: int, page_size: int = 4, layer_num: int = 2, head_num: int = 2, head_dim: int = 8,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.page_size, self.layer_num, self.head_num, self.head_dim = page_size, layer_num, head_num, head_dim
        self.v_head_dim = head_dim
        self.dtype = dtype
        self.size = pages * page_size
        self.kv_buffer = torch.zeros((2, self.size, layer_num, head_num, head_dim), dtype=dtype)

    @property
    def token_bytes(self) -> int:  # of K (or V), all layers
        return self.layer_num * self.head_num * self.head_dim * self.dtype.itemsize

    def get_page_buffer_meta(self, indices: torch.Tensor):
        assert len(indices) % self.page_size == 0
        base, half = self.kv_buffer.data_ptr(), self.size * self.token_bytes
        firsts = indices.tolist()[::self.page_size]
        ptrs = [p for first in firsts for p in (base + first * self.token_bytes, base + half + first * self.token_bytes)]
        return ptrs, [self.page_size * self.token_bytes] * len(ptrs)

    # What SGLang's controller calls on a backend without interface_v1 (its file backend): a page gathered
    # into a flat tensor, and scattered back; the shapes of MHATokenToKVPoolHost's page_first layout.
    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, index:index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, self.page_size, self.layer_num, self.head_num, self.head_dim), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[:, index:index + self.page_size] = data_page.reshape(
            2, self.page_size, self.layer_num, self.head_num, self.head_dim)

    def page_bytes(self, page: int) -> bytes:
        """The page's K then V bytes (what the backend stores, in its pieces' order)."""
        t = slice(page * self.page_size, (page + 1) * self.page_size)
        return b"".join(self.kv_buffer[h, t].contiguous().view(torch.uint8).numpy().tobytes() for h in (0, 1))

    def fill(self, page: int, seed: int) -> bytes:
        t = slice(page * self.page_size, (page + 1) * self.page_size)
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer[:, t] = torch.randn(self.kv_buffer[:, t].shape, generator=g).to(self.dtype)
        return self.page_bytes(page)

    def indices(self, pages: list[int]) -> torch.Tensor:
        return torch.tensor([p * self.page_size + t for p in pages for t in range(self.page_size)], dtype=torch.int64)


class MlaPool(PageFirstPool):
    """MLA host pool, page_first: ``kv_buffer[tokens, layers, 1, kv_lora_rank + qk_rope_head_dim]``."""

    def __init__(self, pages: int, page_size: int = 4, layer_num: int = 2, kv_lora_rank: int = 16,
                 qk_rope_head_dim: int = 8, dtype: torch.dtype = torch.bfloat16) -> None:
        self.page_size, self.layer_num, self.dtype = page_size, layer_num, dtype
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.size = pages * page_size
        self.kv_buffer = torch.zeros((self.size, layer_num, 1, kv_lora_rank + qk_rope_head_dim), dtype=dtype)

    @property
    def token_bytes(self) -> int:
        return self.layer_num * (self.kv_lora_rank + self.qk_rope_head_dim) * self.dtype.itemsize

    def get_page_buffer_meta(self, indices: torch.Tensor):
        assert len(indices) % self.page_size == 0
        base = self.kv_buffer.data_ptr()
        ptrs = [base + first * self.token_bytes for first in indices.tolist()[::self.page_size]]
        return ptrs, [self.page_size * self.token_bytes] * len(ptrs)

    def page_bytes(self, page: int) -> bytes:
        t = slice(page * self.page_size, (page + 1) * self.page_size)
        return self.kv_buffer[t].contiguous().view(torch.uint8).numpy().tobytes()

    def fill(self, page: int, seed: int) -> bytes:
        t = slice(page * self.page_size, (page + 1) * self.page_size)
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer[t] = torch.randn(self.kv_buffer[t].shape, generator=g).to(self.dtype)
        return self.page_bytes(page)


def page_hashes(n: int, salt: str = "") -> list[str]:
    """SGLang-shaped page keys: a hex SHA-256 chain."""
    import hashlib

    keys, last = [], salt
    for i in range(n):
        last = hashlib.sha256(f"{last}|{i}".encode()).hexdigest()
        keys.append(last)
    return keys
