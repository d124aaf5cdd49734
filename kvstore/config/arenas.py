"""Settings of isolated arenas: ``[[arenas]]`` (or ``[arenas.NAME]``), ``--arena``, ``STRATA_ARENA``.

An arena is a group of namespaces with its own shared-memory file, RAM size
and disk share (see :mod:`kvstore.store.group`). Three ways to write one::

    --arena team-a:team-a-*,shared-emb:4GiB[:40GiB]      (repeat the flag per arena)
    STRATA_ARENA="team-a:team-a-*:4GiB;team-b:llama-3-8b:2GiB"   (';' between arenas)

    [[arenas]]                          [arenas.team-a]
    name = "team-a"                     namespaces = ["team-a-*"]
    namespaces = ["team-a-*"]           ram_bytes = "4GiB"
    ram_bytes = "4GiB"
    disk_bytes = "40GiB"   # optional

Sizes are carved out of the node's totals: ``--ram-bytes`` and
``--disk-bytes`` stay what the node uses in all, and the default arena
(every namespace no arena names, at today's arena path and disk directory)
gets what the named arenas leave. A named arena without a disk size gets the
disk share of its RAM share (``disk_bytes × its RAM / ram_bytes``); a disk
size of 0 keeps that arena in RAM only. Keeping the totals fixed means
adding an arena never makes the node use more memory or disk than it was
given; it does shrink the default arena, whose least recently used blocks
then leave at start.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator

from kvstore.config.tiers import MIN_RAM_BYTES
from kvstore.store.namespace_rules import EVERYTHING_ELSE, check_disjoint, check_rule

ARENA_SYNTAX = "NAME:NS1,NS2:RAM_BYTES[:DISK_BYTES]"
DEFAULT_ARENA = "default"
MAX_ARENAS = 64  # the store's ids have room for 256; beyond a few dozen an arena per tenant is the wrong tool
MAX_ARENA_NAMESPACES = 256
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")  # it names a file and a socket


class ArenaSettings(BaseModel):
    """One named arena."""

    model_config = ConfigDict(extra="forbid")

    name: str
    namespaces: list[str] = Field(min_length=1, max_length=MAX_ARENA_NAMESPACES)
    ram_bytes: ByteSize
    disk_bytes: ByteSize | None = None

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if value == DEFAULT_ARENA:
            raise ValueError(
                f"arena name {DEFAULT_ARENA!r} is taken by the arena of every namespace no arena names: pick another"
            )
        if not _NAME_RE.match(value):
            raise ValueError(
                f"arena name {value!r} must be 1-32 characters of a-z, 0-9, '-' or '_', starting with a letter "
                "or digit (it names the arena's file and socket)"
            )
        return value

    @field_validator("namespaces")
    @classmethod
    def _rules(cls, value: list[str]) -> list[str]:
        return [check_rule(rule) for rule in value]

    @field_validator("ram_bytes")
    @classmethod
    def _at_least_16mib(cls, value: ByteSize) -> ByteSize:
        if value < MIN_RAM_BYTES:
            raise ValueError(f"an arena's ram_bytes is {value.human_readable()}; give each arena at least 16MiB")
        return value


def parse_arena(spec: str) -> dict[str, Any]:
    """``team-a:ns1,team-a-*:4GiB[:40GiB]`` → the fields of :class:`ArenaSettings` (checked there)."""
    parts = spec.strip().split(":")
    if len(parts) not in (3, 4) or not all(p.strip() for p in parts):
        raise ValueError(f"arena {spec!r} must look like {ARENA_SYNTAX}, e.g. team-a:team-a-*,shared-emb:4GiB")
    fields: dict[str, Any] = {
        "name": parts[0].strip(),
        "namespaces": [ns.strip() for ns in parts[1].split(",") if ns.strip()],
        "ram_bytes": parts[2].strip(),
    }
    if len(parts) == 4:
        fields["disk_bytes"] = parts[3].strip()
    return fields


def parse_arenas(cls, value: Any) -> Any:
    """Every form to a list of :class:`ArenaSettings` fields: a flag's list of specs, an
    environment variable's ``;``-separated specs, TOML ``[[arenas]]`` or ``[arenas.NAME]``."""
    if isinstance(value, str):
        value = [part for part in value.split(";") if part.strip()]
    if isinstance(value, Mapping):  # [arenas.NAME] tables
        value = [{"name": name, **table} if isinstance(table, Mapping) else table for name, table in value.items()]
    if isinstance(value, list):
        return [parse_arena(item) if isinstance(item, str) else item for item in value]
    return value


def plan_arenas(arenas: list[ArenaSettings], ram_bytes: int, disk_bytes: int) -> list[dict[str, Any]]:
    """Name, namespace rules, RAM and disk bytes of every arena, the default one first.

    Raises ValueError, saying what to change, when the arenas overlap or do not fit the node's totals.
    """
    names = [a.name for a in arenas]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"arena {name!r} is defined twice: give each arena its own name")
    check_disjoint([(a.name, a.namespaces) for a in arenas])
    named_ram = sum(int(a.ram_bytes) for a in arenas)
    default_ram = ram_bytes - named_ram
    if default_ram < MIN_RAM_BYTES:
        raise ValueError(
            f"the arenas take {ByteSize(named_ram).human_readable()} of ram_bytes "
            f"({ByteSize(ram_bytes).human_readable()}), leaving {ByteSize(max(default_ram, 0)).human_readable()} "
            "for the default arena, which needs at least 16MiB: raise --ram-bytes or shrink the arenas"
        )
    plan = []
    for a in arenas:
        if a.disk_bytes is not None and a.disk_bytes > 0 and disk_bytes == 0:
            raise ValueError(
                f"arena {a.name!r} asks for disk_bytes {a.disk_bytes.human_readable()} but the disk tier is off "
                "(disk_bytes 0): drop the arena's disk size, or give the node --disk-bytes"
            )
        disk = int(a.disk_bytes) if a.disk_bytes is not None else disk_bytes * int(a.ram_bytes) // ram_bytes
        plan.append({"name": a.name, "default": False, "namespaces": tuple(a.namespaces), "ram_bytes": int(a.ram_bytes),
                     "disk_bytes": disk})
    default_disk = disk_bytes - sum(p["disk_bytes"] for p in plan)
    if disk_bytes and default_disk <= 0:
        raise ValueError(
            f"the arenas' disk sizes take all of disk_bytes ({ByteSize(disk_bytes).human_readable()}): raise "
            "--disk-bytes or lower the arenas' disk sizes, so the default arena keeps a share"
        )
    default = {"name": DEFAULT_ARENA, "default": True, "namespaces": EVERYTHING_ELSE, "ram_bytes": default_ram, "disk_bytes": default_disk}
    return [default, *plan]
