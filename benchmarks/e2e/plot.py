"""The TTFT distribution per policy, as a PNG: one empirical CDF per policy, turns 2+ and turn 1.

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
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
