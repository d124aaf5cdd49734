"""Forwarding one request to an engine and its response back, bytes unchanged.

The body goes to the engine as received; the engine's status, headers
(less the hop-by-hop ones) and body come back as sent: the client session
does not decompress (``auto_decompress=False``) and adds no
``Accept-Encoding`` of its own, and the body is copied chunk by chunk as
it arrives, so an SSE stream reaches the client event by event, byte for
byte. ``Transfer-Encoding`` is per hop: a body the engine chunked is
chunked again here, one with a ``Content-Length`` keeps it. A request is
the exception to "bytes unchanged": the router's server decodes a gzip,
deflate, brotli or zstd request body to parse it, and forwards the decoded
bytes, so their ``Content-Encoding`` is not forwarded with them (an engine
would try to decode plain JSON again and fail).

Failures are told apart by how far the request got:

- the connection could not be opened (:class:`aiohttp.ClientConnectorError`):
  nothing was sent, so the caller may try another endpoint
  (:class:`EndpointRefused`);
- the engine sent no headers within the upstream timeout: 504;
- the connection broke before the headers: 502, not retried (the engine may
  have started the work);
- it broke after the response began: the client's connection is aborted
  without the end of the body (never a truncated body that looks complete).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from kvstore.router.endpoint import Endpoint
from kvstore.router.errors import UpstreamFailed, UpstreamTimeout, UpstreamUnreachable
from kvstore.router.metrics import RouterMetrics

log = logging.getLogger(__name__)

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "host", "content-length",
})
CHUNK_BYTES = 64 << 10
# The request codings aiohttp's server decodes (its parser's own list); any other is passed through encoded.
DECODED_CODINGS = frozenset({"gzip", "deflate", "br", "zstd"})


class EndpointRefused(Exception):
    """The engine's connection could not be opened; nothing was sent (safe to try another endpoint)."""


def forwarded_headers(headers) -> CIMultiDict:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP)


def request_headers(headers) -> CIMultiDict:
    """A client's request headers as sent on to an engine with the body as the router read it (decoded)."""
    out = forwarded_headers(headers)
    if out.get("Content-Encoding", "").strip().lower() in DECODED_CODINGS:
        del out["Content-Encoding"]
    return out


class Upstream:
    def __init__(self, session: aiohttp.ClientSession, metrics: RouterMetrics, policy: str) -> None:
        self._session = session
        self._metrics = metrics
        self._policy = policy

    @contextlib.contextmanager
    def _failures(self, e: Endpoint, silence: str):
        """aiohttp's failures on the way to ``e`` as the router's (counted): a refused connection is
        :class:`EndpointRefused` (nothing sent), no answer in time :class:`UpstreamTimeout` (``silence``
        says what did not come), a connection that broke :class:`UpstreamUnreachable`."""
        try:
            yield
        except aiohttp.ClientConnectorError as err:
            self._metrics.upstream_errors.labels(e.label, "connect").inc()
            raise EndpointRefused(f"{e.url}: {err}") from None
        except asyncio.TimeoutError:
            self._metrics.upstream_errors.labels(e.label, "timeout").inc()
            raise UpstreamTimeout(f"endpoint {e.label} {silence} within the upstream timeout") from None
        except aiohttp.ClientError as err:
            self._metrics.upstream_errors.labels(e.label, "disconnect").inc()
            raise UpstreamUnreachable(f"endpoint {e.label} closed the connection before answering: {err}") from None

    async def open(self, e: Endpoint, method: str, path: str, headers, body: bytes | None) -> aiohttp.ClientResponse:
        """The engine's response, its headers read and its body not yet."""
        with self._failures(e, "sent no response headers"):
            return await self._session.request(method, e.url + path, data=body, headers=request_headers(headers))

    async def call_json(self, e: Endpoint, path: str, headers, body: dict, *, max_bytes: int) -> dict:
        """POST ``body`` as JSON to ``e`` and return its JSON object answer (a disaggregated prefill):
        :class:`EndpointRefused` when the connection could not be opened; :class:`UpstreamTimeout`,
        :class:`UpstreamUnreachable` or :class:`UpstreamFailed` for the rest."""
        out = request_headers(headers)
        out.pop("Content-Type", None)
        with self._failures(e, "did not answer"):
            async with self._session.post(e.url + path, json=body, headers=out) as resp:
                data = bytearray()
                async for chunk in resp.content.iter_chunked(CHUNK_BYTES):
                    data += chunk
                    if len(data) > max_bytes:
                        raise UpstreamFailed(f"endpoint {e.label} answered over {max_bytes} bytes")
                if resp.status != 200:
                    raise UpstreamFailed(f"endpoint {e.label} answered {resp.status}: "
                                         f"{bytes(data[:300]).decode(errors='replace')}")
        try:
            answer = json.loads(data)
        except ValueError as err:
            raise UpstreamFailed(f"endpoint {e.label} answered something other than JSON: {err}") from None
        if not isinstance(answer, dict):
            raise UpstreamFailed(f"endpoint {e.label} answered JSON that is not an object")
        return answer

    async def relay(self, request: web.Request, e: Endpoint, upstream: aiohttp.ClientResponse, started: float,
                    stream: bool, first_byte: Callable[[float], None] | None = None,
                    ) -> tuple[web.StreamResponse, str | None]:
        """Copy ``upstream``'s response to the client as it arrives; with it, how the engine broke off
        ("disconnect", "timeout"), or None when the body came whole. ``first_byte`` is called with the
        time to the body's first byte when it arrives."""
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                      headers=forwarded_headers(upstream.headers))
        chunked = "chunked" in upstream.headers.get("Transfer-Encoding", "").lower()
        if upstream.content_length is not None and not chunked:
            response.content_length = upstream.content_length
        await response.prepare(request)
        first = True
        try:
            async for chunk in upstream.content.iter_chunked(CHUNK_BYTES):
                if first:
                    ttft = time.perf_counter() - started
                    self._metrics.ttft.labels(e.label, self._policy, str(stream).lower()).observe(ttft)
                    if first_byte is not None:
                        first_byte(ttft)
                    first = False
                await response.write(chunk)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as err:
            kind = "timeout" if isinstance(err, asyncio.TimeoutError) else "disconnect"
            self._metrics.upstream_errors.labels(e.label, kind).inc()
            log.warning("endpoint %s broke off its response (%s: %s); closing the client's connection",
                        e.label, type(err).__name__, err)
            if request.transport is not None:
                request.transport.abort()
            return response, kind
        finally:
            upstream.release()
        await response.write_eof()
        return response, None
