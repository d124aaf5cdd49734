"""The floor of ``benchmarks.lmcache``: a LMCache remote-storage plugin with no storage behind it.

It keeps each stored chunk as a tensor in this process and hands it back
with one copy into a MemoryObj from LMCache's own allocator: no process
boundary, no checksum, no network. What an engine's store, lookup and
retrieve cost through it is LMCache's own per-chunk work plus one memory
copy each way, so no remote backend can be faster; the benchmark reports
every backend against it, to show how much of each operation is LMCache's
and how much is the backend's.

Not a cache to deploy: it holds everything in the engine's own memory and
forgets it with the process.
"""

from __future__ import annotations

import threading

from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector


class InProcessFloor(RemoteConnector):
    def __init__(self, loop=None, local_cpu_backend=None, config=None) -> None:
        metadata = getattr(local_cpu_backend, "metadata", None)
        if metadata is not None and config is not None:
            super().__init__(config, metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self._chunks: dict = {}  # CacheEngineKey -> (shapes, dtypes, fmt, bytearray)
        # Buffers of cleared chunks, reused by later puts: a copy into memory
        # already mapped, as a long-running store's would be.
        self._free: dict[int, list[bytearray]] = {}
        self._lock = threading.Lock()

    # ---- lookups -----------------------------------------------------------

    async def exists(self, key) -> bool:
        return key in self._chunks

    def exists_sync(self, key) -> bool:
        return key in self._chunks

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys) -> int:
        for i, key in enumerate(keys):
            if key not in self._chunks:
                return i
        return len(keys)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id, keys, pin: bool = False) -> int:
        return self.batched_contains(keys)

    # ---- writes: one copy ----------------------------------------------------

    async def put(self, key, memory_obj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys, memory_objs) -> None:
        for key, obj in zip(keys, memory_objs):
            meta = obj.meta
            shapes = meta.shapes if meta.shapes else [meta.shape]
            dtypes = meta.dtypes if meta.dtypes else [meta.dtype]
            src = obj.byte_array.cast("B")
            with self._lock:
                pool = self._free.get(len(src))
                buf = pool.pop() if pool else bytearray(len(src))
            buf[:] = src
            with self._lock:
                self._chunks[key] = (list(shapes), list(dtypes), obj.get_memory_format(), buf)

    # ---- reads: one copy -----------------------------------------------------

    async def get(self, key):
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys) -> list:
        out = []
        for key in keys:
            chunk = self._chunks.get(key)
            if chunk is None:
                out.append(None)
                continue
            shapes, dtypes, fmt, data = chunk
            obj = self.local_cpu_backend.allocate(shapes, dtypes, fmt, busy_loop=False)
            if obj is not None:
                obj.byte_array.cast("B")[: len(data)] = data
            out.append(obj)
        return out

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id, keys) -> list:
        objs = await self.batched_get(keys)
        hits = next((i for i, obj in enumerate(objs) if obj is None), len(objs))
        for obj in objs[hits:]:
            if obj is not None:
                obj.ref_count_down()
        return objs[:hits]

    # ---- the rest ----------------------------------------------------------------

    def remove_sync(self, key) -> bool:
        with self._lock:
            return self._chunks.pop(key, None) is not None

    def clear(self, keys) -> None:
        """Forget these chunks, keeping their buffers for later puts."""
        with self._lock:
            for key in keys:
                chunk = self._chunks.pop(key, None)
                if chunk is not None:
                    self._free.setdefault(len(chunk[3]), []).append(chunk[3])

    async def list(self) -> list[str]:
        return [key.to_string() for key in list(self._chunks)]

    async def close(self) -> None:
        self._chunks.clear()
