"""Every benchmark still runs: each one's ``--smoke`` mode, as a process, exits 0 and writes no results.

A benchmark is code that runs rarely, by hand, and so rots: an API it calls
changes and nobody notices until the next measurement (``kv_local --quick``
once died on a client method that had gained an argument). ``--smoke`` runs
every case of a benchmark once at tiny sizes, in seconds; this module runs
each as ``python -m benchmarks.<name> --smoke`` from the repository root and
checks that it exits 0, says it took the smoke path, and left
``benchmarks/results/`` exactly as it was (a smoke run's figures mean
nothing). A benchmark added without an entry here fails
:func:`test_every_benchmark_has_a_smoke_run`.

A benchmark whose optional dependency is not installed here is skipped with
the reason (found without importing the package: ``importlib.util.find_spec``
only locates it). Optional parts inside a benchmark (the UCX cases of
``kv_pool``, Mooncake, hiredis's lean baseline, runai) report themselves as
left out and need nothing here, but a smoke run in which every case was
skipped fails (the harness exits non-zero). Where a benchmark names the cases
it must report (``expects``: each of issue 27's cases, by the name its table
prints, measured or skipped with a reason), the output is checked for each.
No timing is judged.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.harness import smoke_line

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
RESULTS = BENCHMARKS / "results"
# A smoke run takes seconds on a quiet machine, several times that beside a whole test run on two cores;
# the limit only stops one that hangs, and the test's own pytest-timeout is set above it.
TIMEOUT_S = 240


@dataclass(frozen=True)
class Smoke:
    module: str  # python -m benchmarks.<module>
    flags: tuple[str, ...] = ()  # besides --smoke
    results: str = ""  # the results file it would write, without .json (default: the module's name)
    packages: tuple[str, ...] = ()  # top-level packages it cannot run without
    programs: tuple[str, ...] = ()  # executables on PATH it cannot run without
    s3: bool = False  # it runs moto's S3 server (tests/support/s3_servers.py)
    timeout_s: int = TIMEOUT_S
    covered_by: str = ""  # a test module that runs this benchmark's smallest run already, and checks it
    expects: tuple[str, ...] = ()  # lines of its output that must start with these (a case's row, a summary)

    @property
    def id(self) -> str:
        return " ".join((self.module, *self.flags))

    @property
    def results_name(self) -> str:
        return self.results or self.module


def _kv_local_expects() -> tuple[str, ...]:
    from benchmarks import kv_local

    return (*(c.name + "  " for c in kv_local.CALL_CASES), "daemon idle: ", "daemon CPU per GB moved")


# Issue 27's second table at the smoke run's sizes (1 MiB and 4 MiB; a handoff of 2 x 1 MiB). A row's
# name is padded to its column, so a name followed by two spaces is that row and no longer one.
_KV_POOL_EXPECTS = (
    "get 1MiB peer-tcp  ", "get 4MiB peer-tcp  ", "get 1MiB peer-tcp x16 batch  ",
    "get 1MiB peer-ucx  ", "get 4MiB peer-ucx  ", "get 1MiB peer-ucx vs peer-tcp  ", "get 4MiB peer-ucx vs peer-tcp  ",
    "get 1MiB peer-ucx-shm  ", "get 4MiB peer-ucx-shm vs peer-tcp  ",
    "get 1MiB peer-tcp vs mooncake  ", "put 4MiB peer-tcp x16 batch vs mooncake  ",
    "put 1MiB peer-tcp  ", "handoff 2x1MiB  ", "handoff 2x1MiB grpc  ",
    "pool daemon idle: ", "daemon CPU per GB moved",
)

SMOKES = [
    # The largest: a fleet of processes (Redis, two daemons, two engines, a router) and the tiny model.
    Smoke("e2e", packages=("torch", "transformers", "aiohttp"), programs=("redis-server",), timeout_s=480),
    # Its smoke run (the dry run at its smallest, the host stand-in for device memory) runs with its
    # results checked in tests/tiers/test_gpu_settings.py::test_device_check_dry_run_passes_on_the_host_stand_in.
    Smoke("gpu_check", results="gpu", covered_by="tests/tiers/test_gpu_settings.py"),
    # Two daemons, Redis and moto under traffic while a daemon is killed and bytes are damaged; exits 1 on a
    # lost block or wrong bytes.
    Smoke("chaos", programs=("redis-server",), s3=True),
    # The trace-driven fleet simulation, on a trace it generates (the shared traces are not needed).
    Smoke("fleet"),
    Smoke("index"),  # without redis-server or hiredis its Redis cases say so
    Smoke("index_churn", programs=("redis-server",)),
    Smoke("kv_local", expects=_kv_local_expects()),  # without redis-server its Redis cases say so
    Smoke("kv_local", ("--auth",), results="kv_local_auth", packages=("trustme",)),
    Smoke("kv_object", s3=True),
    Smoke("kv_pool", expects=_KV_POOL_EXPECTS),
    # Without UCX or Mooncake (as on a machine without them): their rows say skipped, and why.
    Smoke("kv_pool", ("--no-ucx", "--no-mooncake", "--no-handoff"), expects=(
        "get 1MiB peer-tcp  ", "get 1MiB peer-ucx vs peer-tcp  ", "    skipped: left out by --no-ucx",
        "get 4MiB peer-tcp vs mooncake  ", "    skipped: left out by --no-mooncake", "pool daemon idle: ")),
    # Its only cases need the daemons' shared index: without redis-server both are skipped, and a smoke run
    # that skipped everything fails.
    Smoke("kv_pool", ("--handoff-only",), results="kv_pool_handoff", programs=("redis-server",)),
    Smoke("lmcache", packages=("torch", "lmcache")),
    Smoke("lmcache_l2", packages=("torch", "lmcache"), expects=("store 2x2MiB: Strata vs fs on tmpfs  ",
                                                                "load 2x2MiB: Strata vs fs on disk  ")),
    Smoke("vllm_tier", packages=("vllm",)),
    # SGLang's file backend needs SGLang's full runtime (triton, orjson...), which CI does not install: its rows
    # say so; Strata's and the memory copy's run.
    Smoke("sglang_backend", packages=("torch", "sglang"), expects=("set 4 pages: Strata vs memory copy  ",)),
    Smoke("weights", packages=("safetensors",), s3=True),
]


def benchmark_modules() -> set[str]:
    """What ``python -m benchmarks.<name>`` runs: modules with a ``main`` and packages with a ``__main__``."""
    found = {p.stem for p in BENCHMARKS.glob("*.py") if re.search(r"^def main\(", p.read_text(), re.MULTILINE)}
    found |= {p.name for p in BENCHMARKS.iterdir() if (p / "__main__.py").is_file()}
    return found


def test_every_benchmark_has_a_smoke_run():
    missing = benchmark_modules() - {s.module for s in SMOKES}
    assert not missing, f"benchmarks without a --smoke run in {Path(__file__).name}: {sorted(missing)}"
    gone = {s.module for s in SMOKES} - benchmark_modules()
    assert not gone, f"smoke runs of benchmarks that no longer exist: {sorted(gone)}"
    for smoke in SMOKES:  # a benchmark whose smallest run another module runs (and checks) already
        if smoke.covered_by:
            assert smoke.module in (REPO / smoke.covered_by).read_text(), f"{smoke.covered_by} runs no {smoke.module}"


def snapshot(folder: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under ``folder``: (mtime in ns, size, SHA-256)."""
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            st = path.stat()
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            out[str(path.relative_to(folder))] = (st.st_mtime_ns, st.st_size, digest)
    return out


def run_smoke(smoke: Smoke) -> subprocess.CompletedProcess:
    """The benchmark in a session of its own, so that a hung one is stopped with every process it started."""
    argv = [sys.executable, "-m", f"benchmarks.{smoke.module}", *smoke.flags, "--smoke"]
    proc = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        out, err = proc.communicate(timeout=smoke.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(argv[1:])} did not finish in {smoke.timeout_s} s:\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.mark.system
@pytest.mark.slow
@pytest.mark.parametrize("smoke", [pytest.param(s, id=s.id, marks=pytest.mark.timeout(s.timeout_s + 60))
                                   for s in SMOKES if not s.covered_by])
def test_smoke_run_exits_0_and_writes_no_results(smoke: Smoke):
    for package in smoke.packages:
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed: python -m benchmarks.{smoke.id} needs it")
    for program in smoke.programs:
        if shutil.which(program) is None:
            pytest.skip(f"{program} is not on PATH: python -m benchmarks.{smoke.id} needs it")
    if smoke.s3:
        from tests.support import s3_servers

        if not s3_servers.available():
            pytest.skip(f"moto[server] is not installed (the test extra): python -m benchmarks.{smoke.id} needs it")
    before = snapshot(RESULTS)
    done = run_smoke(smoke)
    tail = f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode == 0, f"python -m benchmarks.{smoke.id} --smoke exited {done.returncode}\n{tail}"
    assert smoke_line(smoke.results_name) in done.stdout, f"the run did not say it wrote nothing\n{tail}"
    assert snapshot(RESULTS) == before, f"python -m benchmarks.{smoke.id} --smoke changed benchmarks/results/"
    lines = done.stdout.splitlines()
    missing = [e for e in smoke.expects if not any(line.startswith(e) for line in lines)]
    assert not missing, f"python -m benchmarks.{smoke.id} --smoke did not report {missing}\n{tail}"
