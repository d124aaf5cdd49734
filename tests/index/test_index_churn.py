"""Churn: nodes restart, leave, clear and let their leases lapse while lookups, holders and sweeps run.

The prefix index promises (kvstore/index/base.py) that an answer never names a
holder that is not current. This test holds it to that while the membership
churns under concurrent readers, against the in-memory index, one
``redis-server`` and a 3-master Redis Cluster.

How the answers are judged. Every call that changes what the index holds
(``join``, ``leave``, ``clear``, ``add``, ``remove``) is made by one churn task,
one call at a time, and each is also applied to a plain model: ``states[i]`` is
what the index holds once the first ``i`` calls took effect, leases aside. A
reader notes, before it sends a query, how many calls had completed (``j``)
and, when the answer is back, how many had started (``k``): the query ran
against one of ``states[j..k]``. So an answer may only report what some state
in that window holds, which rules out rows of an incarnation that a completed
restart, leave or clear ended, and holder epochs older than a completed join.

Leases are the one thing the model does not replay. A reader counts a node
dead only when it is sure: it left (``leave`` returned), or its heartbeats
were stopped and nothing that could extend its lease (a heartbeat, a join, a
write) ended less than TTL + margin ago. A dead node may not appear in an
answer unless a join of it started before the answer came back.

Answers that miss something a node surely held throughout the query (a lease
mirror refreshed a moment late, say) are false misses: counted and printed,
not failed. Time is the memory index's injected clock, or real time for
Redis, where the churn spreads its steps over several TTLs so leases lapse
mid-run; no assertion is about how long anything took.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

import pytest

from kvstore.block import TierName
from kvstore.index.base import Holder, NodeInfo, NodeMatch, PrefixIndex, StaleEpoch, sort_matches
from kvstore.index.memory import MemoryIndex
from tests.support.index_rows import stored_rows, sweep_all

SEED = 1729
NODES = 12
STEPS = 300  # churn steps (one or a few index calls each)
TTL_S = 0.5
MARGIN_S = 0.1  # a lease counts as lapsed only this long after it certainly ran out
STEP_S = 0.01  # time let pass after each churn step (fake for memory, real for Redis)
BEAT_EVERY_S = TTL_S / 4
REDIS = [pytest.param(name, marks=pytest.mark.system) for name in ("redis", "redis-cluster")]  # real redis-servers
SWEEP_EVERY_S = TTL_S  # at most; a sweep also ends lapsed leases in Redis, the lookup must not rely on it
READERS = 3
FINAL_READS = 40  # reads each reader makes once every stopped lease has surely lapsed
WAIT_LIMIT_S = 30.0
NAMESPACES = ("churn-a", "churn-b")
TIERS = (TierName.GPU, TierName.HOST, TierName.DISK)


def _key(*parts: object) -> bytes:
    return hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=32).digest()


# Nine chains of 24 blocks: three shared 8-block roots (system prompts), three branches each.
ROOTS = [[_key("root", r, i) for i in range(8)] for r in range(3)]
CHAINS = [ROOTS[r] + [_key("branch", r, b, i) for i in range(16)] for r in range(3) for b in range(3)]
ALL_KEYS = sorted({k for c in CHAINS for k in c})
UNKNOWN = _key("never", "added")


# ---- the model ----------------------------------------------------------------------


@dataclass(frozen=True)
class State:
    """What the index holds after a prefix of the churn's calls, leases aside."""

    epochs: Mapping[str, int]  # members: joined and not left
    rows: Mapping[tuple[str, str], Mapping[bytes, TierName]]  # (namespace, node) -> its current rows

    def joined(self, node: str, epoch: int) -> State:
        return State({**self.epochs, node: epoch}, {k: v for k, v in self.rows.items() if k[1] != node})

    def left(self, node: str) -> State:
        epochs = dict(self.epochs)
        del epochs[node]
        return State(epochs, {k: v for k, v in self.rows.items() if k[1] != node})

    def cleared(self, node: str, namespace: str | None) -> State:
        rows = {k: v for k, v in self.rows.items() if not (k[1] == node and namespace in (None, k[0]))}
        return State(self.epochs, rows)

    def added(self, namespace: str, node: str, blocks: list[tuple[bytes, TierName]]) -> State:
        mine = {**self.rows.get((namespace, node), {}), **dict(blocks)}
        return State(self.epochs, {**self.rows, (namespace, node): mine})

    def removed(self, namespace: str, node: str, keys: list[bytes]) -> State:
        mine = {k: t for k, t in self.rows.get((namespace, node), {}).items() if k not in keys}
        return State(self.epochs, {**self.rows, (namespace, node): mine})

    def match(self, namespace: str, node: str, keys: list[bytes]) -> tuple[int, TierName | None]:
        """The leading blocks of ``keys`` the node holds, and the slowest tier among them."""
        rows = self.rows.get((namespace, node), {}) if node in self.epochs else {}
        n, tier = 0, None
        for key in keys:
            t = rows.get(key)
            if t is None:
                break
            n, tier = n + 1, max(t, tier or t)
        return n, tier

    def holders(self, namespace: str, key: bytes) -> set[Holder]:
        return {
            Holder(node, rows[key], self.epochs[node])
            for (ns, node), rows in self.rows.items()
            if ns == namespace and key in rows and node in self.epochs
        }


# ---- the cluster of nodes, as the churn and the readers see it --------------------------


@dataclass
class Node:
    id: str
    epoch: int = 0  # of the last join that returned
    member: bool = False
    left: bool = False  # a leave returned and no join started since
    gen: int = 0  # bumped when a join or leave starts: "still dead when the answer came back"
    beating: bool = False
    abandoned: bool = False  # heartbeats stopped (on purpose, or the index said the lease ran out)
    busy: bool = False  # a churn call on this node is in flight
    beats_in_flight: int = 0
    touched: float = float("-inf")  # when the last call that may have extended its lease returned
    refreshed: float = float("-inf")  # when the last call known to have extended its lease started


@dataclass
class Sight:
    """What a reader knew before sending a query."""

    done: int  # churn calls completed
    dead: dict[str, tuple[int, str]]  # node -> (gen, "left" | "expired")
    epochs: dict[str, int]  # node -> epoch its last completed join reached
    alive: dict[str, tuple[int, float]]  # node -> (gen, lease surely extended at), heartbeats running


class Clock:
    """Time as the backend sees it: the memory index's injected clock, or real time for Redis."""

    def __init__(self, fake: bool) -> None:
        self.fake = fake
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t if self.fake else time.monotonic()

    async def let_pass(self, seconds: float) -> None:
        if self.fake:
            self.t += seconds
            await asyncio.sleep(0)
        else:
            await asyncio.sleep(seconds)

    async def idle(self) -> None:
        """Between two rounds of a background loop: a turn for the others (real time: a short nap)."""
        await asyncio.sleep(0 if self.fake else 0.005)


class Churn:
    def __init__(self, ix: PrefixIndex, clock: Clock) -> None:
        self.ix = ix
        self.clock = clock
        self.nodes = {f"node-{i:02d}": Node(f"node-{i:02d}") for i in range(NODES)}
        self.states = [State({}, {})]
        self.done = 0
        self.stop = False
        self.failed = False
        self.readers_may_start = asyncio.Event()
        self.reads = [0] * READERS
        self.stats: Counter[str] = Counter()

    # ---- writes: one call at a time, each applied to the model ----------------------------

    async def call(self, node: Node, change: Callable[[State], State], op: Awaitable[None]) -> bool:
        """Run one index call that changes what it holds; False if the index refused it (lease ran out)."""
        before = self.states[-1]
        self.states.append(change(before))
        node.busy = True
        try:
            await op
        except StaleEpoch:
            self.states[-1] = before  # refused before writing anything
            self.lapsed(node)
            return False
        finally:
            node.busy = False
            self.done = len(self.states) - 1
        return True

    def lapsed(self, node: Node) -> None:
        """The index says the lease ran out although heartbeats were on (the loop fell behind)."""
        if node.beating:
            node.beating, node.abandoned = False, True
            self.stats["lease lapsed unplanned"] += 1

    async def join(self, node: Node, epoch: int) -> None:
        node.gen += 1
        node.beating = node.abandoned = node.left = False
        started = self.clock()
        await self.call(node, lambda s: s.joined(node.id, epoch), self.ix.join(node.id, epoch, TTL_S))
        node.epoch, node.member, node.beating = epoch, True, True
        node.touched, node.refreshed = self.clock(), started

    async def add(self, node: Node, rnd: random.Random, short: bool = False) -> None:
        ns = NAMESPACES[0] if rnd.random() < 0.7 else NAMESPACES[1]
        chain = rnd.choice(CHAINS)
        blocks = [(k, rnd.choice(TIERS)) for k in chain[: rnd.randint(1, 8 if short else len(chain))]]
        op = self.ix.add(ns, node.id, node.epoch, blocks)
        if await self.call(node, lambda s: s.added(ns, node.id, blocks), op):
            node.touched = self.clock()  # a write may stretch the namespace's lease mirror up to now + TTL
            self.stats["add"] += 1

    async def remove(self, node: Node, rnd: random.Random) -> None:
        ns = rnd.choice(NAMESPACES)
        mine = sorted(self.states[-1].rows.get((ns, node.id), {}))
        keys = rnd.sample(mine, min(len(mine), rnd.randint(1, 4))) or [rnd.choice(ALL_KEYS)]
        op = self.ix.remove(ns, node.id, node.epoch, keys)
        if await self.call(node, lambda s: s.removed(ns, node.id, keys), op):
            node.touched = self.clock()
            self.stats["remove"] += 1

    async def restart(self, node: Node, rnd: random.Random) -> None:
        """A new process: the next epoch, and a fresh (often smaller) set of blocks."""
        await self.join(node, node.epoch + 1)
        self.stats["restart"] += 1
        for _ in range(rnd.randint(0, 2)):
            await self.add(node, rnd, short=True)

    async def leave(self, node: Node) -> None:
        node.gen += 1
        node.beating = node.abandoned = False
        await self.call(node, lambda s: s.left(node.id), self.ix.leave(node.id))
        node.member, node.left = False, True
        self.stats["leave"] += 1

    async def clear(self, node: Node, namespace: str | None) -> None:
        await self.call(node, lambda s: s.cleared(node.id, namespace), self.ix.clear(node.id, namespace))
        self.stats["clear"] += 1

    def abandon(self, node: Node) -> None:
        node.beating, node.abandoned = False, True
        self.stats["heartbeats stopped"] += 1

    async def setup(self, rnd: random.Random) -> None:
        for node in self.nodes.values():
            await self.join(node, 1)
            for _ in range(rnd.randint(2, 4)):
                await self.add(node, rnd)

    async def churn(self, rnd: random.Random) -> None:
        ids = sorted(self.nodes)
        for _ in range(STEPS):
            if self.stop:
                return
            node = self.nodes[rnd.choice(ids)]
            roll = rnd.random()
            if not node.member:
                if roll < 0.5:
                    await self.restart(node, rnd)
            elif node.abandoned:  # mostly left alone, so that its lease runs out
                if roll < 0.15:
                    await self.restart(node, rnd)
                elif roll < 0.25:
                    await self.leave(node)
                elif roll < 0.30:
                    await self.clear(node, None)
            elif roll < 0.30:
                await self.add(node, rnd)
            elif roll < 0.45:
                await self.remove(node, rnd)
            elif roll < 0.60:
                await self.restart(node, rnd)
            elif roll < 0.70:
                await self.leave(node)
            elif roll < 0.80:
                self.abandon(node)
            elif roll < 0.90:
                await self.clear(node, rnd.choice(NAMESPACES))
            else:
                await self.clear(node, None)
            await self.clock.let_pass(STEP_S)

    # ---- background: heartbeats and sweeps --------------------------------------------

    async def heartbeats(self) -> None:
        while not self.stop:
            for node in self.nodes.values():
                if node.beating and self.clock() - node.refreshed >= BEAT_EVERY_S:
                    await self.beat(node)
            await self.clock.idle()

    async def beat(self, node: Node) -> None:
        gen, epoch, started = node.gen, node.epoch, self.clock()
        node.beats_in_flight += 1
        try:
            await self.ix.heartbeat(node.id, epoch, TTL_S)
        except StaleEpoch:
            if node.gen == gen:  # no restart or leave raced it: the lease really ran out
                self.lapsed(node)
        else:
            if node.gen == gen:
                node.touched, node.refreshed = self.clock(), max(node.refreshed, started)
        finally:
            node.beats_in_flight -= 1

    async def sweeper(self, rnd: random.Random) -> None:
        """Sweeps with small budgets at uneven intervals, so answers meet dead holders both before
        and after their rows (and, in Redis, their lease mirrors) are swept."""
        due = self.clock()
        while not self.stop:
            if self.clock() >= due:
                budget = rnd.randint(1, 24)
                n = await self.ix.sweep(budget)
                assert 0 <= n <= budget, f"sweep({budget}) deleted {n}"
                self.stats["rows swept"] += n
                due = self.clock() + rnd.uniform(0, SWEEP_EVERY_S)
            await self.clock.idle()

    # ---- readers ----------------------------------------------------------------------

    def surely_expired(self, node: Node, now: float) -> bool:
        return (
            node.member and node.abandoned and not node.busy and node.beats_in_flight == 0
            and now > node.touched + TTL_S + MARGIN_S
        )

    def look(self) -> Sight:
        now = self.clock()
        dead: dict[str, tuple[int, str]] = {}
        alive: dict[str, tuple[int, float]] = {}
        for n in self.nodes.values():
            if n.left:
                dead[n.id] = (n.gen, "left")
            elif self.surely_expired(n, now):
                dead[n.id] = (n.gen, "expired")
            elif n.member and n.beating:
                alive[n.id] = (n.gen, n.refreshed)
        return Sight(self.done, dead, {n.id: n.epoch for n in self.nodes.values()}, alive)

    def dead_throughout(self, sight: Sight, node_id: str) -> str | None:
        """Why the node was dead from before the query until its answer, if it surely was."""
        gen, why = sight.dead.get(node_id, (None, None))
        return why if gen == self.nodes[node_id].gen else None

    def alive_throughout(self, sight: Sight, node_id: str) -> bool:
        gen, refreshed = sight.alive.get(node_id, (None, 0.0))
        return gen == self.nodes[node_id].gen and self.clock() < refreshed + TTL_S - MARGIN_S

    def count_dead(self, sight: Sight, what: str) -> None:
        for node_id in sight.dead:
            why = self.dead_throughout(sight, node_id)
            if why:
                self.stats[f"{what}s checked against a node that {why}"] += 1

    async def reader(self, me: int, rnd: random.Random) -> None:
        ids = sorted(self.nodes)
        await self.readers_may_start.wait()
        while not self.stop:
            ns = rnd.choice(NAMESPACES)
            roll = rnd.random()
            if roll < 0.55:
                keys = list(rnd.choice(CHAINS))
                if rnd.random() < 0.3:
                    keys = keys[: rnd.randint(1, len(keys))]
                if rnd.random() < 0.1:
                    keys[rnd.randrange(len(keys))] = UNKNOWN
                candidates = rnd.sample(ids, 4) + ["node-zz"] if rnd.random() < 0.2 else None
                sight = self.look()
                got = await self.ix.lookup(ns, keys, candidates)
                self.check_lookup(sight, ns, keys, candidates, got)
            elif roll < 0.95:
                keys = rnd.sample(ALL_KEYS, rnd.randint(1, 24))
                sight = self.look()
                got_holders = await self.ix.holders(ns, keys)
                self.check_holders(sight, ns, keys, got_holders)
            else:
                sight = self.look()
                self.check_nodes(sight, await self.ix.nodes())
            self.reads[me] += 1
            await asyncio.sleep(0)

    def window(self, sight: Sight) -> list[State]:
        return self.states[sight.done :]  # completed before the query .. started before its answer

    def check_lookup(
        self, sight: Sight, ns: str, keys: list[bytes], candidates: list[str] | None, got: list[NodeMatch]
    ) -> None:
        states = self.window(sight)
        self.stats["lookups"] += 1
        self.count_dead(sight, "lookup")
        assert got == sort_matches(got) and len({m.node_id for m in got}) == len(got), got
        for m in got:
            where = f"lookup({ns}, {len(keys)} keys) named {m.node_id} with {m.blocks} blocks"
            assert m.node_id in self.nodes and (candidates is None or m.node_id in candidates), where
            why = self.dead_throughout(sight, m.node_id)
            assert why is None, f"{where}, but it {why} before the lookup began"
            possible = {s.match(ns, m.node_id, keys) for s in states}
            most = max(b for b, _ in possible)
            assert 1 <= m.blocks <= most, (
                f"{where}, but its incarnation(s) current during the call held at most {most} "
                f"(rows of an ended incarnation counted?)"
            )
            assert (m.blocks, m.tier) in possible, f"{where} at {m.tier!r}; the model allows {sorted(possible)}"
        answered = {m.node_id: m.blocks for m in got}
        for node_id in sight.alive:
            if (candidates is None or node_id in candidates) and self.alive_throughout(sight, node_id):
                least = min(s.match(ns, node_id, keys)[0] for s in states)
                if answered.get(node_id, 0) < least:
                    self.stats["false misses"] += 1

    def check_holders(self, sight: Sight, ns: str, keys: list[bytes], got: list[list[Holder]]) -> None:
        states = self.window(sight)
        self.stats["holders calls"] += 1
        self.count_dead(sight, "holders call")
        assert len(got) == len(keys)
        for key, hs in zip(keys, got):
            possible = set().union(*(s.holders(ns, key) for s in states))
            for h in hs:
                where = f"holders({ns}) named {h}"
                assert h.node_id in self.nodes, where
                why = self.dead_throughout(sight, h.node_id)
                assert why is None, f"{where}, but it {why} before the call began"
                assert h.epoch >= sight.epochs[h.node_id], (
                    f"{where}, but it had reached epoch {sight.epochs[h.node_id]} before the call began"
                )
                assert h in possible, f"{where}; the model allows {sorted(possible, key=str)} (an ended incarnation?)"
                if h.epoch > 1:
                    self.stats["holder epochs checked after a restart"] += 1
            named = {h.node_id for h in hs}
            for node_id in sight.alive:
                if node_id not in named and self.alive_throughout(sight, node_id):
                    if all(any(h.node_id == node_id for h in s.holders(ns, key)) for s in states):
                        self.stats["false misses"] += 1

    def check_nodes(self, sight: Sight, got: list[NodeInfo]) -> None:
        self.stats["nodes calls"] += 1
        for info in got:
            why = self.dead_throughout(sight, info.node_id)
            assert why != "left", f"nodes() listed {info} after it left"
            assert not (why == "expired" and info.alive), f"nodes() says {info.node_id} is alive; its lease ran out"
            assert info.epoch >= sight.epochs[info.node_id], f"nodes() says {info}: an older epoch"

    # ---- the run ------------------------------------------------------------------

    async def wait_for(self, predicate: Callable[[], bool], what: str) -> None:
        waited = 0.0
        while not predicate() and not self.failed:
            if waited > WAIT_LIMIT_S:
                pytest.fail(f"gave up waiting for {what}")
            await self.clock.let_pass(STEP_S)
            waited += STEP_S

    def all_stopped_leases_lapsed(self) -> bool:
        now = self.clock()
        return all(self.surely_expired(n, now) for n in self.nodes.values() if n.member and n.abandoned)

    async def settle(self) -> None:
        """Stop one more node's heartbeats, let every stopped lease surely lapse, then read some more."""
        for node in sorted(self.nodes.values(), key=lambda n: n.id):
            if node.beating:
                self.abandon(node)
                break
        await self.wait_for(self.all_stopped_leases_lapsed, "the stopped leases to lapse")
        target = [r + FINAL_READS for r in self.reads]
        await self.wait_for(lambda: all(r >= t for r, t in zip(self.reads, target)), "the final reads")

    async def run(self, rnd: random.Random) -> None:
        async with asyncio.TaskGroup() as tg:
            for work in [
                self.heartbeats(),
                self.setup_then_churn(rnd),
                self.sweeper(random.Random(SEED - 1)),
                *(self.reader(i, random.Random(SEED + 1 + i)) for i in range(READERS)),
            ]:
                tg.create_task(self.until_stopped(work))

    async def until_stopped(self, work: Awaitable[None]) -> None:
        """Whatever ends one task ends the others: every loop also watches ``stop``, because a
        cancellation can get lost inside a redis-py call and leave a loop running."""
        try:
            await work
        except BaseException:
            self.failed = True
            raise
        finally:
            self.stop = True

    async def setup_then_churn(self, rnd: random.Random) -> None:
        await self.setup(rnd)
        self.readers_may_start.set()
        await self.churn(rnd)
        await self.settle()

    async def check_quiet_index(self) -> None:
        """With the churn over: the index agrees exactly with the model, and leaves no rows behind."""
        for node in self.nodes.values():
            if node.beating:
                try:
                    await self.ix.heartbeat(node.id, node.epoch, 60.0)
                except StaleEpoch:
                    self.lapsed(node)
        await self.wait_for(self.all_stopped_leases_lapsed, "the last leases to lapse")
        state = self.states[-1]
        live = sorted(n.id for n in self.nodes.values() if n.member and not n.abandoned)
        for ns in NAMESPACES:
            for chain in CHAINS:
                want = sort_matches(_matches(state, ns, live, chain))
                assert await self.ix.lookup(ns, chain) == want, f"lookup({ns}) after the churn"
            want_holders = [
                sorted((h for h in state.holders(ns, key) if h.node_id in live), key=lambda h: h.node_id)
                for key in ALL_KEYS
            ]
            assert await self.ix.holders(ns, ALL_KEYS) == want_holders, f"holders({ns}) after the churn"
        for node in self.nodes.values():
            await self.ix.leave(node.id)
        self.stats["rows swept"] += sum(await sweep_all(self.ix, 64))
        for ns in NAMESPACES:
            assert await stored_rows(self.ix, ns) == [], f"rows of {ns} left behind after every node left"


def _matches(state: State, ns: str, nodes: Iterable[str], keys: list[bytes]) -> list[NodeMatch]:
    out = []
    for node in nodes:
        blocks, tier = state.match(ns, node, keys)
        if blocks:
            out.append(NodeMatch(node, blocks, tier))
    return out


# ---- the test -----------------------------------------------------------------------


@pytest.fixture(params=["memory", *REDIS])
def backend(request) -> tuple[str, Callable[[], PrefixIndex], Clock]:
    if request.param == "memory":
        clock = Clock(fake=True)
        return request.param, lambda: MemoryIndex(clock=clock), clock
    from kvstore.index.redis import RedisIndex

    url = request.getfixturevalue("redis_url" if request.param == "redis" else "redis_cluster_url")
    prefix = "t" + hashlib.blake2b(request.node.nodeid.encode(), digest_size=8).hexdigest()
    return request.param, lambda: RedisIndex.from_url(url, prefix=prefix), Clock(fake=False)


@pytest.mark.slow
def test_answers_never_name_a_dead_node_or_an_old_epoch_under_churn(backend, request):
    name, make, clock = backend

    async def main() -> Churn:
        ix = make()
        try:
            churn = Churn(ix, clock)
            await churn.run(random.Random(SEED))
            await churn.check_quiet_index()
            return churn
        finally:
            await ix.close()

    churn = asyncio.run(main())
    stats = churn.stats
    stats["false misses"] += 0  # printed even when there were none
    counts = ", ".join(f"{k}: {v}" for k, v in sorted(stats.items()))
    print(f"\n{name}: {len(churn.states) - 1} index calls by the churn; {counts}")
    request.node.user_properties.extend(sorted(stats.items()))
    # the run exercised what it claims to check
    assert stats["restart"] and stats["leave"] and stats["clear"] and stats["heartbeats stopped"]
    assert stats["lookups"] and stats["holders calls"] and stats["nodes calls"]
    assert stats["lookups checked against a node that left"] and stats["lookups checked against a node that expired"]
    assert stats["holder epochs checked after a restart"] and stats["rows swept"]
