"""After the faults: let the fleet settle, then read every acknowledged block back.

Settling is bounded: every daemon serves and every write-back queue is
empty. Then each acknowledged block (the probes' too) is read from the
daemon that acknowledged it (which falls through to its peers and the
bucket on a local miss), and a block it cannot serve from every other
daemon in turn. Every answer is checked against the ledger. A block no
daemon serves is classified:

- **destroyed by injected corruption**: the run overwrote its file on its
  daemon's disk and no other copy is left (the bucket has none: the
  killed S3 server took it, or it was not uploaded yet). The daemon found
  the damage and answered a miss (or DATA_LOSS), never the damaged bytes;
  the run, not the fleet, destroyed the block.
- **only copy was in the killed S3 server**: the bucket held it when the
  run killed the S3 server (moto keeps objects in memory), and no daemon
  holds it: its daemon had evicted it down to the bucket (a full disk makes
  room that way). The bucket's data loss, not the fleet's; no more blocks
  are put down to it than the fleet's disk evictions (:func:`classify`).
- **lost**: every other one, and any block the bucket still holds. The
  figure that must be 0.

Before reading, each block's own daemon is asked where it holds it
(Exists: the best tier it knows of, RAM, disk, or the bucket). A block it
holds in neither RAM nor disk that the run did not damage is counted
(``own_copy_gone``) even when the fleet still serves it from elsewhere;
the per-fault disk evictions say where such copies went.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict

import grpc

from benchmarks.chaos.fleet import NS, Fleet
from benchmarks.chaos.ledger import Acked, Ledger, Tally
from benchmarks.chaos.traffic import check
from kvstore.block import TierName
from kvstore.errors import StrataError

SETTLE_LIMIT_S = 60.0
BATCH = 32
TRIES = 5


def settle(fleet: Fleet) -> dict:
    """Wait (bounded) for every daemon to serve and every upload queue to drain; what was still queued."""
    end = time.monotonic() + SETTLE_LIMIT_S
    for node in fleet.nodes:
        fleet.wait_serving(node, max(1.0, end - time.monotonic()))
    queued: dict[str, float] = {}
    while time.monotonic() < end:
        queued = {n.name: n.metric("strata_object_writeback_queue_blocks") for n in fleet.nodes}
        if not any(queued.values()):
            break
        time.sleep(0.2)
    return {k: int(v) for k, v in queued.items() if v}


def _read(fleet: Fleet, i: int, keys: list[bytes]) -> list:
    """get_many from daemon ``i``, retried over a refusal (the fleet has settled: one is worth a second try)."""
    for attempt in range(TRIES):
        try:
            return fleet.clients[i].get_many(NS, keys)
        except (grpc.RpcError, StrataError):
            if attempt == TRIES - 1:
                raise
            time.sleep(1.0)
    raise AssertionError("unreachable")


def classify(unserved: list[Acked], damaged: set[bytes], in_bucket: set[bytes], bucket_at_kill: set[bytes],
             disk_evictions: int) -> tuple[list[Acked], list[Acked], list[Acked]]:
    """Blocks no daemon serves: (destroyed by injected corruption, only copy was in the killed S3 server, lost).

    A block the bucket holds now is lost whatever else happened to it: the fleet should have served it.
    Only a block a daemon evicted can have had its last copy in the bucket, so no more blocks than the
    fleet's disk evictions are put down to the killed server; any beyond that count as lost."""
    destroyed = [b for b in unserved if b.key in damaged and b.key not in in_bucket]
    bucket_only = [b for b in unserved if b not in destroyed and b.key in bucket_at_kill and b.key not in in_bucket]
    bucket_only = bucket_only[:max(disk_evictions, 0)]
    lost = [b for b in unserved if b not in destroyed and b not in bucket_only]
    return destroyed, bucket_only, lost


def _where_held(fleet: Fleet, with_owner: dict[int, list[Acked]]) -> dict[bytes, str]:
    """The best tier each block's own daemon names for it (Exists), "none" when it names none."""
    named: dict[bytes, str] = {}
    for owner, own in with_owner.items():
        with fleet.client(owner) as c:
            for b in own:
                tiers = c.exists(NS, [b.key])
                named[b.key] = tiers[0].label if tiers else "none"
    return named


def _read_back(fleet: Fleet, tally: Tally, with_owner: dict[int, list[Acked]]) -> tuple[list[Acked], list]:
    """Every block from its own daemon, then each one it missed from the others: (missed by its own daemon,
    [(block, the daemon that served it or None, its Block)])."""
    missing: list[Acked] = []
    for owner, own in with_owner.items():
        for start in range(0, len(own), BATCH):
            part = own[start:start + BATCH]
            for block, got in zip(part, _read(fleet, owner, [b.key for b in part])):
                if not check(tally, "audit", "audit", owner, block, None if got is None else got.data):
                    missing.append(block)
    found = []
    for block in missing:
        for other in (i for i in range(len(fleet.nodes)) if i != block.owner):
            [got] = _read(fleet, other, [block.key])
            if check(tally, "audit", "audit", other, block, None if got is None else got.data):
                found.append((block, other, got))
                break
        else:
            found.append((block, None, None))
    return missing, found


def audit(fleet: Fleet, ledger: Ledger, tally: Tally) -> dict:
    blocks = ledger.blocks()
    with_owner: dict[int, list[Acked]] = defaultdict(list)
    for b in blocks:
        with_owner[b.owner].append(b)
    named = _where_held(fleet, with_owner)
    local = (TierName.HOST.label, TierName.DISK.label)
    gone_locally = {k for k, tier in named.items() if tier not in local}
    missing, found = _read_back(fleet, tally, with_owner)
    elsewhere = [{"key": b.key.hex(), "owner": f"n{b.owner}", "owner_named": named[b.key],
                  "damaged": b.key in ledger.damaged, "served_by": f"n{other}", "from_tier": got.tier.label}
                 for b, other, got in found if other is not None]
    unserved = [b for b, other, _ in found if other is None]
    in_bucket = {b.key for b in unserved if fleet.in_bucket(b.key)}
    evicted = fleet.counters.fleet_total("strata_kv_evictions_total{tier=disk}")
    destroyed, bucket_only, lost = classify(unserved, set(ledger.damaged), in_bucket, fleet.bucket_at_kill, evicted)
    lost_at = fleet.bucket_lost_at
    return {
        "acknowledged_blocks": len(blocks),
        "served_by_own_daemon": len(blocks) - len(missing),
        "served_by_another_daemon": len(elsewhere),
        "served_by_another_daemon_examples": elsewhere[:20],
        "own_daemon_names_tier": dict(sorted(Counter(named.values()).items())),
        "own_copy_gone": len(gone_locally - set(ledger.damaged)),
        "own_copy_gone_damaged_by_the_run": len(gone_locally & set(ledger.damaged)),
        "disk_evictions": evicted,
        "destroyed_by_injected_corruption": len(destroyed),
        "destroyed_whose_bucket_copy_died_with_s3": sum(lost_at is not None and b.at_s < lost_at for b in destroyed),
        "only_copy_was_in_the_killed_s3": len(bucket_only),
        "lost": len(lost),
        "lost_examples": [{"key": b.key.hex(), "owner": f"n{b.owner}", "acked_s": round(b.at_s, 2),
                           "damaged": b.key in ledger.damaged, "in_bucket": b.key in in_bucket}
                          for b in lost[:20]],
    }
