"""LMCache server-mode ``ObjectKey``\\ s as Strata namespaces and block keys, and a MemoryObj's layout as a tag.

A block key is the ObjectKey's string as LMCache's own file-system and
native adapters name objects, lossless and readable in ``strata ls``::

    <model_name>@0x<kv_rank, 8 hex digits>@<object_group_id hex>@<chunk_hash hex>[@<cache_salt>]

(``@`` cannot occur in a model name or a salt, so the fields split back
unambiguously.) The namespace is ``<prefix>/<model_name>``, with
``@<cache_salt>`` appended for a salted key: each model and each salt (a
user, a deployment) gets a namespace of its own, so a salt's blocks can be
listed, counted, authorized and deleted apart from every other's, and a key
of one salt can never name a block of another. A namespace Strata would
refuse (characters, length) is replaced by a readable, collision-free
stand-in (:func:`kvstore.integrations.lmcache.mapping.namespace_of`).

The layout tag names the chunk's shapes and dtypes: a load whose destination
has another layout (the same model served in bf16 after fp16, say: the same
size, other bytes) is a miss, never a wrong read.
"""

from __future__ import annotations

from lmcache.v1.distributed.api import EncodedObjectKey, ObjectKey
from lmcache.v1.memory_management import MemoryObj

from kvstore.integrations.lmcache.mapping import ChunkLayout, namespace_of

SEP = "@"
LAYOUT_PREFIX = "lmcache-mp/1 "


def namespace(prefix: str, key: ObjectKey) -> str:
    name = f"{prefix}/{key.model_name}"
    if key.cache_salt:
        name += SEP + key.cache_salt
    return namespace_of(name)


def model_namespace(prefix: str, model_name: str) -> str:
    """The namespace of a model's unsalted keys; its salted ones are this plus ``@<salt>`` when readable."""
    return namespace_of(f"{prefix}/{model_name}")


def block_key(key: ObjectKey) -> bytes:
    text = f"{key.model_name}{SEP}{key.kv_rank:#010x}{SEP}{key.object_group_id:x}{SEP}{key.chunk_hash.hex()}"
    if key.cache_salt:
        text += SEP + key.cache_salt
    return text.encode()


def object_key(block: bytes) -> EncodedObjectKey | None:
    """Invert :func:`block_key`; None for a block this adapter did not write."""
    try:
        parts = block.decode().split(SEP)
        if len(parts) not in (4, 5):
            return None
        model, rank, group, chunk_hash = parts[:4]
        if not rank.startswith("0x"):
            return None
        key = ObjectKey(bytes.fromhex(chunk_hash), model, int(rank, 16), int(group, 16),
                        parts[4] if len(parts) == 5 else "")
    except (UnicodeDecodeError, ValueError):
        return None
    return key.to_encoded_object_key()


def layout_tag(obj: MemoryObj) -> str:
    """The layout a block of ``obj``'s bytes is stored under, and a destination must have to load it."""
    return LAYOUT_PREFIX + ChunkLayout.of(obj).encode()
