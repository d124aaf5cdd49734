"""The connector LMCache calls, and the adapter that builds one per Strata entry (see the package docstring)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext, extract_plugin_type
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvstore.client import AsyncClient, BlockInfo, BlockPut, Client
from kvstore.errors import (
    CorruptBlock,
    ResourceExhausted,
    StrataError,
    UnknownNamespace,
)

from kvstore.integrations.health import DAEMON_DOWN, DaemonHealth
from kvstore.integrations.lmcache.mapping import ChunkLayout, block_key, chunk_bytes, namespace_of
from kvstore.integrations.lmcache.settings import (
    PLUGIN_TYPE,
    PluginSettings,
    ambiguous_entries,
    plugin_name_of,
    strata_entries,
)

log = logging.getLogger(__name__)


T = TypeVar("T")

# Errors that say the daemon itself is gone or stuck (not a refusal of one call).
# Errors after which a read is a miss: the daemon refused for now, or the bytes were bad.
READ_MISS = (ResourceExhausted, CorruptBlock)


class StrataConnector(RemoteConnector):
    """LMCache remote storage on a Strata daemon (see the module docstring).

    LMCache calls the coroutines on its storage event loop (``loop``) and
    ``exists_sync`` / ``batched_contains`` / ``remove_sync`` from its own
    threads; the first use an :class:`~kvstore.AsyncClient` made on that
    loop, the others a blocking :class:`~kvstore.Client`. Both are made on
    first use, so constructing the connector never touches the network.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None = None,
        local_cpu_backend=None,
        config=None,
        metadata=None,
        plugin_name: str | None = None,
    ) -> None:
        metadata = metadata if metadata is not None else getattr(local_cpu_backend, "metadata", None)
        if metadata is not None and config is not None:
            super().__init__(config, metadata)  # chunk geometry; reshape_partial_chunk needs it
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        name = plugin_name or plugin_name_of(config, type(self))
        self.plugin_name = name
        self.settings = PluginSettings.from_extra_config(getattr(config, "extra_config", None), name)
        self._health = DaemonHealth(self.settings.down_backoff_s)
        self._aio: AsyncClient | None = None
        self._sync: Client | None = None
        self._sync_lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"<StrataConnector {self.plugin_name} {self.settings.target}>"

    # ---- clients ---------------------------------------------------------------

    def _async_client(self) -> AsyncClient:
        if self._aio is None:  # made inside LMCache's loop: grpc.aio binds to it
            self._aio = AsyncClient(self.settings.target, **self.settings.client_options())
        return self._aio

    def _sync_client(self) -> Client:
        with self._sync_lock:
            if self._sync is None:
                self._sync = Client(self.settings.target, **self.settings.client_options())
            return self._sync

    def _namespace(self, key: CacheEngineKey) -> str:
        return self.settings.namespace or namespace_of(key.model_name)

    def _usable(self) -> bool:
        return not self._closed and self._health.usable()

    async def _guard(self, call, miss: T) -> T:
        """Run a daemon call; a miss instead when the daemon is down or the namespace unknown."""
        try:
            result = await call
        except UnknownNamespace:
            self._health.ok(self.settings.target)
            return miss
        except DAEMON_DOWN as err:
            self._health.failed(err, self.settings.target)
            return miss
        self._health.ok(self.settings.target)
        return result

    def _guard_sync(self, call: Callable[[], T], miss: T) -> T:
        try:
            result = call()
        except UnknownNamespace:
            return miss
        except DAEMON_DOWN as err:
            self._health.failed(err, self.settings.target)
            return miss
        self._health.ok(self.settings.target)
        return result

    # ---- lookups ---------------------------------------------------------------

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self.batched_async_contains("", [key]) == 1

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self.batched_contains([key]) == 1

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        """How many leading keys the daemon holds (LMCache chunks form a prefix chain)."""
        hits = 0
        for namespace, run in _namespace_runs(keys, self._namespace):
            if not self._usable():
                break
            tiers = self._guard_sync(lambda: self._sync_client().exists(namespace, [block_key(k) for k in run]), [])
            hits += len(tiers)
            if len(tiers) < len(run):
                break
        return hits

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """As :meth:`batched_contains`. ``pin`` is not honoured: LMCache never
        unpins remote backends, and a Strata pin needs an unpin or a lease."""
        hits = 0
        for namespace, run in _namespace_runs(keys, self._namespace):
            if not self._usable():
                break
            client = self._async_client()
            tiers = await self._guard(client.exists(namespace, [block_key(k) for k in run]), [])
            hits += len(tiers)
            if len(tiers) < len(run):
                break
        return hits

    # ---- writes ----------------------------------------------------------------

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        """Store chunks; the MemoryObjs' references stay the caller's.

        Each chunk goes to the client as a tensor over its MemoryObj's own
        memory (:func:`~kvstore.integrations.lmcache.mapping.chunk_bytes`):
        no copy here; the client reads it in place.

        A full tier or an overloaded daemon drops the chunks (a cache may
        decline to store); a bad chunk (over the daemon's block limit)
        raises, so LMCache logs it.
        """
        if not keys or not self._usable():
            return
        client = self._async_client()
        for namespace, run in _namespace_runs(list(zip(keys, memory_objs)), lambda kv: self._namespace(kv[0])):
            items = [BlockPut(block_key(k), chunk_bytes(obj), None, ChunkLayout.of(obj).encode()) for k, obj in run]
            try:
                await self._guard(client.put_many(namespace, items), None)
            except ResourceExhausted as err:
                log.warning("Strata daemon %s declined %d chunks: %s", self.settings.target, len(items), err)

    # ---- reads -----------------------------------------------------------------

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """One MemoryObj per key, None for each miss; each from ``local_cpu_backend.allocate``."""
        out: list[MemoryObj | None] = [None] * len(keys)
        if not keys or not self._usable():
            return out
        start = 0
        for namespace, run in _namespace_runs(keys, self._namespace):
            objs = await self._read(namespace, run)
            out[start:start + len(run)] = objs
            start += len(run)
        return out

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey]) -> list[MemoryObj]:
        """The leading chunks present, up to the first miss; the rest are given back."""
        objs = await self.batched_get(keys)
        hits = next((i for i, obj in enumerate(objs) if obj is None), len(objs))
        _release(objs[hits:])
        return objs[:hits]

    async def _read(self, namespace: str, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """Read blocks straight into MemoryObjs: the daemon names each found block's size
        and layout first, a MemoryObj of exactly that layout is allocated (a partial last
        chunk included), and the client reads the bytes into the tensor over its memory."""
        client = self._async_client()
        objs: list[MemoryObj | None] = [None] * len(keys)
        views: list[object | None] = [None] * len(keys)  # the tensor placed per key

        def place(i: int, info: BlockInfo):
            if objs[i] is None:  # a retried read is placed in the same MemoryObj, as the same tensor
                obj = objs[i] = self._allocate_for(keys[i], info)
                views[i] = None if obj is None else chunk_bytes(obj)
            return views[i]

        try:
            blocks = await self._guard(client.get_into(namespace, [block_key(k) for k in keys], place), None)
        except READ_MISS as err:
            log.warning("Strata read of %d chunks failed (%s): misses", len(keys), err)
            blocks = None
        except BaseException:
            _release(objs)
            raise
        if blocks is None:
            _release(objs)
            return [None] * len(keys)
        out: list[MemoryObj | None] = []
        for obj, block in zip(objs, blocks):
            if block is None:
                _release([obj])  # placed, then not delivered
                out.append(None)
            else:
                out.append(obj)
        return out

    def _allocate_for(self, key: CacheEngineKey, info: BlockInfo) -> MemoryObj | None:
        """A MemoryObj for one block, from its layout; None (a miss) when it cannot be had."""
        try:
            layout = ChunkLayout.decode(info.layout)
        except ValueError as err:
            log.warning("Strata block %s is not a LMCache chunk (%s); treating it as a miss", key.to_string(), err)
            return None
        obj = self.local_cpu_backend.allocate(list(layout.shapes), list(layout.dtypes), layout.fmt, busy_loop=False)
        if obj is None:
            log.debug("no local CPU memory for chunk %s: miss", key.to_string())
            return None
        if obj.get_size() != info.size:
            log.warning("Strata block %s holds %d bytes but its layout %s needs %d: miss",
                        key.to_string(), info.size, info.layout, obj.get_size())
            _release([obj])
            return None
        return obj

    # ---- the rest of the interface --------------------------------------------

    def remove_sync(self, key: CacheEngineKey) -> bool:
        if not self._usable():
            return False
        namespace, skey = self._namespace(key), block_key(key)
        return self._guard_sync(lambda: self._sync_client().delete(namespace, [skey]), 0) > 0

    async def list(self) -> list[str]:
        """The key strings (``CacheEngineKey.to_string()``) of every LMCache chunk the daemon
        holds: in the configured namespace, or in every namespace when there is one per model.
        Blocks that are not LMCache chunks are left out; empty when the daemon is down."""
        if not self._usable():
            return []
        client = self._async_client()
        if self.settings.namespace:
            namespaces = [self.settings.namespace]
        else:
            stats = await self._guard(client.stats(), None)
            namespaces = [] if stats is None else stats.namespaces
        keys: list[str] = []
        for namespace in namespaces:
            listed = await self._guard(self._list_namespace(client, namespace), None)
            keys += listed or []
        return keys

    @staticmethod
    async def _list_namespace(client: AsyncClient, namespace: str) -> list[str]:
        keys = []
        async for block in client.iter_blocks(namespace):
            if block.key.startswith(b"#"):
                continue  # a digest of a long key: not invertible
            try:
                ChunkLayout.decode(block.layout)
            except ValueError:
                continue  # not written by this plugin
            keys.append(block.key.decode())
        return keys

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when the daemon answers; -2 (LMCache's generic ping error) otherwise."""
        if self._closed:
            return -2
        try:
            await self._async_client().stats()
        except StrataError as err:
            if isinstance(err, DAEMON_DOWN):
                self._health.failed(err, self.settings.target)
            return -2
        self._health.ok(self.settings.target)
        return 0

    async def close(self) -> None:
        """Close both clients; returns within about ``timeout_s`` even when the daemon is gone."""
        self._closed = True
        aio, self._aio = self._aio, None
        sync, self._sync = self._sync, None
        if aio is not None:
            try:
                await asyncio.wait_for(aio.close(), self.settings.timeout_s)
            except asyncio.TimeoutError:
                log.warning("closing the Strata client took over %.1fs; left to gRPC", self.settings.timeout_s)
        if sync is not None:
            await asyncio.to_thread(sync.close)


class StrataAdapter(ConnectorAdapter):
    """LMCache's adapter for Strata entries: each connector gets its own entry's options.

    LMCache makes one adapter per entry whose ``class_name`` names this class and asks
    each whether it can parse the backend's URL, ``plugin://<entry name>``; the first
    that can builds the connector from a context carrying the entry's name. The adapter
    claims the entries of type ``strata`` (``strata``, ``strata.<instance>``), as
    LMCache's own adapters claim theirs, so whichever adapter answers, the connector
    reads the options of the entry it serves.
    """

    def __init__(self) -> None:
        super().__init__(f"plugin://{PLUGIN_TYPE}")

    def can_parse(self, url: str) -> bool:
        scheme, sep, name = url.partition("://")
        return scheme == "plugin" and bool(sep) and extract_plugin_type(name) == PLUGIN_TYPE

    def create_connector(self, context: ConnectorContext) -> StrataConnector:
        entries = strata_entries(context.config)
        extra = getattr(context.config, "extra_config", None) or {}
        plain = [n for n in entries if extra.get(f"remote_storage_plugin.{n}.class_name") == StrataConnector.__name__]
        if len(entries) > 1 and plain:
            raise ValueError(ambiguous_entries(entries))  # the plain entries would get no name; refuse them all alike
        return StrataConnector(
            loop=context.loop,
            local_cpu_backend=context.local_cpu_backend,
            config=context.config,
            metadata=context.metadata,
            plugin_name=context.plugin_name or plugin_name_of(context.config, StrataConnector),
        )


def _namespace_runs(items: Sequence, namespace_of_item: Callable) -> list[tuple[str, list]]:
    """Consecutive items of one namespace, in order (all of them, for one model)."""
    runs: list[tuple[str, list]] = []
    for item in items:
        namespace = namespace_of_item(item)
        if runs and runs[-1][0] == namespace:
            runs[-1][1].append(item)
        else:
            runs.append((namespace, [item]))
    return runs


def _release(objs: Sequence[MemoryObj | None] | None) -> None:
    for obj in objs or ():
        if obj is not None:
            obj.ref_count_down()
