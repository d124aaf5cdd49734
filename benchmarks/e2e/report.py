"""The benchmark's verdict: the per-policy table, the targets the issue sets, the results document.

Targets (mean TTFT of turns 2+ unless named otherwise):

- (c) cache-aware ≥ 3× faster than (a) round robin with a last-prompt cache;
- (c) ≥ 1.5× faster than (b) round robin with per-replica prefix caches;
- (d) round robin + shared pool within 10% of (c): its mean at most 1.1×
  (c)'s (faster counts as within);
- (e) cache-aware + shared pool: the lowest p95 of all five;
- a 4,096-token prompt whose prefix is cached: TTFT ≥ 20× lower than cold.

A target whose inputs were not measured (a policy left out, a failed
phase) is reported as not judged (``met: null``), never as met.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

from benchmarks.e2e.stats import PolicyStats


@dataclass(frozen=True)
class Target:
    name: str
    measured: float | None  # the ratio, or for p95 the policy's own figure
    required: str  # "≥ 3", "≤ 1.1", "lowest"
    met: bool | None
    detail: str = ""

    def to_json(self) -> dict:
        out = asdict(self)
        out["measured"] = None if self.measured is None else float(f"{self.measured:.3g}")
        return out


def _mean(stats: Mapping[str, PolicyStats], key: str) -> float | None:
    s = stats.get(key)
    return None if s is None else s.ttft_later.mean


def _speedup(stats: Mapping[str, PolicyStats], fast: str, slow: str, need: float, name: str) -> Target:
    f, s = _mean(stats, fast), _mean(stats, slow)
    if not f or s is None:
        return Target(name, None, f"≥ {need:g}", None, "not measured")
    ratio = s / f
    return Target(name, ratio, f"≥ {need:g}", ratio >= need, f"{slow} {s:.3f} s / {fast} {f:.3f} s")


def targets(stats: Mapping[str, PolicyStats], prefix: Mapping | None) -> list[Target]:
    out = [
        _speedup(stats, "c", "a", 3.0, "(c) vs (a): mean TTFT turns 2+, speedup"),
        _speedup(stats, "c", "b", 1.5, "(c) vs (b): mean TTFT turns 2+, speedup"),
    ]
    c, d = _mean(stats, "c"), _mean(stats, "d")
    if c and d is not None:
        out.append(Target("(d) vs (c): mean TTFT turns 2+, ratio", d / c, "≤ 1.1", d / c <= 1.1,
                          f"d {d:.3f} s / c {c:.3f} s"))
    else:
        out.append(Target("(d) vs (c): mean TTFT turns 2+, ratio", None, "≤ 1.1", None, "not measured"))
    p95 = {k: s.ttft_later.p95 for k, s in stats.items() if s.ttft_later.p95 is not None}
    if "e" in p95 and len(p95) == 5:
        best = min(p95, key=p95.get)
        out.append(Target("(e): lowest p95 TTFT turns 2+", p95["e"], "lowest", best == "e",
                          ", ".join(f"{k} {v:.3f} s" for k, v in sorted(p95.items()))))
    else:
        out.append(Target("(e): lowest p95 TTFT turns 2+", p95.get("e"), "lowest", None,
                          "needs all five policies"))
    cold, hit = (prefix or {}).get("cold_ttft_s"), (prefix or {}).get("hit_ttft_s")
    if cold and hit:
        out.append(Target("4k prompt: cold / prefix-hit TTFT", cold / hit, "≥ 20", cold / hit >= 20,
                          f"cold {cold:.3f} s, hit {hit:.4f} s"))
    else:
        out.append(Target("4k prompt: cold / prefix-hit TTFT", None, "≥ 20", None,
                          (prefix or {}).get("error", "not measured")))
    return out


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:.0f}"


_COLUMNS = (("policy", 42), ("t2+ mean", 9), ("p50", 6), ("p95", 6), ("p99", 6), ("t1 mean", 8), ("t1 p95", 7),
            ("TPOT", 5), ("hit t2+", 8), ("goodput", 8), ("ok/sent", 8))


def _row(cells: list[str]) -> str:
    return "  ".join(c.ljust(w) for c, (_, w) in zip(cells, _COLUMNS)).rstrip()


def table(names: Mapping[str, str], stats: Mapping[str, PolicyStats]) -> str:
    """Per policy: TTFT (ms) turns 2+ and turn 1, TPOT (ms), hit ratio, goodput (req/s)."""
    lines = [_row([t for t, _ in _COLUMNS]), _row(["-" * w for _, w in _COLUMNS])]
    for key, s in stats.items():
        lat, first = s.ttft_later, s.ttft_turn1
        lines.append(_row([
            names.get(key, key), _ms(lat.mean), _ms(lat.p50), _ms(lat.p95), _ms(lat.p99), _ms(first.mean),
            _ms(first.p95), _ms(s.tpot.mean),
            "n/a" if s.hit_ratio_later is None else f"{s.hit_ratio_later:.2f}",
            "n/a" if s.goodput_rps is None else f"{s.goodput_rps:.3f}",
            f"{s.answered}/{s.answered + s.failed}",
        ]))
    lines.append("(TTFT and TPOT in ms; hit = cached / prompt tokens; goodput = requests/s answered within the SLO)")
    return "\n".join(lines)


def targets_table(rows: list[Target]) -> str:
    lines = []
    for t in rows:
        met = {True: "met", False: "MISSED", None: "not judged"}[t.met]
        measured = "n/a" if t.measured is None else f"{t.measured:.3g}"
        lines.append(f"{t.name:<44} {measured:>8}  (target {t.required}) {met:<10} {t.detail}")
    return "\n".join(lines)


def router_summary(samples: Mapping[tuple[str, tuple], float]) -> dict:
    """The router's own account of a phase: its decisions by reason, upstream errors, index availability."""
    decisions: dict[str, int] = {}
    errors: dict[str, int] = {}
    for (name, labels), value in samples.items():
        lab = dict(labels)
        if name == "strata_router_decisions_total" and value:
            decisions[lab["reason"]] = decisions.get(lab["reason"], 0) + int(value)
        elif name == "strata_router_upstream_errors_total" and value:
            key = f"endpoint {lab.get('endpoint')} {lab.get('kind')}"
            errors[key] = errors.get(key, 0) + int(value)
    return {"decisions_by_reason": dict(sorted(decisions.items())), "upstream_errors": dict(sorted(errors.items())),
            "index_available": samples.get(("strata_router_index_available", ()))}


ENGINE_COUNTERS = ("e2e_engine_pool_blocks_total", "e2e_engine_cached_tokens_total", "e2e_engine_prefix_cache_hits_total")


def engine_summary(per_engine: Mapping[str, Mapping[tuple[str, tuple], float]]) -> dict:
    """Each engine's own counts of where its KV came from (its cache, the pool) and its pool traffic."""
    out = {}
    for engine, samples in per_engine.items():
        counts: dict[str, int] = {}
        for (name, labels), value in samples.items():
            if name in ENGINE_COUNTERS and value:
                short = name.removeprefix("e2e_engine_").removesuffix("_total")
                counts[short + "{" + ",".join(f"{k}={v}" for k, v in labels) + "}"] = int(value)
        out[engine] = dict(sorted(counts.items()))
    return out
