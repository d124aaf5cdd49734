"""Strata as LMCache's remote storage: a ``RemoteConnector`` on Strata's client.

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

Bytes. On the daemon's host the client copies between LMCache's MemoryObj
buffers and the daemon's shared-memory arena, one copy each way; elsewhere
it streams over gRPC (the client's choice, not this module's). ``get``
learns each block's size and layout from the daemon before any byte moves,
allocates a MemoryObj of exactly that layout from ``local_cpu_backend``
(a short last chunk included) and has the bytes read straight into it.

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

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from lmcache.utils import STR_DTYPE_TO_TORCH_DTYPE, TORCH_DTYPE_TO_STR_DTYPE, CacheEngineKey, parse_cache_key
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext, extract_plugin_type
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvstore.block import MAX_KEY_BYTES, MAX_NAMESPACE_CHARS, validate_namespace
from kvstore.client import AsyncClient, BlockInfo, BlockPut, Client
from kvstore.errors import (
    CorruptBlock,
    DaemonUnavailable,
    DeadlineExceeded,
    InvalidNamespace,
    ResourceExhausted,
    StrataError,
    UnknownNamespace,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_PLUGIN_NAME = "strata"
PLUGIN_TYPE = "strata"  # entries "strata" and "strata.<instance>" are this plugin's (LMCache's naming)
LAYOUT_VERSION = "lmcache/1"
# Errors that say the daemon itself is gone or stuck (not a refusal of one call).
DAEMON_DOWN = (DaemonUnavailable, DeadlineExceeded)
# Errors after which a read is a miss: the daemon refused for now, or the bytes were bad.
READ_MISS = (ResourceExhausted, CorruptBlock)


# ---- settings ----------------------------------------------------------------


@dataclass(frozen=True)
class PluginSettings:
    """The plugin's options, read once from LMCache's ``extra_config``.

    ``namespace`` empty means one namespace per model (the key's model name).
    ``shared_memory``: ``auto`` maps the daemon's arena when it is on this
    host; ``false`` always streams; ``true`` requires the arena.
    """

    target: str = "127.0.0.1:50051"
    namespace: str = ""
    timeout_s: float = 2.0
    retries: int = 1
    shared_memory: bool | None = None
    down_backoff_s: float = 5.0
    token_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None

    @classmethod
    def from_extra_config(cls, extra: dict | None, plugin_name: str) -> PluginSettings:
        prefix = f"remote_storage_plugin.{plugin_name}."
        options = {k[len(prefix):]: v for k, v in (extra or {}).items() if k.startswith(prefix)}
        options.pop("module_path", None)
        options.pop("class_name", None)
        unknown = set(options) - {"target", "namespace", "timeout_s", "retries", "shared_memory", "down_backoff_s",
                                  *_SECURITY_OPTIONS}
        if unknown:
            raise ValueError(
                f"unknown option(s) {', '.join(prefix + u for u in sorted(unknown))}: the Strata plugin takes "
                "target, namespace, timeout_s, retries, shared_memory, down_backoff_s, " + ", ".join(_SECURITY_OPTIONS)
            )
        try:
            settings = cls(
                target=str(options.get("target", cls.target)),
                namespace=str(options.get("namespace", cls.namespace)),
                timeout_s=float(options.get("timeout_s", cls.timeout_s)),
                retries=int(options.get("retries", cls.retries)),
                shared_memory=_tristate(options.get("shared_memory", "auto")),
                down_backoff_s=float(options.get("down_backoff_s", cls.down_backoff_s)),
                **{k: str(options[k]) for k in _SECURITY_OPTIONS if options.get(k)},
            )
        except ValueError as err:
            raise ValueError(f"bad option under {prefix}*: {err}") from None
        if settings.timeout_s <= 0 or settings.down_backoff_s < 0 or not 0 <= settings.retries <= 5:
            raise ValueError(f"{prefix}timeout_s must be > 0, down_backoff_s >= 0 and retries 0..5")
        if settings.namespace:
            validate_namespace(settings.namespace)
        return settings


_SECURITY_OPTIONS = ("token_file", "tls_ca", "tls_cert", "tls_key", "tls_server_name")


def _tristate(value: Any) -> bool | None:
    text = str(value).strip().lower()
    if text in ("auto", "", "none"):
        return None
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"shared_memory is {value!r}; use auto, true or false")


def strata_entries(config) -> list[str]:
    """The ``remote_storage_plugins`` entries that load this module."""
    extra = getattr(config, "extra_config", None) or {}
    return [
        name
        for name in getattr(config, "remote_storage_plugins", None) or []
        if extra.get(f"remote_storage_plugin.{name}.module_path") == __name__
        or extra.get(f"remote_storage_plugin.{name}.class_name") in (StrataConnector.__name__, StrataAdapter.__name__)
    ]


def plugin_name_of(config, cls: type) -> str:
    """The entry a connector built without a name serves: the config's only Strata entry.

    LMCache builds a plain ``RemoteConnector`` class with ``cls(loop,
    local_cpu_backend, config)`` and does not say which entry it serves. With one
    Strata entry that is the one; with several it cannot be known, and guessing
    would give every entry the first one's target and namespace.
    """
    entries = strata_entries(config)
    if len(entries) > 1:
        raise ValueError(_ambiguous(entries))
    return entries[0] if entries else DEFAULT_PLUGIN_NAME


def _ambiguous(entries: list[str]) -> str:
    return (
        f"remote_storage_plugins has {len(entries)} Strata entries ({', '.join(entries)}) but LMCache builds "
        f"class_name {StrataConnector.__name__} without saying which entry it is for: set "
        f"remote_storage_plugin.<name>.class_name: {StrataAdapter.__name__} on every Strata entry, and name them "
        f"{PLUGIN_TYPE} or {PLUGIN_TYPE}.<instance> (e.g. {PLUGIN_TYPE}.local, {PLUGIN_TYPE}.remote)"
    )


# ---- keys and layouts --------------------------------------------------------

_NAMESPACE_BAD = re.compile(r"[^A-Za-z0-9._:/@+=-]")


def namespace_of(model_name: str) -> str:
    """The Strata namespace of a model: its name where Strata accepts it, else a
    readable and collision-free stand-in (bad characters replaced, a digest appended)."""
    try:
        return validate_namespace(model_name)
    except InvalidNamespace:
        pass
    digest = hashlib.blake2b(model_name.encode(), digest_size=6).hexdigest()
    readable = _NAMESPACE_BAD.sub("-", model_name).lstrip("._:/@+=-")[: MAX_NAMESPACE_CHARS - 14]
    return f"{readable or 'model'}-{digest}"


def block_key(key: CacheEngineKey) -> bytes:
    """The Strata key of a LMCache chunk: its string form, lossless.

    A key longer than Strata's limit (only with very long request tags)
    becomes ``#`` plus a 32-byte digest of it: still collision-free, but
    :func:`cache_key` cannot invert it.
    """
    text = key.to_string().encode()
    if len(text) <= MAX_KEY_BYTES:
        return text
    return b"#" + hashlib.blake2b(text, digest_size=32).digest()


def cache_key(key: bytes) -> CacheEngineKey:
    """Invert :func:`block_key`."""
    if key.startswith(b"#"):
        raise ValueError("this block key is a digest of a long LMCache key and cannot be inverted")
    return parse_cache_key(key.decode())


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """What ``local_cpu_backend.allocate`` needs to rebuild a MemoryObj."""

    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    fmt: MemoryFormat

    @classmethod
    def of(cls, obj: MemoryObj) -> ChunkLayout:
        meta = obj.meta
        shapes = meta.shapes if meta.shapes else [meta.shape]
        dtypes = meta.dtypes if meta.dtypes else [meta.dtype]
        if any(d not in TORCH_DTYPE_TO_STR_DTYPE for d in dtypes):
            raise ValueError(f"MemoryObj dtypes {dtypes} cannot be described; the Strata plugin stores tensor chunks only")
        return cls(tuple(torch.Size(s) for s in shapes), tuple(dtypes), obj.get_memory_format())

    def encode(self) -> str:
        return json.dumps(
            {
                "v": LAYOUT_VERSION,
                "fmt": self.fmt.name,
                "shapes": [list(s) for s in self.shapes],
                "dtypes": [TORCH_DTYPE_TO_STR_DTYPE[d] for d in self.dtypes],
            },
            separators=(",", ":"),
        )

    @classmethod
    def decode(cls, text: str) -> ChunkLayout:
        """Raise ValueError for a block this plugin did not write."""
        try:
            d = json.loads(text)
            if d.get("v") != LAYOUT_VERSION:
                raise ValueError(f"layout version {d.get('v')!r}, expected {LAYOUT_VERSION!r}")
            return cls(
                tuple(torch.Size(s) for s in d["shapes"]),
                tuple(STR_DTYPE_TO_TORCH_DTYPE[x] for x in d["dtypes"]),
                MemoryFormat[d["fmt"]],
            )
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"not a LMCache chunk layout: {err!r}") from None


# ---- the daemon's reachability ------------------------------------------------


class DaemonHealth:
    """Whether to call the daemon at all.

    After a call finds the daemon unreachable or stuck, every call in the
    next ``backoff_s`` answers a miss at once: a dead sidecar must not cost
    LMCache a deadline per chunk, nor the daemon a retry storm when it
    comes back.
    """

    def __init__(self, backoff_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._backoff = backoff_s
        self._clock = clock
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.down = False

    def usable(self) -> bool:
        return self._clock() >= self._down_until

    def failed(self, err: StrataError, target: str) -> None:
        with self._lock:
            self._down_until = self._clock() + self._backoff
            if not self.down:
                log.warning("Strata daemon %s unreachable (%s); LMCache sees misses for the next %.1fs",
                            target, type(err).__name__, self._backoff)
            self.down = True

    def ok(self, target: str) -> None:
        if self.down:
            with self._lock:
                if self.down:
                    log.info("Strata daemon %s reachable again", target)
                self.down = False


# ---- the connector -----------------------------------------------------------


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

    def _client_options(self) -> dict:
        s = self.settings
        return dict(timeout=s.timeout_s, retries=s.retries, use_shm=s.shared_memory,
                    **{k: getattr(s, k) for k in _SECURITY_OPTIONS})

    def _async_client(self) -> AsyncClient:
        if self._aio is None:  # made inside LMCache's loop: grpc.aio binds to it
            self._aio = AsyncClient(self.settings.target, **self._client_options())
        return self._aio

    def _sync_client(self) -> Client:
        with self._sync_lock:
            if self._sync is None:
                self._sync = Client(self.settings.target, **self._client_options())
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

        A full tier or an overloaded daemon drops the chunks (a cache may
        decline to store); a bad chunk (over the daemon's block limit)
        raises, so LMCache logs it.
        """
        if not keys or not self._usable():
            return
        client = self._async_client()
        for namespace, run in _namespace_runs(list(zip(keys, memory_objs)), lambda kv: self._namespace(kv[0])):
            items = [BlockPut(block_key(k), obj.byte_array, None, ChunkLayout.of(obj).encode()) for k, obj in run]
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
        chunk included), and the bytes are copied into it once."""
        client = self._async_client()
        objs: list[MemoryObj | None] = [None] * len(keys)

        def place(i: int, info: BlockInfo):
            obj = objs[i]
            if obj is None:  # a retried read lands in the same MemoryObj
                obj = objs[i] = self._allocate_for(keys[i], info)
            return None if obj is None else obj.byte_array

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
            raise ValueError(_ambiguous(entries))  # the plain entries would get no name; refuse them all alike
        return StrataConnector(
            loop=context.loop,
            local_cpu_backend=context.local_cpu_backend,
            config=context.config,
            metadata=context.metadata,
            plugin_name=context.plugin_name or plugin_name_of(context.config, StrataConnector),
        )


# ---- helpers -------------------------------------------------------------------


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
