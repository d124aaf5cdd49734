"""How one KV block is laid out as bytes in the shared pool, and the tag that says so.

A block's bytes are the fp32 tensor ``[layers, 2 (K, V), kv_heads, block_size, head_dim]`` in
C order (all layers' K and V for the block's tokens). The layout tag, stored in the block's
metadata, names that shape, the dtype and a digest of the model's weights and config: a block
is loaded only by an engine whose tag is equal, so a replica of another model (or another
block size) that shares the namespace by mistake sees a miss, never wrong KV.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

LAYOUT_VERSION = "strata-e2e-kv/1"
DTYPE = torch.float32
DIGEST_CHARS = 16
_HASH_CHUNK = 1 << 20


def model_digest(model_dir: str | Path) -> str:
    """SHA-256 over the model's config and weights files (what decides the KV's meaning)."""
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        with open(Path(model_dir) / name, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
    return h.hexdigest()[:DIGEST_CHARS]


@dataclass(frozen=True)
class KVLayout:
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    model: str  # :func:`model_digest`

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.layers, 2, self.kv_heads, self.block_size, self.head_dim)

    @property
    def block_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * DTYPE.itemsize

    @property
    def tag(self) -> str:
        shape = "x".join(str(d) for d in self.shape)
        return f"{LAYOUT_VERSION};dtype=float32;shape={shape};model={self.model}"

    def to_bytes(self, block: torch.Tensor) -> bytes:
        if tuple(block.shape) != self.shape or block.dtype != DTYPE:
            raise ValueError(f"a block shaped {tuple(block.shape)} {block.dtype} is not this layout ({self.tag})")
        return block.contiguous().numpy().tobytes()

    def from_bytes(self, data) -> torch.Tensor:
        if len(data) != self.block_bytes:
            raise ValueError(f"a block of {len(data)} bytes is not this layout's {self.block_bytes}")
        return torch.frombuffer(bytearray(data), dtype=DTYPE).view(self.shape)
