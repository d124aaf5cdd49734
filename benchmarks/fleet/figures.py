"""The figures of issue 30, each a table: which runs make it, and its rows.

- ``capacity``: hit rate (tokens) against RAM per node, local caches against
  the pool, each trace, 10 nodes, cache-aware routing (the paper's
  prefix-aware scheduling), up to unlimited;
- ``paper``: the pool's gain over local caches at 3M tokens per node beside
  the paper's 2.22x (conversation) and 2.36x (synthetic), with cache-aware
  routing and, for contrast, round robin;
- ``fleet_size``: hit rate and prefill tokens saved against the number of
  nodes at 3M tokens per node, local and pool;
- ``peer_bytes``: the peer tier's bytes moved per request, from the same runs;
- ``tiers``: the share of hits served by RAM, disk, a peer and the object
  tier, with the whole chain configured (RAM, disk, peer, object);
- ``maximum``: unlimited capacity with the pool against the trace's
  theoretical maximum, exactly (hit tokens, not a rounded rate).

A :class:`Plan` says which sizes a mode runs; every run is one
:func:`benchmarks.fleet.sim.run`, and runs shared by two figures run once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.fleet import weights
from benchmarks.fleet.sim import FleetConfig, Result, run
from benchmarks.fleet.trace import Trace, max_hit_tokens, theoretical_max

M = 1_000_000
PAPER_RATIO = {"conversation": 2.22, "synthetic": 2.36}  # Mooncake FAST'25, section 5.3: 10 nodes, 3M tokens each
PAPER_TOKENS = 3 * M


@dataclass(frozen=True)
class Plan:
    capacities: tuple[int | None, ...]  # RAM tokens per node for the capacity figure (None: unlimited)
    fleet_sizes: tuple[int, ...]
    tier_chain: tuple[int, int]  # (RAM, disk) tokens per node for the tiers figure
    nodes: int = 10  # the capacity figure's fleet
    fixed_tokens: int = PAPER_TOKENS  # the fleet-size figure's RAM per node
    requests: int | None = None  # the first N requests of each trace (None: all)
    tier_sizes: tuple[int, ...] | None = None  # fleet sizes of the tiers figure (default: fleet_sizes)

    def __post_init__(self) -> None:
        if self.tier_sizes is None:
            object.__setattr__(self, "tier_sizes", self.fleet_sizes)


FULL = Plan((M // 2, M, 3 * M, 10 * M, None), (10, 100, 1000), (M // 2, 2 * M), tier_sizes=(10, 100))
QUICK = Plan((M, None), (10, 100), (M // 2, 2 * M), requests=1000)
# The generated trace is small: capacities scaled to it, so that eviction and every tier still happen.
SMOKE = Plan((20_000, None), (4, 16), (5_000, 20_000), nodes=4, fixed_tokens=20_000)


def configs(traces: list[Trace], plan: Plan) -> list[tuple[Trace, FleetConfig]]:
    """Every run the figures of ``plan`` need, once each, in the order the figures ask for them."""
    out: list[tuple[Trace, FleetConfig]] = []
    for trace in traces:
        out += [(trace, FleetConfig(plan.nodes, None, pool=True, policy=p)) for p in ("round-robin", "cache-aware")]
        for tokens in plan.capacities:
            out += [(trace, FleetConfig(plan.nodes, tokens, pool=pool)) for pool in (False, True)]
        out += [(trace, FleetConfig(plan.nodes, plan.fixed_tokens, pool=pool, policy="round-robin"))
                for pool in (False, True)]
        for nodes in plan.fleet_sizes:
            out += [(trace, FleetConfig(nodes, plan.fixed_tokens, pool=pool)) for pool in (False, True)]
        ram, disk = plan.tier_chain
        out += [(trace, FleetConfig(nodes, ram, disk, pool=True, bucket=True)) for nodes in plan.tier_sizes]
    return list(dict.fromkeys(out))


class Runs:
    """Each distinct (trace, config) run once; :meth:`prefetch` runs many in ``jobs`` processes (each run is
    seeded and independent, so the results do not depend on ``jobs``); ``log`` is told of each run."""

    def __init__(self, log: Callable[[str], None] = print, jobs: int = 1) -> None:
        self._done: dict[tuple[str, FleetConfig], Result] = {}
        self._log = log
        self._jobs = jobs

    def prefetch(self, wanted: list[tuple[Trace, FleetConfig]]) -> None:
        todo = [(t, c) for t, c in wanted if (t.name, c) not in self._done]
        if self._jobs <= 1 or len(todo) <= 1:
            for trace, config in todo:
                self.get(trace, config)
            return
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(self._jobs) as pool:
            for (trace, config), (result, seconds) in zip(todo, pool.imap(_timed, todo)):
                self._keep(trace, config, result, seconds)

    def get(self, trace: Trace, config: FleetConfig) -> Result:
        key = (trace.name, config)
        if key not in self._done:
            self._keep(trace, config, *_timed((trace, config)))
        return self._done[key]

    def _keep(self, trace: Trace, config: FleetConfig, result: Result, seconds: float) -> None:
        self._done[(trace.name, config)] = result
        self._log(f"  {trace.name:12} {config.nodes:5} nodes  {config.caching:20} {config.policy:12} "
                  f"ram {_tokens(config.ram_tokens):>9}  hit rate {result.hit_rate:.4f}  ({seconds:.1f} s)")

    def results(self) -> list[Result]:
        return list(self._done.values())


def _timed(job: tuple[Trace, FleetConfig]) -> tuple[Result, float]:
    started = time.monotonic()
    result = run(*job)
    return result, time.monotonic() - started


def _tokens(n: int | None) -> str:
    if n is None:
        return "unlimited"
    return f"{n / M:g}M" if n >= M else f"{n / 1000:g}k"


def table(columns: list[str], rows: list[list]) -> dict:
    return {"columns": columns, "rows": rows}


def capacity(runs: Runs, traces: list[Trace], plan: Plan) -> dict:
    rows = []
    for trace in traces:
        best = theoretical_max(trace)
        for tokens in plan.capacities:
            local = runs.get(trace, FleetConfig(plan.nodes, tokens))
            pool = runs.get(trace, FleetConfig(plan.nodes, tokens, pool=True))
            rows.append([trace.name, plan.nodes, tokens, round(local.hit_rate, 4), round(pool.hit_rate, 4),
                         _ratio(pool.hit_rate, local.hit_rate), round(best, 4)])
    return table(["trace", "nodes", "ram_tokens_per_node", "local_hit_rate", "pool_hit_rate", "pool_over_local",
                  "theoretical_max"], rows)


def paper(runs: Runs, traces: list[Trace], plan: Plan) -> dict:
    rows = []
    for trace in traces:
        for policy in ("cache-aware", "round-robin"):
            local = runs.get(trace, FleetConfig(plan.nodes, plan.fixed_tokens, policy=policy))
            pool = runs.get(trace, FleetConfig(plan.nodes, plan.fixed_tokens, pool=True, policy=policy))
            rows.append([trace.name, policy, plan.nodes, plan.fixed_tokens, round(local.hit_rate, 4),
                         round(pool.hit_rate, 4), _ratio(pool.hit_rate, local.hit_rate),
                         PAPER_RATIO.get(trace.name) if policy == "cache-aware" else None,
                         round(theoretical_max(trace), 4)])
    return table(["trace", "policy", "nodes", "ram_tokens_per_node", "local_hit_rate", "pool_hit_rate",
                  "pool_over_local", "paper_pool_over_local", "theoretical_max"], rows)


def fleet_size(runs: Runs, traces: list[Trace], plan: Plan) -> tuple[dict, dict]:
    sizes, peer = [], []
    for trace in traces:
        for nodes in plan.fleet_sizes:
            local = runs.get(trace, FleetConfig(nodes, plan.fixed_tokens))
            pool = runs.get(trace, FleetConfig(nodes, plan.fixed_tokens, pool=True))
            sizes.append([trace.name, nodes, plan.fixed_tokens, round(local.hit_rate, 4), round(pool.hit_rate, 4),
                          local.hits, pool.hits, trace.input_tokens, local.to_json()["ttft_p50_s"],
                          pool.to_json()["ttft_p50_s"]])
            j = pool.to_json()
            peer.append([trace.name, nodes, plan.fixed_tokens, j["peer_bytes_per_request"],
                         round(j["peer_bytes_per_request"] / pool.config.kv_bytes_per_token), round(j["hit_share"]["peer"], 4)])
    return (table(["trace", "nodes", "ram_tokens_per_node", "local_hit_rate", "pool_hit_rate",
                   "local_prefill_tokens_saved", "pool_prefill_tokens_saved", "input_tokens",
                   "local_ttft_p50_s", "pool_ttft_p50_s"], sizes),
            table(["trace", "nodes", "ram_tokens_per_node", "peer_bytes_per_request", "peer_tokens_per_request",
                   "peer_share_of_hits"], peer))


def tiers(runs: Runs, traces: list[Trace], plan: Plan) -> dict:
    ram, disk = plan.tier_chain
    rows = []
    for trace in traces:
        for nodes in plan.tier_sizes:
            r = runs.get(trace, FleetConfig(nodes, ram, disk, pool=True, bucket=True)).to_json()
            s = r["hit_share"]
            rows.append([trace.name, nodes, ram, disk, r["hit_rate"], s["host"], s["disk"], s["peer"], s["object"],
                         r["peer_bytes_per_request"], r["object_bytes_per_request"]])
    return table(["trace", "nodes", "ram_tokens_per_node", "disk_tokens_per_node", "hit_rate", "ram_share",
                  "disk_share", "peer_share", "object_share", "peer_bytes_per_request", "object_bytes_per_request"], rows)


def maximum(runs: Runs, traces: list[Trace], plan: Plan) -> dict:
    rows = []
    for trace in traces:
        best_tokens = max_hit_tokens(trace)
        for policy in ("round-robin", "cache-aware"):
            r = runs.get(trace, FleetConfig(plan.nodes, None, pool=True, policy=policy))
            rows.append([trace.name, policy, r.hits, best_tokens, r.hits == best_tokens, r.stale_holders])
    return table(["trace", "policy", "simulated_hit_tokens", "theoretical_max_hit_tokens", "exact", "stale_holders"],
                 rows)


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


# The weights figure: (nodes, chunk scale, holders view). 35,000+ transfers per node-chunk pair are too many at
# 1,000 nodes for a Python event loop, so chunk counts are scaled (chunks of scale x 16 MiB) as N grows.
WEIGHTS_FULL = ((10, 1, None), (100, 16, None), (1000, 64, 16))
WEIGHTS_QUICK = ((10, 16, None), (100, 64, None))
WEIGHTS_SMOKE = ((4, 16, None), (16, 64, None))
WEIGHTS_SMOKE_BYTES = 20 * weights.GB  # the smoke run's model: a seventh of the size, same links


def weights_table(plan: tuple, log: Callable[[str], None] = print) -> dict:
    """Time to all-ready per fleet size against the lower bound and against every node reading the origin."""
    rows = []
    model = WEIGHTS_SMOKE_BYTES if plan is WEIGHTS_SMOKE else weights.MODEL_BYTES
    for nodes, scale, view in plan:
        start = time.perf_counter()
        rows.append(weights.run(weights.WeightsConfig(nodes, scale, model, holders_view=view)).row())
        log(f"weights: {nodes} nodes, {rows[-1]['chunks']} chunks: {rows[-1]['all_ready_s']} s "
            f"({rows[-1]['over_bound']}x the bound) in {time.perf_counter() - start:.1f} s")
    columns = list(rows[0])
    return {"columns": columns, "rows": [[r[c] for c in columns] for r in rows],
            "model_bytes": model, "links": weights.WeightLinks().to_json()}
