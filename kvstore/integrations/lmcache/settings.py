"""The plugin's options: one set per ``strata`` / ``strata.<name>`` entry of LMCache's config."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.block import validate_namespace
from kvstore.integrations.options import DaemonOptions


DEFAULT_PLUGIN_NAME = "strata"
PLUGIN_MODULE = "kvstore.integrations.lmcache"  # remote_storage_plugin.<name>.module_path
CLASS_NAMES = ("StrataConnector", "StrataAdapter")  # remote_storage_plugin.<name>.class_name
PLUGIN_TYPE = "strata"  # entries "strata" and "strata.<instance>" are this plugin's (LMCache's naming)


@dataclass(frozen=True)
class PluginSettings(DaemonOptions):
    """The plugin's options, read once from LMCache's ``extra_config``.

    ``namespace`` empty means one namespace per model (the key's model name).
    ``shared_memory``: ``auto`` maps the daemon's arena when it is on this
    host; ``false`` always streams; ``true`` requires the arena.
    """

    namespace: str = ""

    @classmethod
    def from_extra_config(cls, extra: dict | None, plugin_name: str) -> PluginSettings:
        prefix = f"remote_storage_plugin.{plugin_name}."
        options = {k[len(prefix):]: v for k, v in (extra or {}).items() if k.startswith(prefix)}
        options.pop("module_path", None)
        options.pop("class_name", None)
        cls.refuse_unknown(options, f"the Strata plugin's options ({prefix}*)")
        try:
            settings = cls(namespace=str(options.get("namespace", cls.namespace)), **cls.daemon_options(options))
        except ValueError as err:
            raise ValueError(f"bad option under {prefix}*: {err}") from None
        for ok, message in settings.daemon_limits():
            if not ok:
                raise ValueError(f"bad option under {prefix}*: {message}")
        if settings.namespace:
            validate_namespace(settings.namespace)
        return settings





def strata_entries(config) -> list[str]:
    """The ``remote_storage_plugins`` entries that load this module."""
    extra = getattr(config, "extra_config", None) or {}
    return [
        name
        for name in getattr(config, "remote_storage_plugins", None) or []
        if extra.get(f"remote_storage_plugin.{name}.module_path") == PLUGIN_MODULE
        or extra.get(f"remote_storage_plugin.{name}.class_name") in CLASS_NAMES
    ]


def plugin_name_of(config, cls: type) -> str:
    """The entry a connector built without a name serves: the config's only Strata entry.

    LMCache builds a plain ``RemoteConnector`` class with ``cls(loop,
    local_cpu_backend, config)`` and does not say which entry it serves. With one
    Strata entry that is the one; with several it cannot be known, and guessing
    would give every entry the first one's target and namespace.
    """
    entries = strata_entries(config)
    if len(entries) > 1:
        raise ValueError(ambiguous_entries(entries))
    return entries[0] if entries else DEFAULT_PLUGIN_NAME


def ambiguous_entries(entries: list[str]) -> str:
    return (
        f"remote_storage_plugins has {len(entries)} Strata entries ({', '.join(entries)}) but LMCache builds "
        f"class_name {CLASS_NAMES[0]} without saying which entry it is for: set "
        f"remote_storage_plugin.<name>.class_name: {CLASS_NAMES[1]} on every Strata entry, and name them "
        f"{PLUGIN_TYPE} or {PLUGIN_TYPE}.<instance> (e.g. {PLUGIN_TYPE}.local, {PLUGIN_TYPE}.remote)"
    )
