"""A real LMCacheEngine on CPU with Strata as its remote storage, for the LMCache plugin's tests.

The engine is LMCache's own (``LMCacheEngineBuilder``, its storage manager, its
RemoteBackend loading the plugin from config); only the GPU side is replaced by a
connector that copies to and from a CPU tensor, so what comes back can be compared byte
for byte with what went in. Engines of other processes run this module
(``python -m tests.support.lmcache_engine store|retrieve TARGET``) without vLLM and with
a fixed PYTHONHASHSEED, as LMCache's token hashing without vLLM requires. vLLM is
installed here for the vLLM connector's tests; a process run as this module does
without it (``sys.modules["vllm"] = None``), as an LMCache deployment without vLLM
does, because LMCache imports most of vLLM (seconds) only to look for a hash function
and falls back to Python's builtin hash anyway.

It imports lmcache at its top: import it after ``pytest.importorskip("lmcache")``.
"""

from __future__ import annotations

import json
import os
import sys
import uuid

if __name__ == "__main__":
    sys.modules["vllm"] = None  # LMCache without vLLM (see above): imports of vllm fail at once

import torch  # noqa: E402 (lmcache brings torch)
from lmcache.v1.cache_engine import LMCacheEngineBuilder  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402

from kvstore import Client  # noqa: E402
from kvstore.integrations.lmcache import StrataConnector, namespace_of  # noqa: E402
from tests.support.wait import wait_until  # noqa: E402

MODEL = "acme/tiny-llm"
LAYERS, HEADS, HEAD_SIZE, CHUNK = 4, 2, 32, 256
KV_SHAPE = (LAYERS, 2, CHUNK, HEADS, HEAD_SIZE)
TOKENS = 1000  # three full chunks and a partial one of 232 tokens
CHUNKS = -(-TOKENS // CHUNK)

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")


class CPUKVConnector(MockGPUConnector):
    """LMCache's mock GPU connector, made to copy: the "GPU" KV cache is a CPU
    tensor [2, layers, tokens, heads*head_size] (LMCache's KV_2LTD order)."""

    def __init__(self, kv: torch.Tensor) -> None:
        super().__init__(KV_SHAPE)
        self.kv = kv

    def from_gpu(self, memory_obj, start, end, **kwargs):
        memory_obj.tensor.copy_(self.kv[:, :, start:end])

    def to_gpu(self, memory_obj, start, end, **kwargs):
        self.kv[:, :, start:end].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
        for obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(obj, start, end)

    def batched_to_gpu(self, memory_objs, starts, ends, **kwargs):
        for obj, start, end in zip(memory_objs, starts, ends):
            self.to_gpu(obj, start, end)


def kv_source(seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, LAYERS, TOKENS, HEADS * HEAD_SIZE, generator=g).to(torch.bfloat16)


def token_ids() -> torch.Tensor:
    return torch.arange(1000, 1000 + TOKENS)


def plugin_entry(name: str, target: str, class_name: str = "StrataAdapter", **options) -> dict:
    """The extra_config lines of one remote_storage_plugins entry."""
    extra = {
        f"remote_storage_plugin.{name}.module_path": "kvstore.integrations.lmcache",
        f"remote_storage_plugin.{name}.class_name": class_name,
        f"remote_storage_plugin.{name}.target": target,
        f"remote_storage_plugin.{name}.timeout_s": 2.0,
    }
    extra.update({f"remote_storage_plugin.{name}.{k}": v for k, v in options.items()})
    return extra


def lmcache_config(target: str | None, entries: dict[str, dict] | None = None, **options) -> LMCacheEngineConfig:
    """One entry "strata" at ``target``, or ``entries``: name -> the options of plugin_entry."""
    entries = entries if entries is not None else {"strata": dict(target=target, **options)}
    extra: dict = {}
    for name, entry in entries.items():
        extra.update(plugin_entry(name, **entry))
    # local_cpu off: every lookup and retrieve goes to Strata, none is served from LMCache's own RAM.
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.05, remote_serde="naive",
        remote_storage_plugins=list(entries), save_unfull_chunk=True, blocking_timeout_secs=5, extra_config=extra,
    )


def metadata() -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, kv_shape=KV_SHAPE, chunk_size=CHUNK,
    )


class Engine:
    """One LMCacheEngine with the Strata plugin, destroyed on exit."""

    def __init__(self, target: str | None, entries: dict[str, dict] | None = None, **options) -> None:
        self.instance_id = f"strata-{uuid.uuid4().hex[:8]}"
        self.kv = CPUKVConnector(torch.zeros(2, LAYERS, TOKENS, HEADS * HEAD_SIZE, dtype=torch.bfloat16))
        self.engine = LMCacheEngineBuilder.get_or_create(
            self.instance_id, lmcache_config(target, entries, **options), metadata(), self.kv,
            lambda *a: None, lambda *a: None,
        )
        self.engine.post_init()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        LMCacheEngineBuilder.destroy(self.instance_id)

    @property
    def connector(self) -> StrataConnector:
        return self.connector_of("strata")

    def connector_of(self, entry: str) -> StrataConnector | None:
        """The connector LMCache made for one remote_storage_plugins entry (None: it failed)."""
        connection = self.engine.storage_manager.storage_backends[f"RemoteBackend-{entry}"].connection
        return None if connection is None else connection.getWrappedConnector()

    def store(self, kv: torch.Tensor) -> None:
        self.kv.kv = kv
        self.engine.store(token_ids())

    def lookup(self) -> int:
        return self.engine.lookup(token_ids())

    def retrieve(self) -> tuple[int, torch.Tensor]:
        self.kv.kv = torch.zeros_like(self.kv.kv)
        mask = self.engine.retrieve(token_ids())
        return int(mask.sum()), self.kv.kv


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def wait_for_blocks(target: str, n: int, namespace: str = namespace_of(MODEL)) -> None:
    def count() -> int:
        with Client(target, use_shm=False, timeout=2) as c:
            try:
                return c.stats(namespace).blocks
            except Exception:  # noqa: BLE001 - the namespace appears with the first block
                return 0

    wait_until(lambda: count() >= n, what=f"{n} LMCache chunks stored in Strata at {target} in {namespace}")


def main(action: str, target: str) -> dict:
    """What an engine of another process reports: ``store`` the source KV cache, or ``retrieve`` it."""
    with Engine(target) as e:
        if action == "store":
            e.store(kv_source())
            wait_for_blocks(target, CHUNKS)
            with Client(target, use_shm=False) as c:
                return {"stored": c.stats(namespace_of(MODEL)).blocks}
        lookup = e.lookup()
        retrieved, kv = e.retrieve()
        same = same_bytes(kv[:, :, :retrieved], kv_source()[:, :, :retrieved])
        return {"lookup": lookup, "retrieved": retrieved, "same_bytes": same}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
    # The engine is destroyed and the connector closed by now; skip the seconds
    # the interpreter would spend joining LMCache's idle periodic threads.
    os._exit(0)
