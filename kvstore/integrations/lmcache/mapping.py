"""LMCache's chunk keys and MemoryObj layouts as Strata namespaces, block keys and layout tags,
and a MemoryObj's bytes as the tensor the client reads and writes in place."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

import torch
from lmcache.utils import STR_DTYPE_TO_TORCH_DTYPE, TORCH_DTYPE_TO_STR_DTYPE, CacheEngineKey, parse_cache_key
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

from kvstore.block import MAX_KEY_BYTES, MAX_NAMESPACE_CHARS, validate_namespace
from kvstore.errors import InvalidNamespace


LAYOUT_VERSION = "lmcache/1"


_NAMESPACE_BAD = re.compile(r"[^A-Za-z0-9._:/@+=-]")


def namespace_of(model_name: str) -> str:
    """The Strata namespace of a model: its name where Strata accepts it, else a
    readable and collision-free stand-in (bad characters replaced, a digest appended)."""
    try:
        return validate_namespace(model_name)
    except InvalidNamespace:
        pass
    digest = hashlib.blake2b(model_name.encode(), digest_size=6).hexdigest()
    readable = _NAMESPACE_BAD.sub("-", model_name).lstrip("._:/@+=-")[: MAX_NAMESPACE_CHARS - 14]
    return f"{readable or 'model'}-{digest}"


def block_key(key: CacheEngineKey) -> bytes:
    """The Strata key of a LMCache chunk: its string form, lossless.

    A key longer than Strata's limit (only with very long request tags)
    becomes ``#`` plus a 32-byte digest of it: still collision-free, but
    :func:`cache_key` cannot invert it.
    """
    text = key.to_string().encode()
    if len(text) <= MAX_KEY_BYTES:
        return text
    return b"#" + hashlib.blake2b(text, digest_size=32).digest()


def cache_key(key: bytes) -> CacheEngineKey:
    """Invert :func:`block_key`."""
    if key.startswith(b"#"):
        raise ValueError("this block key is a digest of a long LMCache key and cannot be inverted")
    return parse_cache_key(key.decode())


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """What ``local_cpu_backend.allocate`` needs to rebuild a MemoryObj."""

    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    fmt: MemoryFormat

    @classmethod
    def of(cls, obj: MemoryObj) -> ChunkLayout:
        meta = obj.meta
        shapes = meta.shapes if meta.shapes else [meta.shape]
        dtypes = meta.dtypes if meta.dtypes else [meta.dtype]
        if any(d not in TORCH_DTYPE_TO_STR_DTYPE for d in dtypes):
            raise ValueError(f"MemoryObj dtypes {dtypes} cannot be described; the Strata plugin stores tensor chunks only")
        return cls(tuple(torch.Size(s) for s in shapes), tuple(dtypes), obj.get_memory_format())

    def encode(self) -> str:
        return json.dumps(
            {
                "v": LAYOUT_VERSION,
                "fmt": self.fmt.name,
                "shapes": [list(s) for s in self.shapes],
                "dtypes": [TORCH_DTYPE_TO_STR_DTYPE[d] for d in self.dtypes],
            },
            separators=(",", ":"),
        )

    @classmethod
    def decode(cls, text: str) -> ChunkLayout:
        """Raise ValueError for a block this plugin did not write."""
        try:
            d = json.loads(text)
            if d.get("v") != LAYOUT_VERSION:
                raise ValueError(f"layout version {d.get('v')!r}, expected {LAYOUT_VERSION!r}")
            return cls(
                tuple(torch.Size(s) for s in d["shapes"]),
                tuple(STR_DTYPE_TO_TORCH_DTYPE[x] for x in d["dtypes"]),
                MemoryFormat[d["fmt"]],
            )
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"not a LMCache chunk layout: {err!r}") from None


def chunk_bytes(obj: MemoryObj) -> torch.Tensor:
    """A chunk's bytes as a flat uint8 tensor over the MemoryObj's own memory, on its own device.

    No byte is copied: the tensor is a view of the head of the MemoryObj's
    ``raw_tensor`` (its ``get_size()`` bytes, without the allocator's
    alignment padding), so the client writes from and reads into LMCache's
    memory itself, and a MemoryObj on a GPU would take the client's device
    path. ``byte_array`` is not used: it builds a host ``memoryview`` from
    the raw pointer, which is only right for host memory.
    """
    raw = obj.raw_tensor
    if raw is None:
        raise ValueError(f"a {type(obj).__name__} holds no tensor (invalidated, or not a tensor chunk); "
                         "the Strata plugin stores tensor chunks only")
    if raw.dtype != torch.uint8 or raw.dim() != 1:  # LMCache's allocators hand flat uint8 already
        try:
            raw = raw.view(-1).view(torch.uint8)
        except RuntimeError as err:  # a strided raw tensor: its bytes are not one run
            raise ValueError(f"the MemoryObj's memory is not one contiguous run of bytes: {err}") from None
    return raw[: obj.get_size()]
