"""Strata as an L2 adapter of LMCache's server mode, driven as LMCache's controllers drive it.

The adapter is built through LMCache's own path: its ``--l2-adapter`` argument
parser and config registry, then ``create_l2_adapter`` (the plugin factory,
which imports the module and finds the config class by name). Objects come
from LMCache's own L1 memory manager (shared memory off), the ones the
server hands its adapters. Each task is submitted, its event fd waited on
with ``select`` and drained as the controllers do, and its result popped
or queried. Daemons are real (in process, on real ports; a ``strata serve``
child where one is killed).
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (tests/install.py installs its CPU build)")
pytest.importorskip("lmcache", reason="lmcache is not installed (tests/install.py installs it)")

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # noqa: E402
from lmcache.v1.distributed.config import L1MemoryManagerConfig  # noqa: E402
from lmcache.v1.distributed.memory_manager.l1_memory_manager import L1MemoryManager  # noqa: E402

from kvstore import Client  # noqa: E402
from kvstore.integrations.lmcache_mp import (  # noqa: E402
    CLASS_NAME, MODULE_PATH, L2Settings, StrataL2Adapter, StrataL2AdapterConfig,
)
from kvstore.integrations.lmcache_mp import keys as mp_keys  # noqa: E402
from kvstore.integrations.lmcache_mp.locks import LeaseBook  # noqa: E402
from tests.support import lmcache_l2  # noqa: E402
from tests.support.wait import wait_until  # noqa: E402

pytestmark = pytest.mark.system

MODEL = "acme/tiny-llm"
SHAPE = torch.Size([2, 4, 64, 64])  # K/V, layers, chunk tokens, hidden: 64 KiB of float16
FAST = dict(timeout_s=1.0, down_backoff_s=0.3, retries=0)


def build(target: str, **params) -> StrataL2Adapter:
    """The adapter as ``lmcache server --l2-adapter '<json>'`` builds it."""
    adapter = lmcache_l2.build({"type": "plugin", "module_path": MODULE_PATH, "class_name": CLASS_NAME,
                                "adapter_params": dict(FAST, target=target, **params)})
    assert isinstance(adapter, StrataL2Adapter)
    return adapter


class L1:
    """LMCache's L1 memory manager, whose objects go back (ref count down, freed) at the test's end."""

    def __init__(self) -> None:
        self.manager = L1MemoryManager(L1MemoryManagerConfig(size_in_bytes=32 << 20, use_lazy=False, shm_name=""))
        self.handed: list = []

    def allocate(self, shape, dtype, n: int) -> list:
        err, objs = self.manager.allocate(MemoryLayoutDesc([shape], [dtype]), n)
        assert objs, err
        self.handed += objs
        return objs

    def close(self) -> None:
        for obj in self.handed:
            obj.ref_count_down()


@pytest.fixture
def l1():
    memory = L1()
    yield memory
    memory.close()


def objects(l1: L1, n: int, seed: int | None = 0, dtype=torch.float16, shape=SHAPE):
    objs = l1.allocate(shape, dtype, n)
    gen = torch.Generator().manual_seed(seed or 0)
    for obj in objs:
        if seed is None:
            obj.tensor.zero_()
        else:
            obj.tensor.copy_(torch.randn(shape, generator=gen).to(dtype))
    return objs


def object_keys(n: int, start: int = 0, salt: str = "", model: str = MODEL, rank: int = 0) -> list[ObjectKey]:
    return [ObjectKey(bytes([7]) * 24 + (start + i).to_bytes(8, "big"), model, rank, 0, salt) for i in range(n)]


def wait(adapter: StrataL2Adapter, op: str, task_id: int):
    return lmcache_l2.wait(adapter, op, task_id)


def store(adapter, keys, objs):
    return wait(adapter, "store", adapter.submit_store_task(keys, objs))


def lookup(adapter, keys) -> list[bool]:
    bitmap = wait(adapter, "lookup", adapter.submit_lookup_and_lock_task(keys, {}))
    return [bitmap.test(i) for i in range(len(keys))]


def load(adapter, keys, objs) -> list[bool]:
    bitmap = wait(adapter, "load", adapter.submit_load_task(keys, objs))
    return [bitmap.test(i) for i in range(len(keys))]


# ---- options, keys, locks ----------------------------------------------------------------------


def test_options_are_checked_and_errors_name_the_fix():
    s = L2Settings.from_dict({"target": "10.0.0.5:50051", "shared_memory": "false", "num_workers": 2})
    assert (s.target, s.shared_memory, s.num_workers, s.namespace) == ("10.0.0.5:50051", False, 2, "lmcache")
    assert L2Settings.from_dict({}) == L2Settings()
    with pytest.raises(ValueError, match="unknown option.*tagret.*it takes:.*target"):
        L2Settings.from_dict({"tagret": "x"})
    with pytest.raises(ValueError, match="num_workers must be 1..64"):
        L2Settings.from_dict({"num_workers": 0})
    with pytest.raises(ValueError, match="whole number"):
        L2Settings.from_dict({"max_pending_tasks": 2.5})
    with pytest.raises(ValueError, match="namespace is a prefix"):
        L2Settings.from_dict({"namespace": "n" * 60})
    assert "adapter_params" in StrataL2AdapterConfig.help() and "lock_lease_s" in StrataL2AdapterConfig.help()
    spec = {"type": "plugin", "module_path": MODULE_PATH, "class_name": CLASS_NAME, "adapter_params": {"retries": 9}}
    with pytest.raises(ValueError, match="retries must be 0..5"):  # refused where LMCache builds it
        lmcache_l2.build(spec)


def test_keys_are_lossless_and_each_salt_has_its_own_namespace():
    key = ObjectKey(bytes(range(32)), "org/Model-7B", ObjectKey.ComputeKVRank(4, 1, 4, 1), 3, "tenant-a")
    block = mp_keys.block_key(key)
    assert block == b"org/Model-7B@0x04010401@3@" + bytes(range(32)).hex().encode() + b"@tenant-a"
    assert mp_keys.object_key(block).to_object_key() == key
    plain = ObjectKey(b"\x01" * 32, "org/Model-7B", 0)
    assert mp_keys.object_key(mp_keys.block_key(plain)).to_object_key() == plain
    assert mp_keys.object_key(b"not-one-of-ours") is None and mp_keys.object_key(b"\xff\xfe") is None
    assert mp_keys.namespace("lmcache", key) == "lmcache/org/Model-7B@tenant-a"
    assert mp_keys.namespace("lmcache", plain) == "lmcache/org/Model-7B"
    odd = ObjectKey(b"\x01" * 32, "a model with spaces", 0, 0, "x" * 120)
    stand_in = mp_keys.namespace("lmcache", odd)
    assert len(stand_in) <= 128 and stand_in != mp_keys.namespace("lmcache", ObjectKey(b"\x01" * 32,
                                                                                     "a model with spaces", 0))


def test_lease_book_gives_a_lease_back_once_every_key_is_unlocked():
    now = [0.0]
    book = LeaseBook(clock=lambda: now[0])
    book.add(11, "ns", [b"a", b"b"], 60)
    book.add(12, "ns", [b"b"], 60)  # b locked twice
    assert book.unlock([("ns", b"a")]) == []
    assert book.unlock([("ns", b"b")]) == [11]  # the oldest lock of b goes first
    assert book.unlock([("ns", b"x"), ("ns", b"b")]) == [12]  # an unknown key is skipped
    book.add(13, "ns", [b"c"], 5)
    now[0] = 6
    assert book.expire() == 1 and len(book) == 0 and book.unlock([("ns", b"c")]) == []


# ---- through a real daemon ---------------------------------------------------------------------


def test_store_lookup_load_round_trip_byte_for_byte_in_place(make_daemon, l1):
    daemon = make_daemon()
    adapter = build(daemon.target)
    try:
        keys, src = object_keys(6), objects(l1, 6, seed=1)
        result = store(adapter, keys, src)
        assert result.is_successful() and result.bytes_transferred() == 6 * src[0].get_size()
        again = store(adapter, keys, src)  # already stored: nothing moves, nothing is counted twice
        assert again.is_successful() and again.bytes_transferred() == 0
        assert adapter.get_usage().bytes_by_cache_salt == {"": 6 * src[0].get_size()}

        probe = keys[:4] + object_keys(2, start=100)
        assert lookup(adapter, probe) == [True] * 4 + [False] * 2
        assert Client(daemon.target).stats().pinned_blocks == 4  # the hits are held until unlocked
        dst = objects(l1, 4, seed=None)
        assert load(adapter, keys[:4], dst) == [True] * 4
        for a, b in zip(src, dst):
            assert torch.equal(a.tensor, b.tensor)
        adapter.submit_unlock(keys[:4])
        wait_until(lambda: Client(daemon.target).stats().pinned_blocks == 0, what="the unlocked pins to be given back")
        assert adapter.report_status()["is_healthy"] and adapter.counts["loaded"] == 4
    finally:
        adapter.close()


def test_a_miss_takes_no_lease_in_the_daemon(make_daemon):
    daemon = make_daemon()
    adapter = build(daemon.target)
    try:
        for start in range(0, 200, 50):
            assert not any(lookup(adapter, object_keys(50, start=start)))
        assert Client(daemon.target).stats().active_leases == 0
    finally:
        adapter.close()


def test_another_layout_under_the_same_key_is_a_miss_never_a_wrong_read(make_daemon, l1):
    daemon = make_daemon()
    adapter = build(daemon.target)
    try:
        keys = object_keys(2)
        assert store(adapter, keys, objects(l1, 2, seed=3, dtype=torch.float16)).is_successful()
        dst = objects(l1, 2, seed=None, dtype=torch.bfloat16)  # the same size, other bytes
        assert load(adapter, keys, dst) == [False, False]
        assert all(not d.tensor.any() for d in dst) and adapter.counts["load:layout"] == 2
    finally:
        adapter.close()


def test_salts_are_kept_apart_and_counted_apart(make_daemon, l1):
    daemon = make_daemon()
    adapter = build(daemon.target)
    try:
        a, b = object_keys(3, salt="alice"), object_keys(3, salt="bob")
        size = objects(l1, 1)[0].get_size()
        assert store(adapter, a, objects(l1, 3, seed=5)).is_successful()
        assert lookup(adapter, b) == [False] * 3  # the same chunks under another salt: not Alice's
        assert store(adapter, b[:1], objects(l1, 1, seed=6)).is_successful()
        assert adapter.get_usage().bytes_by_cache_salt == {"alice": 3 * size, "bob": size}
        assert sorted(Client(daemon.target).stats().namespaces) == [f"lmcache/{MODEL}@alice", f"lmcache/{MODEL}@bob"]
        adapter.delete(a[:2] + object_keys(1, start=50, salt="alice"))  # one of them was never stored
        assert adapter.get_usage().bytes_by_cache_salt == {"alice": size, "bob": size}
        assert lookup(adapter, a) == [False, False, True]
    finally:
        adapter.close()


def test_list_l2_keys_pages_through_every_namespace(make_daemon, l1):
    daemon = make_daemon()
    adapter = build(daemon.target)
    try:
        stored = object_keys(5) + object_keys(4, salt="t1") + object_keys(3, model="other/model")
        for part in (stored[:5], stored[5:9], stored[9:]):
            assert store(adapter, part, objects(l1, len(part), seed=7)).is_successful()
        Client(daemon.target).put("lmcache/stray", b"not-an-object-key", b"x")  # not ours: left out
        seen, cursor, pages = [], None, 0
        while True:
            page = adapter.list_l2_keys(page_size=4, cursor=cursor)
            assert len(page.entries) <= 4
            seen += [e.key.to_object_key() for e in page.entries]
            assert all(e.size_bytes == 64 << 10 for e in page.entries)
            pages += 1
            cursor = page.next_page_token
            if cursor is None:
                break
        assert sorted(seen, key=repr) == sorted(stored, key=repr) and pages >= 3
        only = adapter.list_l2_keys(model_name="other/model", page_size=100)
        assert {e.key.model_name for e in only.entries} == {"other/model"} and len(only.entries) == 3
        with pytest.raises(ValueError, match="page_size"):
            adapter.list_l2_keys(page_size=0)
        with pytest.raises(ValueError, match="not a cursor"):
            adapter.list_l2_keys(cursor="garbage!")
    finally:
        adapter.close()


def test_daemon_down_fails_fast_and_nothing_hangs(daemon_process, l1):
    proc = daemon_process()
    adapter = build(proc.target, down_backoff_s=30)
    try:
        keys = object_keys(2)
        assert store(adapter, keys, objects(l1, 2, seed=8)).is_successful()
        assert lookup(adapter, keys) == [True, True]
        proc.kill()
        started = time.monotonic()
        assert not store(adapter, object_keys(2, start=9), objects(l1, 2, seed=9)).is_successful()
        assert lookup(adapter, keys) == [False, False]  # backing off: answered at once, no call
        assert load(adapter, keys, objects(l1, 2, seed=None)) == [False, False]
        adapter.submit_unlock(keys)  # the pins die with the daemon; unlocking must not raise
        assert time.monotonic() - started < 10
        status = adapter.report_status()
        assert not status["is_healthy"] and status["counts"]["lookup:down"] == 2
    finally:
        adapter.close()


def test_beyond_max_pending_tasks_a_task_fails_at_once(make_daemon, l1):
    daemon = make_daemon()
    adapter = build(daemon.target, num_workers=1, max_pending_tasks=1)
    try:
        gate = __import__("threading").Event()
        adapter._pool.submit(gate.wait)  # the one worker is busy: the first task waits, the second is refused
        first = adapter.submit_store_task(object_keys(1), objects(l1, 1, seed=1))
        refused = adapter.submit_lookup_and_lock_task(object_keys(1), {})
        assert [adapter.query_lookup_and_lock_result(refused).test(0)] == [False]
        assert adapter.counts["lookup:busy"] == 1
        gate.set()
        assert wait(adapter, "store", first).is_successful()
    finally:
        adapter.close()


def test_a_bug_in_a_task_is_logged_and_answered(make_daemon, l1, caplog):
    daemon = make_daemon()
    adapter = build(daemon.target)
    try:
        assert store(adapter, object_keys(1), objects(l1, 1, seed=1)).is_successful()
        task = adapter.submit_load_task(object_keys(1), [None])  # not a MemoryObj: a caller's bug
        assert wait(adapter, "load", task).popcount() == 0
        assert adapter.counts["load:bug"] == 1 and "raised" in caplog.text
    finally:
        adapter.close()


def test_a_fresh_node_finds_what_another_node_left_in_the_bucket(s3, tmp_path, monkeypatch, l1):
    """A lookup finds objects no local tier holds when the daemon's object tier does (a new node on the
    fleet's bucket): found without a lock, and the load reads them through, verified."""
    from tests.support import s3_servers
    from tests.support.daemons import DaemonProcess

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_servers.ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_servers.SECRET_KEY)
    started = []

    def node(name: str) -> DaemonProcess:
        home = tmp_path / name
        home.mkdir()
        d = DaemonProcess(home, "--tiers", "ram,object", "--object-write-policy", "through",
                          "--object-bucket", s3.bucket, "--object-prefix", "l2", "--object-endpoint", s3.endpoint,
                          "--object-read-seconds", "10").start()
        started.append(d)
        return d

    try:
        first = node("first")
        writer = build(first.target)
        keys, src = object_keys(3), objects(l1, 3, seed=12)
        assert store(writer, keys, src).is_successful()
        namespace = mp_keys.namespace("lmcache", keys[0])
        wait_until(lambda: len(s3.keys("l2/")) >= 3, what="the write-through uploads")
        writer.close()
        second = node("second")  # empty RAM, the same bucket
        reader = build(second.target)
        try:
            assert lookup(reader, keys + object_keys(1, start=77)) == [True, True, True, False]
            assert reader.counts["lookup:remote"] == 3
            dst = objects(l1, 3, seed=None)
            assert load(reader, keys, dst) == [True] * 3
            assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(src, dst))
            reader.submit_unlock(keys)  # never locked here: nothing to give back, nothing raised
            with Client(second.target, use_shm=False) as c:
                assert c.stats(namespace).blocks == 3  # read through into this node's RAM
        finally:
            reader.close()
    finally:
        for d in started:
            d.stop()
