"""The GPU tier's device check: contract suite, IPC read, round trip, copy figures — in one run.

On a machine with an NVIDIA GPU (a few minutes on an H200)::

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py

runs, in order, and stops at nothing (every step reports):

1. ``contract``: pytest over the tier contract suite's gpu rows and
   tests/tiers/test_gpu_tier.py with the ``cuda`` memory kind
   (``STRATA_TEST_GPU_MEMORY=cuda``, no conftest: those modules need only
   the tiers and the store);
2. ``ipc``: a second process maps the tier's region through its CUDA IPC
   handle, reads leased blocks device to device, and checks their
   checksums; it times that read against a device-to-device copy of the
   same bytes inside its own memory (target ≥ 0.8×);
3. ``daemon``: a real ``strata serve --gpu-bytes ... --gpu-memory cuda``;
   this process puts blocks from CUDA tensors (written into gpu slots
   through the region's handle), a second client process reads them with
   ``get_into`` CUDA tensors through the same-host socket's handles, device
   to device, verifies every byte, and times that read against a
   device-to-device copy (target ≥ 0.8×, the same as ``ipc``'s);
4. ``round_trip``: a TieredStore ``[gpu, ram]`` with a GPU tier smaller
   than the blocks put: blocks demote to RAM and promote back; every byte
   compared; CUDA tensors in and out;
5. ``copies``: put (host → device) and get (device → host) of 1/16/64 MiB
   blocks through the tier, from pageable bytes and from pinned tensors,
   against torch copies of the same bytes between a pinned tensor and the
   device (target ≥ 0.8×).

Writes JSON to ``$OUT/gpu.json`` when ``OUT`` is set, else
``benchmarks/results/gpu.json`` (``--out`` overrides); prints a summary;
exits 1 when a check fails (a test, a byte, a checksum), not when a ratio
misses its target (that is a figure, reported as ``target_met``).

``--dry-run`` runs the same steps on the ``host`` stand-in for device
memory with small blocks, on any machine, so the script is known to run
before device time is spent; its figures say nothing about a GPU and are
never written to benchmarks/results.

``--smoke`` is the dry run at its smallest (1 MiB blocks, one timed run per
figure), writing no JSON anywhere: the check that this script still runs,
as ``python -m benchmarks.gpu_check --smoke``, in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvstore.block import BlockKey, BlockMeta, TierName, checksum  # noqa: E402
from kvstore.store import StoreLimits, TieredStore  # noqa: E402
from kvstore.tiers.gpu import GpuTier  # noqa: E402
from kvstore.tiers.ram import HostRamTier  # noqa: E402

MiB = 1 << 20
TARGET = 0.8


def _random(n: int, seed: int) -> bytes:
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process: this repository first on the path, what was there kept."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def key(name: str) -> BlockKey:
    return BlockKey("gpu-check", name.encode())


def timed(fn, repeats: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after ``warmup``."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


class Check:
    def __init__(self, args) -> None:
        self.dry = args.dry_run or args.smoke
        self.memory = "host" if self.dry else "cuda"
        self.sizes = [1] if args.smoke else [1, 4] if self.dry else [1, 16, 64]
        self.repeats = 1 if args.smoke else 3 if self.dry else args.repeats
        self.scratch = tempfile.mkdtemp(prefix="strata-gpu-check-")
        self.failures: list[str] = []
        self.result: dict = {"memory": self.memory, "dry_run": self.dry, "target_ratio": TARGET}

    def tier(self, capacity: int) -> GpuTier:
        options = {"shm_dir": self.scratch} if self.memory == "host" else {}
        return GpuTier(capacity, devices=(0,), memory=self.memory, **options)

    def fail(self, step: str, why: str) -> None:
        self.failures.append(f"{step}: {why}")
        print(f"FAIL {step}: {why}", flush=True)

    # ---- 0. where ------------------------------------------------------------

    def environment(self) -> None:
        env = {"python": platform.python_version(), "host": platform.node()}
        try:
            import torch

            env["torch"] = torch.__version__
            env["cuda"] = torch.version.cuda
            if torch.cuda.is_available():
                env["device"] = torch.cuda.get_device_name(0)
                env["devices"] = torch.cuda.device_count()
        except ImportError:
            env["torch"] = None
        if not self.dry and "device" not in env:
            self.fail("environment", "no CUDA device: run with --dry-run on a machine without a GPU")
        self.result["environment"] = env

    # ---- 1. the contract suite on the device -----------------------------------

    def contract(self) -> None:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
               "tests/tiers/test_tier_contract.py", "tests/tiers/test_gpu_tier.py", "-k", "gpu or test_gpu_tier"]
        env = child_env(STRATA_TEST_GPU_MEMORY=self.memory)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        self.result["contract"] = {"command": " ".join(cmd[1:]), "returncode": proc.returncode,
                                   "summary": tail[-1] if tail else "", "seconds": round(time.perf_counter() - t0, 1)}
        if proc.returncode != 0:
            self.fail("contract", "\n".join(tail))

    # ---- 2. a second process reads through the IPC handle -----------------------

    def ipc(self) -> None:
        size = self.sizes[-1] * MiB
        tier = self.tier(4 * size)
        store = TieredStore([tier, HostRamTier(64 * MiB, shm_dir=self.scratch, arena_name="ipc-ram")],
                            limits=StoreLimits.from_settings(max_block_bytes=size, demotion_threads=0))
        try:
            data = _random(size, 1)
            store.put(key("ipc"), data, BlockMeta(size, checksum(data)))
            [loc] = store.lookup("gpu-check", [b"ipc"], lease_s=120)
            index, local = tier.handle_of(loc.offset)
            ticket = pickle.dumps((tier.handles()[index], local, size, loc.meta.checksum, self.repeats))
            proc = subprocess.run([sys.executable, str(Path(__file__)), "--ipc-reader"], input=ticket,
                                  capture_output=True, timeout=300, env=child_env())
            store.release([loc.lease_id])
        finally:
            store.close()
        if proc.returncode != 0:
            self.fail("ipc", proc.stderr.decode(errors="replace")[-2000:])
            return
        got = json.loads(proc.stdout.decode().strip().splitlines()[-1])
        got["block_bytes"] = size
        if "ratio" in got:
            got["target_met"] = got["ratio"] >= TARGET
        self.result["ipc"] = got
        if not got["verified"]:
            self.fail("ipc", "the bytes read through the handle do not match the block's checksum")

    # ---- 3. the daemon serves the tier: a client process reads through the handles -------------

    def daemon(self) -> None:
        size = self.sizes[-1] * MiB
        port = _free_port()
        target = f"127.0.0.1:{port}"
        args = [sys.executable, "-m", "kvstore.cli.main", "serve", "--listen", target, "--metrics-listen", "",
                "--disk-dir", os.path.join(self.scratch, "daemon"), "--shm-dir", self.scratch,
                "--ram-bytes", f"{max(4 * size, 64 * MiB)}", "--disk-bytes", f"{max(8 * size, 256 * MiB)}",
                "--max-block-bytes", str(size), "--gpu-bytes", str(4 * size), "--gpu-memory", self.memory]
        if self.memory == "host":
            args.append("--no-gpu-host-addressable")  # the copy paths a GPU takes
        log = open(os.path.join(self.scratch, "daemon.log"), "wb")
        daemon = subprocess.Popen(args, cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_listening(daemon, port, 120)
            self._daemon_step(daemon, target, size)
        finally:
            daemon.kill()
            daemon.wait(30)
            log.close()

    def _daemon_step(self, daemon, target: str, size: int) -> None:
        from kvstore.client import Client

        with Client(target, timeout=30) as c:
            end = time.monotonic() + 120
            while True:
                try:
                    tiers = c.stats().tiers
                    break
                except Exception:  # noqa: BLE001 - not serving yet; its exit is checked below
                    if daemon.poll() is not None or time.monotonic() > end:
                        raise RuntimeError(f"the daemon did not serve: {Path(self.scratch, 'daemon.log').read_text()[-2000:]}")
                    time.sleep(0.2)
            data = [_random(size, 200 + i) for i in range(2)]
            values = data
            if self.memory == "cuda":
                import torch

                values = [torch.frombuffer(bytearray(d), dtype=torch.uint8).cuda() for d in data]
            c.put("gpu-check", b"d1", values[1])
            put_s = timed(lambda: [c.delete("gpu-check", [b"d0"]), c.put("gpu-check", b"d0", values[0])], self.repeats)
            out = {"block_bytes": size, "gpu_tier": tiers.get("gpu"), "put_s": put_s,
                   "writer_device_tensors": c._data("gpu-check").device_tensors}
        ticket = json.dumps({"target": target, "size": size, "repeats": self.repeats,
                             "expected": [checksum(d) for d in data]}).encode()
        proc = subprocess.run([sys.executable, str(Path(__file__)), "--daemon-reader"], input=ticket,
                              capture_output=True, timeout=300, env=child_env())
        if proc.returncode != 0:
            self.fail("daemon", proc.stderr.decode(errors="replace")[-2000:])
            return
        out.update(json.loads(proc.stdout.decode().strip().splitlines()[-1]))
        if "ratio" in out:
            out["target_met"] = out["ratio"] >= TARGET
        self.result["daemon"] = out
        if not out["verified"] or out["tiers"] != ["gpu", "gpu"] or not out["mapped_regions"]:
            self.fail("daemon", f"the second process did not read both blocks from the gpu tier through its "
                                f"handle, verified: {out}")

    # ---- 4. demotion to RAM and promotion back --------------------------------------

    def round_trip(self) -> None:
        n, size = 24, 4 * MiB
        tier = self.tier(8 * size)
        store = TieredStore([tier, HostRamTier(n * size * 2, shm_dir=self.scratch, arena_name="rt-ram")],
                            limits=StoreLimits.from_settings(max_block_bytes=size, demotion_threads=2))
        out = {"blocks": n, "block_bytes": size, "gpu_bytes": tier.capacity_bytes}
        try:
            blocks = {f"b{i}": _random(size, 100 + i) for i in range(n)}
            for name, data in blocks.items():
                store.put(key(name), data, BlockMeta(size, checksum(data)))
            store.flush_demotions()
            where = [store.exists("gpu-check", [name.encode()])[0] for name in blocks]
            out["after_puts"] = {"gpu": where.count(TierName.GPU), "host": where.count(TierName.HOST)}
            found, mismatched = {"gpu": 0, "host": 0}, 0
            for name, data in blocks.items():
                got, _, tier_name = store.get(key(name))
                found[tier_name.label] = found.get(tier_name.label, 0) + 1
                mismatched += got != data
                store.flush_demotions()
            out["reads_from"] = found
            out["promoted_then_present_in_gpu"] = sum(tier.contains(key(k)) for k in blocks)
            out["mismatched_blocks"] = mismatched
            if mismatched:
                self.fail("round_trip", f"{mismatched} blocks came back with other bytes")
            if out["after_puts"]["host"] == 0 or found["host"] == 0:
                self.fail("round_trip", f"nothing was demoted and read back from RAM: {out}")
        finally:
            store.close()
        if self.memory == "cuda":
            import torch

            data = blocks["b0"]
            src = torch.frombuffer(bytearray(data), dtype=torch.uint8).cuda()
            tensors = self.tier(2 * size)
            try:
                tensors.put(key("t"), src, BlockMeta(size, checksum(data)))
                dst = torch.empty_like(src)
                tensors.read_into(key("t"), dst)
                out["cuda_tensor_round_trip"] = bool(torch.equal(src, dst))
            finally:
                tensors.close()
            if not out["cuda_tensor_round_trip"]:
                self.fail("round_trip", "a CUDA tensor put and read back differs")
        self.result["round_trip"] = out

    # ---- 5. copies host <-> device against torch pinned copies ------------------------

    def copies(self) -> None:
        rows = []
        for mib in self.sizes:
            size = mib * MiB
            tier = self.tier(4 * size)
            try:
                rows.append(self._copy_row(tier, size))
            finally:
                tier.close()
        self.result["copies"] = rows

    def _copy_row(self, tier: GpuTier, size: int) -> dict:
        data = _random(size, size)
        meta = BlockMeta(size, checksum(data))
        k = key("copy")
        repeats = max(self.repeats * 16 // max(size // MiB, 1), 5)

        def put() -> None:
            tier.delete(k)
            tier.put(k, data, meta)

        row = {"block_bytes": size, "repeats": repeats}
        row["strata_put_s"] = timed(put, repeats)
        row["strata_get_s"] = timed(lambda: tier.get(k), repeats)
        if self.memory == "cuda":
            import torch

            pinned = torch.frombuffer(bytearray(data), dtype=torch.uint8).pin_memory()
            out = torch.empty(size, dtype=torch.uint8).pin_memory()
            dev = torch.empty(size, dtype=torch.uint8, device="cuda")

            def put_pinned() -> None:
                tier.delete(k)
                tier.put(k, pinned, meta)

            def h2d() -> None:
                dev.copy_(pinned, non_blocking=True)
                torch.cuda.synchronize()

            def d2h() -> None:
                out.copy_(dev, non_blocking=True)
                torch.cuda.synchronize()

            row["strata_put_pinned_s"] = timed(put_pinned, repeats)
            row["strata_get_pinned_s"] = timed(lambda: tier.read_into(k, out), repeats)
            if out.numpy().tobytes() != data:
                self.fail("copies", f"a {size}-byte block read into a pinned tensor differs")
            row["torch_h2d_pinned_s"] = timed(h2d, repeats)
            row["torch_d2h_pinned_s"] = timed(d2h, repeats)
            for ours, theirs in [("put", "h2d"), ("get", "d2h"), ("put_pinned", "h2d"), ("get_pinned", "d2h")]:
                row[f"ratio_{ours}"] = round(row[f"torch_{theirs}_pinned_s"] / row[f"strata_{ours}_s"], 3)
            row["target_met"] = {r: row[f"ratio_{r}"] >= TARGET for r in ("put", "get", "put_pinned", "get_pinned")}
        else:  # the stand-in: only a plain host memcpy to compare with
            src, dst = bytearray(data), bytearray(size)

            def memcpy() -> None:
                dst[:] = src

            row["host_memcpy_s"] = timed(memcpy, repeats)
        if tier.get(k) != data:
            self.fail("copies", f"a {size}-byte block read back differs")
        for name in [n for n in row if n.endswith("_s")]:
            row[name.removesuffix("_s") + "_gbps"] = round(size / row[name] / 1e9, 2)
        return row

    # ---- the run ------------------------------------------------------------------

    def run(self) -> int:
        self.environment()
        steps = [] if self.failures else [self.contract, self.ipc, self.daemon, self.round_trip, self.copies]
        for step in steps:
            t0 = time.perf_counter()
            try:
                step()
            except Exception as err:  # a broken step is a failed check, and the next steps still report
                self.fail(step.__name__, f"{type(err).__name__}: {err}")
            print(f"{step.__name__}: {time.perf_counter() - t0:.1f}s", flush=True)
        self.result["failures"] = self.failures
        self.result["ok"] = not self.failures
        return 0 if not self.failures else 1


def ipc_reader() -> None:
    """The second process: map the region by its handle, read the leased block, time it against a local copy."""
    handle, local, size, expected, repeats = pickle.loads(sys.stdin.buffer.read())
    from kvstore.tiers.device import attach_memory

    region = attach_memory(handle)
    out: dict = {"pid": os.getpid(), "kind": handle.kind}
    if handle.kind == "cuda":
        import torch

        dst = torch.empty(size, dtype=torch.uint8, device=handle.device)
        region.read_into(local, dst)
        out["verified"] = checksum(dst.cpu().numpy().tobytes()) == expected
        src_local = torch.empty_like(dst)
        src_local.copy_(dst)

        def ipc() -> None:
            region.read_into(local, dst)

        def d2d() -> None:
            dst.copy_(src_local)
            torch.cuda.synchronize()

        out["ipc_read_s"] = timed(ipc, repeats * 4)
        out["d2d_copy_s"] = timed(d2d, repeats * 4)
        out["ratio"] = round(out["d2d_copy_s"] / out["ipc_read_s"], 3)
        out["ipc_read_gbps"] = round(size / out["ipc_read_s"] / 1e9, 1)
        out["d2d_copy_gbps"] = round(size / out["d2d_copy_s"] / 1e9, 1)
    else:
        data, got = region.read(local, size)
        out["verified"] = got == expected == checksum(data)
        out["ipc_read_s"] = timed(lambda: region.read(local, size), repeats)
    region.close()
    print(json.dumps(out))


def daemon_reader() -> None:
    """The daemon step's second process: a client of its own reads the blocks from the daemon's gpu tier."""
    ticket = json.loads(sys.stdin.buffer.read())
    from kvstore.client import Client

    size, keys = ticket["size"], [b"d0", b"d1"]
    out: dict = {"pid": os.getpid()}
    with Client(ticket["target"], timeout=30) as c:
        transport = c._data("gpu-check")
        out["transport"], out["device_tensors"] = transport.name, transport.device_tensors
        try:
            import torch

            on_cuda = torch.cuda.is_available()
        except ImportError:
            on_cuda = False
        if on_cuda:
            dst = [torch.empty(size, dtype=torch.uint8, device="cuda:0") for _ in keys]
            blocks = c.get_into("gpu-check", keys, dst)
            out["verified"] = [checksum(d.cpu().numpy().tobytes()) for d in dst] == ticket["expected"]
            local = torch.empty_like(dst[0])

            def d2d() -> None:
                local.copy_(dst[1])
                torch.cuda.synchronize()

            out["get_into_s"] = timed(lambda: c.get_into("gpu-check", keys[:1], dst[:1]), ticket["repeats"] * 4)
            out["d2d_copy_s"] = timed(d2d, ticket["repeats"] * 4)
            out["ratio"] = round(out["d2d_copy_s"] / out["get_into_s"], 3)
            out["get_into_gbps"] = round(size / out["get_into_s"] / 1e9, 1)
            out["d2d_copy_gbps"] = round(size / out["d2d_copy_s"] / 1e9, 1)
        else:
            dst = [bytearray(size) for _ in keys]
            blocks = c.get_into("gpu-check", keys, dst)
            out["verified"] = [checksum(d) for d in dst] == ticket["expected"]
            out["get_into_s"] = timed(lambda: c.get_into("gpu-check", keys[:1], dst[:1]), ticket["repeats"])
        out["tiers"] = [b.tier.label if b is not None else None for b in blocks]
        out["mapped_regions"] = getattr(transport, "mapped_regions", 0)
    print(json.dumps(out))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(proc: subprocess.Popen, port: int, timeout_s: float) -> None:
    """Until the daemon's port accepts (or it exits, or the time is up): a gRPC channel whose first
    connection is refused waits out its reconnect backoff, seconds after the daemon is up."""
    import socket

    end = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)


def summary(result: dict) -> str:
    lines = [f"gpu check ({'DRY RUN, host stand-in' if result['dry_run'] else result['memory']}): "
             f"{'ok' if result['ok'] else 'FAILED'}", f"environment: {result.get('environment')}"]
    if "contract" in result:
        lines.append(f"contract: {result['contract']['summary']}")
    if "ipc" in result:
        ipc = result["ipc"]
        lines.append(f"ipc read: verified={ipc['verified']}" + (
            f", {ipc['ipc_read_gbps']} GB/s vs device copy {ipc['d2d_copy_gbps']} GB/s, ratio {ipc['ratio']}"
            if "ratio" in ipc else ""))
    if "daemon" in result:
        d = result["daemon"]
        lines.append(f"daemon: read by a second client from {d.get('tiers')}, verified={d.get('verified')}, "
                     f"regions mapped {d.get('mapped_regions')}" + (
                         f", get_into {d['get_into_gbps']} GB/s vs device copy {d['d2d_copy_gbps']} GB/s, "
                         f"ratio {d['ratio']}" if "ratio" in d else ""))
    if "round_trip" in result:
        rt = result["round_trip"]
        lines.append(f"round trip: after puts {rt.get('after_puts')}, reads from {rt.get('reads_from')}, "
                     f"mismatched {rt.get('mismatched_blocks')}")
    for row in result.get("copies", []):
        mib = row["block_bytes"] // MiB
        if "ratio_put" in row:
            lines.append(
                f"{mib:>3} MiB: put {row['strata_put_gbps']} GB/s (pinned src {row['strata_put_pinned_gbps']}) vs "
                f"torch h2d {row['torch_h2d_pinned_gbps']} -> {row['ratio_put']} ({row['ratio_put_pinned']}); "
                f"get {row['strata_get_gbps']} GB/s (pinned dst {row['strata_get_pinned_gbps']}) vs torch d2h "
                f"{row['torch_d2h_pinned_gbps']} -> {row['ratio_get']} ({row['ratio_get_pinned']})")
        else:
            lines.append(f"{mib:>3} MiB: put {row['strata_put_gbps']} GB/s, get {row['strata_get_gbps']} GB/s, "
                         f"host memcpy {row['host_memcpy_gbps']} GB/s")
    lines += [f"FAIL {f}" for f in result["failures"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the host stand-in, small blocks, any machine")
    parser.add_argument("--smoke", action="store_true", help="the dry run at its smallest (1 MiB, one timed run "
                                                             "per figure), writing no JSON: checks the script runs")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per figure (more for small blocks)")
    parser.add_argument("--out", default="", help="where the JSON goes (default $OUT/gpu.json or "
                                                  "benchmarks/results/gpu.json; a dry run writes only here)")
    parser.add_argument("--ipc-reader", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--daemon-reader", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ipc_reader:
        ipc_reader()
        return 0
    if args.daemon_reader:
        daemon_reader()
        return 0
    check = Check(args)
    try:
        code = check.run()
    finally:
        import shutil

        shutil.rmtree(check.scratch, ignore_errors=True)
    check.result["when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    check.result["command"] = "python3 benchmarks/gpu_check.py" + (" --smoke" if args.smoke else
                                                                    " --dry-run" if args.dry_run else "")
    out = args.out or (os.path.join(os.environ["OUT"], "gpu.json") if os.environ.get("OUT") else "")
    if not out and not args.dry_run:
        out = str(REPO / "benchmarks" / "results" / "gpu.json")
    if out and (not args.smoke or args.out):  # a smoke run writes only where it is told to (--out)
        Path(out).write_text(json.dumps(check.result, indent=2) + "\n")
    print(summary(check.result), flush=True)
    if args.smoke:
        from benchmarks.harness import smoke_line

        print(smoke_line("gpu"), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
