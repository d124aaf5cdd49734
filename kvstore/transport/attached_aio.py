"""Picking an asyncio transport from the daemon's Attach answer: the twin of :mod:`kvstore.transport.attached`.

The same choice, best first, by the same functions: the same-host socket
(:class:`~kvstore.transport.samehost.client_aio.AsyncSameHostTransport`),
the arena under gRPC control
(:class:`~kvstore.transport.grpc.arena_aio.AsyncGrpcArenaTransport`), the
gRPC stream (:class:`~kvstore.transport.grpc.stream_aio.AsyncGrpcStreamTransport`).
"""

from __future__ import annotations

import grpc
import grpc.aio

from kvstore.api.v1 import kv_pb2 as pb
from kvstore.api.v1 import kv_pb2_grpc
from kvstore.errors import DaemonUnavailable
from kvstore.shm.arena import ShmArena
from kvstore.transport.attached import arena_to_map, same_host_offered, same_host_unusable
from kvstore.transport.base import AsyncTransport, Block, BlockPut, Deadline, Place
from kvstore.transport.grpc import blocks as grpc_blocks
from kvstore.transport.grpc.arena_aio import AsyncGrpcArenaTransport
from kvstore.transport.grpc.stream_aio import AsyncGrpcStreamTransport
from kvstore.transport.off_loop import OffLoop
from kvstore.transport.samehost.client_aio import AsyncSameHostTransport


async def choose_async(attach: pb.AttachResponse | None, channel: grpc.aio.Channel, stream: AsyncTransport, *,
                       use_shm: bool | None = None, want: str | None = None, lease_ms: int = 0,
                       off_loop: OffLoop | None = None, same_host_options: dict | None = None,
                       ) -> tuple[AsyncTransport, ShmArena | None]:
    """As :func:`kvstore.transport.attached.choose`; ``off_loop`` goes to the transports that copy."""
    arena = arena_to_map(attach, use_shm=use_shm, want=want)
    if arena is None:
        return stream, None
    if same_host_offered(attach, arena, want):
        try:
            return await AsyncSameHostTransport.connect(
                arena, attach.control_socket, attach.arena_token, fallback=stream, lease_ms=lease_ms,
                off_loop=off_loop, **(same_host_options or {})), arena
        except DaemonUnavailable as err:
            same_host_unusable(err, arena, want)
    return AsyncGrpcArenaTransport(channel, arena, stream, lease_ms=lease_ms, arena_name=attach.arena_name,
                                   off_loop=off_loop), arena


class _AsyncOwning(AsyncTransport):
    """An asyncio transport with the channel and arena it was built on, closed with it."""

    def __init__(self, inner: AsyncTransport, stream: AsyncTransport, arena: ShmArena | None,
                 channel: grpc.aio.Channel, off_loop: OffLoop) -> None:
        self.inner, self._stream, self._arena, self._channel = inner, stream, arena, channel
        self._off_loop = off_loop
        self.name, self.shared_memory, self.device_tensors = inner.name, inner.shared_memory, inner.device_tensors

    async def put(self, namespace: str, blocks: list[BlockPut], deadline: Deadline) -> list[bool]:
        return await self.inner.put(namespace, blocks, deadline)

    async def get_into(self, namespace: str, keys: list[bytes], place: Place | None, deadline: Deadline,
                       ) -> list[Block | None]:
        return await self.inner.get_into(namespace, keys, place, deadline)

    async def touch(self, namespace: str, keys: list[bytes]) -> None:
        await self.inner.touch(namespace, keys)

    async def close(self) -> None:
        await self._off_loop.wait()  # no worker thread holds a view of the arena any more
        await self.inner.close()
        await self._stream.close()
        if self._arena is not None:
            self._arena.close()
        await self._channel.close()


async def connect_attached_async(target: str, want: str, *, timeout: float = 10.0, lease_ms: int = 0,
                                 chunk_bytes: int = grpc_blocks.DEFAULT_CHUNK, namespace: str = "",
                                 **same_host_options) -> AsyncTransport:
    """As :func:`kvstore.transport.attached.connect_attached`, inside the running loop."""
    channel = grpc.aio.insecure_channel(target, options=grpc_blocks.CHANNEL_OPTIONS)
    off_loop = OffLoop()
    stream = AsyncGrpcStreamTransport(channel, lambda: grpc.insecure_channel(target, options=grpc_blocks.CHANNEL_OPTIONS),
                                      chunk_bytes=chunk_bytes)
    try:
        try:
            attach = await kv_pb2_grpc.KVServiceStub(channel).Attach(pb.AttachRequest(namespace=namespace),
                                                                     timeout=timeout)
        except grpc.RpcError as err:
            raise DaemonUnavailable(f"cannot attach to the daemon at {target}: {err.details()}") from None
        inner, arena = await choose_async(attach, channel, stream, want=want, lease_ms=lease_ms, off_loop=off_loop,
                                          same_host_options=same_host_options)
    except BaseException:
        await stream.close()
        await channel.close()
        raise
    return _AsyncOwning(inner, stream, arena, channel, off_loop)
