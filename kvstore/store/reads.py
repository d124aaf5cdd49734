"""Reads down the chain: from the highest tier holding a block, or through to a remote tier.

Every read is verified against the block's checksum. A copy that fails is
dropped from its tier and the next one down is tried; a remote copy that
cannot be reached is passed over, never a local failure. A block no local
tier holds is read through from the remote tiers and promoted into the
head when the chain's edges allow. When every copy the store lists failed
(corrupt, or a remote tier that is down or no longer has it), the remote
tiers it did not list are asked too (:meth:`ChainReader.read_through` with
``skip``): the fleet may hold the block where this node never saw it, say
in the bucket while the peer it was read from is down.
"""

from __future__ import annotations

import logging

from kvstore.block import BlockKey, BlockMeta, TierName, checksum
from kvstore.errors import CorruptBlock, TierUnavailable
from kvstore.store.entries import Entry
from kvstore.store.placement import HeadPlacement
from kvstore.store.state import StorePart, StoreState

log = logging.getLogger(__name__)

READ_THROUGH_BATCH = 64  # blocks of one read that are read through from the remote tiers together


class ChainReader(StorePart):
    def __init__(self, state: StoreState, placement: HeadPlacement) -> None:
        super().__init__(state)
        self._place = placement

    def read_through(self, key: BlockKey, deadline: float | None,
                     skip: frozenset[TierName] = frozenset()) -> tuple[bytes, BlockMeta, TierName] | None:
        """A block no local tier holds, read from the first remote tier that has it (but those in
        ``skip``, already asked), verified.

        The block joins the catalogue as held by that remote tier, and is
        promoted into the head when the edges allow. A remote tier that is
        down, slow or answers with a corrupt block is a miss here: local
        serving never waits on it beyond its call deadline.
        """
        return self.read_through_many([key], deadline, skip)[0]

    def read_through_many(self, keys: list[BlockKey], deadline: float | None,
                          skip: frozenset[TierName] = frozenset()) -> list[tuple[bytes, BlockMeta, TierName] | None]:
        """:meth:`read_through` for many blocks: one call per remote tier for the keys still missing
        (a peer tier then asks each holder for all the blocks it holds of them at once)."""
        out: list[tuple[bytes, BlockMeta, TierName] | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for level in self._chain.remote():
            if not todo:
                break
            if level.name in skip:
                continue
            label = level.name.label
            try:
                found = level.tier.fetch_many([keys[i] for i in todo])
            except TierUnavailable as err:
                self._s.metrics.tier_errors.labels(label).inc()
                log.warning("remote tier %s could not be read for %d blocks (%s...): %s", label, len(todo),
                            keys[todo[0]], err)
                continue
            rest = []
            unavailable = 0
            for i, got in zip(todo, found):
                if isinstance(got, CorruptBlock):
                    self._s.metrics.corrupt.labels(label).inc()
                    log.error("remote tier %s sent a corrupt copy of %s: %s", label, keys[i], got)
                elif isinstance(got, Exception):
                    unavailable += 1
                    if unavailable == 1:
                        self._s.metrics.tier_errors.labels(label).inc()
                        log.warning("remote tier %s could not be read for %s: %s", label, keys[i], got)
                elif got is not None:
                    out[i] = self._adopt(level, keys[i], got[0], got[1], deadline)
                if out[i] is None:
                    rest.append(i)
            todo = rest
        return out

    def read_through_absent(self, keys: list[BlockKey], deadline: float | None
                            ) -> dict[BlockKey, tuple[bytes, BlockMeta, TierName] | None]:
        """The blocks of ``keys`` no local tier lists, read through in one batch when there are several
        (a prefix's blocks are read together, and a peer serves them in one request); {} otherwise."""
        with self._cond:
            absent = [k for k in dict.fromkeys(keys) if self._catalog.live(k) is None]
        if len(absent) < 2 or not self._chain.remote():
            return {}
        return dict(zip(absent, self.read_through_many(absent, deadline)))

    def _adopt(self, level, key: BlockKey, data, meta: BlockMeta,
               deadline: float | None) -> tuple[bytes, BlockMeta, TierName] | None:
        """A verified copy read from a remote level: into the catalogue as held there, promoted when the
        edges allow; None when its size is outside this daemon's limits."""
        if meta.size <= 0 or meta.size > self._s.limits.max_block_bytes:
            log.warning("remote tier %s holds %s of %d bytes, outside this daemon's limits: ignored",
                        level.name.label, key, meta.size)
            return None
        with self._s.locked():
            self._s.namespaces.add(key.namespace)
            if self._catalog.get(key) is None:
                entry = Entry(meta, {level.name})
                self._catalog.add(key, entry)
                self._recency.add(level.name, key)
                self._s.stored_locked(key, entry, level.name)
        self._s.metrics.hits.labels(level.name.label).inc()
        self._s.metrics.bytes_out.labels(level.name.label).inc(meta.size)
        if self._chain.promotes(level.name):
            self._place.promote(key, data, meta, deadline, level.name)
        return bytes(data), meta, level.name

    def read_best(self, key: BlockKey, entry: Entry, *, local_only: bool = False) -> tuple[bytes, TierName] | None:
        """Read a pinned block from the highest tier that holds it, verified.

        A tier whose copy went meanwhile (a race with a move down) or turned
        out corrupt is passed over for the next one down; a tier that fails
        raises TierUnavailable. ``local_only`` passes over remote tiers. A
        remote tier that answers miss for a copy the store lists (a bucket's
        object deleted elsewhere, an upload that never happened) has that
        copy forgotten, so the store stops offering it.
        """
        with self._cond:
            order = self._chain.ordered(entry.tiers)
        if local_only:
            order = [tier for tier in order if not self._chain.tier(tier).remote]
        corrupt: CorruptBlock | None = None
        for tier in order:
            try:
                data = self._read(key, entry.meta, tier)
            except CorruptBlock as err:
                corrupt = err
                continue
            except TierUnavailable:
                if self._chain.tier(tier).remote:  # another machine's copy, unreachable now: not a local failure
                    continue
                raise
            if data is not None:
                return data, tier
            if self._chain.tier(tier).remote:  # the store listed a copy the remote tier no longer has
                with self._s.locked():
                    if self._catalog.get(key) is entry:
                        self._s.forget_copy_locked(key, entry, tier)
        if corrupt is not None:  # no sound copy was left: the caller learns why it is gone
            raise corrupt
        return None

    def _read(self, key: BlockKey, meta: BlockMeta, tier: TierName) -> bytes | None:
        """Read a pinned block from one tier, verified; drop that copy if corrupt."""
        try:
            if self._chain.is_head(tier):
                loc = self._head.locate(key)
                if loc is None:
                    return None
                with self._head.readable(loc[0], meta.size) as view:
                    data = bytes(view)
                if checksum(data) != meta.checksum:
                    raise CorruptBlock(f"block {key} failed its checksum in the {tier.label} tier")
                return data
            return self._chain.tier(tier).get(key)
        except CorruptBlock:
            log.error("dropping corrupt block %s found in tier %s", key, tier.label)
            self._s.metrics.corrupt.labels(tier.label).inc()
            with self._s.locked():
                entry = self._catalog.get(key)
                if entry is not None:
                    self._s.drop_copy_locked(key, entry, tier)
            raise
        except TierUnavailable as err:
            self._s.metrics.tier_errors.labels(tier.label).inc()
            log.error("tier %s failed reading %s: %s", tier.label, key, err)
            raise
