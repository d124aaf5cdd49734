"""The store's input checks: every limit of a request, at the boundary.

Nothing past these fails because a field is too big: a layout the disk
format cannot hold, a batch larger than the daemon allows, a lease longer
than the longest. Each refusal names the limit and the setting to change.
"""

from __future__ import annotations

from kvstore.block import MAX_LAYOUT_CHARS, BlockKey, BlockMeta, validate_key
from kvstore.errors import BlockTooLarge, InvalidArgument
from kvstore.store.limits import StoreLimits


class BlockChecks:
    def __init__(self, limits: StoreLimits) -> None:
        self._limits = limits

    def check_block(self, key: BlockKey, meta: BlockMeta) -> None:
        """Every limit of a block, at the boundary: nothing past here fails for a field's size or type."""
        if not isinstance(meta.layout, str):
            raise InvalidArgument(f"block {key} has a layout of type {type(meta.layout).__name__}: it must be a string")
        if len(meta.layout) > MAX_LAYOUT_CHARS:
            raise InvalidArgument(
                f"block {key} has a layout of {len(meta.layout)} characters; the limit is {MAX_LAYOUT_CHARS}: "
                "describe the value's shape and dtype more briefly"
            )
        if meta.parent is not None:
            try:
                validate_key(meta.parent)
            except InvalidArgument as err:
                raise type(err)(f"block {key} names a bad parent key: {err}") from None
        if meta.size <= 0:
            raise InvalidArgument(f"block {key} is empty: a block needs at least one byte")
        if meta.size > self._limits.max_block_bytes:
            raise BlockTooLarge(
                f"block {key} is {meta.size} bytes; this daemon's limit is {self._limits.max_block_bytes} "
                "(--max-block-bytes): split the value into smaller blocks"
            )

    def check_batch(self, items) -> None:
        if len(items) > self._limits.max_batch_blocks:
            raise InvalidArgument(
                f"{len(items)} blocks in one request; the limit is {self._limits.max_batch_blocks}: split the batch"
            )

    def lease_seconds(self, requested: float | None, default: float) -> float:
        if requested is None or requested <= 0:
            return default
        if requested > self._limits.max_lease_s:
            raise InvalidArgument(f"lease of {requested:.0f}s exceeds the limit of {self._limits.max_lease_s:.0f}s")
        return requested
