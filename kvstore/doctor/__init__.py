"""``strata doctor``: is this host ready for ``strata serve`` with these settings?

Each check reads one part of the host the daemon depends on and says what
it found, and, when something is wrong, what to change. Checks are a
name → function registry, run in order; ``--check NAME`` runs some of them
(an init container runs the host checks, not Redis: the daemon serves
without its index, a pod that would not start without it would not)::

    shm      the arena's tmpfs: exists, writable, a tmpfs, big enough for --ram-bytes and its block table
    memory   the cgroup memory limit against the arena (its pages count against it) and the daemon
    disk     the disk tier's filesystem: writable, free space against --disk-bytes, not tmpfs or overlay,
             no other daemon on the directory
    ports    every TCP listener can be bound; the gRPC Unix socket's directory exists
    auth     protected mode (a non-loopback listener needs authentication), the secret files are readable
    redis    the index's Redis answers PING through --index-url (password, TLS files); a Cluster is whole
    s3       an S3 endpoint answers HTTP (--s3-endpoint; the object tier's own settings when it lands)
    ucx      with UCX configured: ucxx imports, ucx_info lists transports, UCX_TLS names only those

Findings are :class:`~kvstore.doctor.report.Finding`; nothing is created or
changed on the host, and no check takes longer than its timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstore.config import Settings
from kvstore.doctor.access import check_access
from kvstore.doctor.host import Host, check_disk, check_memory, check_shm
from kvstore.doctor.network import check_ports, check_redis, check_s3
from kvstore.doctor.report import Finding, Status, failed, render_json, render_text
from kvstore.doctor.ucx import check_ucx

Check = Callable[[Settings, Host], list[Finding]]

CHECKS: dict[str, Check] = {
    "shm": check_shm,
    "memory": check_memory,
    "disk": check_disk,
    "ports": check_ports,
    "auth": check_access,
    "redis": check_redis,
    "s3": check_s3,
    "ucx": check_ucx,
}


def run_checks(settings: Settings, host: Host, names: Sequence[str] = ()) -> list[Finding]:
    """The findings of ``names`` (every check when empty), in registry order."""
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ValueError(f"unknown check {', '.join(unknown)}: the checks are {', '.join(CHECKS)}")
    findings: list[Finding] = []
    for name, check in CHECKS.items():
        if not names or name in names:
            findings.extend(check(settings, host))
    return findings


__all__ = ["CHECKS", "Finding", "Host", "Status", "failed", "render_json", "render_text", "run_checks"]
