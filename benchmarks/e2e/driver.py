"""Drives a workload's sessions against one OpenAI-compatible endpoint (the router), all at once.

Each session is a closed loop: wait its start offset, send turn 1, read the
whole streamed answer, think, send turn 2, ... A failed turn does not end
the session (the next turn's prompt is the workload's, whatever happened to
this one), so every policy sends the same requests. ``on_answer`` is called
after each request with the records so far and ``before_last_turn`` before
a session's last turn: the fault schedule hooks in there, so faults land at
the same point of the run whatever the machine's speed, and all of them
before the run ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp

from benchmarks.e2e.client import completion_body, monotonic_clock, stream_completion
from benchmarks.e2e.stats import RequestRecord
from benchmarks.e2e.workload import Workload

MAX_CONNECTIONS = 64


async def run_sessions(
    workload: Workload, base_url: str, model: str, *, timeout_s: float = 300.0,
    on_answer: Callable[[list[RequestRecord]], None] | None = None, clock: Callable[[], float] | None = None,
    before_last_turn: Callable[[], Awaitable[None]] | None = None,
) -> list[RequestRecord]:
    """Run every session of ``workload`` against ``base_url``; returns one record per request, in send order.

    ``clock``: seconds since the run's start (the fault schedule's clock too); by default, from now.
    ``before_last_turn``: awaited before each session's last turn is sent (the fault phase holds the
    last turns until every fault has happened)."""
    clock = clock or monotonic_clock()
    records: list[RequestRecord] = []
    url = base_url.rstrip("/") + "/v1/completions"
    connector = aiohttp.TCPConnector(limit=MAX_CONNECTIONS, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def session(index: int) -> None:
            s = workload.sessions[index]
            await asyncio.sleep(s.start_s)
            for turn in s.turns:
                if turn.think_s:
                    await asyncio.sleep(turn.think_s)
                if before_last_turn is not None and turn.index == len(s.turns) - 1:
                    await before_last_turn()
                prompt = workload.prompt(s.index, turn.index)
                record = RequestRecord(session=s.index, turn=turn.index, sent_s=clock(), prompt_tokens_sent=len(prompt))
                records.append(record)
                body = completion_body(model, prompt, workload.spec.output_tokens)
                await stream_completion(http, url, body, record, clock, timeout_s=timeout_s)
                if on_answer is not None:
                    on_answer(records)

        await asyncio.gather(*(session(i) for i in range(len(workload.sessions))))
    return records


def run(workload: Workload, base_url: str, model: str, **kw) -> list[RequestRecord]:
    return asyncio.run(run_sessions(workload, base_url, model, **kw))
