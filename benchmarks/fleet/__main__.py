"""Fleet scale in virtual time: the Mooncake traces replayed through Strata's router, index and eviction code.

Run as ``python -m benchmarks.fleet [--quick | --smoke] [--traces DIR] [--jobs N]``.

Each run (:mod:`benchmarks.fleet.sim`) replays a trace through N simulated
nodes: the router's own policies pick a node, the in-process prefix index
(:class:`kvstore.index.memory.MemoryIndex`) answers the router and the pool,
and each node's cache is decided by the store's catalogue, recency and
eviction plan (:mod:`benchmarks.fleet.node`). Time is virtual and every
choice is seeded, so a run gives the same figures on any machine; only the
modelled link and prefill speeds (:class:`~benchmarks.fleet.sim.Links`)
turn tokens into seconds.

The index at fleet scale (:mod:`benchmarks.fleet.index_load`; ``--no-index`` leaves it out,
``--index-only`` runs it alone into ``benchmarks/results/fleet_index.json``) replays the index
calls of a 10-node fleet from N/10 fleets at once on real Redis Clusters (3 and 6 masters, 100 and
1,000 nodes, a master killed in two runs), checking every answer against the in-process index;
without ``redis-server`` it is skipped and says so.

The figures (:mod:`benchmarks.fleet.figures`) go to
``benchmarks/results/fleet.json`` (one table each, under ``tables``) and three
PNGs (:mod:`benchmarks.fleet.plot`). The run fails (exit 1) when unlimited
capacity with the pool does not hit exactly the trace's theoretical maximum.

Plans: the full run (both whole traces, 10 to 1,000 nodes, about 15 minutes on
two cores with ``--jobs 2``); ``--quick`` (the first 1,000 requests of each trace, 10 and 100
nodes, under a minute); ``--smoke`` (a trace generated here, 4 and 16 nodes,
seconds, writes nothing and draws no plots). Without the shared traces (``--traces``,
``$STRATA_TRACES`` or ``../shared/data/mooncake_traces`` beside the
checkout) the full and quick runs use the generated trace at the smoke
run's sizes, and say so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.fleet import figures, index_load, trace, weights
from benchmarks.fleet.figures import PAPER_RATIO, Runs
from benchmarks.fleet.sim import KV_BYTES_PER_TOKEN, Links
from benchmarks.harness import Case, UnitBenchmark

WHAT_RUNS = {
    "strata": ["kvstore.router.policy (round-robin, least-loaded, cache-aware with kvstore.router.ttft.TtftModel)",
               "kvstore.router.endpoint.Endpoint", "kvstore.index.memory.MemoryIndex (lookup, holders, add, remove)",
               "kvstore.index.scoring.ScoringPolicy", "kvstore.peer.source.LOCAL_TIERS",
               "kvstore.store.entries.Catalog", "kvstore.store.recency.Recency",
               "kvstore.store.eviction.plan_eviction"],
    "modelled": ["virtual time: arrivals at the trace's timestamps, one prefill at a time per node, FIFO",
                 "prefill seconds = overhead + uncached tokens / prefill rate + cached bytes / the link of their tier",
                 "copies down the chain land at once; blocks are stored and published when a request is routed",
                 "tier capacities counted in bytes (tokens x KV bytes per token), no arenas or files"],
}


def main(argv: list[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--traces", help="folder of the Mooncake traces (default: $STRATA_TRACES, "
                                      "else ../shared/data/mooncake_traces beside the checkout)")
    pre.add_argument("--jobs", type=int, default=1, help="runs at once, each in a process of its own (default 1)")
    index = pre.add_mutually_exclusive_group()
    index.add_argument("--no-index", action="store_true",
                       help="leave out the index at fleet scale (the replay's index calls on real Redis Clusters)")
    index.add_argument("--index-only", action="store_true",
                       help="only the index at fleet scale, written to benchmarks/results/fleet_index.json")
    ours, rest = pre.parse_known_args(argv)
    bench = UnitBenchmark("fleet", __doc__.splitlines()[0], rest)
    bench.baseline_width = 30
    plan = bench.plan(figures.FULL, figures.QUICK, figures.SMOKE)
    folder = None if bench.smoke else trace.traces_dir(ours.traces)
    if folder is None:
        if not bench.smoke:
            print("the Mooncake traces are not on this machine: running the generated trace at the smoke run's sizes")
        plan = figures.SMOKE
        traces = [trace.generated()]
    else:
        traces = [trace.load(folder, name, plan.requests) for name in trace.TRACE_NAMES]
    for t in traces:
        print(f"trace {t.name}: {len(t.requests)} requests, {t.input_tokens:,} input tokens over {t.duration_s:.0f} s, "
              f"theoretical maximum hit rate {trace.theoretical_max(t):.4f} ({t.source})")

    if ours.index_only:
        return _index_only(bench, traces[0], plan)

    runs = Runs(jobs=ours.jobs)
    runs.prefetch(figures.configs(traces, plan))
    tables = {"maximum": figures.maximum(runs, traces, plan), "capacity": figures.capacity(runs, traces, plan),
              "paper": figures.paper(runs, traces, plan)}
    tables["fleet_size"], tables["peer_bytes"] = figures.fleet_size(runs, traces, plan)
    tables["tiers"] = figures.tiers(runs, traces, plan)
    tables["weights"] = figures.weights_table(figures.WEIGHTS_SMOKE if bench.smoke else
                                              figures.WEIGHTS_QUICK if plan is figures.QUICK else figures.WEIGHTS_FULL)
    if not ours.no_index:
        tables["index"] = index_load.index_table(traces[0], _index_plan(plan), plan.fixed_tokens)
    print()
    for name, t in tables.items():
        _print_table(name, t)

    label = _tokens_label(plan.fixed_tokens)
    for row in _rows(tables["paper"]):
        if row["policy"] == "cache-aware":
            paper = PAPER_RATIO.get(row["trace"])
            bench.add(Case(f"{row['trace']} pool, {label}/node", row["pool_hit_rate"], "local caches, same RAM",
                           row["local_hit_rate"], metric="hit rate", unit="tokens",
                           note=f"paper: {paper}x" if paper else "no paper figure for this trace"))
    exact = True
    for row in _rows(tables["maximum"]):
        exact &= row["exact"]
        bench.add(Case(f"{row['trace']} unlimited, {row['policy']}", row["simulated_hit_tokens"],
                       "theoretical maximum", row["theoretical_max_hit_tokens"], target_ratio=1.0,
                       metric="hit tokens", unit="tokens"))
    path = bench.finish()
    if path is not None:
        doc = json.loads(path.read_text())
        doc["model"] = {"nodes_in_capacity_figure": plan.nodes, "block_tokens": trace.BLOCK_TOKENS,
                        "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "links": Links().to_json(),
                        "weights_links": weights.WeightLinks().to_json(), **WHAT_RUNS}
        doc["traces"] = [{"name": t.name, "source": t.source, "requests": len(t.requests),
                          "input_tokens": t.input_tokens, "theoretical_max": round(trace.theoretical_max(t), 6)}
                         for t in traces]
        doc["tables"] = tables
        doc["runs"] = [r.to_json() for r in runs.results()]
        path.write_text(json.dumps(doc, indent=1) + "\n")
    _plots(tables, path.parent if path is not None else None)
    if not exact:
        print("unlimited capacity with the pool did not hit the theoretical maximum exactly", file=sys.stderr)
        return 1
    wrong = index_load.answered_wrong(tables.get("index"))
    if wrong:
        print("the index on Redis answered otherwise than the in-process index with no fault: " + "; ".join(wrong),
              file=sys.stderr)
        return 1
    return 0


def _index_plan(plan: figures.Plan) -> index_load.IndexPlan:
    return (index_load.INDEX_SMOKE if plan is figures.SMOKE else
            index_load.INDEX_QUICK if plan is figures.QUICK else index_load.INDEX_FULL)


def _index_only(bench: UnitBenchmark, t: trace.Trace, plan: figures.Plan) -> int:
    """``--index-only``: the index table alone, in a results file of its own (none after ``--smoke``)."""
    table = index_load.index_table(t, _index_plan(plan), plan.fixed_tokens)
    print()
    _print_table("index", table)
    wrong = index_load.answered_wrong(table)
    if not bench.smoke:
        from benchmarks.harness import RESULTS_DIR

        doc = {"benchmark": "fleet_index", "command": "python -m benchmarks.fleet --index-only" + bench.mode_flag,
               "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count(),
               "about": index_load.__doc__.split("\n\n")[0], "table": table}
        path = RESULTS_DIR / "fleet_index.json"
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {path}")
    if wrong:
        print("the index on Redis answered otherwise than the in-process index with no fault: " + "; ".join(wrong),
              file=sys.stderr)
        return 1
    return 0


def _plots(tables: dict, folder: Path | None) -> None:
    """The PNGs beside the JSON; none after ``--smoke`` (it writes nothing, and matplotlib's import
    would be most of its time)."""
    if folder is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed: no plots")
        return
    from benchmarks.fleet.plot import plot_all

    for p in plot_all(tables, folder):
        print(f"plot: {p}")


def _rows(t: dict) -> list[dict]:
    return [dict(zip(t["columns"], row)) for row in t["rows"]]


def _tokens_label(n: int) -> str:
    return f"{n / 1e6:g}M tokens" if n >= 1_000_000 else f"{n / 1000:g}k tokens"


def _print_table(name: str, t: dict) -> None:
    cells = [[str(c) for c in t["columns"]]] + [["" if v is None else str(v) for v in row] for row in t["rows"]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(t["columns"]))]
    print(name)
    for row in cells:
        print("  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)))
    print()


if __name__ == "__main__":
    sys.exit(main())
