"""Strata as a secondary tier of vLLM's own KV offloading, tested against vLLM's real tiering code on CPU.

vLLM's ``TieringOffloadingSpec`` builds the ``TieringOffloadingManager``, its
CPU primary tier and, through its ``SecondaryTierFactory``, the Strata tier
(``type`` + ``module_path``); ``tests/support/vllm_engine.py`` drives it as vLLM's
scheduler does, writing and reading the primary tier's rows where a GPU
worker would. Daemons are real: in-process on a real port, or ``strata
serve`` child processes stopped, killed with SIGKILL and restarted.

Skipped when vLLM is not importable (see docs/integrations/vllm.md: vLLM's Python
layers on CPU, the ``vllm`` extra).
"""

from __future__ import annotations

import signal
import threading

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33 is not installed (docs/integrations/vllm.md: the vllm extra)")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from benchmarks.harness import free_port  # noqa: E402
from kvstore import Client  # noqa: E402
from kvstore.integrations.vllm import StrataTier, StrataTierSettings, block_key, metrics, offload_key  # noqa: E402
from kvstore.integrations.vllm.jobs import Job, JobRunner, Kind  # noqa: E402
from tests.support.vllm_engine import ROW, Engine, chunk_bytes, chunk_keys, offloading_config, strata_entry  # noqa: E402
from tests.support.wait import wait_until  # noqa: E402

pytestmark = pytest.mark.system

FAST = dict(timeout_s=1.0, down_backoff_s=0.3, job_timeout_s=5.0)


def blocks_in(target: str, namespace: str) -> int:
    with Client(target, use_shm=False, timeout=2) as c:
        try:
            return c.stats(namespace).blocks
        except Exception:  # noqa: BLE001 - the namespace appears with its first block
            return 0


class ThreadRecordingClient(Client):
    """A real client that notes which thread made each daemon call (the scheduler thread must make none)."""

    threads: set[str] = set()

    def _retrying(self, method, attempt_once):
        ThreadRecordingClient.threads.add(threading.current_thread().name)
        return super()._retrying(method, attempt_once)


def record_threads(engine: Engine) -> set[str]:
    ThreadRecordingClient.threads = set()
    engine.tier._chunks._factory = ThreadRecordingClient
    return ThreadRecordingClient.threads


# ---- options, keys, namespaces -----------------------------------------------------


def test_options_are_checked_and_errors_name_the_fix():
    s = StrataTierSettings.from_options({"target": "10.0.0.5:50051", "shared_memory": "false", "locality": "remote"})
    assert (s.target, s.shared_memory, s.locality, s.namespace) == ("10.0.0.5:50051", False, "REMOTE", "vllm")
    with pytest.raises(ValueError, match="unknown option.*tagret.*it takes:.*target"):
        StrataTierSettings.from_options({"tagret": "x"})
    with pytest.raises(ValueError, match="shared_memory"):
        StrataTierSettings.from_options({"shared_memory": "maybe"})
    with pytest.raises(ValueError, match="io_threads must be 1..64"):
        StrataTierSettings.from_options({"io_threads": 0})
    with pytest.raises(ValueError, match="namespace is a prefix of at most"):
        StrataTierSettings.from_options({"namespace": "n" * 60})


def test_an_offload_key_maps_to_a_block_key_and_back():
    [key] = chunk_keys(1, group=3)
    group, block = block_key(key)
    assert (group, len(block)) == (3, 32)
    assert offload_key(group, block) == key


def namespace_of(**config) -> str:
    spec = TieringOffloadingSpec(offloading_config([], **config))
    from kvstore.integrations.vllm import KVLayout

    return KVLayout.of(spec, spec.kv_bytes_per_chunk, "vllm").namespace(0)


def test_the_namespace_carries_the_model_and_the_kv_layout():
    same = namespace_of()
    assert same == namespace_of() and same.startswith("vllm/acme/tiny-llm@") and same.endswith("/g0")
    others = {namespace_of(dtype="float16"), namespace_of(tp=2), namespace_of(model="acme/other"),
              namespace_of(row=2 * ROW)}
    assert same not in others and len(others) == 4
    long = namespace_of(model="org/" + "m" * 200)
    assert len(long) <= 128 and long.endswith("/g0")


# ---- one engine, one daemon ---------------------------------------------------------


def test_chunks_evicted_from_the_primary_load_back_byte_for_byte(make_daemon):
    """Stored through vLLM's cascade, gone from the primary tier, found by the Strata tier's lookups
    and promoted back through the primary: every byte as written, and no daemon call on the
    scheduler thread."""
    daemon = make_daemon()
    with Engine([strata_entry(daemon.target, enable_kv_events=True, **FAST)]) as e:
        threads = record_threads(e)
        chunks = chunk_bytes(chunk_keys(6))
        assert e.store(chunks) == list(chunks)
        namespace = e.tier.layout.namespace(0)
        assert blocks_in(daemon.target, namespace) == 6
        stored = [ev for ev in e.manager.take_events() if ev.ownership == "strata"]
        assert [k for ev in stored for k in ev.keys] == list(chunks) and not any(ev.removed for ev in stored)
        e.evict()
        assert not any(e.in_primary(k) for k in chunks)
        assert e.fetch(list(chunks)) == chunks
        assert all(e.in_primary(k) for k in chunks)
        assert threading.main_thread().name not in threads and threads
        assert e.tier._chunks.client().transport_for(namespace) == "same-host"  # one copy each way
        stats = e.manager.get_stats()
        assert stats.data["data"][metrics.LOOKUP_BATCHES][("ok",)] >= 1
        assert stats.data["data"][metrics.DAEMON_UP][()] == 1


def test_the_factory_resolves_the_class_name_too_and_declares_the_tiers_metrics(make_daemon):
    daemon = make_daemon()
    entry = dict(strata_entry(daemon.target), type="StrataTier")
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8 * ROW, "secondary_tiers": [entry]}
    declared = TieringOffloadingSpec.build_metric_definitions(extra)
    assert set(metrics.definitions()) <= set(declared)
    with Engine([entry]) as e:
        assert isinstance(e.tier, StrataTier) and e.tier.tier_type == "StrataTier"
        assert e.tier.config_info()["strata_target"] == daemon.target


def test_a_load_keeps_the_chunks_that_came_and_fails_only_the_others(make_daemon):
    """One chunk of the promotion is gone and one holds another layout's bytes under this engine's
    key: vLLM gets successful_keys for the rest, recomputes those two, and no foreign byte lands.
    The chunk found gone is announced as removed from the tier (KV events)."""
    daemon = make_daemon()
    with Engine([strata_entry(daemon.target, enable_kv_events=True, **FAST)]) as e:
        chunks = chunk_bytes(chunk_keys(5, seed=1))
        keys = list(chunks)
        e.store(chunks)
        namespace = e.tier.layout.namespace(0)
        with Client(daemon.target) as c:
            c.delete(namespace, [block_key(keys[1])[1]])
            c.delete(namespace, [block_key(keys[3])[1]])
            c.put(namespace, block_key(keys[3])[1], b"\x01" * ROW, layout="vllm-tier/1;layout=other;bytes=524288")
        e.evict()
        ctx = ReqContext("partial")
        tier = e.tier
        with e.manager.lock:
            e.manager.on_new_request(ctx)
            spec = e.manager.primary_tier.prepare_write(keys, ctx)
            tier.submit_load(TransferJob(job_id=10_000, keys=keys, chunk_ids=spec.store_spec.chunk_ids,
                                         is_promotion=True, req_context=ctx))
        results = wait_until(lambda: list(tier.get_finished_jobs()), what="the load to finish")
        [result] = results
        assert not result.success and set(result.successful_keys) == {keys[0], keys[2], keys[4]}
        assert tier.counts == {"failed_load:missing": 1, "failed_load:layout": 1}
        removed = [k for ev in tier.take_events() if ev.removed for k in ev.keys]
        assert removed == [keys[1]]
        rows = e._rows()
        for key, chunk in zip(keys, spec.store_spec.chunk_ids):
            if key in result.successful_keys:
                assert rows[chunk].tobytes() == chunks[key]
            else:
                assert rows[chunk].tobytes() != b"\x01" * ROW  # the foreign block never reached the row
        del rows
        with e.manager.lock:
            e.manager.primary_tier.complete_write(list(result.successful_keys), ctx, True)
            e.manager.primary_tier.complete_write([keys[1], keys[3]], ctx, False)
            e.manager.on_request_finished(ctx)


# ---- buffers: the primary tier's rows, in place -------------------------------------------
#
# The rows are host memory by vLLM's design (see kvstore.integrations.vllm); what is checked is
# that each store reads and each load writes the chunk's row of primary_kv_view itself, not a copy.


def where(buf) -> tuple[type, int, int]:
    """(type, address, bytes) of a buffer, without keeping it."""
    view = memoryview(buf)
    return type(buf), np.frombuffer(view, dtype=np.uint8).ctypes.data, view.nbytes


class RecordingClient(Client):
    """A real client that notes where the buffers it is handed live: put values, placed buffers."""

    put: list[tuple[type, int, int]] = []
    placed: list[tuple[type, int, int]] = []

    def put_many(self, namespace, items):
        RecordingClient.put += [where(item.value) for item in items]
        return super().put_many(namespace, items)

    def get_into(self, namespace, keys, buffers):
        inner = buffers

        def place(i, info):
            buf = inner(i, info)
            if buf is not None:
                RecordingClient.placed.append(where(buf))
            return buf

        return super().get_into(namespace, keys, place)


def primary_rows(e: Engine) -> tuple[int, int, int]:
    """(address, rows, row bytes) of the primary tier's buffer."""
    view = e.manager.primary_tier.get_kv_memoryview()  # the manager's own: not released here
    return np.frombuffer(view, dtype=np.uint8).ctypes.data, len(view), view.strides[0]


def row_of(base: int, rows: int, row: int, buf: tuple[type, int, int]) -> int | None:
    """The index of the primary row ``buf`` is, or None when it is not exactly one row of that buffer."""
    kind, address, size = buf
    offset = address - base
    if kind is not memoryview or size != row or offset % row or not 0 <= offset // row < rows:
        return None
    return offset // row


@pytest.mark.parametrize("shared_memory", ["auto", "false"], ids=["shm", "stream"])
def test_stores_and_loads_use_the_primary_rows_in_place_byte_for_byte(make_daemon, shared_memory):
    """The client is handed each chunk's row of vLLM's primary buffer (its address, one row's
    size), never a copy of it, on the same-host path and the streamed one alike."""
    daemon = make_daemon()
    RecordingClient.put, RecordingClient.placed = [], []
    with Engine([strata_entry(daemon.target, shared_memory=shared_memory, **FAST)]) as e:
        e.tier._chunks._factory = RecordingClient
        base, rows, row = primary_rows(e)
        chunks = chunk_bytes(chunk_keys(4, seed=11))
        assert e.store(chunks) == list(chunks)
        stored = [row_of(base, rows, row, buf) for buf in RecordingClient.put]
        assert len(stored) == 4 and None not in stored and len(set(stored)) == 4
        e.evict()  # the 8 chunks that evict them are stored from their rows too
        assert len(RecordingClient.put) == 4 + 8
        assert None not in [row_of(base, rows, row, buf) for buf in RecordingClient.put]
        assert e.fetch(list(chunks)) == chunks
        loaded = [row_of(base, rows, row, buf) for buf in RecordingClient.placed]
        assert len(loaded) == 4 and None not in loaded and len(set(loaded)) == 4


# ---- two engines ----------------------------------------------------------------------


def test_a_second_engine_of_the_same_layout_finds_the_first_ones_chunks(make_daemon):
    daemon = make_daemon()
    chunks = chunk_bytes(chunk_keys(4, seed=2))
    with Engine([strata_entry(daemon.target, **FAST)]) as first:
        first.store(chunks)
    with Engine([strata_entry(daemon.target, **FAST)]) as second:
        assert second.fetch(list(chunks)) == chunks
    with Engine([strata_entry(daemon.target, **FAST)], dtype="float16") as other_layout:
        assert other_layout.fetch(list(chunks)) == dict.fromkeys(chunks)  # misses: its namespace is another
        assert other_layout.tier.layout.namespace(0) != second.tier.layout.namespace(0)


# ---- a daemon that is gone, stopped, killed, restarted ----------------------------------


def test_no_daemon_lookups_miss_stores_drop_loads_fail_and_nothing_waits(tmp_path):
    with Engine([strata_entry(f"127.0.0.1:{free_port()}", **FAST)]) as e:
        threads = record_threads(e)
        chunks = chunk_bytes(chunk_keys(3, seed=3))
        e.store(chunks)  # the cascade fails: dropped, counted
        assert e.tier.counts == {"dropped:down": 3}
        e.evict()
        assert e.fetch(list(chunks)) == dict.fromkeys(chunks)
        e.store(chunk_bytes(chunk_keys(2, seed=4)))
        assert e.tier.counts == {"dropped:down": 3 + 8 + 2}  # with the 8 that evicted the first ones
        assert threading.main_thread().name not in threads
        assert e.manager.get_stats().data["data"][metrics.DAEMON_UP][()] == 0


@pytest.mark.timeout(120)
def test_sigkill_mid_load_fails_the_load_within_bounds_then_a_restart_serves_again(daemon_process):
    daemon = daemon_process()
    # A long call deadline: the load must still be waiting on the stopped daemon when it is killed.
    with Engine([strata_entry(daemon.target, **dict(FAST, timeout_s=30.0))]) as e:
        chunks = chunk_bytes(chunk_keys(6, seed=5))
        keys = list(chunks)
        e.store(chunks)
        e.evict()
        ctx = ReqContext("killed")
        with e.manager.lock:
            e.manager.on_new_request(ctx)
        # Lookups until every chunk is found and its promotion queued (not yet submitted) ...
        def promoted() -> bool:
            with e.manager.lock:
                found = [e.manager.lookup(k, ctx) for k in keys]
                if all(r is LookupResult.HIT_PENDING for r in found):
                    return True
                e.manager.on_schedule_end(ScheduleEndContext((), ()))
            return False

        wait_until(promoted, what="the chunks to be found and queued for promotion")
        daemon.proc.send_signal(signal.SIGSTOP)  # ... then the load starts against a stopped daemon ...
        e.step()
        wait_until(lambda: e.tier._runner._running == 1, what="the load job to be running")
        daemon.kill(signal.SIGKILL)  # ... and the daemon dies under it
        e.settle()
        with e.manager.lock:
            assert [e.manager.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * len(keys)
            e.manager.on_request_finished(ctx)
        assert e.tier.counts.get("failed_load:down") == len(keys)
        daemon.start()  # crash-kept RAM: the restarted daemon still holds what was stored
        got = wait_until(lambda: (lambda g: g if all(g.values()) else None)(e.fetch(keys)),
                         what="the restarted daemon to serve the chunks")
        assert got == chunks


@pytest.mark.timeout(120)
def test_a_restarted_daemon_serves_the_same_engine_without_reconfiguring(daemon_process):
    daemon = daemon_process()
    with Engine([strata_entry(daemon.target, **FAST)]) as e:
        chunks = chunk_bytes(chunk_keys(4, seed=6))
        e.store(chunks)
        e.evict()
        assert daemon.kill(signal.SIGTERM) == 0  # a clean stop keeps its blocks
        daemon.start()
        assert e.fetch(list(chunks)) == chunks  # the tier's client attaches the new daemon's arena
        more = chunk_bytes(chunk_keys(2, seed=7))
        e.store(more)
        assert blocks_in(daemon.target, e.tier.layout.namespace(0)) == 4 + 8 + 2  # and the 8 that evicted them


def test_a_stopped_daemon_costs_the_scheduler_nothing_and_loads_fail_within_bounds(daemon_process):
    """SIGSTOP: calls hang until their deadline. The scheduler thread still never waits: its lookups
    answer RETRY then MISS, and the queued store and load jobs report failure once the deadline passes."""
    daemon = daemon_process()
    with Engine([strata_entry(daemon.target, **FAST)]) as e:
        threads = record_threads(e)
        chunks = chunk_bytes(chunk_keys(3, seed=8))
        e.store(chunks)
        e.evict()
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            assert e.fetch(list(chunks)) == dict.fromkeys(chunks)
            e.store(chunk_bytes(chunk_keys(2, seed=9)))
            assert threading.main_thread().name not in threads
        finally:
            daemon.proc.send_signal(signal.SIGCONT)


# ---- the job runner ---------------------------------------------------------------------


def _result(job_id, log):
    from vllm.v1.kv_offload.tiering.base import JobResult

    def run():
        log.append(job_id)
        return JobResult(job_id=job_id, success=True)

    def give_up(reason):
        log.append((job_id, reason))
        return JobResult(job_id=job_id, success=False)

    return run, give_up


def test_the_runner_takes_loads_first_refuses_beyond_its_limit_and_gives_up_late_jobs():
    log: list = []
    gate = threading.Event()
    runner = JobRunner(threads=1, max_queued=3)
    try:
        from vllm.v1.kv_offload.tiering.base import JobResult

        runner.submit(Kind.STORE, Job(lambda: (gate.wait(), JobResult(job_id=0, success=True))[1],
                                      lambda r: JobResult(job_id=0, success=False), deadline=float("inf")))
        wait_until(lambda: runner._running == 1, what="the first job to run")
        runner.submit(Kind.STORE, Job(*_result(1, log), deadline=float("inf")))
        runner.submit(Kind.LOAD, Job(*_result(2, log), deadline=0.0))  # already late: given up unrun
        assert not runner.submit(Kind.LOAD, Job(*_result(3, log), deadline=float("inf")))  # over max_queued
        gate.set()
        runner.drain()
        assert log == [(2, "expired"), 1]  # the load was taken before the store that waited longer
        assert sorted(r.job_id for r in runner.finished()) == [0, 1, 2]
    finally:
        runner.shutdown()


def test_a_job_that_raises_still_reports_and_shutdown_answers_what_waits():
    log: list = []
    runner = JobRunner(threads=1, max_queued=8)

    def broken():
        raise RuntimeError("a bug")

    gate = threading.Event()
    from vllm.v1.kv_offload.tiering.base import JobResult

    runner.submit(Kind.LOAD, Job(broken, lambda r: (log.append(r), JobResult(job_id=1, success=False))[1], float("inf")))
    runner.drain()
    assert log == ["error"] and [r.success for r in runner.finished()] == [False]
    runner.submit(Kind.STORE, Job(lambda: (gate.wait(), JobResult(job_id=2, success=True))[1],
                                  lambda r: JobResult(job_id=2, success=False), float("inf")))
    wait_until(lambda: runner._running == 1, what="the job to run")
    runner.submit(Kind.STORE, Job(*_result(3, log), deadline=float("inf")))
    threading.Timer(0.2, gate.set).start()
    runner.shutdown()
    assert sorted((r.job_id, r.success) for r in runner.finished()) == [(2, True), (3, False)]


# ---- the router credits the node for what the tier stored ------------------------------------


def test_chunks_the_tier_stored_credit_its_node_in_the_routers_score(make_daemon):
    """A prompt hashed by the router (its tokens, the engines' block size and seed) names the chunks
    vLLM's tiering stored through this tier: the router's scorer, asking the tier's namespace,
    credits the daemon's node with every block at the host tier's weight."""
    import asyncio

    pytest.importorskip("aiohttp", reason="the router needs aiohttp (pip install 'strata-kvcache[router]')")
    from vllm.v1.kv_offload.base import make_offload_key

    from kvstore.index.keys import BlockHasher
    from kvstore.router.metrics import RouterMetrics
    from kvstore.router.scorer import PrefixScorer

    daemon = make_daemon(node_id="node-a")
    hasher = BlockHasher(16, "0")  # the engine's tokens_per_block (tests/support/vllm_engine.py) and PYTHONHASHSEED
    chain = hasher.chain(list(range(1, 4 * 16 + 1)))
    with Engine([strata_entry(daemon.target, **FAST)]) as e:
        chunks = chunk_bytes([make_offload_key(h, 0) for h in chain])
        assert [block_key(k) for k in chunks] == [(0, h) for h in chain]
        e.store(chunks)
        namespace = e.tier.layout.namespace(0)

    async def credit() -> float:
        scorer = PrefixScorer(daemon.target, "", hasher, RouterMetrics(), timeout_s=5.0, retry_s=1.0,
                              tier_namespace=namespace)
        try:
            return (await scorer.credits(chain, [["node-a"]]))[0]
        finally:
            await scorer.close()

    wait_until(lambda: asyncio.run(credit()) == pytest.approx(4 * 0.8), what="the node credited with 4 host blocks")
