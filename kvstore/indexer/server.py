"""``strata index serve``: the indexer HTTP API over a prefix index (shapes: :mod:`kvstore.indexer.api`).

    POST /query           per instance, its cached prefix of a prompt's token ids, per tier
    POST /query_by_hash   the same for a chain of block hashes
    POST /register        follow an engine's KV events (its ZMQ PUB socket) into the index
    POST /unregister      stop following it and drop its entries now
    GET  /instances       the engines followed
    GET  /health          200 while the index answers
    GET  /metrics         the API's own Prometheus metrics (:mod:`kvstore.indexer.metrics`)

It answers from the index the URL names: ``memory://`` holds what this
process's own subscriber ingests (the engines registered here); a Redis URL
adds what every daemon publishes there, so the API sees the whole fleet.
Registered engines are followed by a :class:`~kvstore.index.events.KVEventSubscriber`
(replay on connect, seq-gap handling, epochs) writing into that index, at
most ``max_engines`` of them. With ``registrations_file`` the registrations
are written there (atomically) on every change and followed again at start,
so a restarted server resumes every engine without the gateways registering
again; without it they live in this process only (a restart forgets them,
and the engines' entries expire after the subscriber's TTL).

Limits, as ``strata route`` has them: a body over ``max_body_bytes`` is 413,
one not whole within ``body_timeout_s`` is 408, more than ``max_in_flight``
requests at once are 429, and the index's own calls have ``index_timeout_s``
(503 beyond it, as when the index is down). Every refusal is a JSON error
body naming the fix; none is a 500.

Protected mode, as the daemon's: ``/register`` makes this process connect
wherever a client says, so a listen address beyond loopback needs a bearer
token (``token_file``; clients send ``Authorization: Bearer <token>``) or
``insecure``, or the server refuses to start.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvstore.indexer.metrics import IndexerMetrics
from kvstore.indexer.settings import IndexerSettings
from kvstore.errors import InvalidArgument, PrefixIndexError
from kvstore.index import open_index
from kvstore.index.base import PrefixIndex
from kvstore.index.events import EngineSource, KVEventSubscriber, SubscriberConfig
from kvstore.indexer.api import (
    Conflict, Query, Registration, Unauthorized, hash_chain, instance_answers, merged, parse_query,
    parse_query_by_hash, parse_registration, parse_unregistration,
)
from kvstore.router.body import parse_object
from kvstore.router.errors import (
    BadRequest, BodyTimeout, BodyTooLarge, MethodNotAllowed, NotFound, RequestRefused, TooManyRequests,
)

log = logging.getLogger(__name__)

OFF_LOOP_TOKENS = 2048  # a longer prompt is hashed in a worker thread
ROUTES = ("POST /query", "POST /query_by_hash", "POST /register", "POST /unregister", "GET /instances", "GET /health",
          "GET /metrics")
REGISTRATIONS_VERSION = 1


def error_body(err: RequestRefused) -> web.Response:
    headers = dict(err.headers)
    if err.retry_after_s:
        headers["Retry-After"] = str(int(err.retry_after_s))
    response = web.json_response({"error": {"message": str(err), "type": err.kind, "code": err.status}},
                                 status=err.status, headers=headers)
    if err.body_unread:
        response.force_close()
    return response


class IndexerServer:
    """The API on an aiohttp server inside a running loop: ``await start()``, ``port``, ``await stop()``."""

    def __init__(self, settings: IndexerSettings, index: PrefixIndex | None = None) -> None:
        self.settings = settings
        self._token = settings.token()
        self._own_index = index is None
        self.index = index if index is not None else open_index(settings.index_url)
        ttl = settings.event_ttl_s
        self.subscriber = KVEventSubscriber(self.index, [], SubscriberConfig(ttl_s=ttl, heartbeat_interval_s=ttl / 3),
                                            allow_empty=True, max_engines=settings.max_engines)
        self.registrations: dict[str, Registration] = {}  # holder id -> what /register gave
        self.metrics = IndexerMetrics()
        self._file = Path(settings.registrations_file) if settings.registrations_file else None
        self._in_flight = 0
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    async def start(self) -> IndexerServer:
        await self.subscriber.start()
        await self._restore()
        app = web.Application(client_max_size=self.settings.max_body_bytes, middlewares=[self._guard])
        app.router.add_post("/query", functools.partial(self._post, self._query))
        app.router.add_post("/query_by_hash", functools.partial(self._post, self._query_by_hash))
        app.router.add_post("/register", functools.partial(self._post, self._register))
        app.router.add_post("/unregister", functools.partial(self._post, self._unregister))
        app.router.add_get("/instances", self._instances)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.host, self.settings.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        log.info("indexer API on %s over index %s", self.url, self.settings.index_url.split("@")[-1])
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await self.subscriber.stop(leave=True)
        if self._own_index:
            await self.index.close()

    # ---- the request's way -------------------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        """Authentication first, then aiohttp's own refusals as JSON error bodies, like every other answer."""
        started = time.perf_counter()
        response = await self._answer_or_refuse(request, handler)
        self.metrics.answered(request.path, response.status, time.perf_counter() - started)
        return response

    async def _answer_or_refuse(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            if self._token is not None and request.path != "/metrics":
                sent = request.headers.get("Authorization", "")
                if not hmac.compare_digest(sent.encode(), f"Bearer {self._token}".encode()):
                    raise Unauthorized("send the server's bearer token: Authorization: Bearer <token from its "
                                       "--token-file>", headers={"WWW-Authenticate": "Bearer"})
            return await handler(request)
        except web.HTTPNotFound:
            err: RequestRefused = NotFound(f"no {request.path[:200]!r} here; this indexer serves {', '.join(ROUTES)}")
        except web.HTTPMethodNotAllowed as exc:
            allowed = ", ".join(sorted(exc.allowed_methods))
            err = MethodNotAllowed(f"{request.path} takes {allowed}, not {request.method}", headers={"Allow": allowed})
        except RequestRefused as refused:
            err = refused
        return error_body(err)

    async def _post(self, handle, request: web.Request) -> web.StreamResponse:
        if self._in_flight >= self.settings.max_in_flight:
            raise TooManyRequests(f"{self.settings.max_in_flight} requests are in flight already; retry later",
                                  retry_after_s=1)
        self._in_flight += 1
        try:
            body = parse_object(await self._read(request))
            try:
                async with asyncio.timeout(self.settings.index_timeout_s):
                    return web.json_response(await handle(body))
            except TimeoutError:
                raise RequestRefused(f"the prefix index did not answer within {self.settings.index_timeout_s:g} s; "
                                     "retry later", retry_after_s=1) from None
        except PrefixIndexError as err:  # IndexUnavailable and the rest: the index, not the request
            raise _Unavailable(f"the prefix index cannot answer: {err}", retry_after_s=1) from None
        finally:
            self._in_flight -= 1

    async def _read(self, request: web.Request) -> bytes:
        limit = self.settings.max_body_bytes
        too_large = BodyTooLarge(f"the request body is over {limit} bytes (--max-body-bytes); send a shorter "
                                 "prompt (only its leading blocks can match) or raise the limit")
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        try:
            async with asyncio.timeout(self.settings.body_timeout_s):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None
        except TimeoutError:
            raise BodyTimeout(f"the request body did not arrive whole within {self.settings.body_timeout_s:g} s; "
                              "send it at once") from None
        except web.RequestPayloadError as err:
            raise BadRequest(f"the request body cannot be read: {str(err).strip()}") from None

    # ---- the routes ----------------------------------------------------------------------------

    async def _query(self, body: dict[str, Any]) -> dict[str, Any]:
        if not self.settings.hash_seed:
            raise BadRequest("this indexer was started without --hash-seed, so it cannot hash token ids as the "
                             "engines do: use /query_by_hash, or restart it with the engines' PYTHONHASHSEED")
        query, tokens, hasher, salt = parse_query(body, self.settings.hash_seed, self.settings.tier_namespace,
                                                  self.settings.tier_blocks_per_chunk)
        try:
            if len(tokens) > OFF_LOOP_TOKENS:
                query = await asyncio.to_thread(hash_chain, query, tokens, hasher, salt)
            else:
                query = hash_chain(query, tokens, hasher, salt)
        except InvalidArgument as err:
            raise BadRequest(str(err)) from None
        return await self._answer(query)

    async def _query_by_hash(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._answer(parse_query_by_hash(body))

    async def _answer(self, query: Query) -> dict[str, Any]:
        holders = await self.index.holders(query.namespace, list(query.keys)) if query.keys else []
        instances = instance_answers(holders, query.block_size, query.instance_id)
        if query.tier_keys:  # what node daemons hold of it through vLLM's Strata tier, a chunk at a time
            chunks = await self.index.holders(query.tier_namespace, list(query.tier_keys))
            instances = merged(instances, instance_answers(chunks, query.block_size * query.blocks_per_chunk,
                                                           query.instance_id))
        longest = max((a["longest_matched"] for a in instances.values()), default=0)
        self.metrics.matched.observe(longest // max(query.block_size, 1))
        return {"namespace": query.namespace, "block_size": query.block_size, "blocks": len(query.keys),
                "instances": instances}

    async def _register(self, body: dict[str, Any]) -> dict[str, Any]:
        reg = parse_registration(body)
        known = self.registrations.get(reg.holder_id)
        if known is not None:
            if known == reg:
                return {"registered": reg.holder_id, **reg.as_json()}
            raise Conflict(f"instance {reg.instance_id!r} (dp_rank {reg.dp_rank}) is registered with "
                           f"{known.endpoint} in {known.namespace}: /unregister it first")
        if len(self.registrations) >= self.settings.max_engines:
            raise Conflict(f"{self.settings.max_engines} engines are registered already (--max-engines); "
                           "/unregister one first")
        source = EngineSource(reg.endpoint, reg.holder_id, reg.namespace, reg.replay_endpoint, reg.topic)
        try:
            await self.subscriber.follow(source)
        except InvalidArgument as err:  # an engine id followed from elsewhere, an endpoint ZMQ refuses
            raise BadRequest(str(err)) from None
        self.registrations[reg.holder_id] = reg
        self._changed()
        log.info("following KV events of %s at %s into %s", reg.holder_id, reg.endpoint, reg.namespace)
        return {"registered": reg.holder_id, **reg.as_json()}

    async def _unregister(self, body: dict[str, Any]) -> dict[str, Any]:
        instance, dp_rank = parse_unregistration(body)
        gone = [h for h, r in self.registrations.items()
                if r.instance_id == instance and (dp_rank is None or r.dp_rank == dp_rank)]
        if not gone:
            rank = "" if dp_rank is None else f" at dp_rank {dp_rank}"
            raise NotFound(f"instance {instance!r}{rank} is not registered here; GET /instances lists those that are")
        for holder in gone:
            await self.subscriber.unfollow(holder)
            del self.registrations[holder]
            log.info("no longer following KV events of %s", holder)
        self._changed()
        return {"unregistered": gone}

    async def _instances(self, request: web.Request) -> web.Response:
        out: dict[str, dict[str, Any]] = {}
        for reg in self.registrations.values():
            entry = out.setdefault(reg.instance_id, {"instance_id": reg.instance_id, "endpoints": {}})
            status = self.subscriber.status(reg.holder_id)
            entry["endpoints"][str(reg.dp_rank or 0)] = {**reg.as_json(), "connected": status.connected,
                                                         "epoch": status.epoch, "batches": status.batches}
        return web.json_response(list(out.values()))

    async def _health(self, request: web.Request) -> web.Response:
        try:
            async with asyncio.timeout(self.settings.index_timeout_s):
                await self.index.nodes()
        except (TimeoutError, PrefixIndexError) as err:
            return web.json_response({"status": "unavailable", "error": str(err) or "timed out"}, status=503)
        return web.json_response({"status": "ok", "engines_followed": len(self.registrations)})


    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ---- the registrations file ------------------------------------------------------------------

    def _changed(self) -> None:
        self.metrics.engines.set(len(self.registrations))
        if self._file is None:
            return
        body = {"version": REGISTRATIONS_VERSION, "registrations": [r.as_json() for r in self.registrations.values()]}
        tmp = self._file.with_name(f".{self._file.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "w") as f:
                json.dump(body, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._file)
        except OSError as err:  # the registrations still hold in this process; the next change writes again
            self.metrics.saves.labels("failed").inc()
            log.error("could not write the registrations to %s (%s): a restart would not follow them again",
                      self._file, err.strerror or err)
            tmp.unlink(missing_ok=True)
            return
        self.metrics.saves.labels("ok").inc()

    async def _restore(self) -> None:
        """Follow again every engine the registrations file names; one that cannot be read is logged and left out."""
        if self._file is None or not self._file.exists():
            self.metrics.engines.set(0)
            return
        try:
            body = json.loads(self._file.read_text())
            if not isinstance(body, dict) or body.get("version") != REGISTRATIONS_VERSION:
                raise ValueError(f"not a version {REGISTRATIONS_VERSION} registrations file")
            entries = list(body["registrations"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            kept = self._file.with_name(self._file.name + ".unreadable")
            os.replace(self._file, kept)
            log.error("the registrations file %s cannot be read (%s): kept as %s, starting with no engines",
                      self._file, err, kept)
            self.metrics.engines.set(0)
            return
        for entry in entries:
            try:
                reg = parse_registration(entry)
                if reg.holder_id in self.registrations or len(self.registrations) >= self.settings.max_engines:
                    raise BadRequest("a duplicate, or more engines than --max-engines")
                await self.subscriber.follow(EngineSource(reg.endpoint, reg.holder_id, reg.namespace,
                                                          reg.replay_endpoint, reg.topic))
            except (RequestRefused, InvalidArgument) as err:
                log.warning("registration %s in %s left out: %s", str(entry)[:200], self._file, err)
                continue
            self.registrations[reg.holder_id] = reg
        log.info("following %d engines again from %s", len(self.registrations), self._file)
        self._changed()


class _Unavailable(RequestRefused):
    status = 503
    kind = "server_error"


async def serve(settings: IndexerSettings) -> int:
    server = IndexerServer(settings)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"strata index serve: serving on {server.url}", flush=True)
    await stop.wait()
    await server.stop()
    return 0


def run(settings: IndexerSettings) -> int:
    return asyncio.run(serve(settings))

