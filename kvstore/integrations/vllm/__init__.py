"""Strata as a secondary tier of vLLM's own KV offloading (vLLM 0.33's ``TieringOffloadingManager``).

vLLM's ``OffloadingConnector`` keeps offloaded KV in a CPU primary tier and
cascades every chunk to its ``secondary_tiers``; a chunk found in one is
loaded back through the primary. Strata is such a tier, loaded by vLLM's
``SecondaryTierFactory`` from ``type`` + ``module_path`` (no LMCache, no fork)::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "strata", "module_path": "kvstore.integrations.vllm",
                             "target": "127.0.0.1:50051"}]}}'

The package: :mod:`.settings` (the entry's options), :mod:`.mapping` (keys,
namespaces, layouts), :mod:`.lookups` (lookups that never wait),
:mod:`.jobs` (the tier's threads), :mod:`.chunks` (the only module that
calls the daemon), :mod:`.metrics` and :mod:`.tier` (``StrataTier``).

Keys. A chunk's ``OffloadKey`` (block hash + KV cache group) becomes the
block key = the hash, in the namespace
``<namespace>/<model>@<layout digest>/g<group>``: lossless, vLLM's own
hashes as block keys, and engines of the same KV layout share chunks while
engines of another layout cannot read them (:mod:`.mapping`).

Bytes. A chunk is one row of the primary tier's buffer, handed to the
client in place (a ``memoryview`` slice of ``primary_kv_view``, no copy);
on the daemon's host it is copied once each way between that row and the
daemon's shared arena (gRPC streaming elsewhere). A load checks each
block's size and layout tag before a byte lands in a row.

Those rows are host memory by vLLM's design, and no GPU memory reaches
this tier. vLLM 0.33's secondary tiers run in the scheduler process and
get only ``primary_kv_view``, a ``memoryview`` over the CPU primary tier's
``SharedOffloadRegion`` (an mmap of ``/dev/shm/vllm_offload_<engine>.mmap``);
the GPU workers map the same region, register it as pinned memory where
the platform allows, and copy KV blocks between their GPU cache and its
rows themselves (``CPUOffloadingWorker``), before a store reaches this
tier and after a load leaves it. So the client's device path is never taken here; the
tier's part is to add no copy of its own between a row and the client.

Failure. The scheduler thread never calls the daemon. A daemon that is
down, stuck or restarting costs one failed call per ``down_backoff_s``:
meanwhile lookups answer miss at once, stores are dropped and loads fail
(each counted by reason), and vLLM recomputes. A load fails per chunk,
within ``job_timeout_s`` plus its calls' ``timeout_s``; the chunks that did
arrive are kept (``successful_keys``).
"""

from kvstore.integrations.vllm.mapping import KVLayout, block_key, offload_key
from kvstore.integrations.vllm.settings import MODULE_PATH, TIER_TYPE, StrataTierSettings
from kvstore.integrations.vllm.tier import StrataTier

# vLLM's factory resolves an out-of-tree tier as ``getattr(import_module(module_path), type)``:
# "type": "strata" finds this name, "type": "StrataTier" the class's own.
strata = StrataTier

__all__ = [
    "MODULE_PATH", "TIER_TYPE", "KVLayout", "StrataTier", "StrataTierSettings", "block_key", "offload_key", "strata",
]
