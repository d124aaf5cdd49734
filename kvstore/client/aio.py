"""asyncio client of a Strata daemon: the twin of :class:`kvstore.client.sync.Client`.

Same arguments, same methods, same results; each call is a coroutine. On
the daemon's host, block bytes go through the arena with control over the
daemon's same-host socket (:mod:`kvstore.transport.samehost.client_aio`); without
that socket, control goes as gRPC calls; elsewhere, bytes are streamed. All
request building, parsing, arena copies and the retry policy come from
:mod:`kvstore.client.codec`, so only the loops over them live here.

Copies and checksums of more than ``OFF_LOOP_BYTES`` run in a worker thread
(``asyncio.to_thread``): a 64 MiB memcpy would otherwise stall every other
task on the loop for tens of milliseconds. Smaller ones run inline, where a
thread hop would cost more than the copy.

One call does not go through grpc.aio: a streamed Put (no shared memory)
runs as a future of a blocking channel, which the loop awaits while gRPC's
own thread feeds the stream, because grpc.aio can report such a call's
refusal as INTERNAL instead of the server's status (see
``AsyncClient._put_stream``).

As in the blocking client, the path is picked per arena: a namespace's
first block call attaches its arena (once per arena, not per namespace);
an arena the client may not map is streamed. A same-host connection the
daemon closed is opened again on the next call; when the daemon refuses the
token it gave (it restarted since), the client drops that arena and attaches
again, once per call, as the blocking client does (``codec.Retries``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import grpc.aio

from kvstore.api.v1 import kv_pb2 as pb
from kvstore.api.v1 import kv_pb2_grpc
from kvstore.auth.credentials import ChannelSecurity
from kvstore.block import TierName
from kvstore.client import codec, tensors
from kvstore.client.codec import Block, BlockPut, Listed, ListPage, PinLease, Stats
from kvstore.errors import ArenaReplaced, ArenaUnusable, DaemonUnavailable, StaleAttachment, StrataError
from kvstore.shm.arena import ShmArena
from kvstore.transport.samehost.client_aio import AsyncSameHostTransport

log = logging.getLogger(__name__)

OFF_LOOP_BYTES = 1 << 20
MAX_KNOWN_NAMESPACES = 4096  # namespace → arena memo; beyond it, starts over
# Streamed Puts in flight per client; each holds a gRPC thread feeding it.
MAX_PUT_STREAMS = 8

T = TypeVar("T")


@dataclass(slots=True)
class _Attached:
    """One arena this client maps, and its same-host socket when the daemon offers one."""

    name: str
    arena: ShmArena
    same_host: AsyncSameHostTransport | None = None
    # False when the daemon's slots are in its gpu tier, which this client does not map
    # (kvstore.transport.samehost.regions): its puts stream
    in_place: bool = True


class AsyncClient:
    """A connection to one daemon, bound to the event loop it was created on.

    Create it inside a running loop (``async with AsyncClient(...) as c:``);
    its calls may run concurrently as tasks of that loop. ``use_shm`` and the
    credentials (``token``, ``token_file``, ``tls_*``, ``security``) are as
    for :class:`kvstore.client.sync.Client`.
    """

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        timeout: float = codec.DEFAULT_TIMEOUT_S,
        retries: int = 3,
        use_shm: bool | None = None,
        lease_ms: int = 0,
        chunk_bytes: int = codec.DEFAULT_CHUNK,
        token: str | None = None,
        token_file: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
        security: ChannelSecurity | None = None,
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.retries = retries
        self._use_shm = use_shm
        self._lease_ms = lease_ms
        self._chunk = chunk_bytes
        if security is None:
            security = ChannelSecurity.build(token=token, token_file=token_file, tls_ca=tls_ca, tls_cert=tls_cert,
                                             tls_key=tls_key, tls_server_name=tls_server_name)
        self._security = security
        self._channel = security.aio_channel(target, codec.CHANNEL_OPTIONS)
        self._stub = kv_pb2_grpc.KVServiceStub(self._channel)
        self._attached: dict[str, _Attached | None] = {}  # arena name → mapped, or None: streamed
        self._arena_of: dict[str, str] = {}  # namespace → arena name
        self._attach_lock = asyncio.Lock()  # one Attach per arena, however many first calls race
        self._copies: set[asyncio.Future] = set()  # threads holding arena views
        self._releases: set[asyncio.Future] = set()  # lease releases not awaited by their caller
        self._put_streams = asyncio.Semaphore(MAX_PUT_STREAMS)
        self._put_channel: grpc.Channel | None = None
        self._put_stub: kv_pb2_grpc.KVServiceStub | None = None
        self._retired: list[ShmArena] = []  # arenas of a previous daemon run, unmapped once no copy uses them

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel and unmap the arena, after copies still running in threads end."""
        if self._copies:
            await asyncio.wait(list(self._copies))
        if self._releases:  # let pending releases reach the daemon; failures expire by themselves
            await asyncio.wait(list(self._releases), timeout=self.timeout)
        attached, self._attached, self._arena_of = self._attached, {}, {}
        for one in attached.values():
            if one is not None and one.same_host is not None:
                await one.same_host.close()
        for one in attached.values():
            if one is not None:
                one.arena.close()
        for arena in self._retired:
            arena.close()
        if self._put_channel is not None:
            self._put_channel.close()
        await self._channel.close()

    # ---- calls ---------------------------------------------------------------

    async def _retrying(self, method: str, attempt_once: Callable[[], Any]):
        tries = codec.Retries(method, self.retries)
        while True:
            try:
                return await attempt_once()
            except (grpc.RpcError, StrataError) as failed:  # the same-host transport raises Strata errors already
                err, delay = tries.after(failed)
            if delay is None:
                raise err
            if delay == codec.REATTACH:  # the daemon restarted; _attached_for dropped the stale arena
                continue
            await asyncio.sleep(delay)

    async def _call(self, method: str, request):
        fn = getattr(self._stub, method)
        return await self._retrying(method, lambda: fn(request, timeout=self.timeout))

    async def _arena_call(self, attached: _Attached, method: str, request):
        """Lookup or Allocate of the arena under gRPC control. A daemon that restarted with a new arena
        refuses the token this client mapped: the arena is dropped, and the retry attaches again."""
        try:
            return await self._call(method, request)
        except ArenaReplaced as err:
            self._drop(attached.name)
            raise codec.replaced(err) from None

    async def _off_loop(self, nbytes: int, fn: Callable[..., T], *args) -> T:
        """Run ``fn(*args)`` inline when it moves few bytes, else in a worker thread.

        A thread cannot be stopped mid-copy, so when the awaiting task is
        cancelled this waits for the copy to end before letting the
        cancellation through: the caller then gives back slots and leases
        only once nothing writes into or reads from them any more.
        """
        if nbytes <= OFF_LOOP_BYTES:
            return fn(*args)
        copy = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        self._copies.add(copy)
        copy.add_done_callback(self._copies.discard)
        try:
            return await asyncio.shield(copy)
        except asyncio.CancelledError:
            while not copy.done():
                try:
                    await asyncio.wait([copy])
                except asyncio.CancelledError:
                    continue  # the copy ends within milliseconds
            raise

    async def uses_shared_memory(self, namespace: str = "") -> bool:
        """Whether block bytes of ``namespace`` (default: the default arena's) move through shared memory."""
        return await self._retrying("Attach", lambda: self._attached_for(namespace)) is not None

    async def transport_name(self, namespace: str = "") -> str:
        """The transport block bytes of ``namespace``'s arena take: "same-host", "grpc-arena" or "grpc"."""
        attached = await self._retrying("Attach", lambda: self._attached_for(namespace))
        if attached is None:
            return "grpc"
        return "grpc-arena" if attached.same_host is None else attached.same_host.name

    async def _attached_for(self, namespace: str) -> _Attached | None:
        """The mapped arena of ``namespace``, attaching it on first use; None: stream its bytes.

        Raises :class:`StaleAttachment` when the daemon restarted since it
        attached: the arena is dropped, and the next call attaches again.
        """
        if self._use_shm is False:
            return None
        name = self._arena_of.get(namespace)
        if name is not None and not _broken(self._attached[name]):
            return self._attached[name]
        async with self._attach_lock:
            name = self._arena_of.get(namespace)
            if name is not None:
                attached = self._attached[name]
                if _broken(attached):
                    await self._reconnect(attached)
                return attached
            attach = await self._call("Attach", pb.AttachRequest(namespace=namespace))
            if attach.arena_name not in self._attached:
                self._attached[attach.arena_name] = await self._map(attach)
            if len(self._arena_of) >= MAX_KNOWN_NAMESPACES:
                self._arena_of.clear()
            self._arena_of[namespace] = attach.arena_name
            return self._attached[attach.arena_name]

    async def _reconnect(self, attached: _Attached) -> None:
        """A new same-host connection for a closed one; the arena dropped when its token is refused."""
        try:
            attached.same_host = await attached.same_host.reopen()
        except StaleAttachment:
            self._drop(attached.name)
            raise

    def _drop(self, name: str) -> None:
        """Forget one attached arena: its namespaces attach again on their next call."""
        attached = self._attached.pop(name, None)
        self._arena_of = {ns: arena for ns, arena in self._arena_of.items() if arena != name}
        if attached is not None:
            self._retired.append(attached.arena)
        if not self._copies:  # no worker thread holds a view of an arena
            kept = []
            for arena in self._retired:
                try:
                    arena.close()
                except BufferError:  # a call of this loop still reads it: at close()
                    kept.append(arena)
            self._retired = kept

    async def _map(self, attach: pb.AttachResponse) -> _Attached | None:
        try:
            attached = _Attached(attach.arena_name, codec.open_arena(attach))
        except ArenaUnusable:
            if self._use_shm:
                raise
            return None
        if attach.control_socket:
            try:
                attached.same_host = await AsyncSameHostTransport.connect(
                    attached.arena, attach.control_socket, attach.arena_token, lease_ms=self._lease_ms,
                    off_loop=self._off_loop, off_loop_bytes=OFF_LOOP_BYTES,
                    fallback=lambda ns, keys, place: self._get_streamed(ns, keys, place),
                )
            except DaemonUnavailable as err:
                log.info("same-host socket unusable, control goes over gRPC: %s", err)
            else:
                attached.in_place = attached.same_host.writes_in_place
        return attached

    # ---- data ----------------------------------------------------------------

    async def put(self, namespace: str, key: bytes, value, *, parent: bytes | None = None, layout: str = "") -> bool:
        """Store one block; False when the key was already stored."""
        return (await self.put_many(namespace, [BlockPut(key, value, parent, layout)]))[0]

    async def put_many(self, namespace: str, items: Sequence[BlockPut]) -> list[bool]:
        """Store blocks in one batch; per block, whether it was newly stored. A value may be a torch
        tensor (see :mod:`kvstore.client.tensors`)."""
        checked = codec.check_puts(namespace, await tensors.host_puts_async(items))
        if not checked:
            return []
        return await self._retrying("Put", lambda: self._put_once(namespace, checked))

    async def _put_once(self, namespace: str, checked) -> list[bool]:
        attached = await self._attached_for(namespace)
        if attached is None or not attached.in_place:
            async with self._put_streams:
                return codec.stream_put_results(checked, await self._put_stream(namespace, checked))
        if attached.same_host is not None:
            return await attached.same_host.put(namespace, [item for item, _, _ in checked], self.timeout)
        results: list[bool] = []
        for group in codec.batches_by_bytes(checked, codec.arena_batch_bytes(attached.arena)):
            try:
                results += await self._put_shm(attached, namespace, group)
            except ArenaUnusable:  # the daemon's slots are in its gpu tier: stream from now on
                attached.in_place = False
                async with self._put_streams:
                    results += codec.stream_put_results(group, await self._put_stream(namespace, group))
        return results

    async def _put_shm(self, attached: _Attached, namespace: str, checked) -> list[bool]:
        arena = attached.arena
        request = codec.allocate_request(namespace, checked, self._lease_ms, attached.name, arena.token)
        alloc = await self._arena_call(attached, "Allocate", request)
        received = codec.now_ms()
        commits: list[asyncio.Task] = []
        try:
            for group in codec.slot_groups(checked, alloc):
                nbytes = sum(slot.size for _, slot in group)
                request = await self._off_loop(nbytes, codec.copy_into_slots, arena, alloc, received, group)
                commits.append(asyncio.ensure_future(self._call("Commit", request)))
            done = await asyncio.gather(*commits)
        except BaseException:
            for task in commits:
                task.cancel()
            try:  # committed slots are skipped; the rest are given back
                await self._call("Abort", pb.AbortRequest(slot_ids=codec.slot_ids(alloc)))
            except StrataError:
                pass  # the slots expire by themselves
            raise
        return codec.put_results(alloc, done)

    async def _put_stream(self, namespace: str, checked) -> pb.PutResponse:
        """One streamed Put, driven by the blocking stub's future.

        grpc.aio loses the server's status when the server ends a
        client-streaming call while the client still writes (a block over the
        limit, a full tier): a write that fails after the status arrived
        overwrites it with INTERNAL "Internal error from Core" (grpc/grpc
        #36066). The blocking stack reports the server's status, and its
        request thread also keeps the checksums and chunk copies off the loop.
        """
        if self._put_stub is None:
            self._put_channel = self._security.channel(self.target, codec.CHANNEL_OPTIONS)
            self._put_stub = kv_pb2_grpc.KVServiceStub(self._put_channel)
        call = self._put_stub.Put.future(codec.put_requests(namespace, checked, self._chunk), timeout=self.timeout)
        loop = asyncio.get_running_loop()
        ended = loop.create_future()

        def on_end(_) -> None:  # on a gRPC thread, or here when already ended
            try:
                loop.call_soon_threadsafe(lambda: ended.done() or ended.set_result(None))
            except RuntimeError:
                pass  # the loop is closed: nobody waits any more

        call.add_done_callback(on_end)
        try:
            await ended
        except asyncio.CancelledError:
            call.cancel()
            raise
        return call.result()  # raises the call, a grpc.RpcError, when it failed

    async def get(self, namespace: str, key: bytes) -> bytes | bytearray | None:
        """The block's bytes, or None on a miss."""
        block = (await self.get_many(namespace, [key]))[0]
        return None if block is None else block.data

    async def get_many(self, namespace: str, keys: Sequence[bytes], *, local_only: bool = False) -> list[Block | None]:
        """Blocks in one batch, in order; None for each miss. Every block is checksum-verified.

        ``local_only``: the daemon answers from its own tiers only, never reading through to
        its peers (what a peer fetch asks); the bytes are then always streamed."""
        return await self._get(namespace, keys, None, local_only)

    async def get_into(
        self, namespace: str, keys: Sequence[bytes], buffers: Sequence | codec.Placement, *, local_only: bool = False
    ) -> list[Block | None]:
        """Read blocks straight into caller-owned memory; see :meth:`kvstore.Client.get_into`.

        A placement function runs on the event loop, never in a worker thread.
        ``local_only`` as for :meth:`get_many`.
        """
        keys = codec.check_gets(namespace, keys)
        staging = tensors.StagedBuffers(buffers)
        return await staging.finish_async(await self._get(namespace, keys, codec.placement(keys, staging.buffers), local_only))

    async def _get(self, namespace: str, keys: Sequence[bytes], place, local_only: bool = False) -> list[Block | None]:
        keys = codec.check_gets(namespace, keys)
        if not keys:
            return []
        if local_only:
            return await self._get_streamed(namespace, keys, place, local_only=True)
        return await self._retrying("Get", lambda: self._get_once(namespace, keys, place))

    async def _get_once(self, namespace: str, keys: list[bytes], place) -> list[Block | None]:
        attached = await self._attached_for(namespace)
        if attached is None:
            return await self._get_stream_once(namespace, keys, place)
        if attached.same_host is not None:
            return await attached.same_host.get_into(namespace, keys, place, self.timeout)
        arena = attached.arena
        request = pb.LookupRequest(namespace=namespace, keys=keys, lease_ms=self._lease_ms, arena=attached.name,
                                   arena_token=arena.token)
        response = await self._arena_call(attached, "Lookup", request)
        received = codec.now_ms()
        try:
            placed = None if place is None else codec.place_lookup(response, place)
            read = await self._off_loop(codec.leased_bytes(response), codec.read_lookup, arena, response, placed)
        except BaseException:  # a placement refused, or cancelled: give the read leases back now
            self._release_later(pb.ReleaseRequest(lease_ids=codec.lookup_lease_ids(response)))
            raise
        if read.leased:
            release = pb.ReleaseRequest(lease_ids=read.lease_ids())
            if codec.lease_held(response.lease_deadline_unix_ms, received):
                self._release_later(release)
            else:
                released = await self._call("Release", release)
                codec.drop_expired(read, released.valid)
        if read.refetch:
            again = await self._get_streamed(
                namespace, [keys[i] for i in read.refetch], codec.refetch_placement(place, placed), read.refetch
            )
            for i, block in zip(read.refetch, again):
                read.blocks[i] = block
        return read.blocks

    def _release_later(self, request: pb.ReleaseRequest) -> None:
        """Release read leases without awaiting the answer (the reads are already known good)."""
        task = asyncio.ensure_future(self._stub.Release(request, timeout=self.timeout))
        self._releases.add(task)
        task.add_done_callback(_forget_release)
        task.add_done_callback(self._releases.discard)

    async def _get_streamed(
        self, namespace: str, keys: list[bytes], place=None, indices=None, *, local_only: bool = False
    ) -> list[Block | None]:
        return await self._retrying(
            "Get", lambda: self._get_stream_once(namespace, keys, place, indices, local_only=local_only)
        )

    async def _get_stream_once(
        self, namespace: str, keys: list[bytes], place=None, indices=None, *, local_only: bool = False
    ) -> list[Block | None]:
        request = pb.GetRequest(namespace=namespace, keys=keys, local_only=local_only)
        assembler = codec.GetAssembler(place, indices)
        large = False
        async for msg in self._stub.Get(request, timeout=self.timeout):
            if msg.WhichOneof("part") == "header":  # on the loop: it may call the placement
                large = msg.header.block.size > OFF_LOOP_BYTES
                assembler.feed(msg)
            elif large:  # the block's last chunk checksums all of it
                await asyncio.to_thread(assembler.feed, msg)
            else:
                assembler.feed(msg)
        return assembler.finish()

    # ---- control -------------------------------------------------------------

    async def exists(self, namespace: str, keys: Sequence[bytes]) -> list[TierName]:
        """For a prefix chain (head first): the tier of each leading present block."""
        return codec.parse_exists(await self._call("Exists", pb.ExistsRequest(namespace=namespace, keys=list(keys))))

    async def delete(self, namespace: str, keys: Sequence[bytes]) -> int:
        return (await self._call("Delete", pb.DeleteRequest(namespace=namespace, keys=list(keys)))).deleted

    async def pin(self, namespace: str, keys: Sequence[bytes], lease_s: float = 0, replicas: int = 0) -> PinLease:
        """Protect present blocks from eviction for ``lease_s`` (0: the daemon's default); with
        ``replicas`` = k > 1 the daemon also keeps k - 1 copies of them pinned on other live nodes."""
        r = await self._call("Pin", pb.PinRequest(namespace=namespace, keys=list(keys), lease_ms=int(lease_s * 1000),
                                                  replicas=replicas))
        return codec.parse_pin(r)

    async def unpin(self, lease_id: int) -> bool:
        return (await self._call("Unpin", pb.UnpinRequest(lease_id=lease_id))).released

    async def list_blocks(self, namespace: str, prefix: bytes = b"", *, page_size: int = 0, page_token: bytes = b"") -> ListPage:
        """One page of a listing; see :meth:`kvstore.Client.list_blocks`."""
        return codec.parse_list(await self._call("List", codec.list_request(namespace, prefix, page_size, page_token)))

    async def iter_blocks(self, namespace: str, prefix: bytes = b"", *, page_size: int = 0) -> AsyncIterator[Listed]:
        """Every block of the namespace whose key starts with ``prefix``, page by page."""
        token = b""
        while True:
            page = await self.list_blocks(namespace, prefix, page_size=page_size, page_token=token)
            for block in page.blocks:
                yield block
            token = page.next_page_token
            if not token:
                return

    async def stats(self, namespace: str = "") -> Stats:
        return codec.parse_stats(await self._call("Stats", pb.StatsRequest(namespace=namespace)))


def _broken(attached: _Attached | None) -> bool:
    return attached is not None and attached.same_host is not None and attached.same_host.broken


def _forget_release(task: asyncio.Future) -> None:
    # A failed release is harmless (the lease expires); retrieve the error so
    # asyncio does not report it as never retrieved.
    if not task.cancelled():
        task.exception()
