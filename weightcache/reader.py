"""``open_model``: stream a published model's tensors, each as soon as its bytes are verified here.

::

    with weightcache.open_model("s3://models/llama/rev", digest, cache_dir="/var/cache/strata") as model:
        for name, tensor in model:           # numpy arrays; framework="pt" for torch tensors
            engine.load(name, tensor)

The reader resolves the manifest (from the node cache when the digest is
already there, so a warm node needs no origin at all), opens the model in
the node cache, and starts the fetch planner on a loop thread of its own,
with a plan in the order tensors will be wanted: the files a caller asked
for whole (``include``, e.g. ``config.json``) first, then per safetensors
file its header chunks and its tensors in byte order. Iteration yields
``(name, tensor)`` in the order tensors become complete (close to plan
order; never a tensor with an unverified byte) while the rest keeps arriving.

Each file's header, once its chunks are verified, is parsed again and
compared with the manifest's tensor table before any tensor of that file is
yielded: a manifest whose table does not describe its own bytes raises
``ManifestMismatch`` instead of handing out tensors at wrong offsets.

A subset is chosen with ``files`` (paths, a glob, or a predicate: one
tensor-parallel rank's shards, e.g. ``"model-rank-0-part-*.safetensors"``)
and ``names`` (names, a glob, or a predicate); only the chunks those
tensors touch are fetched. A chunk that cannot be had (corrupt everywhere,
origin gone) fails only the tensors that need it: iteration yields every
other tensor, then raises the first failure.

Tensors are zero-copy views of private mappings of the cache files (see
:mod:`weightcache.tensors`); they stay valid after the reader is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from kvstore.errors import DeadlineExceeded, InvalidArgument, StrataError
from weightcache import catalog
from weightcache.cache import NodeCache
from weightcache.errors import ManifestMismatch
from weightcache.fetch import FetchLimits, FetchStats, Planner
from weightcache.manifest import Manifest
from weightcache.origin import S3OriginOptions, open_origin
from weightcache.ram_copy import RamCopy
from weightcache.safetensors_header import LENGTH_BYTES, SafetensorsHeader, TensorEntry, header_length, parse_header
from weightcache.sources import ChunkRef, ChunkSource, OriginSource
from weightcache.tensors import converter

Selector = str | Iterable[str] | Callable[[str], bool] | None
MANIFEST_TIMEOUT_S = 120.0


def open_model(
    location: str,
    digest: str | None = None,
    *,
    cache_dir: str | Path,
    cache_bytes: int | None = None,
    revision: str | None = None,
    files: Selector = None,
    names: Selector = None,
    include: Selector = None,
    framework: str = "numpy",
    limits: FetchLimits = FetchLimits(),
    s3: S3OriginOptions | None = None,
    sources: Sequence[ChunkSource] | Callable[[ChunkRef], Sequence[ChunkSource]] = (),
    order: Callable[[tuple[int, int]], int] | None = None,
    route: Callable[[Manifest], tuple[Callable, Callable]] | None = None,
    deadline_s: float | None = None,
    metrics=None,
    ram_dir: str | Path | None = None,
) -> ModelReader:
    """Open a published model revision for streaming (see the module docstring).

    ``digest`` pins the manifest (what ``strata weights publish`` printed); without it the
    location's latest manifest is used and ``reader.digest`` says which. ``revision``, when
    given, must be the manifest's. ``sources`` are tried before the origin for every chunk
    (peers), or, given as a function of a chunk, the ones it names for that chunk (a swarm's
    owner of it). ``order`` (a sort key of (file, chunk)) reorders the fetch plan (a swarm
    node fetches the chunks it owns first). ``route``, a function of the resolved manifest,
    gives both (:meth:`weightcache.peers.Swarm.route`). ``cache_bytes`` bounds the node cache
    (default: what its disk holds). ``ram_dir`` is the node's host-RAM copy
    (:mod:`weightcache.ram_copy`, ``strata weights serve --ram-dir``): files the weight node
    copied there are mapped read-only from it, one copy for every process on the node.
    """
    if sys.byteorder != "little":
        raise InvalidArgument("weightcache reads safetensors (little-endian) in place; this host is big-endian")
    make = converter(framework)
    origin = open_origin(location, revision=revision, s3=s3)
    loop = _LoopThread()
    cache = ram = None
    try:
        cache = NodeCache(cache_dir, cache_bytes if cache_bytes is not None else _disk_size(cache_dir))
        manifest = cache.stored_manifest(catalog.check_digest(digest)) if digest else None
        if manifest is None:
            manifest = loop.call(catalog.resolve(origin, digest), MANIFEST_TIMEOUT_S)
        if revision is not None and manifest.revision != origin.default_revision:
            raise InvalidArgument(
                f"manifest {manifest.digest} at {location} is of revision {manifest.revision!r}, not "
                f"{origin.default_revision!r}: open the digest published for that revision"
            )
        if route is not None:
            sources, order = route(manifest)
        origin_source = OriginSource(origin, limits.origin_concurrency)
        if callable(sources):
            pick = sources

            def chooser(ref):
                return [*pick(ref), origin_source]
        else:
            chosen = [*sources, origin_source]

            def chooser(ref):
                return chosen
        if ram_dir is not None:
            copy = RamCopy(ram_dir)
            try:
                ram = copy.open(manifest)
            finally:
                copy.close()
        return ModelReader(
            manifest, cache, loop, origin, chooser, make, limits,
            files=files, names=names, include=include, deadline_s=deadline_s, metrics=metrics, order=order,
            ram=ram,
        )
    except BaseException:
        if ram is not None:
            ram.close()
        loop.call(origin.close(), 30)
        loop.stop()
        if cache is not None:
            cache.close()
        raise


class ModelReader:
    def __init__(self, manifest, cache, loop, origin, chooser, make, limits, *, files, names, include, deadline_s,
                 metrics, order=None, ram=None):
        self.manifest: Manifest = manifest
        self.digest: str = manifest.digest
        self.stats = FetchStats()
        self._cache = cache
        self._loop = loop
        self._origin = origin
        self._make = make
        self._deadline = None if deadline_s is None else time.monotonic() + deadline_s
        self._cond = threading.Condition()
        self._ready: deque[int] = deque()
        self._failed: dict[int, Exception] = {}
        self._fatal: BaseException | None = None
        self._finished = False
        self._closed = False
        self._iterated = False
        self._checked: dict[int, SafetensorsHeader] = {}
        self._maps: dict[int, object] = {}
        self._metrics = metrics
        self._opened = time.monotonic()
        self._select(files, names, include)
        self._ram = ram
        if ram is not None:
            self._from_ram(ram)
        if order is not None:
            self._plan = sorted(self._plan, key=order)  # stable: the reader's order within each rank
            self.plan = tuple(dict.fromkeys(self._plan))
            self._lead = 0
        self.model = cache.open(manifest)
        self._planner = Planner(
            self.model, chooser, limits=limits, stats=self.stats,
            on_present=self._on_present, on_failed=self._on_failed, metrics=metrics,
        )
        self._task: asyncio.Task | None = None
        self._run = loop.submit(self._drive())
        self._run.add_done_callback(self._on_finished)

    async def _drive(self) -> None:
        self._task = asyncio.current_task()
        await self._planner.run(self._plan, lead=self._lead)

    async def _halt(self) -> None:
        """Cancel the planner and wait until it has really stopped (no store still writing)."""
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001 - cancelled, or an error the reader already has
                pass

    # ---- what to fetch -------------------------------------------------------------

    def _select(self, files: Selector, names: Selector, include: Selector) -> None:
        m = self.manifest
        file_ok, name_ok, include_ok = _matcher(files, "files"), _matcher(names, "names"), _matcher(include, "include")
        for label, chosen, pool in (
            ("file", files, {f.path for f in m.files}),
            ("tensor", names, {t.name for _, t in m.tensors()}),
            ("file", include, {f.path for f in m.files}),
        ):
            if isinstance(chosen, (list, tuple, set, frozenset)):
                unknown = sorted(set(chosen) - pool)
                if unknown:
                    raise InvalidArgument(f"{label}s not in manifest {m.digest}: {', '.join(unknown[:5])}")
        # Items: tensors (yielded) and whole files (waited for with path()); each waits on chunks.
        self.tensors: list[tuple[int, TensorEntry]] = [
            (f, t) for f, t in m.tensors() if file_ok(m.files[f].path) and name_ok(t.name)
        ]
        # name -> its table entry: the safetensors dtype of a raw numpy view ("BF16"), its shape
        self.entries: dict[str, TensorEntry] = {t.name: t for _, t in self.tensors}
        self._whole: dict[str, int] = {}  # path -> item number
        items: list[tuple[int, int, int]] = []  # (file, start, end) per item; tensors first
        for f, t in self.tensors:
            start = m.files[f].header.data_start
            items.append((f, start + t.begin, start + t.end))
        for i, f in enumerate(m.files):
            if include is not None and include_ok(f.path):
                self._whole[f.path] = len(items)
                items.append((i, 0, f.size))
        self._missing = [0] * len(items)
        self._waiters: dict[tuple[int, int], list[int]] = {}
        plan: list[tuple[int, int]] = []

        def need(item: int, file: int, start: int, end: int) -> None:
            for c in m.files[file].chunks_covering(start, end, m.chunk_bytes):
                waiting = self._waiters.setdefault((file, c), [])
                if item not in waiting[-1:]:
                    waiting.append(item)
                    self._missing[item] += 1
                    plan.append((file, c))

        for path, item in self._whole.items():
            need(item, *items[item])
        self._lead = 0  # the chunks the first tensor needs, fetched before the rest (none: whole files first)
        for item, (f, t) in enumerate(self.tensors):
            need(item, f, 0, m.files[f].header.data_start)  # the header is checked before any tensor
            need(item, *items[item])
            if item == 0 and not self._whole:
                self._lead = len(dict.fromkeys(plan))
        self._plan = plan
        self.plan: tuple[tuple[int, int], ...] = tuple(dict.fromkeys(plan))  # (file, chunk), fetch order
        for item, n in enumerate(self._missing):
            if n == 0:
                self._ready.append(item)

    def _from_ram(self, ram) -> None:
        """Chunks of files resident in the node's RAM copy are present already: not planned."""
        resident = [item for item in self.plan if ram.has(item[0])]
        if not resident:
            return
        for item in resident:
            self._on_present(*item)
        self._lead = 0  # the plan no longer starts with the first tensor's chunks
        self._plan = [item for item in self._plan if not ram.has(item[0])]
        self.plan = tuple(dict.fromkeys(self._plan))
        nbytes = 0
        for f, c in resident:
            start, end = self.manifest.files[f].chunk_span(c, self.manifest.chunk_bytes)
            nbytes += end - start
        self.stats.planned += len(resident)
        self.stats.fetched["ram"] += len(resident)
        self.stats.fetched_bytes["ram"] += nbytes
        if self._metrics is not None:
            self._metrics.bytes.labels("ram").inc(nbytes)

    # ---- planner callbacks (loop thread) ------------------------------------------

    def _on_present(self, file: int, chunk: int) -> None:
        with self._cond:
            for item in self._waiters.pop((file, chunk), ()):
                self._missing[item] -= 1
                if self._missing[item] == 0 and item not in self._failed:
                    self._ready.append(item)
            self._cond.notify_all()

    def _on_failed(self, file: int, chunk: int, err: Exception) -> None:
        with self._cond:
            for item in self._waiters.pop((file, chunk), ()):
                self._failed.setdefault(item, err)
            self._cond.notify_all()

    def _on_finished(self, future) -> None:
        with self._cond:
            self._finished = True
            if not future.cancelled() and future.exception() is not None:
                self._fatal = future.exception()
            elif self._metrics is not None and not future.cancelled() and not self._failed:
                self._metrics.complete.observe(time.monotonic() - self._opened)
            self._cond.notify_all()

    # ---- consuming -----------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[str, object]]:
        """(name, tensor) for every selected tensor, each once, as it becomes complete."""
        if self._iterated:
            raise InvalidArgument("a model reader yields its tensors once: open the model again to read them again")
        self._iterated = True
        yielded = 0
        while yielded < len(self.tensors):
            item = self._next_ready(lambda i: i < len(self.tensors))
            f, t = self.tensors[item]
            tensor = self._tensor(f, t)
            if yielded == 0 and self._metrics is not None:
                self._metrics.first_tensor.observe(time.monotonic() - self._opened)
            yield t.name, tensor
            yielded += 1

    def path(self, file_path: str) -> Path:
        """The cache path of a file asked for with ``include``, once every byte of it is verified."""
        item = self._whole.get(file_path)
        if item is None:
            raise InvalidArgument(f"{file_path!r} was not asked for: open the model with include=[{file_path!r}]")
        self._wait(lambda: self._missing[item] == 0 or item in self._failed)
        if item in self._failed:
            raise self._failed[item]
        index = self.manifest.file_index(file_path)
        if self._ram is not None and self._ram.has(index):
            return self._ram.files[index]
        return self.model.path(index)

    def wait(self) -> FetchStats:
        """Block until every planned chunk is present or failed; raise the first failure."""
        self._wait(lambda: self._finished)
        if self._fatal is not None:
            raise self._fatal
        if self._failed:
            raise next(iter(self._failed.values()))
        return self.stats

    def _next_ready(self, wanted: Callable[[int], bool]) -> int:
        def ready() -> int | None:
            for i, item in enumerate(self._ready):
                if wanted(item):
                    del self._ready[i]
                    return item
            return None

        found: list[int] = []

        def check() -> bool:
            item = ready()
            if item is not None:
                found.append(item)
                return True
            return self._finished or self._fatal is not None

        self._wait(check)
        if found:
            return found[0]
        if self._fatal is not None:
            raise self._fatal
        failed = [e for i, e in self._failed.items() if wanted(i)]
        if failed:
            raise failed[0]
        raise StrataError("the fetch ended with tensors neither present nor failed")  # a bug, said plainly

    def _wait(self, predicate: Callable[[], bool]) -> None:
        with self._cond:
            while not predicate():
                if self._closed:
                    raise InvalidArgument("the model reader is closed")
                left = None if self._deadline is None else self._deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise DeadlineExceeded(
                        f"model {self.manifest.model} ({self.digest}) not loaded within its deadline: "
                        f"{self.model.verified_chunks()} of {self.manifest.total_chunks} chunks here"
                    )
                self._cond.wait(timeout=left if left is None or left < 1.0 else 1.0)

    def _tensor(self, file: int, t) -> object:
        self._check_header(file)
        start = self.manifest.files[file].header.data_start
        if t.nbytes == 0:
            return self._make(t, b"", 0)
        if self._ram is not None and self._ram.has(file):
            if file not in self._maps:
                self._maps[file] = self._ram.map(file)  # read-only, shared by every process on the node
            return self._make(t, self._maps[file], start + t.begin)
        if file in self._maps or self.model.file_complete(file):
            if file not in self._maps:
                self._maps[file], _ = self.model.map(file, 0, self.manifest.files[file].size)
            return self._make(t, self._maps[file], start + t.begin)
        mapping, offset = self.model.map(file, start + t.begin, start + t.end)
        return self._make(t, mapping, offset)

    def _check_header(self, file: int) -> None:
        if file in self._checked:
            return
        entry = self.manifest.files[file]
        where = f"{entry.path} (cached, manifest {self.digest})"
        read = self.model.read
        if self._ram is not None and self._ram.has(file):
            where = f"{entry.path} (RAM copy, manifest {self.digest})"
            read = self._read_ram
        first = read(file, 0, LENGTH_BYTES)
        n = header_length(first, entry.size, where)
        found = parse_header(read(file, LENGTH_BYTES, LENGTH_BYTES + n), entry.size, where)
        if found != entry.header:
            raise ManifestMismatch(
                f"{where}: the manifest's tensor table is not this file's header (the manifest was built from "
                "other bytes, or edited): publish the model again and open the new digest"
            )
        self._checked[file] = found

    def _read_ram(self, file: int, start: int, end: int) -> bytes:
        if file not in self._maps:
            self._maps[file] = self._ram.map(file)
        return bytes(self._maps[file][start:end])

    # ---- closing -------------------------------------------------------------------

    def close(self) -> None:
        """Stop fetching and release the model (its cache entry may be evicted once no one uses it).
        Tensors already yielded stay valid."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            settled = not self._waiters  # every chunk here or failed: only flushes may be left
            self._cond.notify_all()
        if settled:  # let them finish (durable and counted) instead of cancelling them
            with contextlib.suppress(Exception):  # its failures are already the reader's to report
                self._run.result(timeout=60)
        self._loop.call(self._halt(), 60)
        self._loop.call(self._origin.close(), 30)
        self._loop.stop()
        self.model.close()
        self._cache.close()
        if self._ram is not None:
            self._ram.close()

    def __enter__(self) -> ModelReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _matcher(selector: Selector, what: str) -> Callable[[str], bool]:
    if selector is None:
        return lambda name: True
    if callable(selector):
        return selector
    if isinstance(selector, str):
        return lambda name: fnmatch.fnmatchcase(name, selector)
    try:
        wanted = frozenset(selector)
    except TypeError:
        raise InvalidArgument(f"{what} must be a glob, names, or a predicate") from None
    return wanted.__contains__


def _disk_size(path: str | Path) -> int:
    import os

    Path(path).mkdir(parents=True, exist_ok=True)
    vfs = os.statvfs(path)
    return vfs.f_blocks * vfs.f_frsize


class _LoopThread:
    """An event loop on a daemon thread of its own: the planner and origin run there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="weights-fetch", daemon=True)
        self._thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro, timeout: float):
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)
        if not self.loop.is_running():
            self.loop.close()
