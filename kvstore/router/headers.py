"""A deadline for a connection's first request headers, which aiohttp's server does not have.

aiohttp reads a request's headers without a deadline of its own, and
``--body-timeout-seconds`` (:mod:`kvstore.router.body`) starts only once
they are whole. So a client that connects and sends nothing, only blank
lines (a parser skips them before a request line), or half its headers,
held its connection and a descriptor for as long as it liked.

:class:`HeaderDeadline` closes a connection whose first request's headers
are not whole within ``timeout_s`` of its opening (``--header-timeout-seconds``),
without an answer: there is no request to answer. A connection kept alive
after a response is left to aiohttp's keep-alive timer
(``--keepalive-timeout-seconds``), which closes it when its next request is
not whole within that time of the last response, idle or mid-headers alike.

Why a sweep, not a timer per connection: aiohttp offers no public hook for
a connection's opening (its ``Server`` and ``RequestHandler`` would have to
be subclassed, and their internals relied on), but it lists the open
connections (``Server.connections``) and gives each request its connection
(``request.protocol``, seen here by a middleware). A sweep every quarter
deadline closes a late connection at most half a deadline after its
deadline (a sweep first sees it up to a quarter late, and closes it at the
first sweep past the deadline), for one pass over the open connections.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger(__name__)

SWEEPS_PER_DEADLINE = 4


class HeaderDeadline:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._begun: set[RequestHandler] = set()  # connections whose first request's headers were whole
        self._waiting: dict[RequestHandler, float] = {}  # the others: when a sweep first saw each one

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        """Marks the request's connection: its first headers were whole (aiohttp parses them whole)."""
        self._begun.add(request.protocol)
        return await handler(request)

    async def run(self, server: web.Server) -> None:
        """Sweep ``server``'s connections until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.timeout_s / SWEEPS_PER_DEADLINE)
            closed = self.sweep(server.connections, loop.time())
            if closed:
                log.debug("closed %d connections whose first request's headers were not whole within %g s "
                          "(--header-timeout-seconds)", closed, self.timeout_s)

    def sweep(self, connections: list[RequestHandler], now: float) -> int:
        """Close each connection seen waiting for its first headers for ``timeout_s`` or longer; how many.
        Forgets the connections that are gone."""
        self._begun.intersection_update(connections)
        waiting = {c: self._waiting.get(c, now) for c in connections
                   if c not in self._begun and c.transport is not None}  # None: closed already
        late = [c for c, seen in waiting.items() if now - seen >= self.timeout_s]
        for c in late:
            c.force_close()
            del waiting[c]
        self._waiting = waiting
        return len(late)
