"""Strata's weight pipeline: publish a model revision once, stream it onto every node.

- :mod:`weightcache.manifest`: a revision → files → chunks (BLAKE3) → tensor tables.
- :mod:`weightcache.publish` and :mod:`weightcache.catalog`: build the manifest, store it
  beside the model (``.strata/``), find it again by digest.
- :mod:`weightcache.origin`: where revisions live (a local folder, S3), by URL scheme.
- :mod:`weightcache.cache`, :mod:`weightcache.cached_model`, :mod:`weightcache.record`,
  :mod:`weightcache.claims`: the node cache: sparse files, the record of verified chunks,
  which process fetches what, eviction by model.
- :mod:`weightcache.sources` and :mod:`weightcache.fetch`: where chunks come from, and the
  planner that fetches them in the reader's order, verified, with back-off.
- :mod:`weightcache.reader`: :func:`open_model`, (name, tensor) as each tensor lands.
- :mod:`weightcache.prefetch`, :mod:`weightcache.service`, :mod:`weightcache.peers`: the weight
  node (``strata weights serve``): prefetch jobs, ``WeightService`` over gRPC, peer chunk reads
  and the swarm that asks the origin for each chunk about once.
- :mod:`weightcache.index_swarm`: that swarm found through the prefix index (members, chunk
  holders, liveness) instead of a fixed list.
- :mod:`weightcache.ram_copy`: one host-RAM copy of each model per node, mapped read-only by
  every engine process.
- :mod:`weightcache.access`: the daemon's authentication and policy on ``WeightService``.
- :mod:`weightcache.vllm_loader`: vLLM's ``--load-format strata`` (imported only by vLLM).

``weightcache`` imports ``kvstore``; ``kvstore`` never imports ``weightcache``.
"""

from __future__ import annotations

import asyncio

from weightcache.cache import NodeCache
from weightcache.fetch import FetchLimits, FetchStats
from weightcache.manifest import DEFAULT_CHUNK_BYTES, Manifest
from weightcache.origin import S3OriginOptions, open_origin
from weightcache.reader import ModelReader, open_model

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "FetchLimits",
    "FetchStats",
    "Manifest",
    "ModelReader",
    "NodeCache",
    "S3OriginOptions",
    "open_model",
    "open_origin",
    "publish_model",
]


def publish_model(location: str, *, s3: S3OriginOptions | None = None, revision: str | None = None,
                  **options) -> Manifest:
    """Publish a revision (see :func:`weightcache.publish.publish`) from synchronous code."""
    from weightcache.publish import publish

    async def run() -> Manifest:
        origin = open_origin(location, revision=revision, s3=s3)
        try:
            return await publish(origin, **options)  # the origin knows the revision (an HF branch's commit)
        finally:
            await origin.close()

    return asyncio.run(run())
