"""Strata as LMCache's remote storage: a ``RemoteConnector`` on Strata's client.

The package: :mod:`.settings` (options per entry), :mod:`.mapping` (keys and
layouts) and :mod:`.connector`; when to call the daemon is
:mod:`kvstore.integrations.health`, shared with the vLLM tier.

LMCache (0.5.x) loads it as a remote-storage plugin; no fork of LMCache or
vLLM is needed::

    remote_storage_plugins: ["strata"]
    extra_config:
      remote_storage_plugin.strata.module_path: kvstore.integrations.lmcache
      remote_storage_plugin.strata.class_name: StrataAdapter
      remote_storage_plugin.strata.target: "127.0.0.1:50051"

Options (``remote_storage_plugin.<name>.<option>``; see :class:`PluginSettings`):
``target``, ``namespace``, ``timeout_s``, ``retries``, ``shared_memory``,
``down_backoff_s``; for a daemon with authentication ``token_file`` (a file
holding the bearer token: LMCache's config is logged, so the token itself
is not an option), ``tls_ca``, ``tls_cert``, ``tls_key`` and
``tls_server_name``.

Several entries. LMCache names plugin entries ``<type>`` or
``<type>.<instance>``; entries ``strata.local`` and ``strata.remote`` (say,
the node's sidecar and a shared daemon) each get their own connector with
their own options. Only an adapter learns which entry it builds for (LMCache
hands :class:`StrataAdapter` a context with the entry's name; a plain
``RemoteConnector`` class is built with no name), so ``class_name:
StrataAdapter`` is the form that works for any number of entries.
``class_name: StrataConnector`` still works for a single Strata entry of any
name; with two or more Strata entries it is refused with a message saying to
use ``StrataAdapter``, never silently given the first entry's settings.

Mapping. Each LMCache chunk is one Strata block. The block key is the
``CacheEngineKey``'s own string form (``model@world@worker@hash@dtype[@tags]``),
so the mapping is lossless and :func:`cache_key` inverts it; the namespace is
the model name, so models never see each other's blocks. The block's
``layout`` carries the MemoryObj's shapes, dtypes and memory format, from
which ``get`` rebuilds it exactly, partial last chunks included.

Bytes. Each chunk reaches the client as a tensor over its MemoryObj's own
memory (:func:`.mapping.chunk_bytes`: the head of ``raw_tensor``, no copy);
``put`` reads it and ``get_into`` writes it in place. On the daemon's host
that is one copy each way between the MemoryObj and the daemon's
shared-memory arena; elsewhere the client streams over gRPC (the client's
choice, not this module's). ``get`` learns each block's size and layout from
the daemon before any byte moves, allocates a MemoryObj of exactly that
layout from ``local_cpu_backend`` (a short last chunk included) and has the
bytes read straight into it.

Where those buffers live is LMCache's design, not this plugin's: a remote
connector is handed host memory. LMCache 0.5.6 builds a ``RemoteBackend``
only over a ``LocalCPUBackend`` ("Remote backend requires local CPU backend
as a buffer": ``max_local_cpu_size > 0``; ``local_cpu: False`` turns off
only LMCache's own hot cache, not that backend); the MemoryObjs its ``put``
gets are that backend's (the storage manager first copies those of a PD
backend, which may be on the GPU, into it: ``allocate_and_copy_objects``),
and ``get`` allocates from it. Its allocator carves host memory that
LMCache allocates pinned (``MixedMemoryAllocator`` over
``device_ops.alloc_pinned_*``; in P2P mode a paged allocator whose CPU half
alone is used, ``allocator_type="cpu"``); LMCache's device
memory (``GPUMemoryAllocator``, the PD backend's ``pd_buffer_device``
buffer, GDS's cuFile buffers) serves its GPU connectors' staging, PD
transfers and GDS, never a remote connector. The GPU to host copy is
LMCache's own (its GPU connector, before ``put`` and after ``get``). So the
client's device path is never taken from LMCache 0.5.6; were a MemoryObj on
a GPU handed over, its tensor would take that path unchanged, where
``byte_array`` (a host ``memoryview`` built from the raw pointer) would read
a device address as host memory.

``list`` names every LMCache chunk the daemon holds, as the key strings
``CacheEngineKey.from_string`` reads back.

A down daemon is a miss, never a hang: every call has a short deadline, and
after the daemon is found unreachable the connector answers misses (and
drops puts) without calling it for ``down_backoff_s``, so a dead sidecar
costs one failed RPC per backoff period instead of one per chunk.

Contracts of LMCache's ``RemoteConnector`` kept here: ``put`` does not drop
the MemoryObj's reference (LMCache's wrapper does); ``get`` results come
from ``local_cpu_backend.allocate`` and belong to the caller.
"""

from kvstore.integrations.lmcache.connector import StrataAdapter, StrataConnector
from kvstore.integrations.health import DaemonHealth
from kvstore.integrations.lmcache.mapping import ChunkLayout, block_key, cache_key, namespace_of
from kvstore.integrations.lmcache.settings import PluginSettings

__all__ = [
    "ChunkLayout",
    "DaemonHealth",
    "PluginSettings",
    "StrataAdapter",
    "StrataConnector",
    "block_key",
    "cache_key",
    "namespace_of",
]
