"""asyncio client of a Strata daemon: the twin of :class:`kvstore.client.sync.Client`.

The same constructor arguments and the same methods with the same
arguments and results, each call a coroutine; ``tests/client/test_client_twins.py``
checks it. Two differ in kind only: the blocking client's properties
``shared_memory`` and ``transport_name`` may need an Attach, so here they are
coroutine methods (taking the namespace, default the default arena's);
``uses_shared_memory`` is the old name of ``shared_memory``. ``iter_blocks``
is an async generator.

Both clients are thin shells over :class:`kvstore.client.base.BaseClient`
(arguments, attachments, request building, the retry policy), and both move
block bytes through transports of one contract
(:class:`~kvstore.transport.base.Transport`, and its asyncio twin
:class:`~kvstore.transport.base.AsyncTransport`) picked the same way
(:mod:`kvstore.transport.attached_aio`): on the daemon's host, through the
arena with control over the daemon's same-host socket
(:mod:`kvstore.transport.samehost.client_aio`, which also reads and writes a
gpu tier's regions, and CUDA tensors device to device); without that
socket, control as gRPC calls (:mod:`kvstore.transport.grpc.arena_aio`);
elsewhere, streamed (:mod:`kvstore.transport.grpc.stream_aio`).

Copies and checksums of more than ``OFF_LOOP_BYTES`` run in a worker thread
(:class:`kvstore.transport.off_loop.OffLoop`, shared by this client's
transports): a 64 MiB memcpy would otherwise stall every other task on the
loop for tens of milliseconds. Smaller ones run inline, where a thread hop
would cost more than the copy. Placements always run on the loop.

As in the blocking client, the path is picked per arena: a namespace's
first block call attaches its arena (once per arena, not per namespace);
an arena the client may not map is streamed. A same-host connection the
daemon closed is opened again on the next call; when the daemon refuses the
token it gave (it restarted since), the client drops that arena and attaches
again, once per call (``base.Retries``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from kvstore.api.v1 import handoff_pb2 as hpb
from kvstore.api.v1 import handoff_pb2_grpc, index_pb2, index_pb2_grpc, kv_pb2_grpc
from kvstore.api.v1 import kv_pb2 as pb
from kvstore.auth.credentials import ChannelSecurity
from kvstore.block import TierName
from kvstore.client import codec, tensors
from kvstore.client.base import (  # noqa: F401 - MAX_KNOWN_NAMESPACES: its old home
    MAX_KNOWN_NAMESPACES, REATTACH, RETRIED, Attached, BaseClient,
)
from kvstore.client.codec import Block, BlockPut, Listed, ListPage, PinLease, Stats
from kvstore.errors import StaleAttachment
from kvstore.handoff.params import HandoffParams
from kvstore.handoff.pull import PullResult
from kvstore.shm.arena import ShmArena
from kvstore.transport.attached_aio import choose_async
from kvstore.transport.base import AsyncTransport
from kvstore.transport.grpc.stream_aio import MAX_PUT_STREAMS, AsyncGrpcStreamTransport  # noqa: F401
from kvstore.transport.off_loop import OFF_LOOP_BYTES, OffLoop
from kvstore.transport.samehost.client_aio import AsyncSameHostTransport


class AsyncClient(BaseClient):
    """A connection to one daemon, bound to the event loop it was created on.

    Create it inside a running loop (``async with AsyncClient(...) as c:``);
    its calls may run concurrently as tasks of that loop. The arguments are
    :class:`~kvstore.client.base.BaseClient`'s, as for :class:`kvstore.client.sync.Client`.
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
        transport: str | None = None,
        token: str | None = None,
        token_file: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
        security: ChannelSecurity | None = None,
    ) -> None:
        super().__init__(target, timeout=timeout, retries=retries, use_shm=use_shm, lease_ms=lease_ms,
                         chunk_bytes=chunk_bytes, transport=transport, token=token, token_file=token_file,
                         tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, tls_server_name=tls_server_name,
                         security=security)
        self._channel = self._security.aio_channel(target, codec.CHANNEL_OPTIONS)
        self._stub = kv_pb2_grpc.KVServiceStub(self._channel)
        self._index = index_pb2_grpc.IndexServiceStub(self._channel)
        self._handoff = handoff_pb2_grpc.HandoffServiceStub(self._channel)
        self._off_loop = OffLoop(OFF_LOOP_BYTES)
        self._stream = AsyncGrpcStreamTransport(
            self._channel, lambda: self._security.channel(self.target, codec.CHANNEL_OPTIONS), chunk_bytes=chunk_bytes,
            off_loop_bytes=OFF_LOOP_BYTES)
        self._attach_lock = asyncio.Lock()  # one Attach per arena, however many first calls race
        self._closing: set[asyncio.Future] = set()  # transports of dropped arenas, closing
        self._retired: list[ShmArena] = []  # arenas of a previous daemon run, unmapped once no copy uses them

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the transports and the channel and unmap the arenas, after copies still running in threads end."""
        await self._off_loop.wait()
        attached = self._forget_all()
        for one in attached:
            if one.transport is not self._stream:
                await one.transport.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        for one in attached:
            if one.arena is not None:
                one.arena.close()
        for arena in self._retired:
            arena.close()
        await self._stream.close()
        await self._channel.close()

    # ---- calls ---------------------------------------------------------------

    async def _retrying(self, method: str, attempt_once: Callable[[], Any]):
        tries = self._retries(method)
        while True:
            try:
                return await attempt_once()
            except RETRIED as failed:
                err, delay = tries.after(failed)
            if delay is None:
                raise err
            if delay == REATTACH:  # the daemon restarted; the stale arena was dropped (_on_data, _reconnect)
                continue
            await asyncio.sleep(delay)

    async def _call(self, method: str, request):
        fn = getattr(self._stub, method)
        return await self._retrying(method, lambda: fn(request, timeout=self.timeout))

    async def _on_data(self, method: str, namespace: str, act: Callable[[AsyncTransport], Any]):
        """``await act(transport)`` on ``namespace``'s transport, under the retry policy; an arena the
        daemon no longer knows (it restarted) is dropped, and the retry attaches again."""

        async def once():
            attached = await self._attached_for(namespace)
            try:
                return await act(self._stream if attached is None else attached.transport)
            except StaleAttachment:
                if attached is not None:
                    self._drop(attached)
                raise

        return await self._retrying(method, once)

    async def _transport_of(self, namespace: str) -> AsyncTransport:
        return await self._retrying("Attach", lambda: self._data(namespace))

    async def shared_memory(self, namespace: str = "") -> bool:
        """Whether block bytes of ``namespace`` (default: the default arena's) move through shared memory."""
        return (await self._transport_of(namespace)).shared_memory

    uses_shared_memory = shared_memory  # its old name

    async def transport_name(self, namespace: str = "") -> str:
        """The transport block bytes of ``namespace``'s arena take: "same-host", "grpc-arena" or "grpc"."""
        return (await self._transport_of(namespace)).name

    async def transport_for(self, namespace: str) -> str:
        """The transport block bytes of ``namespace`` take (its arena's)."""
        return (await self._transport_of(namespace)).name

    async def _data(self, namespace: str) -> AsyncTransport:
        attached = await self._attached_for(namespace)
        return self._stream if attached is None else attached.transport

    async def _attached_for(self, namespace: str) -> Attached | None:
        """What was attached for ``namespace``'s arena, attaching it on first use; None: always streamed.

        Raises :class:`StaleAttachment` when the daemon restarted since it
        attached: the arena is dropped, and the next call attaches again.
        """
        if self._streams_only():
            return None
        known = self._known(namespace)
        if known is not None and not _broken(known):
            return known
        async with self._attach_lock:
            known = self._known(namespace)
            if known is not None:
                if _broken(known):
                    await self._reconnect(known)
                return known
            attach = await self._call("Attach", pb.AttachRequest(namespace=namespace))
            attached = self._attached.get(attach.arena_name)
            if attached is None:
                transport, arena = await choose_async(
                    attach, self._channel, self._stream, use_shm=self._use_shm, want=self._want,
                    lease_ms=self._lease_ms, off_loop=self._off_loop)
                attached = Attached(attach.arena_name, transport, arena)
            return self._remember(namespace, attach, lambda: attached)

    async def _reconnect(self, attached: Attached) -> None:
        """A new same-host connection for a closed one; the arena dropped when its token is refused."""
        try:
            attached.transport = await attached.transport.reopen()
        except StaleAttachment:
            self._drop(attached)
            raise

    def _drop(self, attached: Attached) -> None:
        """Forget one attached arena: its namespaces attach again on their next call."""
        if not self._forget(attached):
            return  # dropped already, and maybe attached again since
        if attached.transport is not self._stream:
            closing = asyncio.ensure_future(attached.transport.close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        if attached.arena is not None:
            self._retired.append(attached.arena)
        if not self._off_loop.busy:  # no worker thread holds a view of an arena
            kept = []
            for arena in self._retired:
                try:
                    arena.close()
                except BufferError:  # a call of this loop still reads it: at close()
                    kept.append(arena)
            self._retired = kept

    # ---- data ----------------------------------------------------------------

    async def put(self, namespace: str, key: bytes, value, *, parent: bytes | None = None, layout: str = "") -> bool:
        """Store one block; False when the key was already stored."""
        return (await self.put_many(namespace, [BlockPut(key, value, parent, layout)]))[0]

    async def put_many(self, namespace: str, items: Sequence[BlockPut]) -> list[bool]:
        """Store blocks in one batch; per block, whether it was newly stored. A value may be a torch
        tensor (see :mod:`kvstore.client.tensors`)."""
        items = self._items(namespace, items)
        if not items:
            return []
        staged: list[BlockPut] = []

        async def once(transport: AsyncTransport) -> list[bool]:
            if transport.device_tensors:  # a CUDA tensor goes to a gpu tier's slot device to device
                return await transport.put(namespace, items, self._deadline())
            if not staged:
                staged[:] = await tensors.host_puts_async(items)
            return await transport.put(namespace, staged, self._deadline())

        return await self._on_data("Put", namespace, once)

    async def get(self, namespace: str, key: bytes) -> bytes | bytearray | None:
        """The block's bytes, or None on a miss."""
        block = (await self.get_many(namespace, [key]))[0]
        return None if block is None else block.data

    async def get_many(self, namespace: str, keys: Sequence[bytes], *, local_only: bool = False) -> list[Block | None]:
        """Blocks in one batch, in order; None for each miss. Every block is checksum-verified.

        ``local_only``: the daemon answers from its own tiers only, never reading through to
        its peers (what a peer fetch asks); the bytes are then always streamed."""
        return await self._get(namespace, self._keys(namespace, keys), None, local_only)

    async def get_into(
        self, namespace: str, keys: Sequence[bytes], buffers: Sequence | codec.Placement, *, local_only: bool = False
    ) -> list[Block | None]:
        """Read blocks straight into caller-owned memory; see :meth:`kvstore.Client.get_into`.

        A placement function runs on the event loop, never in a worker thread.
        ``local_only`` as for :meth:`get_many`.
        """
        keys = self._keys(namespace, keys)
        if (not local_only and not callable(buffers) and tensors.any_on_device(buffers)
                and (await self._transport_of(namespace)).device_tensors):
            return await self._get(namespace, keys, tensors.device_placement(keys, buffers), local_only)
        staging = tensors.StagedBuffers(buffers)
        return await staging.finish_async(
            await self._get(namespace, keys, codec.placement(keys, staging.buffers), local_only))

    async def _get(self, namespace: str, keys: list[bytes], place, local_only: bool = False) -> list[Block | None]:
        if not keys:
            return []
        if local_only:
            return await self._retrying("Get", lambda: self._stream.get_into(namespace, keys, place, self._deadline(),
                                                                             local_only=True))
        return await self._on_data("Get", namespace, lambda t: t.get_into(namespace, keys, place, self._deadline()))

    async def touch(self, namespace: str, keys: Sequence[bytes]) -> None:
        """Best effort, no answer: the blocks were used without being read (an engine served them
        from its own memory), so the daemon's eviction should keep them. Only the same-host
        transport says so (batched, with its next flush); the others do nothing."""
        keys = self._keys(namespace, keys)
        if keys:
            await (await self._transport_of(namespace)).touch(namespace, keys)

    # ---- control -------------------------------------------------------------

    async def exists(self, namespace: str, keys: Sequence[bytes]) -> list[TierName]:
        """For a prefix chain (head first): the tier of each leading present block. On the same-host
        path one message on the daemon's socket; otherwise (or from an older daemon) the Exists RPC."""
        keys = list(keys)
        if keys and not self._streams_only():
            found = await self._on_data("Exists", namespace,
                                        lambda t: t.exists(namespace, keys, self._deadline()))
            if found is not None:
                return found
        return codec.parse_exists(await self._call("Exists", pb.ExistsRequest(namespace=namespace, keys=keys)))

    async def delete(self, namespace: str, keys: Sequence[bytes]) -> int:
        return (await self._call("Delete", pb.DeleteRequest(namespace=namespace, keys=list(keys)))).deleted

    async def pin(self, namespace: str, keys: Sequence[bytes], lease_s: float = 0, replicas: int = 0) -> PinLease:
        """Protect present blocks from eviction for ``lease_s`` (0: the daemon's default); with
        ``replicas`` = k > 1 the daemon also keeps k - 1 copies of them pinned on other live nodes
        while the pin lasts (Unpin or expiry makes them ordinary cache)."""
        return codec.parse_pin(await self._call("Pin", self._pin_request(namespace, keys, lease_s, replicas)))

    async def place(self, namespace: str, keys: Sequence[bytes], where: str = "ram") -> codec.Placed:
        """Move held blocks within the daemon: ``"ram"`` reads each into its host-RAM tier from wherever it
        is (disk, a peer, S3), ``"below"`` moves each out of RAM into the tier below it (a pinned block
        stays). What an engine's Prefetch and Demote hints do; nothing is sent back but the counts."""
        return codec.parse_place(await self._call("Place", codec.place_request(namespace, keys, where)))

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

    # ---- prefix index --------------------------------------------------------

    async def _index_call(self, method: str, request):
        fn = getattr(self._index, method)
        return await self._retrying(method, lambda: fn(request, timeout=self.timeout))

    async def score(
        self, namespace: str, *, keys: Sequence[bytes] | None = None, tokens: Sequence[int] | None = None,
        block_size: int = 16, hash_seed: str = "", lora_name: str = "", cache_salt: str = "",
        candidates: Sequence[str] = (), weights: dict[TierName, float] | None = None,
    ) -> list[codec.EndpointScore]:
        """Nodes ranked by how much of this chain they hold; see :meth:`kvstore.Client.score`."""
        request = self._score_request(namespace, keys, tokens, block_size, hash_seed, lora_name, cache_salt,
                                      candidates, weights)
        return codec.parse_scores(await self._index_call("Score", request))

    async def holders(
        self, namespace: str, *, keys: Sequence[bytes] | None = None, tokens: Sequence[int] | None = None,
        block_size: int = 16, hash_seed: str = "", lora_name: str = "", cache_salt: str = "",
    ) -> list[list[codec.Holder]]:
        """For each block of the chain, the nodes that hold it now (live, current epoch)."""
        request = self._holders_request(namespace, keys, tokens, block_size, hash_seed, lora_name, cache_salt)
        return codec.parse_holders(await self._index_call("Holders", request))

    async def nodes(self) -> list[codec.PeerNode]:
        """Every node the daemon's prefix index knows; see :meth:`kvstore.Client.nodes`."""
        return codec.parse_nodes(await self._index_call("Nodes", index_pb2.NodesRequest()))

    async def replication(self) -> codec.Replication:
        """The daemon's replication state; see :meth:`kvstore.Client.replication`."""
        return codec.parse_replication(await self._index_call("Replication", index_pb2.ReplicationRequest()))

    # ---- prefill/decode handoff (kvstore.handoff) ----------------------------------

    async def _handoff_call(self, method: str, request, timeout: float | None = None):
        fn = getattr(self._handoff, method)
        return await self._retrying(method, lambda: fn(request, timeout=timeout or self.timeout))

    async def open_handoff(self, namespace: str, keys: Sequence[bytes], *, lease_s: float = 0,
                           keep_as_cache: bool = True) -> tuple[HandoffParams, list[bytes]]:
        """On the prefill daemon: hold ``keys`` for a decode node to pull; see :meth:`kvstore.Client.open_handoff`."""
        r = await self._handoff_call("OpenHandoff", self._open_handoff_request(namespace, keys, lease_s, keep_as_cache))
        return HandoffParams.from_proto(r.params), list(r.missing)

    async def heartbeat_handoff(self, namespace: str, handoff_id: str, *, timeout: float | None = None) -> int:
        """On the prefill daemon: extend the handoff's lease; the new deadline in unix ms."""
        request = hpb.HeartbeatHandoffRequest(namespace=namespace, handoff_id=handoff_id)
        return (await self._handoff_call("HeartbeatHandoff", request, timeout)).lease_deadline_unix_ms

    async def complete_handoff(self, namespace: str, handoff_id: str, *, timeout: float | None = None) -> tuple[int, int]:
        """On the prefill daemon: end the handoff; (blocks deleted, blocks kept as cache)."""
        request = hpb.CompleteHandoffRequest(namespace=namespace, handoff_id=handoff_id)
        r = await self._handoff_call("CompleteHandoff", request, timeout)
        return r.deleted, r.kept

    async def pull_handoff(self, params: HandoffParams | dict, *, timeout: float | None = None) -> PullResult:
        """On the decode daemon: pull the handoff's blocks; see :meth:`kvstore.Client.pull_handoff`."""
        request, timeout = self._pull_handoff_request(params, timeout)
        r = await self._handoff_call("PullHandoff", request, timeout)
        return PullResult(r.stored, r.present, r.pulled_bytes, r.completed, r.complete_error, r.published)


def _broken(attached: Attached) -> bool:
    return isinstance(attached.transport, AsyncSameHostTransport) and attached.transport.broken
