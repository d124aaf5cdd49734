"""Time to first token with a cached prefix vs a cold prefill, on the engine's own code path.

``python -m benchmarks.e2e.ttft --model DIR [--prompt-tokens 4096] [--cached-tokens 4032]``
(or :func:`measure`) runs an :class:`~benchmarks.e2e.engine.Engine` in-process with the
``blocks`` prefix cache. Per round it takes a fresh random prompt (seeded token ids):

- cold: the prompt with nothing cached, a full prefill of ``prompt_tokens``;
- hit: a second prompt sharing the first ``cached_tokens`` (whole blocks) and differing after,
  so only the tail is prefilled on top of KV rebuilt from the block cache (the rebuild is timed);
- check: the same second prompt on an engine without a cache must give the same first token.

It reports the median of each and their ratio. The figure depends on the machine and on the
threads given (``--threads``); the benchmark's claim is the ratio, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from dataclasses import asdict, dataclass, replace

from benchmarks.e2e.engine import Engine, EngineConfig


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
    ratio: float
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
    cold, hit, equal = [], [], True
    try:
        # One untimed pass so that the timed ones do not include torch's first-call setup.
        cached.generate([rng.randrange(special, vocab) for _ in range(64)], 1, temperature=0)
        for _ in range(rounds):
            prompt = [rng.randrange(special, vocab) for _ in range(prompt_tokens)]
            tail = [rng.randrange(special, vocab) for _ in range(prompt_tokens - cached_tokens)]
            second = prompt[:cached_tokens] + tail
            g = cached.generate(prompt, 1, temperature=0)
            cold.append(g.prefill_s)
            g2 = cached.generate(second, 1, temperature=0)
            hit.append(g2.prefill_s)  # from the request's start: hashing, lookup and KV rebuild included
            if g2.cached_local != cached_tokens:
                raise RuntimeError(f"the hit reused {g2.cached_local} tokens, not {cached_tokens}")
            ref = plain.generate(second, 1, temperature=0)
            equal = equal and ref.tokens[0] == g2.tokens[0]
    finally:
        cached.close()
        plain.close()
    cm, hm = statistics.median(cold), statistics.median(hit)
    return TTFTResult(prompt_tokens, cached_tokens, rounds, threads, cold, hit, cm, hm, cm / hm, equal)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e.ttft", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--cached-tokens", type=int, default=4032)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", help="write the result as JSON here")
    a = p.parse_args(argv)
    r = measure(a.model, prompt_tokens=a.prompt_tokens, cached_tokens=a.cached_tokens, rounds=a.rounds,
                threads=a.threads)
    text = json.dumps(asdict(r), indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    if not r.first_token_equal:
        sys.exit("the first token with the cached prefix differs from the cold one")


if __name__ == "__main__":
    main()
