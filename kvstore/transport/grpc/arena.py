"""Arena transport under gRPC control: bytes through the shared arena, control as gRPC calls.

What a same-host client uses when the daemon offers no same-host socket
(or from a language with only gRPC): Lookup, copy out, Release; Allocate,
copy in, Commit. Each control message costs a gRPC round trip (0.5-0.8 ms
in Python here), which :mod:`kvstore.transport.samehost.client` avoids.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

import grpc

from kvstore.api.v1 import kv_pb2 as pb
from kvstore.api.v1 import kv_pb2_grpc
from kvstore.errors import ArenaReplaced, ArenaUnusable
from kvstore.shm.arena import ShmArena
from kvstore.transport.grpc import blocks as codec
from kvstore.transport.base import Block, BlockPut, Deadline, Place, Transport
from kvstore.transport.grpc.stream import call_grpc, wait_grpc

MAX_PENDING_RELEASES = 64


class GrpcArenaTransport(Transport):
    """``arena``, ``channel`` and ``fallback`` (for blocks not in the arena) stay the caller's."""

    name = "grpc-arena"
    shared_memory = True

    def __init__(self, channel: grpc.Channel, arena: ShmArena, fallback: Transport, *, lease_ms: int = 0,
                 arena_name: str = "") -> None:
        self._stub = kv_pb2_grpc.KVServiceStub(channel)
        self._arena = arena
        # Sent with Allocate and Lookup, with the token of the file mapped: offsets only ever of this arena, in
        # this file. A daemon that restarted with a new arena refuses the token: the client attaches again.
        self._arena_name = arena_name
        self._fallback = fallback
        self._in_place = True  # False once the daemon refused a slot in the arena: puts stream
        self._lease_ms = lease_ms
        self._releases: collections.deque[grpc.Future] = collections.deque()
        self._releases_lock = threading.Lock()

    def close(self) -> None:
        with self._releases_lock:
            pending, self._releases = list(self._releases), collections.deque()
        for future in pending:  # let pending releases reach the daemon
            try:
                future.result(timeout=5)
            except (grpc.RpcError, grpc.FutureTimeoutError):
                pass  # the leases expire by themselves

    # ---- writes --------------------------------------------------------------

    def put(self, namespace: str, blocks: Sequence[BlockPut], deadline: Deadline) -> list[bool]:
        if not self._in_place:
            return self._fallback.put(namespace, blocks, deadline)
        checked = codec.check_puts(namespace, blocks)
        results: list[bool] = []
        for group in codec.batches_by_bytes(checked, codec.arena_batch_bytes(self._arena)):
            try:
                results += self._put_group(namespace, group, deadline)
            except ArenaUnusable:  # the daemon's slots are in its gpu tier (kvstore.transport.samehost.regions)
                self._in_place = False
                results += self._fallback.put(namespace, [item for item, _, _ in group], deadline)
        return results

    def _put_group(self, namespace: str, checked, deadline: Deadline) -> list[bool]:
        request = codec.allocate_request(namespace, checked, self._lease_ms, self._arena_name, self._arena.token)
        try:
            alloc = call_grpc(deadline, self._stub.Allocate, request)
        except ArenaReplaced as err:
            raise codec.replaced(err) from None
        received = codec.now_ms()
        in_flight: list[grpc.Future] = []
        try:
            for group in codec.slot_groups(checked, alloc):
                deadline.check()
                request = codec.copy_into_slots(self._arena, alloc, received, group)
                in_flight.append(self._stub.Commit.future(request, timeout=deadline.remaining()))
            done = [wait_grpc(deadline, future) for future in in_flight]
        except BaseException:
            for future in in_flight:
                future.cancel()
            try:  # committed slots are skipped; the rest are given back
                self._stub.Abort(pb.AbortRequest(slot_ids=codec.slot_ids(alloc)), timeout=5)
            except grpc.RpcError:
                pass  # the slots expire by themselves
            raise
        return codec.put_results(alloc, done)

    # ---- reads ---------------------------------------------------------------

    def get_into(self, namespace: str, keys: Sequence[bytes], place: Place | None, deadline: Deadline,
                 ) -> list[Block | None]:
        keys = list(keys)
        if not keys:
            return []
        request = pb.LookupRequest(namespace=namespace, keys=keys, lease_ms=self._lease_ms, arena=self._arena_name,
                                   arena_token=self._arena.token)
        try:
            response = call_grpc(deadline, self._stub.Lookup, request)
        except ArenaReplaced as err:
            raise codec.replaced(err) from None
        received = codec.now_ms()
        try:
            placed = None if place is None else codec.place_lookup(response, place)
            read = codec.read_lookup(self._arena, response, placed)
        except BaseException:  # a placement refused: give the read leases back now
            self._release_later(pb.ReleaseRequest(lease_ids=codec.lookup_lease_ids(response)))
            raise
        if read.leased:
            release = pb.ReleaseRequest(lease_ids=read.lease_ids())
            if codec.lease_held(response.lease_deadline_unix_ms, received):
                self._release_later(release)
            else:
                codec.drop_expired(read, call_grpc(deadline, self._stub.Release, release).valid)
        if read.refetch:
            again = codec.refetch_placement(place, placed)
            refetch = read.refetch

            def at(j, info):
                return again(refetch[j], info)

            got = self._fallback.get_into(namespace, [keys[i] for i in refetch], at if again else None, deadline)
            for i, block in zip(refetch, got):
                read.blocks[i] = block
        return read.blocks

    def _release_later(self, request: pb.ReleaseRequest) -> None:
        """Release read leases without waiting for the answer (the reads are already known good)."""
        oldest = None
        with self._releases_lock:
            while self._releases and self._releases[0].done():
                self._releases.popleft()
            if len(self._releases) >= MAX_PENDING_RELEASES:
                oldest = self._releases.popleft()
            self._releases.append(self._stub.Release.future(request, timeout=5))
        if oldest is not None:  # a bound on releases in flight
            try:
                oldest.result(timeout=5)
            except (grpc.RpcError, grpc.FutureTimeoutError):
                pass  # that lease expires by itself
