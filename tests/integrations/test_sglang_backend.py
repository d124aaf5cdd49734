"""Strata as SGLang's HiCache L3 storage backend, against SGLang's real storage classes on CPU.

SGLang's own ``StorageBackendFactory`` builds the backend from the dynamic
config (``backend_name`` / ``module_path`` / ``class_name``), with SGLang's
real ``HiCacheStorageConfig`` and, where a test asks for faults, SGLang's
own ``HiCacheStorageFailureInjector`` around it (switched on by SGLang's own
environment variable). The host pool is the smallest stand-in the code
allows (``tests/support/sglang_pool.py`` says why and what it mirrors). The
calls are made as SGLang's cache controller makes them: ``batch_exists``,
then ``batch_get_v1`` into freshly allocated host pages, and
``batch_set_v1`` from written ones, with ``HiCacheStorageExtraInfo``'s
prefix keys. Daemons are real, in-process on a real port.

Skipped when sglang is not installed (tests/install.py installs it; see
docs/integrations/sglang.md).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (tests/install.py installs its CPU build)")

from tests.support.sglang_pool import MlaPool, PageFirstPool, page_hashes, sglang_storage  # noqa: E402

storage, factory = sglang_storage()  # skips, saying why, when sglang is not installed

from kvstore import Client  # noqa: E402
from kvstore.block import BlockKey  # noqa: E402
from kvstore.integrations.sglang import (  # noqa: E402
    BACKEND_NAME, CLASS_NAME, MODULE_PATH, StrataHiCacheStorage, StrataStorageSettings, piece_key,
)

pytestmark = pytest.mark.system

FAST = dict(timeout_s=1.0, down_backoff_s=0.3, retries=0)


def extra_config(target: str, **options) -> dict:
    return {"backend_name": BACKEND_NAME, "module_path": MODULE_PATH, "class_name": CLASS_NAME,
            "interface_v1": 1, "strata": dict(FAST, target=target, **options)}


def storage_config(target: str, *, tp_rank=0, tp_size=1, mla=False, model="org/Model-7B", **options):
    return storage.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True, model_name=model,
        extra_config=extra_config(target, **options),
    )


def attach(config, pool):
    """What SGLang's controller does in ``attach_storage_backend``."""
    backend = factory.StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def info(prefix=None):
    return storage.HiCacheStorageExtraInfo(prefix_keys=prefix)


# ---- options ---------------------------------------------------------------------------------


def test_options_are_checked_and_errors_name_the_fix():
    s = StrataStorageSettings.from_extra_config({"interface_v1": 1, "strata": {"target": "10.0.0.5:50051",
                                                                                "shared_memory": "false"}})
    assert (s.target, s.shared_memory, s.namespace) == ("10.0.0.5:50051", False, "sglang")
    assert StrataStorageSettings.from_extra_config({"backend_name": "strata"}) == StrataStorageSettings()
    with pytest.raises(ValueError, match="unknown option.*tagret.*it takes:.*target"):
        StrataStorageSettings.from_extra_config({"strata": {"tagret": "x"}})
    with pytest.raises(ValueError, match="namespace is a prefix of at most"):
        StrataStorageSettings.from_extra_config({"strata": {"namespace": "n" * 60}})
    config = storage_config("127.0.0.1:1")
    del config.extra_config["interface_v1"]
    with pytest.raises(ValueError, match='add "interface_v1": 1'):
        factory.StorageBackendFactory.create_backend("dynamic", config, None)


# ---- the factory, round trips, prefix chains -------------------------------------------------


def test_sglangs_factory_builds_the_backend_and_pages_round_trip_in_place(make_daemon):
    daemon = make_daemon()
    pool = PageFirstPool(pages=16)
    backend = attach(storage_config(daemon.target), pool)
    assert type(backend) is StrataHiCacheStorage and isinstance(backend, storage.HiCacheStorage)
    keys = page_hashes(6)
    written = [pool.fill(p, seed=p) for p in range(6)]
    assert backend.batch_exists(keys, info()) == 0
    assert backend.batch_set_v1(keys[:4], pool.indices([0, 1, 2, 3]), info([])) == [True] * 4
    assert backend.batch_set_v1(keys[4:], pool.indices([4, 5]), info(keys[:4])) == [True, True]
    assert backend.batch_exists(keys, info()) == 6
    assert backend.batch_exists(keys + page_hashes(2, "other"), info()) == 6  # the leading run

    # Loaded into other host pages, as a prefetch into freshly allocated ones.
    assert backend.batch_get_v1(keys, pool.indices([10, 11, 12, 13, 14, 15]), info()) == [True] * 6
    assert [pool.page_bytes(10 + p) for p in range(6)] == written

    # Each page is its K and V pieces; the call's prefix keys became the first page's parents.
    with Client(daemon.target, use_shm=False) as c:
        listed = {b.key: b for b in c.iter_blocks(backend.layout.namespace)}
    assert len(listed) == 12 and {b.size for b in listed.values()} == {len(written[0]) // 2}
    assert listed[piece_key(keys[4], 1)].parent == piece_key(keys[3], 1)
    assert listed[piece_key(keys[0], 0)].parent is None
    assert backend.counts["got"] == 6
    assert backend.client().transport_for(backend.layout.namespace) == "same-host"  # through the arena
    backend.close()


def test_exists_asks_one_piece_a_page_and_get_still_checks_every_piece(make_daemon):
    """batch_exists asks each page's last piece only; a page whose other piece went first is found, and then
    batch_get_v1 misses it (it verifies every piece), never a page with bytes missing."""
    daemon = make_daemon()
    pool = PageFirstPool(pages=6)
    backend = attach(storage_config(daemon.target), pool)
    keys = page_hashes(3)
    for p in range(3):
        pool.fill(p, seed=30 + p)
    backend.batch_set_v1(keys, pool.indices([0, 1, 2]), info())
    with Client(daemon.target) as c:
        assert c.delete(backend.layout.namespace, [piece_key(keys[1], 0)]) == 1  # page 1's K piece only
    assert backend.batch_exists(keys, info()) == 3
    assert backend.batch_get_v1(keys, pool.indices([3, 4, 5]), info()) == [True, False, True]
    assert pool.page_bytes(3) == pool.page_bytes(0)
    backend.close()


def test_exists_counts_the_leading_run_and_get_answers_per_page(make_daemon):
    daemon = make_daemon()
    pool = PageFirstPool(pages=8)
    backend = attach(storage_config(daemon.target), pool)
    keys = page_hashes(4)
    for p in range(4):
        pool.fill(p, seed=10 + p)
    backend.batch_set_v1([keys[0], keys[1], keys[3]], pool.indices([0, 1, 3]), info())
    assert backend.batch_exists(keys, info()) == 2
    assert backend.batch_get_v1(keys, pool.indices([4, 5, 6, 7]), info()) == [True, True, False, True]
    assert pool.page_bytes(6) == bytes(len(pool.page_bytes(6)))  # the missing page's host page is untouched
    assert pool.page_bytes(7) == pool.page_bytes(3)
    backend.close()


def test_another_geometry_is_a_miss_and_the_same_one_shares(make_daemon):
    daemon = make_daemon()
    pool = PageFirstPool(pages=4)
    writer = attach(storage_config(daemon.target), pool)
    keys = page_hashes(2)
    pool.fill(0, 1), pool.fill(1, 2)
    assert writer.batch_set_v1(keys, pool.indices([0, 1]), info()) == [True, True]

    same = attach(storage_config(daemon.target), PageFirstPool(pages=4))
    assert same.layout.namespace == writer.layout.namespace and same.batch_exists(keys) == 2
    others = {
        "more heads": (storage_config(daemon.target), PageFirstPool(pages=4, head_num=4)),
        "another page size": (storage_config(daemon.target), PageFirstPool(pages=4, page_size=8)),
        "another dtype": (storage_config(daemon.target), PageFirstPool(pages=4, dtype=torch.float16)),
        "another TP rank": (storage_config(daemon.target, tp_rank=1, tp_size=2), PageFirstPool(pages=4)),
        "another model": (storage_config(daemon.target, model="org/Other"), PageFirstPool(pages=4)),
    }
    for what, (config, other_pool) in others.items():
        other = attach(config, other_pool)
        assert other.layout.namespace != writer.layout.namespace, what
        assert other.batch_exists(keys) == 0, what
        assert other.batch_get_v1(keys, other_pool.indices([2, 3]), info()) == [False, False], what
        other.close()
    same.close(), writer.close()


def test_mla_pages_are_written_once_by_the_storage_writer_and_read_by_every_rank(make_daemon):
    daemon = make_daemon()
    pools = [MlaPool(pages=4) for _ in range(2)]
    ranks = [attach(storage_config(daemon.target, tp_rank=r, tp_size=2, mla=True), pools[r]) for r in (0, 1)]
    assert [b.storage_config.is_storage_writer for b in ranks] == [True, False]
    assert ranks[0].layout.namespace == ranks[1].layout.namespace  # replicated KV: one namespace
    keys = page_hashes(2)
    for pool in pools:
        pool.fill(0, 7), pool.fill(1, 8)
    assert ranks[1].batch_set_v1(keys, pools[1].indices([0, 1]), info()) == [True, True]
    assert ranks[1].batch_exists(keys) == 0  # the reader stored nothing
    assert ranks[0].batch_set_v1(keys, pools[0].indices([0, 1]), info()) == [True, True]
    assert ranks[1].batch_get_v1(keys, pools[1].indices([2, 3]), info()) == [True, True]
    assert pools[1].page_bytes(2) == pools[0].page_bytes(0)
    for b in ranks:
        b.close()


# ---- failures cost misses, never wrong bytes, never an exception ------------------------------------


def test_a_corrupted_block_is_a_miss_and_its_page_is_never_reported_loaded(make_daemon):
    daemon = make_daemon()
    pool = PageFirstPool(pages=6)
    backend = attach(storage_config(daemon.target), pool)
    keys = page_hashes(3)
    written = [pool.fill(p, 20 + p) for p in range(3)]
    backend.batch_set_v1(keys, pool.indices([0, 1, 2]), info())
    offset, meta = daemon.store.head.locate(BlockKey(backend.layout.namespace, piece_key(keys[1], 1)))
    view = daemon.store.head.view(offset, meta.size)
    view[0] ^= 0xFF
    view.release()
    got = backend.batch_get_v1(keys, pool.indices([3, 4, 5]), info())
    assert got == [True, False, True]  # page 1 is a miss; SGLang takes the leading run, page 0
    assert pool.page_bytes(3) == written[0] and pool.page_bytes(5) == written[2]
    assert backend.counts["get:corrupt"] == 1
    assert backend.batch_exists(keys, info()) == 1  # the daemon dropped the bad block
    # The daemon serves on; the page stored again loads byte for byte.
    backend.batch_set_v1(keys[1:2], pool.indices([1]), info(keys[:1]))
    assert backend.batch_get_v1(keys, pool.indices([3, 4, 5]), info()) == [True] * 3
    assert [pool.page_bytes(3 + p) for p in range(3)] == written
    backend.close()


def test_sglangs_failure_injector_around_the_backend_never_yields_wrong_bytes(make_daemon, monkeypatch):
    daemon = make_daemon()
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    pool = PageFirstPool(pages=16)
    backend = attach(storage_config(daemon.target), pool)
    assert isinstance(backend, storage.HiCacheStorageFailureInjector)
    keys = page_hashes(8)
    written = [pool.fill(p, 40 + p) for p in range(8)]
    stored = failures = 0
    for _ in range(80):  # each call fails with probability 0.3: both outcomes are seen long before 80
        results = backend.batch_set_v1(keys, pool.indices(list(range(8))), info())
        stored += all(results)
        failures += not any(results)
        if stored and failures:
            break
    assert stored and failures
    for _ in range(10):
        for p in range(8, 16):
            pool.kv_buffer[:, p * pool.page_size:(p + 1) * pool.page_size] = 0
        hits = backend.batch_exists(keys, info())
        got = backend.batch_get_v1(keys[:hits], pool.indices(list(range(8, 8 + hits))), info())
        for p, ok in enumerate(got):
            if ok:
                assert pool.page_bytes(8 + p) == written[p]
    backend.close()


def test_no_daemon_every_call_misses_at_once_and_raises_nothing():
    from benchmarks.harness import free_port

    pool = PageFirstPool(pages=4)
    backend = attach(storage_config(f"127.0.0.1:{free_port()}"), pool)
    keys = page_hashes(2)
    assert backend.batch_exists(keys, info()) == 0
    assert backend.batch_set_v1(keys, pool.indices([0, 1]), info()) == [False, False]
    assert backend.batch_get_v1(keys, pool.indices([2, 3]), info()) == [False, False]
    assert backend.counts["exists:down"] == 2  # the first call found it down: the rest backed off
    assert backend.counts["set:down"] == 2 and backend.counts["get:down"] == 2
    backend.close()


def test_pages_the_pool_does_not_hold_are_refused_not_written():
    pool = PageFirstPool(pages=2)
    backend = attach(storage_config("127.0.0.1:1"), pool)
    beyond = torch.arange(pool.size, pool.size + pool.page_size, dtype=torch.int64)
    assert backend.batch_get_v1(page_hashes(1), beyond, info()) == [False]
    assert backend.counts["get:pages"] == 1
    assert backend.batch_get_v1(page_hashes(2), pool.indices([0]), info()) == [False, False]  # too few indices
    backend.close()


def test_hybrid_models_pool_calls_answer_misses():
    backend = attach(storage_config("127.0.0.1:1"), PageFirstPool(pages=2))
    transfer = storage.PoolTransfer(name=storage.PoolName.MAMBA, keys=page_hashes(2))
    assert backend.batch_exists_v2(page_hashes(2), [transfer]).kv_hit_pages == 0
    assert backend.batch_get_v2([transfer]) == {storage.PoolName.MAMBA: [False, False]}
    assert backend.batch_set_v2([transfer]) == {storage.PoolName.MAMBA: [False, False]}
    backend.close()


def test_strata_failures_answer_misses_by_reason_and_a_bug_reaches_the_controller():
    """What a call can meet (a refusal, a full daemon) is a counted miss; anything else is a bug, which
    the backend does not hide: it raises into SGLang's controller, which logs it and counts a miss."""
    from kvstore.errors import InvalidArgument, ResourceExhausted

    class Failing:
        def __init__(self, error):
            self.error = error

        def __call__(self, target, **options):
            return self

        def exists(self, namespace, keys, *args):
            raise self.error

        put_many = get_into = exists

        def close(self):
            pass

    pool = PageFirstPool(pages=4)
    keys = page_hashes(2)
    for error, reason in ((InvalidArgument("refused"), "refused"), (ResourceExhausted("full", retry_after_s=1), "full")):
        backend = StrataHiCacheStorage(storage_config("127.0.0.1:1"), client_factory=Failing(error))
        backend.register_mem_pool_host(pool)
        assert backend.batch_exists(keys, info()) == 0
        assert backend.batch_set_v1(keys, pool.indices([0, 1]), info()) == [False, False]
        assert backend.batch_get_v1(keys, pool.indices([2, 3]), info()) == [False, False]
        assert {k: v for k, v in backend.counts.items() if v} == \
            {f"exists:{reason}": 2, f"set:{reason}": 2, f"get:{reason}": 2}
    backend = StrataHiCacheStorage(storage_config("127.0.0.1:1"), client_factory=Failing(TypeError("a bug")))
    backend.register_mem_pool_host(pool)
    for call in (lambda: backend.batch_exists(keys, info()),
                 lambda: backend.batch_set_v1(keys, pool.indices([0, 1]), info()),
                 lambda: backend.batch_get_v1(keys, pool.indices([2, 3]), info())):
        with pytest.raises(TypeError, match="a bug"):
            call()
