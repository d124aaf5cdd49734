"""Transports: how block bytes move between a client and a daemon.

Daemons move blocks between each other with :mod:`kvstore.peer`'s
:class:`~kvstore.peer.base.PeerTransport`; its listeners are also reachable
from a client through the ``peer-*`` transports below.

One contract (:class:`~kvstore.transport.base.Transport`, stated in its
module docstring), a registry of implementations by name, one contract
suite over all of them (``tests/transport/test_transport_contract.py``):

- ``in-process``: calls a :class:`~kvstore.store.tiered.TieredStore` in this process;
- ``grpc``: Put/Get streams over gRPC, any host;
- ``grpc-arena``: the daemon's shared arena, control as gRPC calls;
- ``same-host``: the daemon's shared arena, control over its Unix socket;
- ``peer-tcp``: the daemon's peer data plane (``--peer-listen``), the TCP
  transport daemons read each other's blocks with (:mod:`kvstore.peer`);
- ``peer-ucx``: the same over the daemon's UCX listener (``--peer-ucx-listen``;
  needs the ``ucx`` extra);
- ``peer-ucx-shm``: the same over UCX shared memory, to a daemon on this host
  (``--peer-ucx-shm``; the ``ucx`` extra).

A new transport is one module and one entry in :data:`TRANSPORTS`. The
three ``peer-*`` transports live with the peer protocol
(:mod:`kvstore.peer.transports`) and are imported only when opened.

The asyncio twins (:class:`~kvstore.transport.base.AsyncTransport`, the
same contract as coroutines) have a registry of their own,
:data:`ASYNC_TRANSPORTS`, under the same names: ``grpc``, ``grpc-arena``
and ``same-host``, opened with :func:`open_async_transport` inside a
running loop. The contract suite runs over them too.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from kvstore.errors import InvalidArgument
from kvstore.transport.base import (
    AsyncTransport, Block, BlockInfo, BlockPut, Deadline, Place, Placement, Transport, placement,
)


def _in_process(*, store, **_) -> Transport:
    from kvstore.transport.inprocess import InProcessTransport

    return InProcessTransport(store)


def _grpc(*, target: str, **options) -> Transport:
    from kvstore.transport.grpc.stream import GrpcStreamTransport

    return GrpcStreamTransport.connect(target, **options)


def _grpc_arena(*, target: str, **options) -> Transport:
    from kvstore.transport.attached import connect_attached

    return connect_attached(target, "grpc-arena", **options)


def _same_host(*, target: str, **options) -> Transport:
    from kvstore.transport.attached import connect_attached

    return connect_attached(target, "same-host", **options)


def _peer_ucx(*, target: str, **options) -> Transport:
    from kvstore.peer.transports import connect_ucx

    return connect_ucx(target, **options)


def _peer_ucx_shm(*, target: str, **options) -> Transport:
    from kvstore.peer.transports import connect_ucx_shm

    return connect_ucx_shm(target, **options)


def _peer_tcp(*, target: str, **options) -> Transport:
    from kvstore.peer.transports import connect_tcp

    return connect_tcp(target, **options)


# Name → constructor (keyword arguments: ``store`` for in-process, ``target``
# for the others); a new transport registers here.
TRANSPORTS: dict[str, Callable[..., Transport]] = {
    "in-process": _in_process,
    "grpc": _grpc,
    "grpc-arena": _grpc_arena,
    "same-host": _same_host,
    "peer-tcp": _peer_tcp,
    "peer-ucx": _peer_ucx,
    "peer-ucx-shm": _peer_ucx_shm,
}


def open_transport(name: str, **options) -> Transport:
    try:
        factory = TRANSPORTS[name]
    except KeyError:
        raise InvalidArgument(f"unknown transport {name!r}; known: {', '.join(sorted(TRANSPORTS))}") from None
    return factory(**options)


async def _grpc_async(*, target: str, **options) -> AsyncTransport:
    from kvstore.transport.grpc.stream_aio import AsyncGrpcStreamTransport

    return AsyncGrpcStreamTransport.connect(target, **options)


async def _grpc_arena_async(*, target: str, **options) -> AsyncTransport:
    from kvstore.transport.attached_aio import connect_attached_async

    return await connect_attached_async(target, "grpc-arena", **options)


async def _same_host_async(*, target: str, **options) -> AsyncTransport:
    from kvstore.transport.attached_aio import connect_attached_async

    return await connect_attached_async(target, "same-host", **options)


# Name → coroutine function opening the asyncio twin (keyword arguments as in TRANSPORTS).
ASYNC_TRANSPORTS: dict[str, Callable[..., Awaitable[AsyncTransport]]] = {
    "grpc": _grpc_async,
    "grpc-arena": _grpc_arena_async,
    "same-host": _same_host_async,
}


async def open_async_transport(name: str, **options) -> AsyncTransport:
    """Open the asyncio transport ``name`` in the running loop."""
    try:
        factory = ASYNC_TRANSPORTS[name]
    except KeyError:
        raise InvalidArgument(
            f"unknown asyncio transport {name!r}; known: {', '.join(sorted(ASYNC_TRANSPORTS))}") from None
    return await factory(**options)


__all__ = [
    "ASYNC_TRANSPORTS", "TRANSPORTS", "AsyncTransport", "Block", "BlockInfo", "BlockPut", "Deadline", "Place",
    "Placement", "Transport", "open_async_transport", "open_transport", "placement",
]
