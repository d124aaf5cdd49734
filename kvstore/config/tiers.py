"""Settings of the tiers: ``[tiers] chain``, ``[tiers.ram]`` and ``[tiers.disk]``.

``chain`` orders the tiers, fastest first; each name is a section here and a
tier in :mod:`kvstore.tiers`' registry. Every tier below the head says how
blocks reach it (``write_policy``) and whether reads from it are copied up
(``promote``): the policy of the edge above it. The GPU, peer and object
tiers get their sections here when they exist: a
:class:`~kvstore.config.section.Section` subclass (a
:class:`LowerTierSettings` for a tier below the head) and a field of
:class:`TierSettings`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import xxhash
from pydantic import ByteSize, Field, field_validator, model_validator

from kvstore.config.section import Section, setting
from kvstore.config.values import split_commas

MIN_RAM_BYTES = 16 << 20


def default_cache_dir() -> Path:
    # Looked up at load, not import: a test or a container may set HOME late.
    return Path.home() / ".cache" / "strata"


class RamSettings(Section):
    flag_prefix = "ram_"
    title = "host-RAM tier: one shared-memory arena, allocated at start"

    bytes: ByteSize = setting(ByteSize(1 << 30), "host-RAM tier size: one shared-memory arena, allocated at start")
    shm_dir: Path = setting(
        Path("/dev/shm"), "directory (a tmpfs) holding the shared-memory arena file", flag="shm_dir"
    )
    crash_safe: bool = setting(
        True,
        "keep a table of committed blocks beside the arena, so a daemon restarted after a crash (SIGKILL, OOM "
        "kill) re-adopts its RAM blocks while the host stays up; off saves a small write per put",
    )
    keep_on_exit: bool = setting(
        True,
        "leave the arena and its table in the shared-memory directory at a graceful stop, so the next start "
        "(an upgrade) finds the RAM cache warm; off removes them (needs crash_safe to matter)",
    )

    @field_validator("bytes")
    @classmethod
    def _at_least_16mib(cls, value: ByteSize) -> ByteSize:
        if value < MIN_RAM_BYTES:
            raise ValueError(f"ram_bytes is {value.human_readable()}; give the RAM tier at least 16MiB")
        return value

    @property
    def enabled(self) -> bool:
        return True

    def tier_options(self, state_dir: Path) -> dict[str, Any]:
        """Keyword arguments of the tier's constructor (``kvstore.tiers.open_tier``)."""
        return {
            "capacity_bytes": int(self.bytes), "shm_dir": str(self.shm_dir), "arena_name": arena_name(state_dir),
            "crash_safe": self.crash_safe, "keep_on_exit": self.keep_on_exit,
        }

    def arena_path(self, state_dir: Path) -> Path:
        """The arena file of the daemon whose state directory is ``state_dir`` (its table: + ``.table``)."""
        return self.shm_dir / arena_name(state_dir)

    def arena_options(self, options: dict[str, Any], arena: dict[str, Any], state_dir: Path) -> dict[str, Any] | None:
        """``options`` for one arena's own tier (``arena`` as in ``Settings.arena_plan``): its RAM
        share; a named arena's file is the default arena's name plus ``-NAME``."""
        options = {**options, "capacity_bytes": arena["ram_bytes"]}
        if not arena["default"]:
            options["arena_name"] = f"{options['arena_name']}-{arena['name']}"
        return options


def arena_name(state_dir: Path) -> str:
    # One arena per state directory: a restart finds the arena its previous
    # run left (to re-adopt it, or to replace it) instead of leaking its RAM.
    return "strata-" + xxhash.xxh64_hexdigest(str(state_dir).encode())


class LowerTierSettings(Section):
    """What every tier below the head has: the policy of the edge above it."""

    write_policy: Literal["back", "through", "off"] = setting(
        "back",
        "how blocks come down to this tier: back (when evicted above), through (as soon as stored above, "
        "keeping the upper copy), off (never; evicted blocks are dropped)",
    )
    promote: bool = setting(True, "copy a block read from this tier up into RAM, so the next read is served there")

    def arena_options(self, options: dict[str, Any], arena: dict[str, Any], state_dir: Path) -> dict[str, Any] | None:
        """``options`` for one arena's own instance of this tier; None leaves the tier out of
        that arena's chain. Unless a tier says otherwise, every arena's instance is configured alike."""
        return options

    def edge(self) -> dict[str, bool]:
        """Keyword arguments of ``kvstore.store.EdgePolicy`` for the edge above this tier."""
        return {
            "demote": self.write_policy != "off",
            "write_through": self.write_policy == "through",
            "promote": self.promote,
        }


class DiskSettings(LowerTierSettings):
    flag_prefix = "disk_"
    title = "disk tier: blocks on local NVMe; its directory also holds the node epoch and a lock"

    dir: Path = setting(default_factory=default_cache_dir, description="local NVMe directory of the disk tier")
    bytes: ByteSize = setting(ByteSize(10 << 30), "disk tier capacity; 0 turns the disk tier off")
    fsync: bool = setting(False, "fsync each block written to disk (survives power loss, not only crashes)")

    @property
    def enabled(self) -> bool:
        return self.bytes > 0

    def tier_options(self, state_dir: Path) -> dict[str, Any]:
        return {"directory": state_dir / "blocks", "capacity_bytes": int(self.bytes), "fsync": self.fsync}

    def arena_options(self, options: dict[str, Any], arena: dict[str, Any], state_dir: Path) -> dict[str, Any] | None:
        """One arena's disk share; a named arena keeps its blocks in ``arenas/NAME`` under the disk
        directory (the default arena keeps ``blocks``, so a node's cache survives adding arenas)."""
        if arena["disk_bytes"] <= 0:
            return None  # that arena lives in RAM only
        options = {**options, "capacity_bytes": arena["disk_bytes"]}
        if not arena["default"]:
            options["directory"] = state_dir / "arenas" / arena["name"]
        return options


class TierSettings(Section):
    title = "the tiers, fastest first"

    chain: Annotated[list[str], Field(min_length=1, max_length=8)] = setting(
        default_factory=lambda: ["ram", "disk"],
        description="the tiers in order, fastest first, comma-separated; ram comes first (a tier whose size is 0 is left out)",
        flag="tiers",
    )
    ram: RamSettings = setting(default_factory=RamSettings)
    disk: DiskSettings = setting(default_factory=DiskSettings)

    _split = field_validator("chain", mode="before")(split_commas)

    @model_validator(mode="after")
    def _known_chain(self) -> TierSettings:
        known = [name for name in type(self).model_fields if name != "chain"]
        for name in self.chain:
            if name not in known:
                raise ValueError(f"tier {name!r} in the chain is not a tier; the known tiers are {', '.join(known)}")
        if self.chain[0] != "ram" or len(set(self.chain)) != len(self.chain):
            raise ValueError(f"chain {self.chain}: ram comes first, and each tier appears once")
        return self

    def section(self, name: str) -> Section:
        return getattr(self, name)
