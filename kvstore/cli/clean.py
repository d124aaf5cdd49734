"""``strata clean``: remove the arena a stopped daemon kept in shared memory (and its table)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvstore.cli.common import add_settings_flags, serve_overrides
from kvstore.config import SettingsError, load_settings


def add_parser(sub) -> None:
    clean = sub.add_parser(
        "clean", help="remove the arena a stopped daemon kept in shared memory",
        description="A daemon keeps its arena (the host-RAM tier) and its block table in --shm-dir when it stops, "
        "so a restart serves the blocks again. After a trial, this removes them: the files of the arena the "
        "given settings name (the same flags as strata serve: --shm-dir, --disk-dir, --config). It refuses while "
        "that daemon runs. The disk tier's blocks are left where they are (--disk-dir).",
    )
    clean.add_argument("--config", metavar="FILE", help="the daemon's TOML config file [env STRATA_CONFIG]")
    clean.add_argument("--dry-run", action="store_true", help="list what would be removed")
    add_settings_flags(clean)
    clean.set_defaults(func=cmd_clean)


def cmd_clean(args: argparse.Namespace) -> int:
    from kvstore.config.tiers import arena_name
    from kvstore.doctor.host import daemon_running, state_dir

    try:
        settings = load_settings(args.config or os.environ.get("STRATA_CONFIG"), **serve_overrides(args))
    except SettingsError as err:
        print(f"strata clean: {err}", file=sys.stderr)
        return 2
    if daemon_running(settings):
        print(f"strata clean: the daemon of --disk-dir {state_dir(settings)} is running: stop it first "
              "(its arena is in use)", file=sys.stderr)
        return 1
    directory = Path(settings.tiers.ram.shm_dir).expanduser()
    prefix = arena_name(state_dir(settings))
    found = sorted(p for p in directory.glob(prefix + "*") if p.is_file() or p.is_socket())
    held = sum(p.stat().st_blocks * 512 for p in found)
    for path in found:
        if not args.dry_run:
            path.unlink(missing_ok=True)
        print(f"{'would remove' if args.dry_run else 'removed'} {path}")
    print(f"{len(found)} files, {held / (1 << 20):.1f} MiB of shared memory"
          + (" would be given back" if args.dry_run else " given back" if found else ": nothing to remove"))
    return 0
