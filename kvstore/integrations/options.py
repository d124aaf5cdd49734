"""What every integration's settings parse alike: the client's security options, the namespace prefix's
length, and the booleans written in an engine's config (JSON or YAML strings as often as bools)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

SECURITY_OPTIONS = ("token_file", "tls_ca", "tls_cert", "tls_key", "tls_server_name")
MAX_PREFIX_CHARS = 48  # of a namespace prefix: the model and layout digest need the rest of Strata's 128
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def boolean(value: Any, name: str) -> bool:
    """``value`` as a bool (a bool, or true/false, 1/0, yes/no, on/off in any case); else ValueError naming ``name``."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{name} is {value!r}; use true or false")


def tristate(value: Any, name: str = "shared_memory") -> bool | None:
    """A boolean that may be left to Strata: auto (or empty, none, None) is None."""
    if value is None:
        return None
    if not isinstance(value, bool) and str(value).strip().lower() in ("auto", "", "none"):
        return None
    return boolean(value, f"{name} (or auto)")


def security_options(options: dict[str, Any]) -> dict[str, str]:
    """The security options given (non-empty), as strings: what the settings dataclasses take."""
    return {k: str(options[k]) for k in SECURITY_OPTIONS if options.get(k)}


def whole(value: Any, name: str) -> int:
    """``value`` as an int; a bool or a fractional number is refused (``int(2.5)`` would be 2)."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"{name} is {value!r}; use a whole number")
    return int(value)


@dataclass(frozen=True)
class DaemonOptions:
    """The options every integration takes about its daemon; each integration's settings add their own.

    ``shared_memory``: None (``auto``) maps the daemon's arena when it is on
    this host; False always streams over gRPC; True requires the arena.
    ``timeout_s`` bounds every daemon call (``retries`` more on UNAVAILABLE);
    after a call finds the daemon down or stuck, the engine sees misses
    without a call for ``down_backoff_s``.
    """

    target: str = "127.0.0.1:50051"
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
    def refuse_unknown(cls, options: dict[str, Any], where: str) -> None:
        """ValueError naming every option ``where`` does not take, and the ones it does."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown option(s) {', '.join(unknown)} in {where}; it takes: {', '.join(sorted(known))}")

    @classmethod
    def daemon_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        """The values of this class's daemon options in ``options``, parsed; the class's defaults for the rest."""
        defaults = cls()
        return dict(
            target=str(options.get("target", defaults.target)),
            timeout_s=float(options.get("timeout_s", defaults.timeout_s)),
            retries=whole(options.get("retries", defaults.retries), "retries"),
            shared_memory=tristate(options.get("shared_memory", "auto")),
            down_backoff_s=float(options.get("down_backoff_s", defaults.down_backoff_s)),
            **security_options(options),
        )

    def daemon_limits(self) -> list[tuple[bool, str]]:
        """(holds, what to fix) for each daemon option."""
        return [
            (bool(self.target), "target is empty: give the daemon's address, e.g. 127.0.0.1:50051"),
            (self.timeout_s > 0, "timeout_s must be > 0"),
            (0 <= self.retries <= 5, "retries must be 0..5"),
            (self.down_backoff_s >= 0, "down_backoff_s must be >= 0"),
        ]

    def client_options(self) -> dict:
        """The options of :class:`kvstore.client.sync.Client` (timeout, retries, shared memory, security)."""
        return dict(timeout=self.timeout_s, retries=self.retries, use_shm=self.shared_memory,
                    **{k: getattr(self, k) for k in SECURITY_OPTIONS})
