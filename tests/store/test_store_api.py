"""Store (kvstore.store.api): TieredStore and StoreGroup answer the same calls with the same parameters.

Checked structurally, on the classes and on real instances (a store over a real RAM tier, a group of
one arena and its one-arena view): a method a server calls cannot be added to one and forgotten on
the other, or take its arguments in another order there.
"""

from __future__ import annotations

import inspect

import pytest

from kvstore.block import BlockKey, BlockMeta, checksum
from kvstore.store.api import Store
from kvstore.store.group import StoreArena, StoreGroup
from kvstore.store.namespace_rules import EVERYTHING_ELSE
from kvstore.store.tiered import StoreLimits, TieredStore
from kvstore.tiers.base import MappableTier
from kvstore.tiers.ram import HostRamTier
from tests.support.store_blocks import MiB, value

MEMBERS = sorted(name for name in vars(Store) if not name.startswith("_"))
PROPERTIES = [name for name in MEMBERS if isinstance(vars(Store)[name], property)]
METHODS = [name for name in MEMBERS if name not in PROPERTIES]


def parameters(fn) -> list[tuple[str, object, object]]:
    """Names, kinds and defaults: what a caller relies on (annotations are a checker's business)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.fixture
def stores(tmp_path):
    ram = HostRamTier(8 * MiB, shm_dir=str(tmp_path), arena_name="api")
    store = TieredStore([ram], limits=StoreLimits.from_settings(max_block_bytes=MiB, demotion_threads=0))
    group = StoreGroup([StoreArena("default", EVERYTHING_ELSE, store)])
    yield store, group
    store.close()


def test_the_protocol_names_the_calls_servers_make():
    assert {"head", "limits", "metrics"} <= set(PROPERTIES)
    assert {"put", "get", "lookup", "allocate", "commit", "release", "meta", "lease", "touch"} <= set(METHODS)


@pytest.mark.parametrize("cls", [TieredStore, StoreGroup], ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", METHODS)
def test_each_method_has_the_protocols_parameters(cls, name):
    own = getattr(cls, name, None)
    assert callable(own), f"{cls.__name__} has no {name}"
    assert parameters(own) == parameters(getattr(Store, name)), f"{cls.__name__}.{name} differs from Store.{name}"


def test_both_have_every_property_and_a_mappable_head(stores):
    store, group = stores
    for s in (store, group, group.only("default")):
        for name in PROPERTIES:
            assert hasattr(s, name), f"{type(s).__name__} has no {name}"
        assert isinstance(s.head, MappableTier)
    assert group.head is store.head and group.only("default").head is store.head


def test_meta_takes_a_namespace_and_a_key_on_both(stores):
    store, group = stores
    data = value(1, 4096)
    meta = BlockMeta(len(data), checksum(data))
    store.put(BlockKey("m", b"k"), data, meta)
    assert store.meta("m", b"k") == group.meta("m", b"k") == meta
    assert store.meta("m", b"missing") is None and group.meta("m", b"missing") is None
