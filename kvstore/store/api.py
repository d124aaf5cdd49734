"""Store: the store's operations as a server sees them, one contract for both kinds of store.

Two classes answer it: :class:`~kvstore.store.tiered.TieredStore` (one chain
of tiers) and :class:`~kvstore.store.group.StoreGroup` (one such store per
arena, each call routed by its namespace or id). A server that takes a
``Store`` (the same-host socket) is handed either and never asks which: it
does not reach below this boundary with ``hasattr`` or through a group's
arenas. What only a group answers (its arenas, ``arena_of``, ``only``)
stays on :class:`~kvstore.store.group.StoreGroup`. A method a server needs
from either is added here and to both classes;
``tests/store/test_store_api.py`` checks that both keep the same names and
parameters.

Why a :class:`~typing.Protocol` and not a base class: the two share no code
(a group delegates every call), and an empty method inherited from a base
would hide one that a class forgot.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

from kvstore.block import BlockKey, BlockMeta, TierName
from kvstore.tiers.base import MappableTier, TierStats

if TYPE_CHECKING:
    from kvstore.metrics import StoreMetrics
    from kvstore.store.holds import Located
    from kvstore.store.leases import Lease, LeaseKind
    from kvstore.store.limits import StoreLimits
    from kvstore.store.slots import SlotGrant, SlotWrite
    from kvstore.store.moves import Placed
    from kvstore.store.tiered import Listed, StoreStats


class Store(Protocol):
    @property
    def limits(self) -> StoreLimits: ...

    @property
    def metrics(self) -> StoreMetrics: ...

    @property
    def head(self) -> MappableTier:
        """The mappable tier whose offsets Lookup and Allocate hand out (for a group's one-arena
        view, that arena's); :meth:`MappableTier.handle_of` places an offset in its regions."""

    def check_batch(self, items) -> None:
        """InvalidArgument when one request names more blocks (or ids) than the limit."""

    # ---- namespaces ----------------------------------------------------------------

    def create_namespace(self, namespace: str) -> None: ...

    def namespaces(self) -> list[str]: ...

    # ---- the streamed data path ----------------------------------------------------

    def put(self, key: BlockKey, data, meta: BlockMeta, deadline: float | None = None) -> tuple[bool, TierName]: ...

    def open_write(self, key: BlockKey, meta: BlockMeta): ...

    def get(self, key: BlockKey, *, local_only: bool = False) -> tuple[bytes, BlockMeta, TierName] | None: ...

    def get_many(self, namespace: str, keys: Sequence[bytes], *, local_only: bool = False
                 ) -> Iterator[tuple[bytes, BlockMeta, TierName] | None]: ...

    # ---- the slot protocol and reads in place ------------------------------------------

    def allocate(self, namespace: str, blocks: list[tuple[bytes, int, bytes | None, str]],
                 lease_s: float | None = None, deadline: float | None = None, owner: str = "") -> list[SlotGrant]: ...

    def writing(self, slot_id: int, owner: str = "") -> AbstractContextManager[SlotWrite]: ...

    def commit(self, items: list[tuple[int, int]], owner: str = "") -> list[tuple[BlockKey, bool, TierName]]: ...

    def abort(self, slot_ids: Iterable[int], owner: str = "") -> None: ...

    def lookup(self, namespace: str, keys: list[bytes], lease_s: float | None = None, deadline: float | None = None,
               owner: str = "", *, local_only: bool = False) -> list[Located | None]: ...

    def release(self, lease_ids: Iterable[int], owner: str = "") -> list[bool]: ...

    # ---- blocks by key -------------------------------------------------------------

    def exists(self, namespace: str, keys: list[bytes]) -> list[TierName]: ...

    def touch(self, namespace: str, keys: list[bytes]) -> int: ...

    def place(self, namespace: str, keys: list[bytes], warm: bool) -> Placed: ...

    def delete(self, namespace: str, keys: list[bytes]) -> int: ...

    def meta(self, namespace: str, key: bytes) -> BlockMeta | None: ...

    def list_keys(self, namespace: str, prefix: bytes = b"", page_size: int = 0,
                  page_token: bytes = b"") -> tuple[list[Listed], bytes]: ...

    # ---- leases --------------------------------------------------------------------

    def lease(self, namespace: str, keys: list[bytes], kind: LeaseKind, lease_s: float | None = None,
              owner: str = "") -> tuple[Lease, list[bytes]]: ...

    def end_lease(self, lease_id: int, kind: LeaseKind, owner: str = "") -> bool: ...

    def extend_lease(self, lease_id: int, kind: LeaseKind, lease_s: float) -> float: ...

    def pin(self, namespace: str, keys: list[bytes], lease_s: float | None = None,
            owner: str = "") -> tuple[Lease, list[bytes]]: ...

    def unpin(self, lease_id: int, owner: str = "") -> bool: ...

    # ---- the node's view -----------------------------------------------------------

    def stats(self, namespace: str = "") -> StoreStats: ...

    def tier_stats(self) -> list[TierStats]: ...

    def demotion_queue_depth(self) -> int: ...

    def holdings(self, page_blocks: int = 4096) -> Iterator[tuple[BlockKey, TierName]]: ...

    def expire_leases(self) -> None: ...

    def flush_demotions(self) -> None: ...

    def flush_recency(self) -> int: ...

    def persist_ram(self, deadline: float, evict: bool = True) -> int: ...

    def close(self) -> None: ...
