"""What the ``strata`` commands share: the settings given as flags, and the log set-up."""

from __future__ import annotations

import argparse
import logging
import sys

from kvstore.config import SETTINGS


def serve_overrides(args: argparse.Namespace) -> dict:
    """The daemon's settings given as flags (the highest layer of :func:`~kvstore.config.load_settings`)."""
    return {s.flag: getattr(args, s.flag) for s in SETTINGS if getattr(args, s.flag) is not None}


def setup_logging(level: str, fmt: str) -> None:
    """Log to stderr at ``level``, as text or (``fmt`` "json") one JSON object a line; "auto": text
    when stderr is a terminal, JSON otherwise."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "auto":
        fmt = "text" if sys.stderr.isatty() else "json"
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(
            JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s", rename_fields={"levelname": "level"})
        )
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
