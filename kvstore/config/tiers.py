"""Settings of the tiers: ``[tiers] chain``, ``[tiers.ram]``, ``[tiers.disk]``, ``[tiers.peer]``, ``[tiers.object]``.

``chain`` orders the tiers, fastest first; each name is a section here and a
tier in :mod:`kvstore.tiers`' registry. Every tier below the head says how
blocks reach it (``write_policy``) and whether reads from it are copied up
(``promote``): the policy of the edge above it. The GPU tier
(``[tiers.gpu]``) is not listed in ``chain``: a size (``--gpu-bytes``)
puts it at the head, above RAM; 0 (the default) leaves it out and nothing
else changes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import xxhash
from pydantic import ByteSize, Field, TypeAdapter, field_validator, model_validator

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
    prefault: bool = setting(
        True,
        "fault the arena's pages in at start, on a thread of its own, so puts find them ready (a put into "
        "pages the kernel has not yet given the arena costs a page fault and a zeroed page per 4 KiB, on a "
        "VM over ten times the copy); the arena's memory is then taken at start, not as blocks arrive. "
        "Only where shm_dir is a tmpfs",
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
            "crash_safe": self.crash_safe, "keep_on_exit": self.keep_on_exit, "prefault": self.prefault,
        }

    def edge(self) -> dict[str, bool]:
        """The edge above RAM, when the gpu tier is the head: blocks evicted from device memory come
        down to RAM and a read from RAM goes back up (``EdgePolicy``'s defaults, as embedded)."""
        return {}

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


class PeerTierSettings(LowerTierSettings):
    flag_prefix = "peer_"
    title = ("peer tier: on a local miss, blocks other daemons hold (found through the prefix index) are "
             "fetched, verified, and copied up; read-through only")

    write_policy: Literal["back", "through", "off"] = setting(
        "off",
        "blocks never go down to peers (off); the peer tier is read-through only and refuses writes, so "
        "back or through only cost a refused call per block",
    )
    max_fetches: int = setting(16, "reads from peers running at once", ge=1, le=1024)
    max_queued: int = setting(
        64, "reads waiting for a turn beyond max_fetches; more are refused at once (RESOURCE_EXHAUSTED, a "
        "local miss), never queued", ge=0, le=1 << 16,
    )
    fetch_seconds: float = setting(2.0, "deadline of one fetch from one holder; past it the next holder is tried",
                                   gt=0, le=300)
    deadline_seconds: float = setting(
        5.0, "deadline of a whole peer read (every holder tried); a local miss never waits longer", gt=0, le=600
    )
    max_holders: int = setting(3, "holders tried per block before it is a miss", ge=1, le=64)
    backoff_seconds: float = setting(
        1.0, "a holder that could not be reached or stalled is skipped this long", ge=0, le=3600
    )
    transports: Annotated[list[str], Field(min_length=1, max_length=8)] = setting(
        default_factory=lambda: ["tcp", "grpc"],
        description="transport schemes this node fetches with, preferred first, comma-separated; a holder is "
        "reached by the first one it also advertises (tcp: holders with --peer-listen; ucx: holders with "
        "--peer-ucx-listen, and ucxx here; grpc: every daemon); ucx-shm (holders on this host with "
        "--peer-ucx-shm, and ucxx here) is taken first wherever it is listed, for holders on this host only",
    )
    token_file: str = setting(
        "", "file holding the bearer token this daemon presents to its peers; their auth policy must let it "
        "read the namespaces it fetches; empty: no token (peers without authentication)",
    )
    tls_ca: str = setting("", "CA certificate (PEM) that signed the peers' TLS certificates, when they serve TLS")

    _split = field_validator("transports", mode="before")(split_commas)

    @field_validator("transports")
    @classmethod
    def _schemes(cls, value: list[str]) -> list[str]:
        for scheme in value:
            if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
                raise ValueError(f"peer transport {scheme!r} is not a scheme name such as grpc or tcp")
        if len(set(value)) != len(value):
            raise ValueError(f"peer transports {value}: list each scheme once")
        return value

    @model_validator(mode="after")
    def _deadlines(self) -> PeerTierSettings:
        if self.fetch_seconds > self.deadline_seconds:
            raise ValueError(
                f"peer_fetch_seconds ({self.fetch_seconds:g}) is longer than peer_deadline_seconds "
                f"({self.deadline_seconds:g}): one holder's fetch must fit in the whole read's deadline"
            )
        return self

    @property
    def enabled(self) -> bool:
        return True

    def tier_options(self, state_dir: Path) -> dict[str, Any]:
        """Plain values; the daemon adds its index, node id, host and metrics (``kvstore.tiers`` ``peer``)."""
        return {
            "deadline_s": self.deadline_seconds, "max_fetches": self.max_fetches, "max_queued": self.max_queued,
            "fetch_s": self.fetch_seconds, "max_holders": self.max_holders, "backoff_s": self.backoff_seconds,
            "schemes": tuple(self.transports), "token_file": self.token_file, "tls_ca": self.tls_ca,
        }

_SIZE = TypeAdapter(ByteSize)


class ObjectTierSettings(LowerTierSettings):
    flag_prefix = "object_"
    title = ("object tier: blocks evicted from disk go up to an S3-compatible bucket the fleet shares (verified, "
             "one object per block); a local miss reads through")

    write_policy: Literal["back", "through", "off"] = setting(
        "back",
        "how blocks reach the bucket: back (when evicted from the tier above), through (as soon as stored "
        "there, keeping that copy), off (never: read-through only); uploads never hold up a put",
    )
    bucket: str = setting("", "S3 bucket (required with object in the chain); it must exist")
    prefix: str = setting("strata", "key prefix in the bucket: daemons on one bucket and prefix share blocks")
    endpoint: str = setting(
        "", "S3 endpoint, scheme and host: empty for AWS (or AWS_ENDPOINT_URL); http://minio:9000 for MinIO; "
        "http:// allows plain HTTP",
    )
    region: str = setting("", "region; empty: AWS_REGION, AWS_DEFAULT_REGION, the AWS config file, or us-east-1")
    profile: str = setting(
        "", "profile of the AWS credentials and config files; empty: AWS_PROFILE or default. Credentials come "
        "from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, that file, then web identity (IRSA), the container or "
        "the instance role; they are never logged",
    )
    virtual_hosted: bool = setting(
        False, "address the bucket as a host name (BUCKET.s3.REGION.amazonaws.com) instead of a path; MinIO "
        "and most S3-compatible servers want paths",
    )
    max_requests: int = setting(32, "S3 requests in flight at once (reads and uploads)", ge=2, le=1024)
    max_uploads: int = setting(8, "uploads at once (of max_requests; the rest stay free for reads)", ge=1, le=512)
    queue_blocks: int = setting(1024, "blocks waiting for upload; beyond it the oldest are dropped", ge=1,
                                le=1 << 20)
    queue_bytes: ByteSize = setting(
        ByteSize(256 << 20), "block bytes waiting for upload (held in memory); beyond it the oldest are dropped"
    )
    part_bytes: ByteSize = setting(ByteSize(8 << 20), "part size of multipart uploads (S3's minimum: 5MiB)")
    multipart_bytes: ByteSize = setting(
        ByteSize(64 << 20), "blocks at least this large upload in parts; smaller ones in one conditional PUT "
        "(If-None-Match: the bucket keeps one object however many nodes write the block)",
    )
    read_seconds: float = setting(5.0, "deadline of one read from the bucket; a local miss never waits longer",
                                  gt=0, le=300)
    upload_seconds: float = setting(30.0, "deadline of one upload, retries included; then it is tried again later",
                                    gt=0, le=3600)
    request_seconds: float = setting(10.0, "timeout of one S3 request", gt=0, le=600)
    retries: int = setting(4, "retries of one S3 request answered 5xx or SlowDown, or not answered", ge=0, le=20)
    check_before_put: bool = setting(
        True, "ask the bucket (a small ranged GET) before an upload, so a block another node stored is not "
        "sent again",
    )
    drain_seconds: float = setting(10.0, "at a graceful stop, wait this long for queued uploads", ge=0, le=600)
    ttl_seconds: float = setting(
        0.0, "blocks neither written nor read for this long are deleted by the lifecycle sweep (every "
        "namespace without its own namespace_ttl); 0: never", ge=0,
    )
    namespace_ttl: Annotated[list[str], Field(max_length=1024)] = setting(
        default_factory=list, description="a namespace's own TTL, NAMESPACE=SECONDS (once per namespace)",
        repeatable=True,
    )
    namespace_quota: Annotated[list[str], Field(max_length=1024)] = setting(
        default_factory=list, description="a namespace's bound on object bytes in the bucket, NAMESPACE=BYTES "
        "(e.g. chat=500GiB; once per namespace): a block beyond it is refused before upload and stays local",
        repeatable=True,
    )
    sweep_seconds: float = setting(
        600.0, "with a TTL or a quota: run a lifecycle sweep (expire, collect, measure usage) this often; one "
        "daemon per namespace at a time, by a lease object in the bucket; 0: this daemon never sweeps", ge=0,
    )
    lease_seconds: float = setting(300.0, "how long a sweep lease lasts unless renewed (a dead sweeper's lease "
                                          "expires after it)", gt=0, le=86400)
    abandoned_upload_seconds: float = setting(
        3600.0, "the sweep aborts multipart uploads under the prefix older than this (a daemon killed "
        "mid-upload leaves its parts), counted from the later of S3's Initiated and the first sweep that saw "
        "it; it must exceed upload_seconds, so a live upload is never cut",
        gt=0, le=30 * 86400,
    )

    @field_validator("namespace_ttl")
    @classmethod
    def _ttls(cls, value: list[str]) -> list[str]:
        from kvstore.errors import InvalidArgument
        from kvstore.remote.object.lifecycle import parse_ttls

        try:
            parse_ttls(value)
        except InvalidArgument as err:
            raise ValueError(str(err)) from None
        return value

    @field_validator("namespace_quota")
    @classmethod
    def _quotas(cls, value: list[str]) -> list[str]:
        for entry in value:
            ns, sep, size = entry.rpartition("=")
            if not sep or not ns:
                raise ValueError(f"object_namespace_quota {entry!r}: write NAMESPACE=BYTES, e.g. chat=500GiB")
            try:
                _SIZE.validate_python(size)
            except ValueError:
                raise ValueError(f"object_namespace_quota {entry!r}: {size!r} is not a size (e.g. 500GiB)") from None
        return value

    def quotas(self) -> dict[str, int]:
        return {e.rpartition("=")[0]: int(_SIZE.validate_python(e.rpartition("=")[2])) for e in self.namespace_quota}

    @field_validator("part_bytes")
    @classmethod
    def _part_minimum(cls, value: ByteSize) -> ByteSize:
        if value < 5 << 20:
            raise ValueError(f"object_part_bytes is {value.human_readable()}; S3 parts are at least 5MiB")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ObjectTierSettings:
        if self.max_uploads >= self.max_requests:
            raise ValueError(
                f"object_max_uploads ({self.max_uploads}) must be below object_max_requests ({self.max_requests}): "
                "reads need requests of their own"
            )
        if self.multipart_bytes < self.part_bytes:
            raise ValueError("object_multipart_bytes must be at least object_part_bytes")
        if self.abandoned_upload_seconds <= self.upload_seconds:
            raise ValueError(
                f"object_abandoned_upload_seconds ({self.abandoned_upload_seconds:g}) must exceed "
                f"object_upload_seconds ({self.upload_seconds:g}): a live upload would be aborted"
            )
        return self

    @property
    def enabled(self) -> bool:
        return True

    def tier_options(self, state_dir: Path) -> dict[str, Any]:
        """Plain values; the daemon adds its environment (for credentials) and the metrics."""
        return {
            "bucket": self.bucket, "prefix": self.prefix, "endpoint": self.endpoint, "region": self.region,
            "profile": self.profile, "virtual_hosted": self.virtual_hosted, "call_s": self.read_seconds,
            "max_requests": self.max_requests, "request_s": self.request_seconds, "retries": self.retries,
            "part_bytes": int(self.part_bytes), "multipart_bytes": int(self.multipart_bytes),
            "check_before_put": self.check_before_put, "queue_blocks": self.queue_blocks,
            "queue_bytes": int(self.queue_bytes), "max_uploads": self.max_uploads,
            "upload_s": self.upload_seconds, "drain_s": self.drain_seconds,
            "ttl_s": self.ttl_seconds, "namespace_ttl_s": self._ttl_map(), "namespace_quota_bytes": self.quotas(),
            # Abandoned multipart uploads are collected whenever this daemon writes to the bucket.
            "sweep_s": self.sweep_seconds if (self.ttl_seconds or self.namespace_ttl or self.namespace_quota
                                              or self.write_policy != "off") else 0.0,
            "lease_s": self.lease_seconds, "upload_age_s": self.abandoned_upload_seconds,
        }

    def _ttl_map(self) -> dict[str, float]:
        from kvstore.remote.object.lifecycle import parse_ttls

        return parse_ttls(self.namespace_ttl)


class GpuSettings(Section):
    flag_prefix = "gpu_"
    title = ("GPU tier: KV blocks in device memory (one region per device, allocated at start) at the head of "
             "the chain, demoted to RAM over pinned buffers; needs CUDA (torch). Same-host clients read and write "
             "it through the region's handle (docs/guide/tiers/gpu.md)")

    bytes: ByteSize = setting(ByteSize(0), "device memory per GPU for the gpu tier; 0 (the default) leaves it out")
    devices: Annotated[list[int], Field(min_length=1, max_length=16)] = setting(
        default_factory=lambda: [0], description="CUDA device indices the gpu tier allocates on, comma-separated",
    )
    memory: Literal["cuda", "host"] = setting(
        "cuda", "what stands behind the gpu tier: cuda (device memory) or host (a shared-memory stand-in, for "
        "tests and dry runs on machines without a GPU)",
    )
    host_addressable: bool = setting(
        True, "host memory only: false refuses host views of the region as device memory does, so the store "
        "takes the copy paths it takes on a GPU (tests of those paths on machines without one)",
    )

    _split = field_validator("devices", mode="before")(split_commas)

    @field_validator("devices")
    @classmethod
    def _distinct(cls, value: list[int]) -> list[int]:
        if len(set(value)) != len(value) or min(value) < 0:
            raise ValueError(f"gpu_devices {value}: device indices are 0 or more, each listed once")
        return value

    @field_validator("bytes")
    @classmethod
    def _zero_or_a_region(cls, value: ByteSize) -> ByteSize:
        if 0 < value < 1 << 20:
            raise ValueError(f"gpu_bytes is {value.human_readable()}; give the gpu tier at least 1MiB, or 0")
        return value

    @property
    def enabled(self) -> bool:
        return self.bytes > 0

    def tier_options(self, state_dir: Path) -> dict[str, Any]:
        """The host stand-in also takes ``host_addressable``; its file goes where the RAM arena's does
        (the daemon adds ``shm_dir``, see :func:`kvstore.server.stores.open_stores`)."""
        options = {"capacity_bytes": int(self.bytes), "devices": tuple(self.devices), "memory": self.memory}
        if self.memory == "host":
            options["addressable"] = self.host_addressable
        return options

    def arena_options(self, options: dict[str, Any], arena: dict[str, Any], state_dir: Path) -> dict[str, Any] | None:
        """The gpu tier belongs to the default arena only: device memory is not split by namespace."""
        return options if arena["default"] else None


class TierSettings(Section):
    title = "the tiers, fastest first"

    chain: Annotated[list[str], Field(min_length=1, max_length=8)] = setting(
        default_factory=lambda: ["ram", "disk"],
        description="the tiers in order, fastest first, comma-separated; ram comes first (a tier whose size is 0 is left out)",
        flag="tiers",
    )
    ram: RamSettings = setting(default_factory=RamSettings)
    disk: DiskSettings = setting(default_factory=DiskSettings)
    peer: PeerTierSettings = setting(default_factory=PeerTierSettings)
    object: ObjectTierSettings = setting(default_factory=ObjectTierSettings)
    gpu: GpuSettings = setting(default_factory=GpuSettings)

    _split = field_validator("chain", mode="before")(split_commas)

    @model_validator(mode="after")
    def _known_chain(self) -> TierSettings:
        known = [name for name in type(self).model_fields if name not in ("chain", "gpu")]
        if "gpu" in self.chain:
            raise ValueError("gpu is not listed in the chain: set --gpu-bytes and it joins the head, above ram")
        for name in self.chain:
            if name not in known:
                raise ValueError(f"tier {name!r} in the chain is not a tier; the known tiers are {', '.join(known)}")
        if self.chain[0] != "ram" or len(set(self.chain)) != len(self.chain):
            raise ValueError(f"chain {self.chain}: ram comes first, and each tier appears once")
        if "object" in self.chain and not self.object.bucket:
            raise ValueError(
                "the object tier is in the chain but has no bucket: set [tiers.object] bucket "
                "(flag --object-bucket, env STRATA_OBJECT_BUCKET)"
            )
        return self

    def section(self, name: str) -> Section:
        return getattr(self, name)

    def effective_chain(self) -> list[str]:
        """The chain the daemon builds: ``gpu`` first when it has a size, then ``chain``."""
        return (["gpu"] if self.gpu.enabled else []) + list(self.chain)
