"""Strata as an L2 of LMCache's server mode (``lmcache server``, which vLLM reaches through ``LMCacheMPConnector``).

LMCache's server keeps KV chunks in its own L1 memory and writes them down to
L2 adapters; its plugin adapter type loads this one::

    lmcache server --l1-size-gb 20 --eviction-policy LRU \\
      --l2-adapter '{"type": "plugin", "module_path": "kvstore.integrations.lmcache_mp",
                     "class_name": "StrataL2Adapter", "adapter_params": {"target": "127.0.0.1:50051"}}'

- **Store**: each object's bytes are copied once into the daemon (into its
  arena in place on the same host), verified there, and visible only once
  committed; a task fails whole when any object could not be stored, as
  LMCache's contract says. Keys already stored move nothing.
- **Lookup and lock**: one Pin per namespace: the daemon's per-key presence
  answer, and each hit held against eviction until LMCache unlocks it
  (:mod:`~kvstore.integrations.lmcache_mp.locks`), or for ``lock_lease_s``
  if it never does.
- **Load**: each block read straight into LMCache's MemoryObj and checked
  (xxh3) on landing; a block of another size or layout is a miss, never a
  wrong read.
- **Keys and namespaces**: :mod:`~kvstore.integrations.lmcache_mp.keys`
  (a namespace per model and per ``cache_salt``).
- ``delete``, ``list_l2_keys`` (paged from the daemon's listing),
  ``get_usage`` (LMCache's per-``cache_salt`` byte accounting, from what this
  adapter stored and deleted; it declares no capacity, so LMCache does no
  global eviction: the daemon evicts by its own policy), ``report_status``
  (healthy unless the daemon was found down; counts by outcome).

Everything a task can meet from the daemon fails the task or answers misses;
LMCache keeps serving from L1 and recomputes the rest.
"""

from kvstore.integrations.lmcache_mp.adapter import FAILURES, StrataL2Adapter, StrataL2AdapterConfig
from kvstore.integrations.lmcache_mp.settings import CLASS_NAME, MODULE_PATH, L2Settings

__all__ = ["CLASS_NAME", "FAILURES", "MODULE_PATH", "L2Settings", "StrataL2Adapter", "StrataL2AdapterConfig"]
