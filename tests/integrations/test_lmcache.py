"""Strata as LMCache's remote storage, through a real LMCacheEngine on CPU.

The engine is LMCache's own (``LMCacheEngineBuilder``, its storage manager,
its RemoteBackend loading the plugin from config); only the GPU side is
replaced by a connector that copies to and from a CPU tensor, so what
comes back can be compared byte for byte with what went in. Daemons are
real: in-process on a real port, or ``strata serve`` child processes that
are restarted and killed. The engine itself is
tests/support/lmcache_engine.py; engines of other processes run it as
``python -m tests.support.lmcache_engine store|retrieve ...`` with a fixed
PYTHONHASHSEED, as LMCache's token hashing without vLLM requires.

Skipped when lmcache is not installed (``pip install -e ".[test,lmcache]"``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lmcache")

import torch  # noqa: E402  (lmcache brings torch)
from lmcache.utils import CacheEngineKey, LayerCacheEngineKey  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402

from benchmarks.harness import free_port  # noqa: E402
from kvstore import Client  # noqa: E402
from kvstore.block import validate_namespace  # noqa: E402
from kvstore.integrations.lmcache import (  # noqa: E402
    ChunkLayout,
    PluginSettings,
    StrataAdapter,
    StrataConnector,
    block_key,
    cache_key,
    namespace_of,
)
from tests.support.lmcache_engine import (  # noqa: E402
    CHUNK, CHUNKS, HEAD_SIZE, HEADS, LAYERS, MODEL, TOKENS, Engine, kv_source, lmcache_config, same_bytes, token_ids,
    wait_for_blocks,
)
from tests.support.wait import wait_until  # noqa: E402

pytestmark = pytest.mark.system

REPO = Path(__file__).resolve().parents[2]

# ---- mapping: keys, namespaces, layouts, settings ------------------------------


@pytest.mark.parametrize(
    "key",
    [
        CacheEngineKey(MODEL, 2, 1, 0x1234ABCD, torch.bfloat16),
        CacheEngineKey(MODEL, 1, 0, -5, torch.float16, {"lmcache.tag.user": "alice", "lmcache.tag.x": "1"}),
        CacheEngineKey(MODEL, 1, 0, 2**63 - 1, torch.float8_e4m3fn),
        LayerCacheEngineKey(MODEL, 1, 0, 77, torch.bfloat16, layer_id=5),
    ],
    ids=["plain", "tags", "fp8", "layer"],
)
def test_block_keys_map_back_to_the_same_lmcache_key(key):
    mapped = block_key(key)
    assert cache_key(mapped) == key
    assert type(cache_key(mapped)) is type(key)


def test_namespace_is_the_model_name_or_a_safe_stand_in():
    assert namespace_of("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"
    odd = namespace_of("my model (v2)")
    assert odd != namespace_of("my model (v3)")
    validate_namespace(odd)  # the stand-in is a namespace Strata accepts


def test_layout_round_trips_and_rejects_foreign_blocks():
    layout = ChunkLayout((torch.Size([2, 4, 232, 64]),), (torch.bfloat16,), MemoryFormat.KV_2LTD)
    assert ChunkLayout.decode(layout.encode()) == layout
    for foreign in ("", "bf16[2,32,16,128]", '{"v":"other"}'):
        with pytest.raises(ValueError):
            ChunkLayout.decode(foreign)


def test_settings_are_read_from_extra_config_and_checked():
    extra = {"remote_storage_plugin.kv.target": "10.0.0.5:50051", "remote_storage_plugin.kv.shared_memory": "false"}
    s = PluginSettings.from_extra_config(extra, "kv")
    assert (s.target, s.shared_memory, s.namespace) == ("10.0.0.5:50051", False, "")
    with pytest.raises(ValueError, match="unknown option"):
        PluginSettings.from_extra_config({"remote_storage_plugin.kv.tagret": "x"}, "kv")
    with pytest.raises(ValueError, match="shared_memory"):
        PluginSettings.from_extra_config({"remote_storage_plugin.kv.shared_memory": "maybe"}, "kv")


# ---- one engine, one daemon ------------------------------------------------------


@pytest.mark.parametrize("shared_memory", ["auto", "false"], ids=["shm", "stream"])
def test_engine_stores_and_retrieves_byte_for_byte(make_daemon, shared_memory):
    daemon = make_daemon()
    source = kv_source()
    with Engine(daemon.target, shared_memory=shared_memory) as e:
        e.store(source)
        wait_for_blocks(daemon.target, CHUNKS)
        assert e.lookup() == TOKENS
        retrieved, kv = e.retrieve()
        assert retrieved == TOKENS
        assert same_bytes(kv, source)
    with Client(daemon.target) as c:  # one block per chunk, its layout the MemoryObj's own
        blocks = c.get_many(MODEL, [block_key(k) for k in chunk_keys(e)])
    layouts = [ChunkLayout.decode(b.layout) for b in blocks]
    assert [s[0][2] for s in (lay.shapes for lay in layouts)] == [256, 256, 256, 232]


@pytest.mark.parametrize("shared_memory", ["auto", "false"], ids=["shm", "stream"])
def test_retrieve_allocates_each_chunk_once_in_its_own_shape(make_daemon, shared_memory):
    """The daemon names a block's layout before its bytes move, so every chunk, the short
    last one included, is read straight into one MemoryObj of its exact shape."""
    daemon = make_daemon()
    source = kv_source()
    with Engine(daemon.target, shared_memory=shared_memory) as e:
        e.store(source)
        wait_for_blocks(daemon.target, CHUNKS)
        counted = CountingAllocator(e.connector.local_cpu_backend)
        e.connector.local_cpu_backend = counted
        retrieved, kv = e.retrieve()
        assert retrieved == TOKENS and same_bytes(kv, source)
    assert [shape[2] for shape in counted.shapes] == [256, 256, 256, 232]


def test_list_names_every_chunk_the_daemon_holds(make_daemon):
    daemon = make_daemon()
    with Engine(daemon.target) as e:
        e.store(kv_source())
        wait_for_blocks(daemon.target, CHUNKS)
        with Client(daemon.target) as c:  # not an LMCache chunk: not listed
            c.put(namespace_of(MODEL), b"operator-note", b"x")
        conn = e.connector
        listed = asyncio.run_coroutine_threadsafe(conn.list(), conn.loop).result(timeout=30)
        assert sorted(listed) == sorted(k.to_string() for k in chunk_keys(e))
        assert {CacheEngineKey.from_string(k) for k in listed} == set(chunk_keys(e))


def test_connector_contracts_on_the_engines_cpu_backend(make_daemon):
    """put keeps the caller's reference; get returns objects of LMCache's allocator,
    one reference each; unknown keys and namespaces are misses."""
    daemon = make_daemon()
    with Engine(daemon.target) as e:
        backend = e.engine.storage_manager.local_cpu_backend
        conn = StrataConnector(asyncio.new_event_loop(), backend, e.engine.config)
        loop = conn.loop
        key = CacheEngineKey(MODEL, 1, 0, 42, torch.bfloat16)
        other = CacheEngineKey("never-written", 1, 0, 42, torch.bfloat16)
        obj = backend.allocate([torch.Size([2, LAYERS, 100, HEADS * HEAD_SIZE])], [torch.bfloat16])
        obj.tensor.copy_(kv_source()[:, :, :100])
        try:
            assert loop.run_until_complete(conn.get(other)) is None  # UnknownNamespace: a miss
            loop.run_until_complete(conn.put(key, obj))
            assert obj.get_ref_count() == 1
            assert loop.run_until_complete(conn.exists(key)) and conn.exists_sync(key)
            got = loop.run_until_complete(conn.get(key))
            assert got is not None and got.get_ref_count() == 1
            assert got.get_shapes() == obj.get_shapes() and got.get_memory_format() == obj.get_memory_format()
            assert same_bytes(got.tensor, obj.tensor)
            got.ref_count_down()
            objs = loop.run_until_complete(conn.batched_get_non_blocking("l", [key, other, key]))
            assert len(objs) == 1
            objs[0].ref_count_down()
            assert loop.run_until_complete(conn.list()) == [key.to_string()]
            assert conn.remove_sync(key) and not conn.exists_sync(key)
        finally:
            obj.ref_count_down()
            loop.run_until_complete(conn.close())
            loop.close()


def test_chunks_stored_through_lmcache_are_found_in_the_shared_prefix_index(make_daemon, redis_url):
    """Another node asks the Redis index who holds a sequence's chunks (a P/D handoff or
    a router) and is told the node the engine stored them on."""
    holder = make_daemon(node_id="prefill-0", index_url=redis_url)
    other = make_daemon(node_id="decode-0", index_url=redis_url)
    with Engine(holder.target) as e:
        e.store(kv_source())
        wait_for_blocks(holder.target, CHUNKS)
        keys = [block_key(k) for k in chunk_keys(e)]
    with Client(other.target) as c:
        def holders():
            return [[h.node_id for h in hs] for hs in c.holders(namespace_of(MODEL), keys=keys)]

        wait_until(lambda: holders() == [["prefill-0"]] * CHUNKS, what="the chunks to be published to the index")
        [best, *_] = c.score(namespace_of(MODEL), keys=keys)
        assert (best.node_id, best.blocks) == ("prefill-0", CHUNKS)


# ---- several Strata entries in one LMCache config --------------------------------


def test_two_strata_entries_each_use_their_own_target_and_namespace(make_daemon):
    """remote_storage_plugins: ["strata.local", "strata.remote"]: two connectors, each with its
    own entry's options, each storing every chunk on its own daemon in its own namespace."""
    local, remote = make_daemon(), make_daemon()
    entries = {
        "strata.local": dict(target=local.target, namespace="kv-local"),
        "strata.remote": dict(target=remote.target, namespace="kv-remote", shared_memory="false"),
    }
    source = kv_source()
    with Engine(None, entries) as e:
        settings = {n: e.connector_of(n).settings for n in entries}
        assert {n: (s.target, s.namespace, s.shared_memory) for n, s in settings.items()} == {
            "strata.local": (local.target, "kv-local", None),
            "strata.remote": (remote.target, "kv-remote", False),
        }
        e.store(source)
        wait_for_blocks(local.target, CHUNKS, "kv-local")
        wait_for_blocks(remote.target, CHUNKS, "kv-remote")
        with Client(local.target) as c:
            assert c.stats().namespaces == ["kv-local"]
        with Client(remote.target) as c:
            assert c.stats().namespaces == ["kv-remote"]
        assert e.lookup() == TOKENS
        retrieved, kv = e.retrieve()
        assert retrieved == TOKENS and same_bytes(kv, source)


def test_two_entries_of_the_plain_connector_class_are_refused_with_the_fix(make_daemon, caplog):
    """class_name StrataConnector is built by LMCache without its entry's name: with two Strata
    entries no connector is made (LMCache logs why and serves misses) rather than two that
    silently share the first entry's settings."""
    local, remote = make_daemon(), make_daemon()
    entries = {
        "strata.local": dict(target=local.target, class_name="StrataConnector"),
        "strata.remote": dict(target=remote.target, class_name="StrataConnector"),
    }
    with Engine(None, entries) as e:
        assert [e.connector_of(n) for n in entries] == [None, None]
        e.store(kv_source())
        assert e.lookup() == 0
    assert "class_name: StrataAdapter on every Strata entry" in caplog.text
    with pytest.raises(ValueError, match="StrataAdapter"):
        StrataConnector(config=lmcache_config(None, entries))


def test_one_entry_of_the_plain_connector_class_still_works(make_daemon):
    daemon = make_daemon()
    with Engine(daemon.target, class_name="StrataConnector", namespace="plain") as e:
        assert (e.connector.settings.target, e.connector.plugin_name) == (daemon.target, "strata")
        e.store(kv_source())
        wait_for_blocks(daemon.target, CHUNKS, "plain")
        assert e.lookup() == TOKENS


def test_the_adapter_claims_only_strata_entries():
    adapter = StrataAdapter()
    assert [adapter.can_parse(u) for u in ("plugin://strata", "plugin://strata.a", "plugin://stratax", "plugin://fs",
                                           "plugin://fs.strata", "strata://x")] == [True, True, False, False, False, False]


# ---- other processes, restarts, a daemon that is gone ----------------------------


@pytest.mark.slow  # two fresh processes importing lmcache (seconds each)
def test_second_process_retrieves_after_daemon_restart(daemon_process):
    daemon = daemon_process()
    assert run_engine("store", daemon.target)["stored"] == CHUNKS
    assert daemon.kill(signal.SIGTERM) == 0  # a clean stop writes RAM blocks to disk
    daemon.start()
    result = run_engine("retrieve", daemon.target)
    assert result == {"lookup": TOKENS, "retrieved": TOKENS, "same_bytes": True}


@pytest.mark.slow
def test_sigkilled_daemon_loses_at_most_a_suffix_and_never_returns_torn_bytes(daemon_process):
    daemon = daemon_process()
    assert run_engine("store", daemon.target)["stored"] == CHUNKS
    daemon.kill(signal.SIGKILL)  # what was only in RAM is gone; what was demoted survives
    daemon.start()
    result = run_engine("retrieve", daemon.target)
    assert result["same_bytes"] and (result["retrieved"] % CHUNK == 0 or result["retrieved"] == TOKENS)


@pytest.mark.timeout(60)
def test_daemon_down_is_a_miss_nothing_hangs_and_close_returns(daemon_process):
    daemon = daemon_process()
    source = kv_source()
    e = Engine(daemon.target)
    try:
        e.store(source)
        wait_for_blocks(daemon.target, CHUNKS)
        daemon.kill(signal.SIGKILL)
        assert e.lookup() == 0  # LMCache recomputes
        assert e.retrieve()[0] == 0
        e.store(source)  # dropped, not raised, not queued forever
        assert e.lookup() == 0  # answered from the backoff, without calling the daemon
    finally:
        e.close()  # returns: the connector's close() does not wait for a daemon


@pytest.mark.timeout(60)
def test_engine_started_without_a_daemon_serves_misses(tmp_path):
    with Engine(f"127.0.0.1:{free_port()}") as e:
        e.store(kv_source())
        assert e.lookup() == 0
        assert e.retrieve()[0] == 0


# ---- helpers -------------------------------------------------------------------


class CountingAllocator:
    """LMCache's CPU backend, recording the shape of each allocation made through it."""

    def __init__(self, backend) -> None:
        self._backend = backend
        self.shapes: list[tuple[int, ...]] = []

    def allocate(self, shapes, dtypes, fmt=None, **kwargs):
        self.shapes += [tuple(s) for s in shapes]
        return self._backend.allocate(shapes, dtypes, fmt, **kwargs)

    def __getattr__(self, name):
        return getattr(self._backend, name)


def chunk_keys(e: Engine) -> list[CacheEngineKey]:
    return [key for _, _, key in e.engine.token_database.process_tokens(token_ids())]


def run_engine(action: str, target: str) -> dict:
    """Run an engine in a fresh process (fixed PYTHONHASHSEED) and return what it reports."""
    env = dict(os.environ, PYTHONHASHSEED="0", LMCACHE_TRACK_USAGE="false", NO_PROXY="127.0.0.1,localhost")
    out = subprocess.run(
        [sys.executable, "-m", "tests.support.lmcache_engine", action, target],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_names_an_entry_is_recognised_by_are_the_real_module_and_classes():
    from kvstore.integrations.lmcache import settings

    assert settings.PLUGIN_MODULE == StrataConnector.__module__.rpartition(".")[0]
    assert settings.CLASS_NAMES == (StrataConnector.__name__, StrataAdapter.__name__)
