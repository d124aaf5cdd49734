"""Settings of the tiered store: ``[store]`` — leases, batch limits, demotion, namespaces.

The store's own limits type (``kvstore.store.tiered.StoreLimits``) takes its
values from :meth:`StoreSettings.limits`; the defaults live here only.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ByteSize, Field, field_validator, model_validator

from kvstore.config.section import Section, setting
from kvstore.config.values import split_commas

MAX_DEMOTION_THREADS = 64
# Fits one LMCache chunk of the large models (256 tokens of Llama-3-70B at TP=1
# are 80 MiB; of Llama-3.1-405B 126 MiB); the daemon lowers it to a quarter of a
# small RAM tier unless it is set.
DEFAULT_MAX_BLOCK_BYTES = 256 << 20


class StoreSettings(Section):
    title = "the tiered store: block and batch limits, leases, demotion from RAM to disk, namespaces"

    max_block_bytes: ByteSize | None = setting(
        None,
        "largest block accepted (default 256MiB, or a quarter of the RAM tier if that is smaller); "
        "an LMCache chunk is chunk_size x layers x 2 x KV heads x head size x dtype bytes",
    )
    max_batch_blocks: int = setting(4096, "blocks in one request", ge=1, le=1 << 20)
    lease_seconds: float = setting(30.0, "default lease on arena slots and in-place reads", gt=0)
    pin_lease_seconds: float = setting(300.0, "default lease of Pin", gt=0)
    lapsed_slot_hold_seconds: float = setting(
        30.0, "an arena slot whose lease ran out unwritten keeps its extent from other blocks this long, so a "
        "same-host writer that stalled mid-copy cannot land its bytes in another (another tenant's) block",
        ge=0, le=3600,
    )
    max_lease_seconds: float = setting(3600.0, "longest lease a client may ask for", gt=0, le=7 * 86400)
    max_leases: int = setting(65536, "open leases (pins, reads, slots) at once", ge=1, le=1 << 24)
    max_leases_per_identity: int = setting(
        0, "open leases one identity (a token, a certificate, an unauthenticated connection or same-host process) "
        "may hold, so that no caller's pins take every lease; 0: a quarter of --max-leases", ge=0, le=1 << 24,
    )
    demotion_queue_blocks: int = setting(256, "write-behind queue from RAM to disk, in blocks", ge=1, le=1 << 20)
    demotion_threads: int = setting(
        1, "threads writing demoted blocks to disk; 0 demotes inline in the writer (deterministic tests)",
        ge=0, le=MAX_DEMOTION_THREADS,
    )
    high_watermark: float = setting(0.95, "start demoting RAM blocks to disk when RAM is this full (0-1]", gt=0, le=1)
    low_watermark: float = setting(0.85, "... and demote until RAM is this full", gt=0, le=1)
    disk_retry_seconds: float = setting(
        5.0, "after a lower tier fails a write, evict above it by dropping for this long, then try it again",
        gt=0, le=3600,
    )
    put_wait_seconds: float = setting(
        5.0, "longest a writer waits for RAM to free up when its request has no deadline", gt=0, le=3600
    )
    verify_commits: bool = setting(True, "verify checksums of blocks written through shared memory")
    namespaces: Annotated[list[str], Field(max_length=4096)] = setting(
        default_factory=list, description="namespaces to create at start (comma-separated)"
    )
    auto_create_namespaces: bool = setting(True, "create a namespace on its first write")

    _split = field_validator("namespaces", mode="before")(split_commas)

    @model_validator(mode="after")
    def _consistent(self) -> StoreSettings:
        if self.max_lease_seconds < max(self.lease_seconds, self.pin_lease_seconds):
            raise ValueError("max_lease_seconds must be at least lease_seconds and pin_lease_seconds")
        if self.low_watermark >= self.high_watermark:
            raise ValueError(
                f"low_watermark ({self.low_watermark}) must be below high_watermark ({self.high_watermark})"
            )
        return self

    def limits(self) -> dict[str, Any]:
        """Keyword arguments of ``kvstore.store.tiered.StoreLimits``, in the store's own field names."""
        return {
            "max_block_bytes": int(self.max_block_bytes) if self.max_block_bytes is not None else DEFAULT_MAX_BLOCK_BYTES,
            "lease_s": self.lease_seconds,
            "pin_lease_s": self.pin_lease_seconds,
            "lapsed_slot_hold_s": self.lapsed_slot_hold_seconds,
            "max_lease_s": self.max_lease_seconds,
            "max_leases": self.max_leases,
            "max_leases_per_owner": min(self.max_leases_per_identity or max(1, self.max_leases // 4), self.max_leases),
            "max_batch_blocks": self.max_batch_blocks,
            "demotion_queue_blocks": self.demotion_queue_blocks,
            "demotion_threads": self.demotion_threads,
            "high_watermark": self.high_watermark,
            "low_watermark": self.low_watermark,
            "tier_retry_s": self.disk_retry_seconds,
            "verify_commits": self.verify_commits,
            "put_wait_s": self.put_wait_seconds,
        }
