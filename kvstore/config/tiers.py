"""Settings of the tiers: ``[tiers.ram]`` and ``[tiers.disk]``.

The GPU, peer and object tiers get their sections here when they exist:
a :class:`~kvstore.config.section.Section` subclass and a field of
:class:`TierSettings`.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ByteSize, field_validator

from kvstore.config.section import Section, setting

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

    @field_validator("bytes")
    @classmethod
    def _at_least_16mib(cls, value: ByteSize) -> ByteSize:
        if value < MIN_RAM_BYTES:
            raise ValueError(f"ram_bytes is {value.human_readable()}; give the RAM tier at least 16MiB")
        return value


class DiskSettings(Section):
    flag_prefix = "disk_"
    title = "disk tier: blocks on local NVMe; its directory also holds the node epoch and a lock"

    dir: Path = setting(default_factory=default_cache_dir, description="local NVMe directory of the disk tier")
    bytes: ByteSize = setting(ByteSize(10 << 30), "disk tier capacity; 0 turns the disk tier off")
    fsync: bool = setting(False, "fsync each block written to disk (survives power loss, not only crashes)")


class TierSettings(Section):
    title = "the tiers, fastest first"

    ram: RamSettings = setting(default_factory=RamSettings)
    disk: DiskSettings = setting(default_factory=DiskSettings)
