"""Local tiers and their registry: a tier name in config -> a constructor.

The daemon builds its chain from names (``ram``, ``disk``, ``remote`` for a
remote source by URL such as ``memory://fleet``, ``peer`` for other daemons' blocks, ``object`` for an
S3 bucket the fleet shares, ``gpu`` for device memory at the head) with
:func:`open_tier`; a new tier is one module plus one entry in
``_REGISTRY`` (and a row in the tier contract suite), never an ``if`` on a
name somewhere else.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.errors import InvalidArgument
from kvstore.tiers.base import MappableTier, Tier, TierStats

__all__ = ["MappableTier", "Tier", "TierStats", "known_tiers", "open_tier", "register_tier"]


def _ram(**options) -> Tier:
    from kvstore.tiers.ram import HostRamTier

    return HostRamTier(**options)


def _disk(**options) -> Tier:
    from kvstore.tiers.disk import DiskTier

    return DiskTier(**options)


def _remote(url: str, **options) -> Tier:
    from kvstore.tiers.remote import RemoteTier

    return RemoteTier.open(url, **options)


def _peer(*, deadline_s: float, max_fetches: int, max_queued: int, **options) -> Tier:
    """The peer tier: a RemoteTier over ``peer://``; at most ``max_fetches`` reads run at once
    and ``max_queued`` wait (more are Overloaded), each answered within ``deadline_s``."""
    from kvstore.remote.bridge import BridgeLimits
    from kvstore.tiers.remote import RemoteTier

    limits = BridgeLimits(max_in_flight=max_fetches, max_queued=max_queued)
    return RemoteTier.open("peer://", call_s=deadline_s, limits=limits, **options)


def _object(**options) -> Tier:
    """The object tier: an S3-compatible bucket (see ``ObjectTier.open`` for the options)."""
    from kvstore.tiers.object import ObjectTier

    return ObjectTier.open(**options)


def _gpu(**options) -> Tier:
    """The GPU tier: one region per device (``kvstore.tiers.device``); TierUnavailable without CUDA."""
    from kvstore.tiers.gpu import GpuTier

    return GpuTier(**options)


_REGISTRY: dict[str, Callable[..., Tier]] = {
    "ram": _ram, "disk": _disk, "remote": _remote, "peer": _peer, "object": _object, "gpu": _gpu,
}


def register_tier(name: str, factory: Callable[..., Tier]) -> None:
    """Make ``name`` usable in a chain; ``factory(**options)`` builds the tier."""
    _REGISTRY[name] = factory


def known_tiers() -> list[str]:
    return sorted(_REGISTRY)


def open_tier(name: str, **options) -> Tier:
    """The tier registered as ``name``, built with its section's options."""
    factory = _REGISTRY.get(name)
    if factory is None:
        raise InvalidArgument(f"unknown tier {name!r}: the known tiers are {', '.join(known_tiers())}")
    return factory(**options)
