"""``StrataL2Adapter``: a Strata daemon as an L2 of LMCache's server mode (see the package docstring).

LMCache's store and prefetch controllers call from their own threads and
must never block: each submit takes a task id and hands the work to this
adapter's threads, which signal the operation's event fd when a result is
ready. What a task can meet (:data:`FAILURES`: the daemon away, stuck, full,
refusing, a corrupt block) fails the store or answers misses, counted by
reason and logged with structured fields; it decides no tier's health. A
task that raises anything else is a bug: it is logged with its traceback and
answered the same way, since a task left unanswered would stall LMCache's
request for good.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import KeyEntry, KeyListPage, MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform import create_event_notifier

from kvstore.client import BlockInfo, BlockPut, Client
from kvstore.errors import CorruptBlock, DaemonUnavailable, StrataError, UnknownNamespace
from kvstore.integrations.health import MAX_KEYS_PER_CALL, DaemonHealth, failure_reason
from kvstore.integrations.lmcache.mapping import chunk_bytes
from kvstore.integrations.lmcache_mp import keys as mp_keys
from kvstore.integrations.lmcache_mp.locks import LeaseBook
from kvstore.integrations.lmcache_mp.settings import L2Settings

log = logging.getLogger(__name__)

FAILURES = (StrataError,)  # what a task answers as failed / misses; anything else is a bug (logged, answered)
OPS = ("store", "lookup", "load")
MAX_LIST_PAGE = 1000  # blocks per listing page asked of the daemon


class StrataL2AdapterConfig(L2AdapterConfigBase):
    """What LMCache's plugin factory builds from ``adapter_params`` and hands the adapter."""

    def __init__(self, settings: L2Settings) -> None:
        self.settings = settings

    @classmethod
    def from_dict(cls, d: dict) -> StrataL2AdapterConfig:
        return cls(L2Settings.from_dict(d))

    @classmethod
    def help(cls) -> str:
        return (
            "Strata L2 adapter (adapter_params):\n"
            "- target (str): the Strata daemon, host:port (default 127.0.0.1:50051)\n"
            "- namespace (str): namespace prefix; a model and cache_salt each get one under it (default lmcache)\n"
            "- num_workers (int): threads running tasks (default 4)\n"
            "- max_pending_tasks (int): tasks waiting or running at most; beyond, a task fails at once (256)\n"
            "- lock_lease_s (float): how long a lookup holds its hits if never unlocked (default 60)\n"
            "- timeout_s, retries, down_backoff_s, shared_memory (auto|true|false)\n"
            "- token_file, tls_ca, tls_cert, tls_key, tls_server_name: the daemon's security\n"
            'Example: {"type": "plugin", "module_path": "kvstore.integrations.lmcache_mp", '
            '"class_name": "StrataL2Adapter", "adapter_params": {"target": "127.0.0.1:50051"}}'
        )


class StrataL2Adapter(L2AdapterInterface):
    """Stores, looks up (pinning hits) and loads LMCache's objects in a Strata daemon, without blocking."""

    config_class_name = "StrataL2AdapterConfig"

    def __init__(self, config: StrataL2AdapterConfig | L2Settings | dict | None = None, l1_memory_desc=None,
                 client_factory: Callable[..., Client] = Client) -> None:
        if isinstance(config, StrataL2AdapterConfig):
            settings = config.settings
        elif isinstance(config, L2Settings):
            settings = config
        else:
            settings = L2Settings.from_dict(config)
        super().__init__(max_capacity_bytes=0)  # the daemon evicts by its own policy: no global eviction here
        self.settings = settings
        self.counts: Counter[str] = Counter()  # objects by outcome: "stored", "load:missing", "lookup:down" ...
        self._factory = client_factory
        self._client: Client | None = None
        self._health = DaemonHealth(settings.down_backoff_s, engine="the LMCache server")
        self._locks = LeaseBook()
        self._sizes: dict[tuple[str, int, int], int] = {}  # (namespace, group, kv_rank) -> object bytes stored
        self._notifiers = {op: create_event_notifier() for op in OPS}
        self._done: dict[str, dict[L2TaskId, object]] = {op: {} for op in OPS}
        self._ids = itertools.count(1)
        self._pending = 0
        self._lock = threading.Lock()
        self._closed = False
        self._pool = ThreadPoolExecutor(settings.num_workers, thread_name_prefix="strata-l2")
        log.info("Strata L2 adapter: daemon %s, namespaces under %s/, %d workers, at most %d tasks",
                 settings.target, settings.namespace, settings.num_workers, settings.max_pending_tasks)

    # ---- event fds ----------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return self._notifiers["store"].fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._notifiers["lookup"].fileno()

    def get_load_event_fd(self) -> int:
        return self._notifiers["load"].fileno()

    # ---- store --------------------------------------------------------------------------------

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit("store", lambda: self._store(keys, objects), lambda: L2StoreResult(False, 0), len(keys))

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._done["store"] = self._done["store"], {}
        return done  # type: ignore[return-value]

    def _store(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2StoreResult:
        """Each object's bytes, copied once into the daemon; the task fails if any object could not be stored."""
        if not self._usable("store", len(keys)):
            return L2StoreResult(False, 0)
        stored: list[ObjectKey] = []
        sizes: list[int] = []
        failed = False
        for namespace, indices in self._by_namespace(keys):
            for part in _parts(indices):
                outcome = self._put(namespace, [keys[i] for i in part], [objects[i] for i in part], stored, sizes)
                failed |= outcome != "ok"
                if outcome == "down":
                    break
            if self._health.down:
                break
        if stored:
            self._notify_keys_stored(stored, sizes)
        if failed:
            return L2StoreResult(False, 0)
        self._health.ok(self.settings.target)
        return L2StoreResult(True, sum(sizes))

    def _put(self, namespace: str, keys: list[ObjectKey], objects: list[MemoryObj], stored: list[ObjectKey],
             sizes: list[int]) -> str:
        """One put_many; the newly stored keys and sizes are appended. "ok", or the reason it failed."""
        try:
            items = [BlockPut(mp_keys.block_key(k), chunk_bytes(obj), None, mp_keys.layout_tag(obj))
                     for k, obj in zip(keys, objects)]
        except ValueError as err:  # not a tensor chunk, or a dtype a layout cannot name
            self._count("store:unsupported", len(keys))
            log.warning("Strata L2 cannot store %d objects: %s", len(keys), err,
                        extra={"op": "store", "reason": "unsupported", "objects": len(keys)})
            return "unsupported"
        try:
            fresh = self.client().put_many(namespace, items)
        except FAILURES as err:
            self._failed("store", len(keys), err, namespace)
            return failure_reason(err)
        for k, obj, new in zip(keys, objects, fresh):
            if new:  # a key already stored moves nothing and is not counted twice
                stored.append(k)
                sizes.append(obj.get_size())
                self._sizes[(namespace, k.object_group_id, k.kv_rank)] = obj.get_size()
        self._count("stored", sum(fresh))
        self._count("store:present", len(fresh) - sum(fresh))
        return "ok"

    # ---- lookup and lock ----------------------------------------------------------------------

    def submit_lookup_and_lock_task(self, keys: list[ObjectKey],
                                    group_layout_descs: dict[int, MemoryLayoutDesc] | None = None) -> L2TaskId:
        return self._submit("lookup", lambda: self._lookup(keys), lambda: Bitmap(len(keys)), len(keys))

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._done["lookup"].pop(task_id, None)  # type: ignore[return-value]

    def _lookup(self, keys: list[ObjectKey]) -> Bitmap:
        """A bit per key the daemon holds. Those its local tiers hold are pinned (the pin is the daemon's
        per-key presence answer) and stay locked until LMCache unlocks them or ``lock_lease_s`` passes; of
        the rest, those a remote tier that answers existence holds are found without a lock."""
        found = Bitmap(len(keys))
        if not self._usable("lookup", len(keys)):
            return found
        self._locks.expire()
        hits = 0
        for namespace, indices in self._by_namespace(keys):
            for part in _parts(indices):
                names = [mp_keys.block_key(keys[i]) for i in part]
                try:
                    lease = self.client().pin(namespace, names, lease_s=self.settings.lock_lease_s)
                except UnknownNamespace:  # nothing stored here in it yet; a remote tier may hold some
                    hits += self._found_remotely(namespace, part, names, set(names), found)
                    continue
                except FAILURES as err:
                    self._failed("lookup", len(part), err, namespace)
                    if failure_reason(err) == "down":
                        self._count("lookup:missing", len(keys) - hits)
                        return found  # the keys found so far stay found, and locked
                    break
                missing = set(lease.missing)
                locked = [name for name in names if name not in missing]
                for i, name in zip(part, names):
                    if name not in missing:
                        found.set(i)
                if locked:  # a pin that found nothing took no lease
                    self._locks.add(lease.lease_id, namespace, locked, self.settings.lock_lease_s)
                hits += len(locked)
                if missing:
                    hits += self._found_remotely(namespace, part, names, missing, found)
        self._health.ok(self.settings.target)
        self._count("lookup:hit", hits)
        self._count("lookup:missing", len(keys) - hits)
        return found

    def _found_remotely(self, namespace: str, part: list[int], names: list[bytes], missing: set[bytes],
                        found: Bitmap) -> int:
        """Of the keys no local tier holds, the leading ones a remote tier that answers existence holds (the
        object tier: a fresh node's bucket); found, not locked (a load reads them through; one gone by then
        is a miss)."""
        rest = [(i, name) for i, name in zip(part, names) if name in missing]
        try:
            tiers = self.client().exists(namespace, [name for _, name in rest])
        except FAILURES as err:
            self._failed("lookup", len(rest), err, namespace)
            return 0
        for i, _ in rest[:len(tiers)]:
            found.set(i)
        self._count("lookup:remote", len(tiers))
        return len(tiers)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        """Give back the pin of each lease LMCache has now unlocked every key of. A pin the daemon cannot
        take back now (down, or this adapter closing) ends by itself after ``lock_lease_s``."""
        names = [(mp_keys.namespace(self.settings.namespace, k), mp_keys.block_key(k)) for k in keys]
        for lease_id in self._locks.unlock(names):
            try:
                self._pool.submit(self._unpin, lease_id)
            except RuntimeError:  # the pool is shut down: the lease expires
                return

    def _unpin(self, lease_id: int) -> None:
        if not self._health.usable():
            return
        try:
            self.client().unpin(lease_id)
        except FAILURES as err:
            self._count(f"unlock:{failure_reason(err)}")
            log.debug("Strata L2 unpin of lease %d failed (%s); it expires by itself", lease_id, err)

    # ---- load ---------------------------------------------------------------------------------

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit("load", lambda: self._load(keys, objects), lambda: Bitmap(len(keys)), len(keys))

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._done["load"].pop(task_id, None)  # type: ignore[return-value]

    def _load(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> Bitmap:
        """Read each block straight into its MemoryObj, verified on landing; a bit per object loaded.
        A block of another size or layout is not read (a miss); an object whose bit is not set holds
        unspecified bytes."""
        loaded = Bitmap(len(keys))
        if not self._usable("load", len(keys)):
            return loaded
        accessed: list[ObjectKey] = []
        for namespace, indices in self._by_namespace(keys):
            for part in _parts(indices):
                blocks = self._read(namespace, [keys[i] for i in part], [objects[i] for i in part])
                if blocks is None:
                    return loaded
                for i, block in zip(part, blocks):
                    if block is not None:
                        loaded.set(i)
                        accessed.append(keys[i])
        self._count("loaded", len(accessed))
        self._count("load:missing", len(keys) - len(accessed))
        if accessed:
            self._notify_keys_accessed(accessed)
        return loaded

    def _read(self, namespace: str, keys: list[ObjectKey], objects: list[MemoryObj]) -> list | None:
        """The blocks read into ``objects`` (None per miss); None when the daemon is down."""
        views: dict[int, object] = {}
        wrong: set[int] = set()

        def place(j: int, info: BlockInfo):
            if j not in views:
                obj = objects[j]
                try:
                    fits = info.size == obj.get_size() and info.layout == mp_keys.layout_tag(obj)
                    views[j] = chunk_bytes(obj) if fits else None
                except ValueError:  # a destination this adapter never stores into
                    views[j] = None
                if views[j] is None:
                    wrong.add(j)
            return views[j]

        names = [mp_keys.block_key(k) for k in keys]
        try:
            try:
                blocks = self.client().get_into(namespace, names, place)
            except CorruptBlock as err:  # the daemon has dropped the bad copy: the others are still worth reading
                self._failed("load", 1, err, namespace)
                blocks = self.client().get_into(namespace, names, place)
        except FAILURES as err:
            self._failed("load", len(keys), err, namespace)
            return None if failure_reason(err) == "down" else [None] * len(keys)
        if wrong:
            self._count("load:layout", len(wrong))
            log.warning("Strata held %d objects under these keys with another size or layout; not read", len(wrong),
                        extra={"op": "load", "reason": "layout", "objects": len(wrong), "namespace": namespace})
        self._health.ok(self.settings.target)
        return blocks

    # ---- delete, list, usage, status ----------------------------------------------------------

    def delete(self, keys: list[ObjectKey]) -> None:
        """Delete the blocks of ``keys`` (absent ones are skipped); LMCache's byte accounting is told of the
        bytes the daemon removed, each namespace and object group counted at the size this adapter stored."""
        if not keys or not self._usable("delete", len(keys)):
            return
        groups: dict[tuple[str, int, int], list[ObjectKey]] = {}
        for k in keys:
            groups.setdefault((mp_keys.namespace(self.settings.namespace, k), k.object_group_id, k.kv_rank),
                              []).append(k)
        for (namespace, group, rank), members in groups.items():
            for start in range(0, len(members), MAX_KEYS_PER_CALL):
                part = members[start:start + MAX_KEYS_PER_CALL]
                try:
                    deleted = self.client().delete(namespace, [mp_keys.block_key(k) for k in part])
                except FAILURES as err:
                    self._failed("delete", len(part), err, namespace)
                    if failure_reason(err) == "down":
                        return
                    continue
                self._count("deleted", deleted)
                if deleted:  # which keys were absent is not said: all are named gone, the bytes are the deleted
                    size = self._sizes.get((namespace, group, rank), 0)
                    self._notify_keys_deleted(part, [size] * deleted + [0] * (len(part) - deleted))

    def list_l2_keys(self, model_name: str | None = None, page_size: int = 500,
                     cursor: str | None = None) -> KeyListPage:
        """The objects the daemon holds under this adapter's namespaces (of one model, if named), a page at a
        time; ``cursor`` is the previous page's ``next_page_token``. Blocks this adapter did not write are
        left out. Raises ValueError for a bad page size or cursor; StrataError when the daemon cannot answer."""
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        first, token = _read_cursor(cursor)
        client = self.client()
        prefix = self.settings.namespace + "/"
        names = sorted(n for n in client.stats().namespaces if n.startswith(prefix) and n >= first)
        entries: list[KeyEntry] = []
        for n, name in enumerate(names):
            token = token if name == first else b""
            while True:
                page = client.list_blocks(name, page_size=min(page_size - len(entries), MAX_LIST_PAGE),
                                          page_token=token)
                for block in page.blocks:
                    key = mp_keys.object_key(block.key)
                    if key is not None and (model_name is None or key.model_name == model_name):
                        entries.append(KeyEntry(key, block.size))
                token = page.next_page_token
                if len(entries) >= page_size:
                    if token:
                        return KeyListPage(tuple(entries), _write_cursor(name, token))
                    more = n + 1 < len(names)
                    return KeyListPage(tuple(entries), _write_cursor(names[n + 1], b"") if more else None)
                if not token:
                    break
        return KeyListPage(tuple(entries), None)

    def report_status(self) -> dict:
        with self._lock:
            pending = self._pending
            counts = dict(self.counts)
        return {
            "is_healthy": not self._health.down,
            "type": "StrataL2Adapter",
            "target": self.settings.target,
            "namespace": self.settings.namespace,
            "pending_tasks": pending,
            "max_pending_tasks": self.settings.max_pending_tasks,
            "locked_keys": len(self._locks),
            "counts": counts,
        }

    # ---- lifecycle ----------------------------------------------------------------------------

    def client(self) -> Client:
        with self._lock:
            if self._closed:
                raise DaemonUnavailable("the Strata L2 adapter is closed")
            if self._client is None:
                self._client = self._factory(self.settings.target, **self.settings.client_options())
            return self._client

    def close(self) -> None:
        """Stop taking tasks, finish the running ones, give every pin back, close the client and the fds."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            for lease_id in self._locks.drain() if self._health.usable() else ():
                try:
                    client.unpin(lease_id)
                except FAILURES:
                    break  # the rest expire by themselves
            client.close()
        for notifier in self._notifiers.values():
            notifier.close()

    # ---- what every task shares ---------------------------------------------------------------

    def _submit(self, op: str, work: Callable[[], object], refused: Callable[[], object], objects: int) -> L2TaskId:
        task_id = next(self._ids)
        with self._lock:
            reason = "closed" if self._closed else "busy" if self._pending >= self.settings.max_pending_tasks else None
            if reason is None:
                self._pending += 1
        if reason is None:
            try:
                self._pool.submit(self._run, op, task_id, work, refused)
                return task_id
            except RuntimeError:  # closed meanwhile
                with self._lock:
                    self._pending -= 1
                reason = "closed"
        self._count(f"{op}:{reason}", objects)
        if reason == "busy":
            log.warning("Strata L2 adapter has %d tasks in flight (max_pending_tasks); a %s of %d objects fails "
                        "at once", self.settings.max_pending_tasks, op, objects,
                        extra={"op": op, "reason": "busy", "objects": objects})
        self._finish(op, task_id, refused())
        return task_id

    def _run(self, op: str, task_id: L2TaskId, work: Callable[[], object], refused: Callable[[], object]) -> None:
        result = None
        try:
            result = work()
        except Exception:
            self._count(f"{op}:bug")
            log.exception("Strata L2 %s task %d raised; it is answered as failed", op, task_id,
                          extra={"op": op, "reason": "bug"})
        finally:
            with self._lock:
                self._pending -= 1
            self._finish(op, task_id, refused() if result is None else result)

    def _finish(self, op: str, task_id: L2TaskId, result: object) -> None:
        with self._lock:
            self._done[op][task_id] = result
        self._notifiers[op].notify()

    def _usable(self, op: str, objects: int) -> bool:
        if self._health.usable():
            return True
        self._count(f"{op}:down", objects)
        return False

    def _by_namespace(self, keys: Sequence[ObjectKey]) -> Iterator[tuple[str, list[int]]]:
        groups: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(mp_keys.namespace(self.settings.namespace, k), []).append(i)
        yield from groups.items()

    def _count(self, what: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self.counts[what] += n

    def _failed(self, op: str, objects: int, err: StrataError, namespace: str) -> None:
        """Count and log a failed call; the daemon found down starts the back-off."""
        reason = failure_reason(err)
        if reason == "down":
            self._health.failed(err, self.settings.target)
        self._count(f"{op}:{reason}", objects)
        if reason not in ("down", "missing"):  # down: DaemonHealth logs it once; missing: a plain miss
            log.warning("Strata L2 %s of %d objects failed (%s: %s)", op, objects, reason, err,
                        extra={"op": op, "reason": reason, "objects": objects, "error": type(err).__name__,
                               "namespace": namespace})


def _parts(indices: list[int]) -> Iterator[list[int]]:
    for start in range(0, len(indices), MAX_KEYS_PER_CALL):
        yield indices[start:start + MAX_KEYS_PER_CALL]


def _write_cursor(namespace: str, token: bytes) -> str:
    text = json.dumps({"ns": namespace, "t": token.hex()}, separators=(",", ":"))
    return base64.urlsafe_b64encode(text.encode()).decode()


def _read_cursor(cursor: str | None) -> tuple[str, bytes]:
    if not cursor:
        return "", b""
    try:
        d = json.loads(base64.urlsafe_b64decode(cursor.encode()))
        return str(d["ns"]), bytes.fromhex(d["t"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"not a cursor this adapter gave ({err}); start again without one") from None


__all__: Sequence[str] = ("StrataL2Adapter", "StrataL2AdapterConfig")
