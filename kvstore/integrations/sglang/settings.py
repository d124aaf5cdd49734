"""The backend's options: the ``"strata"`` object of SGLang's ``--hicache-storage-backend-extra-config``, read once and checked.

SGLang hands every backend the whole extra config, its own keys included
(``backend_name``, ``module_path``, ``class_name``, ``interface_v1``,
``allocator``...), and adds keys between releases. So Strata's options live
in one nested object, ``"strata": {...}``, where an unknown key is refused
with the known ones listed, and the keys beside it are SGLang's business.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvstore.block import validate_namespace
from kvstore.integrations.options import MAX_PREFIX_CHARS, client_options, security_options, tristate

BACKEND_NAME = "strata"  # "backend_name" of the dynamic backend (SGLang logs it)
MODULE_PATH = "kvstore.integrations.sglang"  # its "module_path"
CLASS_NAME = "StrataHiCacheStorage"  # its "class_name"
OPTIONS_KEY = "strata"  # the extra config's key holding the options below


@dataclass(frozen=True)
class StrataStorageSettings:
    """Options of the Strata HiCache backend; every default suits a daemon on the engine's host.

    ``namespace`` is a prefix (a tenant, a team): the backend appends the
    model and the digest of the host pool's page layout and parallel shard,
    so engines of another geometry never read these pages.
    ``shared_memory``: None (``auto``) maps the daemon's arena when it is on
    this host; False always streams over gRPC; True requires the arena.
    ``timeout_s`` bounds every daemon call (``retries`` more on UNAVAILABLE);
    after a call finds the daemon down or stuck, every call answers a miss
    without calling it for ``down_backoff_s``.
    """

    target: str = "127.0.0.1:50051"
    namespace: str = "sglang"
    timeout_s: float = 2.0
    retries: int = 1
    shared_memory: bool | None = None
    down_backoff_s: float = 5.0
    token_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None

    @classmethod
    def from_extra_config(cls, extra_config: dict[str, Any] | None) -> StrataStorageSettings:
        """From SGLang's extra config: the ``"strata"`` object, absent meaning every default."""
        options = (extra_config or {}).get(OPTIONS_KEY) or {}
        if not isinstance(options, dict):
            raise ValueError(f'Strata HiCache backend: "{OPTIONS_KEY}" in the extra config must be an object '
                             f'of options, e.g. {{"target": "127.0.0.1:50051"}}, not {type(options).__name__}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown option(s) {', '.join(unknown)} in the Strata HiCache backend's "
                             f'"{OPTIONS_KEY}" object; it takes: {", ".join(sorted(known))}')
        defaults = cls()
        try:
            settings = cls(
                target=str(options.get("target", defaults.target)),
                namespace=str(options.get("namespace", defaults.namespace)),
                timeout_s=float(options.get("timeout_s", defaults.timeout_s)),
                retries=int(options.get("retries", defaults.retries)),
                shared_memory=tristate(options.get("shared_memory", "auto")),
                down_backoff_s=float(options.get("down_backoff_s", defaults.down_backoff_s)),
                **security_options(options),
            )
        except (TypeError, ValueError) as err:
            raise ValueError(f"bad option in the Strata HiCache backend: {err}") from None
        settings._check()
        return settings

    def _check(self) -> None:
        limits = [
            (self.timeout_s > 0, "timeout_s must be > 0"),
            (0 <= self.retries <= 5, "retries must be 0..5"),
            (self.down_backoff_s >= 0, "down_backoff_s must be >= 0"),
            (bool(self.target), "target is empty: give the daemon's address, e.g. 127.0.0.1:50051"),
        ]
        for ok, message in limits:
            if not ok:
                raise ValueError(f"Strata HiCache backend: {message}")
        if len(self.namespace) > MAX_PREFIX_CHARS:
            raise ValueError(f"Strata HiCache backend: namespace is a prefix of at most {MAX_PREFIX_CHARS} "
                             "characters (the model and layout are appended)")
        validate_namespace(self.namespace)

    def client_options(self) -> dict:
        return client_options(self)

