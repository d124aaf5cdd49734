"""The tier's options: the keys of its entry in ``secondary_tiers``, read once and checked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore.block import validate_namespace
from kvstore.integrations.options import MAX_PREFIX_CHARS, DaemonOptions, boolean

TIER_TYPE = "strata"  # "type" of the secondary_tiers entry (the module exposes a class of this name)
MODULE_PATH = "kvstore.integrations.vllm"  # its "module_path"
LOCALITIES = ("LOCAL", "REMOTE")


@dataclass(frozen=True)
class StrataTierSettings(DaemonOptions):
    """Options of one Strata entry; every default suits a sidecar on the engine's host.

    ``namespace`` is a prefix (a tenant, a team): the tier appends the model,
    the digest of its KV layout and the KV cache group, so engines of another
    layout never share bytes and engines of the same layout always do.
    ``shared_memory``: None (``auto``) maps the daemon's arena when it is on
    this host; False always streams over gRPC; True requires the arena.
    ``timeout_s`` bounds every call and ``job_timeout_s`` the wait of a job
    in the queue: a load is answered, success or failure, within about
    ``job_timeout_s + (retries + 1) * timeout_s`` of its submission.
    ``lookup_hold_s``: chunks a lookup finds are pinned in the daemon this
    long (or until the request finishes), so a hit is still there when its
    load runs. ``kv_hints``: act on the requests' KV hints (pin, retain,
    share, prefetch, demote; :mod:`kvstore.integrations.vllm.hints`), holding
    chunks at most ``hint_max_hold_s`` (a longer ``ttl_s`` is clipped).
    """

    namespace: str = "vllm"
    io_threads: int = 4
    max_queued_jobs: int = 256
    job_timeout_s: float = 10.0
    chunks_per_call: int = 32
    lookup_hold_s: float = 10.0
    enable_kv_events: bool = False
    locality: str | None = None
    kv_hints: bool = True
    hint_max_hold_s: float = 3600.0

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> StrataTierSettings:
        """From the entry's keys (``type`` and ``module_path`` already taken by vLLM's factory)."""
        cls.refuse_unknown(options, "the Strata secondary tier")
        defaults = cls()
        try:
            settings = cls(
                namespace=str(options.get("namespace", defaults.namespace)),
                io_threads=int(options.get("io_threads", defaults.io_threads)),
                max_queued_jobs=int(options.get("max_queued_jobs", defaults.max_queued_jobs)),
                job_timeout_s=float(options.get("job_timeout_s", defaults.job_timeout_s)),
                chunks_per_call=int(options.get("chunks_per_call", defaults.chunks_per_call)),
                lookup_hold_s=float(options.get("lookup_hold_s", defaults.lookup_hold_s)),
                enable_kv_events=boolean(options.get("enable_kv_events", False), "enable_kv_events"),
                locality=None if options.get("locality") is None else str(options["locality"]).upper(),
                kv_hints=boolean(options.get("kv_hints", True), "kv_hints"),
                hint_max_hold_s=float(options.get("hint_max_hold_s", defaults.hint_max_hold_s)),
                **cls.daemon_options(options),
            )
        except (TypeError, ValueError) as err:
            raise ValueError(f"bad option in the Strata secondary tier: {err}") from None
        settings._check()
        return settings

    def _check(self) -> None:
        limits = self.daemon_limits() + [
            (1 <= self.io_threads <= 64, "io_threads must be 1..64"),
            (1 <= self.max_queued_jobs <= 65536, "max_queued_jobs must be 1..65536"),
            (self.job_timeout_s > 0, "job_timeout_s must be > 0"),
            (1 <= self.chunks_per_call <= 1024, "chunks_per_call must be 1..1024"),
            (0 < self.lookup_hold_s <= 3600, "lookup_hold_s must be > 0 and at most 3600 (the daemon's longest lease)"),
            (self.locality in (None, *LOCALITIES), f"locality must be one of {', '.join(LOCALITIES)}"),
            (0 < self.hint_max_hold_s <= 7 * 86400, "hint_max_hold_s must be > 0 and at most a week "
             "(and at most the daemon's max_lease_seconds, 3600 by default, or its pins are refused)"),
        ]
        for ok, message in limits:
            if not ok:
                raise ValueError(f"Strata secondary tier: {message}")
        if len(self.namespace) > MAX_PREFIX_CHARS:
            raise ValueError(f"Strata secondary tier: namespace is a prefix of at most {MAX_PREFIX_CHARS} characters "
                             "(the model and layout are appended)")
        validate_namespace(self.namespace)


