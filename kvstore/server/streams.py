"""How many streamed RPCs (a Put's request stream, a Get's reply stream) run at once, and per caller.

The sync gRPC server spends a worker thread on every call for as long as it
lasts, and a stream lasts as long as its client makes it: a Put whose client
sends nothing holds its worker until the stream watchdog ends it
(``--stream-idle-seconds``, 30 s by default). With every admitted slot taken
by such streams, every other RPC, Stats and the small reads included, was
refused. So streams get their own limit below the admitted RPCs
(``--max-streams``, by default half of them: unary calls always find a
worker), and each caller a share of it (``--max-streams-per-identity``, by
default half again: no one caller takes every stream), on top of the
watchdog, which stays the bound on how long a stalled stream is kept.

Beyond either, RESOURCE_EXHAUSTED with a retry delay, naming the setting.
This interceptor runs after authentication, so that a tenant's streams
count together whichever connection they come on (:func:`kvstore.auth.owner_of`).
The share is per authenticated identity: a daemon without authentication
serves one trust domain on loopback, where one client (an engine's) may
rightly multiplex every stream on its one connection; there the daemon-wide
limit alone applies.
"""

from __future__ import annotations

import threading

import grpc

from kvstore.auth import current_identity, owner_of
from kvstore.errors import Overloaded
from kvstore.metrics import StoreMetrics
from kvstore.rpc.status import code_for, to_status
from kvstore.shares import Shares

_GUARDED_PREFIX = "/strata."


class StreamLimiter(grpc.ServerInterceptor):
    def __init__(self, max_streams: int, per_identity: int, metrics: StoreMetrics,
                 retry_after_s: float = 0.2) -> None:
        self._slots = threading.BoundedSemaphore(max_streams)
        self._max = max_streams
        self._shares = Shares(min(per_identity, max_streams), "streams", "--max-streams-per-identity",
                              retry_after_s=retry_after_s)
        self._metrics = metrics
        self._retry_after_s = retry_after_s

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(_GUARDED_PREFIX):
            return handler
        op = handler_call_details.method.rsplit("/", 1)[-1]
        if handler.stream_unary:
            return handler._replace(stream_unary=self._stream_in(handler.stream_unary, op))
        if handler.unary_stream:
            return handler._replace(unary_stream=self._stream_out(handler.unary_stream, op))
        return handler  # unary calls end by themselves; the services have no bidirectional streams

    def _enter(self, context, op: str) -> str:
        owner = owner_of(context) if current_identity().authenticated else ""
        try:
            self._take_share(owner)
        except Overloaded as err:
            self._refuse(context, op, err)
        if not self._slots.acquire(blocking=False):
            if owner:
                self._shares.give(owner)
            self._refuse(context, op, Overloaded(
                f"{op}: {self._max} streams are already open (--max-streams); retry after the delay",
                retry_after_s=self._retry_after_s))
        return owner

    def _leave(self, owner: str) -> None:
        self._slots.release()
        if owner:
            self._shares.give(owner)

    def _take_share(self, owner: str) -> None:
        if owner:
            self._shares.take(owner)

    def _refuse(self, context, op: str, err: Overloaded) -> None:
        self._metrics.rejected.labels("streams").inc()
        self._metrics.rpc_errors.labels(op, code_for(err).name).inc()
        context.abort_with_status(to_status(err))

    def _stream_in(self, behavior, op: str):
        def limited(requests, context):
            owner = self._enter(context, op)
            try:
                return behavior(requests, context)
            finally:
                self._leave(owner)

        return limited

    def _stream_out(self, behavior, op: str):
        def limited(request, context):
            owner = self._enter(context, op)
            try:
                yield from behavior(request, context)
            finally:
                self._leave(owner)

        return limited
