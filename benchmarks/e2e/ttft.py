"""Time to first token with a cached prefix vs a cold prefill, on the engine's own code path.

``python -m benchmarks.e2e.ttft [--model DIR] [--prompt-tokens 4096] [--cached-tokens 4032]``
(or :func:`measure`; without ``--model`` the bench model is built in a scratch directory) runs an :class:`~benchmarks.e2e.engine.Engine` in-process with the
``blocks`` prefix cache. Per round it takes a fresh random prompt (seeded token ids):

- cold: the prompt with nothing cached, a full prefill of ``prompt_tokens``;
- hit: a second prompt sharing the first ``cached_tokens`` (whole blocks) and differing after,
  so only the tail is prefilled on top of KV rebuilt from the block cache (the rebuild is timed);
- check: the same second prompt on an engine without a cache must give the same first token.

It reports the median of each and their ratio, in wall-clock time and in the computing thread's
CPU time (with ``--threads 1`` that is all of the model's work; on a shared machine the wall
clock also counts time the thread waited for a core). The figures depend on the machine and on
the threads given; the benchmark's claim is the ratio, not the seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.e2e.engine import Engine, EngineConfig
from benchmarks.e2e.model import build
from benchmarks.harness import RESULTS_DIR, Case


@dataclass(frozen=True)
class TTFTResult:
    prompt_tokens: int
    cached_tokens: int
    rounds: int
    threads: int
    cold_s: list[float]
    hit_s: list[float]
    cold_median_s: float
    hit_median_s: float
    ratio: float  # of the wall-clock medians
    cold_cpu_median_s: float
    hit_cpu_median_s: float
    cpu_ratio: float  # of the computing thread's CPU time: what the ratio is without other load
    first_token_equal: bool


def measure(model_dir: str, *, prompt_tokens: int = 4096, cached_tokens: int = 4032, rounds: int = 3,
            threads: int = 0, block_size: int = 16, seed: int = 0) -> TTFTResult:
    if cached_tokens % block_size or not 0 < cached_tokens < prompt_tokens:
        raise ValueError(f"cached_tokens must be whole blocks of {block_size} below prompt_tokens")
    base = EngineConfig(model=model_dir, block_size=block_size, threads=threads,
                        cache_blocks=2 * rounds * (prompt_tokens // block_size + 1) + 8)
    cached = Engine(replace(base, prefix_cache="blocks"))
    plain = Engine(replace(base, prefix_cache="none"))
    vocab = cached.runner.model.config.vocab_size
    rng = random.Random(seed)
    special = 8  # the tokenizer's special tokens come first; prompts stay clear of them
    cold, hit, cold_cpu, hit_cpu, equal = [], [], [], [], True
    try:
        # One untimed pass so that the timed ones do not include torch's first-call setup.
        cached.generate([rng.randrange(special, vocab) for _ in range(64)], 1, temperature=0)
        for _ in range(rounds):
            prompt = [rng.randrange(special, vocab) for _ in range(prompt_tokens)]
            tail = [rng.randrange(special, vocab) for _ in range(prompt_tokens - cached_tokens)]
            second = prompt[:cached_tokens] + tail
            g = cached.generate(prompt, 1, temperature=0)
            cold.append(g.prefill_s)
            cold_cpu.append(g.prefill_cpu_s)
            g2 = cached.generate(second, 1, temperature=0)
            hit.append(g2.prefill_s)  # from the request's start: hashing, lookup and KV rebuild included
            hit_cpu.append(g2.prefill_cpu_s)
            if g2.cached_local != cached_tokens:
                raise RuntimeError(f"the hit reused {g2.cached_local} tokens, not {cached_tokens}")
            ref = plain.generate(second, 1, temperature=0)
            equal = equal and ref.tokens[0] == g2.tokens[0]
    finally:
        cached.close()
        plain.close()
    cm, hm = statistics.median(cold), statistics.median(hit)
    ccm, hcm = statistics.median(cold_cpu), statistics.median(hit_cpu)
    return TTFTResult(prompt_tokens, cached_tokens, rounds, threads, cold, hit, cm, hm, cm / hm, ccm, hcm, ccm / hcm,
                      equal)


def cases(r: TTFTResult) -> list[Case]:
    """The result as the shared harness's rows: the hit's time over the cold one's (lower is better)."""
    target = 1 / 20
    what = f"TTFT, {r.cached_tokens} of {r.prompt_tokens} tokens cached"
    return [
        Case(f"{what} (wall)", r.hit_median_s, "full prefill (wall)", r.cold_median_s, target, False, "time", "s",
             f"threads {r.threads}; first token equal: {r.first_token_equal}"),
        Case(f"{what} (CPU)", r.hit_cpu_median_s, "full prefill (CPU)", r.cold_cpu_median_s, target, False, "time",
             "s", "the computing thread's CPU time"),
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e.ttft", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: build the bench model in a scratch directory)")
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--cached-tokens", type=int, default=4032)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--out", default=str(RESULTS_DIR / "e2e_ttft.json"), help="where to write the results")
    a = p.parse_args(argv)
    with contextlib.ExitStack() as stack:
        model = a.model
        if model is None:
            model = str(build(stack.enter_context(tempfile.TemporaryDirectory(prefix="e2e-model-")), "bench"))
        r = measure(model, prompt_tokens=a.prompt_tokens, cached_tokens=a.cached_tokens, rounds=a.rounds,
                    threads=a.threads)
    rows = cases(r)
    doc = {
        "benchmark": "e2e_ttft",
        # The model's directory is left out: it is the bench model, wherever it was built.
        "command": f"python -m benchmarks.e2e.ttft --prompt-tokens {a.prompt_tokens} --cached-tokens "
                   f"{a.cached_tokens} --rounds {a.rounds} --threads {a.threads}",
        "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_1m": round(os.getloadavg()[0], 1)},
        "cases": [c.to_json() for c in rows],
        "detail": asdict(r),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")
    for c in rows:
        print(f"{c.case}: {c.value:.3f} s vs {c.baseline_value:.3f} s, {1 / c.ratio:.1f}x sooner")
    print(f"results: {a.out}")
    if not r.first_token_equal:
        sys.exit("the first token with the cached prefix differs from the cold one")


if __name__ == "__main__":
    main()
