"""The GPU tier's settings, the daemon's start with and without it, and the client's tensors.

Absent unless sized (nothing else changes); a clear start error naming the
fix without CUDA; ``put`` from and ``get_into`` torch tensors through a
real daemon.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the GPU tier's tensors need torch (python tests/install.py installs the CPU build)")

from kvstore.block import TierName
from kvstore.client import Client
from kvstore.config import SettingsError, load_settings
from kvstore.errors import TierUnavailable

REPO = Path(__file__).resolve().parents[2]
# a child process imports this tree first, and keeps whatever else was on the path
CHILD_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


# ---- settings and the daemon ------------------------------------------------------------


def test_gpu_tier_is_absent_unless_sized():
    s = load_settings(environ={})
    assert not s.tiers.gpu.enabled and s.tiers.effective_chain() == ["ram", "disk"]
    s = load_settings(environ={}, gpu_bytes="1GiB", gpu_devices="0,1")
    assert s.tiers.effective_chain() == ["gpu", "ram", "disk"]
    assert s.tiers.gpu.tier_options(Path(".")) == {"capacity_bytes": 1 << 30, "devices": (0, 1), "memory": "cuda"}


@pytest.mark.parametrize("bad, says", [
    ({"tiers": "gpu,ram"}, "set --gpu-bytes"),
    ({"gpu_bytes": "512KiB"}, "at least 1MiB"),
    ({"gpu_devices": "0,0"}, "each listed once"),
    ({"gpu_memory": "tpu"}, "cuda"),
])
def test_gpu_settings_refuse_what_cannot_work(bad, says):
    with pytest.raises(SettingsError, match=says):
        load_settings(environ={}, **bad)


def test_daemon_without_the_gpu_tier_is_unchanged(daemon):
    assert [t.tier for t in daemon.store.tier_stats()] == [TierName.HOST, TierName.DISK]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_daemon_with_gpu_bytes_and_no_cuda_stops_with_the_fix(make_daemon, tmp_path):
    with pytest.raises(TierUnavailable, match=r"CUDA is not available.*--gpu-bytes 0"):
        make_daemon(gpu_bytes="64MiB")
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore.cli.main", "serve", "--gpu-bytes", "64MiB", "--listen", "127.0.0.1:0",
         "--metrics-listen", "", "--disk-dir", str(tmp_path / "cli"), "--shm-dir", str(tmp_path),
         "--ram-bytes", "32MiB", "--disk-bytes", "64MiB"],
        capture_output=True, text=True, env=CHILD_ENV, timeout=120,
    )
    assert proc.returncode == 1
    assert "CUDA is not available" in proc.stderr and "--gpu-bytes 0" in proc.stderr
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("strata-")], "nothing left in the shm dir"


def test_daemon_serves_the_host_stand_in_at_the_head(make_daemon):
    served = make_daemon(gpu_bytes="8MiB", gpu_memory="host")  # needs no CUDA (tests/server/test_gpu_daemon.py)
    assert [t.tier for t in served.store.tier_stats()] == [TierName.GPU, TierName.HOST, TierName.DISK]


# ---- the client: tensors in and out ------------------------------------------------------


def test_client_puts_from_and_reads_into_tensors(daemon):
    src = torch.arange(4096, dtype=torch.float16)
    with Client(daemon.target) as c:
        assert c.put("m", b"t", src, layout="f16[4096]")
        dst = torch.zeros(4096, dtype=torch.float16)
        [block] = c.get_into("m", [b"t"], [dst])
        assert torch.equal(dst, src) and block.layout == "f16[4096]"
        placed = torch.zeros(4096, dtype=torch.float16)
        [block] = c.get_into("m", [b"t"], lambda i, info: placed)
        assert torch.equal(placed, src)


@pytest.mark.parametrize("use_shm", [True, False], ids=["same-host", "grpc"])
def test_async_client_puts_from_and_reads_into_tensors(daemon, use_shm):
    import asyncio

    from kvstore.client import AsyncClient

    src = torch.randn(2, 512, dtype=torch.float32)

    async def main():
        async with AsyncClient(daemon.target, use_shm=use_shm) as c:
            assert await c.put("m", b"a", src)
            dst = torch.empty_like(src)
            [block] = await c.get_into("m", [b"a"], [dst])
            assert block is not None and torch.equal(dst, src)

    asyncio.run(main())


# ---- the device check is not dead on arrival ------------------------------------------


@pytest.mark.system
def test_device_check_dry_run_passes_on_the_host_stand_in(tmp_path):
    """The device check's smoke run (its dry run at its smallest; tests/benchmarks/test_bench_smoke.py leaves it
    to this test), its results written where --out says and checked."""
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json

    result = json.loads(out.read_text())
    assert result["ok"] and result["dry_run"] and result["ipc"]["verified"]
    assert result["daemon"]["verified"] and result["daemon"]["tiers"] == ["gpu", "gpu"]  # a served read
    assert result["daemon"]["mapped_regions"] == 1
    assert result["round_trip"]["mismatched_blocks"] == 0 and result["round_trip"]["reads_from"]["host"] > 0
    assert [row["block_bytes"] for row in result["copies"]] == [1 << 20]
