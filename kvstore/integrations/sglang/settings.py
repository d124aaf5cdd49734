"""The backend's options: the ``"strata"`` object of SGLang's ``--hicache-storage-backend-extra-config``, read once and checked.

SGLang hands every backend the whole extra config, its own keys included
(``backend_name``, ``module_path``, ``class_name``, ``interface_v1``,
``allocator``...), and adds keys between releases. So Strata's options live
in one nested object, ``"strata": {...}``, where an unknown key is refused
with the known ones listed, and the keys beside it are SGLang's business.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore.block import validate_namespace
from kvstore.integrations.options import MAX_PREFIX_CHARS, DaemonOptions

BACKEND_NAME = "strata"  # "backend_name" of the dynamic backend (SGLang logs it)
MODULE_PATH = "kvstore.integrations.sglang"  # its "module_path"
CLASS_NAME = "StrataHiCacheStorage"  # its "class_name"
OPTIONS_KEY = "strata"  # the extra config's key holding the options below


@dataclass(frozen=True)
class StrataStorageSettings(DaemonOptions):
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

    namespace: str = "sglang"

    @classmethod
    def from_extra_config(cls, extra_config: dict[str, Any] | None) -> StrataStorageSettings:
        """From SGLang's extra config: the ``"strata"`` object, absent meaning every default."""
        options = (extra_config or {}).get(OPTIONS_KEY) or {}
        if not isinstance(options, dict):
            raise ValueError(f'Strata HiCache backend: "{OPTIONS_KEY}" in the extra config must be an object '
                             f'of options, e.g. {{"target": "127.0.0.1:50051"}}, not {type(options).__name__}')
        cls.refuse_unknown(options, f'the Strata HiCache backend\'s "{OPTIONS_KEY}" object')
        try:
            settings = cls(namespace=str(options.get("namespace", cls.namespace)), **cls.daemon_options(options))
        except (TypeError, ValueError) as err:
            raise ValueError(f"bad option in the Strata HiCache backend: {err}") from None
        settings._check()
        return settings

    def _check(self) -> None:
        for ok, message in self.daemon_limits():
            if not ok:
                raise ValueError(f"Strata HiCache backend: {message}")
        if len(self.namespace) > MAX_PREFIX_CHARS:
            raise ValueError(f"Strata HiCache backend: namespace is a prefix of at most {MAX_PREFIX_CHARS} "
                             "characters (the model and layout are appended)")
        validate_namespace(self.namespace)

