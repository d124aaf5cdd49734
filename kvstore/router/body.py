"""A client's request body: read under a size limit, a deadline and a bound of its own, then parsed as JSON.

Why the body is read before the request counts against ``--max-in-flight``.
An in-flight slot stands for work at an engine; a client still uploading its
body gives the router nothing to forward yet. Counting it there (as the
router once did) let 16 clients that sent their headers and five bytes hold
all 16 slots for as long as they kept the connection open, and every other
request got 429. nginx separates the two the same way: it buffers the
whole body (``proxy_request_buffering on``, its default) before it opens
the upstream connection, under ``client_body_timeout``, and answers 408
when that runs out. Envoy streams the body upstream instead, so a slow
upload does hold its upstream request there, and ``request_timeout``
(the whole request received) is what bounds it; a router that buffers the
body anyway, to parse it, has no reason to hold a slot meanwhile. So here:

- **a deadline for the whole body** (``--body-timeout-seconds``), from the
  headers to the last byte, after which the answer is 408 with
  ``Connection: close``. It is a total rather than nginx's gap between two
  reads because a gap timeout never fires for a client that trickles one
  byte per gap: a total bounds how long any client can occupy the router,
  as Go's ``http.Server.ReadTimeout`` and Envoy's ``request_timeout`` do;
- **a bounded share of their own** (``--max-body-reads``): requests whose
  body is still arriving are counted apart from the in-flight ones, and
  beyond the bound are answered 429. That bound is on memory (at most that
  many bodies of ``--max-body-bytes`` each are buffered), not on the
  engines: slow uploads can fill it, never the slots of requests already
  read. A body that arrived whole with its headers (most JSON requests: one
  TCP segment) waits for nothing and takes no share at all;
- **the size limit** (``--max-body-bytes``, 413) counted on the decoded
  bytes: aiohttp decodes a gzip or deflate body (brotli and zstd where
  their decoders are installed) as it arrives, so a small compressed body
  cannot expand past the limit; a body that does not decode is a 400.

The JSON is parsed by :func:`parse_object`. Python's parser raises more than
:class:`json.JSONDecodeError` on hostile input: :class:`RecursionError` for
arrays or objects nested about a thousand deep, and a bare
:class:`ValueError` for an integer over ``sys.get_int_max_str_digits()``
digits (CVE-2020-10735's limit). Each is bad input, answered 400 with what
was wrong, never a 500.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from aiohttp import web

from kvstore.router.errors import BadRequest, BodyTimeout, BodyTooLarge, ClientClosed, TooManyRequests
from kvstore.router.metrics import RouterMetrics

CHUNK_BYTES = 64 << 10


class BodyReader:
    def __init__(self, metrics: RouterMetrics, *, max_bytes: int, timeout_s: float, max_reads: int,
                 retry_after_s: float) -> None:
        self._metrics = metrics
        self._max_bytes = max_bytes
        self._timeout_s = timeout_s
        self._max_reads = max_reads
        self._retry_after_s = retry_after_s
        self.reading = 0  # requests whose body is still arriving

    async def read(self, request: web.Request) -> bytes:
        """The whole decoded body of ``request``, or one of :class:`BodyTooLarge` (413), :class:`BodyTimeout`
        (408), :class:`TooManyRequests` (429, the readers' share is full), :class:`BadRequest` (400, the
        body's framing or coding is broken), :class:`ClientClosed` (the client went away)."""
        if request.content_length is not None and request.content_length > self._max_bytes:
            raise self._too_large()
        if request.content.is_eof():  # it came whole with the headers: nothing to wait for
            return await self._collect(request)
        if self.reading >= self._max_reads:
            raise TooManyRequests(f"{self._max_reads} request bodies are already arriving (--max-body-reads); "
                                  "retry later", retry_after_s=self._retry_after_s)
        self.reading += 1
        self._metrics.reading.inc()
        try:
            async with asyncio.timeout(self._timeout_s):
                return await self._collect(request)
        except TimeoutError:
            raise BodyTimeout(f"the request body did not arrive whole within {self._timeout_s:g} s "
                              "(--body-timeout-seconds); send it at once") from None
        finally:
            self.reading -= 1
            self._metrics.reading.dec()

    async def _collect(self, request: web.Request) -> bytes:
        parts, size = [], 0
        try:
            async for chunk in request.content.iter_chunked(CHUNK_BYTES):
                size += len(chunk)
                if size > self._max_bytes:
                    raise self._too_large()
                parts.append(chunk)
        except web.RequestPayloadError as err:  # broken chunked framing, a body that does not decode
            raise BadRequest(f"the request body cannot be read: {str(err).strip()}") from None
        except ConnectionResetError:
            raise ClientClosed("the client closed the connection before its request body was whole") from None
        return b"".join(parts)

    def _too_large(self) -> BodyTooLarge:
        return BodyTooLarge(f"the request body is over {self._max_bytes} bytes (--max-body-bytes); send a shorter "
                            "prompt or raise the router's limit")


def parse_object(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object; anything else is :class:`BadRequest` saying what is wrong with it."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BadRequest(f"the request body is not valid JSON: {err}") from None
    except RecursionError:
        raise BadRequest("the request body nests arrays or objects too deeply to parse (the router's parser "
                         f"stops at about {sys.getrecursionlimit()} levels)") from None
    except ValueError:  # what is left: an integer longer than the int-string conversion limit
        raise BadRequest("the request body holds an integer too long to parse (at most "
                         f"{sys.get_int_max_str_digits()} digits)") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, not {type(body).__name__}")
    return body
