"""The daemon's settings: one section per component, checks that span sections."""

from __future__ import annotations

from pydantic import ByteSize, model_validator

from kvstore.config.auth import AuthSettings
from kvstore.config.index import IndexSettings
from kvstore.config.log import LoggingSettings
from kvstore.config.section import Section, setting
from kvstore.config.server import NodeSettings, ServerSettings
from kvstore.config.store import DEFAULT_MAX_BLOCK_BYTES, StoreSettings
from kvstore.config.tiers import TierSettings


class Settings(Section):
    """Everything ``strata serve`` is configured with; built once at start, passed down.

    A component added later (``[tiers.gpu]``, ``[tiers.peer]``, ``[tiers.object]``,
    ``[auth]``, ``[weights]``) is a :class:`Section` subclass in its own module
    and one field here or in :class:`TierSettings`.
    """

    title = "Strata daemon"

    node: NodeSettings = setting(default_factory=NodeSettings)
    server: ServerSettings = setting(default_factory=ServerSettings)
    tiers: TierSettings = setting(default_factory=TierSettings)
    store: StoreSettings = setting(default_factory=StoreSettings)
    index: IndexSettings = setting(default_factory=IndexSettings)
    auth: AuthSettings = setting(default_factory=AuthSettings)
    logging: LoggingSettings = setting(default_factory=LoggingSettings)

    @model_validator(mode="after")
    def _block_fits_ram(self) -> Settings:
        block, ram = self.store.max_block_bytes, self.tiers.ram.bytes
        if block is None:  # not set: the default, lowered to a quarter of a small RAM tier
            block = self.store.max_block_bytes = ByteSize(min(DEFAULT_MAX_BLOCK_BYTES, int(ram) // 4))
        if block > self.server.put_budget_bytes:
            raise ValueError(
                f"put_budget_bytes ({self.server.put_budget_bytes.human_readable()}) is smaller than max_block_bytes "
                f"({block.human_readable()}): a block that large could never be streamed in; raise "
                "--put-budget-bytes or lower --max-block-bytes"
            )
        if block > ram:
            raise ValueError(
                f"max_block_bytes ({block.human_readable()}) is larger than ram_bytes ({ram.human_readable()}): "
                "raise ram_bytes or lower max_block_bytes ([tiers.ram] bytes, [store] max_block_bytes in a config file)"
            )
        return self
