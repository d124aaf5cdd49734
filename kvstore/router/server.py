"""The router: an OpenAI-compatible HTTP front for several engines, picking one per request.

    POST /v1/completions, /v1/chat/completions   routed by the policy, proxied byte for byte (with
                                                 --prefill-endpoint: prefilled there first, then sent
                                                 on with the kv_transfer_params it answered)
    GET  /v1/models                              proxied to a healthy endpoint
    GET  /health                                 200 while some endpoint is in rotation, else 503
    GET  /metrics                                the router's own Prometheus metrics

A request's way: its headers whole within ``header_timeout_seconds`` of the
connection's opening, or the connection closed (:mod:`kvstore.router.headers`;
a kept-alive connection's next request, within ``keepalive_timeout_seconds``
of its last response); its body read up to ``max_body_bytes`` (413) within
``body_timeout_seconds`` (408), among at most ``max_body_reads`` bodies
arriving at once (429; :mod:`kvstore.router.body` says why the body is read
before admission); admission (at most ``max_in_flight`` outstanding, beyond
that 429 with Retry-After, checked before the body too, so a full router
does not read bodies it will refuse); the body parsed as a JSON object
(400), its prompt tokenized and scored against the index (cache-aware only),
an endpoint picked among the healthy ones, the request forwarded. When the
pick refuses the connection it is taken out of rotation and the request goes
to another endpoint, at most ``retries`` times; once any byte went to an
engine it is never sent again.

``Router(settings)`` runs inside an existing event loop (``await
router.start()``, ``router.port``, ``await router.stop()``); ``run`` is the
``strata route`` process around it. Every answer the router gives itself,
an unknown path or method included, is an OpenAI-style JSON error body
(:mod:`kvstore.router.errors`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import signal
import time
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvstore.config.router import RouterSettings
from kvstore.index.keys import BlockHasher
from kvstore.router.body import BodyReader, parse_object
from kvstore.router.endpoint import Endpoint
from kvstore.router.errors import (
    BadRequest, MethodNotAllowed, NoEndpoint, NotFound, RequestRefused, TooManyRequests, UpstreamUnreachable,
)
from kvstore.router.headers import HeaderDeadline
from kvstore.router.health import HealthChecker
from kvstore.router.metrics import RouterMetrics
from kvstore.router.policy import CacheAware, Decision, PromptSize, make_policy
from kvstore.router.prompt import PromptTokenizer, chat_messages, completion_prompt, encodable
from kvstore.router.proxy import EndpointRefused, Upstream
from kvstore.router.scorer import PrefixScorer
from kvstore.router.ttft import Ticket, TtftFit

log = logging.getLogger(__name__)

OFF_LOOP_TOKENS = 2048
APIS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
ROUTES = ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health", "GET /metrics")


def error_body(err: RequestRefused) -> web.Response:
    headers = dict(err.headers)
    if err.retry_after_s:
        headers["Retry-After"] = str(int(err.retry_after_s))
    body = {"error": {"message": str(err), "type": err.kind, "code": err.status}}
    response = web.json_response(body, status=err.status, headers=headers)
    if err.body_unread:  # the rest of the body is not worth reading: no next request on this connection
        response.force_close()
    return response


class Router:
    def __init__(self, settings: RouterSettings, *, tokenizer: PromptTokenizer | None = None) -> None:
        self.settings = settings
        self._lora_adapters = frozenset(settings.lora_adapters)
        self.metrics = RouterMetrics()
        self.endpoints = [Endpoint(i, url, ids) for i, (url, ids) in enumerate(settings.endpoint_specs())]
        # Disaggregated serving: the prefill engines, labelled after the decode ones (--endpoint).
        self.prefill = [Endpoint(len(self.endpoints) + i, url, ids)
                        for i, (url, ids) in enumerate(settings.prefill_specs())]
        s = settings
        fit = TtftFit((s.ttft_overhead_seconds, s.ttft_prefill_seconds_per_token, s.ttft_seconds_per_request_ahead),
                      min_samples=s.ttft_min_samples, window=s.ttft_window)
        self.policy = make_policy(s.policy, score=s.cache_aware_score, prefix_weight=s.prefix_weight,
                                  load_weight=s.load_weight, fit=fit)
        self._tokenizer = tokenizer
        self._in_flight = 0
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._scorer: PrefixScorer | None = None
        self._health_task: asyncio.Task | None = None
        self._headers = HeaderDeadline(settings.header_timeout_seconds)
        self._headers_task: asyncio.Task | None = None
        self.health: HealthChecker | None = None
        self.port = 0
        for e in (*self.endpoints, *self.prefill):
            self.metrics.endpoint_info.labels(e.label, e.url, ",".join(e.ids)).set(1)
            self.metrics.endpoint_healthy.labels(e.label).set(1)
            self.metrics.endpoint_in_flight.labels(e.label).set(0)
        if self.policy.model is not None:
            self._export_fit()

    @property
    def url(self) -> str:
        return f"http://{self.settings.listen_host}:{self.port}"

    async def start(self) -> Router:
        s = self.settings
        if isinstance(self.policy, CacheAware):
            if self._tokenizer is None:
                self._tokenizer = await asyncio.to_thread(PromptTokenizer.from_dir, s.model_dir, s.max_prompt_tokens)
            hasher = BlockHasher(s.block_size, s.hash_seed)
            self._scorer = PrefixScorer(s.index, s.namespace, hasher, self.metrics, timeout_s=s.index_timeout_seconds,
                                        retry_s=s.index_retry_seconds, token_file=s.index_token_file,
                                        tier_namespace=s.tier_namespace, blocks_per_chunk=s.tier_blocks_per_chunk)
        timeout = aiohttp.ClientTimeout(total=None, connect=s.connect_timeout_seconds,
                                        sock_connect=s.connect_timeout_seconds, sock_read=s.upstream_timeout_seconds)
        connector = aiohttp.TCPConnector(limit=s.max_in_flight + 2 * (len(self.endpoints) + len(self.prefill)),
                                         limit_per_host=0)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                              skip_auto_headers=("Accept-Encoding", "User-Agent"))
        self._upstream = Upstream(self._session, self.metrics, s.policy)
        self.health = HealthChecker([*self.endpoints, *self.prefill], self._session, self.metrics,
                                    interval_s=s.health_interval_seconds,
                                    timeout_s=s.health_timeout_seconds, queue_metric=s.queue_metric)
        await self.health.check_all()
        self._health_task = asyncio.create_task(self.health.run(), name="strata-router-health")
        self._bodies = BodyReader(self.metrics, max_bytes=int(s.max_body_bytes), timeout_s=s.body_timeout_seconds,
                                  max_reads=s.max_body_reads, retry_after_s=s.retry_after_seconds)
        app = web.Application(client_max_size=int(s.max_body_bytes) + 1,
                              middlewares=[self._headers.middleware, self._unrouted])
        for path, api in APIS.items():
            app.router.add_post(path, functools.partial(self._route, api))
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     keepalive_timeout=s.keepalive_timeout_seconds)
        await self._runner.setup()
        self._headers_task = asyncio.create_task(self._headers.run(self._runner.server), name="strata-router-headers")
        site = web.TCPSite(self._runner, s.listen_host, s.listen_port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        log.info("router on %s: policy %s, %d endpoints%s, index %s", self.url, s.policy, len(self.endpoints),
                 f" (decode) and {len(self.prefill)} prefill" if self.prefill else "", s.index or "none")
        return self

    async def stop(self) -> None:
        for task in (self._health_task, self._headers_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        if self._scorer is not None:
            await self._scorer.close()

    # ---- handlers ------------------------------------------------------------

    @web.middleware
    async def _unrouted(self, request: web.Request, handler) -> web.StreamResponse:
        """aiohttp's own 404 and 405 as the router's JSON error bodies, like every other answer it gives."""
        try:
            return await handler(request)
        except web.HTTPNotFound:
            err: RequestRefused = NotFound(f"the router serves no {request.path[:200]!r}; it serves {', '.join(ROUTES)}")
        except web.HTTPMethodNotAllowed as exc:
            allowed = ", ".join(sorted(exc.allowed_methods))
            err = MethodNotAllowed(f"{request.path} takes {allowed}, not {request.method}", headers={"Allow": allowed})
        self.metrics.refused.labels(str(err.status)).inc()
        return error_body(err)

    def _admit(self) -> None:
        if self._in_flight >= self.settings.max_in_flight:
            raise TooManyRequests(
                f"{self.settings.max_in_flight} requests are already in flight (--max-in-flight); retry later",
                retry_after_s=self.settings.retry_after_seconds)

    async def _route(self, api: str, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        status = 500
        try:
            self._admit()  # a full router refuses before reading a body it could not forward
            raw = await self._bodies.read(request)
            self._admit()  # and again: the slots may have filled while the body arrived
            self._in_flight += 1
            self.metrics.in_flight.inc()
            try:
                response = await self._proxy(request, api, raw, started)
            finally:
                self._in_flight -= 1
                self.metrics.in_flight.dec()
            status = response.status
            return response
        except RequestRefused as err:
            status = err.status
            self.metrics.refused.labels(str(err.status)).inc()
            log.debug("%s refused with %d: %s", request.path, err.status, err)
            return error_body(err)
        finally:
            self.metrics.latency.labels(api, self.settings.policy, f"{status // 100}xx").observe(
                time.perf_counter() - started)

    def _parse(self, api: str, raw: bytes) -> dict[str, Any]:
        body = parse_object(raw)
        if body.get("model") is not None and not isinstance(body["model"], str):
            raise BadRequest(f"'model' must be a string (a served model or LoRA adapter name), not "
                             f"{type(body['model']).__name__}")
        if api == "completions":
            completion_prompt(body)
        else:
            chat_messages(body)
        return body

    async def _hits(self, api: str, body: dict[str, Any]) -> tuple[dict[Endpoint, float] | None, PromptSize | None]:
        """Each endpoint's cached fraction of the prompt (0..1), None when the index did not answer; with
        it the prompt's size (None when it was not tokenized)."""
        assert self._scorer is not None and self._tokenizer is not None
        if self._scorer.resting():
            return None, None
        tokens = await self._tokenizer.tokens(api, body)
        # Hashing is a SHA-256 per block: a long prompt's chain is hashed off the event loop.
        lora = body.get("model") if body.get("model") in self._lora_adapters else None
        salt = encodable(body["cache_salt"]) if isinstance(body.get("cache_salt"), str) else None
        hash_keys = functools.partial(self._scorer.keys, tokens, lora_name=lora, cache_salt=salt)
        keys = hash_keys() if len(tokens) <= OFF_LOOP_TOKENS else await asyncio.to_thread(hash_keys)
        prompt = PromptSize(len(tokens), len(keys) * self.settings.block_size)
        if not keys:  # shorter than one block: nothing can be cached
            return {}, prompt
        if not any(e.ids for e in self.endpoints):
            return {}, prompt
        credits = await self._scorer.credits(keys, [e.ids for e in self.endpoints])
        if credits is None:
            return None, prompt
        return {e: min(1.0, c / len(keys)) for e, c in zip(self.endpoints, credits)}, prompt

    def _healthy(self, exclude: set[Endpoint] = frozenset()) -> list[Endpoint]:
        return [e for e in self.endpoints if e.healthy and e not in exclude]

    def _no_endpoint(self) -> NoEndpoint:
        return NoEndpoint(f"no endpoint is in rotation (all {len(self.endpoints)} fail their health checks); "
                          "retry later", retry_after_s=self.settings.retry_after_seconds)

    async def _proxy(self, request: web.Request, api: str, raw: bytes, started: float) -> web.StreamResponse:
        body = self._parse(api, raw)
        if self.prefill:
            raw = await self._prefill(request, body, raw)
        hits, prompt = await self._hits(api, body) if self._scorer is not None else (None, None)
        healthy = self._healthy()
        if not healthy:
            raise self._no_endpoint()
        decision = self.policy.pick(healthy, hits, prompt)
        if hits:
            self.metrics.prefix_blocks.observe(decision.hit)
        return await self._forward(request, decision, raw, "POST", request.path, stream=body.get("stream") is True,
                                   started=started)

    async def _prefill(self, request: web.Request, body: dict[str, Any], raw: bytes) -> bytes:
        """Disaggregated serving's first half: the prompt prefilled on the least-loaded prefill engine
        (``max_tokens`` 1, not streamed, ``kv_transfer_params: {do_remote_decode: true}``, as vLLM's
        disaggregated prefill takes it); returns the decode engine's body: the request with the
        ``kv_transfer_params`` the prefill answered. Any failure returns the request as it came, which
        the decode engine serves whole (a recompute, never an error of the client's)."""
        healthy = [e for e in self.prefill if e.healthy]
        if not healthy:
            self.metrics.disaggregated.labels("no_prefill_endpoint").inc()
            return raw
        e = min(healthy, key=lambda x: x.load)
        ask = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
        ask.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
        started = time.perf_counter()
        e.in_flight += 1
        self.metrics.endpoint_in_flight.labels(e.label).inc()
        try:
            answer = await self._upstream.call_json(e, request.path, request.headers, ask,
                                                    max_bytes=int(self.settings.max_body_bytes))
        except EndpointRefused as err:
            self.health.mark_down(e, f"connection refused on a prefill: {err}")
            answer = None
        except RequestRefused as err:
            log.warning("prefill on endpoint %s failed (%s): the decode engine computes the whole prompt", e.label, err)
            answer = None
        finally:
            e.in_flight -= 1
            self.metrics.endpoint_in_flight.labels(e.label).dec()
        if answer is None:
            self.metrics.disaggregated.labels("prefill_failed").inc()
            return raw
        params = answer.get("kv_transfer_params")
        if not isinstance(params, dict):
            self.metrics.disaggregated.labels("no_kv_transfer_params").inc()
            return raw
        self.metrics.prefill.observe(time.perf_counter() - started)
        self.metrics.disaggregated.labels("handoff").inc()
        return json.dumps({**body, "kv_transfer_params": params}).encode()

    async def _forward(self, request: web.Request, decision: Decision, raw: bytes | None, method: str, path: str,
                       *, stream: bool, started: float) -> web.StreamResponse:
        tried: set[Endpoint] = set()
        while True:
            e = decision.endpoint
            tried.add(e)
            ticket = None
            if method == "POST":  # a routed request, not /v1/models
                self.metrics.decisions.labels(self.settings.policy, decision.reason).inc()
                if self.policy.model is not None:
                    ticket = self.policy.model.sent(e, decision.uncached)
                    self.metrics.endpoint_backlog.labels(e.label).set(self.policy.model.backlog(e))
            e.in_flight += 1
            self.metrics.endpoint_in_flight.labels(e.label).inc()
            try:
                try:
                    upstream = await self._upstream.open(e, method, path, request.headers, raw)
                except EndpointRefused as err:
                    self.health.mark_down(e, f"connection refused on a proxied request: {err}")
                    others = self._healthy(exclude=tried)
                    if len(tried) > self.settings.retries or not others:
                        raise UpstreamUnreachable(f"no endpoint accepted the connection ({len(tried)} tried); "
                                                  "retry later", retry_after_s=self.settings.retry_after_seconds) from None
                    decision = Decision(self.policy.pick(others, None).endpoint, "retry")
                    continue
                except UpstreamUnreachable:
                    self.health.mark_down(e, "the connection broke before the response")
                    raise
                sample = stream and upstream.status == 200  # an error's first byte says nothing of prefill
                first_byte = functools.partial(self._first_byte, ticket, sample) if ticket is not None else None
                response, broke = await self._upstream.relay(request, e, upstream, started, stream, first_byte)
                if broke == "disconnect":
                    self.health.mark_down(e, "the connection broke during the response")
                return response
            finally:
                e.in_flight -= 1
                self.metrics.endpoint_in_flight.labels(e.label).dec()
                if ticket is not None:
                    self.policy.model.finished(ticket)
                    self.metrics.endpoint_backlog.labels(e.label).set(self.policy.model.backlog(e))

    def _first_byte(self, ticket: Ticket, sample: bool, ttft_s: float) -> None:
        """A routed response began: its prefill is done; a successful stream's TTFT is a sample of the estimate."""
        model = self.policy.model
        outlier = model.first_byte(ticket, ttft_s if sample else None)
        self.metrics.endpoint_backlog.labels(ticket.endpoint.label).set(model.backlog(ticket.endpoint))
        if outlier is not None:
            self.metrics.ttft_samples.labels("outlier" if outlier else "fit").inc()
            self._export_fit()

    def _export_fit(self) -> None:
        fit = self.policy.model.fit
        overhead, per_token, per_request = fit.coefficients
        self.metrics.ttft_overhead.set(overhead)
        self.metrics.ttft_per_token.set(per_token)
        self.metrics.ttft_per_request.set(per_request)
        self.metrics.ttft_error.set(fit.mean_abs_error)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        healthy = self._healthy()
        if not healthy:
            return error_body(self._no_endpoint())
        decision = Decision(self.policy.turn(healthy)[0], "round_robin")
        try:
            return await self._forward(request, decision, None, "GET", "/v1/models", stream=False,
                                       started=time.perf_counter())
        except RequestRefused as err:
            return error_body(err)

    async def _health(self, request: web.Request) -> web.Response:
        n = len(self._healthy())
        body = {"status": "ok" if n else "unavailable", "endpoints_healthy": n, "endpoints": len(self.endpoints),
                "index_available": self._scorer.available if self._scorer is not None else None}
        return web.json_response(body, status=200 if n else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def serve(settings: RouterSettings) -> int:
    """Run the router until SIGTERM or SIGINT."""
    router = Router(settings)
    await router.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"strata route: serving on {router.url}", flush=True)
    await stop.wait()
    log.info("router stopping")
    await router.stop()
    return 0


def run(settings: RouterSettings) -> int:
    return asyncio.run(serve(settings))
