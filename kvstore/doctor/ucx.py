"""Which UCX transports this host offers, when the daemon is configured to use UCX.

``ucx_info -d`` (the wheel's, next to its libraries, or the system's when
``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY`` says so, as ucxx's loader does)
lists the transports UCX found; ``UCX_TLS``, when set, must name only
transports that exist. ucxx itself is imported in a child process: its
native libraries load there, and a broken install cannot take this one
down.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

from kvstore.config import Settings
from kvstore.doctor.host import Host
from kvstore.doctor.report import Finding, fail, ok, skip, warn

RDMA_TRANSPORTS = {"rc", "rc_verbs", "rc_mlx5", "rc_x", "ud", "ud_verbs", "ud_mlx5", "ud_x", "dc", "dc_mlx5", "dc_x"}
# UCX_TLS may name groups and aliases besides transports.
UCX_TLS_ALIASES = {"all", "sm", "shm", "ib", "mm", "rc", "ud", "dc", "rc_x", "ud_x", "dc_x", "cuda", "rocm"}
IMPORT_TIMEOUT_S = 120.0


def wanted(settings: Settings) -> bool:
    return bool(settings.peers.ucx_listen) or "ucx" in settings.tiers.peer.transports


def ucx_info_command(host: Host) -> tuple[list[str], dict[str, str]] | None:
    """The ``ucx_info`` ucxx would use, and the environment it needs to find its libraries."""
    prefer_system = host.environ.get("RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY", "").lower() in ("1", "true", "yes")
    system = shutil.which("ucx_info", path=host.environ.get("PATH"))
    spec = importlib.util.find_spec("libucx")
    if spec is not None and spec.origin and not (prefer_system and system):
        root = Path(spec.origin).parent
        if (root / "bin" / "ucx_info").exists():
            libs = str(root / "lib")
            path = host.environ.get("LD_LIBRARY_PATH", "")
            return [str(root / "bin" / "ucx_info"), "-d"], {**host.environ, "LD_LIBRARY_PATH": f"{libs}:{path}".rstrip(":")}
    if system:
        return [system, "-d"], dict(host.environ)
    return None


def transports(output: str) -> set[str]:
    return set(re.findall(r"^#\s+Transport:\s+(\S+)", output, re.M))


def check_ucx(settings: Settings, host: Host) -> list[Finding]:
    if not wanted(settings):
        return [skip("ucx", "UCX is not configured (--peer-ucx-listen, or ucx in --peer-transports)")]
    findings = []
    if importlib.util.find_spec("ucxx") is None:
        return [fail("ucx", "UCX is configured but ucxx is not installed",
                     'pip install "strata-kvcache[ucx]", or drop ucx from --peer-transports and --peer-ucx-listen')]
    probe = subprocess.run([sys.executable, "-c", "import ucxx"], capture_output=True, text=True,
                           timeout=IMPORT_TIMEOUT_S, env=dict(host.environ) or None)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no message"])[-1]
        return [fail("ucx", f"ucxx is installed but does not import ({last})",
                     'reinstall the ucx extra (pip install "strata-kvcache[ucx]"), or check LD_LIBRARY_PATH for a system UCX')]
    command = ucx_info_command(host)
    if command is None:
        return [warn("ucx", "ucxx imports, but no ucx_info was found to list the transports",
                     "install UCX's tools (ucx_info) to see what UCX will use")]
    argv, env = command
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env)
    except (OSError, subprocess.TimeoutExpired) as err:
        return [warn("ucx", f"{argv[0]} did not run ({err})", "check the UCX install")]
    found = transports(done.stdout)
    if done.returncode != 0 or not found:
        return [fail("ucx", f"{argv[0]} -d lists no transport ({done.stderr.strip()[-200:] or 'no output'})",
                     "check the UCX install and LD_LIBRARY_PATH")]
    listed = ", ".join(sorted(found))
    asked = [t.strip().lstrip("^") for t in host.environ.get("UCX_TLS", "").split(",") if t.strip()]
    missing = [t for t in asked if t not in found and t not in UCX_TLS_ALIASES]
    if missing:
        findings.append(fail("ucx", f"UCX_TLS names {', '.join(missing)}, which UCX here does not have ({listed})",
                             "set UCX_TLS to transports ucx_info -d lists, or install a UCX built with them"))
    elif found & RDMA_TRANSPORTS:
        findings.append(ok("ucx", f"UCX transports: {listed}"))
    else:
        findings.append(warn("ucx", f"UCX transports: {listed}; no RDMA transport, so peers over UCX use TCP",
                             "for InfiniBand or RoCE, use a system UCX built with verbs "
                             "(RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true; see docs/guide/peers.md)"))
    return findings
