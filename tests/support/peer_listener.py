"""A daemon's TCP peer listener (--peer-listen) as the peer tests reach it: the settings of a daemon
that has one, blocks put through it, a raw connection past its Hello, and whether the daemon has
given back every lease, slot and pin."""

from __future__ import annotations

import socket

from kvstore.peer import wire
from kvstore.transport import BlockPut, Deadline, open_transport

BIG = dict(ram_bytes="160MiB", disk_bytes="0", max_block_bytes="16MiB", auto_create_namespaces=True,
           peer_listen="127.0.0.1:0")


def put(daemon, namespace: str, items: dict[bytes, bytes], token: str = "") -> None:
    with open_transport("peer-tcp", target=daemon.peer_addresses()["tcp"], token=token) as t:
        t.put(namespace, [BlockPut(k, v, layout="L") for k, v in items.items()], Deadline.after(30))


def holds_nothing(daemon) -> bool:
    s = daemon.store.stats()
    return s.active_leases == 0 and s.open_slots == 0 and s.pinned_blocks == 0


def raw_hello(port: int, token: str = "") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    wire.send(sock, wire.encode([wire.HELLO, 1, [wire.PROTOCOL_VERSION, token]]))
    meta, _ = wire.Wire(sock).read_meta()
    assert meta[:2] == [1, wire.OK]
    return sock
