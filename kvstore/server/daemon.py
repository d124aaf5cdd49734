"""The node daemon: builds the tiers and the store from settings and serves them.

Serves ``strata.kv.v1.KVService``, ``grpc.health.v1.Health`` and server
reflection on one gRPC server (TCP, and a Unix socket when configured), and
Prometheus metrics over HTTP. SIGTERM or SIGINT drains it: health turns
NOT_SERVING, in-flight RPCs get ``grace_seconds``, RAM-only blocks are
copied to disk, then the store closes. The arena and its table of committed
blocks stay in the shared-memory directory (``[tiers.ram] keep_on_exit``),
so the next start, after an upgrade or a crash, re-adopts the RAM blocks.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import disable_created_metrics, start_http_server

from kvstore.api.v1 import kv_pb2, kv_pb2_grpc
from kvstore.api.v1 import index_pb2, index_pb2_grpc
from kvstore.block import TierName
from kvstore.config import Settings
from kvstore.index import open_index
from kvstore.index.agent import IndexAgent
from kvstore.index.scoring import ScoringPolicy
from kvstore.server.index_service import IndexServicer
from kvstore.errors import StrataError
from kvstore.metrics import StoreMetrics
from kvstore.node import NodeIdentity
from kvstore.server.admission import AdmissionInterceptor
from kvstore.server.budget import ByteBudget
from kvstore.server.samehost import SameHostServer
from kvstore.server.service import KVServicer
from kvstore.store import EdgePolicy, StoreLimits, TierChain, TieredStore
from kvstore.store.events import EventBus
from kvstore.tiers import open_tier

log = logging.getLogger(__name__)

# The *_created series double every counter's output and carry nothing an
# operator graphs.
disable_created_metrics()

SERVICE_NAME = kv_pb2.DESCRIPTOR.services_by_name["KVService"].full_name
INDEX_SERVICE_NAME = index_pb2.DESCRIPTOR.services_by_name["IndexService"].full_name


class DaemonError(StrataError):
    """The daemon cannot start as configured; the message says what to change."""


class Daemon:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = StoreMetrics()
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._lock_fd: int | None = None
        self._server: grpc.Server | None = None
        self._same_host: SameHostServer | None = None
        self._metrics_server = None
        self._health = health.HealthServicer()
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self._stopping = False
        self.store: TieredStore | None = None
        self.index_agent: IndexAgent | None = None
        self.events = EventBus()  # the store's events: the index agent and metrics subscribe
        self.kv_events = None  # KVEventSubscriber, when engines are configured

    def start(self) -> Daemon:
        """Build and serve; on any failure, give back what was taken (lock, arena, ports)."""
        try:
            return self._start()
        except BaseException:
            self._stopping = True
            if self._server is not None:
                self._server.stop(0)
            if self._same_host is not None:
                self._same_host.stop()
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
        s = self.settings
        state_dir = Path(s.tiers.disk.dir).expanduser().resolve()
        self._lock_state_dir(state_dir)
        self.node = NodeIdentity.start(s.node.id, state_dir)
        tiers: list = []
        edges: list[EdgePolicy] = []
        try:
            for name in s.tiers.chain:
                section = s.tiers.section(name)
                if not section.enabled:
                    continue
                if tiers:  # the policy of the edge above this tier
                    edges.append(EdgePolicy(**section.edge()))
                tiers.append(open_tier(name, **section.tier_options(state_dir)))
            index = open_index(s.index.url)
        except BaseException:
            for tier in tiers:
                tier.close()
            raise
        limits = StoreLimits.from_settings(s.store)
        self.index_agent = IndexAgent(
            index, self.node.node_id, self.node.epoch, lambda: self.store.holdings(),
            ttl_s=s.index.ttl_seconds, registry=self.metrics.registry, on_degraded=self._index_degraded,
        )
        self.events.subscribe("index", self.index_agent.on_events)
        self.events.subscribe("metrics", self.metrics.count_events)
        self.metrics.watch_event_bus(self.events.subscriptions)
        self.metrics.watch_arena(tiers[0])
        self.store = TieredStore(
            TierChain(tiers, edges), limits=limits,
            namespaces=s.store.namespaces, auto_create_namespaces=s.store.auto_create_namespaces,
            metrics=self.metrics, events=self.events,
        )
        self.index_agent.start()
        if s.index.kv_events:
            from kvstore.index.events import EngineSource, KVEventSubscriber, SubscriberConfig

            ttl = max(s.index.ttl_seconds, 1.0)
            self.kv_events = KVEventSubscriber(
                index, [EngineSource(**source) for source in s.index.event_sources()],
                SubscriberConfig(ttl_s=ttl, heartbeat_interval_s=ttl / 3), registry=self.metrics.registry,
            )
            self.index_agent.run(self.kv_events.start(), timeout=10)
        options = [
            ("grpc.max_receive_message_length", s.server.max_message_bytes),
            ("grpc.max_send_message_length", s.server.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=s.server.workers, thread_name_prefix="strata-rpc"),
            interceptors=[AdmissionInterceptor(s.server.admitted_rpcs, self.metrics)],
            options=options,
        )
        arena = self.store.head.arena
        if s.server.same_host_socket != "off":
            auto = os.path.join(os.path.dirname(arena.path), "samehost-" + os.path.basename(arena.path) + ".sock")
            path = auto if s.server.same_host_socket == "auto" else s.server.same_host_socket
            self._same_host = SameHostServer(
                self.store, path, arena.token, metrics=self.metrics,
                max_connections=s.server.same_host_max_connections, idle_s=s.server.same_host_idle_seconds,
            )
            try:
                self._same_host.start()
            except OSError as err:
                raise DaemonError(
                    f"cannot serve the same-host socket at {path} ({err.strerror or err}): "
                    "set --same-host-socket to a writable path, or 'off'"
                ) from None
        kv_pb2_grpc.add_KVServiceServicer_to_server(
            KVServicer(self.store, arena, self.node, int(s.server.chunk_bytes),
                       self._same_host.path if self._same_host else "",
                       self._same_host.removed if self._same_host else None,
                       ByteBudget(int(s.server.put_budget_bytes), "streamed puts", "--put-budget-bytes")), server
        )
        weights = {TierName[label.upper()]: w for label, w in s.index.tier_weights().items()}
        index_pb2_grpc.add_IndexServiceServicer_to_server(
            # Index RPCs may wait on a slow index: at most half the admitted RPCs, the rest stay for the cache.
            IndexServicer(self.index_agent, ScoringPolicy(weights), max_in_flight=max(1, s.server.admitted_rpcs // 2)),
            server,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                INDEX_SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        try:
            self.port = server.add_insecure_port(s.server.listen)
        except RuntimeError as err:
            raise DaemonError(f"cannot listen on {s.server.listen} ({err}): pick a free address with --listen") from None
        if s.server.unix_socket:
            Path(s.server.unix_socket).unlink(missing_ok=True)
            server.add_insecure_port(f"unix:{s.server.unix_socket}")
        server.start()
        self._server = server
        if s.server.metrics_listen:
            host, _, port = s.server.metrics_listen.rpartition(":")
            try:
                self._metrics_server, _ = start_http_server(int(port), addr=host or "0.0.0.0", registry=self.metrics.registry)
            except OSError as err:
                raise DaemonError(
                    f"cannot serve metrics on {s.server.metrics_listen} ({err}): pick a free address with --metrics-listen, "
                    "or pass an empty one to turn metrics off"
                ) from None
            self.metrics_port = self._metrics_server.server_port
        for name in ("", SERVICE_NAME):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._index_degraded(self.index_agent.degraded)
        stats = self.store.stats()
        log.info(
            "strata serving on %s (port %s), metrics port %s, node %s epoch %d, %d blocks recovered",
            s.server.listen, self.port, self.metrics_port, self.node.node_id, self.node.epoch, stats.blocks,
            extra={
                "listen": s.server.listen, "port": self.port, "unix_socket": s.server.unix_socket or None,
                "metrics_port": self.metrics_port, "node_id": self.node.node_id, "epoch": self.node.epoch,
                "ram_bytes": int(s.tiers.ram.bytes), "disk_bytes": int(s.tiers.disk.bytes), "disk_dir": str(state_dir),
                "arena": self.store.head.arena.path, "recovered_blocks": stats.blocks,
            },
        )
        return self

    def _index_degraded(self, degraded: bool) -> None:
        """Health detail: the index service reports NOT_SERVING while the index is unreachable;
        the KV service keeps serving local hits."""
        status = health_pb2.HealthCheckResponse.NOT_SERVING if degraded else health_pb2.HealthCheckResponse.SERVING
        self._health.set(INDEX_SERVICE_NAME, status)

    def _lock_state_dir(self, state_dir: Path) -> None:
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(state_dir / "daemon.lock", os.O_RDWR | os.O_CREAT, 0o644)
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
        if self._server is not None:
            self._server.stop(grace).wait()
        if self._same_host is not None:
            self._same_host.stop()
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


def serve(settings: Settings) -> int:
    """Run until SIGTERM or SIGINT; returns the process exit status."""
    daemon = Daemon(settings).start()

    def on_signal(signum, _frame):
        log.info("received %s", signal.Signals(signum).name)
        threading.Thread(target=daemon.stop, name="strata-shutdown").start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    daemon.wait()
    return 0
