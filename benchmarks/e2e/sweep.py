"""The load sweep: offered load as a share of the fleet's measured capacity, and the reference run behind it.

For each workload (W1: a context per session; W2: a shared system prompt,
:mod:`benchmarks.e2e.workload`) the sweep draws one set of sessions per
load point (tokens seeded by the point: no point's prompts are another's
hits) and, before any policy runs, sends every prompt of every point once
to an engine with no cache at all, on an idle fleet (the **reference
run**, :func:`run_reference`). That run gives three things:

- the **expected tokens** of every request (greedy decoding is
  deterministic), against which every policy's answers are checked: hit
  fidelity is the share equal token for token (:class:`~benchmarks.e2e.stats.Fidelity`);
- the **capacity**: replicas / the mean cold service time (first token
  sent to last token received) of the workload's requests, what the fleet
  serves when nothing is cached;
- the **TTFT SLO**: the median cold TTFT of a turn-1 prompt (a returning
  user should wait no longer than a new conversation's first answer on an
  idle replica).

A load point ``u`` then offers ``u`` × capacity requests per second:
sessions arrive as a Poisson process of ``u × capacity / turns`` per second
(each brings ``turns`` requests), and within a session each turn follows
the previous answer after a think time (``think_factor`` × the mean cold
service time). The load is offered in cold-capacity units: a policy whose
requests hit the cache serves the same offer at a lower utilization,
which is the point.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import aiohttp

from benchmarks.e2e.client import completion_body, monotonic_clock, stream_completion
from benchmarks.e2e.policies import Policy
from benchmarks.e2e.stats import RequestRecord
from benchmarks.e2e.workload import Workload, WorkloadSpec

# The cold reference: no prefix cache, no pool, no events; round robin (it is sent to the engines directly).
REFERENCE = Policy("ref", "cold reference, no cache", "round-robin", "none", kv_events=False, pool=False)
WORKLOADS = {"w1": "W1: a context per session, nothing shared", "w2": "W2: a shared system prompt + history"}


def parse_loads(text: str) -> tuple[float, ...]:
    """``"0.2,0.4"`` -> (0.2, 0.4): each in (0, 1.5], ascending."""
    try:
        loads = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--loads {text!r}: give comma-separated numbers such as 0.2,0.4,0.6,0.8") from None
    if not loads or any(not 0 < u <= 1.5 for u in loads):
        raise ValueError(f"--loads {text!r}: each load is a share of the fleet's capacity in (0, 1.5]")
    return tuple(sorted(set(loads)))


def parse_workloads(text: str) -> tuple[str, ...]:
    names = tuple(w.strip().lower() for w in text.split(",") if w.strip())
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown or not names:
        raise ValueError(f"--workloads {text!r}: choose from {', '.join(WORKLOADS)}")
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class SweepSpec:
    workloads: tuple[str, ...] = ("w1", "w2")
    loads: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8)
    sessions: int = 16  # per load point: 48 turn-2+ requests for each point's intervals; the run 30-70 min
    turns: int = 4
    system_tokens: int = 1000  # W1: each session's own context; W2: the shared system prompt
    user_tokens: int = 200
    output_tokens: int = 16
    think_factor: float = 2.0  # mean think time / the mean cold service time
    seed: int = 0

    def workload(self, name: str, point: int, vocab_size: int, *, arrival_rate_per_s: float = 0.0,
                 think_mean_s: float = 1.0, sessions: int | None = None) -> Workload:
        """Point ``point``'s sessions of workload ``name``: its tokens depend on the point only, its times
        on the rate and think time too."""
        return Workload(WorkloadSpec(
            sessions=sessions or self.sessions, turns=self.turns, system_tokens=self.system_tokens, user_tokens=self.user_tokens,
            output_tokens=self.output_tokens, think_mean_s=think_mean_s, think_min_s=0.1 * think_mean_s,
            seed=self.seed * 1000 + point, vocab_size=vocab_size, shared=name == "w2",
            arrival_rate_per_s=arrival_rate_per_s))


@dataclass
class Reference:
    """One workload's cold reference run: every prompt's expected tokens and the timings capacity is set by."""

    workload: str
    replicas: int
    expected: dict[tuple[int, int, int], list[int]] = field(default_factory=dict)  # (point, session, turn) -> ids
    records: list[RequestRecord] = field(default_factory=list)

    @property
    def failed(self) -> list[RequestRecord]:
        return [r for r in self.records if not r.ok or r.output_ids is None]

    @property
    def service_s(self) -> float:
        """The mean cold service time: request sent to its last token."""
        return statistics.fmean(r.done_s - r.sent_s for r in self.records if r.ok)

    @property
    def capacity_rps(self) -> float:
        return self.replicas / self.service_s

    @property
    def slo_s(self) -> float:
        return statistics.median(r.ttft_s for r in self.records if r.ok and r.turn == 0)

    def arrival_rate(self, load: float, turns: int) -> float:
        """Sessions per second that offer ``load`` × capacity requests per second."""
        return load * self.capacity_rps / turns

    def to_json(self) -> dict:
        ok = [r for r in self.records if r.ok]
        ttft = statistics.fmean(r.ttft_s for r in ok)
        return {
            "requests": len(self.records), "failed": len(self.failed),
            "cold_service_mean_s": round(self.service_s, 4), "cold_ttft_mean_s": round(ttft, 4),
            "prefill_share_of_service": round(ttft / self.service_s, 3),
            "ttft_slo_s": round(self.slo_s, 4), "capacity_rps": round(self.capacity_rps, 4),
            "cold_ttft_by_turn_s": {t: round(statistics.median(r.ttft_s for r in ok if r.turn == t), 4)
                                    for t in sorted({r.turn for r in ok})},
        }


async def _reference(urls: Sequence[str], model: str, jobs: list[tuple[int, int, int, list[int]]],
                     output_tokens: int, timeout_s: float) -> list[RequestRecord]:
    """Every job once, each engine computing one at a time (so each is timed on an idle engine)."""
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    records: list[RequestRecord] = []
    clock = monotonic_clock()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)) as http:

        async def worker(url: str) -> None:
            while not queue.empty():
                point, session, turn, prompt = queue.get_nowait()
                record = RequestRecord(session=session, turn=turn, sent_s=clock(), prompt_tokens_sent=len(prompt),
                                       point=point)
                records.append(record)
                await stream_completion(http, url.rstrip("/") + "/v1/completions",
                                        completion_body(model, prompt, output_tokens), record, clock,
                                        timeout_s=timeout_s)

        await asyncio.gather(*(worker(u) for u in urls))
    return records


def run_reference(name: str, urls: Sequence[str], model: str, workloads: Iterable[tuple[int, Workload]], *,
                  timeout_s: float = 300.0) -> Reference:
    """Send every prompt of ``workloads`` ((point, workload) pairs) to the engines at ``urls`` (configured
    with no cache: :data:`REFERENCE`), one request per engine at a time; longest prompts first, so the
    engines finish together."""
    jobs, output_tokens = [], 0
    for point, w in workloads:
        output_tokens = w.spec.output_tokens
        jobs += [(point, s, t, p) for s, t, p in w.prompts()]
    jobs.sort(key=lambda j: -len(j[3]))
    records = asyncio.run(_reference(list(urls), model, jobs, output_tokens, timeout_s))
    ref = Reference(name, len(urls), records=records)
    ref.expected = {(r.point, r.session, r.turn): r.output_ids for r in records if r.ok and r.output_ids is not None}
    return ref
