"""Request traces: the Mooncake FAST'25 traces from disk, or a small one generated here.

A request is its arrival time, its prompt length and its prompt's chain of
512-token prefix blocks (``hash_ids``: equal ids are the same KV; the last
block may be partial). Where the shared traces are depends on the checkout:
``--traces DIR``, else ``$STRATA_TRACES``, else ``../shared/data/mooncake_traces``
beside the repository (a worktree of this project has it; CI's fresh clone
does not, so its smoke run uses :func:`generated`).

:func:`generated` makes a trace with the same shape, deterministically from a
seed: sessions whose turns extend their own history and share one of a few
system prompts, Poisson arrivals. Its figures mean nothing beyond "the code
ran"; it exists so that the benchmark runs anywhere.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

BLOCK_TOKENS = 512  # the traces' block size
TRACE_NAMES = ("conversation", "synthetic")
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class Request:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]  # hash_ids: the prompt's prefix blocks, in order

    def block_tokens(self, i: int) -> int:
        """Tokens of block ``i`` of this prompt (512 but for a partial last block)."""
        return min(BLOCK_TOKENS, self.input_tokens - BLOCK_TOKENS * i)


@dataclass(frozen=True)
class Trace:
    name: str
    requests: tuple[Request, ...]
    source: str  # the file it was read from, or how it was generated

    @property
    def input_tokens(self) -> int:
        return sum(r.input_tokens for r in self.requests)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0


def traces_dir(explicit: str | None = None) -> Path | None:
    """Where the shared traces are, or None when they are not on this machine."""
    for candidate in (explicit, os.environ.get("STRATA_TRACES"), REPO.parent / "shared" / "data" / "mooncake_traces"):
        if candidate and (Path(candidate) / "conversation_trace.jsonl").is_file():
            return Path(candidate)
    if explicit:
        raise SystemExit(f"--traces {explicit}: no conversation_trace.jsonl there")
    return None


def load(folder: Path, name: str, limit: int | None = None) -> Trace:
    """``<name>_trace.jsonl`` of ``folder``, its first ``limit`` requests (all by default)."""
    path = folder / f"{name}_trace.jsonl"
    requests = []
    with path.open() as f:
        for line in f:
            if limit is not None and len(requests) >= limit:
                break
            r = json.loads(line)
            requests.append(Request(r["timestamp"] / 1000.0, r["input_length"], r["output_length"], tuple(r["hash_ids"])))
    requests.sort(key=lambda r: r.arrival_s)  # stable: the file's order among equal timestamps
    return Trace(name, tuple(requests), str(path))


def generated(seed: int = 1, requests: int = 400, sessions: int = 60, rate_per_s: float = 4.0) -> Trace:
    """A small trace of the traces' shape, the same for the same arguments."""
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    system_prompts = [fresh(rng.randint(1, 4)) for _ in range(4)]
    histories = [list(rng.choice(system_prompts)) for _ in range(sessions)]
    t, out = 0.0, []
    for _ in range(requests):
        t += rng.expovariate(rate_per_s)
        history = histories[rng.randrange(sessions)]
        history += fresh(rng.randint(1, 3))
        tokens = BLOCK_TOKENS * (len(history) - 1) + rng.randint(1, BLOCK_TOKENS)
        out.append(Request(round(t, 3), tokens, rng.randint(1, 500), tuple(history)))
    return Trace("generated", tuple(out), f"generated in-process (seed {seed}, {requests} requests)")


def theoretical_max(trace: Trace) -> float:
    """The hit rate in tokens with unlimited cache (:func:`max_hit_tokens` of the trace's input tokens)."""
    return max_hit_tokens(trace) / trace.input_tokens


def max_hit_tokens(trace: Trace) -> int:
    """The tokens an unlimited cache hits: each prompt's leading blocks that an earlier request had."""
    seen: set[int] = set()
    hit = 0
    for r in trace.requests:
        for i, block in enumerate(r.blocks):
            if block not in seen:
                break
            hit += r.block_tokens(i)
        seen.update(r.blocks)
    return hit
