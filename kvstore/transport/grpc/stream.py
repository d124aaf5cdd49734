"""gRPC streamed transport: block bytes in 1 MiB chunks of Put and Get streams (any host).

The path every client can take, on any host and in any language: nothing
is mapped, the bytes travel in protobuf messages and the client verifies
each block's checksum as it is reassembled into the caller's buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from kvstore.api.v1 import kv_pb2 as pb
from kvstore.api.v1 import kv_pb2_grpc
from kvstore.transport.grpc import blocks as codec
from kvstore.rpc.status import from_rpc_error
from kvstore.transport.base import Block, BlockPut, Deadline, Place, Transport


def call_grpc(deadline: Deadline, method, *args):
    """Run one unary-reply gRPC call under ``deadline``: cancelled with it, its failure as a StrataError.

    ``method`` is a stub's multi-callable. A deadline nobody can cancel takes
    the blocking call, which costs a few hundred microseconds less than a
    future here (no hand-off of the reply between threads).
    """
    deadline.check()
    if not deadline.cancellable:
        try:
            return method(*args, timeout=deadline.remaining())
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
    return wait_grpc(deadline, method.future(*args, timeout=deadline.remaining()))


def wait_grpc(deadline: Deadline, future: grpc.Future):
    """The reply of a call already started, cancelled with ``deadline``; its failure as a StrataError."""
    forget = deadline.on_cancel(future.cancel)
    try:
        return future.result()
    except grpc.FutureCancelledError:
        deadline.check()
        raise
    except grpc.RpcError as err:
        deadline.check()  # a cancellation reads as Cancelled, not as the CANCELLED status
        raise from_rpc_error(err) from None
    finally:
        forget()


class GrpcStreamTransport(Transport):
    """Streams over ``channel``; closes it only when it opened it (:meth:`connect`)."""

    name = "grpc"
    shared_memory = False

    def __init__(self, channel: grpc.Channel, *, chunk_bytes: int = codec.DEFAULT_CHUNK, owns_channel: bool = False) -> None:
        self._channel = channel
        self._stub = kv_pb2_grpc.KVServiceStub(channel)
        self._chunk = chunk_bytes
        self._owns = owns_channel

    @classmethod
    def connect(cls, target: str, **options) -> GrpcStreamTransport:
        return cls(grpc.insecure_channel(target, options=codec.CHANNEL_OPTIONS), owns_channel=True, **options)

    def close(self) -> None:
        if self._owns:
            self._channel.close()

    def put(self, namespace: str, blocks: Sequence[BlockPut], deadline: Deadline) -> list[bool]:
        checked = codec.check_puts(namespace, blocks)
        if not checked:
            return []
        response = call_grpc(deadline, self._stub.Put, codec.put_requests(namespace, checked, self._chunk))
        return codec.stream_put_results(checked, response)

    def get_into(self, namespace: str, keys: Sequence[bytes], place: Place | None, deadline: Deadline, *,
                 local_only: bool = False) -> list[Block | None]:
        """As the contract says; ``local_only``: the daemon answers from its own tiers only, never reading
        through to its peers (what a peer fetch asks)."""
        keys = list(keys)
        if not keys:
            return []
        deadline.check()
        request = pb.GetRequest(namespace=namespace, keys=keys, local_only=local_only)
        stream = self._stub.Get(request, timeout=deadline.remaining())
        forget = deadline.on_cancel(stream.cancel)
        assembler = codec.GetAssembler(place)
        try:
            for msg in stream:
                assembler.feed(msg)
        except grpc.RpcError as err:
            deadline.check()
            raise from_rpc_error(err) from None
        finally:
            forget()
        return assembler.finish()
