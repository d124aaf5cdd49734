"""Daemon settings: built once at start, validated, passed down.

Precedence, highest first: command-line flags, ``STRATA_*`` environment
variables, a TOML config file (``--config`` / ``STRATA_CONFIG``), defaults.
Sizes accept units: ``512MiB``, ``4GiB``, ``64KB``.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Annotated, Literal

from pydantic import ByteSize, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "strata"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="STRATA_", extra="forbid", validate_default=True)

    listen: str = Field("127.0.0.1:50051", description="gRPC address, host:port ('0.0.0.0:50051' for all interfaces)")
    unix_socket: str = Field(
        "", description="also serve gRPC on this Unix socket path (lower latency for same-host clients); empty: off"
    )
    same_host_socket: str = Field(
        "auto",
        description="Unix socket of the same-host block path (control of clients that map the arena, "
        "without gRPC): 'auto' next to the arena file, 'off' to disable, or a path",
    )
    same_host_max_connections: int = Field(64, ge=1, le=4096, description="same-host socket connections at once")
    same_host_idle_seconds: float = Field(300.0, gt=0, description="close a same-host connection idle this long")
    metrics_listen: str = Field("127.0.0.1:9464", description="Prometheus /metrics address, host:port; empty: off")
    node_id: str = Field(default_factory=socket.gethostname, description="this node's name in the fleet (default: hostname)")
    ram_bytes: ByteSize = Field(ByteSize(1 << 30), description="host-RAM tier size: one shared-memory arena, allocated at start")
    shm_dir: Path = Field(Path("/dev/shm"), description="directory (a tmpfs) holding the shared-memory arena file")
    disk_dir: Path = Field(DEFAULT_CACHE_DIR, description="local NVMe directory of the disk tier")
    disk_bytes: ByteSize = Field(ByteSize(10 << 30), description="disk tier capacity; 0 turns the disk tier off")
    disk_fsync: bool = Field(False, description="fsync each block written to disk (survives power loss, not only crashes)")
    max_block_bytes: ByteSize = Field(ByteSize(64 << 20), description="largest block accepted")
    chunk_bytes: ByteSize = Field(ByteSize(1 << 20), description="chunk size of streamed values")
    max_in_flight: int = Field(64, ge=1, description="RPCs served at once; more get RESOURCE_EXHAUSTED with a retry delay")
    workers: int = Field(16, ge=1, le=1024, description="gRPC worker threads")
    lease_seconds: float = Field(30.0, gt=0, description="default lease on arena slots and in-place reads")
    pin_lease_seconds: float = Field(300.0, gt=0, description="default lease of Pin")
    max_lease_seconds: float = Field(3600.0, gt=0, description="longest lease a client may ask for")
    max_leases: int = Field(65536, ge=1, description="open leases (pins, reads, slots) at once")
    max_batch_blocks: int = Field(4096, ge=1, description="blocks in one request")
    demotion_queue_blocks: int = Field(256, ge=1, description="write-behind queue from RAM to disk, in blocks")
    verify_commits: bool = Field(True, description="verify checksums of blocks written through shared memory")
    namespaces: Annotated[list[str], NoDecode] = Field(default_factory=list, description="namespaces to create at start (comma-separated)")
    auto_create_namespaces: bool = Field(True, description="create a namespace on its first write")
    index_url: str = Field(
        "memory://",
        description="prefix index: memory:// (embedded, this node only), redis://HOST:PORT/DB, "
        "or redis+cluster://HOST:PORT for a Redis Cluster",
    )
    index_ttl_seconds: float = Field(10.0, gt=0, description="node heartbeat TTL in the prefix index")
    score_weights: str = Field(
        "gpu=1,host=0.8,disk=0.5,peer=0.3,object=0.1",
        description="router score weight per tier: a cached block counts this much (tier=weight,...)",
    )
    kv_events: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="vLLM engines whose KV events to index, comma-separated, each "
        "ENDPOINT?engine=ID&namespace=NS[&replay=ENDPOINT][&topic=T], "
        "e.g. tcp://10.0.0.5:5557?engine=vllm-0&namespace=llama-3-8b",
    )
    grace_seconds: float = Field(10.0, ge=0, description="on SIGTERM, time given to in-flight RPCs")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level")
    log_format: Literal["json", "text"] = Field("json", description="log lines as JSON objects or plain text")

    @field_validator("namespaces", "kv_events", mode="before")
    @classmethod
    def _split_namespaces(cls, value):
        if isinstance(value, str):
            return [ns.strip() for ns in value.split(",") if ns.strip()]
        return value

    @field_validator("kv_events")
    @classmethod
    def _check_kv_events(cls, value: list[str]) -> list[str]:
        for spec in value:
            parse_event_source(spec)
        return value

    @field_validator("score_weights")
    @classmethod
    def _check_weights(cls, value: str) -> str:
        parse_weights(value)
        return value

    @model_validator(mode="after")
    def _check_sizes(self) -> Settings:
        if self.ram_bytes < 16 << 20:
            raise ValueError(f"ram_bytes is {self.ram_bytes.human_readable()}; give the RAM tier at least 16MiB")
        if self.max_block_bytes > self.ram_bytes:
            raise ValueError(
                f"max_block_bytes ({self.max_block_bytes.human_readable()}) is larger than ram_bytes "
                f"({self.ram_bytes.human_readable()}): raise ram_bytes or lower max_block_bytes"
            )
        if not 4 << 10 <= self.chunk_bytes <= 4 << 20:
            raise ValueError("chunk_bytes must be between 4KiB and 4MiB")
        if self.max_lease_seconds < max(self.lease_seconds, self.pin_lease_seconds):
            raise ValueError("max_lease_seconds must be at least lease_seconds and pin_lease_seconds")
        return self

    @property
    def max_message_bytes(self) -> int:
        # A chunk plus headroom for the header fields of a message.
        return int(self.chunk_bytes) + (64 << 10)


def parse_weights(text: str) -> dict:
    """``gpu=1,host=0.8`` → {TierName.GPU: 1.0, TierName.HOST: 0.8}."""
    from kvstore.block import TierName

    weights = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        try:
            tier = TierName[name.strip().upper()]
            weight = float(value)
        except (KeyError, ValueError):
            raise ValueError(
                f"score weight {part!r} is not tier=number with tier one of gpu, host, disk, peer, object"
            ) from None
        if not sep or weight < 0:
            raise ValueError(f"score weight {part!r} must be tier=number, the number non-negative")
        weights[tier] = weight
    return weights


def parse_event_source(spec: str):
    """``tcp://host:5557?engine=ID&namespace=NS&replay=tcp://host:5558`` → EngineSource."""
    from urllib.parse import parse_qs, urlsplit

    from kvstore.index.events import EngineSource

    endpoint, _, query = spec.partition("?")
    params = {k: v[-1] for k, v in parse_qs(query).items()}
    unknown = set(params) - {"engine", "namespace", "replay", "topic"}
    if not urlsplit(endpoint).scheme or unknown or "engine" not in params or "namespace" not in params:
        raise ValueError(
            f"kv_events entry {spec!r} must look like "
            "tcp://HOST:PORT?engine=ID&namespace=NS[&replay=tcp://HOST:PORT][&topic=T]"
        )
    return EngineSource(endpoint, params["engine"], params["namespace"], params.get("replay"), params.get("topic", ""))


class SettingsError(ValueError):
    """Settings that failed validation, said in terms of flags and variables."""


def load_settings(config_file: str | Path | None = None, **overrides) -> Settings:
    """Settings from overrides (flags), environment, then ``config_file``."""
    if config_file is not None and not Path(config_file).is_file():
        raise SettingsError(f"config file {config_file} does not exist")

    class _Settings(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            sources = [init_settings, env_settings]
            if config_file is not None:
                sources.append(TomlConfigSettingsSource(settings_cls, toml_file=config_file))
            return tuple(sources)

    try:
        return _Settings(**overrides)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            name = ".".join(str(p) for p in e["loc"]) or "settings"
            where = f" (flag --{name.replace('_', '-')}, env STRATA_{name.upper()})" if e["loc"] else ""
            lines.append(f"  {name}{where}: {e['msg']}")
        raise SettingsError("invalid settings:\n" + "\n".join(lines)) from None
