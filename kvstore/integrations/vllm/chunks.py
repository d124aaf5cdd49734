"""vLLM's chunks on a Strata daemon: the one module of the tier that calls the client.

Runs on the tier's worker and lookup threads only. Each chunk is one block:
its bytes are one row of the primary tier's CPU buffer (``primary_kv_view``,
padding included), handed to the client as a ``memoryview`` slice of that
buffer (never a copy: ``bytes()`` of a row would add a copy of every
chunk), which the client copies straight into the daemon's shared arena
on a store and straight out of it into the row on a load: one copy each way
on the daemon's host, gRPC streaming elsewhere. The buffer is host memory
(vLLM's GPU workers fill and drain it; see the package docstring), so
there is no device tensor to hand over. A load takes a block only when its
size and layout tag are this engine's; otherwise the row is left untouched
and the chunk fails.

Failures are answers, counted by reason (:mod:`.metrics`): the daemon down
or stuck (``DaemonUnavailable``, ``DeadlineExceeded``) starts the back-off
of :class:`~kvstore.integrations.health.DaemonHealth`, during which no call
is made; a full daemon drops a store; anything else the daemon refuses
fails the batch it was refused for and is logged. Work is split into calls
of ``chunks_per_call`` chunks, so a daemon that dies mid-job leaves the
chunks of the calls that finished loaded (vLLM keeps those) and fails the
rest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import OffloadKey

from kvstore.client import BlockInfo, BlockPut, Client
from kvstore.errors import (
    DaemonUnavailable,
    ResourceExhausted,
    StrataError,
    UnknownNamespace,
)
from kvstore.integrations.health import DAEMON_DOWN, MAX_KEYS_PER_CALL, DaemonHealth
from kvstore.integrations.vllm.mapping import KVLayout, block_key
from kvstore.integrations.vllm.metrics import TierMetrics
from kvstore.integrations.vllm.settings import StrataTierSettings

log = logging.getLogger(__name__)



@dataclass
class Outcome:
    """What one store or load did: per chunk index into the job's keys."""

    done: list[int] = field(default_factory=list)
    failed: dict[str, list[int]] = field(default_factory=dict)  # reason -> indices
    nbytes: int = 0
    seconds: float = 0.0

    def fail(self, reason: str, indices: Sequence[int]) -> None:
        if indices:
            self.failed.setdefault(reason, []).extend(indices)

    @property
    def complete(self) -> bool:
        return not self.failed


class ChunkStore:
    """Presence, stores and loads of chunks; see the module docstring."""

    def __init__(self, settings: StrataTierSettings, layout: KVLayout, rows: memoryview, health: DaemonHealth,
                 metrics: TierMetrics, client_factory=Client) -> None:
        self.settings = settings
        self.layout = layout
        self._rows = rows  # the primary tier's buffer, flat bytes
        self._row = layout.row_bytes
        self._health = health
        self._metrics = metrics
        self._factory = client_factory
        self._client: Client | None = None
        self._lock = threading.Lock()
        self._closed = False

    def client(self) -> Client:
        """The tier's client, made on first use (constructing the tier touches no network)."""
        with self._lock:
            if self._closed:
                raise DaemonUnavailable("the Strata tier is shut down")
            if self._client is None:
                self._client = self._factory(self.settings.target, **self.settings.client_options())
            return self._client

    def close(self) -> None:
        """Close the client and let go of the primary tier's buffer (vLLM unmaps it next)."""
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()
        try:
            self._rows.release()
        except BufferError:  # a row view still referenced somewhere: vLLM then keeps the mapping
            log.warning("a view of the primary KV buffer is still in use at shutdown")

    def usable(self) -> bool:
        return not self._closed and self._health.usable()

    def _down(self, err: StrataError) -> None:
        self._health.failed(err, self.settings.target)

    def _row_view(self, chunk_id: int) -> memoryview:
        start = chunk_id * self._row
        return self._rows[start:start + self._row]

    # ---- presence (the lookup thread) -------------------------------------------

    def present(self, keys: Sequence[OffloadKey]) -> tuple[list[bool], list[int]]:
        """Which chunks the daemon holds, each found one pinned for ``lookup_hold_s``: (per key, pin lease ids).

        A pin is the daemon's per-key presence answer (``Exists`` answers for a
        prefix chain only, and vLLM's sliding-window groups look chunks up
        from the end), and it keeps a hit in the daemon until its load runs.
        """
        found = [False] * len(keys)
        leases: list[int] = []
        if not self.usable():
            self._metrics.lookup("down", None)
            return found, leases
        started = time.perf_counter()
        result = "ok"
        for namespace, indices, hashes in self._by_namespace(keys):
            for start in range(0, len(indices), MAX_KEYS_PER_CALL):
                part, part_hashes = indices[start:start + MAX_KEYS_PER_CALL], hashes[start:start + MAX_KEYS_PER_CALL]
                try:
                    lease = self.client().pin(namespace, part_hashes, lease_s=self.settings.lookup_hold_s)
                except UnknownNamespace:
                    break  # nothing stored in this layout and group yet: misses
                except DAEMON_DOWN as err:
                    self._down(err)
                    self._metrics.lookup("down", None)
                    return [False] * len(keys), leases
                except StrataError as err:
                    log.warning("Strata lookup of %d chunks in %s refused (%s): misses", len(part), namespace, err)
                    result = "error"
                    continue
                if lease.pinned:  # a lease holding nothing just expires
                    leases.append(lease.lease_id)
                missing = set(lease.missing)
                for i, h in zip(part, part_hashes):
                    found[i] = h not in missing
        self._health.ok(self.settings.target)
        self._metrics.lookup(result, time.perf_counter() - started)
        return found, leases

    def unpin(self, lease_ids: Sequence[int]) -> None:
        """Give the pins of a finished request back (they expire by themselves otherwise)."""
        if not lease_ids or not self.usable():
            return
        client = self.client()
        for lease_id in lease_ids:
            try:
                client.unpin(lease_id)
            except DAEMON_DOWN as err:
                self._down(err)
                return
            except StrataError:
                continue  # expired already, or the daemon restarted: nothing held

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Recency for chunks vLLM used from its own memory (same-host daemons only; a hint)."""
        if not keys or not self.usable():
            return
        for namespace, _, hashes in self._by_namespace(keys):
            try:
                self.client().touch(namespace, hashes)
            except DAEMON_DOWN as err:
                self._down(err)
                return
            except StrataError:
                continue  # a hint only

    # ---- hints (the worker threads) -------------------------------------------

    def place(self, keys: Sequence[OffloadKey], where: str) -> tuple[int, int]:
        """Move the chunks the daemon holds into host RAM (``"ram"``) or out of it (``"below"``): (moved, missing).
        Raises StrataError when the daemon refuses (e.g. no tier below RAM), DaemonUnavailable when it is down."""
        def move(namespace: str, hashes: list[bytes]) -> tuple[int, int]:
            placed = self.client().place(namespace, hashes, where)
            return placed.placed, len(placed.missing)

        return self._per_call(keys, move)

    def hold(self, keys: Sequence[OffloadKey], lease_s: float, replicas: int = 0) -> tuple[int, int]:
        """Pin the chunks the daemon holds for ``lease_s`` (with ``replicas`` copies on other nodes): (held, missing).
        The pins are not given back: they end with their lease."""
        def pin(namespace: str, hashes: list[bytes]) -> tuple[int, int]:
            lease = self.client().pin(namespace, hashes, lease_s=lease_s, replicas=replicas)
            return lease.pinned, len(lease.missing)

        return self._per_call(keys, pin)

    def _per_call(self, keys: Sequence[OffloadKey], call) -> tuple[int, int]:
        done = missing = 0
        for namespace, indices, hashes in self._by_namespace(keys):
            for _, part_hashes in self._calls(indices, hashes):
                if not self.usable():
                    raise DaemonUnavailable("the Strata daemon is backing off")
                try:
                    d, m = call(namespace, part_hashes)
                except UnknownNamespace:
                    d, m = 0, len(part_hashes)
                except DAEMON_DOWN as err:
                    self._down(err)
                    raise
                done, missing = done + d, missing + m
        self._health.ok(self.settings.target)
        return done, missing

    # ---- transfers (the worker threads) -------------------------------------------

    def store(self, keys: Sequence[OffloadKey], chunk_ids: Sequence[int]) -> Outcome:
        """Copy the chunks' rows into the daemon, ``chunks_per_call`` per call."""
        out = Outcome()
        started = time.perf_counter()
        for namespace, indices, hashes in self._by_namespace(keys):
            for part, part_hashes in self._calls(indices, hashes):
                if not self.usable():
                    out.fail("down", part)
                    continue
                items = [BlockPut(h, self._row_view(chunk_ids[i]), None, self.layout.tag) for i, h in zip(part, part_hashes)]
                try:
                    self.client().put_many(namespace, items)
                except DAEMON_DOWN as err:
                    self._down(err)
                    out.fail("down", part)
                    continue
                except ResourceExhausted as err:
                    log.info("Strata daemon declined %d chunks (%s): dropped", len(part), err)
                    out.fail("full", part)
                    continue
                except StrataError as err:
                    log.warning("Strata store of %d chunks in %s refused (%s): dropped", len(part), namespace, err)
                    out.fail("error", part)
                    continue
                self._health.ok(self.settings.target)
                out.done += part
                out.nbytes += len(part) * self._row
        out.seconds = time.perf_counter() - started
        for reason, indices in out.failed.items():
            self._metrics.dropped(reason, len(indices))
        return out

    def load(self, keys: Sequence[OffloadKey], chunk_ids: Sequence[int]) -> Outcome:
        """Copy the chunks from the daemon into their rows; a chunk not delivered leaves its
        row's bytes unspecified and is reported failed, so vLLM never reads it."""
        out = Outcome()
        started = time.perf_counter()
        tag, size = self.layout.tag, self._row
        for namespace, indices, hashes in self._by_namespace(keys):
            for part, part_hashes in self._calls(indices, hashes):
                if not self.usable():
                    out.fail("down", part)
                    continue
                foreign: set[int] = set()

                def place(j: int, info: BlockInfo, part=part, foreign=foreign):
                    if info.size != size or info.layout != tag:
                        foreign.add(j)
                        return None
                    return self._row_view(chunk_ids[part[j]])

                try:
                    blocks = self.client().get_into(namespace, part_hashes, place)
                except UnknownNamespace:
                    out.fail("missing", part)
                    continue
                except DAEMON_DOWN as err:
                    self._down(err)
                    out.fail("down", part)
                    continue
                except StrataError as err:
                    log.warning("Strata load of %d chunks from %s failed (%s)", len(part), namespace, err)
                    out.fail("error", part)
                    continue
                self._health.ok(self.settings.target)
                for j, block in enumerate(blocks):
                    if block is not None:
                        out.done.append(part[j])
                        out.nbytes += size
                    else:
                        out.fail("layout" if j in foreign else "missing", [part[j]])
        out.seconds = time.perf_counter() - started
        for reason, indices in out.failed.items():
            self._metrics.failed_load(reason, len(indices))
        if "layout" in out.failed:
            log.warning("Strata held %d chunks under this engine's keys written with another layout; not loaded",
                        len(out.failed["layout"]))
        return out

    # ---- grouping -------------------------------------------------------------

    def _by_namespace(self, keys: Sequence[OffloadKey]) -> list[tuple[str, list[int], list[bytes]]]:
        """Per KV cache group: its namespace, the indices of its keys, their block keys."""
        groups: dict[int, tuple[list[int], list[bytes]]] = {}
        for i, key in enumerate(keys):
            group, h = block_key(key)
            indices, hashes = groups.setdefault(group, ([], []))
            indices.append(i)
            hashes.append(h)
        return [(self.layout.namespace(g), indices, hashes) for g, (indices, hashes) in groups.items()]

    def _calls(self, indices: list[int], hashes: list[bytes]):
        n = self.settings.chunks_per_call
        for start in range(0, len(indices), n):
            yield indices[start:start + n], hashes[start:start + n]
