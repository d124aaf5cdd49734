"""The adapter's options: ``adapter_params`` of LMCache's ``--l2-adapter '{"type": "plugin", ...}'``, read once
and checked. This module imports no LMCache (the docs are generated from it where LMCache is absent).

LMCache's plugin factory finds the config class
(:class:`~kvstore.integrations.lmcache_mp.adapter.StrataL2AdapterConfig`) by
its name, the adapter's class name plus ``Config``, and builds it with
``from_dict`` from ``adapter_params``; LMCache's own keys stay on the outer object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore.block import validate_namespace
from kvstore.integrations.options import MAX_PREFIX_CHARS, DaemonOptions, whole

MODULE_PATH = "kvstore.integrations.lmcache_mp"  # "module_path" of the plugin entry
CLASS_NAME = "StrataL2Adapter"  # its "class_name"; the config class is found as CLASS_NAME + "Config"


@dataclass(frozen=True)
class L2Settings(DaemonOptions):
    """Options of the Strata L2 adapter; every default suits a daemon on the LMCache server's host.

    ``namespace`` is a prefix: each model (and each ``cache_salt``) gets a
    namespace of its own under it. ``num_workers`` threads run the tasks;
    at most ``max_pending_tasks`` may wait or run at once, and a task beyond
    that fails at once (a store as failed, a lookup or load as misses) rather
    than queue. A lookup holds its hits for ``lock_lease_s``: unlocked by
    LMCache, or expired by the daemon if LMCache never unlocks them.
    ``timeout_s`` bounds every daemon call (``retries`` more on UNAVAILABLE);
    after a call finds the daemon down or stuck, every task answers at once
    (failed, misses) without calling it for ``down_backoff_s``.
    """

    timeout_s: float = 5.0
    namespace: str = "lmcache"
    num_workers: int = 4
    max_pending_tasks: int = 256
    lock_lease_s: float = 60.0

    @classmethod
    def from_dict(cls, options: dict[str, Any] | None) -> L2Settings:
        options = options or {}
        if not isinstance(options, dict):
            raise ValueError("the Strata L2 adapter's adapter_params must be an object of options, "
                             f'e.g. {{"target": "127.0.0.1:50051"}}, not {type(options).__name__}')
        cls.refuse_unknown(options, "the Strata L2 adapter's adapter_params")
        defaults = cls()
        try:
            settings = cls(
                namespace=str(options.get("namespace", defaults.namespace)),
                num_workers=whole(options.get("num_workers", defaults.num_workers), "num_workers"),
                max_pending_tasks=whole(options.get("max_pending_tasks", defaults.max_pending_tasks),
                                        "max_pending_tasks"),
                lock_lease_s=float(options.get("lock_lease_s", defaults.lock_lease_s)),
                **cls.daemon_options(options),
            )
        except (TypeError, ValueError) as err:
            raise ValueError(f"bad option in the Strata L2 adapter's adapter_params: {err}") from None
        settings._check()
        return settings

    def _check(self) -> None:
        limits = self.daemon_limits() + [
            (1 <= self.num_workers <= 64, "num_workers must be 1..64"),
            (self.num_workers <= self.max_pending_tasks <= 65536, "max_pending_tasks must be num_workers..65536"),
            (1 <= self.lock_lease_s <= 3600, "lock_lease_s must be 1..3600"),
            (0 < len(self.namespace) <= MAX_PREFIX_CHARS,
             f"namespace is a prefix of 1..{MAX_PREFIX_CHARS} characters (the model is appended)"),
        ]
        for ok, message in limits:
            if not ok:
                raise ValueError(f"Strata L2 adapter: {message}")
        validate_namespace(self.namespace)
