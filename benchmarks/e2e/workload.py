"""The multi-turn chat workload: sessions, turns, token ids and think times, all drawn from one seed.

Two shapes (``WorkloadSpec.shared``):

- **W1, own context** (``shared=False``): each session starts from a
  context of its own (a document or a tool's output, ``system_tokens``
  long) that no other session has: nothing is shared across sessions, so
  only a replica that served the session's earlier turns, or the shared
  pool, holds its prefix. The shape of the 3.2× reference.
- **W2, shared system prompt** (``shared=True``): every session starts
  from one system prompt (what a fleet serving one assistant sees: the
  same instructions ahead of every conversation), which every replica holds
  after its first request.

Either way each turn adds the user's new tokens after the previous turns'
prompt and reply. A turn's prompt is therefore the previous turn's prompt,
then its reply, then the new user tokens: the longest prefix an engine
could have cached is the whole previous prompt.

The replies are the workload's own tokens, not the model's: with random
weights the model's text means nothing, and fixing the reply keeps every
policy's prompts identical token for token, so policies differ only in
where the KV comes from. The engine is still asked for ``output_tokens``
tokens per turn (it decodes them; their timing is the TPOT).

Token ids are drawn uniformly from ``[first_id, vocab_size)`` (ids below
``first_id`` are the tokenizer's special tokens), so no two sessions share
anything past the system prompt.

Think times (the user reading and typing between a reply and the next
turn) are exponential with mean ``think_mean_s`` plus a floor
``think_min_s``: a Poisson user, never back to back. Sessions start at
exponential offsets of their own (mean ``start_mean_s``), so the first turns
do not all arrive in the same instant either; or, with
``arrival_rate_per_s``, as a Poisson process of that rate (the load sweep's
offered load: new conversations arrive whatever the fleet is doing).

Tokens and times come from two streams of the one seed: the same seed with
another think time or arrival rate sends the same prompts, so every load
point of a sweep can be checked against one cold reference run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkloadSpec:
    """What the issue fixes (sessions × turns, token counts) and what paces the users."""

    sessions: int = 8
    turns: int = 5
    system_tokens: int = 1000
    user_tokens: int = 200
    output_tokens: int = 50
    think_mean_s: float = 2.0
    think_min_s: float = 0.25
    start_mean_s: float = 1.0
    seed: int = 0
    vocab_size: int = 32000
    first_id: int = 4
    shared: bool = True  # W2: one system prompt ahead of every session; False (W1): a context per session
    arrival_rate_per_s: float = 0.0  # > 0: sessions start as a Poisson process of this rate

    @property
    def name(self) -> str:
        return "w2" if self.shared else "w1"

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "system_tokens", "user_tokens", "output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.think_mean_s < 0 or self.think_min_s < 0 or self.start_mean_s < 0 or self.arrival_rate_per_s < 0:
            raise ValueError("think and start times must be >= 0 seconds")
        if self.think_min_s <= 0 and self.think_mean_s <= 0:
            raise ValueError("think_min_s or think_mean_s must be > 0: turns must never arrive back to back")
        if not 0 <= self.first_id < self.vocab_size:
            raise ValueError(f"first_id {self.first_id} must lie in [0, vocab_size={self.vocab_size})")


@dataclass(frozen=True)
class Turn:
    """One request of a session: the tokens it adds and the pause before it is sent."""

    session: int
    index: int  # 0-based; turn 1 of the issue is index 0
    think_s: float  # after the previous turn's reply (for index 0: after the session's start offset)
    user: tuple[int, ...]
    reply: tuple[int, ...]  # the tokens the next turn carries as this turn's answer


@dataclass(frozen=True)
class Session:
    index: int
    start_s: float
    turns: tuple[Turn, ...] = field(repr=False)


class Workload:
    """The sessions of one seeded run; :meth:`prompt` builds a turn's full token list."""

    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec
        rng = random.Random(spec.seed)  # tokens
        times = random.Random(f"times-{spec.seed}")
        self.system = self._tokens(rng, spec.system_tokens) if spec.shared else ()
        self.contexts: tuple[tuple[int, ...], ...] = ()
        if not spec.shared:
            self.contexts = tuple(self._tokens(rng, spec.system_tokens) for _ in range(spec.sessions))
        sessions = []
        arrival = 0.0
        for s in range(spec.sessions):
            if spec.arrival_rate_per_s > 0:
                arrival += times.expovariate(spec.arrival_rate_per_s)
                start = arrival
            else:
                start = times.expovariate(1.0 / spec.start_mean_s) if spec.start_mean_s > 0 else 0.0
            turns = []
            for t in range(spec.turns):
                think = 0.0 if t == 0 else self._think(times)
                turns.append(Turn(s, t, think, self._tokens(rng, spec.user_tokens),
                                  self._tokens(rng, spec.output_tokens)))
            sessions.append(Session(s, start, tuple(turns)))
        self.sessions: tuple[Session, ...] = tuple(sessions)

    def context(self, session: int) -> tuple[int, ...]:
        """What ``session``'s first prompt starts with: the shared system prompt (W2) or its own (W1)."""
        return self.system if self.spec.shared else self.contexts[session]

    def _tokens(self, rng: random.Random, n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(self.spec.first_id, self.spec.vocab_size) for _ in range(n))

    def _think(self, rng: random.Random) -> float:
        mean = self.spec.think_mean_s
        return self.spec.think_min_s + (rng.expovariate(1.0 / mean) if mean > 0 else 0.0)

    def prompt(self, session: int, turn: int) -> list[int]:
        """The context, then for each earlier turn its user tokens and reply, then this turn's user tokens."""
        turns = self.sessions[session].turns
        out = list(self.context(session))
        for earlier in turns[:turn]:
            out.extend(earlier.user)
            out.extend(earlier.reply)
        out.extend(turns[turn].user)
        return out

    def prompt_tokens(self, turn: int) -> int:
        """The prompt length of turn ``turn`` (0-based), the same for every session."""
        s = self.spec
        return s.system_tokens + turn * (s.user_tokens + s.output_tokens) + s.user_tokens

    @property
    def requests(self) -> int:
        return self.spec.sessions * self.spec.turns

    def prompts(self):
        """Every (session, turn, prompt), turn by turn within a session."""
        for s in self.sessions:
            for t in s.turns:
                yield s.index, t.index, self.prompt(s.index, t.index)
