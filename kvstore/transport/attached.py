"""Picking a transport from what the daemon offers (its Attach answer), best first.

Same-host socket when the daemon offers one and its arena maps here; the
arena under gRPC control when only the arena maps; the gRPC stream
otherwise (another host, or a client told not to use shared memory). The
asyncio twin (:mod:`kvstore.transport.attached_aio`) decides with the same
functions.
"""

from __future__ import annotations

import logging

import grpc

from kvstore.api.v1 import kv_pb2 as pb
from kvstore.api.v1 import kv_pb2_grpc
from kvstore.errors import ArenaUnusable, DaemonUnavailable, InvalidArgument
from kvstore.shm.arena import ShmArena
from kvstore.transport.grpc import blocks as grpc_blocks
from kvstore.transport.base import Block, BlockPut, Deadline, Place, Transport
from kvstore.transport.grpc.arena import GrpcArenaTransport
from kvstore.transport.grpc.stream import GrpcStreamTransport
from kvstore.transport.samehost.client import SameHostTransport

log = logging.getLogger(__name__)

CHOICES = ("same-host", "grpc-arena", "grpc")


def arena_to_map(attach: pb.AttachResponse | None, *, use_shm: bool | None = None,
                 want: str | None = None) -> ShmArena | None:
    """The daemon's arena mapped, or None when the bytes are to be streamed (what :func:`choose` and its
    asyncio twin decide first). ``use_shm`` True or a ``want`` fails rather than stream."""
    if want is not None and want not in CHOICES:
        raise InvalidArgument(f"unknown transport {want!r} for a daemon client; known: {', '.join(CHOICES)}")
    if attach is None or use_shm is False or want == "grpc":
        return None
    try:
        return grpc_blocks.open_arena(attach)
    except ArenaUnusable:
        if use_shm or want:
            raise
        return None


def same_host_offered(attach: pb.AttachResponse, arena: ShmArena, want: str | None) -> bool:
    """Whether to try the same-host socket; a ``want`` of it that the daemon does not offer fails (``arena`` closed)."""
    if want != "grpc-arena" and attach.control_socket:
        return True
    if want == "same-host":
        arena.close()
        raise ArenaUnusable("the daemon offers no same-host socket (--same-host-socket off)")
    return False


def same_host_unusable(err: DaemonUnavailable, arena: ShmArena, want: str | None) -> None:
    """The same-host socket did not answer: control goes over gRPC, unless it was the one wanted."""
    if want == "same-host":
        arena.close()
        raise err
    log.info("same-host socket unusable, control goes over gRPC: %s", err)


def choose(attach: pb.AttachResponse | None, channel: grpc.Channel, stream: Transport, *,
           use_shm: bool | None = None, want: str | None = None, lease_ms: int = 0,
           same_host_options: dict | None = None) -> tuple[Transport, ShmArena | None]:
    """The transport to use and the arena it maps (the caller closes both; None: nothing mapped).

    ``attach`` None means the caller did not ask (``use_shm`` False or
    ``want`` "grpc"). ``want`` names one transport and fails rather than
    fall back; ``use_shm`` True fails when the arena cannot be mapped.
    """
    arena = arena_to_map(attach, use_shm=use_shm, want=want)
    if arena is None:
        return stream, None
    if same_host_offered(attach, arena, want):
        try:
            return SameHostTransport(arena, attach.control_socket, attach.arena_token, fallback=stream,
                                     lease_ms=lease_ms, **(same_host_options or {})), arena
        except DaemonUnavailable as err:
            same_host_unusable(err, arena, want)
    return GrpcArenaTransport(channel, arena, stream, lease_ms=lease_ms, arena_name=attach.arena_name), arena


class _Owning(Transport):
    """A transport with the channel and arena it was built on, closed with it."""

    def __init__(self, inner: Transport, stream: Transport, arena: ShmArena | None, channel: grpc.Channel) -> None:
        self.inner, self._stream, self._arena, self._channel = inner, stream, arena, channel
        self.name, self.shared_memory, self.device_tensors = inner.name, inner.shared_memory, inner.device_tensors

    def put(self, namespace: str, blocks: list[BlockPut], deadline: Deadline) -> list[bool]:
        return self.inner.put(namespace, blocks, deadline)

    def get_into(self, namespace: str, keys: list[bytes], place: Place | None, deadline: Deadline) -> list[Block | None]:
        return self.inner.get_into(namespace, keys, place, deadline)

    def close(self) -> None:
        self.inner.close()
        self._stream.close()
        if self._arena is not None:
            self._arena.close()
        self._channel.close()


def connect_attached(target: str, want: str, *, timeout: float = 10.0, lease_ms: int = 0,
                     chunk_bytes: int = grpc_blocks.DEFAULT_CHUNK, namespace: str = "", **same_host_options) -> Transport:
    """Open ``want`` ("same-host", "grpc-arena") to the daemon at ``target``, or fail saying why.

    It maps the arena of ``namespace`` (default: the default arena) and serves that arena's namespaces only.

    ``same_host_options`` go to :class:`SameHostTransport` (``locations=0``: no location table,
    every read asks the daemon; ``inline_bytes``).
    """
    channel = grpc.insecure_channel(target, options=grpc_blocks.CHANNEL_OPTIONS)
    stream = GrpcStreamTransport(channel, chunk_bytes=chunk_bytes)
    try:
        try:
            attach = kv_pb2_grpc.KVServiceStub(channel).Attach(pb.AttachRequest(namespace=namespace), timeout=timeout)
        except grpc.RpcError as err:
            raise DaemonUnavailable(f"cannot attach to the daemon at {target}: {err.details()}") from None
        inner, arena = choose(attach, channel, stream, want=want, lease_ms=lease_ms,
                              same_host_options=same_host_options)
    except BaseException:
        channel.close()
        raise
    return _Owning(inner, stream, arena, channel)
