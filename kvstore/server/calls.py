"""Each caller's share of the RPCs in flight, and how many streamed RPCs run at once, and per caller.

The admission interceptor (:mod:`kvstore.server.admission`) keeps the
daemon-wide limit on RPCs in flight (``--max-in-flight``, at most the
workers less two for health checks). That keeps the daemon from promising
more than it has; it does not keep one tenant from taking all of it. So,
after authentication, every call also takes one of its identity's share
(``--max-in-flight-per-identity``, by default half of the admitted RPCs).

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

Beyond any of them, RESOURCE_EXHAUSTED with a retry delay, naming the
setting. This interceptor runs after authentication, so that a tenant's
calls count together whichever connection they come on
(:func:`kvstore.auth.owner_of`). The shares are per authenticated identity:
a daemon without authentication serves one trust domain on loopback, where
one client (an engine's) may rightly multiplex every call on its one
connection; there the daemon-wide limits alone apply.
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


class CallLimiter(grpc.ServerInterceptor):
    def __init__(self, max_streams: int, streams_per_identity: int, calls_per_identity: int, metrics: StoreMetrics,
                 retry_after_s: float = 0.2) -> None:
        self._slots = threading.BoundedSemaphore(max_streams)
        self._max = max_streams
        self._streams = Shares(min(streams_per_identity, max_streams), "streams", "--max-streams-per-identity",
                               retry_after_s=retry_after_s)
        self._calls = Shares(calls_per_identity, "RPCs in flight", "--max-in-flight-per-identity",
                             retry_after_s=retry_after_s)
        self._metrics = metrics
        self._retry_after_s = retry_after_s

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(_GUARDED_PREFIX):
            return handler
        op = handler_call_details.method.rsplit("/", 1)[-1]
        if handler.unary_unary:
            return handler._replace(unary_unary=self._unary(handler.unary_unary, op))
        if handler.stream_unary:
            return handler._replace(stream_unary=self._stream_in(handler.stream_unary, op))
        if handler.unary_stream:
            return handler._replace(unary_stream=self._stream_out(handler.unary_stream, op))
        return handler  # the services have no bidirectional streams

    @staticmethod
    def _owner(context) -> str:
        return owner_of(context) if current_identity().authenticated else ""

    def _enter_call(self, context, op: str) -> str:
        owner = self._owner(context)
        if owner:
            try:
                self._calls.take(owner)
            except Overloaded as err:
                self._refuse(context, op, err, "calls")
        return owner

    def _leave_call(self, owner: str) -> None:
        if owner:
            self._calls.give(owner)

    def _enter_stream(self, context, op: str) -> str:
        owner = self._enter_call(context, op)
        try:
            if owner:
                try:
                    self._streams.take(owner)
                except Overloaded as err:
                    self._refuse(context, op, err, "streams")
            if not self._slots.acquire(blocking=False):
                if owner:
                    self._streams.give(owner)
                self._refuse(context, op, Overloaded(
                    f"{op}: {self._max} streams are already open (--max-streams); retry after the delay",
                    retry_after_s=self._retry_after_s), "streams")
        except BaseException:  # refused: the call's share is given back
            self._leave_call(owner)
            raise
        return owner

    def _leave_stream(self, owner: str) -> None:
        self._slots.release()
        if owner:
            self._streams.give(owner)
        self._leave_call(owner)

    def _refuse(self, context, op: str, err: Overloaded, what: str) -> None:
        self._metrics.rejected.labels(what).inc()
        self._metrics.rpc_errors.labels(op, code_for(err).name).inc()
        context.abort_with_status(to_status(err))

    def _unary(self, behavior, op: str):
        def limited(request, context):
            owner = self._enter_call(context, op)
            try:
                return behavior(request, context)
            finally:
                self._leave_call(owner)

        return limited

    def _stream_in(self, behavior, op: str):
        def limited(requests, context):
            owner = self._enter_stream(context, op)
            try:
                return behavior(requests, context)
            finally:
                self._leave_stream(owner)

        return limited

    def _stream_out(self, behavior, op: str):
        def limited(request, context):
            owner = self._enter_stream(context, op)
            try:
                yield from behavior(request, context)
            finally:
                self._leave_stream(owner)

        return limited
