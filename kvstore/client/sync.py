"""Blocking client of a Strata daemon.

On the daemon's host the client maps the daemon's arena and moves block
bytes through shared memory (gRPC carries only control); anywhere else, or
when the arena cannot be mapped, it streams bytes over gRPC. The caller sees
the same results either way.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator, Sequence

import grpc

from kvstore.api.v1 import kv_pb2 as pb
from kvstore.api.v1 import index_pb2, index_pb2_grpc, kv_pb2_grpc
from kvstore.block import TierName
from kvstore.client import codec
from kvstore.client.codec import Block, BlockPut, Listed, ListPage, PinLease, Stats
from kvstore.errors import ArenaUnusable, StrataError
from kvstore.shm.arena import ShmArena


class Client:
    """A connection to one daemon. Thread-safe; close it (or use ``with``) when done.

    ``use_shm``: None picks shared memory when the daemon's arena can be
    mapped from here; False always streams; True requires shared memory.
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
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.retries = retries
        self._use_shm = use_shm
        self._lease_ms = lease_ms
        self._chunk = chunk_bytes
        self._channel = grpc.insecure_channel(target, options=codec.CHANNEL_OPTIONS)
        self._stub = kv_pb2_grpc.KVServiceStub(self._channel)
        self._index = index_pb2_grpc.IndexServiceStub(self._channel)
        self._arena: ShmArena | None = None
        self._arena_checked = False
        self._releases: collections.deque[grpc.Future] = collections.deque()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for future in self._releases:  # let pending releases reach the daemon
            try:
                future.result(timeout=self.timeout)
            except grpc.RpcError:
                pass  # the leases expire by themselves
        self._releases.clear()
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        self._channel.close()

    # ---- calls ---------------------------------------------------------------

    def _retrying(self, method: str, attempt_once):
        attempt = 0
        while True:
            try:
                return attempt_once()
            except grpc.RpcError as rpc_err:
                err = codec.translate(rpc_err)
            delay = codec.retry_delay(err, method, attempt, self.retries)
            if delay is None:
                raise err
            time.sleep(delay)
            attempt += 1

    def _call(self, method: str, request):
        fn = getattr(self._stub, method)
        return self._retrying(method, lambda: fn(request, timeout=self.timeout))

    @property
    def shared_memory(self) -> bool:
        """Whether block bytes move through the daemon's arena."""
        return self._arena_or_none() is not None

    def _arena_or_none(self) -> ShmArena | None:
        if self._use_shm is False:
            return None
        if not self._arena_checked:
            try:
                self._arena = codec.open_arena(self._call("Attach", pb.AttachRequest()))
            except ArenaUnusable:
                if self._use_shm:
                    raise
            self._arena_checked = True
        return self._arena

    # ---- data ----------------------------------------------------------------

    def put(self, namespace: str, key: bytes, value, *, parent: bytes | None = None, layout: str = "") -> bool:
        """Store one block; False when the key was already stored."""
        return self.put_many(namespace, [BlockPut(key, value, parent, layout)])[0]

    def put_many(self, namespace: str, items: Sequence[BlockPut]) -> list[bool]:
        """Store blocks in one batch; per block, whether it was newly stored."""
        checked = codec.check_puts(namespace, items)
        if not checked:
            return []
        arena = self._arena_or_none()
        if arena is None:
            return codec.stream_put_results(checked, self._call_put(namespace, checked))
        results: list[bool] = []
        for group in codec.batches_by_bytes(checked, codec.arena_batch_bytes(arena)):
            results += self._put_shm(arena, namespace, group)
        return results

    def _put_shm(self, arena: ShmArena, namespace: str, checked) -> list[bool]:
        alloc = self._call("Allocate", codec.allocate_request(namespace, checked, self._lease_ms))
        received = codec.now_ms()
        in_flight: list[tuple[grpc.Future, pb.CommitRequest]] = []
        try:
            for group in codec.slot_groups(checked, alloc):
                request = codec.copy_into_slots(arena, alloc, received, group)
                in_flight.append((self._stub.Commit.future(request, timeout=self.timeout), request))
            done = [self._commit_result(future, request) for future, request in in_flight]
        except BaseException:
            for future, _ in in_flight:
                future.cancel()
            try:  # committed slots are skipped; the rest are given back
                self._call("Abort", pb.AbortRequest(slot_ids=codec.slot_ids(alloc)))
            except StrataError:
                pass  # the slots expire by themselves
            raise
        return codec.put_results(alloc, done)

    def _commit_result(self, future: grpc.Future, request: pb.CommitRequest) -> pb.CommitResponse:
        try:
            return future.result()
        except grpc.RpcError as rpc_err:
            err = codec.translate(rpc_err)
        if codec.retry_delay(err, "Commit", 0, self.retries) is None:
            raise err
        time.sleep(codec.retry_delay(err, "Commit", 0, self.retries))
        return self._call("Commit", request)

    def _call_put(self, namespace: str, checked) -> pb.PutResponse:
        return self._retrying(
            "Put", lambda: self._stub.Put(codec.put_requests(namespace, checked, self._chunk), timeout=self.timeout)
        )

    def get(self, namespace: str, key: bytes) -> bytes | bytearray | None:
        """The block's bytes, or None on a miss."""
        block = self.get_many(namespace, [key])[0]
        return None if block is None else block.data

    def get_many(self, namespace: str, keys: Sequence[bytes]) -> list[Block | None]:
        """Blocks in one batch, in order; None for each miss. Every block is checksum-verified."""
        return self._get(namespace, keys, None)

    def get_into(self, namespace: str, keys: Sequence[bytes], buffers: Sequence | codec.Placement) -> list[Block | None]:
        """Read blocks straight into caller-owned memory: no buffer allocated per block.

        ``buffers`` is one writable buffer per key, each at least its block's
        size, or a placement function ``place(i, info) -> buffer | None``
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
        return self._get(namespace, keys, codec.placement(keys, buffers))

    def _get(self, namespace: str, keys: Sequence[bytes], place) -> list[Block | None]:
        keys = codec.check_gets(namespace, keys)
        if not keys:
            return []
        arena = self._arena_or_none()
        if arena is None:
            return self._get_streamed(namespace, keys, place)
        response = self._call("Lookup", pb.LookupRequest(namespace=namespace, keys=keys, lease_ms=self._lease_ms))
        received = codec.now_ms()
        try:
            placed = None if place is None else codec.place_lookup(response, place)
            read = codec.read_lookup(arena, response, placed)
        except BaseException:  # a placement refused: give the read leases back now
            self._release_later(pb.ReleaseRequest(lease_ids=codec.lookup_lease_ids(response)))
            raise
        if read.leased:
            release = pb.ReleaseRequest(lease_ids=read.lease_ids())
            if codec.lease_held(response.lease_deadline_unix_ms, received):
                self._release_later(release)
            else:
                codec.drop_expired(read, self._call("Release", release).valid)
        if read.refetch:
            again = self._get_streamed(
                namespace, [keys[i] for i in read.refetch], codec.refetch_placement(place, placed), read.refetch
            )
            for i, block in zip(read.refetch, again):
                read.blocks[i] = block
        return read.blocks

    def _release_later(self, request: pb.ReleaseRequest) -> None:
        """Release read leases without waiting for the answer (the reads are already known good)."""
        while self._releases and self._releases[0].done():
            self._releases.popleft()
        self._releases.append(self._stub.Release.future(request, timeout=self.timeout))

    def _get_streamed(self, namespace: str, keys: list[bytes], place=None, indices=None) -> list[Block | None]:
        def once() -> list[Block | None]:
            assembler = codec.GetAssembler(place, indices)
            for msg in self._stub.Get(pb.GetRequest(namespace=namespace, keys=keys), timeout=self.timeout):
                assembler.feed(msg)
            return assembler.finish()

        return self._retrying("Get", once)

    # ---- control -------------------------------------------------------------

    def exists(self, namespace: str, keys: Sequence[bytes]) -> list[TierName]:
        """For a prefix chain (head first): the tier of each leading present block."""
        return codec.parse_exists(self._call("Exists", pb.ExistsRequest(namespace=namespace, keys=list(keys))))

    def delete(self, namespace: str, keys: Sequence[bytes]) -> int:
        return self._call("Delete", pb.DeleteRequest(namespace=namespace, keys=list(keys))).deleted

    def pin(self, namespace: str, keys: Sequence[bytes], lease_s: float = 0) -> PinLease:
        r = self._call("Pin", pb.PinRequest(namespace=namespace, keys=list(keys), lease_ms=int(lease_s * 1000)))
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
