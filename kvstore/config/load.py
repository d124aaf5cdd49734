"""Settings from their three sources, and errors that say which name to change.

Precedence, highest first: keyword overrides (the flags of ``strata serve``),
``STRATA_*`` environment variables, the TOML config file, the defaults of
the section models. The layers are merged key by key, so a flag overrides
one value of a file's section and keeps the rest.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvstore.config.section import ENV_NESTING, ENV_PREFIX, SettingName, iter_settings, section_at
from kvstore.config.settings import Settings

# Every setting's names, in declaration order (the order of --help).
SETTINGS: tuple[SettingName, ...] = tuple(iter_settings(Settings))
BY_FLAG: dict[str, SettingName] = {s.flag: s for s in SETTINGS}
BY_PATH: dict[tuple[str, ...], SettingName] = {s.path: s for s in SETTINGS}
assert len(BY_FLAG) == len(SETTINGS), "two settings share a flag name"

MAX_CONFIG_FILE_BYTES = 1 << 20


class SettingsError(ValueError):
    """Settings that failed validation, said in terms of flags, variables and config keys."""


def load_settings(
    config_file: str | Path | None = None, *, environ: Mapping[str, str] | None = None, **overrides: Any
) -> Settings:
    """Settings from ``overrides`` (flag names, or a section name with a dict), the environment, then ``config_file``."""
    problems: list[str] = []
    merged: dict[str, Any] = {}
    if config_file is not None:
        _merge(merged, read_config_file(Path(config_file)))
    _merge(merged, _from_environment(os.environ if environ is None else environ, problems))
    _merge(merged, _from_overrides(overrides, problems))
    if problems:
        raise SettingsError("invalid settings:\n" + "\n".join(problems))
    try:
        return Settings.model_validate(merged)
    except ValidationError as err:
        raise SettingsError("invalid settings:\n" + "\n".join(_describe(e) for e in err.errors())) from None


def read_config_file(path: Path) -> dict[str, Any]:
    """The TOML file's tables as nested dicts; its keys are checked with the values."""
    if not path.is_file():
        raise SettingsError(f"config file {path} does not exist")
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_FILE_BYTES + 1)
    except OSError as err:
        raise SettingsError(f"cannot read config file {path} ({err.strerror})") from None
    if len(data) > MAX_CONFIG_FILE_BYTES:
        raise SettingsError(f"config file {path} is over {MAX_CONFIG_FILE_BYTES >> 20}MiB; is it the right file?")
    try:
        return tomllib.loads(data.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise SettingsError(f"config file {path} is not valid TOML: {err}") from None


def _from_environment(environ: Mapping[str, str], problems: list[str]) -> dict[str, Any]:
    """``STRATA_RAM_BYTES`` (a flag's name) or ``STRATA_TIERS__RAM__BYTES`` (its path); names are case-insensitive."""
    env = {name.upper(): value for name, value in environ.items() if name.upper().startswith(ENV_PREFIX)}
    values: dict[str, Any] = {}
    for s in SETTINGS:
        flat, nested = env.get(s.env), env.get(s.nested_env)
        if flat is not None and nested is not None and flat != nested:
            problems.append(f"  {s.flag}: both {s.env}={flat!r} and {s.nested_env}={nested!r} are set; unset one")
        value = nested if nested is not None else flat
        if value is not None:
            _set(values, s.path, value)
    known_nested = {s.nested_env for s in SETTINGS}
    for name in sorted(env):
        if ENV_NESTING in name[len(ENV_PREFIX):] and name not in known_nested:
            path = tuple(name[len(ENV_PREFIX):].lower().split(ENV_NESTING))
            problems.append(f"  environment variable {name} names no setting; {_known_under(path[:-1], env=True)}")
    return values


def _from_overrides(overrides: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, value in overrides.items():
        if name in BY_FLAG:
            _set(values, BY_FLAG[name].path, value)
        elif name in Settings.model_fields and isinstance(value, Mapping):
            _merge(values, {name: value})
        else:
            problems.append(
                f"  {name}: unknown setting; known: {', '.join(BY_FLAG)} (or a section: {', '.join(Settings.model_fields)})"
            )
    return values


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
    tree[path[-1]] = value


def _merge(into: dict[str, Any], layer: Mapping[str, Any]) -> None:
    """Deep-merge ``layer`` over ``into``: tables merge, values replace."""
    for key, value in layer.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = dict(value) if isinstance(value, Mapping) else value


def _known_under(path: tuple[str | int, ...], env: bool = False) -> str:
    section = section_at(Settings, path)
    if section is None:
        return f"{'.'.join(map(str, path))} is not a section; sections: {', '.join(Settings.model_fields)}"
    keys = list(section.model_fields)
    if env:
        stem = ENV_PREFIX + "".join(f"{p}{ENV_NESTING}".upper() for p in path)
        return f"known: {', '.join(stem + k.upper() for k in keys)}"
    where = f"in [{'.'.join(map(str, path))}]" if path else "at the top level"
    return f"known {where}: {', '.join(keys)}"


def _describe(error: Mapping[str, Any]) -> str:
    loc = tuple(error["loc"])
    if error["type"] == "extra_forbidden":
        key = loc[-1]
        hint = ""
        if len(loc) == 1 and key in BY_FLAG:
            hint = f" ({key} is the flag {BY_FLAG[key].option}; in a config file it is {BY_FLAG[key].toml})"
        return f"  {'.'.join(map(str, loc))}: unknown section or key; {_known_under(loc[:-1])}{hint}"
    message = error["msg"].removeprefix("Value error, ")
    for end in range(len(loc), 0, -1):
        s = BY_PATH.get(loc[:end])  # type: ignore[arg-type]
        if s is not None:
            return f"  {s.where()}: {message}"
    if loc:
        return f"  [{'.'.join(map(str, loc))}]: {message}"
    return f"  settings: {message}"
