"""AsyncClient across a daemon restart: a real ``strata serve`` SIGKILLed and started again on the
same address and arena directory, with the client left open in between.

The restarted daemon re-adopts its RAM blocks under a new arena token; the client's same-host
connection is gone and its token refused, so it attaches again (as the blocking client does,
tests/server/test_process.py) instead of failing every later call.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

from kvstore.client import AsyncClient

pytestmark = pytest.mark.system

BLOCK = 300_000


def blob(key: bytes) -> bytes:
    return (key * (BLOCK // len(key) + 1))[:BLOCK]


def arena_token(c: AsyncClient) -> bytes:
    """The token this client attached under (the same-host Hello's), new at every daemon start."""
    [attached] = c._attached.values()
    return attached.arena.token


async def wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    """Poll on the loop (the client's reader task must run to see the socket close)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("path", ["same-host", "grpc-arena"])
def test_the_next_put_and_get_work_after_the_daemon_is_killed_and_started_again(daemon_process, path):
    daemon = daemon_process(*(["--same-host-socket", "off"] if path == "grpc-arena" else []))

    async def main() -> None:
        async with AsyncClient(daemon.target) as c:
            assert await c.transport_name("m") == path
            assert await c.put("m", b"before", blob(b"before"))
            old = arena_token(c)
            assert daemon.kill(signal.SIGKILL) == -signal.SIGKILL
            daemon.start()  # same port, disk directory and arena directory
            assert await c.put("m", b"after", blob(b"after"))
            assert await c.get("m", b"after") == blob(b"after")
            assert await c.get("m", b"before") == blob(b"before")  # re-adopted from the kept arena
            assert await c.transport_name("m") == path
            if path == "same-host":  # attached again: the new run's token (gRPC control keeps the re-adopted file)
                assert arena_token(c) != old

    asyncio.run(main())


def test_a_get_is_the_first_call_after_the_restart(daemon_process):
    daemon = daemon_process()

    async def main() -> None:
        async with AsyncClient(daemon.target) as c:
            assert await c.put("m", b"k", blob(b"k"))
            assert daemon.kill(signal.SIGKILL) == -signal.SIGKILL
            daemon.start()
            found, missing = await c.get_many("m", [b"k", b"missing"])
            assert bytes(found.data) == blob(b"k") and missing is None

    asyncio.run(main())


def test_a_connection_the_daemon_closed_for_idleness_is_opened_again(daemon_process):
    daemon = daemon_process("--same-host-idle-seconds", "0.3")

    async def main() -> None:
        async with AsyncClient(daemon.target) as c:
            assert await c.put("m", b"k", blob(b"k"))
            [attached] = c._attached.values()
            token, connection = arena_token(c), attached.same_host
            await wait_for(lambda: attached.same_host.broken, "the daemon to close the idle connection")
            assert await c.get("m", b"k") == blob(b"k")
            assert await c.put("m", b"k2", blob(b"k2"))
            assert arena_token(c) == token and attached.same_host is not connection  # same daemon, new connection
            assert await c.transport_name("m") == "same-host"

    asyncio.run(main())
