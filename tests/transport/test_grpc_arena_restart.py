"""The arena under gRPC control across a daemon restart that recreates the arena file.

A real ``strata serve`` without a same-host socket (clients map the arena and
send Lookup and Allocate as gRPC calls) is SIGKILLed and started again on the
same directories, with the arena's block table gone, so the new run starts
empty in a new arena file. A client left open still maps the old file: its
calls carry the token it mapped, the daemon refuses them, and the client maps
the new arena and tries again instead of reading or writing the old file.
"""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest

from kvstore import AsyncClient, Client
from kvstore.api.v1 import kv_pb2 as pb
from kvstore.api.v1 import kv_pb2_grpc
from kvstore.config.tiers import arena_name

pytestmark = pytest.mark.system

BLOCK = 300_000


def blob(key: bytes) -> bytes:
    return (key * (BLOCK // len(key) + 1))[:BLOCK]


def daemon_token(daemon) -> bytes:
    """The token of the arena the daemon serves now."""
    with grpc.insecure_channel(daemon.target) as channel:
        return kv_pb2_grpc.KVServiceStub(channel).Attach(pb.AttachRequest(), timeout=10).arena_token


def mapped_token(c: Client | AsyncClient) -> bytes:
    """The token of the arena file the client maps."""
    if isinstance(c, Client):
        [arena] = c._mapped
        return arena.token
    [attached] = c._attached.values()
    return attached.arena.token


def restart_with_a_new_arena(daemon) -> None:
    """SIGKILL, then start again with the block table removed: the arena cannot be kept."""
    arena_path = str(daemon.disk_dir.parent / arena_name(daemon.disk_dir))
    old_inode = os.stat(arena_path).st_ino
    assert daemon.kill(signal.SIGKILL) == -signal.SIGKILL
    os.unlink(arena_path + ".table")
    daemon.start()
    assert os.stat(arena_path).st_ino != old_inode  # a new file, not the old one's bytes


def test_the_blocking_client_maps_the_new_arena_after_a_restart(daemon_process):
    daemon = daemon_process("--same-host-socket", "off")
    with Client(daemon.target) as c:
        assert c.transport_name == "grpc-arena"
        assert c.put("m", b"before", blob(b"before"))
        restart_with_a_new_arena(daemon)
        assert c.put("m", b"after", blob(b"after"))
        assert c.get("m", b"after") == blob(b"after")
        assert c.get("m", b"before") is None  # the new run started empty
        assert c.transport_name == "grpc-arena" and mapped_token(c) == daemon_token(daemon)


def test_a_get_is_the_blocking_clients_first_call_after_the_restart(daemon_process):
    daemon = daemon_process("--same-host-socket", "off")
    with Client(daemon.target) as c:
        assert c.put("m", b"before", blob(b"before"))
        restart_with_a_new_arena(daemon)
        with Client(daemon.target) as fresh:
            assert fresh.put("m", b"after", blob(b"after"))
        assert c.get("m", b"after") == blob(b"after")  # a Lookup refused, then asked again in the new arena
        assert mapped_token(c) == daemon_token(daemon)


def test_the_asyncio_client_maps_the_new_arena_after_a_restart(daemon_process):
    daemon = daemon_process("--same-host-socket", "off")

    async def main() -> None:
        async with AsyncClient(daemon.target) as c:
            assert await c.transport_name("m") == "grpc-arena"
            assert await c.put("m", b"before", blob(b"before"))
            restart_with_a_new_arena(daemon)
            assert await c.put("m", b"after", blob(b"after"))
            assert await c.get("m", b"after") == blob(b"after")
            assert await c.get("m", b"before") is None
            assert await c.transport_name("m") == "grpc-arena" and mapped_token(c) == daemon_token(daemon)

    asyncio.run(main())


def test_a_get_is_the_asyncio_clients_first_call_after_the_restart(daemon_process):
    daemon = daemon_process("--same-host-socket", "off")

    async def main() -> None:
        async with AsyncClient(daemon.target) as c:
            assert await c.put("m", b"before", blob(b"before"))
            restart_with_a_new_arena(daemon)
            async with AsyncClient(daemon.target) as fresh:
                assert await fresh.put("m", b"after", blob(b"after"))
            assert await c.get("m", b"after") == blob(b"after")
            assert mapped_token(c) == daemon_token(daemon)

    asyncio.run(main())
