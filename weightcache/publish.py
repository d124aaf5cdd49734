"""Publishing: read a revision once, cut its files into chunks, hash them, parse the headers,
store the manifest beside the files.

This is the only step that reads the whole model from the origin; every
node afterwards fetches by the manifest. Chunks are read with bounded
concurrency into reused buffers (a fresh buffer per chunk costs several
times the read) and hashed off the event loop. A safetensors file whose
header is broken stops the publish with the file named: a model that
cannot be read must not get a manifest that promises it can. A Hugging
Face shard index (``*.safetensors.index.json``) is checked against the
headers, so a shard that lost a tensor is caught here, not in the engine.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from weightcache.errors import ManifestError
from weightcache.manifest import DEFAULT_CHUNK_BYTES, FileEntry, Manifest, check_chunk_bytes, digest_of
from weightcache.origin.base import Origin
from weightcache.safetensors_header import LENGTH_BYTES, SafetensorsHeader, header_length, parse_header
from weightcache import catalog

SAFETENSORS_SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20
DEFAULT_CONCURRENCY = 8


async def publish(
    origin: Origin,
    *,
    model: str | None = None,
    revision: str | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    concurrency: int = DEFAULT_CONCURRENCY,
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    """Build the revision's manifest and store it at the origin; returns it (``.digest`` names it)."""
    manifest = await build_manifest(
        origin, model=model, revision=revision, chunk_bytes=chunk_bytes, concurrency=concurrency, progress=progress
    )
    await catalog.store(origin, manifest)
    return manifest


async def build_manifest(
    origin: Origin,
    *,
    model: str | None = None,
    revision: str | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    concurrency: int = DEFAULT_CONCURRENCY,
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    check_chunk_bytes(chunk_bytes)
    if not 1 <= concurrency <= 256:
        raise ManifestError(f"publish concurrency {concurrency} must be 1..256")
    files = await origin.list_files()
    if not files:
        raise ManifestError(f"{origin.location} holds no files to publish")
    headers = {p: await read_header(origin, p, size) for p, size in files if p.endswith(SAFETENSORS_SUFFIX)}
    digests: dict[str, list[bytes | None]] = {p: [None] * -(-size // chunk_bytes) for p, size in files}
    work = asyncio.Queue()
    for p, size in files:
        for i in range(len(digests[p])):
            work.put_nowait((p, i, min(chunk_bytes, size - i * chunk_bytes)))
    loop = asyncio.get_running_loop()

    async def worker() -> None:
        buffer = memoryview(bytearray(chunk_bytes))
        while not work.empty():
            path, i, length = work.get_nowait()
            view = await origin.read(path, i * chunk_bytes, length, buffer)
            digests[path][i] = await loop.run_in_executor(None, digest_of, view)
            if progress is not None:
                progress(length)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, max(1, work.qsize())))))
    entries = [FileEntry(p, size, tuple(digests[p]), headers.get(p)) for p, size in files]
    manifest = Manifest.build(model or origin.default_model, revision or origin.default_revision, chunk_bytes, entries)
    for p, size in files:
        if p.endswith(INDEX_SUFFIX):
            await check_shard_index(origin, p, manifest)
    return manifest


async def read_header(origin: Origin, path: str, size: int) -> SafetensorsHeader:
    where = origin.where(path)
    first = bytes(await origin.read(path, 0, min(LENGTH_BYTES, size), memoryview(bytearray(LENGTH_BYTES))))
    n = header_length(first, size, where)
    raw = bytes(await origin.read(path, LENGTH_BYTES, n, memoryview(bytearray(n))))
    return parse_header(raw, size, where)


async def check_shard_index(origin: Origin, path: str, manifest: Manifest) -> None:
    """Every tensor a Hugging Face shard index names is in the shard it names."""
    where = origin.where(path)
    raw = await origin.get(path, MAX_INDEX_BYTES)
    try:
        weight_map = json.loads(raw or b"{}").get("weight_map", {})
    except (ValueError, AttributeError, RecursionError):
        raise ManifestError(f"{where}: not a JSON object with a weight_map") from None
    if not isinstance(weight_map, dict):
        raise ManifestError(f"{where}: weight_map is not an object")
    base = path.rsplit("/", 1)[0] + "/" if "/" in path else ""
    tables = {f.path: {t.name for t in f.header.tensors} for f in manifest.files if f.header is not None}
    for name, shard in weight_map.items():
        if name not in tables.get(f"{base}{shard}", ()):
            raise ManifestError(
                f"{where} says tensor {name!r} is in {shard}, but that shard's header has no such tensor: "
                "re-upload the shards or the index"
            )
