"""A hostile client of the peer listeners (--peer-listen; the UCX one's Hello buffer): regressions of what a review found.

Each test starts a real daemon with small limits, speaks raw frames
(:mod:`kvstore.peer.wire`) over real sockets, and waits on outcomes: the
server closing a connection, a real peer's Hello answered while a flood is
open, the daemon's own count of its frame buffers. Each fails on the code
before its fix: a Hello's time limit restarted with every byte, so a byte
every few seconds kept a connection (and its slot) for ever, and so did a
frame of an authenticated peer; connections waiting for their Hello could
take every slot; a frame's header was given a buffer of the length it
claimed before any Hello was checked.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time
from contextlib import ExitStack

import pytest

from kvstore.block import checksum
from kvstore.peer import wire
from kvstore.peer.hello_gate import HelloGate
from kvstore.peer.tcp import TcpPeerClient
from kvstore.peer.ucx_link import UcxLink, UcxRuntime, ucx_available
from kvstore.remote.base import ReadStatus
from kvstore.transport import Deadline
from tests.support.peer_listener import BIG, holds_nothing, put, raw_hello
from tests.support.store_blocks import MiB
from tests.support.wait import wait_until
# trickle gives up after TRICKLE_BYTES (20 s of it): a server that never closes fails the test.
TRICKLE_S = 0.05
TRICKLE_BYTES = 400


def hello_frame(token_chars: int = 2000) -> bytes:
    """A Hello long enough to trickle for longer than any test waits (its token is no one's)."""
    return wire.encode([wire.HELLO, 1, [wire.PROTOCOL_VERSION, "t" * token_chars]])


def server_spoke(sock: socket.socket) -> bool:
    """Whether the server has answered or closed (the socket is readable)."""
    return bool(select.select([sock], [], [], 0)[0])


def trickle(sock: socket.socket, data: bytes) -> int | None:
    """Send ``data`` a byte at a time until the server answers or closes; how many bytes went
    (None: all of them, or TRICKLE_BYTES, and the server still listening)."""
    for i in range(min(len(data), TRICKLE_BYTES)):
        if server_spoke(sock):
            return i
        try:
            sock.sendall(data[i : i + 1])
        except (BrokenPipeError, ConnectionResetError):
            return i
        time.sleep(TRICKLE_S)
    return None


def closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(10)
    try:
        while sock.recv(65536):
            pass  # an error frame first, perhaps
    except ConnectionResetError:
        pass
    return True


def refusal(sock: socket.socket) -> list:
    """The error frame a refused connection gets (request id 0), then the server's close."""
    sock.settimeout(10)
    link = wire.Wire(sock)
    (rid, status, result), _ = link.read_meta()
    assert (rid, status) == (0, wire.ERROR), result
    with pytest.raises((EOFError, ConnectionResetError)):
        link.read_meta()
    return result


# ---- a Hello within a deadline from the accept ---------------------------------------


def test_a_hello_trickled_a_byte_at_a_time_is_cut_off_at_its_deadline(make_daemon):
    """Each byte came well within the limit, so a limit that restarts with every byte (an idle
    timeout, as before) never fired: the connection stayed open as long as bytes came."""
    d = make_daemon(peer_listen="127.0.0.1:0", peer_hello_seconds=0.5)
    sock = socket.create_connection(("127.0.0.1", d.peer_server.port), timeout=10)
    try:
        sent = trickle(sock, hello_frame())
        assert sent is not None, "the server still waited for the Hello after 20 s of it"
        assert closed_by_server(sock)
        wait_until(lambda: d.peer_server.connections == 0, what="the connection to leave the listener")
    finally:
        sock.close()


def test_connections_waiting_for_their_hello_cannot_keep_a_real_peer_out(make_daemon):
    """Twelve connections from six addresses, each trickling its Hello, against a listener of
    eight: they hold at most half of it (a quarter from one address), the oldest closed with
    Overloaded as newer ones come, and a real peer's Hello is answered while they go on."""
    d = make_daemon(peer_listen="127.0.0.1:0", peer_max_connections=8, peer_hello_seconds=600)
    put(d, "m", {b"x": b"v"})
    wait_until(lambda: d.peer_server.connections == 0, what="the writer's connection to end")
    port, frame = d.peer_server.port, hello_frame()
    flood = [socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(f"127.0.0.{2 + i // 2}", 0))
             for i in range(12)]
    stop = threading.Event()

    def keep_trickling():  # a byte every 0.5 s each: an idle timeout of seconds never fires
        at = 0
        while not stop.wait(0.5):
            at += 1
            for sock in flood:
                try:
                    if not server_spoke(sock) and at < len(frame) - 1:
                        sock.sendall(frame[at - 1 : at])
                except OSError:
                    pass

    trickler = threading.Thread(target=keep_trickling, daemon=True)
    trickler.start()
    client = TcpPeerClient()
    try:
        # Every flood connection accounted for (answered and gone, or still served), at most half the listener.
        wait_until(lambda: sum(map(server_spoke, flood)) + d.peer_server.connections == len(flood)
                   and d.peer_server.connections <= 4, what="the waiting connections to hold half the listener")
        assert d.peer_server.waiting_for_hello <= 4
        [got] = client.read(d.peer_addresses()["tcp"], "m", [b"x"], None, Deadline.after(10))
        assert got.result.status is ReadStatus.SKIPPED  # found, bytes not asked for
        still_waiting = [s for s in flood if not server_spoke(s)]
        assert still_waiting, "the flood had ended: the real peer proved nothing"
        for sock in flood:
            if sock not in still_waiting:
                name, message, retry_after_s = refusal(sock)
                assert name == "Overloaded" and retry_after_s > 0, message
    finally:
        stop.set()
        trickler.join(10)
        client.close()
        for sock in flood:
            sock.close()


def _hello_from(port: int, source: str) -> socket.socket:
    """A peer connection from ``source`` (an address of the loopback net) that sent its Hello."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    wire.send(sock, wire.encode([wire.HELLO, 1, [wire.PROTOCOL_VERSION, ""]]))
    return sock


def _taken(sock: socket.socket) -> socket.socket:
    (rid, status, result), _ = wire.Wire(sock).read_meta()
    assert (rid, status) == (1, wire.OK), result
    return sock


def test_one_peer_node_holds_at_most_its_share_of_the_connections_and_another_node_still_gets_in(make_daemon):
    """A node's pool (or a stolen token used from one host) after its Hellos: half the listener, not all
    of it. Each Hello is answered before the next connection opens (the Hello gate is not what is tested)."""
    d = make_daemon(peer_listen="127.0.0.1:0", peer_max_connections=4)  # a share of 2 per node
    port = d.peer_server.port
    with ExitStack() as stack:
        ours = [_taken(stack.enter_context(_hello_from(port, "127.0.0.2"))) for _ in range(2)]
        third = stack.enter_context(_hello_from(port, "127.0.0.2"))
        name, message, retry_after_s = refusal(third)
        assert name == "Overloaded" and retry_after_s > 0, message
        assert "share of this daemon's limit is 2" in message and "--peer-max-connections-per-node" in message
        _taken(stack.enter_context(_hello_from(port, "127.0.0.3")))  # another node: served
        ours[0].close()
        wait_until(lambda: d.peer_server.connections == 2, what="the closed connection to leave the share")
        _taken(stack.enter_context(_hello_from(port, "127.0.0.2")))


def test_one_peer_node_holds_at_most_its_share_of_the_bytes_in_flight(make_daemon):
    """Two reads from one node that stop reading mid-block hold its share of the peer budget (half): its
    next read is refused by name, while another node's read of the same block is served."""
    d = make_daemon(**{**BIG, "max_block_bytes": "8MiB", "peer_in_flight_bytes": "32MiB",
                       "peer_connection_in_flight_bytes": "8MiB"})
    data = os.urandom(8 * MiB)
    put(d, "m", {b"big": data})
    wait_until(lambda: d.peer_server.in_flight_bytes == 0, what="the put's bytes to leave the budget")
    port = d.peer_server.port
    read = wire.encode([wire.READ, 7, ["m", [b"big"], 10_000, True]])
    with ExitStack() as stack:
        for _ in range(2):  # each asks for the block and reads nothing of it: its send blocks, its bytes held
            sock = _taken(stack.enter_context(_hello_from(port, "127.0.0.2")))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(read)
        wait_until(lambda: d.peer_server.in_flight_bytes == 16 * MiB, what="the stalled reads to hold the share")
        third = _taken(stack.enter_context(_hello_from(port, "127.0.0.2")))
        third.sendall(read)
        (rid, status, result), _ = wire.Wire(third).read_meta()
        assert (rid, status, result[0]) == (7, wire.ERROR, "Overloaded"), result
        assert "--peer-in-flight-bytes-per-node" in result[1] and result[2] > 0
        other = _taken(stack.enter_context(_hello_from(port, "127.0.0.3")))
        other.sendall(read)
        link = wire.Wire(other)
        (rid, status, head), size = link.read_meta()
        assert (rid, status, size) == (7, wire.BLOCK, len(data))
        got = bytearray(size)
        link.read_into(memoryview(got))
        assert got == data


def test_the_hello_gate_closes_the_oldest_of_the_newcomers_address_first_then_the_oldest_of_all():
    gate, woken = HelloGate(limit=3, per_host=2), []
    with ExitStack() as held:
        tickets = {}
        for name, host in [("a1", "a"), ("a2", "a"), ("b1", "b"), ("a3", "a"), ("c1", "c"), ("u1", None)]:
            tickets[name] = held.enter_context(gate.waiting(host, lambda name=name: woken.append(name)))
        # a3: address a was full, so a1 went; c1 and u1: the gate was full, so the oldest (a2, b1) went.
        assert woken == ["a1", "a2", "b1"] and len(gate) == 3
        assert [n for n, t in tickets.items() if t.closed] == woken
    assert len(gate) == 0
    with gate.waiting("a", lambda: woken.append("again")) as ticket:
        pass
    assert not ticket.closed and woken[-1] == "b1"  # room again once the others left


# ---- before the Hello, nothing but a small Hello -------------------------------------


@pytest.mark.parametrize("head, says", [
    (struct.pack("<II", wire.MAX_META_BYTES, 0), "over the limit"),  # a control frame as big as any allowed later
    (struct.pack("<II", wire.MAX_HELLO_BYTES + 1, 0), "over the limit"),
    (wire.encode([wire.HELLO, 1, [wire.PROTOCOL_VERSION, ""]], 8 * MiB), "payload"),  # a Hello never carries one
    (wire.encode([wire.READ, 1, ["m", [b"x"], 0, True]]), "must be a Hello"),
], ids=["8MiB-control-part", "control-part-over-the-hello-limit", "hello-with-payload", "read-before-hello"])
def test_before_its_hello_a_connection_may_send_only_a_small_hello(make_daemon, head, says):
    """Refused from the header, at once: before, a header claiming 8 MiB got an 8 MiB buffer
    and the daemon waited for the bytes (64 such connections: 218 MiB of it, and 478 MiB when
    they sent them), and went away silently at the Hello's time limit."""
    d = make_daemon(peer_listen="127.0.0.1:0", peer_hello_seconds=600)
    sock = socket.create_connection(("127.0.0.1", d.peer_server.port), timeout=10)
    try:
        sock.sendall(head + b"\x00" * 1024)
        name, message, _ = refusal(sock)
        assert name == "InvalidArgument" and says in message, message
    finally:
        sock.close()


def test_unauthenticated_frame_headers_cost_the_daemon_no_buffer_of_their_length(make_daemon):
    """Thirty-two connections (from one address: a listener of 128 lets 32 wait) each claim the largest
    control part; the daemon's own count of its
    frame buffers never goes past what it gives any connection (64 KiB), while before each was
    given the 8 MiB its header claimed."""
    d = make_daemon(peer_listen="127.0.0.1:0", peer_max_connections=128, peer_hello_seconds=600)
    server = d.peer_server
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], server.buffered_bytes)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(32)]
    try:
        for sock in socks:
            sock.sendall(struct.pack("<II", wire.MAX_META_BYTES, 0) + b"\x00" * 4096)
        for sock in socks:
            name, message, _ = refusal(sock)
            assert name == "InvalidArgument" and "over the limit" in message
        wait_until(lambda: server.connections == 0, what="every refused connection to end")
    finally:
        done.set()
        sampler.join(10)
        for sock in socks:
            sock.close()
    assert peak[0] <= 32 * (64 << 10), peak[0]


UCX, NO_UCX = ucx_available()


@pytest.mark.skipif(not UCX, reason=NO_UCX)
def test_a_ucx_connection_that_has_not_said_hello_gets_a_hello_sized_buffer(make_daemon):
    """The UCX listener took a head buffer of the largest control part (8 MiB) for every endpoint
    the moment it connected; now one of a Hello's size until the Hello is done."""
    d = make_daemon(ram_bytes="64MiB", disk_bytes="0", auto_create_namespaces=True, insecure=True,
                    peer_ucx_listen="127.0.0.1:0", peer_hello_seconds=600)
    server, runtime = d.ucx_server, UcxRuntime.get()
    links = [UcxLink(runtime, runtime.call(runtime.context.create_endpoint(
        "127.0.0.1", server.port, endpoint_error_handling=True, connect_timeout=10), 11)) for _ in range(8)]
    hello_head = wire.HEADER.size + wire.MAX_HELLO_BYTES
    try:
        wait_until(lambda: server.waiting_for_hello == 8 and server.buffered_bytes == 8 * hello_head,
                   what="eight endpoints waiting for their Hello, each with a Hello-sized head buffer")
        links[0].settimeout(10)
        links[0].sendall(struct.pack("<II", wire.MAX_META_BYTES, 0))  # a head claiming the largest control part
        (rid, status, result), _ = links[0].read_meta()
        assert (rid, status, result[0]) == (0, wire.ERROR, "InvalidArgument") and "over the limit" in result[1]
        links[1].settimeout(10)
        links[1].sendall(wire.encode([wire.HELLO, 1, [wire.PROTOCOL_VERSION, ""]]))
        (rid, status, _), _ = links[1].read_meta()
        assert (rid, status) == (1, wire.OK)
        wait_until(lambda: server.waiting_for_hello == 6, what="the refused and the greeted endpoints to leave the gate")
    finally:
        for link in links:
            link.close()


# ---- after the Hello, a frame begun must end -----------------------------------------


def test_an_authenticated_peer_trickling_a_request_is_closed(make_daemon):
    """A byte every 50 ms never lets a 0.5 s idle limit fire; the frame's own limit does."""
    d = make_daemon(**{**BIG, "peer_idle_seconds": 0.5})
    sock = raw_hello(d.peer_server.port)
    try:
        request = wire.encode([wire.READ, 2, ["m", [b"k%04d" % i for i in range(400)], 0, True]])
        sent = trickle(sock, request)
        assert sent is not None, "the server still waited for the frame after 20 s of it"
        assert closed_by_server(sock)
        wait_until(lambda: d.peer_server.connections == 0, what="the connection to leave the listener")
    finally:
        sock.close()


def test_a_write_whose_data_trickles_is_closed_and_its_slots_given_back(make_daemon):
    d = make_daemon(**{**BIG, "peer_idle_seconds": 0.5})
    sock = raw_hello(d.peer_server.port)
    link = wire.Wire(sock)
    size = MiB
    try:
        wire.send(sock, wire.encode([wire.PUT, 2, ["m", 0, [[b"slow", size, checksum(b"z" * size), None, "L"]]]]))
        (rid, status, present), _ = link.read_meta()
        assert (rid, status, present) == (2, wire.OK, [False])
        assert d.store.stats().open_slots == 1
        sock.sendall(wire.encode([wire.DATA, 2, []], size))
        sent = trickle(sock, b"z" * size)
        assert sent is not None, "the server still took the block's bytes after 20 s of them"
        assert closed_by_server(sock)
        wait_until(lambda: holds_nothing(d), what="the write's slot to be given back")
    finally:
        sock.close()
