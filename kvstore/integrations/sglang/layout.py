"""SGLang's page keys and host-pool geometry as Strata namespaces, block keys and layout tags.

A HiCache page (``page_size`` tokens of every layer) lies in SGLang's host
pool as a few contiguous pieces: the pool's ``get_page_buffer_meta`` names
them (MHA ``page_first``: the page's K and its V; MLA: one latent run).
Each piece is one Strata block, so a piece moves between the daemon and the
pool in one copy, with no staging buffer: block key =
``"<page hash>#<piece>"`` (UTF-8), its parent the same piece of the page
before (the last of the call's prefix keys for the call's first page), so
Strata's eviction keeps a prefix as long as its descendants.

The namespace ``<prefix>/<model>@<digest>`` carries a digest of everything
that decides whether one engine's page bytes mean the same to another: the
model (SGLang's storage name, which carries the pool's own format tag), the
pool's class, dtype, page size, memory layout and head geometry, the bytes
of every piece, and the shard the pool holds (pipeline stage, context- and
decode-context-parallel rank, and the tensor-parallel rank and size unless
the model's KV is replicated across TP ranks, as MLA's is). An engine of
another geometry looks in another namespace: a miss, never a collision.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.block import MAX_KEY_BYTES, MAX_NAMESPACE_CHARS, validate_namespace

log = logging.getLogger(__name__)

LAYOUT_VERSION = "sglang-hicache/1"  # bump when the bytes of a block change meaning
DIGEST_CHARS = 16
MAX_PIECES_PER_PAGE = 16  # beyond it (layer_first: 2 per layer) a page is too many blocks: use page_first
_SLUG_BAD = re.compile(r"[^A-Za-z0-9._:/@+=-]")
# Geometry a pool may carry, by SGLang's attribute names; absent ones are left out of the digest.
_POOL_FIELDS = ("layer_num", "head_num", "head_dim", "v_head_dim", "kv_lora_rank", "qk_rope_head_dim",
                "head_group_num", "start_layer", "end_layer", "storage_format_tag")


@dataclass(frozen=True)
class PageLayout:
    """One engine rank's page geometry: its namespace, the pieces of a page, and the tag every block carries."""

    model: str
    digest: str
    pieces: tuple[int, ...]  # bytes of each contiguous piece of one page, in the pool's order
    page_tokens: int
    prefix: str

    @classmethod
    def of(cls, storage_config: Any, host_pool: Any, prefix: str) -> PageLayout:
        """From SGLang's ``HiCacheStorageConfig`` and its registered host pool."""
        page_tokens = int(host_pool.page_size)
        pieces = page_pieces(host_pool, page_tokens)
        replicated = bool(storage_config.is_mla_model)  # MLA KV is the same on every TP rank
        fields = {
            "format": LAYOUT_VERSION,
            "model": storage_config.model_name or "",
            "pool": type(host_pool).__name__,
            "dtype": str(host_pool.dtype),
            "page_tokens": page_tokens,
            "layout": str(host_pool.layout),
            "pieces": list(pieces),
            **{name: _plain(getattr(host_pool, name)) for name in _POOL_FIELDS if hasattr(host_pool, name)},
            "pp": [storage_config.pp_rank, storage_config.pp_size],
            "attn_cp": [storage_config.attn_cp_rank, storage_config.attn_cp_size],
            "dcp": [storage_config.dcp_rank, storage_config.dcp_size, storage_config.logical_page_size],
            "tp": None if replicated else [storage_config.tp_rank, storage_config.tp_size],
            "split_heads": [bool(storage_config.should_split_heads), storage_config.tp_lcm_size],
        }
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
        digest = hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]
        layout = cls(str(fields["model"]), digest, pieces, page_tokens, prefix)
        log.info("Strata HiCache backend: page layout %s for %s (%s)", digest, layout.model or "-", text[:512])
        return layout

    @property
    def page_bytes(self) -> int:
        return sum(self.pieces)

    @property
    def namespace(self) -> str:
        """``<prefix>/<model>@<digest>``; the model part is shortened to fit, never the digest."""
        tail = f"@{self.digest}"
        room = MAX_NAMESPACE_CHARS - len(self.prefix) - 1 - len(tail)
        slug = _SLUG_BAD.sub("-", self.model).strip("-._:/@+=")[:room].rstrip("/") or "model"
        return validate_namespace(f"{self.prefix}/{slug}{tail}")

    def tag(self, piece: int) -> str:
        """The block's layout tag: a read takes only a block written as this piece of this layout."""
        return f"{LAYOUT_VERSION};layout={self.digest};piece={piece};bytes={self.pieces[piece]}"

    def block_keys(self, page_key: str) -> list[bytes]:
        """The block key of each piece of the page SGLang names ``page_key``."""
        return [piece_key(page_key, p) for p in range(len(self.pieces))]

    def parents(self, keys: Sequence[str], before: str | None) -> list[str | None]:
        """The page before each of ``keys``: ``before`` (the call's last prefix key, or None) for the first."""
        return [before, *keys[:-1]] if keys else []


def piece_key(page_key: str, piece: int) -> bytes:
    key = f"{page_key}#{piece}".encode()
    if not page_key or len(key) > MAX_KEY_BYTES:
        raise ValueError(f"a HiCache page key of {len(page_key)} characters is no Strata block key")
    return key


def page_pieces(host_pool: Any, page_tokens: int) -> tuple[int, ...]:
    """Bytes of each contiguous piece of one page, from the pool's own zero-copy metadata."""
    import torch

    try:
        _, sizes = host_pool.get_page_buffer_meta(torch.arange(page_tokens, dtype=torch.int64))
    except (NotImplementedError, AttributeError, AssertionError, ValueError) as err:
        raise ValueError(f"the Strata HiCache backend needs the host pool's page pointers "
                         f"(get_page_buffer_meta), which {type(host_pool).__name__} with layout "
                         f"{getattr(host_pool, 'layout', '?')!r} does not give ({err}): use "
                         "--hicache-mem-layout page_first or page_first_direct") from None
    pieces = tuple(int(s) for s in sizes)
    if not pieces or len(pieces) > MAX_PIECES_PER_PAGE or min(pieces) <= 0:
        raise ValueError(f"the host pool's pages come in {len(pieces)} pieces; the Strata HiCache backend "
                         f"takes 1 to {MAX_PIECES_PER_PAGE} per page: use --hicache-mem-layout page_first "
                         "or page_first_direct")
    return pieces


def _plain(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
