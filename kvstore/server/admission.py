"""Admission and accounting for every KVService RPC.

One interceptor, so that no handler can forget: it refuses work beyond the
in-flight limit (RESOURCE_EXHAUSTED with a retry delay) and work whose
deadline has already passed, times each RPC, and turns Strata errors into
statuses through :mod:`kvstore.rpc.status`. An unexpected exception
becomes INTERNAL and a log line; it never takes the daemon down.

Health and reflection are not throttled: an overloaded daemon must still
answer its probes.

A request whose bytes are not the method's message is bad input, not a
server fault: gRPC's own answer for a request it cannot deserialize is
INTERNAL, so the interceptor gives each method a tolerant deserializer
(:mod:`kvstore.rpc.decoding`) that hands the failure to the handler, which
answers INVALID_ARGUMENT.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from kvstore.errors import DeadlineExceeded, Overloaded, StrataError
from kvstore.metrics import StoreMetrics
from kvstore.rpc.decoding import checked, tolerant
from kvstore.rpc.status import code_for, to_status

log = logging.getLogger(__name__)

_GUARDED_PREFIX = "/strata."
_MIN_DEADLINE_S = 0.001


class AdmissionInterceptor(grpc.ServerInterceptor):
    def __init__(self, max_in_flight: int, metrics: StoreMetrics, retry_after_s: float = 0.05) -> None:
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._max = max_in_flight
        self._metrics = metrics
        self._retry_after_s = retry_after_s

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(_GUARDED_PREFIX):
            return handler
        op = method.rsplit("/", 1)[-1]
        if handler.request_deserializer is not None:
            handler = handler._replace(request_deserializer=tolerant(handler.request_deserializer))
        if handler.unary_unary:
            return handler._replace(unary_unary=self._unary(handler.unary_unary, op))
        if handler.stream_unary:
            return handler._replace(stream_unary=self._unary(handler.stream_unary, op))
        if handler.unary_stream:
            return handler._replace(unary_stream=self._streaming(handler.unary_stream, op))
        return handler._replace(stream_stream=self._streaming(handler.stream_stream, op))

    def _admit(self, context: grpc.ServicerContext, op: str) -> None:
        remaining = context.time_remaining()
        if remaining is not None and remaining < _MIN_DEADLINE_S:
            self._metrics.rejected.labels("deadline").inc()
            self._abort(context, op, DeadlineExceeded(f"{op}: the deadline passed before the daemon could start"))
        if not self._slots.acquire(blocking=False):
            self._metrics.rejected.labels("overload").inc()
            self._abort(
                context,
                op,
                Overloaded(
                    f"{op}: {self._max} RPCs are already in flight (--max-in-flight); retry after the delay",
                    retry_after_s=self._retry_after_s,
                ),
            )
        self._metrics.in_flight.inc()

    def _done(self, op: str, start: float) -> None:
        self._metrics.in_flight.dec()
        self._slots.release()
        self._metrics.op_latency.labels(op).observe(time.perf_counter() - start)

    def _abort(self, context: grpc.ServicerContext, op: str, err: Exception) -> None:
        if isinstance(err, StrataError):
            self._metrics.rpc_errors.labels(op, code_for(err).name).inc()
            context.abort_with_status(to_status(err))
        self._metrics.rpc_errors.labels(op, "INTERNAL").inc()
        log.error("%s failed unexpectedly", op, exc_info=err)
        context.abort(grpc.StatusCode.INTERNAL, f"{op}: internal error ({type(err).__name__}); see the daemon log")

    def _unary(self, behavior, op: str):
        def guarded(request, context):
            self._admit(context, op)
            start = time.perf_counter()
            try:
                return behavior(checked(request, op), context)
            except Exception as err:
                if _is_abort(err, context):
                    raise
                if _client_gone(err, context):
                    self._metrics.rpc_errors.labels(op, "CANCELLED").inc()
                    raise
                self._abort(context, op, err)
            finally:
                self._done(op, start)

        return guarded

    def _streaming(self, behavior, op: str):
        def guarded(request, context):
            self._admit(context, op)
            start = time.perf_counter()
            try:
                yield from behavior(checked(request, op), context)
            except Exception as err:
                if _is_abort(err, context):
                    raise
                if _client_gone(err, context):
                    self._metrics.rpc_errors.labels(op, "CANCELLED").inc()
                    raise
                self._abort(context, op, err)
            finally:
                self._done(op, start)

        return guarded


def _client_gone(err: Exception, context: grpc.ServicerContext) -> bool:
    """True for the error a request stream raises once its call was cancelled (by the client, or
    ended by the stream watchdog): the client has gone, no status can reach it, nothing failed here."""
    return isinstance(err, grpc.RpcError) and not context.is_active()


def _is_abort(err: Exception, context: grpc.ServicerContext) -> bool:
    """True for the exception ``context.abort`` raises (the status is already set)."""
    return type(err) is Exception and context.code() is not None
