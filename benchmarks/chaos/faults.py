"""The faults, one at a time with the traffic running, and the probe that says each is over.

A :class:`Fault` breaks one thing (:meth:`inject`), leaves it broken for
``hold_s``, ends it (:meth:`heal`: a process resumed or started again, a
path mended, space freed), and then :meth:`probe` is tried every 50 ms
until it passes: the time from the end of the fault to the first passing
probe is the fault's *time to recover*. A probe is what a user of the
broken part would try first: a put and a get through a fresh client on
the daemon that was broken, the index naming a block's holder again, a
new block reaching the bucket, a block read over the peer path. A fault
whose probe never passes in ``RECOVER_LIMIT_S`` did not recover, and fails
the run.

Faults are named in :data:`FAULTS` (name → class), in the order a full run
injects them. The S3 server's kill comes after every fault that relies on
the bucket's copies, and the disk corruption after it, so that some of the
blocks it damages have lost their bucket copy with the killed server (the
case the audit has to tell apart from a loss; see :mod:`benchmarks.chaos.audit`).

Every fault is injected and healed from the main thread: a restarted
child's death signal is tied to the thread that started it.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable

import grpc

from benchmarks.chaos.fleet import NS, PREFIX, Fleet, fill, pause, resume
from benchmarks.chaos.ledger import Acked, Ledger, Tally, digest
from benchmarks.chaos.traffic import block_bytes, check
from kvstore.block import BlockKey, TierName
from kvstore.errors import CorruptBlock, StrataError

RECOVER_LIMIT_S = 90.0
PROBE_INTERVAL_S = 0.05
PROBE_BYTES = 32 << 10
CORRUPT_BYTES = 64  # overwritten at the end of each damaged block file (its payload)
DISK_EVICTIONS = "strata_kv_evictions_total{tier=disk}"


class Fault:
    """One fault: ``prepare`` (untimed), ``inject``, ``hold_s``, ``heal``, then ``probe`` until it passes.

    ``details`` collects what the fault did and what its probe met (bytes flipped, blocks damaged and
    how each was answered), for the report's row. A probe counts its reads in the tally under the
    fault's window, so a wrong answer to a probe is a wrong byte served like any other."""

    name = ""
    what = ""  # one line for the report

    def __init__(self, fleet: Fleet, ledger: Ledger, tally: Tally, clock: Callable[[], float], hold_s: float,
                 corrupt_blocks: int) -> None:
        self.fleet, self.ledger, self.tally, self.clock = fleet, ledger, tally, clock
        self.hold_s = hold_s
        self.corrupt_blocks = corrupt_blocks
        self.details: dict = {}
        self._probes = 0
        self._rng = random.Random(self.name)

    @property
    def target(self) -> str:
        return ""

    def available(self) -> str | None:
        """Why this fault cannot run here, or None."""
        return None

    def prepare(self) -> None:
        """What to look at before the fault starts (it is not part of the fault's time)."""

    def inject(self) -> None:
        raise NotImplementedError

    def heal(self) -> None:
        pass

    def probe(self) -> bool:
        raise NotImplementedError

    # ---- probes ---------------------------------------------------------------

    def _fresh_key(self) -> bytes:
        self._probes += 1
        return b"probe-%s-%d" % (self.name.encode(), self._probes)

    def round_trip(self, i: int) -> Acked | None:
        """A put and a get of a fresh block on daemon ``i`` through a fresh client; the block, acknowledged."""
        key = self._fresh_key()
        data = block_bytes(self._rng, PROBE_BYTES)
        try:
            with self.fleet.client(i) as c:
                if not c.put(NS, key, data):
                    return None
                block = Acked(key, digest(data), len(data), i, self.clock())
                self.ledger.acknowledge(block)
                return block if check(self.tally, self.name, "probe", i, block, c.get(NS, key)) else None
        except (grpc.RpcError, StrataError):
            return None


def _pid(fleet: Fleet, i: int) -> int:
    return fleet.nodes[i].proc.pid


class DaemonFault(Fault):
    """A fault of one daemon: the second (n1) unless a subclass says otherwise."""

    node = 1

    @property
    def target(self) -> str:
        return self.fleet.nodes[self.node].name

    def probe(self) -> bool:
        return self.round_trip(self.node) is not None


class PeerStall(DaemonFault):
    name = "peer_stall"
    what = "SIGSTOP a daemon (its peers and clients wait on it), SIGCONT after the hold"

    def inject(self) -> None:
        pause(_pid(self.fleet, self.node))

    def heal(self) -> None:
        resume(_pid(self.fleet, self.node))


class DaemonKill(DaemonFault):
    name = "daemon_kill"
    what = "SIGKILL a daemon; after the hold, start it again on the same directories (a new epoch)"

    def inject(self) -> None:
        self.fleet.counters.carry(self.node)  # its counters start again at 0
        self.fleet.nodes[self.node].kill()

    def heal(self) -> None:
        self.fleet.nodes[self.node].spawn()  # the probe waits for it to serve

    def probe(self) -> bool:
        return self.fleet.nodes[self.node].healthy() and super().probe()


class RedisKill(Fault):
    name = "redis_kill"
    what = ("SIGKILL Redis (no persistence: the index is lost); after the hold, start it again on its port; "
            "recovered when the index names n0 for a new block and for one acknowledged before the kill")

    @property
    def target(self) -> str:
        return "redis"

    def inject(self) -> None:
        self._old = next((b for b in reversed(self.ledger.blocks()) if b.owner == 0), None)
        self.fleet.redis.stop()

    def heal(self) -> None:
        self.fleet.restart_redis()

    def probe(self) -> bool:
        fresh = self.round_trip(0)
        keys = [k.key for k in (fresh, self._old) if k is not None]
        if fresh is None:
            return False
        try:
            held = self.fleet.clients[1].holders(NS, keys=keys)
        except (grpc.RpcError, StrataError):
            return False
        return all("n0" in {h.node_id for h in holders} for holders in held)


class S3Fault(Fault):
    NEW_BLOCK_EVERY_S = 1.0  # one upload may be given up on: keep offering new ones

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pending: list[Acked] = []
        self._last_put = float("-inf")

    @property
    def target(self) -> str:
        return "s3"

    def probe(self) -> bool:
        """A new block put on n0 reaches the bucket (its upload is asynchronous: polled, not waited for)."""
        if self.clock() - self._last_put >= self.NEW_BLOCK_EVERY_S:
            block = self.round_trip(0)
            if block is not None:
                self._pending.append(block)
                self._last_put = self.clock()
        if any(self.fleet.in_bucket(b.key) for b in self._pending):
            self._pending.clear()
            return True
        return False


class S3Stall(S3Fault):
    name = "s3_stall"
    what = "SIGSTOP the S3 server (uploads and read-throughs hang), SIGCONT after the hold"

    def inject(self) -> None:
        pause(self.fleet.moto.proc.pid)

    def heal(self) -> None:
        resume(self.fleet.moto.proc.pid)


class S3Kill(S3Fault):
    name = "s3_kill"
    what = ("SIGKILL the S3 server; after the hold, start it again on its port with an empty bucket (moto keeps "
            "objects in memory: every bucket copy made so far is gone)")

    def prepare(self) -> None:
        """The blocks the bucket holds now: the copies the kill will take (uploads finishing in between
        are missed, which only makes the audit stricter)."""
        listed = set(self.fleet.s3.all_keys(f"{PREFIX}/"))
        self.fleet.bucket_at_kill = {b.key for b in self.ledger.blocks()
                                     if self.fleet.layout.path(BlockKey(NS, b.key)) in listed}

    def inject(self) -> None:
        self.fleet.moto.stop()
        self.fleet.bucket_lost_at = self.clock()
        self.details["bucket_copies_lost"] = len(self.fleet.bucket_at_kill)

    def heal(self) -> None:
        self.fleet.restart_moto()


class PeerPathCorruption(Fault):
    name = "peer_path_corruption"
    what = ("flip a byte of every block n0 sends to its peers (a proxy on the path); recovered when a new n0 block "
            "is read from n1 over the peer path again")
    node = 0

    @property
    def target(self) -> str:
        return f"{self.fleet.nodes[self.node].name} peer path"

    def inject(self) -> None:
        path = self.fleet.paths[self.node]
        self._flipped = path.flipped
        path.flip(True)

    def heal(self) -> None:
        path = self.fleet.paths[self.node]
        path.flip(False)
        self.details["bytes_flipped"] = path.flipped - self._flipped

    def probe(self) -> bool:
        block = self.round_trip(self.node)
        if block is None:
            return False
        try:
            if not all("n0" in {h.node_id for h in hs} for hs in self.fleet.clients[1].holders(NS, keys=[block.key])):
                return False
            hits = self.fleet.nodes[1].metric("strata_peer_reads_total", outcome="hit")
            got = self.fleet.clients[1].get(NS, block.key)
            served = check(self.tally, self.name, "probe", 1, block, got)
            return bool(served) and self.fleet.nodes[1].metric("strata_peer_reads_total", outcome="hit") > hits
        except (grpc.RpcError, StrataError, OSError):  # OSError: n1's metrics did not answer
            return False


class DiskFull(DaemonFault):
    name = "disk_full"
    what = ("fill the filesystem under a daemon's disk tier to its last byte; after the hold, free it; recovered "
            "when its disk tier serves again and a put and get pass")

    @property
    def node(self) -> int:
        return len(self.fleet.nodes) - 1

    def available(self) -> str | None:
        return None if self.fleet.small_disk is not None else self.fleet.small_disk_note

    def inject(self) -> None:
        self._filler = fill(self.fleet.small_disk)

    def heal(self) -> None:
        self._filler.unlink()

    def probe(self) -> bool:
        return self.fleet.disk_serving(self.node) and super().probe()


class DiskCorruption(DaemonFault):
    name = "disk_corruption"
    what = ("overwrite the last bytes of block files on n0's disk (blocks held there and not in its RAM); "
            "recovered when each has been read back from n0: its own bytes from another copy, a miss or DATA_LOSS")
    node = 0

    def prepare(self) -> None:
        self._chosen = self._victims()

    def inject(self) -> None:
        victims = self._chosen
        for block in victims:
            path = self.fleet.block_file(self.node, block.key)
            with open(path, "r+b") as f:
                f.seek(-CORRUPT_BYTES, os.SEEK_END)
                tail = f.read(CORRUPT_BYTES)
                f.seek(-CORRUPT_BYTES, os.SEEK_END)
                f.write(bytes(b ^ 0x5A for b in tail))
            self.ledger.damaged[block.key] = self.node
        self._victims_left = list(victims)
        self.details["blocks_damaged"] = len(victims)
        lost_at = self.fleet.bucket_lost_at
        self.details["of_which_acknowledged_before_the_s3_kill"] = (
            sum(b.at_s < lost_at for b in victims) if lost_at is not None else 0)

    def _victims(self) -> list[Acked]:
        """Blocks n0 acknowledged whose best copy on n0 is on disk, oldest first: half from before the S3
        server's kill (their bucket copy died with it), half from after (the bucket has one), where there
        are both."""
        own = [b for b in self.ledger.blocks() if b.owner == self.node and not b.key.startswith(b"probe-")]
        lost_at = self.fleet.bucket_lost_at
        groups = [[b for b in own if b.at_s < lost_at], [b for b in own if b.at_s >= lost_at]] if lost_at else [own]
        picked: list[Acked] = []
        with self.fleet.client(self.node) as c:
            for g, group in enumerate(groups):
                want = self.corrupt_blocks * (g + 1) // len(groups) - len(picked)  # the rest: into the last group
                for block in group[: 8 * self.corrupt_blocks]:
                    if want <= 0:
                        break
                    on_disk = self.fleet.block_file(self.node, block.key).exists()
                    if on_disk and c.exists(NS, [block.key]) == [TierName.DISK]:
                        picked.append(block)
                        want -= 1
        return picked

    def probe(self) -> bool:
        """Read each damaged block back from n0 once: its bytes from a sound copy, a miss, or DATA_LOSS,
        never the damaged bytes. Counted by the tier that answered (``host``: read before the damage
        reached RAM, so the damaged file was not read)."""
        try:
            with self.fleet.client(self.node) as c:
                while self._victims_left:
                    block = self._victims_left[0]
                    try:
                        [got] = c.get_many(NS, [block.key])
                    except CorruptBlock:
                        answer = "refused_data_loss"
                    else:
                        data = None if got is None else got.data
                        served = check(self.tally, self.name, "probe", self.node, block, data)
                        answer = (f"served_from_{got.tier.label}" if served else
                                  "served_as_a_miss" if served is None else "wrong_bytes")
                    self.details[answer] = self.details.get(answer, 0) + 1
                    self._victims_left.pop(0)
        except (grpc.RpcError, StrataError):
            return False
        return True


FAULTS: dict[str, type[Fault]] = {f.name: f for f in (
    PeerStall, DaemonKill, RedisKill, S3Stall, PeerPathCorruption, DiskFull, S3Kill, DiskCorruption)}


def run_fault(fault: Fault, settle_s: float) -> dict:
    """Inject, hold, heal, probe until recovered; then let the fleet settle. The fault's row of the report."""
    tally, clock = fault.tally, fault.clock
    evicted = fault.fleet.counters.fleet_total(DISK_EVICTIONS)
    fault.prepare()
    tally.window = fault.name
    started = clock()
    fault.inject()
    time.sleep(fault.hold_s)
    ended = clock()
    fault.heal()
    recovered = None
    while clock() - ended < RECOVER_LIMIT_S:
        if fault.probe():
            recovered = clock() - ended
            break
        time.sleep(PROBE_INTERVAL_S)
    tally.window = "steady"
    evicted = fault.fleet.counters.fleet_total(DISK_EVICTIONS) - evicted
    time.sleep(settle_s)
    return {"fault": fault.name, "target": fault.target, "what": fault.what, "started_s": round(started, 2),
            "held_s": round(ended - started, 2), "recovery_s": None if recovered is None else round(recovered, 3),
            "recovered": recovered is not None, **fault.details, "disk_evictions": evicted,
            **tally.window_summary(fault.name)}
