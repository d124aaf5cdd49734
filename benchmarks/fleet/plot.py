"""The figures as PNGs, from the tables of :mod:`benchmarks.fleet.figures` (matplotlib, as benchmarks.e2e.plot).

Three files: ``fleet_capacity.png`` (hit rate against RAM per node, local
against pool, one panel per trace, the theoretical maximum as a line and the
paper's point marked), ``fleet_size.png`` (hit rate and peer bytes per
request against the number of nodes) and ``fleet_tiers.png`` (the share of
hits per tier, stacked, per trace and fleet size).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.fleet.figures import M, PAPER_TOKENS


def _rows(t: dict) -> list[dict]:
    return [dict(zip(t["columns"], row)) for row in t["rows"]]


def plot_all(tables: dict, folder: Path, prefix: str = "fleet") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    traces = list(dict.fromkeys(r["trace"] for r in _rows(tables["capacity"])))

    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4.5), squeeze=False)
    for ax, name in zip(axes[0], traces):
        rows = [r for r in _rows(tables["capacity"]) if r["trace"] == name]
        limited = [r for r in rows if r["ram_tokens_per_node"] is not None]
        xs = [r["ram_tokens_per_node"] / M for r in limited]
        ax.plot(xs, [r["local_hit_rate"] for r in limited], "o-", label="local caches")
        ax.plot(xs, [r["pool_hit_rate"] for r in limited], "s-", label="pool (peer tier)")
        ax.axhline(rows[0]["theoretical_max"], color="grey", linestyle="--", linewidth=1, label="theoretical maximum")
        ax.axvline(PAPER_TOKENS / M, color="red", linestyle=":", linewidth=1)
        paper = [r for r in _rows(tables["paper"]) if r["trace"] == name and r["paper_pool_over_local"]]
        if paper:
            ax.text(PAPER_TOKENS / M, 0.03, f" 3M: pool/local {paper[0]['pool_over_local']}x\n (paper {paper[0]['paper_pool_over_local']}x)",
                    fontsize=8, color="red")
        ax.set_xscale("log")
        ax.set_ylim(0, 1)
        ax.set_xlabel("RAM per node (M tokens, log scale)")
        ax.set_title(f"{name}: {rows[0]['nodes']} nodes, cache-aware routing")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("hit rate (share of prompt tokens)")
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    paths.append(_save(fig, plt, folder / f"{prefix}_capacity.png"))

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    sizes = _rows(tables["fleet_size"])
    peer = _rows(tables["peer_bytes"])
    for name in traces:
        rows = [r for r in sizes if r["trace"] == name]
        xs = [r["nodes"] for r in rows]
        a1.plot(xs, [r["local_hit_rate"] for r in rows], "o-", label=f"{name}, local")
        a1.plot(xs, [r["pool_hit_rate"] for r in rows], "s--", label=f"{name}, pool")
        prow = [r for r in peer if r["trace"] == name]
        a2.plot([r["nodes"] for r in prow], [r["peer_bytes_per_request"] / 1e9 for r in prow], "s-", label=name)
    tokens = sizes[0]["ram_tokens_per_node"] if sizes else 0
    for ax in (a1, a2):
        ax.set_xscale("log")
        ax.set_xlabel("nodes (log scale)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    a1.set_ylim(0, 1)
    a1.set_ylabel("hit rate (share of prompt tokens)")
    a1.set_title(f"hit rate, {tokens / M:g}M tokens of RAM per node")
    a2.set_ylabel("peer GB moved per request")
    a2.set_title("the pool's peer traffic")
    fig.tight_layout()
    paths.append(_save(fig, plt, folder / f"{prefix}_size.png"))

    fig, ax = plt.subplots(figsize=(8, 4.5))
    rows = _rows(tables["tiers"])
    labels = [f"{r['trace'][:5]}\n{r['nodes']}" for r in rows]
    bottom = [0.0] * len(rows)
    for tier in ("ram", "disk", "peer", "object"):
        values = [r[f"{tier}_share"] for r in rows]
        ax.bar(labels, values, bottom=bottom, label=tier)
        bottom = [b + v for b, v in zip(bottom, values)]
    if rows:
        ax.set_title(f"share of hits per tier: {rows[0]['ram_tokens_per_node'] / M:g}M tokens RAM + "
                     f"{rows[0]['disk_tokens_per_node'] / M:g}M disk per node, peers, object tier")
    ax.set_ylabel("share of hit tokens")
    ax.set_xlabel("trace, nodes")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(_save(fig, plt, folder / f"{prefix}_tiers.png"))

    if "weights" in tables:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        rows = _rows(tables["weights"])
        xs = [r["nodes"] for r in rows]
        ax.plot(xs, [r["all_ready_s"] for r in rows], "o-", label="swarm (IndexSwarm.route): all nodes ready")
        ax.plot(xs, [r["bound_s"] for r in rows], "k--", label="lower bound")
        ax.plot(xs, [r["origin_only_s"] for r in rows], "s:", label="every node from the origin")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("nodes (log scale)")
        ax.set_ylabel("seconds to all-ready (log scale)")
        ax.set_title(f"a {tables['weights']['model_bytes'] / 1e9:g} GB model to every node")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(_save(fig, plt, folder / f"{prefix}_weights.png"))
    return paths


def _save(fig, plt, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
