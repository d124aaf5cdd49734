"""The node daemon: builds the tiers and the store from settings and serves them.

Serves ``strata.kv.v1.KVService``, ``grpc.health.v1.Health`` and server
reflection on one gRPC server (TCP, and a Unix socket when configured), and
Prometheus metrics over HTTP. Authentication and protected mode are
:mod:`kvstore.auth`'s; SIGHUP reloads the auth policy file. SIGTERM or SIGINT drains it: health turns
NOT_SERVING, in-flight RPCs get ``grace_seconds``, RAM-only blocks are
copied to disk, then the store closes. Each arena and its table of committed
blocks stay in the shared-memory directory (``[tiers.ram] keep_on_exit``),
so the next start, after an upgrade or a crash, re-adopts the RAM blocks.

The listeners served next to the gRPC port (same-host sockets, the peer data
plane over TCP, UCX and UCX shared memory), protected mode and the TLS
credentials are :mod:`kvstore.server.endpoints`'s, with :class:`DaemonError`.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import sys
import threading
import time
from concurrent import futures
from dataclasses import replace
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import disable_created_metrics, start_http_server

from kvstore.api.v1 import kv_pb2, kv_pb2_grpc
from kvstore.api.v1 import index_pb2, index_pb2_grpc
from kvstore.api.v1 import handoff_pb2, handoff_pb2_grpc
from kvstore.auth import Authority
from kvstore.auth.exposure import split_host
from kvstore.auth.interceptor import AuthInterceptor
from kvstore.block import TierName
from kvstore.replication.replicator import Replicator, open_replicator
from kvstore.config import Settings
from kvstore.index import open_index
from kvstore.index.agent import IndexAgent
from kvstore.index.scoring import ScoringPolicy
from kvstore.server.index_service import IndexServicer
from kvstore.server.handoff_service import HandoffServicer
from kvstore.metrics import StoreMetrics
from kvstore.node import NodeIdentity
from kvstore.peer.served import ServedBytes
from kvstore.peer.server import PeerServer
from kvstore.server.admission import AdmissionInterceptor
from kvstore.server import endpoints
from kvstore.wire.budget import ByteBudget
from kvstore.server.endpoints import DaemonError
from kvstore.transport.samehost.server import SameHostServer
from kvstore.server.service import KVServicer
from kvstore.server.stores import open_stores
from kvstore.server.calls import CallLimiter
from kvstore.server.watchdog import StreamWatchdog
from kvstore.events import EventBus
from kvstore.store.group import StoreGroup

log = logging.getLogger(__name__)

# The *_created series double every counter's output and carry nothing an
# operator graphs.
disable_created_metrics()

# What Strata's clients accept (kvstore.transport.grpc.blocks.CHANNEL_OPTIONS): a batch of
# max_batch_blocks keys with their parents and layouts, or a List page, fits with room to spare.
MAX_REPLY_BYTES = 64 << 20

SERVICE_NAME = kv_pb2.DESCRIPTOR.services_by_name["KVService"].full_name
INDEX_SERVICE_NAME = index_pb2.DESCRIPTOR.services_by_name["IndexService"].full_name
HANDOFF_SERVICE_NAME = handoff_pb2.DESCRIPTOR.services_by_name["HandoffService"].full_name
TIER_HEALTH_PREFIX = "strata.tier."  # + a tier's label: one health service per tier
TIER_CHECK_SECONDS = 1.0


class Daemon:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = StoreMetrics()
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.authority = None  # the auth policy, from the first step of a start
        self._lock_fd: int | None = None
        self._server: grpc.Server | None = None
        self._same_host: SameHostServer | None = None  # the default arena's
        self._same_hosts: dict[str, SameHostServer] = {}  # every arena's, by arena name
        self.peer_server: PeerServer | None = None  # the peer data plane (--peer-listen)
        self.ucx_server: PeerServer | None = None  # the same over UCX (--peer-ucx-listen)
        self.ucx_shm_server: PeerServer | None = None  # the same over UCX shared memory, this host (--peer-ucx-shm)
        self._watchdog: StreamWatchdog | None = None
        self._metrics_server = None
        self._health = health.HealthServicer()
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self._stopping = False
        self._watch_stop = threading.Event()
        self.store: StoreGroup | None = None  # one store per arena, called as one store
        self.index_agent: IndexAgent | None = None
        self.events = EventBus()  # the store's events: the index agent and metrics subscribe
        self.kv_events = None  # KVEventSubscriber, when engines are configured
        self.authority: Authority | None = None
        self.advertised = ""  # host:port peers reach this daemon at (its node record)
        self.peer_metrics = None  # PeerMetrics, with a peer tier in the chain
        self.handoffs = None  # HandoffTable: the prefill side's open handoffs
        self._handoff_peers: dict = {}  # the blocking peer clients the decode side pulls with, by scheme
        self.replicator: Replicator | None = None  # with [replication] namespaces, or pins with replicas
        self.served: ServedBytes | None = None  # block bytes served to peers, by transport

    def start(self) -> Daemon:
        """Build and serve; on any failure, give back what was taken (lock, arena, ports)."""
        try:
            return self._start()
        except BaseException:
            self._stopping = True
            if self._server is not None:
                self._server.stop(0)
            if self._metrics_server is not None:
                self._metrics_server.shutdown()
            for same_host in self._same_hosts.values():
                same_host.stop()
            if self.peer_server is not None:
                self.peer_server.stop()
            self._stop_handoffs()
            if self.ucx_server is not None:
                self.ucx_server.stop()
            if self.ucx_shm_server is not None:
                self.ucx_shm_server.stop()
            if self._watchdog is not None:
                self._watchdog.stop()
            if self.replicator is not None:
                self.replicator.stop(1.0)
            if self.index_agent is not None and self.store is not None:
                self.index_agent.stop(1.0)
            if self.store is not None:
                self.store.close()
            self.events.close(1.0)
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
            raise

    def _start(self) -> Daemon:
        """The steps of a start, in order: each uses what those before it built, and
        :meth:`start` gives back what they took when one fails."""
        self._claim_node()
        index = open_index(self.settings.index.url)
        self._open_index_agent(index)
        self._open_store(index)
        self._start_index_agent(index)
        server = self._grpc_server()
        self._start_same_host_sockets()
        self._start_peer_listeners()
        self._add_services(server)
        self._bind(server)
        self._serve_metrics()
        self._start_grpc(server)
        self._report_serving()
        self._log_started()
        return self

    # ---- the steps of a start ------------------------------------------------------

    def _claim_node(self) -> None:
        """The auth policy, the state directory (locked: one daemon per directory) and the node's
        identity and epoch, kept in it."""
        s = self.settings
        self.authority = endpoints.authority(s)
        self._state_dir = Path(s.tiers.disk.dir).expanduser().resolve()
        self._lock_state_dir(self._state_dir)
        self.node = NodeIdentity.start(s.node.id, self._state_dir)

    def _open_index_agent(self, index) -> None:
        """The agent that publishes this node's blocks to the index, subscribed to the store's
        events (with the metrics) before the store opens, so no event of its recovery is missed."""
        s = self.settings
        self.served = ServedBytes(self.metrics.registry)
        self.index_agent = IndexAgent(
            index, self.node.node_id, self.node.epoch, lambda: self.store.holdings(),
            ttl_s=s.index.ttl_seconds, registry=self.metrics.registry, on_degraded=self._index_degraded,
            served=self.served.snapshot,
        )
        self.events.subscribe("index", self.index_agent.on_events)
        self.events.subscribe("metrics", self.metrics.count_events)
        self.metrics.watch_event_bus(self.events.subscriptions)

    def _open_store(self, index) -> None:
        """One store per arena, its tiers built from the settings and what the daemon gives them
        (:meth:`_tier_runtime`); the RAM blocks a kept arena holds are adopted here."""
        self.store = open_stores(self.settings, self._state_dir, self.metrics, self.events, self._tier_runtime(index))
        self.metrics.watch_ram_recovery({a.name: a.ram for a in self.store.arenas})

    def _start_index_agent(self, index) -> None:
        """The index agent's loop, and what runs on it: the replicator (with ``[replication]``) and
        the subscriber to the engines' KV events (with ``[index] kv_events``)."""
        s = self.settings
        self.index_agent.start()
        self.replicator = open_replicator(s, self.store, index, self.node.node_id, self.index_agent.loop,
                                          self.metrics.registry)
        if s.index.kv_events:
            from kvstore.index.events import EngineSource, KVEventSubscriber, SubscriberConfig

            ttl = max(s.index.ttl_seconds, 1.0)
            self.kv_events = KVEventSubscriber(
                index, [EngineSource(**source) for source in s.index.event_sources()],
                SubscriberConfig(ttl_s=ttl, heartbeat_interval_s=ttl / 3), registry=self.metrics.registry,
            )
            self.index_agent.run(self.kv_events.start(), timeout=10)

    def _grpc_server(self) -> grpc.Server:
        """The gRPC server, not yet listening, with its interceptors in order: admission, auth,
        the per-identity limits, the stream watchdog."""
        s = self.settings
        options = [
            ("grpc.max_receive_message_length", s.server.max_message_bytes),
            # A reply is bounded by the request limits (a batch of keys echoed back, a List page),
            # not by the chunk size: a 1 MiB cap failed valid Lookup, Pin and List answers.
            ("grpc.max_send_message_length", MAX_REPLY_BYTES),
            ("grpc.so_reuseport", 0),
        ]
        self._watchdog = StreamWatchdog(s.server.stream_idle_seconds, self.metrics).start()
        interceptors = [AdmissionInterceptor(s.server.admitted_rpcs, self.metrics)]
        if self.authority.required:  # inside admission: its refusals become statuses there
            interceptors.append(AuthInterceptor(self.authority))
        # After auth: a tenant's calls and streams count together, on whichever connection they come.
        interceptors.append(CallLimiter(s.server.admitted_streams, s.server.streams_per_identity,
                                        s.server.calls_per_identity, self.metrics))
        interceptors.append(self._watchdog)  # last: a call admission or auth refused is never watched
        return grpc.server(
            futures.ThreadPoolExecutor(max_workers=s.server.workers, thread_name_prefix="strata-rpc"),
            interceptors=interceptors,
            options=options,
        )

    def _start_same_host_sockets(self) -> None:
        """Each arena's same-host socket (--same-host-socket), unless it is off."""
        s = self.settings
        if s.server.same_host_socket != "off":
            endpoints.start_same_host_sockets(s, self.store, self.authority, self.metrics, self._same_hosts)
            self._same_host = self._same_hosts[self.store.default.name]

    def _start_peer_listeners(self) -> None:
        """The peer data plane's listeners: TCP (--peer-listen), UCX (--peer-ucx-listen) and UCX
        shared memory (--peer-ucx-shm); without a UCX listener, UCX is still started when the peer
        tier reads over it."""
        s = self.settings
        if s.peers.listen:
            self.peer_server = endpoints.start_peer_server(s, self.store, self.authority, self.metrics, self.served)
        if s.peers.ucx_listen:
            self.ucx_server = endpoints.start_ucx_server(s, self.store, self.authority, self.metrics, self.served)
        elif "peer" in s.tiers.chain and "ucx" in s.tiers.peer.transports:
            endpoints.start_ucx("--peer-transports ucx")
        if s.peers.ucx_shm:
            self.ucx_shm_server = endpoints.start_ucx_shm_server(s, self.store, self.authority, self.metrics)
        elif "peer" in s.tiers.chain and "ucx-shm" in s.tiers.peer.transports:
            endpoints.start_ucx("--peer-transports ucx-shm", shared_memory=True)

    def _add_services(self, server: grpc.Server) -> None:
        """The KV service (with the streamed puts' byte budget), the handoff and index services,
        health and reflection."""
        s = self.settings
        budget = int(s.server.put_budget_bytes)
        self.put_budget = ByteBudget(budget, "streamed puts", "--put-budget-bytes",
                                     # half by default, never less than one whole block
                                     share_bytes=int(s.server.put_budget_bytes_per_identity) or max(
                                         budget // 2, min(self.store.limits.max_block_bytes, budget)),
                                     share_setting="--put-budget-bytes-per-identity")
        kv_pb2_grpc.add_KVServiceServicer_to_server(
            KVServicer(self.store, self.node, int(s.server.chunk_bytes),
                       {name: sh.path for name, sh in self._same_hosts.items()},
                       self._removed,
                       self.put_budget, handoffs=lambda: self.handoffs.metrics.counts(), served=self.served,
                       replication=self.replicator.report if self.replicator is not None else None,
                       pin_copies=self.replicator.pins if self.replicator is not None else None,
                       open_handoffs=lambda namespace: self.handoffs.open_in(namespace)), server
        )
        handoff_pb2_grpc.add_HandoffServiceServicer_to_server(self._handoff_servicer(), server)
        weights = {TierName[label.upper()]: w for label, w in s.index.tier_weights().items()}
        index_pb2_grpc.add_IndexServiceServicer_to_server(
            # Index RPCs may wait on a slow index: at most half the admitted RPCs, the rest stay for the cache.
            IndexServicer(self.index_agent, ScoringPolicy(weights), max_in_flight=max(1, s.server.admitted_rpcs // 2),
                          replication=self.replicator.report if self.replicator is not None else None),
            server,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                INDEX_SERVICE_NAME,
                HANDOFF_SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )

    def _bind(self, server: grpc.Server) -> None:
        """The gRPC port (with TLS when configured) and the Unix socket; the address this node
        advertises, given to the index agent with the peer transports."""
        s = self.settings
        try:
            tls = endpoints.server_credentials(s)
            if tls is None:
                self.port = server.add_insecure_port(s.server.listen)
            else:
                self.port = server.add_secure_port(s.server.listen, tls)
        except RuntimeError as err:
            raise DaemonError(f"cannot listen on {s.server.listen} ({err}): pick a free address with --listen") from None
        self.advertised = s.server.advertised(self.port)
        self.index_agent.advertise(self.advertised, self.peer_transports())
        if s.server.unix_socket:
            Path(s.server.unix_socket).unlink(missing_ok=True)
            server.add_insecure_port(f"unix:{s.server.unix_socket}")

    def _serve_metrics(self) -> None:
        """Prometheus metrics over HTTP (--metrics-listen; ':PORT' is loopback), before the first
        RPC is answered."""
        s = self.settings
        if not s.server.metrics_listen:
            return
        host, port = split_host(s.server.metrics_listen)
        try:  # ':PORT' is loopback: metrics leave the host only when an address says so
            self._metrics_server, _ = start_http_server(int(port), addr=host or "127.0.0.1", registry=self.metrics.registry)
        except OSError as err:
            raise DaemonError(
                f"cannot serve metrics on {s.server.metrics_listen} ({err}): pick a free address with --metrics-listen, "
                "or pass an empty one to turn metrics off"
            ) from None
        self.metrics_port = self._metrics_server.server_port

    def _start_grpc(self, server: grpc.Server) -> None:
        """The gRPC server started. Its Unix socket is created owner-only (no window in which
        another user could connect), then given its configured mode."""
        s = self.settings
        mask = os.umask(0o177) if s.server.unix_socket else None
        try:
            server.start()
        finally:
            if mask is not None:
                os.umask(mask)
        self._server = server
        if s.server.unix_socket:
            os.chmod(s.server.unix_socket, s.auth.mode)

    def _report_serving(self) -> None:
        """Health SERVING, the index's and each tier's health detail, watched from now on; the
        replicator started."""
        for name in ("", SERVICE_NAME):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._index_degraded(self.index_agent.degraded)
        self._check_tiers()
        self._tier_watch = threading.Thread(target=self._watch_tiers, name="strata-tier-health", daemon=True)
        self._tier_watch.start()
        if self.replicator is not None:
            self.replicator.start()

    def _log_started(self) -> None:
        """One line for the operator: where the daemon serves, its node and epoch, what it recovered."""
        s = self.settings
        stats = self.store.stats()
        log.info(
            "strata serving on %s (port %s), metrics port %s, node %s epoch %d, %d blocks recovered",
            s.server.listen, self.port, self.metrics_port, self.node.node_id, self.node.epoch, stats.blocks,
            extra={
                "listen": s.server.listen, "port": self.port, "unix_socket": s.server.unix_socket or None,
                "metrics_port": self.metrics_port, "node_id": self.node.node_id, "epoch": self.node.epoch,
                "ram_bytes": int(s.tiers.ram.bytes), "disk_bytes": int(s.tiers.disk.bytes),
                "disk_dir": str(self._state_dir), "arena": self.store.default.shm.path, "recovered_blocks": stats.blocks,
                "arenas": [a.name for a in self.store.arenas], "peer_addresses": self.peer_addresses(),
            },
        )

    # ---- the running daemon ----------------------------------------------------------

    def peer_addresses(self) -> dict[str, str]:
        """The peer data plane's addresses by transport scheme (``{"tcp": "tcp://host:port",
        "ucx": "ucx://host:port"}``), as other daemons reach them: what this node's index record
        advertises, shared memory first (``ucx-shm://<host id>:port``, for daemons on this host).
        Empty when no peer listener is configured (--peer-listen, --peer-ucx-listen, --peer-ucx-shm)."""
        return endpoints.peer_addresses(self.settings, self.peer_server, self.ucx_server, self.ucx_shm_server)

    def _removed(self, arena: str, namespace: str, keys: list[bytes]) -> None:
        """A Delete removed blocks of ``arena``: its same-host clients forget where they saw those keys."""
        same_host = self._same_hosts.get(arena)
        if same_host is not None:
            same_host.removed(namespace, keys)

    def _handoff_servicer(self) -> HandoffServicer:
        """Both sides of the prefill/decode handoff (kvstore.handoff): the table of handoffs this
        node holds open, and the puller it runs as a decode side, with the peer token."""
        from kvstore.auth.credentials import ChannelSecurity, read_token_file
        from kvstore.client.sync import Client
        from kvstore.handoff.metrics import HandoffMetrics
        from kvstore.handoff.pull import HandoffPuller, PullLimits
        from kvstore.handoff.table import HandoffLimits, HandoffTable
        from kvstore.peer.registry import fabric_order, open_peer_client

        s = self.settings
        h = s.handoff
        metrics = HandoffMetrics(self.metrics.registry, h.transports)
        self.handoffs = HandoffTable(
            self.store, lambda: (self.node.node_id, self.node.epoch, self.peer_transports(), self.advertised),
            HandoffLimits(h.lease_seconds, h.max_lease_seconds, h.max_total_seconds, h.max_open, h.max_blocks,
                          h.max_open_per_identity),
            metrics,
        ).start()
        token_file = h.token_file or s.tiers.peer.token_file
        token = read_token_file(token_file) if token_file else ""
        security = ChannelSecurity.build(token=token or None, tls_ca=s.tiers.peer.tls_ca or None)
        self._handoff_peers = {scheme: open_peer_client(scheme, security)
                               for scheme in fabric_order(h.transports, ucx_over_tcp=s.peers.ucx_over_tcp)}
        puller = HandoffPuller(
            self.store, self._handoff_peers, lambda address: Client(address, security=security, retries=1, timeout=10),
            self.index_agent.publish,
            PullLimits(h.max_pulls, h.max_blocks, int(s.store.max_block_bytes), h.pull_seconds,
                       h.max_pulls_per_identity),
            self.index_agent.node, metrics,
        )
        return HandoffServicer(self.handoffs, puller)

    def _stop_handoffs(self) -> None:
        if self.handoffs is not None:
            self.handoffs.stop()
        for client in self._handoff_peers.values():
            client.close()

    def _tier_runtime(self, index) -> dict[str, dict]:
        """What tiers get from the running daemon: the peer tier asks this node's index (on the
        index agent's loop) for holders, and must know which node it is not to fetch from; the
        object tier reads its credentials from the daemon's environment, once, here, and removes every
        node's holding of the blocks whose object goes from the index."""
        s = self.settings
        runtime: dict[str, dict] = {}
        if "object" in s.tiers.chain:
            from kvstore.remote.object.metrics import ObjectMetrics

            runtime["object"] = {"environ": dict(os.environ), "metrics": ObjectMetrics(self.metrics.registry),
                                 "max_block_bytes": int(s.store.max_block_bytes), "node_id": self.node.node_id,
                                 "index": index, "index_loop": self.index_agent.loop}
        if "peer" not in s.tiers.chain:
            return runtime
        from kvstore.peer.source import PeerMetrics

        self.peer_metrics = PeerMetrics(self.metrics.registry, s.tiers.peer.transports)
        runtime["peer"] = {
            "index": index, "index_loop": self.index_agent.loop, "node_id": self.node.node_id,
            "host": s.server.advertised_host(), "metrics": self.peer_metrics,
            "max_block_bytes": int(s.store.max_block_bytes), "ucx_over_tcp": s.peers.ucx_over_tcp,
        }
        return runtime

    def peer_transports(self) -> list[str]:
        """The data-plane endpoints this node advertises in its node record, preferred first: UCX
        shared memory for this host's daemons (--peer-ucx-shm), the TCP peer listener when there is
        one (--peer-listen), the UCX one (--peer-ucx-listen), then gRPC. A reader picks the first of its own ``[tiers.peer] transports`` listed here."""
        return [*self.peer_addresses().values(), f"grpc://{self.advertised}"]

    def reload_auth(self) -> bool:
        """Load the auth policy file again (SIGHUP); the old rules stay when it is broken."""
        return self.authority.reload() if self.authority is not None else False

    def _watch_tiers(self) -> None:
        while not self._watch_stop.wait(TIER_CHECK_SECONDS):
            self._check_tiers()

    def _check_tiers(self) -> None:
        """Health detail per tier: ``strata.tier.<tier>`` is NOT_SERVING while the tier is degraded
        (a full filesystem, a device that failed a write); the KV service keeps serving from the
        tiers that work. An epoch that could not be written at start is written once there is room."""
        for stats in self.store.tier_stats():
            status = health_pb2.HealthCheckResponse.NOT_SERVING if stats.degraded else health_pb2.HealthCheckResponse.SERVING
            self._health.set(f"{TIER_HEALTH_PREFIX}{stats.tier.label}", status)
        if not self.node.persisted and self.node.persist(self._state_dir):
            self.node = replace(self.node, persisted=True)
            log.info("epoch %d written to %s: the filesystem has room again", self.node.epoch, self._state_dir)

    def _index_degraded(self, degraded: bool) -> None:
        """Health detail: the index service reports NOT_SERVING while the index is unreachable;
        the KV service keeps serving local hits."""
        status = health_pb2.HealthCheckResponse.NOT_SERVING if degraded else health_pb2.HealthCheckResponse.SERVING
        self._health.set(INDEX_SERVICE_NAME, status)

    def _lock_state_dir(self, state_dir: Path) -> None:
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(state_dir / "daemon.lock", os.O_RDWR | os.O_CREAT, 0o600)
            os.fchmod(fd, 0o600)  # one an older release made readable to all
        except OSError as err:
            raise DaemonError(f"cannot use {state_dir} as the cache directory ({err.strerror}): set --disk-dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DaemonError(
                f"another strata daemon is using {state_dir}: stop it, or give this one its own --disk-dir"
            ) from None
        self._lock_fd = fd

    def stop(self, grace: float | None = None) -> None:
        with self._stop_lock:
            if self._stopping:
                self._stopped.wait()
                return
            self._stopping = True
        grace = self.settings.server.grace_seconds if grace is None else grace
        log.info("strata stopping", extra={"grace_seconds": grace})
        self._health.enter_graceful_shutdown()
        self._watch_stop.set()
        if self._server is not None:
            self._server.stop(grace).wait()
        if self._watchdog is not None:
            self._watchdog.stop()
        for same_host in self._same_hosts.values():
            same_host.stop()
        if self.peer_server is not None:
            self.peer_server.stop()
        self._stop_handoffs()
        if self.replicator is not None:
            self.replicator.stop()
        if self.ucx_server is not None:
            self.ucx_server.stop()
        if self.ucx_shm_server is not None:
            self.ucx_shm_server.stop()
        if self.kv_events is not None:
            try:
                self.index_agent.run(self.kv_events.stop(leave=True), timeout=5)
            except Exception as err:  # noqa: BLE001 - stopping: report, go on
                log.warning("KV-event subscriber did not stop cleanly: %s", err)
        if self.index_agent is not None:
            self.index_agent.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        if self.store is not None:
            # A kept arena serves the next start, so RAM keeps its copies; the copies on disk are
            # for a reboot, which the arena does not survive.
            ram = self.settings.tiers.ram
            keep = ram.crash_safe and ram.keep_on_exit
            written = self.store.persist_ram(time.monotonic() + max(grace, 5.0), evict=not keep)
            log.info("wrote %d RAM blocks to disk before exit%s", written,
                     "; the arena stays for the next start" if keep else "")
            self.store.close()
        self.events.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
        if self.settings.server.unix_socket:
            Path(self.settings.server.unix_socket).unlink(missing_ok=True)
        self._stopped.set()
        log.info("strata stopped")

    def wait(self) -> None:
        self._stopped.wait()


def ready_line(daemon: Daemon, terminal: bool = False) -> str:
    """The one line ``strata serve`` prints on stdout once it serves: where, and (on a terminal) what to try."""
    host = daemon.settings.server.listen.rpartition(":")[0] or "127.0.0.1"
    target = f"{host}:{daemon.port}"
    line = f"strata serve: ready on {target}, node {daemon.node.node_id} epoch {daemon.node.epoch}"
    if daemon.metrics_port:
        metrics_host = daemon.settings.server.metrics_listen.rpartition(":")[0] or "127.0.0.1"
        line += f", metrics on http://{metrics_host}:{daemon.metrics_port}/metrics"
    if terminal:
        hint = "" if target == "127.0.0.1:50051" else f" --target {target}"
        line += (f"\n  try: echo hello | strata kv put demo k1{hint} && strata kv get demo k1{hint} && "
                 f"strata stats{hint}\n  stop: Ctrl-C (then strata clean removes the arena it kept in shared memory)")
    return line


def serve(settings: Settings) -> int:
    """Run until SIGTERM or SIGINT; returns the process exit status."""
    daemon = Daemon(settings)

    def on_signal(signum, _frame):
        log.info("received %s", signal.Signals(signum).name)
        threading.Thread(target=daemon.stop, name="strata-shutdown").start()

    def on_hangup(_signum, _frame):
        threading.Thread(target=daemon.reload_auth, name="strata-auth-reload").start()

    # SIGHUP is handled before the daemon answers anyone: a reload asked for as soon as it is healthy must not
    # meet the default action (the end of the process, or nothing where SIGHUP is inherited ignored).
    signal.signal(signal.SIGHUP, on_hangup)
    daemon.start()
    print(ready_line(daemon, terminal=sys.stdout.isatty()), flush=True)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    daemon.wait()
    return 0
