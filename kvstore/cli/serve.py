"""``strata serve``: the node daemon, every setting a flag."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvstore.cli.common import add_settings_flags, serve_overrides, setup_logging
from kvstore.config import SettingsError, load_settings


def add_parser(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="start the node daemon",
        description="Start the node daemon: gRPC KVService with health and reflection, Prometheus metrics, "
        "a host-RAM tier (shared memory) over a disk tier. Every setting comes from a flag, a STRATA_* "
        "environment variable (the flag's name, or the section path: STRATA_TIERS__RAM__BYTES) or a TOML "
        "config file, in that order of precedence. Flags are grouped below by the config file section that "
        "holds them; sizes take units (512MiB, 4GiB).",
    )
    serve.add_argument("--config", metavar="FILE",
                       help="TOML config file, one table per section below: [tiers.ram] bytes = \"1GiB\" "
                       "(example: deploy/strata.example.toml) [env STRATA_CONFIG]")
    add_settings_flags(serve)
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    overrides = serve_overrides(args)
    config = args.config or os.environ.get("STRATA_CONFIG")
    try:
        settings = load_settings(config, **overrides)
    except SettingsError as err:
        print(f"strata serve: {err}", file=sys.stderr)
        return 2
    setup_logging(settings.logging.level, settings.logging.format)
    from kvstore.errors import StrataError
    from kvstore.server.daemon import serve

    try:
        return serve(settings)
    except StrataError as err:
        logging.getLogger("strata").error("cannot start: %s", err)
        print(f"strata serve: {err}", file=sys.stderr)
        return 1
