"""What the ``strata`` commands that take the daemon's settings share (serve, clean, doctor): one flag
per setting, the settings given as flags; and the log set-up every command uses."""

from __future__ import annotations

import argparse
import logging
import sys
import typing

from kvstore.config import SETTINGS, Settings
from kvstore.config.section import iter_sections


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, grouped by config section, its help taken from the field."""
    for path, section in iter_sections(Settings):
        names = [s for s in SETTINGS if s.path[:-1] == path]
        if not names:
            continue
        group = parser.add_argument_group(group_title(path), section.title)
        for s in names:
            default = s.field.get_default(call_default_factory=True)
            help_text = f"{s.field.description} [env {s.env}; config key {s.path[-1]}; default {_show(default)}]"
            if s.repeatable:
                group.add_argument(s.option, dest=s.flag, action="append", default=None, metavar=s.flag.upper(), help=help_text)
            elif s.field.annotation is bool:
                group.add_argument(s.option, dest=s.flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            else:
                literal = typing.get_origin(s.field.annotation) is typing.Literal
                choices = typing.get_args(s.field.annotation) if literal else None
                group.add_argument(s.option, dest=s.flag, default=None, choices=choices, metavar=s.flag.upper(), help=help_text)


def group_title(path: tuple[str, ...]) -> str:
    """A --help group: the config file's table, or its top level (``[[arenas]]``)."""
    return f"[{'.'.join(path)}]" if path else "top-level keys"


def _show(value) -> str:
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value >> 20}MiB" if value < 1 << 30 else f"{value >> 30}GiB"
    if isinstance(value, list):
        return ",".join(map(str, value)) or "none"
    if isinstance(value, dict):
        return ",".join(f"{k}:{v}" for k, v in value.items()) or "none"
    return str(value) if value != "" else "off"


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
