"""The arena under gRPC control, for asyncio: the twin of :mod:`kvstore.transport.grpc.arena`.

The same calls (Lookup, copy out, Release; Allocate, copy in, Commit), built
and parsed by the same functions (:mod:`kvstore.transport.grpc.blocks`), as
grpc.aio calls. Copies of more than ``off_loop.threshold`` bytes run in a
worker thread (:class:`kvstore.transport.off_loop.OffLoop`); each Commit is
in flight while the next group is copied. Read leases known good are
released without awaiting the answer; :meth:`close` waits for those still
on their way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
import grpc.aio

from kvstore.api.v1 import kv_pb2 as pb
from kvstore.api.v1 import kv_pb2_grpc
from kvstore.errors import ArenaReplaced, ArenaUnusable
from kvstore.shm.arena import ShmArena
from kvstore.transport.base import AsyncTransport, Block, BlockPut, Deadline, Place
from kvstore.transport.grpc import blocks as codec
from kvstore.transport.grpc.stream_aio import call_grpc_async
from kvstore.transport.off_loop import OffLoop

RELEASE_TIMEOUT_S = 5.0  # a Release or Abort nobody awaits: its lease or slots expire by themselves anyway


class AsyncGrpcArenaTransport(AsyncTransport):
    """``arena``, ``channel`` and ``fallback`` (for blocks not in the arena) stay the caller's."""

    name = "grpc-arena"
    shared_memory = True

    def __init__(self, channel: grpc.aio.Channel, arena: ShmArena, fallback: AsyncTransport, *, lease_ms: int = 0,
                 arena_name: str = "", off_loop: OffLoop | None = None) -> None:
        self._stub = kv_pb2_grpc.KVServiceStub(channel)
        self._arena = arena
        # Sent with Allocate and Lookup, with the token of the file mapped: offsets only ever of this arena, in
        # this file. A daemon that restarted with a new arena refuses the token: the client attaches again.
        self._arena_name = arena_name
        self._fallback = fallback
        self._in_place = True  # False once the daemon refused a slot in the arena: puts stream
        self._lease_ms = lease_ms
        self._off_loop = off_loop if off_loop is not None else OffLoop()
        self._releases: set[asyncio.Future] = set()  # releases not awaited by their caller

    async def close(self) -> None:
        if self._releases:  # let pending releases reach the daemon; failures expire by themselves
            await asyncio.wait(list(self._releases), timeout=RELEASE_TIMEOUT_S)

    async def _arena_call(self, method, request, deadline: Deadline):
        """Lookup or Allocate. A daemon that restarted with a new arena refuses the token of the file
        mapped: StaleAttachment, and the client's retry attaches again."""
        try:
            return await call_grpc_async(deadline, method, request)
        except ArenaReplaced as err:
            raise codec.replaced(err) from None

    # ---- writes --------------------------------------------------------------

    async def put(self, namespace: str, blocks: Sequence[BlockPut], deadline: Deadline) -> list[bool]:
        if not self._in_place:
            return await self._fallback.put(namespace, blocks, deadline)
        checked = codec.check_puts(namespace, blocks)
        results: list[bool] = []
        for group in codec.batches_by_bytes(checked, codec.arena_batch_bytes(self._arena)):
            try:
                results += await self._put_group(namespace, group, deadline)
            except ArenaUnusable:  # the daemon's slots are in its gpu tier (kvstore.transport.samehost.regions)
                self._in_place = False
                results += await self._fallback.put(namespace, [item for item, _, _ in group], deadline)
        return results

    async def _put_group(self, namespace: str, checked, deadline: Deadline) -> list[bool]:
        request = codec.allocate_request(namespace, checked, self._lease_ms, self._arena_name, self._arena.token)
        alloc = await self._arena_call(self._stub.Allocate, request, deadline)
        received = codec.now_ms()
        commits: list[asyncio.Future] = []
        try:
            for group in codec.slot_groups(checked, alloc):
                nbytes = sum(slot.size for _, slot in group)
                request = await self._off_loop(nbytes, codec.copy_into_slots, self._arena, alloc, received, group)
                commits.append(asyncio.ensure_future(call_grpc_async(deadline, self._stub.Commit, request)))
            done = await asyncio.gather(*commits)
        except BaseException:
            for task in commits:
                task.cancel()
            try:  # committed slots are skipped; the rest are given back
                await self._stub.Abort(pb.AbortRequest(slot_ids=codec.slot_ids(alloc)), timeout=RELEASE_TIMEOUT_S)
            except grpc.RpcError:
                pass  # the slots expire by themselves
            raise
        return codec.put_results(alloc, done)

    # ---- reads ---------------------------------------------------------------

    async def get_into(self, namespace: str, keys: Sequence[bytes], place: Place | None, deadline: Deadline,
                       ) -> list[Block | None]:
        keys = list(keys)
        if not keys:
            return []
        request = pb.LookupRequest(namespace=namespace, keys=keys, lease_ms=self._lease_ms, arena=self._arena_name,
                                   arena_token=self._arena.token)
        response = await self._arena_call(self._stub.Lookup, request, deadline)
        received = codec.now_ms()
        try:
            placed = None if place is None else codec.place_lookup(response, place)  # on the loop
            read = await self._off_loop(codec.leased_bytes(response), codec.read_lookup, self._arena, response, placed)
        except BaseException:  # a placement refused, or cancelled: give the read leases back now
            self._release_later(pb.ReleaseRequest(lease_ids=codec.lookup_lease_ids(response)))
            raise
        if read.leased:
            release = pb.ReleaseRequest(lease_ids=read.lease_ids())
            if codec.lease_held(response.lease_deadline_unix_ms, received):
                self._release_later(release)
            else:
                released = await call_grpc_async(deadline, self._stub.Release, release)
                codec.drop_expired(read, released.valid)
        if read.refetch:
            again = codec.refetch_placement(place, placed)
            refetch = read.refetch

            def at(j: int, info) -> memoryview | None:
                return again(refetch[j], info)

            got = await self._fallback.get_into(namespace, [keys[i] for i in refetch], at if again else None, deadline)
            for i, block in zip(refetch, got):
                read.blocks[i] = block
        return read.blocks

    def _release_later(self, request: pb.ReleaseRequest) -> None:
        """Release read leases without awaiting the answer (the reads are already known good)."""
        task = asyncio.ensure_future(self._stub.Release(request, timeout=RELEASE_TIMEOUT_S))
        self._releases.add(task)
        task.add_done_callback(_forget_release)
        task.add_done_callback(self._releases.discard)


def _forget_release(task: asyncio.Future) -> None:
    # A failed release is harmless (the lease expires); retrieve the error so
    # asyncio does not report it as never retrieved.
    if not task.cancelled():
        task.exception()
