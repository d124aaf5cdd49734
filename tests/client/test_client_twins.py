"""The blocking and the asyncio client (and each transport and its asyncio twin) cannot drift apart.

Each pair must show the same public methods with the same parameters (names,
kinds, defaults, annotations); the asyncio one's are coroutines. What may
differ is listed here, with why. No daemon: the classes are compared as
they are declared.
"""

from __future__ import annotations

import inspect

import pytest

from kvstore.client import AsyncClient, Client
from kvstore.client.base import BaseClient
from kvstore.transport.base import AsyncTransport, Transport
from kvstore.transport.grpc.arena import GrpcArenaTransport
from kvstore.transport.grpc.arena_aio import AsyncGrpcArenaTransport
from kvstore.transport.grpc.stream import GrpcStreamTransport
from kvstore.transport.grpc.stream_aio import AsyncGrpcStreamTransport
from kvstore.transport.samehost.client import SameHostTransport
from kvstore.transport.samehost.client_aio import AsyncSameHostTransport

# A property of the blocking client that may need an Attach is a coroutine method of the asyncio one
# (with the namespace as an argument, default the default arena's).
PROPERTY_AS_COROUTINE = {"shared_memory", "transport_name"}
ASYNC_ONLY = {"uses_shared_memory"}  # the old name of shared_memory, kept as an alias


def public(cls) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


def parameters(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default, p.annotation) for p in inspect.signature(fn).parameters.values()]


def is_coroutine_method(fn) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)


def test_both_clients_have_the_same_public_methods():
    assert public(Client) == public(AsyncClient) - ASYNC_ONLY
    assert AsyncClient.uses_shared_memory is AsyncClient.shared_memory
    for name in ("touch", "score", "holders", "nodes", "replication", "open_handoff", "heartbeat_handoff",
                 "complete_handoff", "pull_handoff", "transport_for"):  # the ten the asyncio client once lacked
        assert name in public(AsyncClient)


@pytest.mark.parametrize("name", sorted(public(Client)))
def test_each_method_takes_the_same_arguments_and_the_asyncio_one_is_a_coroutine(name):
    sync, aio = getattr(Client, name), getattr(AsyncClient, name)
    if isinstance(sync, property):
        assert name in PROPERTY_AS_COROUTINE, f"Client.{name} is a property the asyncio twin must mirror"
        assert is_coroutine_method(aio)
        assert [p[0] for p in parameters(aio)] == ["self", "namespace"]
        return
    if not callable(sync):
        return  # an attribute (name, ...)
    assert is_coroutine_method(aio), f"AsyncClient.{name} is not a coroutine"
    assert parameters(sync) == parameters(aio), f"Client.{name} and AsyncClient.{name} take different arguments"


def test_both_clients_are_built_alike_on_one_base():
    assert issubclass(Client, BaseClient) and issubclass(AsyncClient, BaseClient)
    assert parameters(Client.__init__) == parameters(AsyncClient.__init__) == parameters(BaseClient.__init__)


TWINS = [
    (GrpcStreamTransport, AsyncGrpcStreamTransport),
    (GrpcArenaTransport, AsyncGrpcArenaTransport),
    (SameHostTransport, AsyncSameHostTransport),
]
# How one connection per transport differs from a pool of them: the asyncio same-host transport is
# opened by a coroutine (connect) and, its one connection closed by the daemon, opened again (broken, reopen).
ASYNC_TRANSPORT_ONLY = {"connect", "broken", "reopen"}


@pytest.mark.parametrize("sync, aio", TWINS, ids=[s.name for s, _ in TWINS])
def test_each_transport_and_its_asyncio_twin_show_the_same_contract(sync, aio):
    assert issubclass(sync, Transport) and issubclass(aio, AsyncTransport)
    assert sync.name == aio.name and sync.shared_memory == aio.shared_memory
    assert public(sync) - {"connect"} == public(aio) - ASYNC_TRANSPORT_ONLY
    for name in ("put", "get_into", "touch", "close"):
        assert is_coroutine_method(getattr(aio, name)), f"{aio.__name__}.{name} is not a coroutine"
        assert parameters(getattr(sync, name)) == parameters(getattr(aio, name)), f"{name} of {sync.__name__}"


def test_the_same_host_twins_are_opened_with_the_same_options():
    sync = parameters(SameHostTransport.__init__)[1:]  # without self
    aio = parameters(AsyncSameHostTransport.connect)  # a classmethod, bound: without cls
    # off_loop: the worker threads, shared with the client; the fallback is the twin's kind of transport
    assert [(*p[:3], p[3].replace("AsyncTransport", "Transport")) for p in aio if p[0] != "off_loop"] == sync
