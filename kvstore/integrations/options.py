"""What every integration's settings parse alike: the client's security options, the namespace prefix's
length, and the booleans written in an engine's config (JSON or YAML strings as often as bools)."""

from __future__ import annotations

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


def client_options(settings) -> dict:
    """A settings object's options for :class:`kvstore.client.sync.Client` (timeout, retries, shared memory,
    security)."""
    return dict(timeout=settings.timeout_s, retries=settings.retries, use_shm=settings.shared_memory,
                **{k: getattr(settings, k) for k in SECURITY_OPTIONS})
