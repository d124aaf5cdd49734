"""The prefix index at fleet scale, for real: a fleet's KV-event, heartbeat and Score load on a Redis Cluster.

What drives it is the replay, not a model of it. One 10-node fleet replays the
first ``requests`` of a trace (:class:`benchmarks.fleet.sim.Fleet`, cache-aware
routing over the pool), and every call it makes to its index is recorded in
order: each node's ``add`` and ``remove`` batches (what a daemon's index agent
publishes of its store's events) and each request's ``lookup`` (what the
router's Score asks) with the answer the in-process index gave. A fleet of N
nodes is N/10 such fleets at once, each with node ids of its own and block
keys of its own (another model or tenant): ``copies`` lanes, each sending its
fleet's calls one after another, as fast as the cluster answers (time
compressed), against the real
:class:`kvstore.index.redis.RedisIndex` on a real Redis Cluster of 3 or 6
masters on loopback, while every node heartbeats at the daemons' rate (its TTL
over three), from a process of its own as each daemon heartbeats for itself. Either every fleet writes its own namespace (``namespaces:
per fleet``, a fleet of many models: the namespaces spread over the shards), or
all share one (``one``, a fleet of one model: a namespace lives on one
shard, whatever the cluster's size).

Reported per run: events (blocks added or removed) per second and lookups per
second sustained; lookup latency p50/p99; Redis memory per (block, holder)
entry and per node (``used_memory`` of the masters, over what the joins left);
Redis and client CPU seconds per 1,000 events; and every lookup's answer
checked against the in-process index's: a node credited with more blocks than
it held is a **false hit**, with fewer a **lost** entry.

The failover run kills (SIGKILL) the master of the busiest shard half way
through; its replica takes over after the cluster's node timeout. Calls that
fail meanwhile are retried every ``RETRY_S`` (as a daemon's agent re-publishes
once the index answers again), and the run reports the calls that failed, the
time from the kill until every lane's calls went through again, and the
entries the index lost or kept too long (writes the old master acknowledged
and had not yet passed to its replica) — at the end, against what every node
holds, and in the lookups' answers after the kill.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvstore.block import TierName
from kvstore.errors import PrefixIndexError
from kvstore.index.base import MAX_CHAIN_BLOCKS
from kvstore.index.memory import MemoryIndex

from benchmarks.fleet.sim import NAMESPACE, Fleet, FleetConfig
from benchmarks.fleet.trace import Trace

NODES_PER_FLEET = 10
TTL_S = 10.0  # the daemons' default [index] ttl_seconds: a heartbeat every TTL/3
RETRY_S = 0.1
RETRY_FOR_S = 60.0  # a lane gives up a call this long after its first failure
CLUSTER_NODE_TIMEOUT_MS = 1000


# ---- recording one fleet's calls -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Op:
    kind: str  # "add", "remove", "lookup"
    node: int  # the fleet's node (add, remove); -1 for a lookup
    keys: tuple[bytes, ...]
    tiers: tuple[TierName, ...] = ()  # add
    truth: tuple[tuple[int, int], ...] = ()  # lookup: (node, leading blocks) as the in-process index answered


class _RecordingIndex(MemoryIndex):
    """The in-process index, writing down every call the fleet's nodes and router make."""

    def __init__(self, clock, ids: list[str]) -> None:
        super().__init__(clock=clock)
        self.ops: list[Op] = []
        self._node = {node_id: i for i, node_id in enumerate(ids)}

    async def add(self, namespace, node_id, epoch, blocks):
        await super().add(namespace, node_id, epoch, blocks)
        self.ops.append(Op("add", self._node[node_id], tuple(k for k, _ in blocks), tuple(t for _, t in blocks)))

    async def remove(self, namespace, node_id, epoch, keys):
        await super().remove(namespace, node_id, epoch, keys)
        self.ops.append(Op("remove", self._node[node_id], tuple(keys)))

    async def lookup(self, namespace, keys, candidates=None):
        matches = await super().lookup(namespace, keys, candidates)
        self.ops.append(Op("lookup", -1, tuple(keys), truth=tuple((self._node[m.node_id], m.blocks) for m in matches)))
        return matches


def record(trace: Trace, ram_tokens: int) -> list[Op]:
    """The calls one 10-node fleet makes to its index replaying ``trace`` (cache-aware routing, the pool)."""
    config = FleetConfig(nodes=NODES_PER_FLEET, ram_tokens=ram_tokens, policy="cache-aware", pool=True)
    fleet = Fleet(trace, config)
    fleet.index = _RecordingIndex(lambda: fleet.now, fleet.ids)
    asyncio.run(fleet.replay())
    return fleet.index.ops


# ---- replaying them on a cluster --------------------------------------------------------------


@dataclass(frozen=True)
class IndexRun:
    nodes: int
    masters: int
    namespaces: str = "per fleet"  # or "one"
    failover: bool = False

    @property
    def fleets(self) -> int:
        return max(1, self.nodes // NODES_PER_FLEET)

    @property
    def label(self) -> str:
        return (f"{self.nodes} nodes, {self.masters} masters, namespaces {self.namespaces}"
                + (", failover" if self.failover else ""))


@dataclass
class _Tally:
    events: int = 0
    calls: int = 0
    lookups: int = 0
    lookup_s: list[float] = field(default_factory=list)
    false_hits: int = 0  # lookups that credited a node with more blocks than it held
    lost: int = 0  # ... with fewer
    after_kill: dict = field(default_factory=lambda: {"lookups": 0, "false_hits": 0, "lost": 0})
    failed_calls: int = 0
    first_failure: float | None = None
    last_failure: float | None = None
    gave_up: int = 0


def _key(fleet: int, key: bytes) -> bytes:
    """Fleet ``fleet``'s copy of a block key: the same length, its own key space."""
    return fleet.to_bytes(2, "big") + key[2:] if fleet else key


class _Replay:
    def __init__(self, index, ops: list[Op], run: IndexRun) -> None:
        self.index = index
        self.ops = ops
        self.run = run
        self.tally = _Tally()
        self.killed_at: float | None = None
        self.ids = [[f"f{f}-n{i}" for i in range(NODES_PER_FLEET)] for f in range(run.fleets)]

    def namespace(self, fleet: int) -> str:
        return NAMESPACE if self.run.namespaces == "one" else f"{NAMESPACE}-{fleet}"

    async def _call(self, make):
        """One index call, retried while the cluster fails over (see the module docstring)."""
        first = None
        while True:
            try:
                return await make()
            except PrefixIndexError:
                now = time.monotonic()
                t = self.tally
                t.failed_calls += 1
                t.first_failure = now if t.first_failure is None else t.first_failure
                t.last_failure = now
                first = now if first is None else first
                if now - first > RETRY_FOR_S:
                    t.gave_up += 1
                    return None
                await asyncio.sleep(RETRY_S)

    async def join(self) -> None:
        ids = [i for fleet in self.ids for i in fleet]
        for k in range(0, len(ids), 64):
            await asyncio.gather(*(self.index.join(i, 1, TTL_S) for i in ids[k:k + 64]))

    async def lane(self, fleet: int, progress: list[int]) -> None:
        ns, ids, t = self.namespace(fleet), self.ids[fleet], self.tally
        for n, op in enumerate(self.ops):
            keys = [_key(fleet, k) for k in op.keys]
            if op.kind == "lookup":
                started = time.monotonic()
                matches = await self._call(lambda: self.index.lookup(ns, keys))
                t.lookup_s.append(time.monotonic() - started)
                t.lookups += 1
                if matches is not None:
                    self._check(matches, op, ids)
            else:
                for k in range(0, len(keys), MAX_CHAIN_BLOCKS):
                    part = keys[k:k + MAX_CHAIN_BLOCKS]
                    if op.kind == "add":
                        blocks = list(zip(part, op.tiers[k:k + MAX_CHAIN_BLOCKS]))
                        await self._call(lambda: self.index.add(ns, ids[op.node], 1, blocks))
                    else:
                        await self._call(lambda: self.index.remove(ns, ids[op.node], 1, part))
                    t.calls += 1
                t.events += len(keys)
            progress[fleet] = n + 1

    def _check(self, matches, op: Op, ids: list[str]) -> None:
        got = {m.node_id: m.blocks for m in matches}
        want = {ids[node]: blocks for node, blocks in op.truth}
        t = self.tally
        after = self.killed_at is not None
        if after:
            t.after_kill["lookups"] += 1
        for node_id in got.keys() | want.keys():
            if got.get(node_id, 0) > want.get(node_id, 0):
                t.false_hits += 1
                if after:
                    t.after_kill["false_hits"] += 1
            elif got.get(node_id, 0) < want.get(node_id, 0):
                t.lost += 1
                if after:
                    t.after_kill["lost"] += 1


def held_at_end(ops: list[Op]) -> dict[int, set[bytes]]:
    """Per node of one fleet, the keys it holds once every call was made."""
    held: dict[int, set[bytes]] = {i: set() for i in range(NODES_PER_FLEET)}
    for op in ops:
        if op.kind == "add":
            held[op.node].update(op.keys)
        elif op.kind == "remove":
            held[op.node].difference_update(op.keys)
    return held


async def _compare_holdings(replay: _Replay, ops: list[Op]) -> dict:
    """Entries the cluster lacks (lost) or has beyond what the nodes hold (kept), fleet by fleet."""
    held = held_at_end(ops)
    keys = sorted({k for ks in held.values() for k in ks} | {k for op in ops if op.kind == "add" for k in op.keys})
    lost = kept = 0
    for fleet in range(replay.run.fleets):
        ids = replay.ids[fleet]
        for k in range(0, len(keys), MAX_CHAIN_BLOCKS):
            part = keys[k:k + MAX_CHAIN_BLOCKS]
            answer = await replay.index.holders(replay.namespace(fleet), [_key(fleet, key) for key in part])
            for key, holders in zip(part, answer):
                have = {h.node_id for h in holders}
                want = {ids[n] for n, ks in held.items() if key in ks}
                lost += len(want - have)
                kept += len(have - want)
    entries = sum(len(ks) for ks in held.values()) * replay.run.fleets
    return {"entries": entries, "lost": lost, "kept_too_long": kept}


def _heartbeats(url: str, ids: list[str], stop, rounds) -> None:
    """In a process of its own, as each daemon heartbeats for itself (not behind the lanes' calls): every
    node every TTL/3, until ``stop``; each round's seconds go to ``rounds``."""
    from kvstore.index.redis import RedisIndex

    async def beat() -> None:
        index = RedisIndex.from_url(url)
        try:
            while not stop.is_set():
                started = time.monotonic()
                for k in range(0, len(ids), 64):
                    results = await asyncio.gather(*(index.heartbeat(i, 1, TTL_S) for i in ids[k:k + 64]),
                                                   return_exceptions=True)
                    for r in results:
                        if isinstance(r, BaseException) and not isinstance(r, PrefixIndexError):
                            raise r
                rounds.put(time.monotonic() - started)
                while not stop.is_set() and time.monotonic() - started < TTL_S / 3:
                    await asyncio.sleep(0.05)
        finally:
            await index.close()

    asyncio.run(beat())


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _used_memory(server) -> int:
    info = server.cli("INFO", "memory")
    return int(next(line.split(":")[1] for line in info.splitlines() if line.startswith("used_memory:")))


async def _replay(run: IndexRun, ops: list[Op], url: str, servers, masters) -> dict:
    from kvstore.index.redis import RedisIndex
    from tests.support.redis_servers import master_of

    index = RedisIndex.from_url(url)
    replay = _Replay(index, ops, run)
    try:
        await replay.join()
        memory0 = sum(_used_memory(m) for m in masters)
        cpu0 = {m.port: _cpu_s(m.proc.pid) for m in masters}
        client0 = time.process_time()
        progress = [0] * run.fleets
        context = multiprocessing.get_context("spawn")
        stop, rounds = context.Event(), context.Queue()
        beats = context.Process(target=_heartbeats, args=(url, [i for f in replay.ids for i in f], stop, rounds),
                                daemon=True)
        beats.start()
        killer = None
        victim = None
        if run.failover:
            victim = master_of(servers, "{strata:%s}:meta" % replay.namespace(0))

            async def kill_half_way() -> None:
                while sum(progress) < len(ops) * run.fleets // 2:
                    await asyncio.sleep(0.01)
                victim.proc.kill()
                replay.killed_at = time.monotonic()

            killer = asyncio.create_task(kill_half_way())
        started = time.monotonic()
        await asyncio.gather(*(replay.lane(f, progress) for f in range(run.fleets)))
        wall = time.monotonic() - started
        client_cpu = time.process_time() - client0
        if killer is not None:
            await killer
        alive = [m for m in masters if m.proc.poll() is None]
        redis_cpu = sum(_cpu_s(m.proc.pid) - cpu0[m.port] for m in alive)
        memory = sum(_used_memory(m) for m in alive) if not run.failover else None
        # With the nodes still heartbeating: an expired node's entries stop counting for good.
        holdings = await _compare_holdings(replay, ops)
        stop.set()
        beat_rounds = []
        while beats.is_alive() or not rounds.empty():
            try:
                beat_rounds.append(rounds.get(timeout=0.2))
            except queue.Empty:
                pass
        beats.join()
    finally:
        await index.close()
    t = replay.tally
    lookups = sorted(t.lookup_s)
    out = {
        "nodes": run.nodes, "masters": run.masters, "namespaces": run.namespaces, "failover": run.failover,
        "fleets": run.fleets, "seconds": round(wall, 2),
        "events": t.events, "events_per_s": round(t.events / wall), "lookups": t.lookups,
        "lookups_per_s": round(t.lookups / wall), "heartbeats_per_s": round(run.nodes / (TTL_S / 3), 1),
        "heartbeat_round_max_s": round(max(beat_rounds), 3) if beat_rounds else None,
        "lookup_p50_ms": round(statistics.median(lookups) * 1000, 3) if lookups else None,
        "lookup_p99_ms": round(lookups[int(0.99 * (len(lookups) - 1))] * 1000, 3) if lookups else None,
        "redis_cpu_s_per_1000_events": round(redis_cpu / t.events * 1000, 4) if t.events else None,
        "client_cpu_s_per_1000_events": round(client_cpu / t.events * 1000, 4) if t.events else None,
        "entries": holdings["entries"],
        "false_hits": t.false_hits, "lost_in_lookups": t.lost,
        "lost_entries": holdings["lost"], "entries_kept_too_long": holdings["kept_too_long"],
    }
    if memory is not None:
        out["redis_bytes_per_entry"] = round((memory - memory0) / max(1, holdings["entries"]), 1)
        out["redis_bytes_per_node"] = round((memory - memory0) / run.nodes)
    if run.failover:
        out.update(failed_calls=t.failed_calls, calls_given_up=t.gave_up,
                   settled_after_s=round(t.last_failure - replay.killed_at, 2)
                   if t.last_failure is not None and replay.killed_at is not None else 0.0,
                   after_kill=t.after_kill, killed_master_port=victim.port if victim else None)
    return out


def run_one(run: IndexRun, ops: list[Op]) -> dict:
    """``run`` on a fresh cluster of its own (with one replica a master when it fails over)."""
    from tests.support.redis_servers import start_cluster

    with tempfile.TemporaryDirectory(prefix="strata-index-load-") as home:
        servers = start_cluster(Path(home), run.masters, replicas=1 if run.failover else 0,
                                node_timeout_ms=CLUSTER_NODE_TIMEOUT_MS)
        try:
            masters = servers[:run.masters]
            url = f"redis+cluster://127.0.0.1:{masters[0].port}"
            return asyncio.run(_replay(run, ops, url, servers, masters))
        finally:
            for s in servers:
                s.stop()


@dataclass(frozen=True)
class IndexPlan:
    requests: int  # of the trace, per 10-node fleet
    runs: tuple[IndexRun, ...]


_SIZES = tuple(IndexRun(n, m, ns) for n in (100, 1000) for m in (3, 6) for ns in ("per fleet", "one"))
INDEX_FULL = IndexPlan(1000, _SIZES + (IndexRun(100, 3, failover=True), IndexRun(1000, 6, failover=True)))
INDEX_QUICK = IndexPlan(200, tuple(replace(r) for r in _SIZES if r.nodes == 100) + (IndexRun(100, 3, failover=True),))
INDEX_SMOKE = IndexPlan(50, (IndexRun(20, 3), IndexRun(20, 3, "one", failover=True)))


def index_table(trace: Trace, plan: IndexPlan, ram_tokens: int, log=print) -> dict:
    """Every run of ``plan`` on a cluster of its own, as a table (columns, rows)."""
    from tests.support import redis_servers

    if not redis_servers.available():
        log("index at fleet scale: skipped (redis-server is not installed: apt-get install redis-server)")
        return {"columns": [], "rows": [], "skipped": "redis-server is not installed"}
    head = Trace(trace.name, trace.requests[:plan.requests], trace.source)
    started = time.perf_counter()
    ops = record(head, ram_tokens)
    log(f"index: {len(ops)} calls recorded from {len(head.requests)} requests of {trace.name} on a "
        f"{NODES_PER_FLEET}-node fleet in {time.perf_counter() - started:.1f} s")
    rows = []
    for run in plan.runs:
        started = time.perf_counter()
        row = run_one(run, ops)
        rows.append(row)
        log(f"index: {run.label}: {row['events_per_s']:,} events/s, {row['lookups_per_s']:,} lookups/s, lookup p50 "
            f"{row['lookup_p50_ms']} ms p99 {row['lookup_p99_ms']} ms, false hits {row['false_hits']}, lost "
            f"{row['lost_entries']} ({time.perf_counter() - started:.0f} s)")
    columns = list(dict.fromkeys(k for row in rows for k in row))
    return {"columns": columns, "rows": [[row.get(c) for c in columns] for row in rows],
            "requests_per_fleet": len(head.requests), "calls_per_fleet": len(ops), "trace": trace.name}


def answered_wrong(table: dict | None) -> list[str]:
    """The runs without a failover whose lookups or final holdings differ from the in-process index's:
    with no fault there must be none."""
    if not table or not table.get("rows"):
        return []
    out = []
    for row in (dict(zip(table["columns"], r)) for r in table["rows"]):
        if row["failover"]:
            continue
        bad = {k: row[k] for k in ("false_hits", "lost_in_lookups", "lost_entries", "entries_kept_too_long") if row[k]}
        if bad:
            out.append(f"{row['nodes']} nodes, {row['masters']} masters, namespaces {row['namespaces']}: {bad}")
    return out
