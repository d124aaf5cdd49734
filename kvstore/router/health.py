"""Health checks of the endpoints: GET /health every interval, and the engine's queue from /metrics.

An endpoint whose check fails (connection refused, a status other than 200,
no answer within the health timeout) leaves rotation at the end of that
check, so a dead engine is out within one interval; it returns after a check
passes. A proxied request whose connection is refused takes it out at once
(:meth:`HealthChecker.mark_down`), without waiting for the next round.

The queue gauge (vLLM's ``vllm:num_requests_waiting`` by default) is
summed over its samples (one per model name) and added to the endpoint's
load; an engine without that gauge counts a queue of 0, and so does one
whose sum is not a count at all (negative, NaN or infinite): a NaN load
compares neither less nor more than any other and a negative one draws
every request, so either would steer the policies by an engine's bug.
"""

from __future__ import annotations

import asyncio
import logging
import math

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvstore.router.endpoint import Endpoint
from kvstore.router.metrics import RouterMetrics

log = logging.getLogger(__name__)

MAX_METRICS_BYTES = 4 << 20  # an engine's /metrics page read for its queue gauge


def queue_depth(text: str, metric: str) -> float | None:
    """The sum of ``metric``'s samples in a Prometheus text page; None when it is absent, does not parse,
    or is not a finite count of zero or more."""
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        return None
    values = [s.value for f in families for s in f.samples if s.name == metric]
    total = float(sum(values)) if values else None
    return total if total is not None and math.isfinite(total) and total >= 0 else None


class HealthChecker:
    def __init__(self, endpoints: list[Endpoint], session: aiohttp.ClientSession, metrics: RouterMetrics, *,
                 interval_s: float, timeout_s: float, queue_metric: str) -> None:
        self._endpoints = endpoints
        self._session = session
        self._metrics = metrics
        self._interval = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._queue_metric = queue_metric
        self.rounds = 0  # health rounds completed

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(e) for e in self._endpoints))
        self.rounds += 1
        self._metrics.health_rounds.inc()

    async def _check(self, e: Endpoint) -> None:
        error = await self._probe(e)
        if error is None and self._queue_metric:
            e.queue_depth = await self._scrape(e)
            self._metrics.queue_depth.labels(e.label).set(e.queue_depth)
        self._set(e, error)

    async def _probe(self, e: Endpoint) -> str | None:
        try:
            async with self._session.get(e.url + "/health", timeout=self._timeout) as r:
                await r.read()
                return None if r.status == 200 else f"GET /health answered {r.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            return f"GET /health failed: {type(err).__name__} {err}"

    async def _scrape(self, e: Endpoint) -> float:
        try:
            async with self._session.get(e.url + "/metrics", timeout=self._timeout) as r:
                if r.status != 200:
                    return 0.0
                text = (await r.content.read(MAX_METRICS_BYTES)).decode("utf-8", "replace")
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return 0.0
        found = queue_depth(text, self._queue_metric)
        return found if found is not None else 0.0

    def mark_down(self, e: Endpoint, reason: str) -> None:
        """A proxied request could not connect: out of rotation now, until a health check passes."""
        self._set(e, reason)

    def _set(self, e: Endpoint, error: str | None) -> None:
        healthy = error is None
        if healthy != e.healthy:
            if healthy:
                log.info("endpoint %s (%s) is healthy again; back in rotation", e.label, e.url)
            else:
                log.warning("endpoint %s (%s) is out of rotation: %s", e.label, e.url, error)
        e.healthy = healthy
        e.last_error = error or ""
        self._metrics.endpoint_healthy.labels(e.label).set(1 if healthy else 0)
