"""Store events: fan-out, order, the overflow rule, slow and failing subscribers, and the
subscribers the daemon runs (the index agent, metrics)."""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest
from prometheus_client import CollectorRegistry

from kvstore.block import BlockKey, BlockMeta, TierName, checksum
from kvstore.events import EventBus, Evicted, Moved, Removed, Resync, Stored
from kvstore.index.agent import IndexAgent
from kvstore.index.memory import MemoryIndex
from kvstore.metrics import StoreMetrics
from kvstore.store.tiered import StoreLimits, TieredStore
from kvstore.tiers.ram import HostRamTier
from tests.support.wait import wait_until

HOST, DISK = TierName.HOST, TierName.DISK


def key(i: int, namespace: str = "m") -> BlockKey:
    return BlockKey(namespace, b"k%d" % i)


def stored(i: int) -> Stored:
    return Stored(key(i), HOST, 100 + i, HOST)


class Recorder:
    """A subscriber that keeps every batch; optionally blocks inside its callback until released."""

    def __init__(self, block: bool = False) -> None:
        self.batches: list[list] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        if not block:
            self.release.set()
        self._lock = threading.Lock()

    def __call__(self, batch) -> None:
        self.entered.set()
        self.release.wait(60)
        with self._lock:
            self.batches.append(list(batch))

    @property
    def events(self) -> list:
        with self._lock:
            return [e for b in self.batches for e in b]


@pytest.fixture
def bus():
    b = EventBus(queue_events=64, batch_events=16)
    yield b
    b.close()


def test_events_are_immutable_and_carry_the_best_tier_after_them():
    k = key(1)
    events = [Stored(k, HOST, 10, HOST), Moved(k, HOST, DISK, HOST), Evicted(k, HOST, DISK), Removed(k, dropped=True)]
    assert [e.kind for e in events] == ["stored", "moved", "evicted", "removed"]
    assert [e.best for e in events] == [HOST, HOST, DISK, None]
    with pytest.raises(dataclasses.FrozenInstanceError):
        events[0].tier = DISK  # type: ignore[misc]
    assert Resync() == Resync() and Resync().kind == "resync"


def test_every_subscriber_gets_every_event_in_order_in_bounded_batches(bus):
    a, b = Recorder(), Recorder()
    bus.subscribe("a", a)
    bus.subscribe("b", b)
    sent = [stored(i) for i in range(50)]
    for e in sent[:20]:
        bus.publish(e)
    bus.publish_all(sent[20:40])
    for e in sent[40:]:
        bus.publish(e)
    for r in (a, b):
        wait_until(lambda: len(r.events) == len(sent), what="every event delivered")
        assert r.events == sent
        assert all(0 < len(batch) <= 16 for batch in r.batches)


def test_publishers_on_several_threads_each_keep_their_order(bus):
    r = Recorder()
    bus.subscribe("r", r, queue_events=10_000)

    def publish(ns: str) -> None:
        for i in range(300):
            bus.publish(Stored(key(i, ns), HOST, i, HOST))

    threads = [threading.Thread(target=publish, args=(ns,)) for ns in ("x", "y", "z")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait_until(lambda: len(r.events) == 900, what="900 events delivered")
    for ns in ("x", "y", "z"):
        assert [e.key.key for e in r.events if e.key.namespace == ns] == [b"k%d" % i for i in range(300)]


def test_overflow_drops_the_pending_events_counts_them_and_delivers_resync_next(bus):
    slow = Recorder(block=True)
    sub = bus.subscribe("slow", slow, queue_events=10)
    bus.publish(stored(0))
    assert slow.entered.wait(30)  # the delivery thread holds event 0 in the callback
    bus.publish_all([stored(i) for i in range(1, 6)])  # fits: 5 queued
    bus.publish_all([stored(i) for i in range(6, 12)])  # 5 + 6 > 10: all 11 dropped
    assert sub.dropped_events == 11 and sub.overflows == 1 and sub.pending == 1
    after = [stored(i) for i in range(12, 15)]
    bus.publish_all(after)
    slow.release.set()
    wait_until(lambda: len(slow.batches) == 3, what="three deliveries")
    assert slow.batches == [[stored(0)], [Resync()], after]
    assert sub.resyncs == 1 and sub.delivered_events == 4


def test_a_slow_subscriber_blocks_neither_publish_nor_the_others(bus):
    slow, fast = Recorder(block=True), Recorder()
    slow_sub = bus.subscribe("slow", slow, queue_events=8)
    bus.subscribe("fast", fast, queue_events=10_000)
    bus.publish(stored(0))
    assert slow.entered.wait(30)
    sent = [stored(i) for i in range(1, 1000)]
    publisher = threading.Thread(target=lambda: [bus.publish(e) for e in sent])
    publisher.start()
    publisher.join(60)
    assert not publisher.is_alive(), "publish waited on a subscriber stuck in its callback"
    wait_until(lambda: len(fast.events) == 1000, what="the fast subscriber to get everything")
    assert fast.events == [stored(0), *sent]
    assert slow_sub.dropped_events > 0 and slow_sub.pending <= 8
    slow.release.set()
    wait_until(lambda: Resync() in slow.events, what="the slow subscriber to be told to resync")
    assert slow.batches[0] == [stored(0)] and slow.batches[1] == [Resync()]


def test_a_failing_subscriber_is_logged_counted_resynced_and_others_go_on(bus, caplog):
    seen: list = []

    def flaky(batch) -> None:
        seen.append(list(batch))
        if any(isinstance(e, Stored) and e.key == key(2) for e in batch):
            raise RuntimeError("cannot apply")

    other = Recorder()
    sub = bus.subscribe("flaky", flaky, batch_events=1)
    bus.subscribe("other", other)
    with caplog.at_level(logging.ERROR, logger="kvstore.events"):
        for i in range(5):
            bus.publish(stored(i))
        wait_until(lambda: len(other.events) == 5, what="the other subscriber's events")
        wait_until(lambda: sum(len(b) for b in seen) >= 6, what="the flaky subscriber's deliveries")
    assert seen[:3] == [[stored(0)], [stored(1)], [stored(2)]]
    assert seen[3] == [Resync()]  # it lost a batch: rebuild
    assert [e for b in seen[4:] for e in b] == [stored(3), stored(4)]
    assert sub.errors == 1 and sub.resyncs == 1
    assert any("'flaky'" in r.getMessage() and r.exc_info for r in caplog.records)
    assert other.events == [stored(i) for i in range(5)]


def test_a_subscriber_whose_resync_fails_does_not_spin(bus):
    calls: list = []

    def broken(batch) -> None:
        calls.append(list(batch))
        raise RuntimeError("always")

    sub = bus.subscribe("broken", broken)
    bus.publish(stored(0))
    wait_until(lambda: sub.errors == 2, what="the batch and the Resync after it to fail")
    marker = Recorder()
    bus.subscribe("marker", marker)
    bus.publish(stored(1))  # delivered to both; broken must not have looped meanwhile
    wait_until(lambda: marker.events == [stored(1)] and sub.errors == 4, what="the next event")
    assert calls == [[stored(0)], [Resync()], [stored(1)], [Resync()]]


def test_unsubscribe_stops_delivery_and_close_drains_then_ignores(bus):
    gone, stays = Recorder(block=True), Recorder()
    sub = bus.subscribe("gone", gone)
    bus.subscribe("stays", stays)
    bus.publish(stored(0))
    assert gone.entered.wait(30)
    bus.publish(stored(1))
    t = threading.Thread(target=sub.unsubscribe)
    t.start()
    gone.release.set()
    t.join(30)
    assert not t.is_alive()
    bus.publish(stored(2))
    wait_until(lambda: len(stays.events) == 3, what="the remaining subscriber's events")
    assert gone.events == [stored(0)]  # event 1 was queued at unsubscribe: dropped
    assert [s.name for s in bus.subscriptions()] == ["stays"]
    bus.publish_all([stored(i) for i in range(3, 40)])
    bus.close()
    assert stays.events == [stored(i) for i in range(40)]  # close delivered what was queued
    bus.publish(stored(99))
    assert len(stays.events) == 40
    with pytest.raises(RuntimeError, match="closed"):
        bus.subscribe("late", Recorder())


def test_subscriber_names_and_limits_are_checked(bus):
    bus.subscribe("index", Recorder())
    with pytest.raises(ValueError, match="exists already"):
        bus.subscribe("index", Recorder())
    with pytest.raises(ValueError, match="at least 1"):
        bus.subscribe("zero", Recorder(), queue_events=0)
    with pytest.raises(ValueError, match="short fixed word"):
        bus.subscribe("", Recorder())


def test_resync_first_and_a_real_store_publishing(bus, tmp_path):
    late = Recorder()
    bus.subscribe("late", late, resync_first=True)
    ram = HostRamTier(16 << 20, shm_dir=str(tmp_path), arena_name="events")
    store = TieredStore([ram], limits=StoreLimits.from_settings(max_block_bytes=1 << 20), events=bus)
    try:
        data = b"x" * 1000
        store.put(BlockKey("m", b"a"), data, BlockMeta(len(data), checksum(data)))
        store.delete("m", [b"a"])
        gone = Removed(BlockKey("m", b"a"), dropped=False)
        wait_until(lambda: late.events[-1:] == [gone], what="the store's changes")
        assert late.events == [Resync(), Stored(BlockKey("m", b"a"), HOST, 1000, HOST), gone], "a delete is told once"
    finally:
        store.close()


def test_metrics_count_events_by_kind_and_tier_and_export_subscriber_losses(bus):
    metrics = StoreMetrics(CollectorRegistry())
    bus.subscribe("metrics", metrics.count_events)
    slow = Recorder(block=True)
    bus.subscribe("slow", slow, queue_events=2)
    metrics.watch_event_bus(bus.subscriptions)
    bus.publish(stored(0))
    assert slow.entered.wait(30)
    k = key(9)
    bus.publish_all([Stored(k, HOST, 5, HOST), Moved(k, HOST, DISK, HOST), Evicted(k, HOST, DISK), Removed(k)])
    sample = metrics.registry.get_sample_value
    wait_until(lambda: sample("strata_store_events_total", {"kind": "removed", "tier": "none"}) == 1, what="counts")
    assert sample("strata_store_events_total", {"kind": "stored", "tier": "host"}) == 2
    assert sample("strata_store_events_total", {"kind": "moved", "tier": "disk"}) == 1
    assert sample("strata_store_events_total", {"kind": "evicted", "tier": "host"}) == 1
    assert sample("strata_store_event_dropped_total", {"subscriber": "slow"}) == 4
    assert sample("strata_store_event_overflows_total", {"subscriber": "slow"}) == 1
    assert sample("strata_store_event_queue_events", {"subscriber": "slow"}) == 1  # the Resync
    assert sample("strata_store_event_dropped_total", {"subscriber": "metrics"}) == 0
    slow.release.set()
    wait_until(lambda: sample("strata_store_event_resyncs_total", {"subscriber": "slow"}) == 1, what="the resync")


# ---- the index agent as a subscriber ---------------------------------------------------


class Holdings:
    """What a store would answer to holdings(); can block, to hold a snapshot in progress."""

    def __init__(self) -> None:
        self.blocks: list[tuple[BlockKey, TierName]] = []
        self.threads: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __call__(self) -> list[tuple[BlockKey, TierName]]:
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        assert self.gate.wait(60)
        return list(self.blocks)


def node_blocks(agent: IndexAgent, keys: list[bytes]) -> list[TierName | None]:
    found = agent.run(agent.index.holders("m", keys), 5)
    return [next((h.tier for h in hs if h.node_id == "n1"), None) for hs in found]


@pytest.fixture
def agent_and_holdings():
    holdings = Holdings()
    registry = CollectorRegistry()
    agent = IndexAgent(MemoryIndex(), "n1", 1, holdings, flush_s=0.01, registry=registry)
    agent.registry = registry
    yield agent, holdings
    holdings.gate.set()
    agent.stop(2)


def test_index_agent_publishes_events_and_resyncs_from_a_snapshot(bus, agent_and_holdings):
    agent, holdings = agent_and_holdings
    sub = bus.subscribe("index", agent.on_events, queue_events=4)
    agent.start()
    # the first publication is a full one, of what the store holds then (nothing): events
    # from before it are in that snapshot, so wait for it before the store "changes"
    resyncs = lambda: agent.registry.get_sample_value("strata_index_resyncs_total")
    wait_until(lambda: resyncs() == 1, what="the first full publication")
    ks = [b"k%d" % i for i in range(4)]
    bus.publish_all([Stored(key(0), HOST, 1, HOST), Stored(key(1), HOST, 1, HOST)])
    bus.publish(Moved(key(1), HOST, DISK, HOST))
    bus.publish(Evicted(key(1), HOST, DISK))
    wait_until(lambda: node_blocks(agent, ks) == [HOST, DISK, None, None], what="the events in the index")
    bus.publish(Removed(key(0)))
    wait_until(lambda: node_blocks(agent, ks) == [None, DISK, None, None], what="the removal in the index")
    # an overflow: the agent is told to resync and re-publishes what the store holds now
    holdings.blocks = [(key(2), HOST), (key(3), DISK)]
    bus.publish_all([Stored(key(i), HOST, 1, HOST) for i in range(10, 20)])
    assert sub.overflows == 1
    wait_until(lambda: node_blocks(agent, ks) == [None, None, HOST, DISK], what="the re-publication")
    wait_until(lambda: resyncs() == 2, what="the re-publication to be counted")


def test_the_holdings_snapshot_runs_off_the_agents_loop_which_keeps_serving(agent_and_holdings):
    agent, holdings = agent_and_holdings
    holdings.gate.clear()
    holdings.blocks = [(key(i), HOST) for i in range(5000)]
    agent.start()  # the first publication is a full one: it takes a snapshot
    assert holdings.entered.wait(30)
    # the snapshot is still in progress (blocked in the store), yet the loop answers queries
    assert node_blocks(agent, [b"k0"]) == [None]
    assert "strata-index" not in holdings.threads
    holdings.gate.set()
    wait_until(lambda: node_blocks(agent, [b"k0", b"k4999"]) == [HOST, HOST], what="the full publication")


def test_events_gather_while_the_thread_lingers_and_batches_stay_capped():
    bus = EventBus(linger_s=1.0, batch_events=4)
    try:
        rec = Recorder()
        bus.subscribe("gather", rec)
        for i in range(3):
            bus.publish(stored(i))
        wait_until(lambda: rec.batches, what="the lingering batch")
        assert rec.batches == [[stored(0), stored(1), stored(2)]], "one callback for events published together"
        for i in range(3, 11):
            bus.publish(stored(i))
        wait_until(lambda: sum(map(len, rec.batches)) == 11, what="full batches")
        assert [len(b) for b in rec.batches[1:]] == [4, 4], "batches are capped at batch_events"
    finally:
        bus.close()
