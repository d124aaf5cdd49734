"""The processes of one benchmarked fleet: a Redis index, a daemon and an engine per replica, a router.

Every part is a real child process, as it would be deployed (separate
GILs: the engines compute while the client times them). Each replica (its
daemon and its engine) is a host of its own: a network namespace with its
own address on a virtual network (veth pairs on one bridge,
:class:`tests.support.peer_cluster.Network`), so a block one replica's
daemon fetches from another's crosses a network path over the peer
transport; Redis and the router are on the host side (the bridge's
address), a third host. ``FleetSpec.loopback`` (``--loopback``), or a
machine where namespaces cannot be made, puts everything on loopback
instead. :class:`Nodes` live for the whole benchmark:

- one private ``redis-server`` (:func:`benchmarks.harness.private_redis`):
  the prefix index every daemon publishes to, so a router asking any daemon
  sees every replica's holdings;
- per replica, a ``strata serve`` (node ``node-<i>``) with its own scratch
  shared-memory directory and disk directory, the peer tier at the end of
  its chain and a peer listener (so a block another node holds is fetched),
  subscribed to the KV events of the engines of the phases that route by
  cache.

:class:`Engines`, the reference engines, one per replica (one compute
thread each, in front of its node's daemon), are started once too and
reconfigured for each phase (``POST /admin/reconfigure``): an engine's
start-up is torch, transformers and the model's load, the same for every
policy, while what a policy changes (the prefix cache's mode, the pool's
namespace, the KV-event endpoint, the engine id ``engine-<i>-<phase>``) is
set anew, empty, without a restart. A :class:`Fleet` is one phase's (one
policy's) serving side: the engines so configured, every cache cold, and a
router (``strata route``) of its own in front of them.

Each child gets ``PR_SET_PDEATHSIG`` (it dies with the benchmark, even a
SIGKILLed one), a log file in the scratch directory (its tail is shown when
it fails to start), and a readiness check that must pass before the next
part starts. :meth:`Fleet.close` stops the router; :meth:`Engines.close` the engines;
:meth:`Nodes.close` the daemons, then Redis, and removes the scratch
directories.
"""

from __future__ import annotations

import contextlib
import json
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.e2e.policies import Policy
from benchmarks.harness import free_port, private_redis
from tests.support.peer_cluster import Network

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
SHM_ROOT = Path("/dev/shm")
NAMESPACE = "e2e"
BLOCK_SIZE = 16
HASH_SEED = "0"
QUEUE_METRIC = "e2e_engine_queue_depth"  # the engine's waiting requests, which the router adds to its load


class StartFailed(RuntimeError):
    """A fleet process exited or never became ready; the message has its log's tail."""


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def grpc_serving(target: str, timeout_s: float = 1.0) -> bool:
    try:
        with grpc.insecure_channel(target) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            return r.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


class Child:
    """One child process: its command, log, readiness check; started, SIGKILLed, restarted."""

    def __init__(self, name: str, argv: list[str], log_path: Path, ready: Callable[[], bool], *,
                 env: dict[str, str] | None = None, start_timeout_s: float = 180.0) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.ready = ready
        self.env = env
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None

    def spawn(self) -> Child:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
               **(self.env or {})}
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env=env, cwd=REPO, preexec_fn=_die_with_parent)
        return self

    def wait_ready(self) -> Child:
        end = time.monotonic() + self.start_timeout_s
        while not self.ready():
            if self.proc is not None and self.proc.poll() is not None:
                raise StartFailed(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > end:
                raise StartFailed(f"{self.name} not ready after {self.start_timeout_s:.0f} s:\n{self.tail()}")
            time.sleep(0.1)
        return self

    def start(self) -> Child:
        return self.spawn().wait_ready()

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is flushed or drained."""
        if self.alive:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited after ``timeout_s``."""
        if not self.alive:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()


@dataclass(frozen=True)
class Phase:
    """One measured run: a policy, and the names that keep its cache apart from every other phase's."""

    name: str  # "a".."e", or "faults"
    policy: Policy

    @property
    def namespace(self) -> str:
        return f"{NAMESPACE}-{self.name}"

    def engine_id(self, replica: int) -> str:
        return f"engine-{replica}-{self.name}"


@dataclass(frozen=True)
class FleetSpec:
    model_dir: Path
    replicas: int = 2
    ram_bytes: str = "512MiB"
    disk_bytes: str = "2GiB"
    max_block_bytes: str = "16MiB"
    cache_blocks: int = 4096  # per engine (--prefix-cache blocks): more than the workload needs
    max_queue: int = 32  # per engine: more than the sessions, so a full queue is a fault, not the workload
    index_ttl_s: float = 3.0
    health_interval_s: float = 1.0  # the router's health checks of its endpoints
    # An engine that computes answers its /health late on 2 shared cores; a SIGKILLed one refuses the
    # connection at once, so a longer timeout does not delay taking a dead engine out of rotation.
    health_timeout_s: float = 5.0
    # The router's deadline for one Score RPC. Its default (50 ms) is for a dedicated host; on 2 shared cores
    # a daemon's answer can take longer than that while an engine prefills, and each miss is a fallback.
    index_timeout_s: float = 0.25
    engine_threads: int = 1  # torch threads per engine: the replicas share the machine's cores
    # The router's --load-weight. The reference engine computes one request at a time, so a request
    # queued behind another waits its whole prefill and decode, while a miss at an idle engine costs
    # only the prefill past the shared system prompt: load weighs more than for a batching vLLM.
    # Measured on this workload (b, c, e in one run): c/b mean TTFT 1.67x with 2, 1.0x with 1.
    load_weight: float = 2.0
    loopback: bool = False  # every part on 127.0.0.1 instead of a host (network namespace) per replica
    spare: int = 0  # nodes beyond the replicas, with a daemon and no engine: where the scale-up drill adds one


@dataclass
class Node:
    index: int
    node_id: str
    daemon: Child
    target: str
    host: str  # the replica's address: its daemon's and its engine's
    events: dict[str, tuple[str, str]]  # phase name -> where its engine on this node publishes KV events, replays
    peer_listen: str = ""  # the daemon's peer data-plane listener
    metrics_url: str = ""  # the daemon's Prometheus endpoint
    disk_dir: Path | None = None
    shm_dir: Path | None = None


class Nodes:
    """Redis and one daemon per replica, shared by every phase (each phase has its own namespace and
    engine ids, so one phase's blocks and index entries are never another's hits).

    A daemon's ``--kv-events`` is fixed when it starts, so it subscribes to the endpoints of every
    phase whose engines publish events, up front; an endpoint nobody binds yet costs nothing (ZMQ
    reconnects in the background).
    """

    def __init__(self, spec: FleetSpec, phases: list[Phase]) -> None:
        self.spec = spec
        self.phases = phases
        self.nodes: list[Node] = []
        self.redis_url = ""
        self.net: Network | None = None
        self._stack = contextlib.ExitStack()
        self.scratch = Path(tempfile.mkdtemp(prefix="strata-e2e-"))
        shm_parent = SHM_ROOT if SHM_ROOT.is_dir() else None  # a tmpfs for the arena where there is one
        self.shm = Path(tempfile.mkdtemp(prefix="strata-e2e-", dir=shm_parent))

    def start(self) -> Nodes:
        try:
            self.net = Network(self.spec.replicas + self.spec.spare, loopback=self.spec.loopback)
            self._stack.callback(self.net.close)
            log.info("network: %s", self.net.note)
            port = self._stack.enter_context(private_redis(bind=self.net.gateway))
            self.redis_url = f"redis://{self.net.gateway}:{port}/0"
            self.nodes = [self._node(i) for i in range(self.spec.replicas + self.spec.spare)]
            for n in self.nodes:  # all at once: their start-ups overlap
                n.daemon.spawn()
            for n in self.nodes:
                n.daemon.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def _node(self, i: int) -> Node:
        spec = self.spec
        home = self.scratch / f"node-{i}"
        home.mkdir()
        shm = self.shm / f"node-{i}"
        shm.mkdir()
        node_id = f"node-{i}"
        host = self.net.host(i)
        target = f"{host}:{free_port()}"
        peer_listen, metrics = f"{host}:{free_port()}", f"{host}:{free_port()}"
        events = {p.name: (f"tcp://{host}:{free_port()}", f"tcp://{host}:{free_port()}")
                  for p in self.phases if p.policy.kv_events}
        argv = [
            sys.executable, "-m", "kvstore.cli.main", "serve", "--node-id", node_id, "--listen", target,
            "--metrics-listen", metrics, "--disk-dir", str(home / "disk"), "--shm-dir", str(shm),
            "--ram-bytes", spec.ram_bytes, "--disk-bytes", spec.disk_bytes, "--max-block-bytes", spec.max_block_bytes,
            "--index-url", self.redis_url, "--index-ttl-seconds", str(spec.index_ttl_s),
            "--tiers", "ram,disk,peer", "--peer-listen", peer_listen, "--log-format", "text",
        ]
        if self.net.virtual is not None:  # a private virtual network: authentication is not what is measured
            argv.append("--insecure")
        if events:
            subs = [f"{ep[0]}?engine={p.engine_id(i)}&namespace={p.namespace}&replay={ep[1]}"
                    for p in self.phases if (ep := events.get(p.name))]
            argv += ["--kv-events", ",".join(subs)]
        daemon = Child(node_id, self.net.command(i, argv), home / "daemon.log", lambda t=target: grpc_serving(t),
                       start_timeout_s=90)
        return Node(i, node_id, daemon, target, host, events, peer_listen, f"http://{metrics}", home / "disk", shm)

    def restart_daemons(self, flags: dict[int, dict[str, str]]) -> None:
        """SIGKILL each node ``i`` of ``flags`` and start them again at once, each with ``flags[i]`` set on its
        command line. From the calling thread: a child dies with the thread that started it."""
        for i, changes in flags.items():
            node = self.nodes[i]
            node.daemon.kill()
            _set_flags(node.daemon.argv, changes)
        for i in flags:
            self.nodes[i].daemon.spawn()
        for i in flags:
            self.nodes[i].daemon.wait_ready()

    def restart_daemon(self, i: int, *, flags: dict[str, str] | None = None, lose_ram: bool = False,
                       while_down: Callable[[Node], None] | None = None) -> None:
        """SIGKILL node ``i``'s daemon and start it again on the same directories (a new epoch).

        ``flags``: set (or added) on its command line for this start and later ones. ``lose_ram``: its
        shared-memory arena is removed while it is down, as a host reboot empties a tmpfs (the disk
        tier's files stay). ``while_down``: called with the node before the new start."""
        node = self.nodes[i]
        node.daemon.kill()
        _set_flags(node.daemon.argv, flags or {})
        if lose_ram and node.shm_dir is not None:
            for f in node.shm_dir.iterdir():
                if f.is_file():
                    f.unlink()
        if while_down is not None:
            while_down(node)
        node.daemon.start()

    @property
    def serving(self) -> list[Node]:
        """The nodes whose engines serve every phase (the spares have a daemon only, until a drill)."""
        return self.nodes[: self.spec.replicas]

    @property
    def network_note(self) -> str:
        return self.net.note if self.net is not None else ""

    def close(self) -> None:
        for n in self.nodes:
            n.daemon.stop()
        self._stack.close()
        shutil.rmtree(self.shm, ignore_errors=True)
        shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self) -> Nodes:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _set_flags(argv: list[str], flags: dict[str, str]) -> None:
    """Each flag's value replaced in ``argv``, or the flag added."""
    for flag, value in flags.items():
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]


@dataclass
class Replica:
    index: int
    node: Node
    engine: Child
    engine_id: str
    url: str


def engine_settings(spec: FleetSpec, phase: Phase, node: Node) -> dict:
    """What a phase's engine on ``node`` is configured with beyond the model: every field
    :meth:`benchmarks.e2e.engine.Engine.reconfigure` may change, "" where the policy leaves a part off."""
    policy = phase.policy
    publish, replay = node.events[phase.name] if policy.kv_events else ("", "")
    return {"engine_id": phase.engine_id(node.index), "prefix_cache": policy.prefix_cache,
            "cache_blocks": spec.cache_blocks, "max_queue": spec.max_queue,
            "kv_events": publish, "kv_events_replay": replay,
            "strata": node.target if policy.pool else "", "namespace": phase.namespace if policy.pool else ""}


_FLAGS = {"engine_id": "--engine-id", "prefix_cache": "--prefix-cache", "cache_blocks": "--cache-blocks",
          "max_queue": "--max-queue", "kv_events": "--kv-events", "kv_events_replay": "--kv-events-replay",
          "strata": "--strata", "namespace": "--namespace"}


class Engines:
    """The reference engines, one per node, kept across phases.

    An engine's start-up (torch and transformers imports, the model's load) is most of a phase's
    set-up, and nothing of it depends on the policy: each phase after the first reconfigures the
    running engines (``POST /admin/reconfigure``, :meth:`Engine.reconfigure`) instead. That gives
    each phase what a fresh process had: an empty prefix cache of the policy's mode, its own engine
    id, the pool client on the phase's own namespace (empty in every daemon) or none, and the KV
    events on the phase's own endpoint (the one its daemon subscribed to for that engine id and
    namespace) or none; metrics from zero. An engine that is dead (the fault phase kills one), or
    that cannot be reconfigured, is started anew. ``reuse=False`` starts fresh engines every phase
    (``--fresh-engines``: what the set-up cost before). :attr:`starts` counts start-ups.
    """

    def __init__(self, nodes: Nodes, *, reuse: bool = True, reconfigure_timeout_s: float = 60.0) -> None:
        self.nodes = nodes
        self.spec = nodes.spec
        self.reuse = reuse
        self.reconfigure_timeout_s = reconfigure_timeout_s
        self.replicas: list[Replica] = []
        self.starts = 0
        self._prestarted = ""  # the phase whose engines prestart spawned and begin has not yet handed out
        self._prestart_count = 0
        self.wait_for_model_s = 0.0
        self.home = nodes.scratch / "engines"
        self.home.mkdir(exist_ok=True)

    def prestart(self, phase: Phase, wait_for_model_s: float) -> None:
        """Spawn ``phase``'s engines before their model directory is complete: their imports (torch,
        transformers: most of a start-up) overlap the model's build, and each waits up to
        ``wait_for_model_s`` for the directory before it loads it. :meth:`begin` of that phase then
        hands them out as they are."""
        self.wait_for_model_s, before = wait_for_model_s, self.starts
        try:
            self.begin(phase)
        finally:
            self.wait_for_model_s = 0.0
        # Counted when begin hands them out, so the phase's set-up reports the start-ups it used.
        self._prestarted, self._prestart_count, self.starts = phase.name, self.starts - before, before

    def begin(self, phase: Phase) -> list[Replica]:
        """Every node's engine configured for ``phase``: live ones reconfigured, the others spawned
        (not yet ready: :meth:`wait_ready`, so a router can start meanwhile)."""
        if self._prestarted:
            prestarted, self._prestarted = self._prestarted, ""
            self.starts += self._prestart_count
            if prestarted == phase.name and all(r.engine.alive for r in self.replicas):
                return self.replicas
        old = {r.index: r for r in self.replicas}
        self.replicas = []
        for node in self.nodes.serving:
            settings = engine_settings(self.spec, phase, node)
            r = old.get(node.index)
            if r is not None and self.reuse and r.engine.alive and self._reconfigure(r, settings):
                self.replicas.append(Replica(node.index, node, r.engine, settings["engine_id"], r.url))
                continue
            if r is not None:
                r.engine.stop()
            self.replicas.append(self._spawn(node, settings))
        return self.replicas

    def wait_ready(self) -> None:
        for r in self.replicas:
            r.engine.wait_ready()

    def _spawn(self, node: Node, settings: dict) -> Replica:
        spec = self.spec
        port = free_port()
        url = f"http://{node.host}:{port}"
        argv = [sys.executable, "-m", "benchmarks.e2e.engine", "--model", str(spec.model_dir), "--host", node.host,
                "--port", str(port), "--block-size", str(BLOCK_SIZE), "--hash-seed", HASH_SEED,
                "--threads", str(spec.engine_threads), "--admin"]
        if self.wait_for_model_s:
            argv += ["--wait-for-model", str(self.wait_for_model_s)]
        for field, value in settings.items():
            if value != "":
                argv += [_FLAGS[field], str(value)]
        engine = Child(f"engine-{node.index}", self.nodes.net.command(node.index, argv),
                       self.home / f"engine-{node.index}.log",
                       lambda u=url: http_ok(u + "/health"), start_timeout_s=240)
        engine.spawn()
        self.starts += 1
        return Replica(node.index, node, engine, settings["engine_id"], url)

    def _reconfigure(self, r: Replica, settings: dict) -> bool:
        """POST the phase's settings; an engine still busy (a stream the last phase's router cut that
        has not reached its next token) answers 409 and is asked again until it is idle."""
        body = json.dumps(settings).encode()
        end = time.monotonic() + self.reconfigure_timeout_s
        while True:
            req = urllib.request.Request(r.url + "/admin/reconfigure", body, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.reconfigure_timeout_s) as resp:
                    json.loads(resp.read())
                return True
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:500]
                if e.code != 409 or time.monotonic() > end:
                    log.warning("engine %s refused its reconfiguration (%s %s): starting a new one", r.engine_id,
                                e.code, detail)
                    return False
            except (urllib.error.URLError, OSError) as e:
                log.warning("engine %s could not be reconfigured (%s): starting a new one", r.engine_id, e)
                return False
            time.sleep(0.1)  # polling an engine that said it is busy

    def close(self) -> None:
        for r in self.replicas:
            r.engine.stop()

    def __enter__(self) -> Engines:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Fleet:
    """One phase's engines (one per node) and router; :attr:`url` is the router's base URL.

    The engines are ``engines``' (kept across phases), or without it the fleet's own, started
    with it and stopped with it.
    """

    def __init__(self, nodes: Nodes, phase: Phase, engines: Engines | None = None, *,
                 router_args: list[str] | None = None, spare_endpoints: list[tuple[str, str]] = ()) -> None:
        self.nodes = nodes
        self.router_args = list(router_args or [])  # more flags for a cache-aware router (its TTFT priors)
        # (url, engine id) of engines not started yet (a drill's new replica): out of rotation until they are
        self.spare_endpoints = list(spare_endpoints)
        self.spec = nodes.spec
        self.phase = phase
        self._own_engines = engines is None
        self.engines = engines if engines is not None else Engines(nodes)
        self.replicas: list[Replica] = []
        self.router: Child | None = None
        self.url = ""
        self.model = ""
        self.engine_starts = 0  # engine start-ups this phase's set-up needed
        self.home = nodes.scratch / f"phase-{phase.name}"
        self.home.mkdir(exist_ok=True)

    def start(self) -> Fleet:
        try:
            # The router starts beside the engines (both import torch or transformers: seconds each);
            # the fleet is ready when every engine answers and the router has them all in rotation.
            starts = self.engines.starts
            self.replicas = self.engines.begin(self.phase)
            self.engine_starts = self.engines.starts - starts
            self.router = self._router()
            self.router.spawn()
            self.engines.wait_ready()
            self.router.wait_ready()
            self._wait_all_in_rotation()
            self.model = model_name(self.url)
        except BaseException:
            self.close()
            raise
        return self


    def _router(self) -> Child:
        spec, policy = self.spec, self.phase.policy
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "kvstore.cli.main", "route", "--listen", f"127.0.0.1:{port}",
                "--model-dir", str(spec.model_dir), "--policy", policy.router_policy,
                "--block-size", str(BLOCK_SIZE), "--hash-seed", HASH_SEED, "--namespace", self.phase.namespace,
                "--health-interval-seconds", str(spec.health_interval_s), "--queue-metric", QUEUE_METRIC,
                "--index-timeout-seconds", str(spec.index_timeout_s), "--health-timeout-seconds",
                str(spec.health_timeout_s), "--load-weight", str(spec.load_weight), "--log-format", "text"]
        for r in self.replicas:
            # With the shared pool a block any daemon holds is one this engine loads (through its own
            # daemon's peer tier): every node's holdings count for every endpoint, its own engine's first.
            ids = [r.engine_id] + ([n.node_id for n in self.nodes.nodes] if policy.pool else [])
            role = "--prefill-endpoint" if policy.disaggregated and r.index == 0 else "--endpoint"
            argv += [role, f"{r.url}={','.join(ids)}"]
        for url, engine_id in self.spare_endpoints:
            ids = [engine_id] + ([n.node_id for n in self.nodes.nodes] if policy.pool else [])
            argv += ["--endpoint", f"{url}={','.join(ids)}"]
        if policy.router_policy == "cache-aware":
            # Any daemon answers for the whole fleet (they share the index): the first node's, so a fault
            # on that daemon is one the router must ride out.
            argv += ["--index", self.nodes.nodes[0].target, *self.router_args]
        return Child("router", argv, self.home / "router.log", lambda: http_ok(self.url + "/health"),
                     start_timeout_s=60)

    def _wait_all_in_rotation(self, timeout_s: float = 60.0) -> None:  # prefill endpoints included
        """Until the router's health checks have every endpoint in rotation (an engine that was still
        starting at the router's first round comes back one health interval later)."""
        end = time.monotonic() + timeout_s
        while True:
            started = {str(i) for i in range(len(self.replicas))}  # labels: the started engines come first
            healthy = [v for (name, labels), v in self.router_metrics().items()
                       if name == "strata_router_endpoint_healthy" and dict(labels).get("endpoint") in started]
            if len(healthy) == len(self.replicas) and all(v == 1 for v in healthy):
                return
            if time.monotonic() > end:
                raise StartFailed(f"the router has not every engine in rotation after {timeout_s:.0f} s:\n"
                                  f"{self.router.tail() if self.router else ''}")
            time.sleep(0.1)

    def router_metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of the router's ``/metrics``: (name, sorted labels) -> value."""
        return scrape(self.url)

    def engine_metrics(self) -> dict[str, dict[tuple[str, tuple], float]]:
        """Every live engine's ``/metrics`` samples, by engine id."""
        return {r.engine_id: scrape(r.url) for r in self.replicas if r.engine.alive}

    def close(self) -> None:
        if self.router is not None:
            self.router.stop()
        if self._own_engines:
            self.engines.close()

    def logs(self) -> dict[str, str]:
        """Each process's log tail, for a failure report."""
        out = {n.node_id: n.daemon.tail() for n in self.nodes.nodes}
        out.update({r.engine_id: r.engine.tail() for r in self.replicas})
        if self.router is not None:
            out["router"] = self.router.tail()
        return out

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of ``base_url/metrics`` (Prometheus text): (name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def model_name(base_url: str) -> str:
    """The served model's id, from ``GET /v1/models``."""
    with urllib.request.urlopen(base_url.rstrip("/") + "/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]
