"""The measured tables of ``docs/performance/e2e.md``, from a run's ``e2e.json``.

Run as ``python -m benchmarks.e2e.markdown [benchmarks/results/e2e.json]``: prints, per workload,
TTFT of turns 2+ (mean and p95 with their 95% intervals) and goodput (with the hit ratio) by
policy and load, then the targets, the scale-up drill and the faults, in Markdown. The prose
around them (what limits each missed target) is the docs' own.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.harness import RESULTS_DIR


def _ms(s: float | None) -> str:
    return "–" if s is None else f"{s * 1000:,.0f}"


def _interval(ci: list[float] | None) -> str:
    return "" if not ci else f" [{_ms(ci[0])}–{_ms(ci[1])}]"


def _ttft(stats: dict) -> str:
    t = stats["ttft_turns2plus_s"]
    if not t.get("n"):
        return "–"
    return (f"{_ms(t['mean'])}{_interval(stats.get('ttft_turns2plus_mean_ci95_s'))} / "
            f"{_ms(t['p95'])}{_interval(stats.get('ttft_turns2plus_p95_ci95_s'))}")


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def workload(name: str, entry: dict) -> list[str]:
    ref = entry["reference"]
    out = [f"### {entry.get('name') or name.upper()}", ""]
    if "error" in ref:
        return [*out, f"The reference run failed: {ref['error']}", ""]
    out += [f"Reference run: {ref['requests']} prompts; cold service {ref['cold_service_mean_s']} s mean, prefill "
            f"{ref['prefill_share_of_service']} of it; capacity {ref['capacity_rps']} requests/s; TTFT SLO "
            f"{ref['ttft_slo_s']} s; think time mean {entry.get('think_mean_s')} s.", ""]
    policies = entry["policies"]
    loads = [p["load"] for p in entry.get("points", [])]
    head = ["policy", *(f"{u:g}" for u in loads)]

    def by_load(pol: dict, cell) -> list[str]:
        points = {p["load"]: p for p in pol.get("points", [])}
        return [cell(points[u]) if u in points else "–" for u in loads]

    out += ["TTFT of turns 2+, ms: mean [95% interval] / p95 [95% interval], by offered load:", ""]
    out += _table(head, [[pol["policy"], *by_load(pol, lambda p: _ttft(p["stats"]))] for pol in policies.values()])
    out += ["", "Goodput (requests/s within the SLO) and, in brackets, the hit ratio of turns 2+:", ""]
    offered = [f"{p['offered_rps']:.2f}" for p in entry.get("points", [])]
    rows = [["offered", *offered]]
    rows += [[pol["policy"], *by_load(pol, lambda p: f"{p['stats']['goodput_rps']:.2f} "
                                                   f"({p['stats']['cache_hit_ratio_turns2plus']:.2f})")]
             for pol in policies.values()]
    return [*out, *_table(head, rows), ""]


def targets(doc: dict) -> list[str]:
    rows = [[t["name"], f"{t['measured']:g}" if isinstance(t["measured"], (int, float)) else str(t["measured"]),
             t["required"], "yes" if t["met"] else "**no**", t.get("detail", "")] for t in doc.get("targets", [])]
    return ["### Targets", "", *_table(["target", "measured", "required", "met", "detail"], rows), ""]


def drill(doc: dict) -> list[str]:
    d = doc.get("drill")
    if not d or "error" in d:
        return [] if not d else ["### The scale-up drill", "", f"Failed: {d['error']}", ""]
    rows = []
    for name, label in (("drill-strata", "with Strata (e)"), ("drill-origin", "without (b)")):
        u = (d.get(name) or {}).get("scale_up")
        if not u:
            continue
        steps = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in u["steps_s"].items() if k != "started")
        t = u["first_requests_ttft_s"]
        mb = u["model_bytes"] / 1e6
        rows.append([label, f"{u['time_to_ready_s']} s", steps, f"{u['origin_bytes'] / 1e6:.1f} of {mb:.1f} MB",
                     f"{t.get('n', 0)} requests: {_ms(t.get('mean'))} / {_ms(t.get('p95'))} ms, "
                     f"{u['first_requests_hit_ratio']}"])
    head = ["", "time to ready", "steps (s from the start)", "origin bytes",
            "the new replica's first requests: TTFT mean / p95, hit ratio"]
    return [f"### The scale-up drill ({d.get('sessions')} sessions at load {d.get('load')})", "", *_table(head, rows), ""]


def faults(doc: dict) -> list[str]:
    out = ["### Faults", ""]
    f = (doc.get("faults") or {}).get("faults")
    if f:
        out.append(f"- Crashes ({doc['faults'].get('workload')}): {f['answered']} of {f['sent']} answered; failed by "
                   f"reason {f['failed_by_reason'] or '{}'}; for a cache reason: {f['failed_for_a_cache_reason']}; "
                   f"the dead engine out of rotation after {f['out_of_rotation_after_s']} s, tried "
                   f"{f['router_upstream_errors_after_rotation']} times after.")
    g = (doc.get("data_faults") or {}).get("faults")
    if g:
        out.append(f"- Damaged bytes ({doc['data_faults'].get('workload')}): {g['answered']} of {g['sent']} answered; "
                   f"{g['peer_path_bytes_flipped']} bytes flipped on the peer path; {g['disk_block_files_damaged']} "
                   f"block files damaged on the disk of replica {g.get('rebooted_replica')}, rebooted; what the "
                   f"daemons met: {g['damage_met_by_daemon']}.")
    return [*out, ""] if len(out) > 2 else []


def render(doc: dict) -> str:
    lines = [f"`{doc['command']}` ({doc['when']}, {doc['machine']['cpus']} CPUs, load average at the end "
             f"{doc['machine'].get('load_average_at_end')}; {doc['run_seconds'] / 60:.0f} min; {doc['network']}).", ""]
    for name, entry in doc["workloads"].items():
        lines += workload(name, entry)
    lines += targets(doc) + drill(doc) + faults(doc)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0]) if argv else RESULTS_DIR / "e2e.json"
    print(render(json.loads(path.read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
