"""Model weights: time to first tensor, warm loads against safetensors and a plain read, and a swarm's origin bytes.

Run as ``python -m benchmarks.weights [--quick]``. A model of ``--shards``
safetensors files (float16 matrices, about 16 MiB each) is written to a
scratch folder (the origin: a local folder, so the figures are the
pipeline's, not a network's) and published with 4 MiB chunks. Then:

- **cold**: ``open_model`` into an empty node cache, iterating every tensor
  (each copied into a preallocated buffer, as an engine copies into its
  parameters): the time to the first tensor, the time to all of them, and
  their ratio (streaming means the first tensor comes long before the rest);
- **warm**: the same load from the filled cache (no origin), against
  ``safetensors.safe_open(framework="numpy")`` over the origin's files with
  the same copies, and against a sequential ``readinto`` of the files (the
  floor: bytes off the page cache, no parsing, no copy out); each run once
  to warm the page cache, then timed ``--repeat`` times, the best kept;
- **swarm**: four weight node processes (``strata weights serve --peer``)
  prefetch the model at once; the origin bytes are the sum of what each
  node verified from the origin (``Status.bytes_by_source``), divided by
  the model's size.

Figures go to ``benchmarks/results/weights.json``: measurements of this
machine (2 shared cores, page cache warm), not claims about a fleet.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

NAME = "weights"
ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
CHUNK = 4 << 20


def write_model(folder: Path, shards: int, seed: int = 0) -> int:
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for s in range(shards):
        tensors = {f"layers.{s}.{k}.weight": rng.standard_normal((1024, 2048), dtype=np.float32).astype(np.float16)
                   for k in range(4)}
        save_file(tensors, str(folder / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"))
    (folder / "config.json").write_text('{"architectures": ["Bench"]}')
    return sum(p.stat().st_size for p in folder.iterdir())


def copy_all(pairs, out: dict, start: float) -> float:
    """Iterate (name, array) pairs copying each into its buffer; the time from ``start`` to the first."""
    first = None
    for name, arr in pairs:
        np.copyto(out[name], arr)
        if first is None:
            first = time.perf_counter() - start
    return first


def load_strata(location: str, digest: str, cache: Path, out: dict) -> tuple[float, float]:
    import weightcache

    start = time.perf_counter()
    with weightcache.open_model(location, digest, cache_dir=cache) as model:
        first = copy_all(model, out, start)  # from before the open: manifest, cache, first chunks
    return first, time.perf_counter() - start


def load_safe_open(folder: Path, out: dict) -> float:
    from safetensors import safe_open

    start = time.perf_counter()
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as f:
            for name in f.keys():
                np.copyto(out[name], f.get_tensor(name))
    return time.perf_counter() - start


def read_sequential(folder: Path, buffer: bytearray) -> float:
    start = time.perf_counter()
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
    return time.perf_counter() - start


def swarm(location: str, digest: str, total: int, scratch: Path, nodes: int = 4) -> dict:
    import grpc

    from weightcache.api.v1 import weights_pb2 as pb
    from weightcache.api.v1 import weights_pb2_grpc as pb_grpc
    from weightcache.peers import CHANNEL_OPTIONS

    def free_port() -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    members = [f"127.0.0.1:{free_port()}" for _ in range(nodes)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = []
    for i, a in enumerate(members):
        args = [sys.executable, "-m", "weightcache", "serve", "--cache", str(scratch / f"node{i}"), "--listen", a]
        for m in members:
            args += ["--peer", m]
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    stubs = [pb_grpc.WeightServiceStub(grpc.insecure_channel(a, options=CHANNEL_OPTIONS)) for a in members]
    try:
        for s in stubs:
            for _ in range(600):
                try:
                    s.Status(pb.StatusRequest(digest="0" * 64), timeout=2)
                    break
                except grpc.RpcError:
                    time.sleep(0.05)
        start = time.perf_counter()
        threads = [threading.Thread(target=lambda s=s: s.Prefetch(pb.PrefetchRequest(location=location, digest=digest),
                                                                  timeout=120)) for s in stubs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done = {}
        while len(done) < nodes:
            for i, s in enumerate(stubs):
                if i not in done:
                    st = s.Status(pb.StatusRequest(digest=digest), timeout=10)
                    if st.state == pb.PREFETCH_STATE_FAILED:
                        raise SystemExit(f"node {i}: {st.error}")
                    if st.state == pb.PREFETCH_STATE_COMPLETE:
                        done[i] = dict(st.bytes_by_source)
            time.sleep(0.05)
        elapsed = time.perf_counter() - start
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(30)
    origin = sum(d.get("origin", 0) for d in done.values())
    return {"nodes": nodes, "seconds": round(elapsed, 3), "origin_bytes": origin, "model_bytes": total,
            "origin_bytes_per_model_byte": round(origin / total, 4),
            "peer_bytes": sum(d.get("peer", 0) for d in done.values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 4-shard model (about 64 MiB), 2 repeats")
    parser.add_argument("--shards", type=int, default=16, help="safetensors files of about 16 MiB each [16]")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.quick:
        args.shards, args.repeat = 4, 2
    import weightcache

    scratch = Path(tempfile.mkdtemp(prefix="strata-weights-bench-"))
    try:
        folder = scratch / "origin"
        total = write_model(folder, args.shards)
        manifest = weightcache.publish_model(str(folder), chunk_bytes=CHUNK)
        out = {t.name: np.empty(t.shape, dtype=np.float16) for _, t in manifest.tensors()}
        cold_first, cold_total = load_strata(str(folder), manifest.digest, scratch / "cold", out)
        warm = [load_strata(str(folder), manifest.digest, scratch / "cold", out)[1] for _ in range(args.repeat + 1)][1:]
        safe = [load_safe_open(folder, out) for _ in range(args.repeat + 1)][1:]
        buffer = bytearray(16 << 20)
        seq = [read_sequential(folder, buffer) for _ in range(args.repeat + 1)][1:]
        swarm_doc = swarm(str(folder), manifest.digest, manifest.total_bytes, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    doc = {
        "benchmark": NAME,
        "command": " ".join(["python -m benchmarks." + NAME, *sys.argv[1:]]),
        "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "model": {"files": len(manifest.files), "bytes": total, "tensors": len(out), "chunk_bytes": CHUNK},
        "cold": {"first_tensor_s": round(cold_first, 4), "all_tensors_s": round(cold_total, 4),
                 "first_over_all": round(cold_first / cold_total, 4)},
        "warm": {"strata_s": round(min(warm), 4), "safe_open_s": round(min(safe), 4),
                 "sequential_read_s": round(min(seq), 4),
                 "strata_gbps": round(total / min(warm) / 1e9, 3), "safe_open_gbps": round(total / min(safe) / 1e9, 3),
                 "sequential_read_gbps": round(total / min(seq) / 1e9, 3)},
        "swarm": swarm_doc,
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{NAME}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
