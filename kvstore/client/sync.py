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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import grpc

from kvstore.api.v1 import kv_pb2 as pb
from kvstore.api.v1 import handoff_pb2 as hpb
from kvstore.api.v1 import handoff_pb2_grpc, index_pb2, index_pb2_grpc, kv_pb2_grpc
from kvstore.auth.credentials import ChannelSecurity
from kvstore.block import TierName
from kvstore.client import tensors
from kvstore.client import codec
from kvstore.client.codec import Block, BlockPut, Listed, ListPage, PinLease, Stats
from kvstore.errors import StrataError
from kvstore.handoff.params import HandoffParams
from kvstore.handoff.pull import PullResult
from kvstore.shm.arena import ShmArena
from kvstore.transport.attached import choose
from kvstore.transport.base import Deadline, Transport
from kvstore.transport.grpc.stream import GrpcStreamTransport

# Namespaces whose arena the client remembers; beyond it the memo starts over
# (an Attach per namespace again, the arenas stay mapped).
MAX_KNOWN_NAMESPACES = 4096


class Client:
    """A connection to one daemon. Thread-safe; close it (or use ``with``) when done.

    ``use_shm``: None picks shared memory when the daemon's arena can be
    mapped from here; False always streams; True requires shared memory.
    ``transport`` names one ("same-host", "grpc-arena", "grpc") instead of
    picking, and fails rather than fall back.

    Credentials, for a daemon with authentication: ``token`` or
    ``token_file`` (a bearer token), ``tls_ca`` (PEM that verifies the
    daemon's certificate), ``tls_cert``/``tls_key`` (this client's
    certificate, for mTLS), ``tls_server_name`` (the name to verify when the
    target is an address); or a prepared ``security``.
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
        self.target = target
        self.timeout = timeout
        self.retries = retries
        self._use_shm = use_shm
        self._want = transport
        self._lease_ms = lease_ms
        if security is None:
            security = ChannelSecurity.build(token=token, token_file=token_file, tls_ca=tls_ca, tls_cert=tls_cert,
                                             tls_key=tls_key, tls_server_name=tls_server_name)
        self._channel = security.channel(target, codec.CHANNEL_OPTIONS)
        self._stub = kv_pb2_grpc.KVServiceStub(self._channel)
        self._index = index_pb2_grpc.IndexServiceStub(self._channel)
        self._handoff = handoff_pb2_grpc.HandoffServiceStub(self._channel)
        self._stream = GrpcStreamTransport(self._channel, chunk_bytes=chunk_bytes)
        self._transports: dict[str, Transport] = {}  # arena name → the transport to it
        self._arena_of: dict[str, str] = {}  # namespace → arena name
        self._mapped: list[ShmArena] = []
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
        tries = codec.Retries(method, self.retries)
        while True:
            try:
                return attempt_once()
            except (grpc.RpcError, StrataError) as failed:  # transports raise Strata errors already
                err, delay = tries.after(failed)
            if delay is None:
                raise err
            if delay == codec.REATTACH:  # the daemon restarted: attach its new arena
                self._forget_attachments()
                continue
            time.sleep(delay)

    def _call(self, method: str, request):
        fn = getattr(self._stub, method)
        return self._retrying(method, lambda: fn(request, timeout=self.timeout))

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

    def _data(self, namespace: str) -> Transport:
        """The transport of ``namespace``'s arena, attaching that arena on first use."""
        if self._use_shm is False or self._want == "grpc":
            return self._stream
        name = self._arena_of.get(namespace)
        if name is not None:
            return self._transports[name]
        with self._pick_lock:
            name = self._arena_of.get(namespace)
            if name is not None:
                return self._transports[name]
            attach = self._call("Attach", pb.AttachRequest(namespace=namespace))
            transport = self._transports.get(attach.arena_name)
            if transport is None:
                transport, arena = choose(
                    attach, self._channel, self._stream, use_shm=self._use_shm, want=self._want,
                    lease_ms=self._lease_ms,
                )
                self._transports[attach.arena_name] = transport
                if arena is not None:
                    self._mapped.append(arena)
            if len(self._arena_of) >= MAX_KNOWN_NAMESPACES:
                self._arena_of.clear()
            self._arena_of[namespace] = attach.arena_name
            return transport

    def _forget_attachments(self) -> None:
        """Drop every attached arena and its transport; the next block call attaches again."""
        with self._pick_lock:
            transports, self._transports, self._arena_of = self._transports, {}, {}
            mapped, self._mapped = self._mapped, []
        for transport in {id(t): t for t in transports.values()}.values():
            if transport is not self._stream:
                transport.close()
        for arena in mapped:
            arena.close()

    def _deadline(self) -> Deadline:
        return Deadline.after(self.timeout, cancellable=False)  # the call's own: nobody else can cancel it

    # ---- data ----------------------------------------------------------------

    def put(self, namespace: str, key: bytes, value, *, parent: bytes | None = None, layout: str = "") -> bool:
        """Store one block; False when the key was already stored."""
        return self.put_many(namespace, [BlockPut(key, value, parent, layout)])[0]

    def put_many(self, namespace: str, items: Sequence[BlockPut]) -> list[bool]:
        """Store blocks in one batch; per block, whether it was newly stored."""
        codec.check_gets(namespace, [item.key for item in items])
        if not items:
            return []

        def once() -> list[bool]:
            transport = self._data(namespace)  # a CUDA tensor goes to a gpu tier's slot device to device
            if transport.device_tensors:
                return transport.put(namespace, list(items), self._deadline())
            staged = [item for item, _, _ in codec.check_puts(namespace, tensors.host_puts(items))]
            return transport.put(namespace, staged, self._deadline())

        return self._retrying("Put", once)

    def get(self, namespace: str, key: bytes) -> bytes | bytearray | None:
        """The block's bytes, or None on a miss."""
        block = self.get_many(namespace, [key])[0]
        return None if block is None else block.data

    def get_many(self, namespace: str, keys: Sequence[bytes]) -> list[Block | None]:
        """Blocks in one batch, in order; None for each miss. Every block is checksum-verified."""
        return self._get(codec.check_gets(namespace, keys), namespace, None)

    def get_into(self, namespace: str, keys: Sequence[bytes], buffers: Sequence | codec.Placement) -> list[Block | None]:
        """Read blocks straight into caller-owned memory: no buffer allocated per block.

        ``buffers`` is one writable buffer (or torch tensor: a CUDA tensor is
        filled through host staging, see :mod:`kvstore.client.tensors`) per key,
        each at least its block's size, or a placement function ``place(i, info) -> buffer | None``
        called with each found block's :class:`BlockInfo` (size, layout)
        before its bytes are read: return a buffer of at least ``info.size``
        bytes, or None to skip the block (it reads as a miss). An engine
        passes the memory its KV cache lives in, sized from the layout. Each
        returned ``Block.data`` is a view of the head of its buffer; None for
        a miss. A block placed but then not delivered (a miss after a
        refetch) leaves its buffer untouched. A block whose read is retried
        may be placed again: return the same buffer for the same index.
        """
        keys = codec.check_gets(namespace, keys)
        if self._data(namespace).device_tensors and not callable(buffers) and tensors.any_on_device(buffers):
            return self._get(keys, namespace, tensors.device_placement(keys, buffers))
        staging = tensors.StagedBuffers(buffers)
        return staging.finish(self._get(keys, namespace, codec.placement(keys, staging.buffers)))

    def _get(self, keys: list[bytes], namespace: str, place) -> list[Block | None]:
        if not keys:
            return []
        return self._retrying("Get", lambda: self._data(namespace).get_into(namespace, keys, place, self._deadline()))

    def touch(self, namespace: str, keys: Sequence[bytes]) -> None:
        """Best effort, no answer: the blocks were used without being read (an engine served them
        from its own memory), so the daemon's eviction should keep them. Only the same-host
        transport says so (batched, with its next flush); the others do nothing."""
        keys = codec.check_gets(namespace, keys)
        if keys:
            self._data(namespace).touch(namespace, keys)

    # ---- control -------------------------------------------------------------

    def exists(self, namespace: str, keys: Sequence[bytes]) -> list[TierName]:
        """For a prefix chain (head first): the tier of each leading present block."""
        return codec.parse_exists(self._call("Exists", pb.ExistsRequest(namespace=namespace, keys=list(keys))))

    def delete(self, namespace: str, keys: Sequence[bytes]) -> int:
        return self._call("Delete", pb.DeleteRequest(namespace=namespace, keys=list(keys))).deleted

    def pin(self, namespace: str, keys: Sequence[bytes], lease_s: float = 0, replicas: int = 0) -> PinLease:
        """Protect present blocks from eviction for ``lease_s`` (0: the daemon's default); with
        ``replicas`` = k > 1 the daemon also keeps k - 1 copies of them pinned on other live nodes
        while the pin lasts (Unpin or expiry makes them ordinary cache)."""
        r = self._call("Pin", pb.PinRequest(namespace=namespace, keys=list(keys), lease_ms=int(lease_s * 1000),
                                            replicas=replicas))
        return codec.parse_pin(r)

    def unpin(self, lease_id: int) -> bool:
        return self._call("Unpin", pb.UnpinRequest(lease_id=lease_id)).released

    # ---- prefix index --------------------------------------------------------

    def score(
        self, namespace: str, *, keys: Sequence[bytes] | None = None, tokens: Sequence[int] | None = None,
        block_size: int = 16, hash_seed: str = "", lora_name: str = "", cache_salt: str = "",
        candidates: Sequence[str] = (), weights: dict[TierName, float] | None = None,
    ) -> list[codec.EndpointScore]:
        """Nodes ranked by how much of this chain they hold (blocks x tier weight), best first.

        Give the chain as block keys, or as token ids hashed as vLLM does
        (``block_size`` and ``hash_seed``, the engines' PYTHONHASHSEED).
        """
        request = codec.chain_request(index_pb2.ScoreRequest, namespace, keys, tokens, block_size, hash_seed, lora_name, cache_salt)
        request.candidates.extend(candidates)
        for tier, weight in (weights or {}).items():
            request.tier_weights.add(tier=int(tier), weight=weight)
        return codec.parse_scores(self._retrying("Score", lambda: self._index.Score(request, timeout=self.timeout)))

    def holders(
        self, namespace: str, *, keys: Sequence[bytes] | None = None, tokens: Sequence[int] | None = None,
        block_size: int = 16, hash_seed: str = "", lora_name: str = "", cache_salt: str = "",
    ) -> list[list[codec.Holder]]:
        """For each block of the chain, the nodes that hold it now (live, current epoch)."""
        request = codec.chain_request(index_pb2.HoldersRequest, namespace, keys, tokens, block_size, hash_seed, lora_name, cache_salt)
        return codec.parse_holders(self._retrying("Holders", lambda: self._index.Holders(request, timeout=self.timeout)))

    def nodes(self) -> list[codec.PeerNode]:
        """Every node the daemon's prefix index knows, with its epoch, liveness and advertised
        transports (needs an identity allowed on every namespace when the daemon authenticates)."""
        request = index_pb2.NodesRequest()
        return codec.parse_nodes(self._retrying("Nodes", lambda: self._index.Nodes(request, timeout=self.timeout)))

    def replication(self) -> codec.Replication:
        """The daemon's replication state: per replicated namespace, the blocks it holds, how many
        have fewer than k live holders, the copies it made (an identity allowed on every namespace)."""
        request = index_pb2.ReplicationRequest()
        return codec.parse_replication(
            self._retrying("Replication", lambda: self._index.Replication(request, timeout=self.timeout))
        )

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

    # ---- prefill/decode handoff (kvstore.handoff) ----------------------------------

    def _handoff_call(self, method: str, request, timeout: float | None = None):
        fn = getattr(self._handoff, method)
        return self._retrying(method, lambda: fn(request, timeout=timeout or self.timeout))

    def open_handoff(self, namespace: str, keys: Sequence[bytes], *, lease_s: float = 0,
                     keep_as_cache: bool = True) -> tuple[HandoffParams, list[bytes]]:
        """On the prefill daemon: hold ``keys`` for a decode node to pull; (the params to pass on, the
        keys it does not hold). ``params.to_dict()`` travels through a router as JSON."""
        r = self._handoff_call("OpenHandoff", hpb.OpenHandoffRequest(
            namespace=namespace, keys=list(keys), lease_ms=int(lease_s * 1000), keep_as_cache=keep_as_cache))
        return HandoffParams.from_proto(r.params), list(r.missing)

    def heartbeat_handoff(self, namespace: str, handoff_id: str, *, timeout: float | None = None) -> int:
        """On the prefill daemon: extend the handoff's lease; the new deadline in unix ms."""
        r = self._handoff_call("HeartbeatHandoff", hpb.HeartbeatHandoffRequest(namespace=namespace, handoff_id=handoff_id),
                               timeout)
        return r.lease_deadline_unix_ms

    def complete_handoff(self, namespace: str, handoff_id: str, *, timeout: float | None = None) -> tuple[int, int]:
        """On the prefill daemon: end the handoff; (blocks deleted, blocks kept as cache)."""
        r = self._handoff_call("CompleteHandoff", hpb.CompleteHandoffRequest(namespace=namespace, handoff_id=handoff_id),
                               timeout)
        return r.deleted, r.kept

    def pull_handoff(self, params: HandoffParams | dict, *, timeout: float | None = None) -> PullResult:
        """On the decode daemon: pull the handoff's blocks into it, store them, publish it as their
        holder and complete the handoff at the prefill daemon. ``params``: as open_handoff returned
        them, or their dict."""
        if isinstance(params, dict):
            params = HandoffParams.from_dict(params)
        timeout = timeout or max(self.timeout, 120.0)
        r = self._handoff_call("PullHandoff", hpb.PullHandoffRequest(
            namespace=params.namespace, params=params.to_proto(), timeout_ms=int(timeout * 1000)), timeout + 5)
        return PullResult(r.stored, r.present, r.pulled_bytes, r.completed, r.complete_error, r.published)
