"""Model weights: time to first tensor, warm and cold loads against their baselines, and swarms of weight nodes.

Run as ``python -m benchmarks.weights [--quick | --smoke]``. A model of ``--shards``
safetensors files (written by the safetensors library: float16 matrices of
4 MiB, 16 MiB a file; 64 files, 1 GiB, by default) is published with 4 MiB
chunks into a scratch folder, and the same files and manifest are uploaded
to a private moto S3 server (``tests/support/s3_servers.py``, on loopback). Then, in
one run, each case's baseline alternating with it in rotating order
(``--rounds``, median kept):

- **first tensor**: ``open_model`` from the folder into an empty node cache,
  every tensor copied into a preallocated buffer (as an engine copies into
  its parameters): time to the first tensor ÷ time to all of them, both
  counted from before the open (manifest, cache, first chunks);
- **warm**: the same load from the filled node cache against
  ``safetensors.safe_open(framework="numpy")`` over the folder's files with
  the same copies, a sequential ``readinto`` of the files into one reused
  buffer (no parsing, no copy out: the floor), and ``runai-model-streamer``
  on CPU with the same copies (a note when it is not installed);
- **cold from S3**: ``open_model`` from moto into an empty node cache against
  obstore's raw ranged GETs of the same files, the same ranges (one per
  chunk) and the same concurrency (8), bytes dropped. moto reads the whole
  object for every ranged GET, so both pay it alike (and whole-object GETs
  are timed once, for scale);
- **swarms**: 4 and 8 weight nodes (``strata weights serve --peer``, one
  process each) prefetch the model from moto at once: origin bytes (what the
  nodes verified from the origin, ``Status.bytes_by_source``) ÷ model size,
  against independent pulls (N×, computed: each node would fetch every
  chunk), and the time against the bound max(F/u_origin, F/d,
  N·F/(u_origin + N·u_peer)) with u_origin the raw ranged-GET rate above,
  d one node's prefetch rate from the folder (origin out of the way), and
  u_peer one node's ReadChunk rate to one reader (all chunks, 4 at once, as
  a swarm member asks), all measured in this run. The nodes share 2 cores
  here, so the bound (independent links) is not reachable; it is reported.

Figures go to ``benchmarks/results/weights.json`` (shared BENCHMARKS.md
format, plus the raw figures): measurements of this machine, not claims
about a fleet. ``--smoke`` runs every case once on one file (16 MiB) with a
swarm of 2, no warm-up, and writes no results.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
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
CONCURRENCY = 8  # FetchLimits' default origin_concurrency, and the raw baseline's
BUCKET = "strata-bench"
PREFIX = "bench/rev1"
TARGETS = {"first_over_all": 0.05, "first_over_all_goal": 0.02, "warm_vs_safe_open": 1.1,
           "warm_vs_sequential": 0.8, "cold_s3_vs_raw": 0.8, "swarm_origin": 1.1, "swarm_origin_goal": 1.05}
SMOKE = dict(shards=1, rounds=1, nodes=[2], warmup=0)


def write_model(folder: Path, shards: int, seed: int = 0) -> int:
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for s in range(shards):
        tensors = {f"layers.{s}.{k}.weight": rng.standard_normal((1024, 2048), dtype=np.float32).astype(np.float16)
                   for k in range(4)}
        save_file(tensors, str(folder / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"))
    (folder / "config.json").write_text('{"architectures": ["Bench"]}')
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def shards_of(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


# ---- loads (each returns seconds, or (first, all) seconds) --------------------------


def copy_all(pairs, out: dict, start: float) -> float:
    """Copy each (name, array) into its buffer; the time from ``start`` to the first."""
    first = None
    for name, arr in pairs:
        np.copyto(out[name], arr)
        if first is None:
            first = time.perf_counter() - start
    return first


def load_strata(location: str, digest: str, cache: Path, out: dict, s3=None) -> tuple[float, float]:
    import weightcache

    start = time.perf_counter()
    with weightcache.open_model(location, digest, cache_dir=cache, s3=s3) as model:
        first = copy_all(model, out, start)
    return first, time.perf_counter() - start


def load_safe_open(folder: Path, out: dict) -> float:
    from safetensors import safe_open

    start = time.perf_counter()
    for path in shards_of(folder):
        with safe_open(str(path), framework="numpy") as f:
            for name in f.keys():
                np.copyto(out[name], f.get_tensor(name))
    return time.perf_counter() - start


def read_sequential(folder: Path, buffer: bytearray) -> float:
    start = time.perf_counter()
    for path in shards_of(folder):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
    return time.perf_counter() - start


def runai_available() -> str | None:
    """None when runai-model-streamer runs here; otherwise why not."""
    try:
        import runai_model_streamer  # noqa: F401
    except ImportError as err:
        return f"runai-model-streamer is not installed ({err}): pip install runai-model-streamer"
    return None


def load_runai(folder: Path, out: dict) -> float:
    from runai_model_streamer import SafetensorsStreamer

    start = time.perf_counter()
    with SafetensorsStreamer() as streamer:
        streamer.stream_files([str(p) for p in shards_of(folder)])
        for name, tensor in streamer.get_tensors():
            np.copyto(out[name], tensor.numpy())
    return time.perf_counter() - start


# ---- S3 (moto) -------------------------------------------------------------------


def s3_options(endpoint: str):
    from tests.support import s3_servers

    from weightcache.origin import S3OriginOptions

    return S3OriginOptions(endpoint=endpoint, region=s3_servers.REGION, access_key_id=s3_servers.ACCESS_KEY,
                     secret_access_key=s3_servers.SECRET_KEY, allow_http=True)


def raw_store(endpoint: str):
    from tests.support import s3_servers
    from obstore.store import S3Store

    return S3Store(BUCKET, endpoint=endpoint, region=s3_servers.REGION, access_key_id=s3_servers.ACCESS_KEY,
                   secret_access_key=s3_servers.SECRET_KEY, client_options={"allow_http": True},
                   virtual_hosted_style_request=False)


def upload(folder: Path, endpoint: str) -> None:
    """The folder as published (files and ``.strata/`` catalog) under s3://BUCKET/PREFIX/."""
    import obstore

    store = raw_store(endpoint)
    paths = [p for p in sorted(folder.rglob("*")) if p.is_file()]

    async def go():
        gate = asyncio.Semaphore(4)

        async def one(p: Path):
            async with gate:
                await obstore.put_async(store, f"{PREFIX}/{p.relative_to(folder).as_posix()}", p.read_bytes())

        await asyncio.gather(*(one(p) for p in paths))

    asyncio.run(go())


def raw_ranged_gets(manifest, endpoint: str) -> float:
    """Every chunk's byte range of every file, CONCURRENCY GETs at once, bytes dropped."""
    import obstore

    store = raw_store(endpoint)
    ranges = [(f.path, *f.chunk_span(c, manifest.chunk_bytes)) for f in manifest.files for c in range(len(f.chunks))]

    async def go():
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(path, begin, end):
            async with gate:
                data = await obstore.get_range_async(store, f"{PREFIX}/{path}", start=begin, end=end)
                assert len(data) == end - begin

        start = time.perf_counter()
        await asyncio.gather(*(one(*r) for r in ranges))
        return time.perf_counter() - start

    return asyncio.run(go())


def raw_whole_gets(manifest, endpoint: str) -> float:
    import obstore

    store = raw_store(endpoint)

    async def go():
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(path):
            async with gate:
                result = await obstore.get_async(store, f"{PREFIX}/{path}")
                await result.bytes_async()

        start = time.perf_counter()
        await asyncio.gather(*(one(f.path) for f in manifest.files))
        return time.perf_counter() - start

    return asyncio.run(go())


# ---- weight nodes ----------------------------------------------------------------


class Nodes:
    """``strata weights serve`` processes, a swarm when more than one."""

    def __init__(self, scratch: Path, count: int, endpoint: str | None, tag: str) -> None:
        import grpc
        from tests.support import s3_servers

        from weightcache.api.v1 import weights_pb2_grpc as pb_grpc
        from weightcache.peers import CHANNEL_OPTIONS

        self.members = [f"127.0.0.1:{s3_servers.free_port()}" for _ in range(count)]
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "AWS_ACCESS_KEY_ID": s3_servers.ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": s3_servers.SECRET_KEY}
        self.procs = []
        for i, a in enumerate(self.members):
            args = [sys.executable, "-m", "weightcache", "serve", "--cache", str(scratch / f"{tag}-node{i}"),
                    "--listen", a]
            if endpoint:
                args += ["--s3-endpoint", endpoint, "--s3-allow-http", "--s3-region", s3_servers.REGION]
            if count > 1:
                for m in self.members:
                    args += ["--peer", m]
            self.procs.append(subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self.channels = [grpc.insecure_channel(a, options=CHANNEL_OPTIONS) for a in self.members]
        self.stubs = [pb_grpc.WeightServiceStub(c) for c in self.channels]

    def wait_ready(self) -> None:
        import socket

        import grpc

        from weightcache.api.v1 import weights_pb2 as pb

        # The port first: a channel whose first connection is refused waits out gRPC's reconnect backoff
        # (seconds) before it tries again, long after the node is up.
        for a, p in zip(self.members, self.procs):
            host, port = a.rsplit(":", 1)
            end = time.monotonic() + 60
            while p.poll() is None and time.monotonic() < end:
                try:
                    socket.create_connection((host, int(port)), timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.02)
        for s in self.stubs:
            for _ in range(1200):
                try:
                    s.Status(pb.StatusRequest(digest="0" * 64), timeout=2)
                    break
                except grpc.RpcError:
                    time.sleep(0.05)
            else:
                raise SystemExit("a weight node did not start")

    def prefetch_all(self, location: str, digest: str) -> tuple[float, list[dict]]:
        """Every node prefetches the model at once; (seconds until all are complete, bytes by source each)."""
        from weightcache.api.v1 import weights_pb2 as pb

        start = time.perf_counter()
        threads = [threading.Thread(target=lambda s=s: s.Prefetch(pb.PrefetchRequest(location=location, digest=digest),
                                                                  timeout=300)) for s in self.stubs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done: dict[int, dict] = {}
        while len(done) < len(self.stubs):
            for i, s in enumerate(self.stubs):
                if i not in done:
                    st = s.Status(pb.StatusRequest(digest=digest), timeout=10)
                    if st.state == pb.PREFETCH_STATE_FAILED:
                        raise SystemExit(f"node {i}: {st.error}")
                    if st.state == pb.PREFETCH_STATE_COMPLETE:
                        done[i] = dict(st.bytes_by_source)
            time.sleep(0.02)
        return time.perf_counter() - start, [done[i] for i in range(len(self.stubs))]

    def close(self) -> None:
        for c in self.channels:
            c.close()
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(30)


def peer_read_rate(address: str, manifest) -> float:
    """Seconds for one reader to get every chunk from one node's ReadChunk, 4 at once (a swarm member's
    per-peer concurrency)."""
    from weightcache.peers import PeerChunkSource
    from weightcache.sources import ChunkRef

    async def go():
        peer = PeerChunkSource(address, manifest.digest, concurrency=4)
        refs = [ChunkRef.of(manifest, f, c) for f, e in enumerate(manifest.files) for c in range(len(e.chunks))]
        gate = asyncio.Semaphore(4)

        async def one(ref):
            async with gate:
                into = memoryview(bytearray(ref.length))
                assert await peer.read(ref, into) is not None

        start = time.perf_counter()
        await asyncio.gather(*(one(r) for r in refs))
        seconds = time.perf_counter() - start
        await peer.close()
        return seconds

    return asyncio.run(go())


# ---- the run ---------------------------------------------------------------------


def rotate(fns: dict, rounds: int, warmup: int = 1) -> dict[str, list]:
    """Each function once per round, the order rotating; every sample kept, the warm-up dropped."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    out: dict[str, list] = {n: [] for n in names}
    for r in range(rounds):
        shift = r % len(names)
        for n in names[shift:] + names[:shift]:
            out[n].append(fns[n]())
    return out


def case(name: str, metric: str, unit: str, value, baseline: str, baseline_value, *, higher: bool,
         target, ratio=None, note: str | None = None) -> dict:
    if ratio is None and value is not None and baseline_value:
        ratio = value / baseline_value
    met = None if target is None or ratio is None else (ratio >= target if higher else ratio <= target)
    doc = {"case": name, "metric": metric, "unit": unit, "value": _r(value), "baseline": baseline,
           "baseline_value": _r(baseline_value), "ratio": _r(ratio), "higher_is_better": higher,
           "target_ratio": target, "meets_target": met}
    if note:
        doc["note"] = note
    return doc


def _r(x, digits: int = 4):
    return None if x is None else float(f"{x:.{digits}g}")


def main(argv: list[str] | None = None) -> int:
    from benchmarks.harness import SMOKE_HELP, smoke_line

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="4 files (64 MiB), 5 rounds, a swarm of 4 only")
    size.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP} (1 file, 1 round, a swarm of 2)")
    parser.add_argument("--shards", type=int, default=64, help="safetensors files of 16 MiB each [64: 1 GiB]")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per alternating case [5]")
    parser.add_argument("--nodes", type=int, action="append", help="swarm sizes [4 and 8]")
    args = parser.parse_args(argv)
    warmup = 1
    if args.quick:
        args.shards, args.nodes = 4, args.nodes or [4]
    if args.smoke:
        args.shards, args.rounds, args.nodes, warmup = (SMOKE[k] for k in ("shards", "rounds", "nodes", "warmup"))
    nodes = args.nodes or [4, 8]
    from tests.support import s3_servers

    import weightcache

    scratch = Path(tempfile.mkdtemp(prefix="strata-weights-bench-"))
    moto = None
    raw: dict = {}
    try:
        folder = scratch / "origin"
        total = write_model(folder, args.shards)
        manifest = weightcache.publish_model(str(folder), chunk_bytes=CHUNK)
        F = manifest.total_bytes
        out = {t.name: np.zeros(t.shape, dtype=np.float16) for _, t in manifest.tensors()}
        print(f"model: {len(manifest.files)} files, {F / 2**30:.2f} GiB, {len(out)} tensors", file=sys.stderr)

        # first tensor, cold from the folder: a fresh cache each round (cleared outside the timing)
        def cold_local():
            shutil.rmtree(scratch / "cold", ignore_errors=True)
            return load_strata(str(folder), manifest.digest, scratch / "cold", out)

        cold = [cold_local() for _ in range(args.rounds)]
        raw["cold_local"] = [{"first_tensor_s": _r(f), "all_tensors_s": _r(a)} for f, a in cold]
        ratios = [f / a for f, a in cold]
        print(f"first tensor: {statistics.median(ratios):.4f} of all", file=sys.stderr)

        # warm: the cache filled by the last cold round
        buffer = bytearray(16 << 20)
        warm_fns = {
            "strata": lambda: load_strata(str(folder), manifest.digest, scratch / "cold", out)[1],
            "safe_open": lambda: load_safe_open(folder, out),
            "sequential": lambda: read_sequential(folder, buffer),
        }
        runai_note = runai_available()
        if runai_note is None:
            warm_fns["runai"] = lambda: load_runai(folder, out)
        warm = {k: statistics.median(v) for k, v in rotate(warm_fns, args.rounds, warmup).items()}
        raw["warm_s"] = {k: _r(v) for k, v in warm.items()}
        print(f"warm: {raw['warm_s']}", file=sys.stderr)

        # cold from S3
        moto = s3_servers.start_moto(scratch / "moto")
        moto.create_bucket(BUCKET)
        upload(folder, moto.endpoint)
        location = f"s3://{BUCKET}/{PREFIX}"
        s3 = s3_options(moto.endpoint)

        def cold_s3():
            shutil.rmtree(scratch / "cold-s3", ignore_errors=True)
            return load_strata(location, manifest.digest, scratch / "cold-s3", out, s3=s3)

        s3_runs = rotate({"strata": cold_s3, "raw": lambda: raw_ranged_gets(manifest, moto.endpoint)}, args.rounds,
                         warmup)
        s3_strata = statistics.median(a for _, a in s3_runs["strata"])
        s3_first = statistics.median(f / a for f, a in s3_runs["strata"])
        s3_raw = statistics.median(s3_runs["raw"])
        whole = raw_whole_gets(manifest, moto.endpoint)
        raw["cold_s3"] = {"strata_s": [_r(a) for _, a in s3_runs["strata"]], "raw_ranged_s": [_r(x) for x in s3_runs["raw"]],
                          "raw_whole_object_s": _r(whole), "first_over_all": _r(s3_first)}
        print(f"cold s3: strata {s3_strata:.3f}s raw ranged {s3_raw:.3f}s whole {whole:.3f}s", file=sys.stderr)

        # d: one weight node's prefetch from the folder (the origin out of the way)
        single = Nodes(scratch, 1, None, "single")
        try:
            single.wait_ready()
            d_s, _ = single.prefetch_all(str(folder), manifest.digest)
        finally:
            single.close()
        u_origin, d = F / s3_raw, F / d_s
        swarms, u_peers = [], []
        for n in nodes:
            group = Nodes(scratch, n, moto.endpoint, f"swarm{n}")
            try:
                group.wait_ready()
                seconds, by_source = group.prefetch_all(location, manifest.digest)
                u_peer = F / peer_read_rate(group.members[0], manifest)
            finally:
                group.close()
            for i in range(n):
                shutil.rmtree(scratch / f"swarm{n}-node{i}", ignore_errors=True)
            u_peers.append(u_peer)
            origin = sum(b.get("origin", 0) for b in by_source)
            bound = max(F / u_origin, F / d, n * F / (u_origin + n * u_peer))
            swarms.append({"nodes": n, "seconds": _r(seconds), "origin_bytes": origin,
                           "origin_bytes_per_model_byte": _r(origin / F),
                           "independent_pulls_origin_bytes_per_model_byte": float(n),
                           "peer_bytes": sum(b.get("peer", 0) for b in by_source),
                           "u_peer_gbps": _r(u_peer / 1e9), "lower_bound_s": _r(bound),
                           "seconds_over_lower_bound": _r(seconds / bound)})
            print(f"swarm {n}: {swarms[-1]}", file=sys.stderr)
    finally:
        if moto is not None:
            moto.stop()
        shutil.rmtree(scratch, ignore_errors=True)

    first_over_all = statistics.median(ratios)
    cases = [
        case("cold load from a folder: first tensor / all tensors", "time ratio", "ratio", first_over_all, "", None,
             higher=False, target=TARGETS["first_over_all"], ratio=first_over_all,
             note=f"goal {TARGETS['first_over_all_goal']}; median of {args.rounds} cold loads into an empty cache"),
        case("cold load from S3 (moto): first tensor / all tensors", "time ratio", "ratio", s3_first, "", None,
             higher=False, target=TARGETS["first_over_all"], ratio=s3_first),
        case("warm load from the node cache", "throughput", "GB/s", F / warm["strata"] / 1e9,
             "safetensors.safe_open, every tensor", F / warm["safe_open"] / 1e9, higher=True,
             target=TARGETS["warm_vs_safe_open"]),
        case("warm load from the node cache", "throughput", "GB/s", F / warm["strata"] / 1e9,
             "sequential readinto a reused 16 MiB buffer", F / warm["sequential"] / 1e9, higher=True,
             target=TARGETS["warm_vs_sequential"]),
    ]
    if runai_note is None:
        cases.append(case("runai-model-streamer 0.17 on CPU, every tensor", "throughput", "GB/s",
                          F / warm["runai"] / 1e9, "safetensors.safe_open, every tensor", F / warm["safe_open"] / 1e9,
                          higher=True, target=None, note="side by side, no target"))
        cases.append(case("warm load from the node cache", "throughput", "GB/s", F / warm["strata"] / 1e9,
                          "runai-model-streamer 0.17 on CPU, every tensor", F / warm["runai"] / 1e9, higher=True,
                          target=None, note="side by side, no target"))
    else:
        cases.append(case("runai-model-streamer on CPU", "throughput", "GB/s", None, "", None, higher=True,
                          target=None, note=runai_note))
    cases.append(case("cold load from S3 (moto), every tensor", "throughput", "GB/s", F / s3_strata / 1e9,
                      f"obstore ranged GETs of the same chunks, {CONCURRENCY} at once", F / s3_raw / 1e9, higher=True,
                      target=TARGETS["cold_s3_vs_raw"],
                      note=f"moto reads the whole object for each ranged GET (both sides pay it); "
                           f"whole-object GETs, {CONCURRENCY} at once: {F / whole / 1e9:.3g} GB/s"))
    for s in swarms:
        cases.append(case(f"{s['nodes']} weight nodes at once: origin bytes / model size", "bytes ratio", "ratio",
                          s["origin_bytes_per_model_byte"], "independent pulls (computed)", float(s["nodes"]),
                          higher=False, target=TARGETS["swarm_origin"], ratio=s["origin_bytes_per_model_byte"],
                          note=f"goal {TARGETS['swarm_origin_goal']}; independent pulls would be {s['nodes']}.0"))
        cases.append(case(f"{s['nodes']} weight nodes at once: time", "seconds", "s", s["seconds"],
                          "max(F/u_origin, F/d, N*F/(u_origin + N*u_peer))", s["lower_bound_s"], higher=False,
                          target=None, note="2 shared cores run every node, moto and the reader; the bound assumes "
                                            "links of their own"))
    doc = {
        "benchmark": NAME,
        "command": " ".join(["python -m benchmarks." + NAME, *argv]),
        "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "model": {"files": len(manifest.files), "bytes": total, "tensors": len(out), "chunk_bytes": CHUNK},
        "cases": cases,
        "bandwidths_gbps": {
            "u_origin": _r(u_origin / 1e9), "d": _r(d / 1e9), "u_peer": [_r(u / 1e9) for u in u_peers],
            "how": "u_origin: obstore ranged GETs of every chunk from moto, 8 at once (the cold S3 baseline); "
                   "d: one weight node prefetching the model from the folder; u_peer: one reader taking every "
                   "chunk from one complete swarm node's ReadChunk, 4 at once, after each swarm run",
        },
        "raw": raw,
        "swarms": swarms,
    }
    path = None
    if not args.smoke:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        path = RESULTS_DIR / f"{NAME}.json"
        path.write_text(json.dumps(doc, indent=2) + "\n")
    for c in cases:
        print(f"{c['case']:<58} {c['value']!s:>9} vs {c['baseline_value']!s:>9}  ratio {c['ratio']!s:>7}  "
              f"target {c['target_ratio']!s:>5}  {'met' if c['meets_target'] else ('-' if c['meets_target'] is None else 'MISSED')}")
    print(smoke_line(NAME) if path is None else f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
