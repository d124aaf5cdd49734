"""Recovery: index what the persistent tiers of a chain kept from a previous run.

The persistent tiers are the disk and, when crash-safe, the host-RAM arena
(which re-adopted its blocks from its block table before the store asks).
Each lists its blocks least recently used first (the order the store wrote
back to it as touches), so the store's recency after a restart is the one
it had before, within the last write-back pass. Tiers are read top down: a
block found in RAM and on disk is one entry with two copies; if their
metadata differ the higher tier's is kept.
"""

from __future__ import annotations

import logging

from kvstore.store.chain import TierChain
from kvstore.store.entries import Catalog, Entry
from kvstore.store.recency import Recency

log = logging.getLogger(__name__)


def recover(chain: TierChain, catalog: Catalog, recency: Recency) -> set[str]:
    """Add every block of every persistent tier to ``catalog``; returns the namespaces found."""
    namespaces: set[str] = set()
    for level in chain:
        if not level.tier.persistent:
            continue
        found = 0
        for key in level.tier.lru():
            meta = level.tier.meta(key)
            if meta is None:
                continue
            entry = catalog.get(key)
            if entry is None:
                entry = Entry(meta)
                catalog.add(key, entry)
            elif entry.meta != meta:
                log.warning("block %s differs between tiers after a restart; keeping the higher tier's copy", key)
                continue
            entry.tiers.add(level.name)
            recency.add(level.name, key)
            namespaces.add(key.namespace)
            found += 1
        if found:
            log.info("recovered %d blocks from the %s tier", found, level.name.label)
    return namespaces
