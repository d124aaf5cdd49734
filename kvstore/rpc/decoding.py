"""Request bytes that are not the method's message: INVALID_ARGUMENT, never gRPC's own INTERNAL.

gRPC answers a request it cannot deserialize with INTERNAL ("Exception
deserializing request!"), which reads as a fault of the server; it is the
client's bad input. So a method is given a tolerant deserializer
(:func:`tolerant`) that returns an :class:`Undecodable` in place of the
message, and the method's behaviour refuses it before it runs
(:func:`checked`: InvalidArgument, naming the message type).

Two servers use it: the KV daemon's admission interceptor
(:mod:`kvstore.server.admission`), which also counts the refusal among its
RPC errors, and :class:`DecodingInterceptor` for a server with no admission
of its own (the weight node's ``WeightService``).
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError

from kvstore.errors import InvalidArgument
from kvstore.rpc.status import to_status


class Undecodable:
    """What a tolerant deserializer returns for bytes that are not the method's message."""

    __slots__ = ("error", "message_type")

    def __init__(self, error: DecodeError, message_type: str) -> None:
        self.error = error
        self.message_type = message_type


def tolerant(deserialize):
    """``deserialize`` (a message class's ``FromString``), returning an :class:`Undecodable` where it would raise."""
    cls = getattr(deserialize, "__self__", None)
    descriptor = getattr(cls, "DESCRIPTOR", None)
    message_type = descriptor.full_name if descriptor is not None else "protobuf message"

    def parse(data: bytes):
        try:
            return deserialize(data)
        except DecodeError as err:
            return Undecodable(err, message_type)

    return parse


def _refusal(op: str, bad: Undecodable) -> InvalidArgument:
    return InvalidArgument(
        f"{op}: the request is not a valid {bad.message_type} (not a valid protobuf message: {bad.error}): "
        "check that the client speaks this server's proto"
    )


def checked(request, op: str):
    """The request, or InvalidArgument when it did not decode; a stream of requests is checked as it is read."""
    if isinstance(request, Undecodable):
        raise _refusal(op, request)
    if hasattr(request, "__next__"):
        return _checked_stream(request, op)
    return request


def _checked_stream(requests, op: str):
    for request in requests:
        if isinstance(request, Undecodable):
            raise _refusal(op, request)
        yield request


class DecodingInterceptor(grpc.ServerInterceptor):
    """Every method of the server gets a tolerant deserializer; a request that did not decode is
    answered INVALID_ARGUMENT before the method runs (one of a stream, when the method reads it)."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        op = handler_call_details.method.rsplit("/", 1)[-1]
        handler = handler._replace(request_deserializer=tolerant(handler.request_deserializer))
        kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))
        return handler._replace(**{kind: _refusing(getattr(handler, kind), op)})


def _refusing(behavior, op: str):
    def guarded(request, context):
        if isinstance(request, Undecodable):
            context.abort_with_status(to_status(_refusal(op, request)))
        if hasattr(request, "__next__"):
            request = _refusing_stream(request, op, context)
        return behavior(request, context)

    return guarded


def _refusing_stream(requests, op: str, context):
    for request in requests:
        if isinstance(request, Undecodable):
            context.abort_with_status(to_status(_refusal(op, request)))
        yield request
