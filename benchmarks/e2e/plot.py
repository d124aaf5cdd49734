"""The benchmark's figures as PNGs: TTFT and goodput against offered load (:func:`plot_load`), and the TTFT
distribution per policy at one load point (:func:`plot_ttft`: one empirical CDF per policy, turns 2+ and turn 1).

An ECDF rather than a histogram: with 32 requests per policy a histogram's
bins say more about the bin width than the data, while the CDF shows every
sample, the median and the tail at once. The x axis is logarithmic because
a cache hit and a cold prefill differ by an order of magnitude.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from benchmarks.e2e.stats import RequestRecord


def plot_ttft(records: Mapping[str, Sequence[RequestRecord]], path: Path, *, slo_s: float | None = None,
              title: str = "") -> Path:
    """Write the plot of ``records`` (policy name -> its requests) to ``path``; returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    panels = ((axes[0], "turns 2+", lambda r: r.turn >= 1), (axes[1], "turn 1", lambda r: r.turn == 0))
    for ax, label, keep in panels:
        for name, rs in records.items():
            ttfts = sorted(r.ttft_s for r in rs if r.ok and keep(r))
            if not ttfts:
                continue
            ys = [0.0] + [(i + 1) / len(ttfts) for i in range(len(ttfts))]
            ax.step([ttfts[0]] + ttfts, ys, where="post", label=f"{name} (n={len(ttfts)})")
        if slo_s is not None:
            ax.axvline(slo_s, color="grey", linestyle="--", linewidth=1, label=f"TTFT SLO {slo_s:.2f} s")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("TTFT (s, log scale)")
        ax.set_title(f"TTFT, {label}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("share of requests with TTFT ≤ x")
    axes[0].legend(fontsize=8, loc="lower right")
    return _save(fig, path, title)


def plot_load(doc: Mapping, path: Path, *, title: str = "") -> Path:
    """TTFT of turns 2+ (p50 solid, p95 dashed, the p95's 95% interval as error bars) and goodput at the
    SLO against offered load, one line per policy, one row per workload of the results document."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w for w, e in doc["workloads"].items() if e["policies"]]
    rows = max(1, len(workloads))
    fig, axes = plt.subplots(rows, 2, figsize=(13, 5.6 * rows), squeeze=False)
    for row, w in enumerate(workloads):
        entry = doc["workloads"][w]
        ax_t, ax_g = axes[row]
        for n, (key, pol) in enumerate(sorted(entry["policies"].items())):
            pts = [p for p in pol.get("points", []) if p["stats"]["ttft_turns2plus_s"]["n"]]
            if not pts:
                continue
            color = f"C{n}"
            loads = [p["load"] for p in pts]
            lat = [p["stats"]["ttft_turns2plus_s"] for p in pts]
            ax_t.plot(loads, [s["p50"] for s in lat], "-o", color=color, label=f"{pol['policy']} p50")
            p95 = [s["p95"] for s in lat]
            cis = [p["stats"]["ttft_turns2plus_p95_ci95_s"] for p in pts]
            err = [[max(0.0, v - ci[0]) if ci else 0.0 for v, ci in zip(p95, cis)],
                   [max(0.0, ci[1] - v) if ci else 0.0 for v, ci in zip(p95, cis)]]
            ax_t.errorbar(loads, p95, yerr=err, fmt="--s", color=color, capsize=3, markersize=4, linewidth=1,
                          label=f"{key} p95 (95% CI)")
            ax_g.plot(loads, [p["stats"]["goodput_rps"] or 0.0 for p in pts], "-o", color=color,
                      label=pol["policy"])
        offered = [(p["load"], p["offered_rps"]) for p in entry["points"]]
        if offered:
            ax_g.plot([x for x, _ in offered], [y for _, y in offered], ":", color="grey", label="offered")
        slo = entry.get("ttft_slo_s")
        if slo:
            ax_t.axhline(slo, color="grey", linestyle=":", linewidth=1, label=f"SLO {slo:.2f} s")
        ax_t.set_yscale("log")
        ax_t.set_ylabel("TTFT, turns 2+ (s, log scale)")
        ax_g.set_ylabel("goodput: requests/s within the SLO")
        for ax in (ax_t, ax_g):
            ax.set_xlabel("offered load (share of the fleet's cold capacity)")
            ax.grid(True, which="both", alpha=0.3)
        ax_t.set_title(f"{entry['name']}: TTFT against load")
        ax_g.set_title(f"{entry['name']}: goodput against load")
        # Below the axes: the curves' high end (p95 at low load, goodput at high load) stays in view.
        ax_t.legend(fontsize=6, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
        ax_g.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    return _save(fig, path, title)


def _save(fig, path: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # legends placed outside the axes included
    plt.close(fig)
    return path
