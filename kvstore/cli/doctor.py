"""``strata doctor``: the host checks, with the same settings ``strata serve`` would use.

It takes every flag of ``strata serve`` (and ``--config``, the ``STRATA_*``
variables), so ``strata doctor`` followed by a daemon's own arguments
checks the host for exactly that daemon. Exit status: 0 when nothing
failed (warnings included), 1 when a check failed, 2 for settings that do
not load (what ``strata serve`` would refuse).
"""

from __future__ import annotations

import argparse
import os
import sys

from kvstore.cli.common import add_settings_flags, serve_overrides
from kvstore.config import SettingsError, load_settings


def add_parser(sub) -> None:
    from kvstore.doctor import CHECKS

    doctor = sub.add_parser(
        "doctor",
        help="check this host for strata serve: tmpfs, disk, memory, ports, auth, Redis, S3, UCX",
        description="Check this host against the settings strata serve would use (the same flags, STRATA_* "
        "variables and --config): the arena's tmpfs against --ram-bytes, the disk tier's free space against "
        "--disk-bytes, the memory limit, free ports, protected mode and secret files, Redis and S3 "
        "reachability, UCX transports. Each problem comes with what to change. Exit 1 when a check fails.",
    )
    doctor.add_argument("--config", metavar="FILE", help="TOML config file, as strata serve takes [env STRATA_CONFIG]")
    doctor.add_argument("--check", action="append", choices=list(CHECKS), metavar="NAME",
                        help=f"run only this check (repeatable): {', '.join(CHECKS)} [default: all]")
    doctor.add_argument("--s3-endpoint", default=os.environ.get("STRATA_S3_ENDPOINT", ""), metavar="URL",
                        help="an S3-compatible endpoint to reach (http://minio:9000) [env STRATA_S3_ENDPOINT]")
    doctor.add_argument("--timeout", type=float, default=2.0, help="seconds per network check [default 2]")
    doctor.add_argument("--json", action="store_true", help="print the findings as JSON")
    add_settings_flags(doctor)
    doctor.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from kvstore.doctor import Host, failed, render_json, render_text, run_checks

    try:
        settings = load_settings(args.config or os.environ.get("STRATA_CONFIG"), **serve_overrides(args))
    except SettingsError as err:
        print(f"strata doctor: strata serve would refuse these settings: {err}", file=sys.stderr)
        return 2
    host = Host(environ=dict(os.environ), timeout_s=args.timeout, s3_endpoint=args.s3_endpoint)
    findings = run_checks(settings, host, args.check or ())
    print(render_json(findings) if args.json else render_text(findings))
    return 1 if failed(findings) else 0
