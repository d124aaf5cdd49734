"""Cluster KV pool: block reads from another daemon over the TCP peer transport.

Run as ``python -m benchmarks.kv_pool [--quick]``. A Strata daemon runs in
its own process with its peer listener on loopback (``--peer-listen``),
holding 1 MiB, 4 MiB and 16 MiB blocks in RAM. This process reads them as a
peer daemon's fetch does (:class:`kvstore.peer.tcp.TcpPeerClient`: one
request per batch, each block's bytes received straight into a
preallocated buffer that stands for the arena slot the reader's store
reserved, verified against its checksum before it counts), one block per
call and 16 per call.

The baseline, alternating with it in the same rounds: a plain blocking
socket between two processes. A child process sends the same number of
bytes from a preallocated buffer with ``sendall`` for each request of a
few bytes; this process receives them with ``recv_into`` (``MSG_WAITALL``)
into the same kind of preallocated buffers. No framing, no checksums, no
store: the floor of moving these bytes over loopback TCP from Python.

The UCX peer transport (:class:`kvstore.peer.ucx.UcxPeerClient`) over the
same daemon's ``--peer-ucx-listen``, in the same rounds, where ucxx can be
imported: UCX over its tcp transport on loopback (the listener API wires up
over TCP), ``UCX_MAX_RNDV_RAILS=2``, blocking progress. UCX shared memory is
not measured: the listener API never selects it.

The target is ≥ 0.8× the plain socket. Not measured yet (issue 10):
Mooncake, the handoff and the index churn rates; and a daemon fetching from
a daemon through its peer tier (this process stands for the fetching daemon).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import struct
import time
from collections.abc import Iterator

from benchmarks.harness import MiB, Benchmark, compare, free_port, interleave, size_label, strata_daemon
from kvstore.block import BlockMeta, checksum
from kvstore.peer.tcp import TcpPeerClient
from kvstore.peer.ucx_link import ucx_available
from kvstore.transport.base import Deadline

NAME = "kv_pool"
SIZES = [1 * MiB, 4 * MiB, 16 * MiB]
BATCH = 16
TARGET = 0.8
FULL = dict(rounds=9, warmup=2, round_bytes=256 * MiB)
QUICK = dict(rounds=5, warmup=1, round_bytes=64 * MiB)
_REQUEST = struct.Struct("<Q")


def _plain_sender(port_out, max_bytes: int) -> None:
    """The baseline's server: per request of n, send n bytes from one preallocated buffer."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port_out.send(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = memoryview(os.urandom(max_bytes))
    while True:
        head = conn.recv(_REQUEST.size, socket.MSG_WAITALL)
        if len(head) < _REQUEST.size:
            return
        (n,) = _REQUEST.unpack(head)
        conn.sendall(data[:n])


@contextlib.contextmanager
def plain_socket(max_bytes: int) -> Iterator[socket.socket]:
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_plain_sender, args=(there, max_bytes), daemon=True)
    proc.start()
    try:
        port = here.recv()
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            yield sock
        finally:
            sock.close()
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()


def plain_round(sock: socket.socket, buffers: list[memoryview], size: int, calls: int):
    def run() -> tuple[int, float]:
        t0 = time.perf_counter()
        for _ in range(calls):
            sock.sendall(_REQUEST.pack(size * len(buffers)))
            for view in buffers:
                got = 0
                while got < size:
                    got += sock.recv_into(view[got:size], size - got, socket.MSG_WAITALL)
        return calls * len(buffers) * size, time.perf_counter() - t0

    return run


def peer_round(client: TcpPeerClient, address: str, keys: list[bytes], buffers: list[memoryview], calls: int):
    def run() -> tuple[int, float]:
        moved = 0
        t0 = time.perf_counter()
        for _ in range(calls):
            got = client.read(address, "bench", keys, lambda i, meta: buffers[i], Deadline.after(60, cancellable=False))
            for g in got:
                if not g.result.is_hit:
                    raise SystemExit(f"a benchmark read was not a hit: {g.result}")
                moved += g.result.meta.size
        return moved, time.perf_counter() - t0

    return run


def main(argv: list[str] | None = None) -> int:
    bench = Benchmark(NAME, __doc__.splitlines()[0], argv)
    plan = QUICK if bench.quick else FULL
    peer_port, ucx_port = free_port(), free_port()
    ucx, no_ucx = ucx_available()
    if not ucx:
        print(f"UCX cases left out: {no_ucx}")
    extra = dict(peer_ucx_listen=f"127.0.0.1:{ucx_port}", insecure=True) if ucx else {}
    with strata_daemon(ram_bytes="1GiB", disk_bytes="0", max_block_bytes="16MiB", auto_create_namespaces=True,
                       peer_listen=f"127.0.0.1:{peer_port}", **extra), \
            plain_socket(BATCH * max(SIZES)) as plain:
        address = f"tcp://127.0.0.1:{peer_port}"
        client = TcpPeerClient()
        ucx_client = None
        if ucx:
            from kvstore.peer.ucx import UcxPeerClient

            ucx_client = UcxPeerClient()
        try:
            for seed, size in enumerate(SIZES):
                L = size_label(size)
                keys = [b"%s-%d" % (L.encode(), i) for i in range(BATCH)]
                blocks = []
                for key in keys:
                    data = os.urandom(size)
                    blocks.append((key, data, BlockMeta(size, checksum(data))))
                client.write(address, "bench", blocks, Deadline.after(120))
                del blocks
                buffers = [memoryview(bytearray(size)) for _ in range(BATCH)]
                for view in buffers:
                    view[:] = b"\0" * size  # touched: no page faults in the timed part
                single_calls = max(1, plan["round_bytes"] // size)
                batch_calls = max(1, plan["round_bytes"] // (size * BATCH))
                fns = {
                    f"get {L} peer-tcp": peer_round(client, address, keys[:1], buffers[:1], single_calls),
                    f"plain socket {L}": plain_round(plain, buffers[:1], size, single_calls),
                    f"get {L} peer-tcp x{BATCH} batch": peer_round(client, address, keys, buffers, batch_calls),
                    f"plain socket {L} x{BATCH}": plain_round(plain, buffers, size, batch_calls),
                }
                if ucx_client is not None:
                    at = f"ucx://127.0.0.1:{ucx_port}"
                    fns[f"get {L} peer-ucx"] = peer_round(ucx_client, at, keys[:1], buffers[:1], single_calls)
                    fns[f"get {L} peer-ucx x{BATCH} batch"] = peer_round(ucx_client, at, keys, buffers, batch_calls)
                s = interleave(fns, rounds=plan["rounds"], warmup=plan["warmup"])
                bench.add(compare(s, f"get {L} peer-tcp", f"plain socket {L}", target_ratio=TARGET, note=(
                    "one block per read: request, header, bytes received into a preallocated buffer and "
                    "verified (xxh3-64, on both sides); the baseline sends the same bytes per request, unframed, "
                    "unverified")))
                bench.add(compare(s, f"get {L} peer-tcp x{BATCH} batch", f"plain socket {L} x{BATCH}",
                                  target_ratio=TARGET, note=f"{BATCH} blocks per read, one request"))
                if ucx_client is not None:
                    bench.add(compare(s, f"get {L} peer-ucx", f"plain socket {L}", target_ratio=TARGET, note=(
                        "the same over UCX (tcp transport, loopback): frames as tag messages, each block one tag "
                        "receive into the preallocated buffer, verified")))
                    bench.add(compare(s, f"get {L} peer-ucx x{BATCH} batch", f"plain socket {L} x{BATCH}",
                                      target_ratio=TARGET, note=f"{BATCH} blocks per read over UCX"))
        finally:
            client.close()
            if ucx_client is not None:
                ucx_client.close()
    bench.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
