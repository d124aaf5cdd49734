"""The benchmark's HTTP client: one streamed completion, timed as a user sees it.

TTFT is from the moment the request is written to the first streamed chunk
that carries a choice (the first token; its text may be empty when a token
is half a UTF-8 character, so the chunk counts, not the text). TPOT is the
rest of the stream over the tokens after the first. Usage, cached tokens
included, comes from the final chunk (``stream_options.include_usage``).

Failures are recorded, never raised: each gets a short reason first
(``connect``, ``http_<status>``, ``stream_broken``, ``timeout``,
``bad_stream``), which the fault report counts by. An HTTP 429 (an engine's
queue is full) is waited out for its ``Retry-After`` and sent again, at
most ``max_retries`` times: the queue is a limit, not a failure.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

import aiohttp

from benchmarks.e2e.stats import RequestRecord

log = logging.getLogger(__name__)

MAX_RETRY_AFTER_S = 5.0
MAX_LINE_BYTES = 1 << 20  # one SSE line; a chunk of one token is far smaller


def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,  # every answer is max_tokens long, as the workload says
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,  # the generated ids, checked against a cold reference run (hit fidelity)
    }


async def stream_completion(
    http: aiohttp.ClientSession, url: str, body: dict, record: RequestRecord, clock: Callable[[], float], *,
    timeout_s: float = 300.0, max_retries: int = 5,
) -> RequestRecord:
    """POST ``body`` to ``url`` (``.../v1/completions``) and fill ``record`` from the stream."""
    try:
        return await _attempts(http, url, body, record, clock, timeout_s, max_retries)
    finally:
        record.ended_s = clock()


async def _attempts(http: aiohttp.ClientSession, url: str, body: dict, record: RequestRecord,
                    clock: Callable[[], float], timeout_s: float, max_retries: int) -> RequestRecord:
    for attempt in range(max_retries + 1):
        record.sent_s = clock()
        try:
            retry_after = await asyncio.wait_for(_once(http, url, body, record, clock), timeout_s)
        except asyncio.TimeoutError:
            record.error = f"timeout: no complete answer within {timeout_s:.0f} s"
            return record
        if retry_after is None:
            return record
        if attempt == max_retries:
            record.error = f"http_429: still refused after {max_retries} retries"
            return record
        record.retries += 1
        await asyncio.sleep(retry_after)
    return record


async def _once(http: aiohttp.ClientSession, url: str, body: dict, record: RequestRecord,
                clock: Callable[[], float]) -> float | None:
    """One attempt; returns the delay to wait before retrying (429), else None with ``record`` filled."""
    try:
        async with http.post(url, json=body) as resp:
            record.status = resp.status
            if resp.status == 429:
                try:
                    delay = float(resp.headers.get("Retry-After", "1"))
                except ValueError:
                    delay = 1.0
                await resp.read()
                return min(max(delay, 0.05), MAX_RETRY_AFTER_S)
            if resp.status != 200:
                text = (await resp.text(errors="replace"))[:300]
                record.error = f"http_{resp.status}: {text}"
                return None
            await _read_stream(resp, record, clock)
    except aiohttp.ClientPayloadError as e:
        record.error = f"stream_broken: {e}"
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
        record.error = ("stream_broken: " if record.status else "connect: ") + str(e)
    except aiohttp.ClientConnectionError as e:
        record.error = f"connect: {e}"
    return None


async def _read_stream(resp: aiohttp.ClientResponse, record: RequestRecord, clock: Callable[[], float]) -> None:
    done = False
    tokens = 0
    usage = None
    strata = None
    ids = None
    async for raw in resp.content:
        if len(raw) > MAX_LINE_BYTES:
            record.error = "bad_stream: an SSE line over 1 MiB"
            return
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            record.error = f"stream_error: {str(chunk['error'])[:300]}"
            return
        if chunk.get("choices"):
            now = clock()
            if record.first_token_s is None:
                record.first_token_s = now
            tokens += 1
            record.done_s = now
        if chunk.get("usage"):
            usage = chunk["usage"]
        if isinstance(chunk.get("token_ids"), list):
            ids = chunk["token_ids"]
        strata = chunk.get("strata") or (usage or {}).get("strata") or strata
    if not done:
        record.error = "stream_broken: the stream ended before [DONE]"
        return
    if record.first_token_s is None:
        record.error = "bad_stream: no token in the stream"
        return
    if usage is None:
        record.error = "bad_stream: no usage in the stream (stream_options.include_usage)"
        return
    record.prompt_tokens = int(usage.get("prompt_tokens", 0))
    record.completion_tokens = int(usage.get("completion_tokens", tokens))
    details = usage.get("prompt_tokens_details") or {}
    record.cached_tokens = int(details.get("cached_tokens") or 0)
    if ids is not None:
        record.output_ids = [int(i) for i in ids]
    if strata:
        record.cached_local = int(strata.get("cached_local") or 0)
        record.cached_pool = int(strata.get("cached_pool") or 0)
        record.engine_id = str(strata.get("engine_id") or "")


def monotonic_clock(start: float | None = None) -> Callable[[], float]:
    """Seconds since ``start`` (now, by default), from the monotonic clock."""
    t0 = time.monotonic() if start is None else start
    return lambda: time.monotonic() - t0
