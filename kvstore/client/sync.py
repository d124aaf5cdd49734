"""Blocking client of a Strata daemon.

Block bytes move through a transport (:mod:`kvstore.transport`) picked from
what the daemon offers: on the daemon's host the client maps its arena and
sends control messages over the daemon's same-host socket (or, when none is
offered, as gRPC calls); anywhere else, or when the arena cannot be mapped,
it streams bytes over gRPC. The caller sees the same results either way.
Control calls that move no block bytes (Exists, Pin, List, Stats, Score...)
are gRPC calls.

A daemon may group namespaces into isolated arenas, each with its own file
and socket. The transport is picked per arena: on the first block call for
a namespace the client attaches that namespace's arena (or reuses the one
it already attached for another namespace of it), and streams the bytes of
arenas it may not map.

What this client shares with its asyncio twin (arguments, attachments,
request building, the retry policy) is :mod:`kvstore.client.base`; this
module holds its I/O only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

from kvstore.api.v1 import kv_pb2 as pb
from kvstore.api.v1 import handoff_pb2 as hpb
from kvstore.api.v1 import handoff_pb2_grpc, index_pb2, index_pb2_grpc, kv_pb2_grpc
from kvstore.auth.credentials import ChannelSecurity
from kvstore.block import TierName
from kvstore.client import codec, tensors
from kvstore.client.base import (  # noqa: F401 - MAX_KNOWN_NAMESPACES: its old home
    MAX_KNOWN_NAMESPACES, REATTACH, RETRIED, Attached, BaseClient,
)
from kvstore.client.codec import Block, BlockPut, Listed, ListPage, PinLease, Stats
from kvstore.handoff.params import HandoffParams
from kvstore.handoff.pull import PullResult
from kvstore.shm.arena import ShmArena
from kvstore.transport.attached import choose
from kvstore.transport.base import Transport
from kvstore.transport.grpc.stream import GrpcStreamTransport


class Client(BaseClient):
    """A connection to one daemon. Thread-safe; close it (or use ``with``) when done.

    The arguments are :class:`~kvstore.client.base.BaseClient`'s (shared memory,
    the transport wanted, credentials).
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
        self._channel = self._security.channel(target, codec.CHANNEL_OPTIONS)
        self._stub = kv_pb2_grpc.KVServiceStub(self._channel)
        self._index = index_pb2_grpc.IndexServiceStub(self._channel)
        self._handoff = handoff_pb2_grpc.HandoffServiceStub(self._channel)
        self._stream = GrpcStreamTransport(self._channel, chunk_bytes=chunk_bytes)
        self._pick_lock = threading.Lock()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._forget_attachments()
        self._stream.close()
        self._channel.close()

    # ---- calls ---------------------------------------------------------------

    def _retrying(self, method: str, attempt_once):
        tries = self._retries(method)
        while True:
            try:
                return attempt_once()
            except RETRIED as failed:
                err, delay = tries.after(failed)
            if delay is None:
                raise err
            if delay == REATTACH:  # the daemon restarted: attach its new arena
                self._forget_attachments()
                continue
            time.sleep(delay)

    def _call(self, method: str, request):
        fn = getattr(self._stub, method)
        return self._retrying(method, lambda: fn(request, timeout=self.timeout))

    def _on_data(self, method: str, namespace: str, act):
        """``act(transport)`` on ``namespace``'s transport, under the retry policy."""
        return self._retrying(method, lambda: act(self._data(namespace)))

    @property
    def shared_memory(self) -> bool:
        """Whether block bytes of the default arena's namespaces move through shared memory."""
        return self._data("").shared_memory

    @property
    def transport_name(self) -> str:
        """The transport block bytes of the default arena take: "same-host", "grpc-arena" or "grpc"."""
        return self._data("").name

    def transport_for(self, namespace: str) -> str:
        """The transport block bytes of ``namespace`` take (its arena's)."""
        return self._data(namespace).name

    @property
    def _mapped(self) -> list[ShmArena]:
        """The arenas this client maps now."""
        return [a.arena for a in self._attached.values() if a.arena is not None]

    @property
    def _transports(self) -> dict[str, Transport]:
        """Arena name → the transport to it (what tests look under)."""
        return {name: a.transport for name, a in self._attached.items()}

    def _data(self, namespace: str) -> Transport:
        """The transport of ``namespace``'s arena, attaching that arena on first use."""
        if self._streams_only():
            return self._stream
        known = self._known(namespace)
        if known is not None:
            return known.transport
        with self._pick_lock:
            known = self._known(namespace)
            if known is not None:
                return known.transport
            attach = self._call("Attach", pb.AttachRequest(namespace=namespace))

            def attached() -> Attached:
                transport, arena = choose(attach, self._channel, self._stream, use_shm=self._use_shm,
                                          want=self._want, lease_ms=self._lease_ms)
                return Attached(attach.arena_name, transport, arena)

            return self._remember(namespace, attach, attached).transport

    def _forget_attachments(self) -> None:
        """Drop every attached arena and its transport; the next block call attaches again."""
        with self._pick_lock:
            attached = self._forget_all()
        for one in attached:
            if one.transport is not self._stream:
                one.transport.close()
        for one in attached:
            if one.arena is not None:
                one.arena.close()

    # ---- data ----------------------------------------------------------------

    def put(self, namespace: str, key: bytes, value, *, parent: bytes | None = None, layout: str = "") -> bool:
        """Store one block; False when the key was already stored."""
        return self.put_many(namespace, [BlockPut(key, value, parent, layout)])[0]

    def put_many(self, namespace: str, items: Sequence[BlockPut]) -> list[bool]:
        """Store blocks in one batch; per block, whether it was newly stored. A value may be a torch
        tensor (see :mod:`kvstore.client.tensors`)."""
        items = self._items(namespace, items)
        if not items:
            return []
        staged: list[BlockPut] = []

        def once(transport: Transport) -> list[bool]:
            if transport.device_tensors:  # a CUDA tensor goes to a gpu tier's slot device to device
                return transport.put(namespace, items, self._deadline())
            if not staged:
                staged[:] = tensors.host_puts(items)
            return transport.put(namespace, staged, self._deadline())

        return self._on_data("Put", namespace, once)

    def get(self, namespace: str, key: bytes) -> bytes | bytearray | None:
        """The block's bytes, or None on a miss."""
        block = self.get_many(namespace, [key])[0]
        return None if block is None else block.data

    def get_many(self, namespace: str, keys: Sequence[bytes], *, local_only: bool = False) -> list[Block | None]:
        """Blocks in one batch, in order; None for each miss. Every block is checksum-verified.

        ``local_only``: the daemon answers from its own tiers only, never reading through to
        its peers (what a peer fetch asks); the bytes are then always streamed."""
        return self._get(namespace, self._keys(namespace, keys), None, local_only)

    def get_into(
        self, namespace: str, keys: Sequence[bytes], buffers: Sequence | codec.Placement, *, local_only: bool = False
    ) -> list[Block | None]:
        """Read blocks straight into caller-owned memory: no buffer allocated per block.

        ``buffers`` is one writable buffer (or torch tensor: a CUDA tensor is
        filled through host staging, see :mod:`kvstore.client.tensors`, or
        device to device from a gpu tier on this node) per key,
        each at least its block's size, or a placement function ``place(i, info) -> buffer | None``
        called with each found block's :class:`BlockInfo` (size, layout)
        before its bytes are read: return a buffer of at least ``info.size``
        bytes, or None to skip the block (it reads as a miss). An engine
        passes the memory its KV cache lives in, sized from the layout. Each
        returned ``Block.data`` is a view of the head of its buffer; None for
        a miss. A block placed but then not delivered (a miss after a
        refetch) leaves its buffer untouched. A block whose read is retried
        may be placed again: return the same buffer for the same index.
        ``local_only`` as for :meth:`get_many`.
        """
        keys = self._keys(namespace, keys)
        if (not local_only and not callable(buffers) and tensors.any_on_device(buffers)
                and self._data(namespace).device_tensors):
            return self._get(namespace, keys, tensors.device_placement(keys, buffers), local_only)
        staging = tensors.StagedBuffers(buffers)
        return staging.finish(self._get(namespace, keys, codec.placement(keys, staging.buffers), local_only))

    def _get(self, namespace: str, keys: list[bytes], place, local_only: bool = False) -> list[Block | None]:
        if not keys:
            return []
        if local_only:
            return self._retrying("Get", lambda: self._stream.get_into(namespace, keys, place, self._deadline(),
                                                                       local_only=True))
        return self._on_data("Get", namespace, lambda t: t.get_into(namespace, keys, place, self._deadline()))

    def touch(self, namespace: str, keys: Sequence[bytes]) -> None:
        """Best effort, no answer: the blocks were used without being read (an engine served them
        from its own memory), so the daemon's eviction should keep them. Only the same-host
        transport says so (batched, with its next flush); the others do nothing."""
        keys = self._keys(namespace, keys)
        if keys:
            self._data(namespace).touch(namespace, keys)

    # ---- control -------------------------------------------------------------

    def exists(self, namespace: str, keys: Sequence[bytes]) -> list[TierName]:
        """For a prefix chain (head first): the tier of each leading present block. On the same-host
        path one message on the daemon's socket; otherwise (or from an older daemon) the Exists RPC."""
        keys = list(keys)
        if keys and not self._streams_only():
            found = self._on_data("Exists", namespace, lambda t: t.exists(namespace, keys, self._deadline()))
            if found is not None:
                return found
        return codec.parse_exists(self._call("Exists", pb.ExistsRequest(namespace=namespace, keys=keys)))

    def delete(self, namespace: str, keys: Sequence[bytes]) -> int:
        return self._call("Delete", pb.DeleteRequest(namespace=namespace, keys=list(keys))).deleted

    def pin(self, namespace: str, keys: Sequence[bytes], lease_s: float = 0, replicas: int = 0) -> PinLease:
        """Protect present blocks from eviction for ``lease_s`` (0: the daemon's default); with
        ``replicas`` = k > 1 the daemon also keeps k - 1 copies of them pinned on other live nodes
        while the pin lasts (Unpin or expiry makes them ordinary cache)."""
        return codec.parse_pin(self._call("Pin", self._pin_request(namespace, keys, lease_s, replicas)))

    def place(self, namespace: str, keys: Sequence[bytes], where: str = "ram") -> codec.Placed:
        """Move held blocks within the daemon: ``"ram"`` reads each into its host-RAM tier from wherever it
        is (disk, a peer, S3), ``"below"`` moves each out of RAM into the tier below it (a pinned block
        stays). What an engine's Prefetch and Demote hints do; nothing is sent back but the counts."""
        return codec.parse_place(self._call("Place", codec.place_request(namespace, keys, where)))

    def unpin(self, lease_id: int) -> bool:
        return self._call("Unpin", pb.UnpinRequest(lease_id=lease_id)).released

    def list_blocks(self, namespace: str, prefix: bytes = b"", *, page_size: int = 0, page_token: bytes = b"") -> ListPage:
        """One page of the namespace's keys starting with ``prefix``, in byte order.

        Pass ``next_page_token`` back for the next page (empty after the last).
        ``page_size`` 0 is the daemon's default (1000); at most 10000.
        """
        return codec.parse_list(self._call("List", codec.list_request(namespace, prefix, page_size, page_token)))

    def iter_blocks(self, namespace: str, prefix: bytes = b"", *, page_size: int = 0) -> Iterator[Listed]:
        """Every block of the namespace whose key starts with ``prefix``, page by page."""
        token = b""
        while True:
            page = self.list_blocks(namespace, prefix, page_size=page_size, page_token=token)
            yield from page.blocks
            token = page.next_page_token
            if not token:
                return

    def stats(self, namespace: str = "") -> Stats:
        return codec.parse_stats(self._call("Stats", pb.StatsRequest(namespace=namespace)))

    # ---- prefix index --------------------------------------------------------

    def _index_call(self, method: str, request):
        fn = getattr(self._index, method)
        return self._retrying(method, lambda: fn(request, timeout=self.timeout))

    def score(
        self, namespace: str, *, keys: Sequence[bytes] | None = None, tokens: Sequence[int] | None = None,
        block_size: int = 16, hash_seed: str = "", lora_name: str = "", cache_salt: str = "",
        candidates: Sequence[str] = (), weights: dict[TierName, float] | None = None,
    ) -> list[codec.EndpointScore]:
        """Nodes ranked by how much of this chain they hold (blocks x tier weight), best first.

        Give the chain as block keys, or as token ids hashed as vLLM does
        (``block_size`` and ``hash_seed``, the engines' PYTHONHASHSEED).
        """
        request = self._score_request(namespace, keys, tokens, block_size, hash_seed, lora_name, cache_salt,
                                      candidates, weights)
        return codec.parse_scores(self._index_call("Score", request))

    def holders(
        self, namespace: str, *, keys: Sequence[bytes] | None = None, tokens: Sequence[int] | None = None,
        block_size: int = 16, hash_seed: str = "", lora_name: str = "", cache_salt: str = "",
    ) -> list[list[codec.Holder]]:
        """For each block of the chain, the nodes that hold it now (live, current epoch)."""
        request = self._holders_request(namespace, keys, tokens, block_size, hash_seed, lora_name, cache_salt)
        return codec.parse_holders(self._index_call("Holders", request))

    def nodes(self) -> list[codec.PeerNode]:
        """Every node the daemon's prefix index knows, with its epoch, liveness and advertised
        transports (needs an identity allowed on every namespace when the daemon authenticates)."""
        return codec.parse_nodes(self._index_call("Nodes", index_pb2.NodesRequest()))

    def replication(self) -> codec.Replication:
        """The daemon's replication state: per replicated namespace, the blocks it holds, how many
        have fewer than k live holders, the copies it made (an identity allowed on every namespace)."""
        return codec.parse_replication(self._index_call("Replication", index_pb2.ReplicationRequest()))

    # ---- prefill/decode handoff (kvstore.handoff) ----------------------------------

    def _handoff_call(self, method: str, request, timeout: float | None = None):
        fn = getattr(self._handoff, method)
        return self._retrying(method, lambda: fn(request, timeout=timeout or self.timeout))

    def open_handoff(self, namespace: str, keys: Sequence[bytes], *, lease_s: float = 0,
                     keep_as_cache: bool = True) -> tuple[HandoffParams, list[bytes]]:
        """On the prefill daemon: hold ``keys`` for a decode node to pull; (the params to pass on, the
        keys it does not hold). ``params.to_dict()`` travels through a router as JSON."""
        r = self._handoff_call("OpenHandoff", self._open_handoff_request(namespace, keys, lease_s, keep_as_cache))
        return HandoffParams.from_proto(r.params), list(r.missing)

    def heartbeat_handoff(self, namespace: str, handoff_id: str, *, timeout: float | None = None) -> int:
        """On the prefill daemon: extend the handoff's lease; the new deadline in unix ms."""
        request = hpb.HeartbeatHandoffRequest(namespace=namespace, handoff_id=handoff_id)
        return self._handoff_call("HeartbeatHandoff", request, timeout).lease_deadline_unix_ms

    def complete_handoff(self, namespace: str, handoff_id: str, *, timeout: float | None = None) -> tuple[int, int]:
        """On the prefill daemon: end the handoff; (blocks deleted, blocks kept as cache)."""
        request = hpb.CompleteHandoffRequest(namespace=namespace, handoff_id=handoff_id)
        r = self._handoff_call("CompleteHandoff", request, timeout)
        return r.deleted, r.kept

    def pull_handoff(self, params: HandoffParams | dict, *, timeout: float | None = None) -> PullResult:
        """On the decode daemon: pull the handoff's blocks into it, store them, publish it as their
        holder and complete the handoff at the prefill daemon. ``params``: as open_handoff returned
        them, or their dict."""
        request, timeout = self._pull_handoff_request(params, timeout)
        r = self._handoff_call("PullHandoff", request, timeout)
        return PullResult(r.stored, r.present, r.pulled_bytes, r.completed, r.complete_error, r.published)
