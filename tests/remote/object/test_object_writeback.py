"""The write-back queue alone, over in-process sources (any remote source takes its uploads).

Which blocks a full queue drops (the oldest), retries after a failed upload
and the pause that goes with them, giving up after ``attempts``, blocks the
source refuses, corrupt input, a delete racing an upload, and the drain at
close. Sources are MemoryRemote (wrapped in FaultySource to fail calls), so
every outcome is decided by the test, not by timing.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from kvstore.block import BlockKey, BlockMeta, checksum
from kvstore.errors import BlockTooLarge, CorruptBlock, TierUnavailable
from kvstore.remote.bridge import RemoteBridge
from kvstore.remote.faults import FaultySource
from kvstore.remote.memory import MemoryRemote, forget
from kvstore.remote.object.metrics import ObjectMetrics
from kvstore.remote.object.writeback import WriteBack, WriteBackLimits
from tests.support.wait import wait_until


def block(i: int, size: int = 1000) -> tuple[BlockKey, bytes, BlockMeta]:
    data = bytes([i % 256]) * size
    return BlockKey("m", b"k%d" % i), data, BlockMeta(size, checksum(data))


def held(place: str, *keys: BlockKey) -> list[bool]:
    """What the named in-process place holds, asked through a source of this thread's own."""
    async def look():
        return await MemoryRemote(place).lookup(list(keys), time.monotonic() + 5)

    return [m is not None for m in asyncio.run(look())]


@pytest.fixture
def place(request):
    name = "wb-" + request.node.name[:40].replace("_", "-")
    yield name
    forget(name)


@pytest.fixture
def bridges():
    made: list[tuple[WriteBack, RemoteBridge]] = []

    def make(source, **limits) -> WriteBack:
        bridge = RemoteBridge(source)
        queue = WriteBack(bridge, WriteBackLimits(**{"pause_s": 0.01, "max_pause_s": 0.02, **limits}),
                          ObjectMetrics(), "test")
        made.append((queue, bridge))
        return queue

    yield make
    for queue, bridge in made:
        queue.close()
        bridge.close()


def test_a_full_queue_drops_its_oldest_blocks_first_and_keeps_serving_the_rest(bridges):
    stuck = MemoryRemote(latency_s=3600.0)  # every upload hangs: the queue only fills
    queue = bridges(stuck, max_blocks=3, uploads=1, drain_s=0)
    blocks = [block(i) for i in range(8)]
    for k, data, meta in blocks[:1]:
        assert queue.offer(k, data, meta)
    wait_until(lambda: queue.stats().uploading == 1, what="the first upload to start")
    for k, data, meta in blocks[1:]:
        assert queue.offer(k, data, meta)
    kept = [i for i, (k, _, _) in enumerate(blocks) if queue.pending(k) is not None]
    assert kept == [0, 6, 7], "the uploading block and the two newest stay; the oldest queued went first"
    assert queue.stats().outcomes["dropped"] == 5 and queue.stats().queued_blocks == 3
    assert queue.pending(blocks[7][0]) == (blocks[7][1], blocks[7][2])
    assert not queue.offer(*blocks[7]), "a block already queued is not queued twice"


def test_a_failed_upload_is_tried_again_and_then_stored(bridges, place):
    inner = MemoryRemote(place)
    queue = bridges(FaultySource(inner, fail_calls={1, 2}), attempts=3)
    k, data, meta = block(1)
    queue.offer(k, data, meta)
    wait_until(lambda: queue.stats().outcomes["uploaded"] == 1, what="the upload to succeed on its third try")
    assert held(place, k) == [True] and queue.stats().failing == "" and queue.pending(k) is None


def test_an_upload_that_keeps_failing_is_given_up_after_its_attempts(bridges, place):
    inner = MemoryRemote(place)
    faulty = FaultySource(inner, fail_calls=set(range(1, 100)))
    queue = bridges(faulty, attempts=3)
    k, data, meta = block(1)
    queue.offer(k, data, meta)
    wait_until(lambda: queue.stats().outcomes["failed"] == 1, what="the block to be given up")
    assert faulty.calls == 3 and held(place, k) == [False]
    assert "3 uploads failed in a row" in queue.stats().failing


def test_a_block_the_source_refuses_is_not_retried(bridges):
    small = MemoryRemote(capacity_bytes=1500)
    queue = bridges(small)
    for i in range(2):
        queue.offer(*block(i))
    wait_until(lambda: sum(queue.stats().outcomes.values()) == 2, what="both blocks to leave the queue")
    assert queue.stats().outcomes["uploaded"] == 1 and queue.stats().outcomes["refused"] == 1
    assert queue.stats().failing == "", "a full bucket is this block's problem, not an outage"


def test_bad_input_is_refused_at_the_door(bridges):
    queue = bridges(MemoryRemote(), max_bytes=4000)
    k, data, meta = block(1)
    with pytest.raises(CorruptBlock):
        queue.offer(k, data, BlockMeta(meta.size, meta.checksum ^ 1))
    with pytest.raises(CorruptBlock):
        queue.offer(k, data[:-1], meta)
    with pytest.raises(BlockTooLarge, match="queue_bytes"):
        queue.offer(*block(2, size=5000))
    assert queue.stats().outcomes["corrupt"] == 1 and queue.pending(k) is None


def test_a_block_deleted_while_it_uploads_is_removed_once_it_is_up(bridges, place):
    slow = MemoryRemote(place, latency_s=0.2)
    queue = bridges(slow)
    k, data, meta = block(1)
    queue.offer(k, data, meta)
    wait_until(lambda: queue.stats().uploading == 1, what="the upload to start")
    assert queue.discard(k) and queue.pending(k) is None
    wait_until(lambda: queue.stats().outcomes["uploaded"] == 1, what="the upload to end")
    wait_until(lambda: held(place, k) == [False], what="the deleted block to be removed from the source")


def test_close_drains_the_queue_then_refuses_more(bridges, place):
    inner = MemoryRemote(place, latency_s=0.01)
    queue = bridges(inner, uploads=2, drain_s=30)
    blocks = [block(i) for i in range(10)]
    for b in blocks:
        queue.offer(*b)
    queue.close()
    assert queue.stats().outcomes["uploaded"] == 10 and queue.stats().outcomes["closed"] == 0
    assert all(held(place, *[k for k, _, _ in blocks]))
    with pytest.raises(TierUnavailable, match="closing"):
        queue.offer(*block(99))
