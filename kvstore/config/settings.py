"""The daemon's settings: one section per component, checks that span sections."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ByteSize, Field, field_validator, model_validator

from kvstore.config.arenas import MAX_ARENAS, ArenaSettings, parse_arenas, plan_arenas
from kvstore.config.auth import AuthSettings
from kvstore.config.index import IndexSettings
from kvstore.config.log import LoggingSettings
from kvstore.config.handoff import HandoffSettings
from kvstore.config.peers import PeerSettings
from kvstore.config.replication import ReplicationSettings
from kvstore.config.section import Section, setting
from kvstore.config.server import NodeSettings, ServerSettings
from kvstore.config.store import DEFAULT_MAX_BLOCK_BYTES, StoreSettings
from kvstore.config.tiers import TierSettings


class Settings(Section):
    """Everything ``strata serve`` is configured with; built once at start, passed down.

    Each component (``[tiers.gpu]``, ``[tiers.peer]``, ``[tiers.object]``,
    ``[auth]``, ``[weights]``, ...) is a :class:`Section` subclass in its own
    module and one field here or in :class:`TierSettings`.
    """

    title = "Strata daemon"

    node: NodeSettings = setting(default_factory=NodeSettings)
    server: ServerSettings = setting(default_factory=ServerSettings)
    tiers: TierSettings = setting(default_factory=TierSettings)
    store: StoreSettings = setting(default_factory=StoreSettings)
    index: IndexSettings = setting(default_factory=IndexSettings)
    auth: AuthSettings = setting(default_factory=AuthSettings)
    logging: LoggingSettings = setting(default_factory=LoggingSettings)
    peers: PeerSettings = setting(default_factory=PeerSettings)
    handoff: HandoffSettings = setting(default_factory=HandoffSettings)
    replication: ReplicationSettings = setting(default_factory=ReplicationSettings)
    arenas: Annotated[list[ArenaSettings], Field(max_length=MAX_ARENAS)] = setting(
        default_factory=list,
        description="an isolated arena NAME:NS1,NS2:RAM[:DISK] (repeat per arena; ';' between arenas in the "
        "variable): its namespaces (exact, or a prefix such as team-a-*) get their own shared-memory file, "
        "RAM and disk share, carved out of ram_bytes and disk_bytes; every other namespace stays in the "
        "default arena",
        flag="arena", repeatable=True,
    )

    _parse_arenas = field_validator("arenas", mode="before")(parse_arenas)

    def arena_plan(self) -> list[dict[str, Any]]:
        """Every arena's name, namespace rules, RAM and disk bytes, the default arena first
        (see :func:`kvstore.config.arenas.plan_arenas`)."""
        disk = int(self.tiers.disk.bytes) if "disk" in self.tiers.chain else 0
        return plan_arenas(self.arenas, int(self.tiers.ram.bytes), disk)

    def arena_tier_options(self, arena: dict[str, Any], tier: str, state_dir) -> dict[str, Any] | None:
        """Keyword arguments of ``kvstore.tiers.open_tier`` for ``arena``'s own ``tier``; None: not in its chain."""
        section = self.tiers.section(tier)
        if not section.enabled:
            return None
        return section.arena_options(section.tier_options(state_dir), arena, state_dir)

    @model_validator(mode="after")
    def _block_fits_ram(self) -> Settings:
        plan = self.arena_plan()  # raises when the arenas overlap or do not fit
        smallest = min(plan, key=lambda a: a["ram_bytes"])
        block, ram = self.store.max_block_bytes, ByteSize(smallest["ram_bytes"])
        if block is None:  # not set: the default, lowered to a quarter of a small RAM tier
            block = self.store.max_block_bytes = ByteSize(min(DEFAULT_MAX_BLOCK_BYTES, int(ram) // 4))
        if block > self.server.put_budget_bytes:
            raise ValueError(
                f"put_budget_bytes ({self.server.put_budget_bytes.human_readable()}) is smaller than max_block_bytes "
                f"({block.human_readable()}): a block that large could never be streamed in; raise "
                "--put-budget-bytes or lower --max-block-bytes"
            )
        peers = self.peers
        if peers.listen and not block <= peers.connection_in_flight_bytes <= peers.in_flight_bytes:
            raise ValueError(
                f"the peer limits must grow from max_block_bytes ({block.human_readable()}) to "
                f"peer_connection_in_flight_bytes ({peers.connection_in_flight_bytes.human_readable()}) to "
                f"peer_in_flight_bytes ({peers.in_flight_bytes.human_readable()}): a block larger than either "
                "could never be sent; raise --peer-connection-in-flight-bytes and --peer-in-flight-bytes"
            )
        if block > ram and len(plan) > 1:
            raise ValueError(
                f"max_block_bytes ({block.human_readable()}) is larger than the RAM of arena {smallest['name']!r} "
                f"({ram.human_readable()}): give that arena more RAM or lower max_block_bytes"
            )
        if block > ram:
            raise ValueError(
                f"max_block_bytes ({block.human_readable()}) is larger than ram_bytes ({ram.human_readable()}): "
                "raise ram_bytes or lower max_block_bytes ([tiers.ram] bytes, [store] max_block_bytes in a config file)"
            )
        return self
