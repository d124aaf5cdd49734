"""RemoteBridge (kvstore/remote/bridge.py): the threaded store's door to an asynchronous source.

The source behind it is the in-process one, slowed with ``latency_s`` so that
calls are really in flight, queued, past their deadline or cut short by
close. Waiting for a state (a call admitted, the loop idle) polls with a
bound; nothing asserts how long anything took.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from kvstore.block import BlockKey, BlockMeta, TierName, checksum
from kvstore.errors import DeadlineExceeded, InvalidArgument, Overloaded, TierUnavailable
from kvstore.remote.base import ReadStatus, WriteStatus
from kvstore.remote.bridge import BridgeLimits, RemoteBridge
from kvstore.remote.memory import MemoryRemote, forget
from tests.support.wait import wait_until

SLOW_S = 30.0  # a latency no test waits out


def later() -> float:
    return time.monotonic() + 60.0


def soon() -> float:
    return time.monotonic() + 0.05


def block(n: int, seed: int = 0) -> tuple[bytes, BlockMeta]:
    data = random.Random(seed).randbytes(n)
    return data, BlockMeta(n, checksum(data))


def key(name: str) -> BlockKey:
    return BlockKey.checked("model-a", name.encode())


@pytest.fixture
def place(request):
    name = "b" + hashlib.blake2b(request.node.nodeid.encode(), digest_size=8).hexdigest()
    yield name
    forget(name)


@pytest.fixture
def bridges():
    """A function (source, limits) -> bridge; every bridge made is closed afterwards."""
    made: list[RemoteBridge] = []

    def make(source, limits: BridgeLimits = BridgeLimits()) -> RemoteBridge:
        made.append(RemoteBridge(source, limits))
        return made[-1]

    yield make
    for b in made:
        b.close()


def test_round_trip_through_the_bridge(place, bridges):
    bridge = bridges(lambda: MemoryRemote(place, tier=TierName.PEER))
    assert bridge.tier is TierName.PEER and bridge.name == f"memory://{place}"
    data, meta = block(100_000)
    assert [r.status for r in bridge.write([(key("k"), data, meta)], later())] == [WriteStatus.STORED]
    assert bridge.lookup([key("k"), key("none")], later()) == [meta, None]
    buffer = bytearray(meta.size)
    results = bridge.read([key("k"), key("none")], lambda i, m: memoryview(buffer), later())
    assert [r.status for r in results] == [ReadStatus.HIT, ReadStatus.MISS]
    assert bytes(buffer) == data
    assert bridge.delete([key("k")], later()) == 1
    stats = bridge.stats()
    assert (stats.running, stats.queued, stats.source.hits, stats.source.stored) == (0, 0, 1, 1)


def test_bridges_on_one_place_see_each_others_blocks(place, bridges):
    one = RemoteBridge.open(f"memory://{place}")
    two = bridges(MemoryRemote(place))
    try:
        data, meta = block(5000)
        one.write([(key("k"), data, meta)], later())
        assert two.lookup([key("k")], later()) == [meta]
    finally:
        one.close()


def test_calls_from_many_threads(place, bridges):
    bridge = bridges(MemoryRemote(place, capacity_bytes=64 << 20), BridgeLimits(max_in_flight=4, max_queued=64))
    threads, rounds = 8, 20

    def worker(t: int) -> int:
        done = 0
        for r in range(rounds):
            k = key(f"t{t}-r{r}")
            data, meta = block(4096 + r, seed=t * 1000 + r)
            [written] = bridge.write([(k, data, meta)], later())
            assert written.status is WriteStatus.STORED
            buffer = bytearray(meta.size)
            [result] = bridge.read([k], lambda i, m: memoryview(buffer), later())
            assert result.is_hit and bytes(buffer) == data
            done += 1
        return done

    with ThreadPoolExecutor(threads) as pool:
        assert sum(pool.map(worker, range(threads))) == threads * rounds
    stats = bridge.stats()
    assert (stats.running, stats.queued, stats.overloaded) == (0, 0, 0)
    assert stats.source.stored == stats.source.hits == threads * rounds


def test_under_pressure_every_call_is_answered_or_refused(place, bridges):
    limits = BridgeLimits(max_in_flight=2, max_queued=2)
    bridge = bridges(MemoryRemote(place, latency_s=0.001), limits)
    data, meta = block(2048)
    bridge.write([(key("k"), data, meta)], later())

    def worker(_: int) -> tuple[int, int]:
        answered = refused = 0
        for _ in range(25):
            try:
                assert bridge.lookup([key("k")], later()) == [meta]
                answered += 1
            except Overloaded as e:
                assert e.retry_after_s == limits.retry_after_s
                refused += 1
        return answered, refused

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(worker, range(8)))
    answered, refused = sum(a for a, _ in outcomes), sum(r for _, r in outcomes)
    assert answered + refused == 8 * 25 and answered > 0
    stats = bridge.stats()
    assert (stats.overloaded, stats.running, stats.queued) == (refused, 0, 0)


def test_beyond_the_queue_calls_are_refused_with_overloaded(place, bridges):
    limits = BridgeLimits(max_in_flight=1, max_queued=1, retry_after_s=0.2)
    bridge = bridges(MemoryRemote(place, latency_s=SLOW_S), limits)
    outcomes: list[BaseException | object] = []

    def call():
        try:
            outcomes.append(bridge.lookup([key("k")], later()))
        except Exception as e:  # noqa: BLE001 - the test inspects what each caller got
            outcomes.append(e)

    callers = [threading.Thread(target=call) for _ in range(2)]
    for c in callers:
        c.start()
    wait_until(lambda: (bridge.stats().running, bridge.stats().queued) == (1, 1), what="one call running, one queued")
    with pytest.raises(Overloaded) as refused:
        bridge.lookup([key("k")], later())
    assert refused.value.retry_after_s == 0.2
    assert bridge.stats().overloaded == 1
    bridge.close()  # ends both: the running one through the source, the queued one before its turn
    for c in callers:
        c.join(timeout=30)
        assert not c.is_alive()
    assert len(outcomes) == 2 and all(isinstance(o, TierUnavailable) for o in outcomes), outcomes


def test_a_deadline_passed_before_the_call_is_refused(place, bridges):
    bridge = bridges(MemoryRemote(place))
    with pytest.raises(DeadlineExceeded):
        bridge.lookup([key("k")], time.monotonic() - 1)
    assert bridge.stats().queued == 0


def test_a_slow_source_answers_by_the_deadline(place, bridges):
    bridge = bridges(MemoryRemote(place, latency_s=SLOW_S))
    with pytest.raises(DeadlineExceeded):
        bridge.lookup([key("k")], soon())
    data, meta = block(1000)
    [result] = bridge.write([(key("k"), data, meta)], soon())
    assert isinstance(result.error, DeadlineExceeded)
    wait_until(lambda: bridge.stats().running == 0, what="the slow calls to end")


def test_a_call_waiting_for_a_turn_gives_up_at_its_deadline(place, bridges):
    bridge = bridges(MemoryRemote(place, latency_s=SLOW_S), BridgeLimits(max_in_flight=1, max_queued=4))
    outcomes = []

    def hog():
        try:
            outcomes.append(bridge.lookup([key("k")], later()))
        except TierUnavailable as e:
            outcomes.append(e)

    hogging = threading.Thread(target=hog)
    hogging.start()
    wait_until(lambda: bridge.stats().running == 1, what="the first call to run")
    with pytest.raises(DeadlineExceeded, match="turn"):
        bridge.lookup([key("k")], soon())
    assert bridge.stats().timed_out == 1
    bridge.close()
    hogging.join(timeout=30)
    assert len(outcomes) == 1 and isinstance(outcomes[0], TierUnavailable)  # ended by close


class IgnoresDeadlines(MemoryRemote):
    """A source that breaks the contract: its lookup sleeps past the deadline it was given."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cancelled = threading.Event()

    async def lookup(self, keys, deadline):
        try:
            await asyncio.sleep(SLOW_S)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return [None] * len(keys)


def test_a_source_that_overruns_its_deadline_is_cancelled(place, bridges):
    source = IgnoresDeadlines(place)
    bridge = bridges(source, BridgeLimits(overrun_s=0.05))
    with pytest.raises(DeadlineExceeded):
        bridge.lookup([key("k")], soon())
    assert source.cancelled.is_set()
    wait_until(lambda: bridge.stats().running == 0, what="the cancelled call to end")
    assert bridge.stats().timed_out == 1


class BlocksTheLoop(MemoryRemote):
    """A source that breaks the contract worse: blocking work on the event loop thread."""

    async def lookup(self, keys, deadline):
        time.sleep(3.0)
        return [None] * len(keys)


def test_a_stuck_loop_is_reported_not_waited_for(place, bridges):
    bridge = bridges(BlocksTheLoop(place), BridgeLimits(overrun_s=0.05))
    with pytest.raises(TierUnavailable, match="stuck"):
        bridge.lookup([key("k")], soon())


def test_calls_from_inside_place_are_refused(place, bridges):
    bridge = bridges(MemoryRemote(place))
    data, meta = block(1000)
    bridge.write([(key("k"), data, meta)], later())

    def place_that_calls_back(i, m):
        bridge.lookup([key("k")], later())

    with pytest.raises(InvalidArgument, match="loop thread"):
        bridge.read([key("k")], place_that_calls_back, later())
    assert bridge.lookup([key("k")], later()) == [meta]  # the bridge still works


def test_close_is_clean_and_final(place):
    bridge = RemoteBridge(MemoryRemote(place))
    data, meta = block(1000)
    bridge.write([(key("k"), data, meta)], later())
    thread = bridge._thread
    bridge.close()
    assert not thread.is_alive()
    with pytest.raises(TierUnavailable, match="closed"):
        bridge.lookup([key("k")], later())
    bridge.close()  # idempotent
    with RemoteBridge(MemoryRemote(place)) as again:  # the blocks outlived the bridge
        assert again.lookup([key("k")], later()) == [meta]


def test_limits_are_checked():
    with pytest.raises(InvalidArgument):
        BridgeLimits(max_in_flight=0)
    with pytest.raises(InvalidArgument):
        BridgeLimits(overrun_s=0)


def test_a_source_that_cannot_be_built_leaves_no_thread():
    before = threading.active_count()
    with pytest.raises(InvalidArgument):
        RemoteBridge.open("nope://x")
    assert threading.active_count() == before
