"""Daemon settings: built once at start, validated, passed down.

One section per component, each a model that holds its settings' defaults
(the only place they are written down)::

    Settings
    ├── node      NodeSettings      [node]         id
    ├── server    ServerSettings    [server]       listen, advertise_address, unix_socket, metrics_listen, limits
    ├── tiers     TierSettings
    │   ├── ram   RamSettings       [tiers.ram]    bytes, shm_dir
    │   ├── disk  DiskSettings      [tiers.disk]   dir, bytes, fsync
    │   ├── peer  PeerTierSettings  [tiers.peer]   fetch limits and deadlines, transports, token_file
    │   └── object ObjectTierSettings [tiers.object] bucket, prefix, endpoint, region, uploads, queue
    ├── store     StoreSettings     [store]        block and batch limits, leases, demotion, namespaces
    ├── index     IndexSettings     [index]        url, ttl_seconds, score_weights, kv_events
    ├── auth      AuthSettings      [auth]         policy file, TLS, protected mode, socket mode
    ├── peers     PeerSettings      [peers]        the peer data plane's listener and limits
    ├── replication ReplicationSettings [replication] namespaces to keep k copies of, round limits
    └── logging   LoggingSettings   [logging]      level, format

``strata route`` has its own settings, outside this tree:
:class:`kvstore.config.router.RouterSettings` (flags, ``STRATA_ROUTER_*``, a
``[router]`` table).

Precedence, highest first: command-line flags, ``STRATA_*`` environment
variables, a TOML config file (``--config`` / ``STRATA_CONFIG``), defaults.
Every setting keeps the flat flag and variable it always had
(``--ram-bytes``, ``STRATA_RAM_BYTES``) and has a nested variable of its
path (``STRATA_TIERS__RAM__BYTES``). Sizes accept units: ``512MiB``,
``4GiB``, ``64KB``. An unknown key or section, in a file or a nested
variable, is an error that lists the known ones.

A new component (the GPU, peer and object tiers, auth, weights) adds a
:class:`~kvstore.config.section.Section` subclass in its own module and one
field on its parent (:class:`Settings` or :class:`TierSettings`); flags,
variables, ``--help`` groups and error messages follow from the field.
Config builds no domain types: sections hand plain values to the code that
owns them (:meth:`StoreSettings.limits`, :meth:`IndexSettings.event_sources`).
"""

from kvstore.config.auth import AuthSettings
from kvstore.config.index import IndexSettings, parse_event_source, parse_tier_weights
from kvstore.config.load import SETTINGS, SettingsError, load_settings
from kvstore.config.log import LoggingSettings
from kvstore.config.section import Section, SettingName
from kvstore.config.server import NodeSettings, ServerSettings
from kvstore.config.settings import Settings
from kvstore.config.store import StoreSettings
from kvstore.config.tiers import DiskSettings, RamSettings, TierSettings

__all__ = [
    "SETTINGS",
    "AuthSettings",
    "DiskSettings",
    "IndexSettings",
    "LoggingSettings",
    "NodeSettings",
    "RamSettings",
    "Section",
    "ServerSettings",
    "SettingName",
    "Settings",
    "SettingsError",
    "StoreSettings",
    "TierSettings",
    "load_settings",
    "parse_event_source",
    "parse_tier_weights",
]
