"""The scale-up drill: a replica added to a loaded fleet mid-run, with Strata and without.

The fleet serves a W1 load point at 0.8 of its (two-replica) capacity. Once
``start_after`` of the requests are answered, a third replica is brought up
on a node that so far ran only its daemon (``FleetSpec.spare``), and the
router, which has had its endpoint out of rotation all along (its health
check failed), takes it in as soon as it answers:

- **with Strata** (policy e): the node's weight node (``strata weights
  serve``, one per node, a swarm) is asked to pre-fetch the model
  (``strata weights prefetch`` + ``strata weights wait``, as the deploy
  manifests' init container does), from the other nodes' weight caches,
  which hold it; then the engine starts with ``--model s3://… --model-digest
  D --weights-cache DIR``: its tensors stream through
  :func:`weightcache.open_model` from the warm node cache, and its KV comes
  from the pool (its daemon's peer tier) where the router sends it a
  returning session;
- **without** (policy b: round robin, per-replica caches, no Strata): the
  model's files are downloaded from the origin (the moto S3 bucket, as an
  init container's ``aws s3 cp`` would), the engine loads them, and every
  prefix it is sent it computes (cold KV).

Reported per run: time to ready (the drill's start to the new replica's
first token served, and the steps in between), origin bytes (what the S3
bucket served for it), and the TTFT of the new replica's first
``first_requests`` requests (fewer where the run sent it fewer).

The model is published once, at the start (:class:`WeightOrigin`): its files
uploaded to a private moto S3 server on the host side, ``strata weights
publish`` over them, and every serving node's weight node pre-fetches it
there (not timed: the fleet was running before the drill).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.e2e.fleet import (
    BLOCK_SIZE, HASH_SEED, Child, Fleet, Nodes, REPO, StartFailed, engine_settings, free_port, http_ok,
)
from benchmarks.e2e.stats import RequestRecord, Summary

log = logging.getLogger(__name__)

BUCKET = "strata-e2e-models"
PREFIX = "model"  # the published location's last part: the engines serve the model under this name
CHUNK_BYTES = 1 << 20
HOLD_LIMIT_S = 300.0  # the longest the last turns wait for the new replica
ROTATION_WAIT_S = 30.0


@dataclass(frozen=True)
class DrillPlan:
    start_after: float = 0.3  # share of the run's requests answered when the new replica is started
    first_requests: int = 50  # the new replica's first requests whose TTFT is reported
    wait_deadline: str = "5m"  # strata weights wait --deadline


def _s3_env() -> dict[str, str]:
    from tests.support import s3_servers

    return {"AWS_ACCESS_KEY_ID": s3_servers.ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": s3_servers.SECRET_KEY,
            "AWS_REGION": s3_servers.REGION}


class WeightOrigin:
    """The model in a private S3 bucket (moto, on the host side of the network), published, and a weight
    node per node (``strata weights serve`` in the node's namespace, every other node its peer)."""

    def __init__(self, nodes: Nodes, model_dir: Path) -> None:
        from tests.support import s3_servers

        self.nodes = nodes
        self.home = nodes.scratch / "weights"
        self.home.mkdir(exist_ok=True)
        self.moto = s3_servers.MotoServer(self.home / "moto", host=nodes.net.gateway).wait_ready()
        self.moto.create_bucket(BUCKET)
        self.location = f"s3://{BUCKET}/{PREFIX}"
        self.files = {p.name: p.stat().st_size for p in sorted(model_dir.iterdir())
                      if p.is_file() and not p.name.startswith(".")}
        self._upload(model_dir)
        self.digest = self._publish()
        self.addresses = [f"{n.host}:{free_port()}" for n in nodes.nodes]
        self.caches = [nodes.scratch / n.node_id / "weight-cache" for n in nodes.nodes]
        self.children = [self._serve(i) for i in range(len(nodes.nodes))]

    @property
    def endpoint(self) -> str:
        return self.moto.endpoint

    @property
    def model_bytes(self) -> int:
        return sum(self.files.values())

    def _store(self):
        from obstore.store import S3Store

        from tests.support import s3_servers

        return S3Store(BUCKET, endpoint=self.endpoint, region=s3_servers.REGION, access_key_id=s3_servers.ACCESS_KEY,
                       secret_access_key=s3_servers.SECRET_KEY, client_options={"allow_http": True},
                       virtual_hosted_style_request=False)

    def _upload(self, model_dir: Path) -> None:
        import obstore

        store = self._store()
        for name in self.files:
            obstore.put(store, f"{PREFIX}/{name}", (model_dir / name).read_bytes())

    def _publish(self) -> str:
        from tests.support import s3_servers

        from weightcache import publish_model
        from weightcache.origin import S3OriginOptions

        s3 = S3OriginOptions(endpoint=self.endpoint, region=s3_servers.REGION, access_key_id=s3_servers.ACCESS_KEY,
                             secret_access_key=s3_servers.SECRET_KEY, allow_http=True)
        return publish_model(self.location, s3=s3, chunk_bytes=CHUNK_BYTES).digest

    def _serve(self, i: int) -> Child:
        from tests.support import s3_servers

        argv = [sys.executable, "-m", "weightcache", "serve", "--cache", str(self.caches[i]), "--listen",
                self.addresses[i], "--s3-endpoint", self.endpoint, "--s3-allow-http", "--s3-region", s3_servers.REGION]
        for a in self.addresses:
            argv += ["--peer", a]
        if self.nodes.net.virtual is not None:
            argv.append("--insecure")
        host, port = self.addresses[i].rsplit(":", 1)
        child = Child(f"weights-{i}", self.nodes.net.command(i, argv), self.home / f"weights-{i}.log",
                      lambda h=host, p=int(port): _listening(h, p), env=_s3_env(), start_timeout_s=90)
        return child.spawn()

    def wait_ready(self) -> WeightOrigin:
        for c in self.children:
            c.wait_ready()
        return self

    def _cli(self, *args: str, timeout_s: float = 600.0) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "weightcache", *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=REPO,
                              env={**os.environ, **_s3_env(), "PYTHONPATH": str(REPO)}, check=False)

    def prefetch(self, i: int, deadline: str) -> dict:
        """``strata weights prefetch`` then ``wait`` on node ``i``'s weight node; where the bytes came from."""
        from tests.support import s3_servers

        s3 = ["--s3-endpoint", self.endpoint, "--s3-allow-http", "--s3-region", s3_servers.REGION]
        r = self._cli("prefetch", self.location, self.digest, "--node", self.addresses[i], *s3)
        if r.returncode != 0:
            raise StartFailed(f"strata weights prefetch on node {i} failed:\n{r.stdout[-800:]}{r.stderr[-1500:]}")
        r = self._cli("wait", self.digest, "--node", self.addresses[i], "--deadline", deadline, "--json",
                      "--no-progress")
        if r.returncode != 0:
            raise StartFailed(f"strata weights wait on node {i} failed:\n{r.stdout[-800:]}{r.stderr[-1500:]}")
        try:
            return json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return {"output": r.stdout[-500:]}

    def download(self, out: Path) -> int:
        """The model's files from the bucket into ``out`` (no Strata: what an init container's ``aws s3 cp``
        does); the bytes the origin served."""
        import obstore

        store = self._store()
        out.mkdir(parents=True, exist_ok=True)
        total = 0
        for name in self.files:
            data = obstore.get(store, f"{PREFIX}/{name}").bytes()
            (out / name).write_bytes(bytes(data))
            total += len(data)
        return total

    def close(self) -> None:
        for c in self.children:
            c.stop()
        self.moto.stop()


def _listening(host: str, port: int) -> bool:
    import socket

    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


class ScaleUp:
    """Brings the spare replica up during a run (on its own thread, started by :meth:`observe`)."""

    def __init__(self, fleet: Fleet, origin: WeightOrigin, plan: DrillPlan, clock: Callable[[], float],
                 total: int, *, with_strata: bool, url: str, engine_id: str, model_name: str) -> None:
        self.fleet = fleet
        self.origin = origin
        self.plan = plan
        self.clock = clock
        self.total = total
        self.with_strata = with_strata
        self.url = url
        self.engine_id = engine_id
        self.model_name = model_name
        self.node = fleet.nodes.nodes[fleet.spec.replicas]  # the first spare
        self.events: dict[str, float] = {}
        self.detail: dict = {}
        self.errors: list[str] = []
        self.engine: Child | None = None
        self._due = threading.Event()
        self._done = threading.Event()
        self._finished = threading.Event()  # in rotation, or failed
        self._thread = threading.Thread(target=self._run, name="scale-up", daemon=True)

    def observe(self, records: list[RequestRecord]) -> None:
        answered = sum(1 for r in records if r.done_s is not None or r.error)
        if answered >= self.plan.start_after * self.total:
            self._due.set()

    async def hold(self) -> None:
        """The driver's ``before_last_turn``: the last turns wait (bounded) until the new replica is in the
        router's rotation, or its start failed; a run too short for the schedule brings the start forward."""
        end = self.clock() + HOLD_LIMIT_S
        while not self._finished.is_set() and self.clock() < end:
            self._due.set()
            await asyncio.sleep(0.05)

    def _engine_argv(self, model: str, published: bool) -> list[str]:
        port = int(self.url.rsplit(":", 1)[1])
        phase = self.fleet.phase
        settings = engine_settings(self.fleet.spec, phase, self.node)
        settings["engine_id"] = self.engine_id
        argv = [sys.executable, "-m", "benchmarks.e2e.engine", "--model", model, "--host", self.node.host, "--port",
                str(port), "--block-size", str(BLOCK_SIZE), "--hash-seed", HASH_SEED, "--threads",
                str(self.fleet.spec.engine_threads), "--served-model-name", self.model_name]
        if published:
            argv += ["--model-digest", self.origin.digest, "--weights-cache",
                     str(self.origin.caches[self.node.index]), "--s3-endpoint", self.origin.endpoint]
        flags = {"engine_id": "--engine-id", "prefix_cache": "--prefix-cache", "cache_blocks": "--cache-blocks",
                 "max_queue": "--max-queue", "kv_events": "--kv-events", "kv_events_replay": "--kv-events-replay",
                 "strata": "--strata", "namespace": "--namespace"}
        for field, value in settings.items():
            if value != "":
                argv += [flags[field], str(value)]
        return self.fleet.nodes.net.command(self.node.index, argv)

    def _run(self) -> None:
        try:
            while not self._due.wait(0.05):
                if self._done.is_set():
                    return
            self.events["started"] = self.clock()
            if self.with_strata:
                self.detail["weights"] = self.origin.prefetch(self.node.index, self.plan.wait_deadline)
                self.events["weights_warm"] = self.clock()
                argv = self._engine_argv(self.origin.location, published=True)
            else:
                folder = self.fleet.nodes.scratch / self.node.node_id / f"downloaded-{self.fleet.phase.name}"
                self.detail["origin_bytes"] = self.origin.download(folder)
                self.events["weights_downloaded"] = self.clock()
                argv = self._engine_argv(str(folder), published=False)
            self.engine = Child(self.engine_id, argv, self.fleet.nodes.scratch / f"{self.engine_id}.log",
                                lambda: http_ok(self.url + "/health"), env={"PYTHONPATH": str(REPO), **_s3_env()},
                                start_timeout_s=240)
            self.engine.start()
            self.events["engine_ready"] = self.clock()
            self._wait_in_rotation()
        except (StartFailed, OSError, subprocess.SubprocessError) as e:
            log.error("the scale-up failed: %s", e)
            self.errors.append(f"{type(e).__name__}: {str(e)[-1500:]}")
        finally:
            self._finished.set()
        self._done.wait()  # stay: the engine dies with the thread that started it (PR_SET_PDEATHSIG)

    def _wait_in_rotation(self) -> None:
        """Until the router's health checks take the new endpoint in (it is listed after the replicas)."""
        label = (("endpoint", str(len(self.fleet.replicas))),)
        end = self.clock() + ROTATION_WAIT_S
        while self.clock() < end and not self._done.is_set():
            if self.fleet.router_metrics().get(("strata_router_endpoint_healthy", label)) == 1:
                self.events["in_rotation"] = self.clock()
                return
            self._done.wait(0.05)
        self.errors.append(f"the router did not take the new replica into rotation within {ROTATION_WAIT_S:.0f} s")

    def report(self, records: list[RequestRecord]) -> dict:
        mine = sorted((r for r in records if r.engine_id == self.engine_id and r.ok), key=lambda r: r.sent_s)
        start = self.events.get("started")
        first = min((r.first_token_s for r in mine), default=None)
        weights = self.detail.get("weights") or {}
        by_source = weights.get("bytes_by_source") if isinstance(weights, dict) else None
        origin_bytes = self.detail.get("origin_bytes")
        if origin_bytes is None and isinstance(by_source, dict):
            origin_bytes = sum(int(v) for k, v in by_source.items() if "origin" in str(k))
        firsts = mine[: self.plan.first_requests]
        return {
            "with_strata": self.with_strata,
            "started_s": start,
            "steps_s": {k: round(v - start, 3) for k, v in self.events.items() if start is not None},
            "time_to_ready_s": None if first is None or start is None else round(first - start, 3),
            "origin_bytes": origin_bytes,
            "model_bytes": self.origin.model_bytes,
            "weights": weights,
            "requests_served": len(mine),
            "first_requests_ttft_s": Summary.of(r.ttft_s for r in firsts).to_json(),
            "first_requests_hit_ratio": (round(sum(r.cached_tokens for r in firsts)
                                               / max(1, sum(r.prompt_tokens for r in firsts)), 3) if firsts else None),
            "first_requests_ttft_median_s": round(statistics.median(r.ttft_s for r in firsts), 4) if firsts else None,
            "errors": self.errors,
        }

    def __enter__(self) -> ScaleUp:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(60)
        if self.engine is not None:
            self.engine.stop()
