"""Index churn: how often the prefix index names a holder that lacks the block, or misses one that has it.

Run as ``python -m benchmarks.index_churn [--quick | --smoke] [--seconds N]``. Three
``strata serve`` processes share one private ``redis-server`` index, each
with a small RAM and disk tier (so puts evict), while a driver loop

- puts blocks of 256 KiB to a random node, from a key space several times
  what the cluster holds (evictions on every node, all the time), and now
  and then deletes some, in a thread of its own that never pauses;
- restarts a node every few seconds, alternating SIGKILL (its crash-safe
  RAM and its disk are re-adopted at a new epoch) and SIGTERM (a drain);
- samples: a batch of keys, the index's holders of each (one ``Holders``
  call through a live daemon, as a router asks), then every node's own
  answer (``Exists``, one key at a time: side-effect free), then the
  index again.

Counted per (key, node) pair:

- **false hit**: the index names the node as a holder, the node does not
  have the block. ``raw`` uses the index read before the nodes were asked
  (a block evicted in between counts: what a router acting on that answer
  would meet); ``settled`` only counts pairs the index still names in the
  read after (staleness that outlived the sample, ~0.1-0.5 s). A named
  holder that is down (restarting) is counted apart: it cannot be asked,
  and a router would find it unreachable (its entries stop counting when it
  re-joins at a new epoch, or when its TTL lapses).
- **false miss**: the node has the block, the index does not name it:
  ``raw`` against the read after, ``settled`` against both reads.

Rates are per named pair (false hits) and per held pair (false misses). The
figures are written to ``benchmarks/results/index_churn.json``. They are
measurements of this machine and this load, not claims about a fleet: the
publication lag the raw rates include is the index agent's batching
(``flush_s`` 50 ms) plus the Redis round trips, on 2 shared cores.

``--smoke`` churns about a second, long enough for one restart of each kind
(SIGKILL, then SIGTERM) and a few samples, and writes no results.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import hashlib
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.harness import RESULTS_DIR, SMOKE_HELP, free_port, private_redis, smoke_line
from kvstore.client.sync import Client
from kvstore.errors import StrataError

NAME = "index_churn"
NS = "churn"
BLOCK = 256 << 10
KEYS = 1200  # the key space: about four times what the three nodes hold together
SAMPLE_KEYS = 48
FULL = dict(seconds=180, restart_every_s=10.0, sample_every_s=0.5)
QUICK = dict(seconds=40, restart_every_s=6.0, sample_every_s=0.5)
SMOKE = dict(seconds=1, restart_every_s=0.2, sample_every_s=0.1, min_restarts=2)  # one SIGKILL, one SIGTERM
TTL_S = 3.0
START_TIMEOUT_S = 60.0


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def key_of(i: int) -> bytes:
    return hashlib.blake2b(f"churn/{i}".encode(), digest_size=16).digest()


class Node:
    """``strata serve`` as a child process, restartable on the same directory (a new epoch)."""

    def __init__(self, home: Path, name: str, index_url: str) -> None:
        self.name = name
        self.home = home / name
        self.home.mkdir(parents=True, exist_ok=True)
        self.target = f"127.0.0.1:{free_port()}"
        self.log = self.home / "daemon.log"
        self.args = [
            "--node-id", name, "--listen", self.target, "--metrics-listen", "",
            "--disk-dir", str(self.home / "cache"), "--shm-dir", str(self.home), "--ram-bytes", "24MiB",
            "--disk-bytes", "48MiB", "--max-block-bytes", "1MiB", "--index-url", index_url,
            "--index-ttl-seconds", str(TTL_S), "--tiers", "ram,disk", "--log-format", "text",
            "--log-level", "WARNING",
        ]
        self.proc: subprocess.Popen | None = None
        self.client: Client | None = None

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.client is not None

    def start(self) -> Node:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                            os.environ.get("PYTHONPATH", "")])}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli.main", "serve", *self.args],
                                         stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)
        end = time.monotonic() + START_TIMEOUT_S
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > end:
                raise SystemExit(f"{self.name} did not start (log {self.log}):\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)
        self.client = Client(self.target, use_shm=False, timeout=5.0, retries=0)
        return self

    def _healthy(self) -> bool:
        try:
            with grpc.insecure_channel(self.target) as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                return r.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def stop(self, sig: int) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Counts:
    samples: int = 0
    named: int = 0  # (key, node) pairs the index named, node up
    held: int = 0  # (key, node) pairs a node held
    false_hits_raw: int = 0
    false_hits_settled: int = 0
    false_misses_raw: int = 0
    false_misses_settled: int = 0
    named_down: int = 0  # pairs naming a node that was down at the time
    puts: int = 0
    deletes: int = 0
    restarts: dict[str, int] = field(default_factory=lambda: {"sigkill": 0, "sigterm": 0})
    skipped_samples: int = 0  # an RPC failed mid-sample (a node went down): the sample is dropped

    def rates(self) -> dict[str, float | None]:
        def r(n: int, d: int) -> float | None:
            return None if not d else n / d
        return {
            "false_hit_rate_raw": r(self.false_hits_raw, self.named),
            "false_hit_rate_settled": r(self.false_hits_settled, self.named),
            "false_miss_rate_raw": r(self.false_misses_raw, self.held),
            "false_miss_rate_settled": r(self.false_misses_settled, self.held),
            "named_down_share": r(self.named_down, self.named + self.named_down),
        }


def holders(node: Node, keys: list[bytes]) -> list[set[str]]:
    return [{h.node_id for h in held} for held in node.client.holders(NS, keys=keys)]


def sample(nodes: list[Node], rng: random.Random, counts: Counts) -> None:
    live = [n for n in nodes if n.up]
    if not live:
        return
    asker = rng.choice(live)
    keys = [key_of(i) for i in rng.sample(range(KEYS), SAMPLE_KEYS)]
    try:
        before = holders(asker, keys)
        have = {n.name: [bool(n.client.exists(NS, [k])) for k in keys] for n in live}
        after = holders(asker, keys)
    except grpc.RpcError:
        counts.skipped_samples += 1
        return
    up = set(have)
    counts.samples += 1
    for i in range(len(keys)):
        for name in before[i] - up:
            counts.named_down += 1
        for name in up:
            held = have[name][i]
            if name in before[i]:
                counts.named += 1
                if not held:
                    counts.false_hits_raw += 1
                    counts.false_hits_settled += name in after[i]
            if held:
                counts.held += 1
                if name not in after[i]:
                    counts.false_misses_raw += 1
                    counts.false_misses_settled += name not in before[i]


def write_load(nodes: list[Node], rng: random.Random, counts: Counts, stop: threading.Event) -> None:
    """Puts (and a few deletes) to random live nodes until ``stop``: the eviction churn."""
    payload = os.urandom(BLOCK)
    while not stop.is_set():
        live = [n.client for n in nodes if n.up]
        if not live:
            time.sleep(0.01)
            continue
        client = rng.choice(live)
        i = rng.randrange(KEYS)
        try:
            if rng.random() < 0.05:
                client.delete(NS, [key_of(j) for j in range(i, min(KEYS, i + 4))])
                counts.deletes += 1
            else:  # the block's bytes: its index in front of one shared random payload
                client.put(NS, key_of(i), i.to_bytes(4, "big") + payload[4:])
                counts.puts += 1
        except (grpc.RpcError, StrataError, ValueError):
            pass  # a node going down under the call, or a full RAM (RESOURCE_EXHAUSTED): part of the churn


def drive(nodes: list[Node], plan: dict, rng: random.Random) -> Counts:
    """Samples and restarts here; puts and deletes in a thread of their own, all the time."""
    counts = Counts()
    stop = threading.Event()
    writer = threading.Thread(target=write_load, args=(nodes, random.Random(rng.random()), counts, stop), daemon=True)
    writer.start()
    try:
        end = time.monotonic() + plan["seconds"]
        next_restart = time.monotonic() + plan["restart_every_s"]
        kill = True
        restarts = 0
        while time.monotonic() < end or restarts < plan.get("min_restarts", 0):
            if time.monotonic() >= next_restart:
                victim = rng.choice(nodes)
                victim.stop(signal.SIGKILL if kill else signal.SIGTERM)
                counts.restarts["sigkill" if kill else "sigterm"] += 1
                for _ in range(3):  # sample while it is down
                    sample(nodes, rng, counts)
                victim.start()
                restarts += 1
                kill = not kill
                next_restart = time.monotonic() + plan["restart_every_s"]
            sample(nodes, rng, counts)
            time.sleep(plan["sample_every_s"])
    finally:
        stop.set()
        writer.join(30)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help=f"{QUICK['seconds']} s of churn instead of {FULL['seconds']}")
    size.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--seconds", type=float, help="how long to churn (overrides --quick)")
    parser.add_argument("--seed", type=int, default=1729)
    args = parser.parse_args(argv)
    plan = dict(SMOKE if args.smoke else QUICK if args.quick else FULL)
    if args.seconds:
        plan["seconds"] = args.seconds
    rng = random.Random(args.seed)
    started = time.monotonic()
    with private_redis() as port, tempfile.TemporaryDirectory(prefix="strata-churn-") as home:
        url = f"redis://127.0.0.1:{port}/0"
        nodes = [Node(Path(home), f"n{i}", url).start() for i in range(3)]
        try:
            counts = drive(nodes, plan, rng)
        finally:
            for n in nodes:
                n.stop(signal.SIGTERM)
    rates = counts.rates()
    doc = {
        "benchmark": NAME,
        "command": f"python -m benchmarks.{NAME}" + (" --quick" if args.quick else ""),
        "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "plan": {**plan, "nodes": 3, "block_bytes": BLOCK, "keys": KEYS, "sample_keys": SAMPLE_KEYS,
                 "ttl_s": TTL_S, "ram_bytes_per_node": 24 << 20, "disk_bytes_per_node": 48 << 20},
        "counts": asdict(counts),
        "rates": {k: (None if v is None else float(f"{v:.4g}")) for k, v in rates.items()},
    }
    path = None
    if not args.smoke:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        path = RESULTS_DIR / f"{NAME}.json"
        path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{counts.samples} samples ({counts.skipped_samples} dropped), {counts.puts} puts, {counts.deletes} deletes, "
          f"restarts {counts.restarts}, in {time.monotonic() - started:.0f} s")
    print(f"named (key, node) pairs {counts.named}, held pairs {counts.held}, named while down {counts.named_down}")
    for k, v in rates.items():
        print(f"  {k:26} {'n/a' if v is None else f'{100 * v:.3f}%'}")
    print(smoke_line(NAME) if path is None else f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
