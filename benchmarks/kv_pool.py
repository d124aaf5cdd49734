"""Cluster KV pool: block reads from another daemon over the TCP peer transport.

Run as ``python -m benchmarks.kv_pool [--quick | --smoke] [--no-handoff | --handoff-only]
[--no-ucx] [--mooncake | --no-mooncake]`` (``--handoff``, which used to add the handoff, is
accepted: it is in every run now). A Strata daemon runs in
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

Every case of issue 27's second table is a row by name with the issue's
target, in one run: peer-tcp reads against the socket (≥ 0.8 one block per
read, ≥ 0.9 batched), UCX (tag) against the socket (≥ 0.9 at 4 MiB and up)
and against peer-tcp in the same rounds (``vs peer-tcp``, ≥ 1: never
slower), UCX shared memory the same way (no target: for context), Mooncake
(≥ 2), and the handoff (≥ 0.85 over TCP). A transport that cannot run here
(ucxx not importable, ``--no-ucx``; Mooncake not installed,
``--no-mooncake``; no ``redis-server`` for the handoff) leaves a row per
case, with no figure and the reason: never a silent gap. Peer-tcp writes
(fresh keys, deleted untimed) run in the same rounds too, without a target,
so the daemon's CPU per GB written is always there.

Every Strata case is charged with its daemon's CPU seconds per GB moved (the
holder's for reads and writes; prefill and decode daemons' together for a
handoff: :mod:`benchmarks.daemon_cpu`); the pool daemon's idle CPU is read
after its cases, every client still connected and UCX endpoints open (where
a busy progress thread would show), and the handoff daemons' after theirs.

The handoff case (in every run; ``--no-handoff`` leaves it out, ``--handoff-only`` runs it alone):
a prefill daemon P (peer listener on loopback) holds a 32k-token request's
KV, 16 blocks × 16 MiB; each round opens a handoff on P and asks a decode
daemon D to pull it (PullHandoff: D finds P in the prefix index the daemons
share, a private ``redis-server``, reads the blocks over P's peer listener
into its arena slots, verifies, stores, publishes, and completes the
handoff at P), timed from OpenHandoff to PullHandoff's answer; and the same
handoff pulled by a decode daemon with ``--handoff-transports grpc`` (what
any pull from a prefill node without ``--peer-listen`` takes: gRPC). Between
rounds the decode daemons delete the blocks, untimed. The baseline is the
plain socket moving the same 256 MiB in one request, in the same rounds.
Without ``redis-server`` the handoff rows say so.

The UCX peer transport (:class:`kvstore.peer.ucx.UcxPeerClient`) over the
same daemon's ``--peer-ucx-listen``, in the same rounds, where ucxx can be
imported: UCX over its tcp transport on loopback (the listener API wires up
over TCP), ``UCX_MAX_RNDV_RAILS=2``, blocking progress.

UCX shared memory (:class:`kvstore.peer.ucx_shm.UcxShmPeerClient`) over the
same daemon's ``--peer-ucx-shm``, in the same rounds, where ucxx can be
imported: endpoints from worker addresses, error handling off, on a worker
whose only transports are ``sm,self`` (so it is shared memory or nothing:
sysv/posix for messages, cma for blocks), the address found in the daemon's
own node record.

Mooncake Store over TCP on this machine (:mod:`benchmarks.mooncake_store`:
its master, a holder process with the segment, this process as the client,
its zero-copy calls) against Strata's reads (as above) and writes
(``put``: :meth:`TcpPeerClient.write` of fresh keys into the daemon,
deleted between rounds, untimed), alternating in the same rounds. These
run first, before any UCX endpoint is open: an open one keeps a progress
thread busy on each side, which slows every case on a small machine. They
run where Mooncake is installed; ``--no-mooncake`` leaves them out,
``--mooncake`` insists on them; where they cannot run, a printed line and a
row in the results say why and how to enable them.

Not measured yet:
a daemon fetching from a daemon through its peer tier (this process stands
for the fetching daemon). The index churn rates are
``benchmarks.index_churn``.

``--smoke`` runs every case once with 1 MiB and 4 MiB blocks (a handoff of
two 1 MiB blocks) and writes no results.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import struct
import tempfile
import time
from collections.abc import Iterator

from benchmarks import mooncake_store
from benchmarks.daemon_cpu import DaemonCpu, DaemonMeter
from benchmarks.harness import (
    MiB,
    Benchmark,
    Case,
    ServerUnavailable,
    compare,
    free_port,
    interleave,
    private_redis,
    settle,
    size_label,
    skipped,
    strata_daemon_process,
)
from kvstore.block import BlockMeta, checksum
from kvstore.errors import UnknownNamespace
from kvstore.peer.tcp import TcpPeerClient
from kvstore.peer.ucx_link import ucx_available
from kvstore.remote.base import STORED
from kvstore.transport.base import Deadline

NAME = "kv_pool"
SIZES = [1 * MiB, 4 * MiB, 16 * MiB]
BATCH = 16
# Issue 27's targets, each against the plain socket unless it says otherwise.
TCP_SINGLE_TARGET = 0.8  # peer-tcp, one block per read
TCP_BATCH_TARGET = 0.9  # peer-tcp, 16 blocks per read
UCX_VS_TCP_TARGET = 1.0  # UCX (tag) never slower than peer-tcp ...
UCX_TARGET = 0.9  # ... and >= 0.9x the socket for blocks of at least
UCX_TARGET_MIN_BYTES = 4 * MiB
HANDOFF_TARGET = 0.85  # the handoff over the TCP peer listener (the gRPC fallback has none)
MOONCAKE_SEGMENT = 1 << 30  # the holder's segment: one size's 16 blocks and a put round, 512 MiB at most
HANDOFF = dict(handoff_blocks=16, handoff_block=16 * MiB)  # a 32k-token request's KV
FULL = dict(rounds=9, warmup=2, round_bytes=256 * MiB, sizes=SIZES, idle_s=5.0, **HANDOFF)
QUICK = dict(rounds=5, warmup=1, round_bytes=64 * MiB, sizes=SIZES, idle_s=3.0, **HANDOFF)
# The sizes of issue 27's cases (1 MiB and 4 MiB), a handoff of two blocks.
SMOKE = dict(rounds=5, warmup=0, round_bytes=1 * MiB, sizes=[1 * MiB, 4 * MiB], idle_s=1.0, handoff_blocks=2,
             handoff_block=1 * MiB)
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


def peer_round(client: TcpPeerClient, address: str, keys: list[bytes], buffers: list[memoryview], calls: int,
               meter: DaemonMeter):
    def run() -> tuple[int, float]:
        moved = 0
        meter.start()
        for _ in range(calls):
            got = client.read(address, "bench", keys, lambda i, meta: buffers[i], Deadline.after(60, cancellable=False))
            for g in got:
                if not g.result.is_hit:
                    raise SystemExit(f"a benchmark read was not a hit: {g.result}")
                moved += g.result.meta.size
        return moved, meter.stop(moved)

    return run


def shm_reader(target: str):
    """The daemon's ucx-shm:// address (from its node record) and a shared-memory client; refuses
    to go on unless the client's worker has shared-memory transports only."""
    from kvstore.client.sync import Client
    from kvstore.peer.ucx_shm import UcxShmPeerClient
    from kvstore.peer.ucx_shm_link import SHM_TRANSPORTS, UcxShmRuntime

    with Client(target, use_shm=False) as c:
        for _ in range(100):  # the daemon publishes its node record just after it starts
            found = [t for n in c.nodes() for t in n.transports if t.startswith("ucx-shm://")]
            if found:
                break
            time.sleep(0.1)
        else:
            raise SystemExit("the daemon never advertised a ucx-shm:// address")
    at = found[0]
    transports = UcxShmRuntime.get().transports()
    if not transports <= SHM_TRANSPORTS:
        raise SystemExit(f"the shared-memory worker offers {sorted(transports)}: not shared memory only")
    print(f"UCX shared memory: {at}, worker transports {sorted(transports)}")
    return at, UcxShmPeerClient()


def peer_write_round(client: TcpPeerClient, address: str, control, blocks: list, per_call: int,
                     meter: DaemonMeter):
    """Writes of ``blocks`` (fresh keys), ``per_call`` per request; deleted afterwards, untimed."""
    nbytes = sum(meta.size for _, _, meta in blocks)

    def run() -> tuple[int, float]:
        meter.start()
        for lo in range(0, len(blocks), per_call):
            done = client.write(address, "bench", blocks[lo:lo + per_call], Deadline.after(120))
            if any(result is not STORED for result, _ in done):
                raise SystemExit(f"a benchmark write was not stored: {done}")
        elapsed = meter.stop(nbytes)
        if control.delete("bench", [key for key, _, _ in blocks]) != len(blocks):
            raise SystemExit("a benchmark write's blocks were not all there to delete")
        return nbytes, elapsed

    return run


def run_mooncake(bench: Benchmark, plan: dict, mc, client: TcpPeerClient, address: str, control,
                 plain: socket.socket, daemon: DaemonCpu) -> None:
    """Strata's reads and writes over the TCP peer transport against Mooncake Store's, in the same rounds.

    The plain socket's reads run in them too: the floor both sides' reads are held to (rows without a target).
    """
    for size in plan["sizes"]:
        L = size_label(size)
        sources = [os.urandom(size) for _ in range(BATCH)]
        sources = [(data, BlockMeta(size, checksum(data))) for data in sources]
        keys = [b"mc-%s-%d" % (L.encode(), i) for i in range(BATCH)]
        client.write(address, "bench", [(key, *sources[i]) for i, key in enumerate(keys)], Deadline.after(120))
        buffers = [memoryview(bytearray(size)) for _ in range(BATCH)]
        for view in buffers:
            view[:] = b"\0" * size  # touched: no page faults in the timed part
        calls = {1: max(1, plan["round_bytes"] // size), BATCH: max(1, plan["round_bytes"] // (size * BATCH))}
        fns = mc.rounds(L, size, BATCH, calls[1], calls[BATCH])
        meters: dict[str, DaemonMeter] = {}
        for n in (1, BATCH):
            suffix = f" x{BATCH} batch" if n > 1 else ""
            get, put = f"get {L} peer-tcp{suffix}", f"put {L} peer-tcp{suffix}"
            meters[get], meters[put] = DaemonMeter(daemon, "get"), DaemonMeter(daemon, "put")
            fns[get] = peer_round(client, address, keys[:n], buffers[:n], calls[n], meters[get])
            blocks = [(b"mc-%s-put%d-%d" % (L.encode(), n, i), *sources[i % BATCH]) for i in range(n * calls[n])]
            fns[put] = peer_write_round(client, address, control, blocks, n, meters[put])
            fns[f"plain socket {L}" + (f" x{BATCH}" if n > 1 else "")] = plain_round(plain, buffers[:n], size, calls[n])
        s = interleave(fns, rounds=plan["rounds"], warmup=plan["warmup"])
        for op in ("get", "put"):
            for n in (1, BATCH):
                ours = f"{op} {L} peer-tcp" + (f" x{BATCH} batch" if n > 1 else "")
                bench.add(compare(s, ours, mooncake_store.name(op, L, n), case=f"{ours} vs mooncake",
                                  target_ratio=mooncake_store.TARGET, note=mooncake_store.note(op, n),
                                  daemon_cpu=meters[ours].use()))
        for n in (1, BATCH):
            theirs, floor = mooncake_store.name("get", L, n), f"plain socket {L}" + (f" x{BATCH}" if n > 1 else "")
            bench.add(compare(s, theirs, floor, case=f"{theirs} vs plain",
                              note="Mooncake's reads against the plain socket's, in the same rounds (no target)"))
        control.delete("bench", keys)


def handoff_round(prefill, decode, keys: list[bytes], meter: DaemonMeter):
    def run() -> tuple[int, float]:
        with contextlib.suppress(UnknownNamespace):  # untimed: every round pulls the whole request again
            decode.delete("bench", keys)
        meter.start()
        params, _ = prefill.open_handoff("bench", keys, lease_s=30)
        result = decode.pull_handoff(params, timeout=120)
        elapsed = meter.stop(result.pulled_bytes)
        if result.stored != len(keys) or not result.completed:
            raise SystemExit(f"a benchmark handoff did not complete: {result}")
        return result.pulled_bytes, elapsed

    return run


def wait_for_node(client, node_id: str, timeout_s: float = 30.0) -> None:
    """Until the daemon's prefix index knows ``node_id`` as live: a pull goes only where the index says the
    prefill node is (its record is published just after it starts)."""
    end = time.monotonic() + timeout_s
    while not any(n.node_id == node_id and n.alive for n in client.nodes()):
        if time.monotonic() > end:
            raise SystemExit(f"the decode daemon's index never listed {node_id} as live")
        time.sleep(0.05)


def run_handoff(bench: Benchmark, plan: dict) -> None:
    blocks, block = plan["handoff_blocks"], plan["handoff_block"]
    what = f"{blocks}x{size_label(block)}"
    with contextlib.ExitStack() as stack:
        try:  # the daemons' shared index: a decode daemon pulls only from a prefill node its index knows
            index_url = f"redis://127.0.0.1:{stack.enter_context(private_redis())}/0"
        except ServerUnavailable as err:
            why = f"the handoff needs a prefix index the daemons share: {err}"
            bench.add(skipped(f"handoff {what}", f"plain socket {what}", why, HANDOFF_TARGET))
            bench.add(skipped(f"handoff {what} grpc", f"plain socket {what}", why))
            return
        _handoff_cases(bench, plan, stack, index_url, blocks, block, what)


def _handoff_cases(bench: Benchmark, plan: dict, stack: contextlib.ExitStack, index_url: str, blocks: int,
                   block: int, what: str) -> None:
    from kvstore.client.sync import Client

    peer_port = free_port()
    total = blocks * block
    home = stack.enter_context(tempfile.TemporaryDirectory(prefix="strata-handoff-bench-"))
    common = dict(ram_bytes="768MiB", disk_bytes="0", max_block_bytes="16MiB", auto_create_namespaces=True,
                  index_url=index_url)
    # Each daemon's arena in a folder of its own on a tmpfs, as in production (the harness picks it):
    # an arena on a disk's file system would write every pulled block back to the disk.
    p = stack.enter_context(strata_daemon_process(node_id="prefill", disk_dir=f"{home}/p",
                                                  peer_listen=f"127.0.0.1:{peer_port}", **common))
    d = stack.enter_context(strata_daemon_process(node_id="decode", disk_dir=f"{home}/d", **common))
    # Pulls over gRPC only, as every decode daemon does from a prefill node without --peer-listen.
    g = stack.enter_context(strata_daemon_process(node_id="decode-grpc", disk_dir=f"{home}/g",
                                                  handoff_transports="grpc", **common))
    plain = stack.enter_context(plain_socket(total))
    prefill = stack.enter_context(Client(p.target, use_shm=False, timeout=120))
    decode = stack.enter_context(Client(d.target, use_shm=False, timeout=120))
    decode_grpc = stack.enter_context(Client(g.target, use_shm=False, timeout=120))
    keys = [b"handoff-%d" % i for i in range(blocks)]
    for i, key in enumerate(keys):
        prefill.put("bench", key, os.urandom(block), parent=keys[i - 1] if i else None)
    for client in (decode, decode_grpc):
        wait_for_node(client, "prefill")
    buffers = [memoryview(bytearray(block)) for _ in range(blocks)]
    settle([p.pid, d.pid, g.pid])  # their arenas faulted in before anything is timed
    tcp = DaemonMeter(DaemonCpu([p.pid, d.pid]), "handoff")
    grpc = DaemonMeter(DaemonCpu([p.pid, g.pid]), "handoff")
    fns = {
        f"handoff {what}": handoff_round(prefill, decode, keys, tcp),
        f"handoff {what} grpc": handoff_round(prefill, decode_grpc, keys, grpc),
        f"plain socket {what}": plain_round(plain, buffers, block, 1),
    }
    s = interleave(fns, rounds=plan["rounds"], warmup=plan["warmup"])
    bench.add(compare(s, f"handoff {what}", f"plain socket {what}", target_ratio=HANDOFF_TARGET, daemon_cpu=tcp.use(),
                      note=(
        "OpenHandoff on P to PullHandoff's answer from D: D finds P in the shared index and pulls over its TCP "
        "peer listener into its arena, verifies, stores, publishes itself as holder, completes at P; each daemon "
        f"in its own process; the baseline moves the same {size_label(total)} unframed and unverified in one "
        "request; daemon CPU is P's and D's together")))
    bench.add(compare(s, f"handoff {what} grpc", f"plain socket {what}", daemon_cpu=grpc.use(), note=(
        "no target (issue 27 sets one for the TCP path only): the same handoff pulled by a decode daemon with "
        "--handoff-transports grpc (what every pull from a prefill node without --peer-listen takes): it pulls "
        "through P's KVService Get, each message copied into the arena slot and hashed there; daemon CPU is "
        "P's and this D's together")))
    bench.add_idle(DaemonCpu([p.pid, d.pid, g.pid], "handoff daemons (P, D, D-grpc, summed)").idle(plan["idle_s"]))


def ucx_cases(label: str, size: int) -> list[tuple[str, str, float | None, str]]:
    """(case, baseline, target, what) of the UCX rows at one size; the rounds are named by their first word."""
    rows = []
    for transport, target_vs_socket, target_vs_tcp in (
            ("peer-ucx", UCX_TARGET if size >= UCX_TARGET_MIN_BYTES else None, UCX_VS_TCP_TARGET),
            ("peer-ucx-shm", None, None)):
        for suffix, socket_suffix in (("", ""), (f" x{BATCH} batch", f" x{BATCH}")):
            ours = f"get {label} {transport}{suffix}"
            rows.append((ours, f"plain socket {label}{socket_suffix}", target_vs_socket, transport))
            rows.append((f"{ours} vs peer-tcp", f"get {label} peer-tcp{suffix}", target_vs_tcp, transport))
    return rows


_UCX_HOW = {
    "peer-ucx": "over UCX (tag; tcp transport, loopback): frames as tag messages, each block one tag receive "
                "into the preallocated buffer, verified",
    "peer-ucx-shm": "over UCX shared memory (worker transports sm,self only: sysv/posix messages, each block one "
                    "tag receive pulled by cma into the preallocated buffer), verified; no target (issue 27 sets "
                    "none for shared memory): for context",
}


def mooncake_skipped(sizes: list[int], why: str) -> list[Case]:
    """One row per Mooncake case that cannot run here, each with the reason."""
    rows = []
    for size in sizes:
        L = size_label(size)
        for op in ("get", "put"):
            for n in (1, BATCH):
                ours = f"{op} {L} peer-tcp" + (f" x{BATCH} batch" if n > 1 else "")
                rows.append(mooncake_store.left_out(why, case=f"{ours} vs mooncake",
                                                    baseline=mooncake_store.name(op, L, n)))
    return rows


def run_sizes(bench: Benchmark, plan: dict, client: TcpPeerClient, address: str, control, plain: socket.socket,
              daemon: DaemonCpu, ucx: tuple | None, no_ucx: str) -> None:
    """Per size, in the same rounds: the plain socket, peer-tcp reads and writes, UCX and UCX shared memory
    reads (``ucx``: (client, address, shm client, shm address), or None and ``no_ucx`` says why)."""
    for size in plan["sizes"]:
        L = size_label(size)
        keys = [b"%s-%d" % (L.encode(), i) for i in range(BATCH)]
        sources = []
        for _ in range(BATCH):
            data = os.urandom(size)
            sources.append((data, BlockMeta(size, checksum(data))))
        client.write(address, "bench", [(key, *src) for key, src in zip(keys, sources)], Deadline.after(120))
        buffers = [memoryview(bytearray(size)) for _ in range(BATCH)]
        for view in buffers:
            view[:] = b"\0" * size  # touched: no page faults in the timed part
        calls = {1: max(1, plan["round_bytes"] // size), BATCH: max(1, plan["round_bytes"] // (size * BATCH))}
        meters: dict[str, DaemonMeter] = {}
        fns = {}
        for n in (1, BATCH):
            suffix, socket_suffix = (f" x{BATCH} batch", f" x{BATCH}") if n > 1 else ("", "")
            fns[f"plain socket {L}{socket_suffix}"] = plain_round(plain, buffers[:n], size, calls[n])
            get, put = f"get {L} peer-tcp{suffix}", f"put {L} peer-tcp{suffix}"
            meters[get], meters[put] = DaemonMeter(daemon, "get"), DaemonMeter(daemon, "put")
            fns[get] = peer_round(client, address, keys[:n], buffers[:n], calls[n], meters[get])
            blocks = [(b"%s-put%d-%d" % (L.encode(), n, i), *sources[i % BATCH]) for i in range(n * calls[n])]
            fns[put] = peer_write_round(client, address, control, blocks, n, meters[put])
            if ucx is not None:
                ucx_client, at, shm_client, shm_at = ucx
                for transport, c, where in (("peer-ucx", ucx_client, at), ("peer-ucx-shm", shm_client, shm_at)):
                    name = f"get {L} {transport}{suffix}"
                    meters[name] = DaemonMeter(daemon, "get")
                    fns[name] = peer_round(c, where, keys[:n], buffers[:n], calls[n], meters[name])
        s = interleave(fns, rounds=plan["rounds"], warmup=plan["warmup"])
        bench.add(compare(s, f"get {L} peer-tcp", f"plain socket {L}", target_ratio=TCP_SINGLE_TARGET,
                          daemon_cpu=meters[f"get {L} peer-tcp"].use(), note=(
            "one block per read: request, header, bytes received into a preallocated buffer and verified by the "
            "reader (xxh3-64); the baseline sends the same bytes per request, unframed, unverified")))
        bench.add(compare(s, f"get {L} peer-tcp x{BATCH} batch", f"plain socket {L} x{BATCH}",
                          target_ratio=TCP_BATCH_TARGET, daemon_cpu=meters[f"get {L} peer-tcp x{BATCH} batch"].use(),
                          note=f"{BATCH} blocks per read, one request"))
        for suffix, socket_suffix, per in (("", "", "one block"),
                                           (f" x{BATCH} batch", f" x{BATCH}", f"{BATCH} blocks")):
            put = f"put {L} peer-tcp{suffix}"
            bench.add(compare(s, put, f"plain socket {L}{socket_suffix}", daemon_cpu=meters[put].use(), note=(
                f"no target, for context (and the daemon's CPU per GB written): {per} per write "
                "(TcpPeerClient.write of fresh keys, checksums computed beforehand, verified by the daemon, "
                "deleted untimed); the baseline moves the same bytes the other way, daemon to reader")))
        for case, baseline, target, transport in ucx_cases(L, size):
            ours = case.removesuffix(" vs peer-tcp")
            if ucx is None:
                bench.add(skipped(case, baseline, no_ucx, target))
                continue
            versus = " against peer-tcp in the same rounds" if case.endswith(" vs peer-tcp") else ""
            per = f"{BATCH} blocks per read" if "batch" in ours else "one block per read"
            bench.add(compare(s, ours, baseline, case=case, target_ratio=target, daemon_cpu=meters[ours].use(),
                              note=f"{per} {_UCX_HOW[transport]}{versus}"))


def main(argv: list[str] | None = None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    handoff = "--no-handoff" not in argv
    only = "--handoff-only" in argv
    mooncake = "off" if "--no-mooncake" in argv else "on" if "--mooncake" in argv else "auto"
    flags = ("--handoff", "--no-handoff", "--handoff-only", "--mooncake", "--no-mooncake", "--no-ucx")
    bench = Benchmark(NAME + "_handoff" if only else NAME, __doc__.splitlines()[0],
                      [a for a in argv if a not in flags], daemon_cpu=True)
    plan = bench.plan(FULL, QUICK, SMOKE)
    if only:
        run_handoff(bench, plan)
        bench.finish()
        return 0
    peer_port, ucx_port = free_port(), free_port()
    ucx, no_ucx = (False, "left out by --no-ucx") if "--no-ucx" in argv else ucx_available()
    if not ucx:
        print(f"UCX cases skipped: {no_ucx}")
    extra = dict(peer_ucx_listen=f"127.0.0.1:{ucx_port}", insecure=True, peer_ucx_shm=True) if ucx else {}
    from kvstore.client.sync import Client

    home = tempfile.TemporaryDirectory(prefix="strata-pool-bench-")  # its own state dir: another daemon may run here
    with home, strata_daemon_process(ram_bytes="1GiB", disk_bytes="0", max_block_bytes="16MiB",
                                     auto_create_namespaces=True, peer_listen=f"127.0.0.1:{peer_port}",
                                     disk_dir=home.name, **extra) as process, \
            plain_socket(BATCH * max(plan["sizes"])) as plain, \
            Client(process.target, use_shm=False, timeout=120) as control, \
            mooncake_store.optional_cluster(mooncake, MOONCAKE_SEGMENT) as (mc, mc_why):
        daemon = DaemonCpu([process.pid], "pool daemon")
        address = f"tcp://127.0.0.1:{peer_port}"
        client = TcpPeerClient()
        ucx_clients = None
        if ucx:
            from kvstore.peer.ucx import UcxPeerClient

            ucx_client = UcxPeerClient()
            shm_at, shm_client = shm_reader(process.target)
            ucx_clients = (ucx_client, f"ucx://127.0.0.1:{ucx_port}", shm_client, shm_at)
        settle([process.pid])  # the daemon's arena faulted in before anything is timed
        try:
            if mc is None:
                print(f"Mooncake cases skipped: {mc_why}")
                for row in mooncake_skipped(plan["sizes"], mc_why):
                    bench.add(row)
            else:  # first: an open UCX endpoint keeps both ends' progress threads busy
                run_mooncake(bench, plan, mc, client, address, control, plain, daemon)
            run_sizes(bench, plan, client, address, control, plain, daemon, ucx_clients, no_ucx)
            bench.add_idle(daemon.idle(plan["idle_s"]))  # every client still connected, UCX endpoints open
        finally:
            client.close()
            if ucx_clients is not None:
                ucx_clients[0].close()
                ucx_clients[2].close()
    if handoff:
        run_handoff(bench, plan)
    bench.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
