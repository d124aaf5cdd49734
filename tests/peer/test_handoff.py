"""The prefill/decode handoff across real daemons: separate ``strata serve`` processes, one real Redis index.

A prefill daemon P holds a request's blocks under a handoff lease; a decode
daemon D pulls them over P's TCP peer listener into its own arena, stores
them, is published as their holder and completes the handoff. A decode side
that completes, one that is SIGKILLed mid-pull, one that never comes; the
lease kept alive by heartbeats; ended, unknown and strangers' ids; bytes
damaged in transit. What must hold every time: D stores exactly the bytes P
held or nothing, and after the lease nothing stays pinned on P. No test
asserts a timing; waits are bounded polls.
"""

from __future__ import annotations

import hashlib
import json
import random
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable

import grpc
import pytest

from benchmarks.harness import free_port
from kvstore.api.v1 import handoff_pb2 as hpb
from kvstore.api.v1 import handoff_pb2_grpc
from kvstore.block import TierName
from kvstore.client.sync import Client
from kvstore.errors import CorruptBlock, DeadlineExceeded, HandoffEnded, Overloaded, StrataError, UnknownHandoff
from kvstore.handoff.params import HandoffParams
from tests.support import redis_servers
from tests.support.peer_cluster import FlipProxy, PeerNode
from tests.support.wait import wait_until

pytestmark = pytest.mark.system

NS = "req-kv"
MARKER = b"STRATA-FLIP-HERE"


def value(tag: str, size: int, prefix: bytes = b"") -> bytes:
    return prefix + random.Random(hashlib.blake2b(tag.encode()).digest()).randbytes(size - len(prefix))


def keys_of(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(n)]


@pytest.fixture(scope="module")
def index_url(tmp_path_factory):
    if not redis_servers.available():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = redis_servers.start_standalone(tmp_path_factory.mktemp("handoff-redis"))
    yield server.url
    server.stop()


@pytest.fixture
def nodes(tmp_path, index_url):
    started: list[PeerNode] = []

    def start(name: str, *extra: str, peer_listen: bool = False, via: Callable | None = None,
              via_grpc: Callable | None = None) -> PeerNode:
        """``via(upstream)`` / ``via_grpc(upstream)``: a proxy in front of the node's TCP peer
        listener / gRPC port, which the node advertises in the index instead of its own address:
        a pull goes where the index says, so that is where a test puts what is in between."""
        node = PeerNode(tmp_path, name, index_url, *extra)
        if peer_listen:
            node.peer_port = free_port()
            node.args += ["--peer-listen", f"127.0.0.1:{node.peer_port}"]
            if via is not None:
                node.proxy = via(("127.0.0.1", node.peer_port))
                node.args += ["--peer-advertise", node.proxy.address]
        if via_grpc is not None:
            node.proxy = via_grpc(("127.0.0.1", node.port))
            node.args += ["--advertise-address", node.proxy.address]
        started.append(node)
        return node.start()

    yield start
    for node in started:
        node.kill()


class ClosedPort:
    """An address nobody listens on: connections to it are refused."""

    def __init__(self) -> None:
        with socket.create_server(("127.0.0.1", 0)) as server:
            self.address = f"127.0.0.1:{server.getsockname()[1]}"


def put_chain(client: Client, tag: str, n: int, size: int, prefix: bytes = b"") -> tuple[list[bytes], list[bytes]]:
    keys = keys_of(tag, n)
    values = [value(f"{tag}/{i}", size, prefix) for i in range(n)]
    for i, (k, v) in enumerate(zip(keys, values)):
        client.put(NS, k, v, parent=keys[i - 1] if i else None)
    return keys, values


def holder_names(client: Client, keys: list[bytes]) -> list[set[str]]:
    return [{h.node_id for h in held} for held in client.holders(NS, keys=keys)]


@pytest.mark.parametrize("keep_as_cache", [True, False])
def test_decode_side_pulls_stores_and_completes(nodes, keep_as_cache):
    p, d = nodes("p", peer_listen=True), nodes("d")
    with Client(p.target, use_shm=False) as pc, Client(d.target, use_shm=False) as dc:
        keys, values = put_chain(pc, "done", 8, 1 << 20)
        params, missing = pc.open_handoff(NS, keys, keep_as_cache=keep_as_cache)
        assert missing == []
        assert params.node_id == "p" and params.addresses[0].startswith("tcp://")
        assert params.addresses[-1].startswith("grpc://") and [b.key for b in params.blocks] == keys
        assert pc.stats().open_handoffs == 1 and pc.stats().pinned_blocks == 8
        # What a router passes on: plain JSON.
        routed = json.loads(json.dumps(params.to_dict()))
        assert HandoffParams.from_dict(routed) == params

        result = dc.pull_handoff(routed)
        returned = time.monotonic()
        assert (result.stored, result.present, result.pulled_bytes) == (8, 0, 8 << 20)
        assert result.completed and result.published, result.complete_error
        # D is a holder as soon as the pull returns (it publishes before completing).
        seen = holder_names(dc, keys)
        lag_ms = (time.monotonic() - returned) * 1000
        assert all("d" in h for h in seen), seen
        print(f"decode node a holder in the index {lag_ms:.1f} ms after PullHandoff returned (published before completion)")

        assert dc.exists(NS, keys) == [TierName.HOST] * 8  # in D's RAM, its arena
        for k, v in zip(keys, values):
            assert dc.get(NS, k) == v
        s = pc.stats()
        assert (s.open_handoffs, s.pinned_blocks) == (0, 0)
        if keep_as_cache:
            assert pc.exists(NS, keys) == [TierName.HOST] * 8
        else:
            assert pc.exists(NS, keys) == []
        assert p.metric("strata_handoffs_ended_total", outcome="completed") == 1
        assert p.metric("strata_handoffs_opened_total") == 1
        assert d.metric("strata_handoff_pulled_bytes_total", transport="tcp") == 8 << 20
        assert d.metric("strata_handoff_pulled_bytes_total", transport="grpc") == 0
        assert d.metric("strata_handoff_pulls_total", outcome="ok") == 1

        # A completed handoff's id is refused, naming it.
        with pytest.raises(HandoffEnded, match=f"handoff {params.handoff_id[:8]}.*completed"):
            pc.complete_handoff(NS, params.handoff_id)
        again = dc.pull_handoff(params)  # the blocks are here already: nothing moves, the completion is refused
        assert (again.stored, again.present, again.completed) == (0, 8, False)
        assert "completed" in again.complete_error
        with pytest.raises(HandoffEnded, match="completed"):
            pc.heartbeat_handoff(NS, params.handoff_id)


def test_decode_side_that_never_comes_leaves_nothing_pinned(nodes):
    p = nodes("p", peer_listen=True)
    with Client(p.target, use_shm=False) as pc:
        keys, _ = put_chain(pc, "never", 4, 64 << 10)
        params, _ = pc.open_handoff(NS, keys, lease_s=0.5)
        assert pc.stats().pinned_blocks == 4
        wait_until(lambda: pc.stats().open_handoffs == 0, timeout=30, what="the handoff lease to expire")
        assert pc.stats().pinned_blocks == 0
        assert p.metric("strata_handoffs_ended_total", outcome="expired") == 1
        assert p.metric("strata_handoffs_ended_total", outcome="completed") == 0
        for call in (pc.heartbeat_handoff, pc.complete_handoff):
            with pytest.raises(HandoffEnded, match=f"handoff {params.handoff_id[:8]}.*expired"):
                call(NS, params.handoff_id)
        assert pc.exists(NS, keys) == [TierName.HOST] * 4  # unpinned, still cache: evictable again


def test_heartbeats_extend_the_lease_and_ids_are_checked(nodes):
    p = nodes("p", "--handoff-max-open", "2", peer_listen=True)
    with Client(p.target, use_shm=False, retries=0) as pc:
        keys, _ = put_chain(pc, "beat", 3, 4096)
        params, _ = pc.open_handoff(NS, keys, lease_s=1.0)
        deadlines = [params.lease_deadline_unix_ms]
        end = time.monotonic() + 3.0  # three leases long
        while time.monotonic() < end:
            deadlines.append(pc.heartbeat_handoff(NS, params.handoff_id))
            time.sleep(0.2)
        assert deadlines == sorted(deadlines) and deadlines[-1] > deadlines[0]
        assert pc.stats().open_handoffs == 1 and pc.stats().pinned_blocks == 3

        # Strangers: an id never issued, and a real id presented with another namespace, read the same.
        with pytest.raises(UnknownHandoff, match="never issued"):
            pc.heartbeat_handoff(NS, "x" * 22)
        pc.put("other-ns", b"k" * 16, b"v")
        with pytest.raises(UnknownHandoff, match="never issued"):
            pc.complete_handoff("other-ns", params.handoff_id)

        # Limits: beyond --handoff-max-open, RESOURCE_EXHAUSTED with a retry delay.
        pc.open_handoff(NS, keys[:1], lease_s=30)
        with pytest.raises(Overloaded, match="handoff-max-open") as refused:
            pc.open_handoff(NS, keys[:1], lease_s=30)
        assert refused.value.retry_after_s > 0
        with pytest.raises(StrataError, match="handoff-max-lease-seconds"):
            pc.complete_handoff(NS, params.handoff_id)
            pc.open_handoff(NS, keys, lease_s=3600)

        with pytest.raises(HandoffEnded, match="completed"):
            pc.complete_handoff(NS, params.handoff_id)


def reset(s: socket.socket) -> None:
    """Closes ``s`` with a reset, not a FIN: the other end learns at once that nobody reads any more."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    s.close()


class ThrottleProxy:
    """Forwards TCP to ``upstream``, the replies at about ``rate`` bytes a second: a pull that lasts.

    When either side of a connection goes away, the other is reset (once both directions have
    stopped), as the kernel of a process killed with bytes still coming does: a socket only shut
    down, or closed with a full window, leaves the prefill side's send waiting on a window that
    never opens, until its read lease runs out, instead of failing at once."""

    def __init__(self, upstream: tuple[str, int], rate: int) -> None:
        self.upstream, self.rate = upstream, rate
        self.forwarded = 0
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._server.accept()
                up = socket.create_connection(self.upstream, timeout=10)
                up.settimeout(None)
            except OSError:
                return
            ended = threading.Barrier(2, action=lambda d=down, u=up: (reset(d), reset(u)))
            threading.Thread(target=self._pump, args=(down, up, False, ended), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, True, ended), daemon=True).start()

    def _pump(self, src, dst, slow: bool, ended: threading.Barrier) -> None:
        try:
            while data := src.recv(64 << 10):
                dst.sendall(data)
                if slow:
                    self.forwarded += len(data)
                    time.sleep(len(data) / self.rate)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)  # wakes the other direction's recv or send
                except OSError:
                    pass
            try:
                ended.wait()  # the last of the two closes both sockets
            except threading.BrokenBarrierError:
                pass

    def close(self) -> None:
        self._server.close()


def test_decode_side_killed_mid_pull_leaves_nothing_pinned(nodes):
    """D is SIGKILLed while a pull that outlasts the lease runs: its heartbeats kept the handoff open
    while it lived; after one lease without them P holds nothing pinned."""
    p = nodes("p", peer_listen=True, via=lambda up: ThrottleProxy(up, rate=16 << 20))  # ~4 s for the pull
    d, proxy = nodes("d"), p.proxy
    with Client(p.target, use_shm=False) as pc:
        keys, _ = put_chain(pc, "killed", 16, 4 << 20)  # 64 MiB
        params, _ = pc.open_handoff(NS, keys, lease_s=1.0)
        routed = params.to_dict()
        failed: list[BaseException] = []

        def pull() -> None:
            try:
                with Client(d.target, use_shm=False, retries=0) as dc:
                    dc.pull_handoff(routed, timeout=60)
            except BaseException as err:  # noqa: BLE001 - the daemon is killed under it
                failed.append(err)

        puller = threading.Thread(target=pull)
        puller.start()
        wait_until(lambda: proxy.forwarded > 24 << 20, timeout=60, what="the pull to be well under way")
        # Past the first lease: only D's heartbeats kept the handoff open.
        assert pc.stats().open_handoffs == 1
        d.kill()
        puller.join(30)
        assert failed, "the pull cannot have finished: its daemon was killed"
        wait_until(lambda: pc.stats().open_handoffs == 0, timeout=30, what="the handoff to expire after D died")
        wait_until(lambda: pc.stats().pinned_blocks == 0, timeout=30, what="P's pins to be released")
        assert p.metric("strata_handoffs_ended_total", outcome="expired") == 1
        proxy.close()


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_bytes_damaged_in_transit_are_never_stored(nodes, transport):
    flipper = lambda up: FlipProxy(up, MARKER)  # noqa: E731
    p = nodes("p", peer_listen=transport == "tcp", **({"via": flipper} if transport == "tcp" else {"via_grpc": flipper}))
    d, proxy = nodes("d"), p.proxy
    with Client(p.target, use_shm=False) as pc, Client(d.target, use_shm=False, retries=0) as dc:
        keys, values = put_chain(pc, "flip", 4, 256 << 10, prefix=MARKER)
        params, _ = pc.open_handoff(NS, keys, lease_s=30)
        with pytest.raises(CorruptBlock):
            dc.pull_handoff(params.to_dict())
        assert proxy.flipped >= 1
        proxy.enabled = False  # the path is mended
        assert dc.exists(NS, keys) == []  # nothing of the failed pull was stored
        assert pc.stats().open_handoffs == 1  # not completed: the decode side may try again
        result = dc.pull_handoff(params)
        assert result.stored == 4 and result.completed
        for k, v in zip(keys, values):
            assert dc.get(NS, k) == v


class CutProxy(ThrottleProxy):
    """A ThrottleProxy whose :meth:`cut` takes the listener down: the server socket closes and every
    connection through it is shut, as when the prefill node's TCP peer listener goes away."""

    def __init__(self, upstream: tuple[str, int], rate: int) -> None:
        self.live: list[socket.socket] = []
        super().__init__(upstream, rate)

    def _pump(self, src, dst, slow: bool, ended: threading.Barrier) -> None:
        self.live += [src, dst]
        super()._pump(src, dst, slow, ended)

    def cut(self) -> None:
        self.close()
        for s in list(self.live):
            try:  # a reset, not a close: the sender at P learns at once that nobody reads any more
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass


def pulled(node: PeerNode) -> dict[str, float]:
    return {t: node.metric("strata_handoff_pulled_bytes_total", transport=t) for t in ("tcp", "grpc")}


def test_a_prefill_node_without_a_peer_listener_is_pulled_over_grpc(nodes):
    """P runs without --peer-listen: its params offer gRPC only, the transport both daemons share;
    the blocks still land in D's arena, verified, and no fallback is counted (none was needed)."""
    p, d = nodes("p"), nodes("d")
    with Client(p.target, use_shm=False) as pc, Client(d.target, use_shm=False) as dc:
        keys, values = put_chain(pc, "grpc-only", 6, 1 << 20)
        params, _ = pc.open_handoff(NS, keys)
        assert [a.partition("://")[0] for a in params.addresses] == ["grpc"]
        result = dc.pull_handoff(params.to_dict())
        assert (result.stored, result.pulled_bytes) == (6, 6 << 20) and result.completed and result.published
        assert dc.exists(NS, keys) == [TierName.HOST] * 6  # in D's RAM: its arena slots
        for k, v in zip(keys, values):
            assert dc.get(NS, k) == v
        assert pulled(d) == {"tcp": 0, "grpc": 6 << 20}
        assert d.metric("strata_handoff_pull_fallbacks_total", transport="tcp", reason="unavailable") == 0
        assert p.metric("strata_handoffs_ended_total", outcome="completed") == 1
        assert pc.stats().pinned_blocks == 0


def test_a_tcp_listener_that_is_down_falls_back_to_grpc_and_is_counted(nodes):
    """P advertises a TCP listener nobody answers on (as when it went down): D falls back to gRPC."""
    p = nodes("p", peer_listen=True, via=lambda up: ClosedPort())
    d = nodes("d")
    with Client(p.target, use_shm=False) as pc, Client(d.target, use_shm=False) as dc:
        keys, values = put_chain(pc, "tcp-down", 4, 512 << 10)
        params, _ = pc.open_handoff(NS, keys)
        assert params.addresses[0] == f"tcp://{p.proxy.address}"
        result = dc.pull_handoff(params.to_dict())
        assert (result.stored, result.pulled_bytes) == (4, 2 << 20) and result.completed
        for k, v in zip(keys, values):
            assert dc.get(NS, k) == v
        assert pulled(d) == {"tcp": 0, "grpc": 2 << 20}
        assert d.metric("strata_handoff_pull_fallbacks_total", transport="tcp", reason="unavailable") == 1


def test_a_tcp_listener_that_goes_down_mid_pull_falls_back_for_the_rest(nodes):
    """The TCP path breaks off while the bytes flow: the blocks verified over it stay, the rest come
    over gRPC, and what D stores is exactly what P held."""
    p = nodes("p", peer_listen=True, via=lambda up: CutProxy(up, rate=16 << 20))  # ~2 s over TCP
    d, proxy = nodes("d"), p.proxy
    with Client(p.target, use_shm=False) as pc, Client(d.target, use_shm=False, retries=0) as dc:
        keys, values = put_chain(pc, "tcp-cut", 16, 2 << 20)  # 32 MiB
        params, _ = pc.open_handoff(NS, keys, lease_s=30)
        routed = params.to_dict()
        outcome: list = []
        puller = threading.Thread(target=lambda: outcome.append(dc.pull_handoff(routed, timeout=60)))
        puller.start()
        wait_until(lambda: proxy.forwarded > 8 << 20, timeout=60, what="the pull to be under way over TCP")
        proxy.cut()
        puller.join(60)
        [result] = outcome
        assert (result.stored, result.pulled_bytes) == (16, 32 << 20) and result.completed
        for k, v in zip(keys, values):
            assert dc.get(NS, k) == v
        by = pulled(d)
        assert by["tcp"] > 0 and by["grpc"] > 0 and by["tcp"] + by["grpc"] == 32 << 20, by
        assert d.metric("strata_handoff_pull_fallbacks_total", transport="tcp", reason="unavailable") == 1
        # The handoff's lease ended; the read lease of the block cut mid-send ends as P's sender sees the reset.
        wait_until(lambda: pc.stats().pinned_blocks == 0, timeout=10, what="P's pins to be released")


class Listener:
    """A port a hostile caller controls: counts the connections made to it and what they sent."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        self.connections = 0
        self.received = b""
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            self.connections += 1
            conn.settimeout(2)
            try:
                self.received += conn.recv(1 << 16)
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self._server.close()


def hostile(params, address: str, **changes) -> dict:
    """The params as a caller that rewrote where the prefill side is would send them."""
    d = params.to_dict()
    d["addresses"] = [f"tcp://{address}", f"grpc://{address}"]
    d["control_address"] = address
    d.update(changes)
    return d


def test_a_pull_never_connects_to_an_address_the_caller_names(nodes):
    """The decode daemon authenticates its pulls with the node's peer token: params that point it at
    a port the caller controls must not make it connect there (the token would be the caller's, and
    every tenant's blocks with it). It pulls from where the index says the prefill node is."""
    p, d = nodes("p", peer_listen=True), nodes("d")
    trap = Listener()
    try:
        with Client(p.target, use_shm=False) as pc, Client(d.target, use_shm=False, retries=0) as dc:
            keys, values = put_chain(pc, "trap", 3, 64 << 10)
            params, _ = pc.open_handoff(NS, keys)
            result = dc.pull_handoff(hostile(params, trap.address))
            assert result.stored == 3 and result.completed  # from P, as its index record says
            for k, v in zip(keys, values):
                assert dc.get(NS, k) == v
            assert (trap.connections, trap.received) == (0, b"")
    finally:
        trap.close()


def test_a_pull_naming_a_node_the_index_does_not_know_is_refused_before_any_connection(nodes):
    """No node, no connection: the same refusal whether the named port is open or closed, so
    PullHandoff scans no ports either."""
    p, d = nodes("p", peer_listen=True), nodes("d")
    trap, closed = Listener(), ClosedPort()
    try:
        with Client(p.target, use_shm=False) as pc, Client(d.target, use_shm=False, retries=0) as dc:
            keys, _ = put_chain(pc, "ghost", 2, 4096)
            params, _ = pc.open_handoff(NS, keys)
            answers = []
            for address in (trap.address, closed.address):
                with pytest.raises(StrataError) as refused:
                    dc.pull_handoff(hostile(params, address, node_id="ghost"))
                answers.append((type(refused.value), str(refused.value).replace(address, "ADDR")))
            assert answers[0] == answers[1], answers
            assert "does not know" in answers[0][1] and "--index-url" in answers[0][1]
            with pytest.raises(HandoffEnded, match="another epoch"):  # P's own id, at an epoch it is not at
                dc.pull_handoff(hostile(params, trap.address, epoch=params.epoch + 1))
            assert (trap.connections, trap.received) == (0, b"")
            assert dc.exists(NS, keys) == []
            assert pc.stats().open_handoffs == 1  # untouched: the real decode side may still pull it
    finally:
        trap.close()


def test_a_pull_from_a_stopped_prefill_node_ends_at_the_daemons_cap_not_the_callers_timeout(nodes):
    """A caller asks for an hour; the decode daemon holds a pull slot no longer than
    --handoff-pull-seconds, whatever the prefill side does (here it is SIGSTOPped: its sockets accept
    and nothing answers). Its heartbeats and the completion are bounded by the same deadline."""
    p = nodes("p", peer_listen=True)
    d = nodes("d", "--handoff-pull-seconds", "2", "--handoff-max-pulls", "1")
    with Client(p.target, use_shm=False) as pc, Client(d.target, use_shm=False, retries=0) as dc:
        keys, _ = put_chain(pc, "stopped", 2, 64 << 10)
        params, _ = pc.open_handoff(NS, keys, lease_s=60)
        p.proc.send_signal(signal.SIGSTOP)
        try:
            outcome: list = []

            def pull() -> None:
                try:
                    dc.pull_handoff(params, timeout=3600)
                except StrataError as err:
                    outcome.append(err)

            puller = threading.Thread(target=pull, daemon=True)
            puller.start()
            puller.join(120)  # the cap is 2 s; an hour-long wait would outlast this by far
            assert not puller.is_alive(), "the pull kept its slot past --handoff-pull-seconds"
            [err] = outcome
            assert isinstance(err, (DeadlineExceeded, HandoffEnded)), err
            assert dc.exists(NS, keys) == []
        finally:
            p.proc.send_signal(signal.SIGCONT)


def test_a_cancelled_pull_gives_its_slot_back(nodes):
    """The caller of a PullHandoff goes away (its RPC is cancelled): the pull ends with it and the
    decode daemon's only pull slot is free for the next caller, long before the pull's deadline."""
    p = nodes("p", peer_listen=True)
    d = nodes("d", "--handoff-max-pulls", "1")  # the default cap: 120 s
    with Client(p.target, use_shm=False) as pc:
        keys, _ = put_chain(pc, "cancelled", 2, 64 << 10)
        params, _ = pc.open_handoff(NS, keys, lease_s=60)
        p.proc.send_signal(signal.SIGSTOP)
        try:
            with grpc.insecure_channel(d.target) as channel:
                stub = handoff_pb2_grpc.HandoffServiceStub(channel)
                request = hpb.PullHandoffRequest(namespace=NS, params=params.to_proto(), timeout_ms=3_600_000)
                call = stub.PullHandoff.future(request, timeout=3600)
                with Client(d.target, use_shm=False, retries=0) as dc:
                    def busy() -> bool:  # a second pull, refused while the first holds the slot
                        try:
                            dc.pull_handoff(params, timeout=0.5)
                        except Overloaded:
                            return True
                        except StrataError:
                            return False
                        return False
                    # The first pull holds the only slot (a probe sent before it got there would
                    # take the slot itself and make the first one be refused).
                    wait_until(lambda: d.metric("strata_handoff_pulls_running") == 1, timeout=30,
                               what="the first pull to run")
                    assert busy(), "a second pull got a slot while the first held the only one"
                    call.cancel()

                    def free() -> bool:
                        try:
                            dc.pull_handoff(params, timeout=0.5)
                        except Overloaded:
                            return False
                        except StrataError:  # the slot was free: this pull ran (and found P stopped)
                            return True
                        return True
                    wait_until(free, timeout=30, what="the cancelled pull's slot to be given back")
        finally:
            p.proc.send_signal(signal.SIGCONT)


def test_one_caller_cannot_take_every_pull_slot(nodes):
    """A caller whose pull hangs (its prefill node stopped) holds its share of the decode daemon's
    pull slots, and is refused beyond it by name; another caller's pull still gets a slot."""
    p = nodes("p", peer_listen=True)
    d = nodes("d", "--handoff-max-pulls", "4", "--handoff-max-pulls-per-identity", "1")
    with Client(p.target, use_shm=False) as pc:
        keys, _ = put_chain(pc, "share", 2, 64 << 10)
        params, _ = pc.open_handoff(NS, keys, lease_s=60)
    p.proc.send_signal(signal.SIGSTOP)
    try:
        with Client(d.target, use_shm=False, retries=0) as greedy:
            checked = threading.Event()

            def hold() -> None:  # pulls that hang on P, one after another, until the checks are done;
                while not checked.is_set():  # the probe below may hold the share a moment
                    try:
                        greedy.pull_handoff(params, timeout=2)
                    except Overloaded:
                        time.sleep(0.05)
                    except StrataError:  # this pull's deadline passed on the stopped P: hang again
                        pass

            hanging = threading.Thread(target=hold, daemon=True)
            hanging.start()

            def refused_by_share() -> bool:
                try:
                    greedy.pull_handoff(params, timeout=0.5)
                except Overloaded as err:
                    assert "--handoff-max-pulls-per-identity" in str(err)
                    return True
                except StrataError:
                    return False
                return False
            wait_until(refused_by_share, timeout=15, what="the greedy caller's second pull to be refused by its share")
            # Another caller: a connection of its own (unauthenticated callers are told apart by it).
            with grpc.insecure_channel(d.target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
                stub = handoff_pb2_grpc.HandoffServiceStub(channel)
                with pytest.raises(grpc.RpcError) as theirs:  # a slot, and a pull that finds P stopped
                    stub.PullHandoff(hpb.PullHandoffRequest(namespace=NS, params=params.to_proto(), timeout_ms=500),
                                     timeout=30)
            assert theirs.value.code() != grpc.StatusCode.RESOURCE_EXHAUSTED, theirs.value.details()
            checked.set()
            hanging.join(60)
    finally:
        p.proc.send_signal(signal.SIGCONT)
