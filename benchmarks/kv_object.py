"""Object tier: read-through and write-back against an S3-compatible server, and a fleet's cold restart.

Run as ``python -m benchmarks.kv_object [--quick | --smoke]``. moto's S3 server runs
in a child process on loopback (the tests' ``tests/support/s3_servers.py``); every
case and its baseline talk to that same server, in the same rounds, so the
ratios measure what Strata adds over a bare client, not S3.

- **read-through** (1, 4, 16 MiB): :meth:`ObjectTier.fetch`, what a store's
  local miss does: a request through the tier's bridge, one streamed GET,
  header parsed, the payload received into the block's buffer and verified
  (xxh3-64). Baseline: ``obstore.get`` of the same object, its bytes read,
  nothing checked. Target ≥ 0.8×.
- **write-back** (1, 4, 16 MiB): :meth:`ObjectTier.put` of a round's blocks
  (copied into the write-back queue), timed until the queue has uploaded
  them all (a ranged GET to ask first, then a conditional PUT each).
  Baseline: ``obstore.put`` of objects of the same size, as many at once as
  the tier's uploads. Target ≥ 0.8×.
- **S3 requests per MiB** stored and read, from the tier's own request
  counters over the cases above (no baseline).
- **hit rate after a cold restart**: three ``strata serve`` processes
  (RAM, disk, object; write policy through on both edges) store a
  namespace's blocks, each a third; once the bucket lists them all, every
  daemon is SIGKILLed; three new daemons, each with an empty RAM arena and
  an empty disk, read every block, each the blocks another daemon wrote.
  A hit is the block's own bytes. Target: every block served (1.0).

``--smoke`` runs every case once at 1 MiB, with a fleet of two daemons
(each reads what the other wrote), and writes no results.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path

import obstore

from benchmarks.harness import MiB, Case, UnitBenchmark, compare, interleave, size_label
from kvstore.block import BlockKey, BlockMeta, checksum
from kvstore.remote.object.metrics import ObjectMetrics

NAME = "kv_object"
TARGET = 0.8
SIZES = (1 * MiB, 4 * MiB, 16 * MiB)
QUICK = {"rounds": 5, "warmup": 1, "round_bytes": 16 * MiB, "restart_blocks": 24, "sizes": SIZES, "fleet": 3}
FULL = {"rounds": 9, "warmup": 2, "round_bytes": 64 * MiB, "restart_blocks": 96, "sizes": SIZES, "fleet": 3}
SMOKE = {"rounds": 5, "warmup": 0, "round_bytes": 2 * MiB, "restart_blocks": 2, "sizes": (1 * MiB,), "fleet": 2}
UPLOADS = 8


def _environ(home: str) -> dict[str, str]:
    from tests.support import s3_servers

    return {"AWS_ACCESS_KEY_ID": s3_servers.ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": s3_servers.SECRET_KEY, "HOME": home}


def _tier(env, prefix: str, home: str, metrics: ObjectMetrics, **options):
    from kvstore.tiers.object import ObjectTier

    return ObjectTier.open(bucket=env.bucket, prefix=prefix, endpoint=env.endpoint, environ=_environ(home),
                           metrics=metrics, max_uploads=UPLOADS, queue_bytes=512 * MiB, **options)


def _raw_store(env):
    from tests.support import s3_servers
    from obstore.store import S3Store

    return S3Store(env.bucket, endpoint=env.endpoint, region="us-east-1", access_key_id=s3_servers.ACCESS_KEY,
                   secret_access_key=s3_servers.SECRET_KEY, client_options={"allow_http": True})


def read_round(tier, keys: list[BlockKey], size: int):
    def run() -> tuple[int, float]:
        t0 = time.perf_counter()
        for k in keys:
            found = tier.fetch(k)
            if found is None or found[1].size != size:
                raise SystemExit(f"read-through of {k} missed")
        return size * len(keys), time.perf_counter() - t0
    return run


def raw_read_round(store, paths: list[str], size: int):
    def run() -> tuple[int, float]:
        t0 = time.perf_counter()
        for p in paths:
            got = obstore.get(store, p).bytes()
            if len(got) < size:
                raise SystemExit(f"raw GET of {p} was short")
        return size * len(paths), time.perf_counter() - t0
    return run


def write_round(tier, data: bytes, n: int, tag: str):
    meta = BlockMeta(len(data), checksum(data))
    counter = iter(range(1 << 30))

    def run() -> tuple[int, float]:
        r = next(counter)
        t0 = time.perf_counter()
        for i in range(n):
            tier.put(BlockKey("wb", b"%s-%d-%d" % (tag.encode(), r, i)), data, meta)
        while tier.writeback.queued_blocks:
            time.sleep(0.002)
        return len(data) * n, time.perf_counter() - t0
    return run


def raw_write_round(store, prefix: str, data: bytes, n: int, tag: str):
    import asyncio

    counter = iter(range(1 << 30))

    async def puts(r: int) -> None:
        turns = asyncio.Semaphore(UPLOADS)

        async def one(i: int) -> None:
            async with turns:
                await obstore.put_async(store, f"{prefix}/raw/{tag}-{r}-{i}", data, mode="create")
        await asyncio.gather(*(one(i) for i in range(n)))

    def run() -> tuple[int, float]:
        r = next(counter)
        t0 = time.perf_counter()
        asyncio.run(puts(r))
        return len(data) * n, time.perf_counter() - t0
    return run


def requests_of(metrics: ObjectMetrics, ops: tuple[str, ...]) -> int:
    total = 0
    for metric in metrics.requests.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.labels["op"] in ops:
                total += int(sample.value)
    return total


FLEET_BLOCK = 1 * MiB


def _fleet_node(env, home: Path, name: str, prefix: str):
    """A ``strata serve`` process (benchmarks.index_churn's Node) with the object tier, written through."""
    from benchmarks.index_churn import Node

    node = Node(home, name, "memory://")
    node.args[node.args.index("--tiers") + 1] = "ram,disk,object"
    node.args += ["--max-block-bytes", "4MiB", "--disk-write-policy", "through", "--object-write-policy", "through",
                  "--object-bucket", env.bucket, "--object-prefix", prefix, "--object-endpoint", env.endpoint,
                  "--object-read-seconds", "30"]
    return node


def cold_restart(env, prefix: str, plan: dict) -> Case:
    """Blocks stored by a fleet of daemon processes, all SIGKILLed, read back by new daemons with empty
    RAM and disk: what a fleet restarted from scratch (scale to zero and back) finds in the bucket."""
    import signal

    from tests.support import s3_servers

    n, fleet = plan["restart_blocks"], plan["fleet"]
    data = [os.urandom(FLEET_BLOCK) for _ in range(n)]
    keys = [b"block-%d" % i for i in range(n)]
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ.update(AWS_ACCESS_KEY_ID=s3_servers.ACCESS_KEY, AWS_SECRET_ACCESS_KEY=s3_servers.SECRET_KEY)
    nodes = []
    try:
        with tempfile.TemporaryDirectory(prefix="strata-object-fleet-") as home:
            first = [_fleet_node(env, Path(home) / "first", f"fill{j}", prefix).start() for j in range(fleet)]
            nodes += first
            for i, (k, d) in enumerate(zip(keys, data)):
                first[i % fleet].client.put("fleet", k, d)
            end = time.monotonic() + 120
            while len(env.keys(f"{prefix}/fleet/")) < n and time.monotonic() < end:
                time.sleep(0.1)
            stored = len(env.keys(f"{prefix}/fleet/"))
            for node in first:
                node.stop(signal.SIGKILL)
            fresh = [_fleet_node(env, Path(home) / "fresh", f"cold{j}", prefix).start() for j in range(fleet)]
            nodes += fresh
            hits = 0
            t0 = time.perf_counter()
            for i, (k, d) in enumerate(zip(keys, data)):
                hits += fresh[(i + 1) % fleet].client.get("fleet", k) == d  # another node wrote it
            seconds = time.perf_counter() - t0
    finally:
        for node in nodes:
            node.stop(signal.SIGKILL)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return Case(case=f"hit rate after a cold restart ({fleet} daemons, {n} x 1MiB)", value=hits / n,
                baseline="every block", baseline_value=1.0, target_ratio=1.0, metric="hit_rate", unit="ratio", note=(
                    f"{fleet} strata serve processes (ram, disk, object; write-through) store the blocks; once the "
                    f"bucket lists {stored} of {n}, all are SIGKILLed; {fleet} new daemons with empty RAM and disk "
                    f"read every block, each one another daemon wrote ({n / seconds:.0f} blocks/s); a hit is the "
                    "block's own bytes"))


def main(argv: list[str] | None = None) -> int:
    from tests.support import s3_servers

    bench = UnitBenchmark(NAME, __doc__.splitlines()[0], argv)
    bench.baseline_width = 30
    plan = bench.plan(FULL, QUICK, SMOKE)
    with tempfile.TemporaryDirectory(prefix="strata-moto-") as moto_home, contextlib.ExitStack() as stack:
        env = s3_servers.S3Env(s3_servers.start_moto(Path(moto_home)))
        stack.callback(env.close)
        prefix = f"bench-{os.getpid()}"
        metrics = ObjectMetrics()
        tier = _tier(env, prefix, moto_home, metrics)
        stack.callback(tier.close)
        raw = _raw_store(env)
        read_mib = write_mib = 0.0
        for size in plan["sizes"]:
            L = size_label(size)
            n = max(2, plan["round_bytes"] // size)
            data = os.urandom(size)
            keys = [BlockKey("rt", b"%s-%d" % (L.encode(), i)) for i in range(n)]
            for k in keys:
                tier.put(k, data, BlockMeta(size, checksum(data)))
            while tier.writeback.queued_blocks:
                time.sleep(0.01)
            from kvstore.remote.object.layout import KeyLayout

            paths = [KeyLayout(prefix).path(k) for k in keys]
            s = interleave({f"read-through {L}": read_round(tier, keys, size),
                            f"obstore GET {L}": raw_read_round(raw, paths, size),
                            f"write-back {L}": write_round(tier, data, n, L),
                            f"obstore PUT {L}": raw_write_round(raw, prefix, data, n, L)},
                           rounds=plan["rounds"], warmup=plan["warmup"])
            runs = plan["rounds"] + plan["warmup"]
            read_mib += runs * n * size / MiB
            write_mib += (runs * n + n) * size / MiB
            for case, base, note in (
                (f"read-through {L}", f"obstore GET {L}", "ObjectTier.fetch: bridge, streamed GET, header, "
                 "payload into the block's buffer, verified; baseline: the same object's bytes, unchecked"),
                (f"write-back {L}", f"obstore PUT {L}", f"ObjectTier.put of {n} blocks until uploaded ({UPLOADS} "
                 "at once; a ranged GET first, then a conditional PUT); baseline: as many conditional PUTs"),
            ):
                c = compare(s, case, base, target_ratio=TARGET, note=note)
                bench.add(Case(c.case, c.value, c.baseline, c.baseline_value, TARGET, note=note))
        reads = requests_of(metrics, ("get",))
        writes = requests_of(metrics, ("probe", "put", "put_multipart"))
        bench.add(Case("S3 requests per MiB read", reads / read_mib, "", None, metric="requests_per_mib",
                       unit="req/MiB", note="GETs of the read-through cases over the MiB they read"))
        bench.add(Case("S3 requests per MiB stored", writes / write_mib, "", None, metric="requests_per_mib",
                       unit="req/MiB", note="probes (ranged GETs) and PUTs of the write-back cases over the MiB "
                       "stored: two per block"))
        bench.add(cold_restart(env, prefix + "-fleet", plan))
    bench.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
