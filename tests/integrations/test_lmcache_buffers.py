"""The LMCache plugin hands the client LMCache's own memory: each chunk as a tensor over its MemoryObj.

The engine, its CPU backend, the daemons and the client are real; the one
stand-in is a client subclass that notes what the connector hands it
(put values, the buffers its placement returns) before doing the real call.
A tensor over the MemoryObj's memory (the same address, the chunk's exact
size) is what the client reads and writes in place on the host, and what
takes its device path on a GPU: the connector has no branch on the device,
so a CPU MemoryObj runs the same plugin code a CUDA one would. Where the
MemoryObjs live is LMCache's choice (host memory, see
:mod:`kvstore.integrations.lmcache`); this file checks that the plugin adds
no copy of its own on either path.

Skipped when lmcache is not installed (``pip install -e ".[test,lmcache]"``).
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("lmcache")

import torch  # noqa: E402
from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj  # noqa: E402

import kvstore.integrations.lmcache.connector as connector_module  # noqa: E402
from kvstore.client import AsyncClient  # noqa: E402
from kvstore.integrations.lmcache import StrataConnector  # noqa: E402
from kvstore.integrations.lmcache.mapping import chunk_bytes  # noqa: E402
from tests.support.lmcache_engine import (  # noqa: E402
    CHUNKS, HEAD_SIZE, HEADS, LAYERS, MODEL, TOKENS, Engine, kv_source, same_bytes, wait_for_blocks,
)

pytestmark = pytest.mark.system


class RecordingAsyncClient(AsyncClient):
    """A real client that keeps what the connector hands it: the values it puts, the buffers it places."""

    made: list[RecordingAsyncClient] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.put_values: list = []
        self.placed: list = []
        RecordingAsyncClient.made.append(self)

    async def put_many(self, namespace, items):
        self.put_values += [item.value for item in items]
        return await super().put_many(namespace, items)

    async def get_into(self, namespace, keys, buffers):
        assert callable(buffers), "the connector places each block from its layout"
        inner = buffers

        def place(i, info):
            buf = inner(i, info)
            if buf is not None:
                self.placed.append(buf)
            return buf

        return await super().get_into(namespace, keys, place)


@pytest.fixture
def recording(monkeypatch) -> list[RecordingAsyncClient]:
    RecordingAsyncClient.made = []
    monkeypatch.setattr(connector_module, "AsyncClient", RecordingAsyncClient)
    return RecordingAsyncClient.made


def over(tensor, obj) -> bool:
    """Whether ``tensor`` is the MemoryObj's own chunk bytes: its address, its exact size, its device."""
    return (isinstance(tensor, torch.Tensor) and tensor.dtype == torch.uint8 and tensor.data_ptr() == obj.data_ptr
            and tensor.numel() == obj.get_size() and tensor.device == obj.raw_tensor.device)


def within(tensor, region: torch.Tensor) -> bool:
    """Whether ``tensor``'s bytes lie inside ``region`` (a backend's whole buffer)."""
    start, end = region.data_ptr(), region.data_ptr() + region.numel()
    return (isinstance(tensor, torch.Tensor) and start <= tensor.data_ptr()
            and tensor.data_ptr() + tensor.numel() * tensor.element_size() <= end)


@pytest.mark.parametrize("shared_memory", ["auto", "false"], ids=["shm", "stream"])
def test_put_and_get_hand_the_client_the_memoryobjs_own_memory(make_daemon, recording, shared_memory):
    """put gives the client a tensor over the MemoryObj's bytes (no byte_array view, no copy); get
    reads the block into a tensor over the MemoryObj it returns; the bytes come back equal."""
    daemon = make_daemon()
    with Engine(daemon.target, shared_memory=shared_memory) as e:
        backend = e.engine.storage_manager.local_cpu_backend
        conn = StrataConnector(asyncio.new_event_loop(), backend, e.engine.config)
        loop = conn.loop
        key = CacheEngineKey(MODEL, 1, 0, 4242, torch.bfloat16)
        obj = backend.allocate([torch.Size([2, LAYERS, 100, HEADS * HEAD_SIZE])], [torch.bfloat16])
        obj.tensor.copy_(kv_source()[:, :, :100])
        got = None
        try:
            loop.run_until_complete(conn.put(key, obj))
            [client] = recording
            [value] = client.put_values
            assert over(value, obj)
            got = loop.run_until_complete(conn.get(key))
            assert got is not None and got.data_ptr != obj.data_ptr
            [placed] = client.placed
            assert over(placed, got)
            assert same_bytes(got.tensor, obj.tensor)
        finally:
            obj.ref_count_down()
            if got is not None:
                got.ref_count_down()
            loop.run_until_complete(conn.close())
            loop.close()


def test_an_engines_chunks_cross_in_lmcaches_own_memory_byte_for_byte(make_daemon, recording):
    """Through a real LMCacheEngine: every chunk put and every chunk read in lies in the LocalCPUBackend's
    own buffer (the memory LMCache's GPU connector copies to and from), and the KV comes back equal."""
    daemon = make_daemon()
    source = kv_source()
    with Engine(daemon.target) as e:
        region = e.engine.storage_manager.local_cpu_backend.memory_allocator.buffer
        e.store(source)
        wait_for_blocks(daemon.target, CHUNKS)
        retrieved, kv = e.retrieve()
        assert retrieved == TOKENS and same_bytes(kv, source)
        [client] = recording
    assert len(client.put_values) == CHUNKS and all(within(v, region) for v in client.put_values)
    assert len(client.placed) == CHUNKS and all(within(b, region) for b in client.placed)
    assert sorted(v.numel() for v in client.put_values) == sorted(b.numel() for b in client.placed)


def test_chunk_bytes_is_a_view_of_the_chunk_without_the_allocators_padding(make_daemon):
    daemon = make_daemon()
    with Engine(daemon.target) as e:
        backend = e.engine.storage_manager.local_cpu_backend
        objs = backend.batched_allocate(torch.Size([2, LAYERS, 7, HEADS * HEAD_SIZE]), torch.bfloat16, batch_size=2)
        try:
            for obj in objs:
                view = chunk_bytes(obj)
                assert over(view, obj) and view.numel() < obj.raw_tensor.numel()  # the padding left out
                view.fill_(7)  # the MemoryObj's memory itself
                assert bool((obj.tensor.view(torch.uint8) == 7).all())
        finally:
            for obj in objs:
                obj.ref_count_down()


def tensor_obj(raw: torch.Tensor, shape: torch.Size, dtype: torch.dtype):
    """A MemoryObj over ``raw`` as LMCache builds them, without an allocator behind it."""
    size = shape.numel() * dtype.itemsize
    meta = MemoryObjMetadata(shape=shape, dtype=dtype, address=0, phy_size=size, ref_count=1,
                             fmt=MemoryFormat.KV_2LTD, shapes=[shape], dtypes=[dtype])
    return TensorMemoryObj(raw, meta, None)


def test_chunk_bytes_of_a_typed_raw_tensor_is_still_a_view_and_a_strided_one_is_refused():
    shape = torch.Size([2, LAYERS, 5, HEADS * HEAD_SIZE])
    typed = torch.zeros(shape.numel(), dtype=torch.bfloat16)
    obj = tensor_obj(typed, shape, torch.bfloat16)
    assert over(chunk_bytes(obj), obj)
    strided = torch.zeros(2 * shape.numel(), dtype=torch.bfloat16)[::2]
    with pytest.raises(ValueError, match="not one contiguous run"):
        chunk_bytes(tensor_obj(strided, shape, torch.bfloat16))
