"""The replicator: keeps k copies of a replicated namespace's (or a pin's) blocks on distinct live nodes.

Every daemon runs one (``[replication] namespaces``, and pins that ask for
``replicas``: :mod:`kvstore.replication.pin_copies`, whose work runs first in
each round, from the same budgets). In rounds, each
``interval_s`` apart, it walks the blocks this node holds in replicated
namespaces (a cursor over the store's listing, ``blocks_per_round`` blocks a
round, resumed where the last round stopped), asks the prefix index who
holds them (one ``holders`` call per batch) and, for a block with fewer than
k live holders, pushes a copy to nodes that lack it over the peer data plane
(:meth:`~kvstore.peer.base.PeerTransport.write`, the TCP transport: the
target's peer listener stores it, checked against the block's checksum,
and the target's index agent publishes it). A holder that disappears
(killed, restarted with an empty cache, left) drops out of the index's
answers once its heartbeats lapse; the next pass over that block restores
the count.

Who pushes, and where to. Every holder of an under-replicated block sees
the same shortfall; only the holder with the **smallest node id** among
the block's current holders (this node counted, whatever the index says of
it) pushes, so two holders do not both copy it to the same place. Targets
are the live nodes that advertise a writable peer transport and do not hold
the block, ranked by a hash of (block key, node id) (rendezvous hashing):
deterministic, so every holder would pick the same targets, and spread, so
the copies of a node's blocks do not all land on one neighbour. Views can
differ for a moment (an agent that has not published yet): the worst case
is one copy too many, never a lost block. Extra copies are not trimmed:
they are cache, and go when capacity needs them.

A push counts as a copy for ``settle_s`` before the target's index agent
publishes it, so the next round does not push it again; a target whose push
failed is passed over for ``backoff_s``. Limits: ``blocks_per_round``
checks, ``bytes_per_round`` pushed (one block in flight at a time; a block
larger than that budget goes alone in its round), ``push_s`` per push. A k
larger than the live nodes can give is reported, not retried harder: rounds
keep their interval, whatever they find.

Copies are cache, not storage: a replicated block's copy on a node may be
evicted by capacity like any other block (pin it to keep it); the replicator
restores the count when it next finds the block short, as long as one copy
is left. What it reports (:meth:`report`, the ``Replication`` RPC and
``strata replication``): per namespace, the blocks this node holds, those
found with fewer than k live holders at their latest check, and the copies
it made or failed to make. Each holder reports the blocks it holds, so a
fleet-wide sum counts a block once per holder.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvstore.block import BlockKey
from kvstore.replication.pin_copies import PinCopies, PinLimits, PinNamespaceReport
from kvstore.replication.policy import ReplicationPolicy
from kvstore.replication.pusher import Pusher, rank
from kvstore.errors import InvalidArgument, PrefixIndexError, StrataError, UnknownNamespace
from kvstore.index.base import MAX_CHAIN_BLOCKS, NodeInfo, PrefixIndex
from kvstore.peer.base import PeerTransport
from kvstore.peer.source import LOCAL_TIERS
from kvstore.store.tiered import MAX_LIST_PAGE

log = logging.getLogger(__name__)

INDEX_TIMEOUT_S = 5.0
__all__ = ["Plan", "ReplicationLimits", "ReplicationReport", "Replicator", "open_replicator", "plan", "rank"]


@dataclass(frozen=True, slots=True)
class ReplicationLimits:
    interval_s: float = 1.0
    blocks_per_round: int = 256
    bytes_per_round: int = 256 << 20
    push_s: float = 10.0
    settle_s: float = 5.0  # a push counts as a copy this long before the index shows it
    backoff_s: float = 5.0  # a target whose push failed is passed over this long
    max_pin_replicas: int = 4  # the most copies a Pin may ask for; 1: pins are never replicated
    max_pins: int = 4096  # pins with replicas kept at once

    def __post_init__(self) -> None:
        if not (self.interval_s > 0 and self.push_s > 0 and self.settle_s >= 0 and self.backoff_s >= 0):
            raise InvalidArgument("replication limits: interval_s and push_s must be positive, settle_s and backoff_s not negative")
        if self.blocks_per_round < 1 or self.bytes_per_round < 1:
            raise InvalidArgument("replication limits: check at least one block and push at least one byte a round")


@dataclass(frozen=True, slots=True)
class Plan:
    """One block's replication, as every holder that sees the same index computes it."""

    holders: frozenset[str]  # live nodes holding it (this one included)
    pusher: str  # the holder that pushes the missing copies
    targets: tuple[str, ...]  # nodes to push to, best first (at most the shortfall)

    @property
    def short(self) -> int:
        return len(self.targets)


def plan(key: bytes, k: int, node_id: str, holders: Iterable[str], writable: Iterable[str]) -> tuple[int, Plan]:
    """The shortfall of ``key`` (k minus its live holders, this node counted; 0 when none) and
    its plan: who pushes, and to which of the ``writable`` nodes (live, reachable for a push)."""
    held = frozenset(holders) | {node_id}
    short = max(0, k - len(held))
    targets = tuple(rank(key, (n for n in writable if n not in held)))[:short] if short else ()
    return short, Plan(held, min(held), targets)


@dataclass
class NamespaceReport:
    namespace: str
    rule: str
    replicas: int
    blocks: int = 0  # blocks this node holds here (at the last complete pass, or so far in the first)
    under_replicated: int = 0  # of them, found with fewer than k live holders at their latest check
    copies_made: int = 0
    copies_failed: int = 0


@dataclass
class ReplicationReport:
    node_id: str
    rounds: int = 0
    passes: int = 0  # complete walks over every replicated block
    last_round_at: float = 0.0  # wall clock (time.time), 0: no round yet
    last_error: str = ""  # why the latest round stopped short ("": it did not)
    namespaces: list[NamespaceReport] = field(default_factory=list)
    pins: list[PinNamespaceReport] = field(default_factory=list)  # this node's pins that ask for copies
    namespaces_enabled: bool = True  # whether any [replication] namespaces rule is set
    max_pin_replicas: int = 1


class ReplicationMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.under = Gauge(
            "strata_replication_under_replicated_blocks",
            "Blocks this node holds in replicated namespaces found with fewer live holders than their rule asks "
            "(at each block's latest check), by rule", ["rule"], registry=r,
        )
        self.copies = Counter(
            "strata_replication_copies_total",
            "Copies of under-replicated blocks pushed to other nodes, by outcome: made (stored or already "
            "present there), failed", ["outcome"], registry=r,
        )
        self.pushed_bytes = Counter("strata_replication_pushed_bytes_total", "Block bytes pushed to other nodes", registry=r)
        self.pinned_under = Gauge(
            "strata_replication_pinned_under_replicated_blocks",
            "Blocks of this node's pins that ask for replicas found with fewer copies on distinct live nodes than "
            "asked (this one counted, at each pin's latest check)", registry=r,
        )
        self.pinned_copies = Gauge(
            "strata_replication_pinned_copies",
            "Copies of this node's pinned blocks held (pinned) on other nodes for those pins", registry=r,
        )
        self.checked = Counter("strata_replication_checked_blocks_total", "Blocks whose holders were checked", registry=r)
        self.rounds = Counter(
            "strata_replication_rounds_total", "Replication rounds, by outcome: ok, error (the index did not answer)",
            ["outcome"], registry=r,
        )
        self.last_round = Gauge(
            "strata_replication_last_round_timestamp_seconds", "Unix time the latest replication round ended", registry=r
        )
        for outcome in ("made", "failed"):
            self.copies.labels(outcome)
        for outcome in ("ok", "error"):
            self.rounds.labels(outcome)


class _Namespace:
    """One namespace's state between rounds."""

    def __init__(self, rule: str, k: int) -> None:
        self.rule, self.k = rule, k
        self.seen: set[bytes] = set()  # keys checked in the current pass
        self.under: set[bytes] = set()  # keys short of k at their latest check
        self.blocks_last_pass: int | None = None
        self.made = self.failed = 0


class Replicator:
    """Thread-safe to :meth:`report` from anywhere; :meth:`start` runs rounds in its own thread."""

    def __init__(
        self,
        store,
        index: PrefixIndex,
        node_id: str,
        policy: ReplicationPolicy,
        limits: ReplicationLimits = ReplicationLimits(),
        *,
        index_loop: asyncio.AbstractEventLoop | None = None,
        token: str = "",
        transports: Mapping[str, PeerTransport] | None = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``store``: the daemon's store group (namespaces, list_keys, get). ``index`` lives on
        ``index_loop`` (the index agent's; None: the loop rounds run on). ``token``: the bearer
        token presented to the targets' peer listeners (it must let this node write there)."""
        self._store = store
        self._index = index
        self._index_loop = index_loop
        self.node_id = node_id
        self.policy = policy
        self.limits = limits
        self.metrics = ReplicationMetrics(registry)
        self._clock = clock
        self._pusher = Pusher(node_id, push_s=limits.push_s, backoff_s=limits.backoff_s, token=token,
                              transports=transports, clock=clock)
        self.pins = PinCopies(
            store, node_id, self._pusher,
            PinLimits(limits.max_pin_replicas, limits.max_pins, limits.blocks_per_round, limits.settle_s,
                      renew_s=3 * limits.interval_s),
            self.metrics, clock,
        )
        self._lock = threading.Lock()
        self._ns: dict[str, _Namespace] = {}
        self._pass: list[str] = []  # namespaces of the current pass, in order
        self._cursor = (0, b"")  # (position in _pass, page token)
        self._recent: dict[tuple[str, bytes], dict[str, float]] = {}  # (namespace, key) -> target -> pushed at
        self._rounds = self._passes = 0
        self._last_round_at = 0.0
        self._last_error = ""
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task | None = None

    # ---- running -------------------------------------------------------------------

    def start(self) -> Replicator:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="strata-replicator", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """End the round in progress (a push in flight is cancelled: the target aborts its slots) and stop."""
        self._stop.set()
        if self._loop is not None and self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the replicator did not stop within %.1fs", timeout)

    def _run(self) -> None:
        assert self._loop is not None
        self._task = self._loop.create_task(self._main())
        try:
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass  # stopped
        finally:
            self._loop.run_until_complete(self.close())
            self._loop.run_until_complete(self._loop.shutdown_default_executor())
            self._loop.close()

    async def _main(self) -> None:
        while not self._stop.is_set():
            await self.run_round()
            await asyncio.sleep(self.limits.interval_s)

    async def close(self) -> None:
        await self._pusher.close()

    # ---- one round -------------------------------------------------------------------

    async def run_round(self) -> None:
        """Check up to ``blocks_per_round`` blocks and push what they lack (bounded by ``bytes_per_round``)."""
        error = ""
        try:
            await self._round()
        except (PrefixIndexError, TimeoutError) as err:
            error = f"the prefix index did not answer: {err or type(err).__name__}"
            log.warning("replication round stopped short: %s", error)
        except StrataError as err:  # the store refused a listing (a namespace dropped meanwhile, a bad page)
            error = str(err)
            log.warning("replication round stopped short: %s", err)
        self.metrics.rounds.labels("error" if error else "ok").inc()
        with self._lock:
            self._rounds += 1
            self._last_round_at = time.time()
            self._last_error = error
            self._publish_gauges_locked()
        self.metrics.last_round.set(self._last_round_at)

    async def _round(self) -> None:
        batch = await self._next_batch() if self.policy else []
        if not batch and not self.pins.busy():
            return
        nodes = await self._on_index(self._index.nodes)
        live = {n.node_id: n for n in nodes if n.alive}
        now = self._clock()
        self._forget(now)
        spent, pushed_any = await self.pins.round(live, self._holders, self.limits.bytes_per_round, False)
        budget = self.limits.bytes_per_round - spent
        for namespace, keys in batch:
            state = self._ns[namespace]
            found = await self._holders(namespace, keys)
            self.metrics.checked.inc(len(keys))
            for key, holders in zip(keys, found):
                holders |= {t for t in self._recent.get((namespace, key), ()) if t in live}
                writable = [n for n, info in live.items() if self._pusher.usable(info, now)]
                short, p = plan(key, state.k, self.node_id, holders, writable)
                made = 0
                if p.pusher == self.node_id and p.targets and (not pushed_any or budget > 0):
                    made, spent = await self._push(namespace, key, [live[t] for t in p.targets], budget, pushed_any)
                    budget -= spent
                    pushed_any = pushed_any or spent > 0
                with self._lock:
                    state.seen.add(key)
                    if short - made > 0:
                        state.under.add(key)
                    else:
                        state.under.discard(key)

    async def _holders(self, namespace: str, keys: list[bytes]) -> list[set[str]]:
        """Per key, the live nodes the index says hold it in a local tier (batched within the index's limit)."""
        found: list = []
        for i in range(0, len(keys), MAX_CHAIN_BLOCKS):
            part = keys[i : i + MAX_CHAIN_BLOCKS]
            found += await self._on_index(lambda part=part: self._index.holders(namespace, part))
        return [{h.node_id for h in held if h.tier in LOCAL_TIERS} for held in found]

    async def _next_batch(self) -> list[tuple[str, list[bytes]]]:
        """Up to ``blocks_per_round`` keys this node holds, from where the last round stopped;
        a pass that ended is closed and a new one begun (once per round)."""
        position, token = self._cursor
        if position >= len(self._pass):
            await self._begin_pass()
            position, token = 0, b""
        loop = asyncio.get_running_loop()
        left = self.limits.blocks_per_round
        batch: list[tuple[str, list[bytes]]] = []
        while left > 0 and position < len(self._pass):
            namespace = self._pass[position]
            try:
                page, token = await loop.run_in_executor(
                    None, self._store.list_keys, namespace, b"", min(left, MAX_LIST_PAGE), token
                )
            except UnknownNamespace:
                page, token = [], b""
            keys = [b.key for b in page if b.tier in LOCAL_TIERS]
            if keys:
                batch.append((namespace, keys))
            left -= len(page)
            if not token:
                position, token = position + 1, b""
        self._cursor = (position, token)
        return batch

    async def _begin_pass(self) -> None:
        """Close the pass that ended (blocks no longer held stop counting) and list the namespaces."""
        namespaces = await asyncio.get_running_loop().run_in_executor(None, self._store.namespaces)
        with self._lock:
            if self._pass:
                self._passes += 1
            for state in self._ns.values():
                if self._pass:
                    state.under &= state.seen
                    state.blocks_last_pass = len(state.seen)
                state.seen = set()
            self._pass = []
            for namespace in namespaces:
                replicas = self.policy.replicas(namespace)
                if replicas is None:
                    continue
                self._pass.append(namespace)
                state = self._ns.get(namespace)
                if state is None or (state.rule, state.k) != (replicas.rule, replicas.k):
                    self._ns[namespace] = _Namespace(replicas.rule, replicas.k)
            for gone in set(self._ns) - set(self._pass):
                del self._ns[gone]

    # ---- pushing ------------------------------------------------------------------------

    async def _push(self, namespace: str, key: bytes, targets: list[NodeInfo], budget: int,
                    pushed_any: bool) -> tuple[int, int]:
        """Copy the block to each target in turn while the budget lasts; returns (copies made, bytes spent)."""
        found = await asyncio.get_running_loop().run_in_executor(
            None, lambda: self._store.get(BlockKey(namespace, key), local_only=True)
        )
        if found is None:
            return 0, 0  # gone since it was listed
        data, meta, _ = found
        made = spent = 0
        state = self._ns[namespace]
        for target in targets:
            if (pushed_any or spent) and meta.size > budget - spent:
                break  # the round's byte budget is spent; the next round goes on
            ok, _why = await self._pusher.write(target, namespace, key, data, meta)
            spent += meta.size
            now = self._clock()
            if ok:
                made += 1
                self._recent.setdefault((namespace, key), {})[target.node_id] = now
                self.metrics.copies.labels("made").inc()
                self.metrics.pushed_bytes.inc(meta.size)
                with self._lock:
                    state.made += 1
                log.debug("replicated %s/%s to %s", namespace, key.hex()[:16], target.node_id)
            else:
                self.metrics.copies.labels("failed").inc()
                with self._lock:
                    state.failed += 1
                log.debug("could not copy %s/%s to %s", namespace, key.hex()[:16], target.node_id)
        return made, spent

    def _forget(self, now: float) -> None:
        recent = {}
        for block, pushes in self._recent.items():
            kept = {n: t for n, t in pushes.items() if now - t < self.limits.settle_s}
            if kept:
                recent[block] = kept
        self._recent = recent
        self._pusher.forget(now)

    async def _on_index(self, call: Callable[[], Awaitable]):
        async def bounded():
            async with asyncio.timeout(INDEX_TIMEOUT_S):
                return await call()

        loop = asyncio.get_running_loop()
        if self._index_loop is None or self._index_loop is loop:
            return await bounded()
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(bounded(), self._index_loop))

    # ---- reporting ------------------------------------------------------------------------

    def _publish_gauges_locked(self) -> None:
        by_rule: dict[str, int] = defaultdict(int)
        for rule in self.policy.rules:
            by_rule[rule] += 0
        for state in self._ns.values():
            by_rule[state.rule] += len(state.under)
        for rule, n in by_rule.items():
            self.metrics.under.labels(rule).set(n)

    def report(self) -> ReplicationReport:
        with self._lock:
            namespaces = [
                NamespaceReport(
                    namespace, s.rule, s.k,
                    blocks=len(s.seen) if s.blocks_last_pass is None else max(s.blocks_last_pass, len(s.seen)),
                    under_replicated=len(s.under), copies_made=s.made, copies_failed=s.failed,
                )
                for namespace, s in sorted(self._ns.items())
            ]
            report = ReplicationReport(self.node_id, self._rounds, self._passes, self._last_round_at,
                                       self._last_error, namespaces)
        report.pins = self.pins.report()
        report.namespaces_enabled = bool(self.policy)
        report.max_pin_replicas = self.limits.max_pin_replicas
        return report

    def under_replicated(self) -> int:
        with self._lock:
            return sum(len(s.under) for s in self._ns.values()) + self.pins.under_replicated()


def open_replicator(settings, store, index: PrefixIndex, node_id: str, index_loop: asyncio.AbstractEventLoop,
                    registry: CollectorRegistry | None = None) -> Replicator | None:
    """The daemon's replicator from its settings (``[replication]``; the push token is
    ``[tiers.peer] token_file``), or None when no namespace is replicated and pins may not ask for copies."""
    options = settings.replication.options()
    policy = ReplicationPolicy(options.pop("rules"))
    if not policy and options["max_pin_replicas"] < 2:
        return None
    token = ""
    if settings.tiers.peer.token_file:
        from kvstore.auth.credentials import read_token_file

        token = read_token_file(settings.tiers.peer.token_file)
    return Replicator(store, index, node_id, policy, ReplicationLimits(**options), index_loop=index_loop,
                      token=token, registry=registry)
