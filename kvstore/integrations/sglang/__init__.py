"""Strata as an SGLang HiCache L3 storage backend (sglang 0.5.23's ``HiCacheStorage``).

SGLang's hierarchical cache keeps KV pages in GPU memory (L1), a host pool
(L2) and a storage backend (L3). Strata is such a backend, loaded by
SGLang's own ``StorageBackendFactory`` from the dynamic backend config (no
fork, no patch)::

    --enable-hierarchical-cache --hicache-mem-layout page_first --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "strata",
      "module_path": "kvstore.integrations.sglang", "class_name": "StrataHiCacheStorage",
      "interface_v1": 1, "hicache_storage_pass_prefix_keys": true,
      "strata": {"target": "127.0.0.1:50051"}}'

The package: :mod:`.settings` (the ``"strata"`` options), :mod:`.layout`
(keys, namespaces, the page geometry's digest), :mod:`.host_pages` (the
host pool's pages as views) and :mod:`.backend` (``StrataHiCacheStorage``,
the only module that calls the daemon).

Keys. Each page is stored as one block per contiguous piece of it in the
host pool (MHA ``page_first``: K and V; MLA: one), key
``"<SGLang's page hash>#<piece>"``, in the namespace
``<namespace>/<model>@<digest>``: the digest covers the page geometry and
the rank's shard, so another geometry is a miss, never a collision
(:mod:`.layout`). With ``hicache_storage_pass_prefix_keys`` SGLang names
the pages before a call's first one, and each block's parent is the same
piece of the page before it.

Bytes. ``batch_set_v1`` hands the client views of the pages' pieces in the
host pool, ``batch_get_v1`` a placement that answers with those views: on
the daemon's host each piece is copied once each way between the pool and
the daemon's arena, checked against its xxh3 checksum where it lands, and a
block is visible to readers only once committed and verified. A block of
another size or layout tag is never read. Not done yet: with
``"allocator": "shm"`` the pool is a memfd the daemon could map and fill
itself (passed over the same-host socket); this backend does not use it.

Ranks. SGLang runs one backend per TP rank and min-reduces the hits; each
non-MLA rank has its own namespace (its shard is in the digest). MLA KV is
the same on every rank: one namespace, and only SGLang's storage writer
(``is_storage_writer``) stores.

Failure. A call answers False (or 0 pages) and never raises into SGLang:
the daemon down or stuck costs one failed call per ``down_backoff_s``
(meanwhile every call misses at once); a corrupt block, a full daemon, a
refused call or pages outside the pool cost that call's pages, counted by
reason in ``counts`` and logged with ``op``, ``reason`` and ``pages``.
"""

from kvstore.integrations.sglang.backend import StrataHiCacheStorage
from kvstore.integrations.sglang.layout import PageLayout, piece_key
from kvstore.integrations.sglang.settings import BACKEND_NAME, CLASS_NAME, MODULE_PATH, StrataStorageSettings

__all__ = ["BACKEND_NAME", "CLASS_NAME", "MODULE_PATH", "PageLayout", "StrataHiCacheStorage",
           "StrataStorageSettings", "piece_key"]
