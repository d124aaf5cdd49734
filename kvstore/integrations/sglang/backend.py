"""``StrataHiCacheStorage``: the ``HiCacheStorage`` SGLang's cache controller calls (see the package docstring).

Every method runs on one of the controller's storage threads (prefetch,
prefetch I/O, backup), which may call at once: the client is thread-safe and
made on first use. What a call can meet (:data:`FAILURES`: the daemon away,
stuck, full or refusing, a corrupt block, pages the pool does not hold) is
counted by reason, logged with structured fields, and answered as a miss (or
"not stored"); it decides no tier's health. Anything else is a bug and
reaches the controller, which wraps every storage call (SGLang 0.5.23's
``cache_controller``: query, prefetch and backup each log the exception
and count the pages as missed).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolTransferResult,
)

from kvstore.client import BlockInfo, BlockPut, Client
from kvstore.errors import CorruptBlock, DaemonUnavailable, StrataError, UnknownNamespace
from kvstore.integrations.health import MAX_KEYS_PER_CALL, DaemonHealth, failure_reason
from kvstore.integrations.sglang.host_pages import HostPages, PagesOutOfPool
from kvstore.integrations.sglang.layout import PageLayout
from kvstore.integrations.sglang.settings import StrataStorageSettings

log = logging.getLogger(__name__)

FAILURES = (StrataError, PagesOutOfPool)  # what a call answers as a miss; anything else is a bug and raises

class StrataHiCacheStorage(HiCacheStorage):
    """A Strata daemon as SGLang's HiCache L3 storage, with the zero-copy ``interface_v1``."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None,
                 client_factory=Client) -> None:
        extra = storage_config.extra_config or {}
        if not extra.get("interface_v1"):
            raise ValueError('the Strata HiCache backend moves pages in place through interface_v1: add '
                             '"interface_v1": 1 to --hicache-storage-backend-extra-config')
        self.settings = StrataStorageSettings.from_extra_config(extra)
        self.storage_config = storage_config
        self.layout: PageLayout | None = None
        self.counts: Counter[str] = Counter()  # pages by outcome: "got", "get:missing", "set:down" ...
        self._pages: HostPages | None = None
        self._health = DaemonHealth(self.settings.down_backoff_s, engine="SGLang")
        self._factory = client_factory
        self._client: Client | None = None
        self._lock = threading.Lock()
        self._closed = False

    # ---- registration ---------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Learn the page geometry; an unsupported pool fails the attach here, with the fix in the message."""
        super().register_mem_pool_host(mem_pool_host)
        layout = PageLayout.of(self.storage_config, mem_pool_host, self.settings.namespace)
        self._pages = HostPages(mem_pool_host, layout)
        self.layout = layout
        log.info("Strata HiCache backend: daemon %s, namespace %s, pages of %d bytes in %d piece(s), %s",
                 self.settings.target, layout.namespace, layout.page_bytes, len(layout.pieces),
                 "writer" if self.storage_config.is_storage_writer else "reader (MLA: another rank writes)")

    def client(self) -> Client:
        with self._lock:
            if self._closed:
                raise DaemonUnavailable("the Strata HiCache backend is closed")
            if self._client is None:
                self._client = self._factory(self.settings.target, **self.settings.client_options())
            return self._client

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # ---- interface_v1 -------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of ``keys``, from the first, the daemon holds: one block a page is asked, its last piece.

        A page's pieces (MHA's K and V) are written in one call and read
        together, so they are evicted together but for the rare page split at
        the eviction boundary; such a page is found here and then missed by
        ``batch_get_v1``, which verifies every piece (SGLang takes the pages
        before the miss). Asking one block a page halves the daemon's work.
        """
        layout = self._ready("exists", len(keys))
        if layout is None or not keys:
            return 0
        found = 0
        try:
            for start in range(0, len(keys), MAX_KEYS_PER_CALL):
                part = keys[start:start + MAX_KEYS_PER_CALL]
                tiers = self.client().exists(layout.namespace, [layout.block_keys(key)[-1] for key in part])
                found += len(tiers)
                if len(tiers) < len(part):
                    break
        except FAILURES as err:
            return self._failed("exists", len(keys), err, found)
        self._health.ok(self.settings.target)
        return found

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store each page's pieces from the host pool, in place; a page is True once the daemon holds it."""
        if not self.storage_config.is_storage_writer:
            return [True] * len(keys)  # MLA: one rank writes what every rank reads
        layout = self._ready("set", len(keys))
        if layout is None or not keys:
            return [False] * len(keys)
        done = [False] * len(keys)
        parents = layout.parents(keys, _last_prefix_key(extra_info))
        try:
            pieces = self._pages.pieces(host_indices, len(keys))
            per_call = self._pages_per_call(len(layout.pieces))
            for start in range(0, len(keys), per_call):
                pages = range(start, min(start + per_call, len(keys)))
                items = [BlockPut(block, pieces[i][p], _piece_parent(layout, parents[i], p), layout.tag(p))
                         for i in pages for p, block in enumerate(layout.block_keys(keys[i]))]
                self.client().put_many(layout.namespace, items)
                for i in pages:
                    done[i] = True
        except FAILURES as err:
            self._failed("set", len(keys) - sum(done), err)
            return done
        self._health.ok(self.settings.target)
        self.counts["set"] += len(keys)
        return done

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read each page's pieces into the host pool, in place; a page is True only when all arrived verified.

        A block of another size or layout tag is never read (the page is a
        miss); a page that is not True holds unspecified bytes, which SGLang
        never uses (it frees the pages past the first failure).
        """
        layout = self._ready("get", len(keys))
        if layout is None or not keys:
            return [False] * len(keys)
        got = [False] * len(keys)
        foreign = 0
        try:
            pieces = self._pages.pieces(host_indices, len(keys))
            per_page = len(layout.pieces)
            per_call = self._pages_per_call(per_page)
            for start in range(0, len(keys), per_call):
                pages = list(range(start, min(start + per_call, len(keys))))
                blocks = [k for i in pages for k in layout.block_keys(keys[i])]
                wrong: set[int] = set()

                def place(j: int, info: BlockInfo, pages=pages, wrong=wrong) -> memoryview | None:
                    page, piece = pages[j // per_page], j % per_page
                    if info.size != layout.pieces[piece] or info.layout != layout.tag(piece):
                        wrong.add(j)
                        return None
                    return pieces[page][piece]

                delivered = self._get_into(layout.namespace, blocks, place)
                foreign += len({j // per_page for j in wrong})
                for n, i in enumerate(pages):
                    got[i] = all(b is not None for b in delivered[n * per_page:(n + 1) * per_page])
                if not all(got[i] for i in pages):
                    break  # SGLang takes the leading run of pages: the rest would be read for nothing
        except UnknownNamespace:
            pass  # nothing stored in this layout yet: misses
        except FAILURES as err:
            self._failed("get", len(keys) - sum(got), err)
            return got
        self._health.ok(self.settings.target)
        hits = sum(got)
        self.counts["got"] += hits
        self.counts["get:missing"] += len(keys) - hits - foreign
        if foreign:
            self.counts["get:layout"] += foreign
            log.warning("Strata held %d HiCache pages under this engine's keys written with another layout; not read",
                        foreign, extra={"op": "get", "reason": "layout", "pages": foreign, "namespace": layout.namespace})
        return got

    def _get_into(self, namespace: str, blocks: list[bytes], place) -> list:
        """The client's verified read; once more after a corrupt block, which the daemon has dropped by then,
        so one bad block costs its own page and the pages after it, not the pages before it."""
        try:
            return self.client().get_into(namespace, blocks, place)
        except CorruptBlock as err:
            self.counts["get:corrupt"] += 1
            log.warning("Strata HiCache read found a corrupt block (%s); the daemon dropped it, reading again", err,
                        extra={"op": "get", "reason": "corrupt", "namespace": namespace})
            return self.client().get_into(namespace, blocks, place)

    # ---- hybrid models' pools (not supported: misses) -------------------------------------------

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None) -> PoolTransferResult:
        self._unsupported("exists_v2", len(keys))
        return PoolTransferResult.empty()

    def batch_get_v2(self, transfers, extra_info=None) -> dict[str, list[bool]]:
        self._unsupported("get_v2", sum(len(t.keys or ()) for t in transfers))
        return {t.name: [False] * len(t.keys or ()) for t in transfers}

    def batch_set_v2(self, transfers, extra_info=None) -> dict[str, list[bool]]:
        self._unsupported("set_v2", sum(len(t.keys or ()) for t in transfers))
        return {t.name: [False] * len(t.keys or ()) for t in transfers}

    def _unsupported(self, op: str, pages: int) -> None:
        if not self.counts[f"{op}:unsupported"]:
            log.warning("the Strata HiCache backend does not store hybrid models' extra pools (SGLang's %s): misses",
                        op, extra={"op": op, "reason": "unsupported", "pages": pages})
        self.counts[f"{op}:unsupported"] += max(pages, 1)

    # ---- the page-by-page interface (SGLang calls it only without interface_v1) ----------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return None  # never reached: __init__ requires interface_v1, which routes reads to batch_get_v1

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[None]:
        return [None] * len(keys)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return False  # never reached: __init__ requires interface_v1, which routes writes to batch_set_v1

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return False

    # ---- what every call shares -------------------------------------------------------------

    def _ready(self, op: str, pages: int) -> PageLayout | None:
        """The layout, when a call may be made now (registered, open, the daemon not backing off)."""
        if self.layout is None or self._closed:
            self.counts[f"{op}:unregistered"] += pages
            return None
        if not self._health.usable():
            self.counts[f"{op}:down"] += pages
            return None
        return self.layout

    def _pages_per_call(self, per_page: int) -> int:
        return max(1, MAX_KEYS_PER_CALL // per_page)

    def _failed(self, op: str, pages: int, err: Exception, answer: int = 0) -> int:
        """Count and log a failed call; the daemon found down starts the back-off."""
        reason = "pages" if isinstance(err, PagesOutOfPool) else failure_reason(err)
        if reason == "down":
            self._health.failed(err, self.settings.target)
        self.counts[f"{op}:{reason}"] += pages
        if reason not in ("down", "missing"):  # down: DaemonHealth logs it once; missing: a plain miss
            log.warning("Strata HiCache %s of %d pages failed (%s: %s): SGLang sees a miss", op, pages, reason, err,
                        extra={"op": op, "reason": reason, "pages": pages, "error": type(err).__name__,
                               "namespace": self.layout.namespace if self.layout else None})
        return answer


def _last_prefix_key(extra_info: HiCacheStorageExtraInfo | None) -> str | None:
    prefix = extra_info.prefix_keys if extra_info is not None else None
    return prefix[-1] if prefix else None


def _piece_parent(layout: PageLayout, page_key: str | None, piece: int) -> bytes | None:
    return None if page_key is None else layout.block_keys(page_key)[piece]


__all__: Sequence[str] = ("StrataHiCacheStorage",)
