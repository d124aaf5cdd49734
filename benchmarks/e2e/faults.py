"""Faults during a run, and what the requests around them saw.

The schedule is tied to progress, not to the clock: a fault fires once a
given share of the run's requests has been answered, so it lands mid-run on
a fast machine and a slow one alike.

1. **A daemon crashes**: replica ``daemon_replica``'s ``strata serve`` is
   SIGKILLed and, ``daemon_down_s`` later, started again on the same
   directories (a new epoch). It is the daemon the router asks for scores
   and the one its engine stores to and loads from: while it is down every
   request must still be answered (the engine recomputes what it cannot
   load; the router routes without scores), and none may fail for a cache
   reason.
2. **An engine crashes**: replica ``engine_replica``'s engine is SIGKILLed
   and stays down. Requests it was serving fail (a stream cut mid-way
   cannot be moved); the router must stop sending it new ones within one
   health interval.

Every failed request is put down to one reason, by what it met and when
it was in flight: ``engine_killed_in_flight`` (sent before the engine's
kill, failed after it), ``sent_to_dead_engine_within_health_interval``,
``sent_to_dead_engine_after_health_interval`` (a router fault),
``during_daemon_outage`` (a cache reason: the faults allow none), or
``other``. The actions run on one thread that lives until the run ends:
a child's ``PR_SET_PDEATHSIG`` fires when the thread that started it exits,
so the restarted daemon must not be started from a short-lived one.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from kvstore.errors import PrefixIndexError, StrataError

from benchmarks.e2e.fleet import Fleet, StartFailed
from benchmarks.e2e.stats import RequestRecord, Summary

log = logging.getLogger(__name__)

UPSTREAM_ERRORS = ("connect", "stream_broken", "http_502", "http_503", "http_504")
HOLD_LIMIT_S = 180.0  # the longest the last turns wait for the faults
ROTATION_WAIT_INTERVALS = 10  # give up watching for the router's reaction after this many health intervals


def _upstream_errors(samples: dict, endpoint: str) -> float:
    return sum(v for (name, labels), v in samples.items()
               if name == "strata_router_upstream_errors_total" and dict(labels).get("endpoint") == endpoint)


@dataclass(frozen=True)
class FaultPlan:
    daemon_replica: int = 0
    daemon_kill_after: float = 0.25  # share of the run's requests answered
    daemon_down_s: float = 5.0  # long enough that some turns arrive while it is down
    engine_replica: int = -1  # the last replica
    engine_kill_after: float = 0.6


@dataclass
class FaultEvent:
    what: str  # "daemon_killed", "daemon_ready", "engine_killed"
    replica: int
    at_s: float


class FaultInjector:
    """Runs a :class:`FaultPlan` against a fleet while the driver runs; use as a context manager."""

    def __init__(self, fleet: Fleet, plan: FaultPlan, clock: Callable[[], float], total_requests: int) -> None:
        self.fleet = fleet
        self.plan = plan
        self.clock = clock
        self.total = total_requests
        self.events: list[FaultEvent] = []
        self.errors: list[str] = []
        self._daemon_due = threading.Event()
        self._engine_due = threading.Event()
        self._done = threading.Event()
        self._finished = threading.Event()  # every fault has happened (or failed to)
        self._thread = threading.Thread(target=self._run, name="faults", daemon=True)
        self.errors_after_rotation: float | None = None

    @property
    def engine_replica(self) -> int:
        return self.plan.engine_replica % len(self.fleet.replicas)

    def observe(self, records: list[RequestRecord]) -> None:
        """The driver's ``on_answer``: counts answers, sets the faults due. Cheap; runs on the event loop."""
        answered = sum(1 for r in records if r.done_s is not None or r.error)
        if answered >= self.plan.daemon_kill_after * self.total:
            self._daemon_due.set()
        if answered >= self.plan.engine_kill_after * self.total:
            self._engine_due.set()

    async def hold(self) -> None:
        """The driver's ``before_last_turn``: wait (bounded) until every fault has happened, or the fault
        thread gave up, and while due faults wait for answers, fire them: a run too short for the
        schedule brings the faults forward rather than ending without them."""
        end = self.clock() + HOLD_LIMIT_S
        while not self._finished.is_set() and self.clock() < end:
            self._daemon_due.set()
            self._engine_due.set()
            await asyncio.sleep(0.05)

    def _wait(self, due: threading.Event) -> bool:
        while not due.wait(0.05):
            if self._done.is_set():
                return False
        return True

    def _run(self) -> None:
        p = self.plan
        try:
            if not self._wait(self._daemon_due):
                return
            daemon = self.fleet.nodes.nodes[p.daemon_replica].daemon
            daemon.kill()
            self.events.append(FaultEvent("daemon_killed", p.daemon_replica, self.clock()))
            if self._done.wait(p.daemon_down_s):
                return
            daemon.start()
            self.events.append(FaultEvent("daemon_ready", p.daemon_replica, self.clock()))
            if not self._wait(self._engine_due):
                return
            k = self.engine_replica
            self.fleet.replicas[k].engine.kill()
            self.events.append(FaultEvent("engine_killed", k, self.clock()))
            self._watch_rotation(k)
        except (StartFailed, OSError, subprocess.SubprocessError) as e:
            log.error("fault injection failed: %s", e)
            self.errors.append(f"{type(e).__name__}: {e}")
        finally:
            self._finished.set()
        self._done.wait()  # stay: the restarted daemon dies with the thread that started it

    def _watch_rotation(self, k: int) -> None:
        """Poll the router until it takes the dead engine out of rotation (its ``endpoint_healthy`` is 0)."""
        label = (("endpoint", str(k)),)
        deadline = self.clock() + ROTATION_WAIT_INTERVALS * self.fleet.spec.health_interval_s
        while self.clock() < deadline and not self._done.is_set():
            samples = self.fleet.router_metrics()
            if samples.get(("strata_router_endpoint_healthy", label)) == 0:
                self.events.append(FaultEvent("engine_out_of_rotation", k, self.clock()))
                self.errors_after_rotation = _upstream_errors(samples, str(k))
                return
            self._done.wait(0.05)
        self.errors.append(f"the router kept engine {k} in rotation for "
                           f"{ROTATION_WAIT_INTERVALS} health intervals after its SIGKILL")

    def upstream_errors_since_rotation(self) -> int | None:
        """Connections the router tried to the dead engine after taking it out of rotation (should be 0)."""
        if self.errors_after_rotation is None:
            return None
        return _upstream_errors(self.fleet.router_metrics(), str(self.engine_replica)) - self.errors_after_rotation

    def __enter__(self) -> FaultInjector:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(60)

    def stop(self) -> None:
        self._done.set()

    def report(self, records: list[RequestRecord]) -> dict:
        return fault_report(records, self.events, self.fleet.spec.health_interval_s, self.errors,
                            self.upstream_errors_since_rotation())


def _at(events: list[FaultEvent], what: str) -> float | None:
    return next((e.at_s for e in events if e.what == what), None)


def classify(r: RequestRecord, events: list[FaultEvent], health_interval_s: float) -> str:
    """The reason a failed request failed (see the module docstring)."""
    end = r.ended_s if r.ended_s is not None else float("inf")
    engine_killed = _at(events, "engine_killed")
    upstream = r.error.startswith(UPSTREAM_ERRORS)
    if engine_killed is not None and upstream:
        if r.sent_s < engine_killed:
            return "engine_killed_in_flight"
        if r.sent_s <= engine_killed + health_interval_s:
            return "sent_to_dead_engine_within_health_interval"
        return "sent_to_dead_engine_after_health_interval"
    killed, ready = _at(events, "daemon_killed"), _at(events, "daemon_ready")
    if killed is not None and r.sent_s <= (ready if ready is not None else float("inf")) + health_interval_s \
            and end >= killed:
        return "during_daemon_outage"
    return "other"


def _rotation_delay(events: list[FaultEvent]) -> float | None:
    killed, out = _at(events, "engine_killed"), _at(events, "engine_out_of_rotation")
    return None if killed is None or out is None else round(out - killed, 3)


def _window(r: RequestRecord, events: list[FaultEvent]) -> str:
    killed, ready, engine = _at(events, "daemon_killed"), _at(events, "daemon_ready"), _at(events, "engine_killed")
    if engine is not None and r.sent_s >= engine:
        return "after_engine_kill"
    if ready is not None and r.sent_s >= ready:
        return "after_daemon_restart"
    if killed is not None and r.sent_s >= killed:
        return "daemon_down"
    return "before_faults"


def fault_report(records: list[RequestRecord], events: list[FaultEvent], health_interval_s: float,
                 errors: list[str], upstream_errors_after_rotation: float | None = None) -> dict:
    """Counts answered and failed (by reason), and per window the TTFT and hit ratio of what was answered."""
    failed = [r for r in records if not r.ok]
    reasons = Counter(classify(r, events, health_interval_s) for r in failed)
    windows: dict[str, dict] = {}
    for name in ("before_faults", "daemon_down", "after_daemon_restart", "after_engine_kill"):
        rs = [r for r in records if _window(r, events) == name]
        ok = [r for r in rs if r.ok]
        prompt = sum(r.prompt_tokens for r in ok)
        windows[name] = {
            "sent": len(rs),
            "answered": len(ok),
            "ttft_s": Summary.of(r.ttft_s for r in ok).to_json(),
            "cache_hit_ratio": round(sum(r.cached_tokens for r in ok) / prompt, 3) if prompt else None,
        }
    cache_failures = reasons.get("during_daemon_outage", 0)
    return {
        "sent": len(records),
        "answered": len(records) - len(failed),
        "failed": len(failed),
        "failed_by_reason": dict(sorted(reasons.items())),
        "failed_for_a_cache_reason": cache_failures,
        "late_to_dead_engine": reasons.get("sent_to_dead_engine_after_health_interval", 0),
        "out_of_rotation_after_s": _rotation_delay(events),
        "router_upstream_errors_after_rotation": upstream_errors_after_rotation,
        "health_interval_s": health_interval_s,
        "events": [asdict(e) for e in events],
        "injection_errors": errors,
        "windows": windows,
        "failures": [{"session": r.session, "turn": r.turn, "sent_s": round(r.sent_s, 3),
                      "reason": classify(r, events, health_interval_s), "error": r.error[:200]} for r in failed],
    }


# ---- faults on the data: a damaged peer path, a rebooted host with a damaged disk block ----------------


@dataclass(frozen=True)
class DataFaultPlan:
    """The faults on the bytes themselves, for the pool policy (d), where most prefixes cross the peer path.

    1. **The peer path is damaged**: once ``peer_damage_after`` of the requests are answered, the
       proxy every other daemon reaches replica ``peer_replica``'s peer listener through flips one
       byte every ``peer_every`` bytes of what that daemon sends, ``peer_flips`` times, then is whole
       again (a flaky NIC or switch).
    2. **A host reboots with a damaged disk**: once ``reboot_after`` are answered, replica
       ``reboot_replica``'s daemon (None: the replica whose engine served the most turns of the
       sessions still running, so its disk holds blocks the next turns read) is SIGKILLed, its RAM tier lost (the arena removed, as a reboot
       empties the tmpfs), the last bytes of up to ``disk_blocks`` of its block files overwritten (per
       session with a turn still to send, the block of its last prompt nearest the middle that this
       disk holds and no other node does, by the index and by their disks: blocks the next turns read
       from here or nowhere), and it is started again: what it serves now comes from its disk.

    Every answer must still equal the reference's tokens: a damaged block costs a miss (the engine
    recomputes it), never a wrong token. The daemons' counters (:data:`DAMAGE_COUNTERS`) say whether the
    damage was met (a block failing its checksum on a tier or on arrival from a peer), not skipped.
    """

    peer_replica: int = 1
    peer_damage_after: float = 0.2
    peer_flips: int = 3
    peer_every: int = 100_003  # a prime: the flips land at varied offsets of the blocks
    reboot_replica: int | None = None
    reboot_after: float = 0.5
    disk_blocks: int = 6
    damage_bytes: int = 64


def damage_block_files(disk_dir: Path, namespace: str, chains: list[list[bytes]], n: int, nbytes: int,
                       elsewhere: list[Path] = ()) -> list[str]:
    """Overwrite the last ``nbytes`` of up to ``n`` block files under ``disk_dir``: per chain (a prompt's
    pool keys, block 0 first), the file of the block nearest the chain's middle that this disk holds
    and no disk of ``elsewhere`` does (the other nodes' disks: a copy there would be read instead).

    A node holds the blocks of the turns its engine served (and of none other, without sharing), so a
    session's chain is looked up whole: its earlier turns' blocks are a prefix of its last prompt's.
    A damaged block ends the prefix a load can take there: what follows it is a miss too."""
    from kvstore.block import BlockKey
    from kvstore.tiers.block_file import block_name

    damaged = []
    for keys in chains:
        if len(damaged) >= n:
            break
        held = []  # (distance from the middle, file, size)
        for i, key in enumerate(keys):
            if not key:  # a block another node holds too (see DataFaultInjector.held_only_by)
                continue
            name = block_name(BlockKey(namespace, key))
            f = disk_dir / "blocks" / name[:2] / name
            try:
                size = f.stat().st_size
            except FileNotFoundError:
                continue
            if any((other / "blocks" / name[:2] / name).exists() for other in elsewhere):
                continue
            if size > nbytes:
                held.append((abs(i - len(keys) // 2), f, size))
        if not held:
            continue
        _, f, size = min(held, key=lambda h: h[0])
        with open(f, "r+b") as out:
            out.seek(size - nbytes)
            tail = out.read(nbytes)
            out.seek(size - nbytes)
            out.write(bytes(b ^ 0x5A for b in tail))
        damaged.append(f.name)
    return damaged


DAMAGE_COUNTERS = {  # what a daemon counts when it meets damaged bytes, by the label that says where
    "strata_kv_corrupt_blocks_total": "tier",  # a block read from a tier failed its checksum
    "strata_peer_fallbacks_total": "reason",  # a holder passed over: corrupt (checksum), unavailable, ...
    "strata_peer_reads_total": "outcome",  # peer-tier reads: hit, miss, no_holder
}


def damage_seen(fleet: Fleet) -> dict[str, dict[str, int]]:
    """Each daemon's counts of damage met (:data:`DAMAGE_COUNTERS`), as ``name{label}`` -> count."""
    from benchmarks.e2e.fleet import scrape

    out: dict[str, dict[str, int]] = {}
    for n in fleet.nodes.nodes:
        try:
            samples = scrape(n.metrics_url)
        except OSError as e:
            out[n.node_id] = {"error": str(e)}
            continue
        counts = {}
        for (name, labels), v in samples.items():
            label = DAMAGE_COUNTERS.get(name)
            if label is not None and v:
                short = name.removeprefix("strata_").removesuffix("_total")
                counts[f"{short}{{{dict(labels).get(label, '')}}}"] = int(v)
        out[n.node_id] = dict(sorted(counts.items()))
    return out


class DataFaultInjector(FaultInjector):
    """Runs a :class:`DataFaultPlan` while the driver runs (the same progress-tied schedule and hold)."""

    def __init__(self, fleet: Fleet, plan: DataFaultPlan, clock: Callable[[], float], total_requests: int,
                 path, next_chains: Callable[[list[RequestRecord]], list[list[bytes]]],
                 live_sessions: Callable[[list[RequestRecord]], set[int]]) -> None:
        super().__init__(fleet, FaultPlan(daemon_kill_after=plan.peer_damage_after,
                                          engine_kill_after=plan.reboot_after), clock, total_requests)
        self.data_plan = plan
        self.path = path  # the damaged peer path's proxy (benchmarks.chaos.path.PeerPath)
        self.next_chains = next_chains  # answers so far -> pool keys of prompts whose sessions send another turn
        self.live_sessions = live_sessions  # answers so far -> the sessions with a turn still to send
        self.rebooted: int | None = None
        self.damaged_files: list[str] = []
        self.damaged_keys: list[bytes] = []  # the damaged blocks' keys, read back at the end (probe)
        self._records: list[RequestRecord] = []

    def observe(self, records: list[RequestRecord]) -> None:
        self._records = records
        super().observe(records)

    def _run(self) -> None:
        p = self.data_plan
        try:
            if not self._wait(self._daemon_due):
                return
            self.path.flip(True)
            self.events.append(FaultEvent("peer_path_damaged", p.peer_replica, self.clock()))
            if not self._wait(self._engine_due):
                return

            records = list(self._records)
            k = self.rebooted = p.reboot_replica if p.reboot_replica is not None else self.busiest(records)
            chains = self.held_only_by(self.fleet.nodes.nodes[k].node_id, self.next_chains(records))

            def damage(node) -> None:
                from kvstore.block import BlockKey
                from kvstore.tiers.block_file import block_name

                others = [n.disk_dir for n in self.fleet.nodes.nodes if n is not node]
                self.damaged_files = damage_block_files(node.disk_dir, self.fleet.phase.namespace, chains,
                                                        p.disk_blocks, p.damage_bytes, others)
                names = {block_name(BlockKey(self.fleet.phase.namespace, key)): key for c in chains for key in c if key}
                self.damaged_keys = [names[f] for f in self.damaged_files if f in names]

            self.events.append(FaultEvent("host_rebooting", k, self.clock()))
            self.fleet.nodes.restart_daemon(k, lose_ram=True, while_down=damage)
            self.events.append(FaultEvent("daemon_ready", k, self.clock()))
        except (StartFailed, OSError, subprocess.SubprocessError, RuntimeError) as e:
            log.error("data fault injection failed: %s", e)
            self.errors.append(f"{type(e).__name__}: {e}")
        finally:
            self._finished.set()
        self._done.wait()  # stay: the restarted daemon dies with the thread that started it

    def probe(self) -> dict[str, int]:
        """After the phase, each damaged block read once more from the rebooted daemon's own tiers, as an
        engine's pool load would (a later turn may have met it already, or may never have asked for it):
        each must be refused, never served. Counted: ``corrupt`` (refused by its checksum on this read),
        ``absent`` (met and dropped before), ``served`` (bytes came back: a damaged block served)."""
        out = {"corrupt": 0, "absent": 0, "served": 0}
        if self.rebooted is None or not self.damaged_keys:
            return out
        from kvstore.client import Client
        from kvstore.errors import CorruptBlock

        node = self.fleet.nodes.nodes[self.rebooted]
        try:
            with Client(node.target, use_shm=False, timeout=10) as c:
                for key in self.damaged_keys:
                    try:
                        block = c.get_many(self.fleet.phase.namespace, [key], local_only=True)[0]
                    except CorruptBlock:
                        out["corrupt"] += 1
                        continue
                    out["absent" if block is None else "served"] += 1
        except StrataError as e:
            self.errors.append(f"probe: {type(e).__name__}: {e}")
        return out

    def held_only_by(self, node_id: str, chains: list[list[bytes]]) -> list[list[bytes]]:
        """Each chain cut to the blocks the index names ``node_id`` the only holder of, in any tier (another
        node's copy, in RAM or on disk, would be read instead of the damaged one). The chains as they are
        when the index cannot be asked."""
        import asyncio

        from kvstore.index import open_index

        async def ask() -> list[list[bytes]]:
            index = open_index(self.fleet.nodes.redis_url)
            try:
                out = []
                for keys in chains:
                    holders = await index.holders(self.fleet.phase.namespace, keys) if keys else []
                    out.append([key if {h.node_id for h in held} == {node_id} else b"" for key, held in zip(keys, holders)])
                return out
            finally:
                await index.close()

        try:
            return asyncio.run(ask())
        except (PrefixIndexError, OSError) as e:
            log.warning("the index could not say who holds the blocks to damage (%s): choosing from the disks", e)
            return chains

    def busiest(self, records: list[RequestRecord]) -> int:
        """The replica whose engine answered the most turns of the sessions still running (ties: the
        lowest index other than the damaged peer path's): its disk holds what their next turns read."""
        replica = {self.fleet.phase.engine_id(i): i for i in range(len(self.fleet.replicas))}
        live = self.live_sessions(records)
        served = Counter(replica[r.engine_id] for r in records if r.ok and r.session in live and r.engine_id in replica)
        return min(range(len(self.fleet.replicas)),
                   key=lambda i: (-served[i], i == self.data_plan.peer_replica, i))

    def report(self, records: list[RequestRecord]) -> dict:
        failed = [r for r in records if not r.ok]
        return {
            "sent": len(records), "answered": len(records) - len(failed), "failed": len(failed),
            "events": [asdict(e) for e in self.events], "injection_errors": self.errors,
            "peer_path_bytes_flipped": self.path.flipped,
            "rebooted_replica": self.rebooted,
            "disk_block_files_damaged": len(self.damaged_files),
            "damaged_blocks_read_back": self.probe(),
            # Since each daemon's last start: the rebooted one counts from its reboot (the probe's reads included).
            "damage_met_by_daemon": damage_seen(self.fleet),
            "cache_hit_ratio": (round(sum(r.cached_tokens for r in records if r.ok)
                                      / max(1, sum(r.prompt_tokens for r in records if r.ok)), 3)),
            "failures": [{"session": r.session, "turn": r.turn, "error": r.error[:200]} for r in failed],
        }
