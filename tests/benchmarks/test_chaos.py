"""The chaos benchmark's bookkeeping: what it counts as lost, destroyed, or refused (no fleet needed).

The benchmark itself runs in ``tests/benchmarks/test_bench_smoke.py`` (its ``--smoke``);
these pin the rules its headline figures rest on, which a smoke run with
no loss cannot exercise: a block the bucket still holds is never excused,
a block is put down to the killed S3 server only as far as evictions
explain it, and a damaged block is the run's doing only when no copy is
left.
"""

from __future__ import annotations

from benchmarks.chaos.audit import classify
from benchmarks.chaos.ledger import MISS, OK, WRONG, Acked, Tally, digest


def block(name: str, at_s: float = 1.0) -> Acked:
    return Acked(name.encode(), digest(name.encode()), len(name), 0, at_s)


def keys(blocks: list[Acked]) -> list[bytes]:
    return [b.key for b in blocks]


def test_a_damaged_block_with_no_copy_left_is_destroyed_not_lost():
    damaged = block("damaged")
    destroyed, bucket_only, lost = classify([damaged], {damaged.key}, set(), set(), 0)
    assert keys(destroyed) == [damaged.key] and bucket_only == [] and lost == []


def test_a_block_the_bucket_still_holds_is_lost_whatever_else_happened():
    held = block("held")
    destroyed, bucket_only, lost = classify([held], {held.key}, {held.key}, {held.key}, 10)
    assert destroyed == [] and bucket_only == [] and keys(lost) == [held.key]


def test_the_killed_server_takes_no_more_blocks_than_the_fleet_evicted():
    gone = [block(f"gone-{i}") for i in range(3)]
    destroyed, bucket_only, lost = classify(gone, set(), set(), set(keys(gone)), 2)
    assert destroyed == [] and keys(bucket_only) == keys(gone[:2]) and keys(lost) == keys(gone[2:])


def test_a_block_the_bucket_never_had_is_lost():
    never = block("never")
    assert classify([never], set(), set(), set(), 5) == ([], [], [never])


def test_the_tally_counts_refusals_by_reason_and_wrong_bytes_apart():
    tally = Tally()
    b = block("b")
    tally.record("steady", "get", OK, 0.2)
    tally.record("steady", "get", MISS)
    tally.record("daemon_kill", "put", "DaemonUnavailable", 1.5)
    tally.wrong_bytes("daemon_kill", "get", 1, b, b"x")
    assert tally.refusals() == {"put DaemonUnavailable": 1}
    assert tally.total(outcome=WRONG) == 1 and tally.wrong[0]["node"] == "n1"
    steady = tally.window_summary("steady")
    assert (steady["gets"], steady["served"], steady["misses"], steady["refused"]) == (2, 1, 1, {})
    assert tally.window_summary("daemon_kill")["slowest_op_s"] == 1.5
