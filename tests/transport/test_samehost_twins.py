"""The blocking and the asyncio same-host transports send the same requests for the same calls.

They are not generated one from the other (a pool of blocking connections
and one multiplexed asyncio connection wait too differently); both drive
:mod:`kvstore.transport.samehost.protocol` instead. What keeps them from
drifting is this: one script of calls, run over each against a real daemon,
must put the same requests on the socket (operation, keys, sizes,
checksums; not request ids, timeouts or the slots the daemon happened to
grant). Requests without a reply (Release and Touch notifications, whose
timing is each transport's own) are left out.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvstore import Client
from kvstore.transport.attached import connect_attached
from kvstore.transport.attached_aio import connect_attached_async
from kvstore.transport.base import BlockPut, Deadline, placement
from kvstore.transport.samehost import frames

pytestmark = pytest.mark.system

KiB = 1 << 10
VALUES = {b"small": b"s" * 1000, b"large": bytes(range(256)) * (300 * KiB // 256), b"tiny": b"t" * 10}


def requests(meta) -> tuple | None:
    """One request as both transports must send it; None for a notification."""
    op, rid, args = meta
    if not rid:
        return None
    name = frames.OP_NAMES[op]
    if op == frames.HELLO:
        return name, tuple(args[2])
    if op == frames.LOOKUP:
        return name, tuple(args[1])
    if op == frames.PUT:
        return name, tuple((h[0], h[1], h[2]) for h in args[2])
    if op == frames.ALLOCATE:
        return name, tuple((h[0], h[1]) for h in args[3])
    if op == frames.COMMIT:
        return name, tuple(args[1])
    return name, len(args[0])


@pytest.fixture
def sent(monkeypatch):
    """The requests this thread (the client's: a blocking call, or asyncio.run's loop) encodes."""
    out: list[tuple] = []
    me = threading.get_ident()
    real = frames.encode

    def encode(meta, payload_len: int = 0) -> bytes:
        if threading.get_ident() == me:
            request = requests(meta)
            if request is not None:
                out.append(request)
        return real(meta, payload_len)

    monkeypatch.setattr(frames, "encode", encode)
    return out


def script(ns: str, target: str):
    """The calls, as (what to do, its arguments); each transport runs them in order."""
    keys = list(VALUES)
    buffers = [bytearray(len(v)) for v in VALUES.values()]
    return [
        ("put", ns, [BlockPut(k, v) for k, v in VALUES.items()]),  # inline, into a slot, inline
        ("put", ns, [BlockPut(k, v) for k, v in VALUES.items()]),  # all present: no Commit
        ("get", ns, [b"small", b"absent", b"large"], None),  # a Lookup; their extents are learned
        ("get", ns, [b"small", b"large"], None),  # read from the learned extents: no request
        ("delete", target, ns, [b"small"]),  # a Delete voids what was learned
        ("get", ns, [b"small", b"large", b"tiny"], None),
        # one declined; "small" (deleted) is asked for, the others read from their learned extents
        ("get", ns, keys, placement(keys, lambda i, info: None if i == 1 else buffers[i])),
    ]


def expected_results(results) -> list:
    return [r if isinstance(r, list) and (not r or isinstance(r[0], bool)) else
            [None if b is None else bytes(b.data) for b in r] for r in results]


def run_sync(target: str, ns: str) -> list:
    out = []
    transport = connect_attached(target, "same-host")
    try:
        for step in script(ns, target):
            if step[0] == "put":
                out.append(transport.put(step[1], step[2], Deadline.after(10)))
            elif step[0] == "get":
                out.append(transport.get_into(step[1], step[2], step[3], Deadline.after(10)))
            else:
                with Client(step[1], use_shm=False) as c:
                    c.delete(step[2], step[3])
    finally:
        transport.close()
    return expected_results(out)


def run_async(target: str, ns: str) -> list:
    async def main():
        out = []
        transport = await connect_attached_async(target, "same-host")
        try:
            for step in script(ns, target):
                if step[0] == "put":
                    out.append(await transport.put(step[1], step[2], Deadline.after(10)))
                elif step[0] == "get":
                    out.append(await transport.get_into(step[1], step[2], step[3], Deadline.after(10)))
                else:
                    await asyncio.to_thread(_delete, step[1], step[2], step[3])
        finally:
            await transport.close()
        return expected_results(out)

    return asyncio.run(main())


def _delete(target: str, ns: str, keys) -> None:
    with Client(target, use_shm=False) as c:
        c.delete(ns, keys)


def test_both_transports_send_the_same_requests_and_read_the_same_blocks(make_daemon, sent):
    daemon = make_daemon(auto_create_namespaces=True)
    sync_results = run_sync(daemon.target, "sync")
    sync_sent = list(sent)
    sent.clear()
    async_results = run_async(daemon.target, "aio")
    assert async_results == sync_results
    assert sent == sync_sent
    assert [name for name, _ in sync_sent] == [
        "Hello", "Put", "Allocate", "Commit", "Put", "Allocate", "Lookup", "Lookup", "Lookup"]
    lookups = [keys for name, keys in sync_sent if name == "Lookup"]
    # After the Delete of "small", "large" is still read from where it was seen: a Delete voids its own keys.
    assert lookups == [(b"small", b"absent", b"large"), (b"small", b"tiny"), (b"small",)]
    assert sync_results[2] == [VALUES[b"small"], None, VALUES[b"large"]]
    assert sync_results[3] == [VALUES[b"small"], VALUES[b"large"]]
    assert sync_results[4] == [None, VALUES[b"large"], VALUES[b"tiny"]]  # after the Delete (none of its own)
    assert sync_results[5] == [None, None, VALUES[b"tiny"]]
