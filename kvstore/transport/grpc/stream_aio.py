"""The gRPC streamed transport for asyncio: the twin of :mod:`kvstore.transport.grpc.stream`.

Gets are grpc.aio server streams, assembled and verified by the same
:class:`~kvstore.transport.grpc.blocks.GetAssembler`; chunks of a block
larger than ``off_loop_bytes`` are fed in a worker thread (the block's last
chunk checksums all of it), headers always on the loop (they may call the
placement).

A Put does not go through grpc.aio: it runs as a future of a blocking
channel, which the loop awaits while gRPC's own thread feeds the stream.
grpc.aio loses the server's status when the server ends a client-streaming
call while the client still writes (a block over the limit, a full tier): a
write that fails after the status arrived overwrites it with INTERNAL
"Internal error from Core" (grpc/grpc#36066). The blocking stack reports
the server's status, and its request thread also keeps the checksums and
chunk copies off the loop. At most ``MAX_PUT_STREAMS`` run at once, each
holding a gRPC thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import grpc
import grpc.aio

from kvstore.api.v1 import kv_pb2 as pb
from kvstore.api.v1 import kv_pb2_grpc
from kvstore.rpc.status import from_rpc_error
from kvstore.transport.base import AsyncTransport, Block, BlockPut, Deadline, Place
from kvstore.transport.grpc import blocks as codec
from kvstore.transport.grpc.stream import wait_grpc
from kvstore.transport.off_loop import OFF_LOOP_BYTES

# Streamed Puts in flight per transport; each holds a gRPC thread feeding it.
MAX_PUT_STREAMS = 8


async def call_grpc_async(deadline: Deadline, method, request):
    """One unary gRPC call of grpc.aio under ``deadline``; its failure as a StrataError."""
    deadline.check()
    try:
        return await method(request, timeout=deadline.remaining())
    except grpc.RpcError as err:
        deadline.check()  # a cancellation reads as Cancelled, not as the CANCELLED status
        raise from_rpc_error(err) from None


class AsyncGrpcStreamTransport(AsyncTransport):
    """Streams over ``channel`` (grpc.aio); Puts over the blocking channel ``put_channel()`` makes on first
    use (closed with the transport). Closes ``channel`` only when it opened it (:meth:`connect`)."""

    name = "grpc"
    shared_memory = False

    def __init__(self, channel: grpc.aio.Channel, put_channel: Callable[[], grpc.Channel], *,
                 chunk_bytes: int = codec.DEFAULT_CHUNK, off_loop_bytes: int = OFF_LOOP_BYTES,
                 owns_channel: bool = False) -> None:
        self._channel = channel
        self._stub = kv_pb2_grpc.KVServiceStub(channel)
        self._make_put_channel = put_channel
        self._put_channel: grpc.Channel | None = None
        self._put_stub: kv_pb2_grpc.KVServiceStub | None = None
        self._put_streams = asyncio.Semaphore(MAX_PUT_STREAMS)
        self._chunk = chunk_bytes
        self._off_loop_bytes = off_loop_bytes
        self._owns = owns_channel

    @classmethod
    def connect(cls, target: str, **options) -> AsyncGrpcStreamTransport:
        channel = grpc.aio.insecure_channel(target, options=codec.CHANNEL_OPTIONS)
        return cls(channel, lambda: grpc.insecure_channel(target, options=codec.CHANNEL_OPTIONS), owns_channel=True,
                   **options)

    async def close(self) -> None:
        if self._put_channel is not None:
            self._put_channel.close()
            self._put_channel = self._put_stub = None
        if self._owns:
            await self._channel.close()

    # ---- writes --------------------------------------------------------------

    async def put(self, namespace: str, blocks: Sequence[BlockPut], deadline: Deadline) -> list[bool]:
        checked = codec.check_puts(namespace, blocks)
        if not checked:
            return []
        deadline.check()
        async with self._put_streams:
            response = await self._put_stream(namespace, checked, deadline)
        return codec.stream_put_results(checked, response)

    async def _put_stream(self, namespace: str, checked, deadline: Deadline) -> pb.PutResponse:
        """One streamed Put, driven by the blocking stub's future (see the module docstring)."""
        if self._put_stub is None:
            self._put_channel = self._make_put_channel()
            self._put_stub = kv_pb2_grpc.KVServiceStub(self._put_channel)
        call = self._put_stub.Put.future(codec.put_requests(namespace, checked, self._chunk),
                                         timeout=deadline.remaining())
        loop = asyncio.get_running_loop()
        ended = loop.create_future()

        def on_end(_) -> None:  # on a gRPC thread, or here when already ended
            try:
                loop.call_soon_threadsafe(lambda: ended.done() or ended.set_result(None))
            except RuntimeError:
                pass  # the loop is closed: nobody waits any more

        call.add_done_callback(on_end)
        try:
            await ended
        except asyncio.CancelledError:
            call.cancel()
            raise
        return wait_grpc(deadline, call)  # ended: its reply, or its failure as a StrataError

    # ---- reads ---------------------------------------------------------------

    async def get_into(self, namespace: str, keys: Sequence[bytes], place: Place | None, deadline: Deadline, *,
                       local_only: bool = False) -> list[Block | None]:
        """As the contract says; ``local_only`` as for the blocking twin."""
        keys = list(keys)
        if not keys:
            return []
        deadline.check()
        request = pb.GetRequest(namespace=namespace, keys=keys, local_only=local_only)
        assembler = codec.GetAssembler(place)
        large = False
        try:
            async for msg in self._stub.Get(request, timeout=deadline.remaining()):
                if msg.WhichOneof("part") == "header":  # on the loop: it may call the placement
                    large = msg.header.block.size > self._off_loop_bytes
                    assembler.feed(msg)
                elif large:  # the block's last chunk checksums all of it
                    await asyncio.to_thread(assembler.feed, msg)
                else:
                    assembler.feed(msg)
        except grpc.RpcError as err:
            deadline.check()
            raise from_rpc_error(err) from None
        return assembler.finish()
