"""The node's stores from its settings: one chain of tiers and one store per arena.

Each arena (``Settings.arena_plan``, the default arena first) gets its own
instance of every tier in ``[tiers] chain``, sized and placed by the tier's
settings (``arena_options``): its own shared-memory file, its own disk
directory. Each store recovers its own directory at start. All stores share
the limits, the metrics and the event bus (events carry the namespace), and
their ids carry the arena's index (see :mod:`kvstore.store.group`) when
there is more than one arena. With ``--gpu-bytes`` the default arena's chain
starts at the gpu tier (``[gpu, ram, disk...]``): writes land in device
memory and same-host clients reach it through the region's handle
(:mod:`kvstore.server.samehost_gpu`); the RAM arena below stays the file
every client maps.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvstore.config import Settings
from kvstore.metrics import StoreMetrics
from kvstore.store import EdgePolicy, StoreLimits, TierChain, TieredStore
from kvstore.store.group import StoreArena, StoreGroup, watch_group
from kvstore.store.namespace_rules import NamespaceRules
from kvstore.store.state import EventSink
from kvstore.tiers import open_tier

log = logging.getLogger(__name__)


def open_stores(
    settings: Settings, state_dir: Path, metrics: StoreMetrics, events: EventSink,
    runtime: Mapping[str, Mapping[str, Any]] | None = None,
) -> StoreGroup:
    """Build every arena's tiers and store; on a failure, close what was opened and raise.

    ``runtime``: per tier name, options only the running daemon has (the peer tier's index,
    node identity and metrics), added to what the tier's settings give."""
    _check_gpu(settings)
    plan = settings.arena_plan()
    rules = NamespaceRules([(a["name"], a["namespaces"]) for a in plan[1:]], plan[0]["name"])
    limits = StoreLimits.from_settings(settings.store)
    arenas: list[StoreArena] = []
    try:
        for index, arena in enumerate(plan):
            created = [ns for ns in settings.store.namespaces if rules.arena_of(ns) == arena["name"]]
            chain = _chain(settings, arena, state_dir, {"gpu": _gpu_runtime(settings), **(runtime or {})})
            try:
                store = TieredStore(
                    chain, limits=limits,
                    namespaces=created, auto_create_namespaces=settings.store.auto_create_namespaces,
                    metrics=metrics, events=events, id_tag=index if len(plan) > 1 else None, watch_tiers=False,
                )
            except BaseException:
                for level in chain:
                    level.tier.close()
                raise
            arenas.append(StoreArena(arena["name"], tuple(arena["namespaces"]), store, index))
    except BaseException:
        for built in arenas:
            built.store.close()
        raise
    group = StoreGroup(arenas, metrics=metrics)
    watch_group(metrics, group)
    _warn_of_orphans(state_dir, {a["name"] for a in plan})
    return group


def _warn_of_orphans(state_dir: Path, names: set[str]) -> None:
    """A disk folder of an arena no longer configured holds blocks no store counts or serves."""
    try:
        orphans = sorted(p for p in (state_dir / "arenas").iterdir() if p.is_dir() and p.name not in names)
    except FileNotFoundError:
        return
    for path in orphans:
        log.warning("disk folder %s belongs to arena %r, which is not configured: its blocks are not served "
                    "or counted; configure the arena again, or delete the folder", path, path.name)


def _chain(settings: Settings, arena: dict, state_dir: Path, runtime: Mapping[str, Mapping[str, Any]]) -> TierChain:
    tiers: list = []
    edges: list[EdgePolicy] = []
    try:
        for name in settings.tiers.effective_chain():
            options = settings.arena_tier_options(arena, name, state_dir)
            if options is None:
                continue
            if tiers:  # the policy of the edge above this tier
                edges.append(EdgePolicy(**settings.tiers.section(name).edge()))
            tiers.append(open_tier(name, **options, **runtime.get(name, {})))
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return TierChain(tiers, edges)


def _check_gpu(settings: Settings) -> None:
    """With ``--gpu-bytes``: the memory kind must be there on every device, else a start error naming
    the fix (no CUDA, no such device), before anything is allocated."""
    gpu = settings.tiers.gpu
    if not gpu.enabled:
        return
    from kvstore.tiers.device import probe

    probe(gpu.memory, gpu.devices)


def _gpu_runtime(settings: Settings) -> dict[str, Any]:
    """The host stand-in's file goes beside the RAM arena's (a tmpfs the daemon was told to use)."""
    gpu = settings.tiers.gpu
    return {"shm_dir": str(settings.tiers.ram.shm_dir)} if gpu.enabled and gpu.memory == "host" else {}
