"""vLLM's offload keys and KV layouts as Strata namespaces, block keys and layout tags.

An ``OffloadKey`` is a block hash followed by the KV cache group's index
(4 bytes, big-endian). The tier keeps the hash as the Strata block key and
puts the group in the namespace, so the mapping is lossless both ways and
the block keys are vLLM's own prefix hashes: a router or another node that
hashes the same tokens (``kvstore.index.keys``, one block per chunk) names
the same blocks.

The namespace also carries a digest of the KV layout: everything that
decides whether one engine's chunk bytes mean the same thing to another
(model, dtype, tokens per block and per chunk, the layers of each group,
parallelism unless the bytes are parallelism-agnostic, canonical format,
the size of a chunk row). That is the identity vLLM's own file-system and
object-store tiers key their directories by (``FileMapper``'s run config),
so Strata shares exactly when they would: two engines of one layout read
each other's chunks; two of different layouts live in different namespaces
and cannot.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass

from vllm.v1.kv_offload.base import OffloadingSpec, OffloadKey, get_offload_block_hash, get_offload_group_idx
from vllm.v1.kv_offload.file_mapper import FileMapper

from kvstore.block import MAX_KEY_BYTES, MAX_NAMESPACE_CHARS, validate_namespace

log = logging.getLogger(__name__)

LAYOUT_VERSION = "vllm-tier/1"  # bump when the bytes of a block change meaning
DIGEST_CHARS = 16
_SLUG_BAD = re.compile(r"[^A-Za-z0-9._:/@+=-]")


def block_key(key: OffloadKey) -> tuple[int, bytes]:
    """(KV cache group, Strata block key) of an offload key."""
    block_hash = bytes(get_offload_block_hash(key))
    if not block_hash or len(block_hash) > MAX_KEY_BYTES:
        raise ValueError(f"an offload key of {len(key)} bytes has no block hash Strata can store")
    return get_offload_group_idx(key), block_hash


def offload_key(group: int, key: bytes) -> OffloadKey:
    """Invert :func:`block_key`."""
    return OffloadKey(bytes(key) + group.to_bytes(4, "big", signed=False))


@dataclass(frozen=True)
class KVLayout:
    """What makes chunk bytes interchangeable, the namespaces it gives, and the tag every block carries."""

    model: str
    digest: str
    row_bytes: int
    prefix: str

    @classmethod
    def of(cls, spec: OffloadingSpec, row_bytes: int, prefix: str) -> KVLayout:
        fields = FileMapper.from_offloading_spec(
            root_dir="", offloading_spec=spec, blocks_per_file=spec.blocks_per_chunk, parallel_agnostic=True
        ).get_run_config()
        fields = dict(fields, row_bytes=row_bytes, format=LAYOUT_VERSION)
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
        digest = hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]
        layout = cls(str(fields["model_name"]), digest, row_bytes, prefix)
        log.info("Strata tier: KV layout %s for %s (%s)", digest, layout.model, text[:512])
        return layout

    @property
    def tag(self) -> str:
        """The block's layout tag: a load takes only a block written for this layout."""
        return f"{LAYOUT_VERSION};layout={self.digest};bytes={self.row_bytes}"

    def namespace(self, group: int) -> str:
        """``<prefix>/<model>@<digest>/g<group>``; the model part is shortened to fit, never the digest."""
        tail = f"@{self.digest}/g{group}"
        room = MAX_NAMESPACE_CHARS - len(self.prefix) - 1 - len(tail)
        slug = _SLUG_BAD.sub("-", self.model).strip("-._:/@+=")[:room].rstrip("/") or "model"
        return validate_namespace(f"{self.prefix}/{slug}{tail}")
