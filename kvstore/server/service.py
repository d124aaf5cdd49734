"""KVService: translates proto messages to store calls and back; no policy here."""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace

import grpc

from kvstore.api.v1 import kv_pb2 as pb
from kvstore.api.v1 import kv_pb2_grpc
from kvstore.auth import EVERY_NAMESPACE, READ, current_identity, may_attach, owner_of
from kvstore.auth.stats import visible_stats
from kvstore.block import BlockKey, BlockMeta, TierName, validate_namespace
from kvstore.replication.pin_copies import PinCopies
from kvstore.replication.replicator import ReplicationReport
from kvstore.errors import ArenaReplaced, ArenaUnusable, BlockTooLarge, InvalidArgument, LeaseOwnedElsewhere, PermissionDenied, StrataError
from kvstore.handoff.metrics import HandoffCounts
from kvstore.node import NodeIdentity
from kvstore.peer.served import ServedBytes
from kvstore.wire.budget import ByteBudget
from kvstore.store.group import StoreArena, StoreGroup
from kvstore.store.writer import BlockWriter


def _deadline(context: grpc.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def _lease_s(lease_ms: int) -> float | None:
    return lease_ms / 1000 if lease_ms else None


def _to_ms(deadline_monotonic: float) -> int:
    return int((time.time() + (deadline_monotonic - time.monotonic())) * 1000)


def _header(key: bytes, meta: BlockMeta) -> pb.BlockHeader:
    return pb.BlockHeader(key=key, size=meta.size, checksum=meta.checksum, parent_key=meta.parent or b"", layout=meta.layout)


@dataclass(slots=True)
class _Held:
    """What a Put stream holds for its current block: bytes of the put budget, and the block's writer."""

    budget: int = 0
    writer: BlockWriter | None = None
    holder: str = ""  # whose share of the budget the bytes count against (an authenticated identity)

    def give_back(self, budget: ByteBudget) -> None:
        if self.writer is not None:
            self.writer.abort()
            self.writer = None
        budget.give(self.budget, self.holder)
        self.budget = 0


class KVServicer(kv_pb2_grpc.KVServiceServicer):
    def __init__(self, store: StoreGroup, node: NodeIdentity, chunk_bytes: int,
                 control_sockets: Mapping[str, str] | None = None, removed: Callable[[str, str, list[bytes]], None] | None = None,
                 put_budget: ByteBudget | None = None, handoffs: Callable[[], HandoffCounts] | None = None,
                 served: ServedBytes | None = None, replication: Callable[[], ReplicationReport] | None = None,
                 pin_copies: PinCopies | None = None, open_handoffs: Callable[[str], int] | None = None) -> None:
        """``handoffs``: the daemon's handoff counts (kvstore.handoff); ``open_handoffs(namespace)``:
        the handoffs open in one namespace (what a tenant's Stats shows); ``replication``: its
        replicator's report (None: it replicates nothing); ``served``: where peer reads are counted;
        ``pin_copies``: copies of pins that ask for replicas (kvstore.replication; None: not kept)."""
        self._store = store  # every arena's store; each call goes to its namespace's arena
        self._control_sockets = dict(control_sockets or {})  # arena name → its same-host socket
        # Told (with the arena's name) after blocks were deleted, before the Delete answers
        # (same-host clients' location tables).
        self._removed = removed
        self._node = node
        self._chunk = chunk_bytes
        self._put_budget = put_budget or ByteBudget(1 << 62, "streamed puts", "--put-budget-bytes")
        self._handoffs = handoffs or HandoffCounts
        self._open_handoffs = open_handoffs or (lambda namespace: 0)
        self._replication = replication
        self._served = served if served is not None else ServedBytes()  # what peers read here (local_only Gets)
        self._pin_copies = pin_copies

    # ---- streamed bytes ---------------------------------------------------

    def Put(self, request_iterator: Iterator[pb.PutRequest], context) -> pb.PutResponse:
        """Each block's chunks go straight into its place in the arena as they arrive (kvstore.store.writer)."""
        # A tenant's streams count together against its share of the budget; a daemon without
        # authentication is one trust domain, where the budget alone applies (as for streams).
        held = _Held(holder=owner_of(context) if current_identity().authenticated else "")
        try:
            return self._put(request_iterator, context, held)
        finally:
            held.give_back(self._put_budget)  # a broken, cancelled or idle stream: nothing of its block is stored

    def _put(self, request_iterator: Iterator[pb.PutRequest], context, held: _Held) -> pb.PutResponse:
        results = []
        namespace = ""
        limit = self._store.limits.max_block_bytes

        def finish() -> None:
            writer = held.writer
            if writer is None:
                return
            stored, tier = writer.commit(_deadline(context))
            results.append(pb.PutResult(key=writer.key.key, stored=stored, tier=int(tier)))
            held.writer = None
            held.give_back(self._put_budget)

        for msg in request_iterator:
            if msg.namespace:
                namespace = validate_namespace(msg.namespace)
            part = msg.WhichOneof("part")
            if part == "header":
                finish()  # the previous block, if any; raises if it is incomplete
                if not namespace:
                    raise InvalidArgument("the first Put message must carry the namespace")
                header = msg.header
                if header.size > limit:
                    raise BlockTooLarge(
                        f"block is {header.size} bytes; this daemon's limit is {limit} "
                        "(--max-block-bytes): split the value into smaller blocks"
                    )
                key = BlockKey.checked(namespace, header.key)
                meta = BlockMeta(header.size, header.checksum, header.parent_key or None, header.layout)
                # before any room is taken: bytes are promised only within budget
                self._put_budget.take(header.size, held.holder)
                held.budget = header.size
                held.writer = self._store.open_write(key, meta)
                if held.writer.present:  # its bytes will be dropped: nothing is held for them
                    self._put_budget.give(held.budget, held.holder)
                    held.budget = 0
            elif part == "chunk":
                if held.writer is None:
                    raise InvalidArgument("a Put chunk arrived before any block header")
                held.writer.write(msg.chunk)
            else:
                raise InvalidArgument("a Put message carried neither a header nor a chunk")
        finish()
        return pb.PutResponse(results=results)

    def Get(self, request: pb.GetRequest, context) -> Iterator[pb.GetResponse]:
        if not request.keys:
            raise InvalidArgument("Get needs at least one key")
        self._store.check_batch(request.keys)
        keys = list(request.keys)
        for key_bytes, found in zip(keys, self._store.get_many(request.namespace, keys, local_only=request.local_only)):
            if found is None:
                yield pb.GetResponse(header=pb.GetHeader(found=False, block=pb.BlockHeader(key=key_bytes)))
                continue
            data, meta, tier = found
            yield pb.GetResponse(header=pb.GetHeader(found=True, block=_header(key_bytes, meta), tier=int(tier)))
            view = memoryview(data)
            for off in range(0, len(data), self._chunk):
                yield pb.GetResponse(chunk=bytes(view[off : off + self._chunk]))
            if request.local_only:  # a peer's read (the gRPC peer transport, a handoff pulled over gRPC)
                self._served.add("grpc", len(data))

    # ---- shared-memory path -------------------------------------------------

    def _mapped(self, arena_name: str, token: bytes = b"") -> StoreGroup:
        """The one arena a caller of Allocate or Lookup mapped (empty: the default arena, what an
        older client mapped): offsets are only ever handed out into that arena, and, when the
        caller says which file it mapped (``token``, empty from older clients), into that file."""
        name = arena_name or self._store.default.name
        view = self._store.only(name)  # an unknown name: WrongArena
        if not self._may_attach(None, self._store.arena(name)):
            # The same answer as for an unknown arena's offsets: this caller streams its bytes.
            raise PermissionDenied(
                "this identity may not map the arena of this namespace: use the streamed Put and Get "
                "(Attach answers without an arena path)"
            )
        if token and not hmac.compare_digest(token, self._store.arena(name).shm.token):
            raise ArenaReplaced(
                f"the arena {name!r} this client mapped is not the daemon's any more (the daemon restarted "
                "and its arena has a new token): attach again to map the new one"
            )
        return view

    def _may_attach(self, context, arena: StoreArena) -> bool:
        """Whether this caller may map ``arena``'s shared memory: only if it may read and write
        every namespace of it (``arena.namespaces``). No: it gets streamed bytes for them."""
        return may_attach(current_identity(), EVERY_NAMESPACE if arena is self._store.default else arena.namespaces)

    def Attach(self, request: pb.AttachRequest, context) -> pb.AttachResponse:
        """Which arena holds the namespace, and its path and token to a caller that may map it.

        The arena's name goes only to a caller that may read the namespace, its namespace
        patterns only to one that may map it (and so read them all anyway): a tenant naming
        another's namespace learns nothing of how that tenant is laid out."""
        response = pb.AttachResponse(
            max_block_bytes=self._store.limits.max_block_bytes,
            lease_ms=int(self._store.limits.lease_s * 1000),
        )
        if request.namespace and not current_identity().may(request.namespace, READ):
            return response  # as for an arena it may not map: it streams, and is refused there by name
        arena = self._store.arena_of(request.namespace) if request.namespace else self._store.default
        response.arena_name = arena.name
        if self._may_attach(context, arena):
            response.namespaces.extend(arena.namespaces)
            shm = arena.shm
            response.arena_path, response.arena_token, response.arena_bytes = shm.path, shm.token, shm.size
            response.control_socket = self._control_sockets.get(arena.name, "")
        return response

    def Allocate(self, request: pb.AllocateRequest, context) -> pb.AllocateResponse:
        lease_s = _lease_s(request.lease_ms)
        mapped = self._mapped(request.arena, request.arena_token)
        if mapped.head.name == TierName.GPU:  # gRPC never hands out device offsets (kvstore.transport.samehost.regions)
            raise ArenaUnusable("this daemon's slots are in the gpu tier, which only same-host clients with the "
                                "gpu capability write: use the streamed Put")
        grants = mapped.allocate(
            request.namespace,
            [(b.key, b.size, b.parent_key, b.layout) for b in request.blocks],
            lease_s,
            _deadline(context),
            owner_of(context),
        )
        lease_deadline = time.monotonic() + (lease_s or self._store.limits.lease_s)
        return pb.AllocateResponse(
            slots=[
                pb.Slot(key=g.key.key, present=g.present, slot_id=g.slot_id, offset=g.offset, size=g.size)
                for g in grants
            ],
            lease_deadline_unix_ms=_to_ms(lease_deadline),
        )

    def Commit(self, request: pb.CommitRequest, context) -> pb.CommitResponse:
        items = [(i.slot_id, i.checksum if i.HasField("checksum") else None) for i in request.items]
        try:
            done = self._store.commit(items, owner_of(context))
        except LeaseOwnedElsewhere as err:
            raise err.stranger_view from None
        return pb.CommitResponse(
            results=[pb.PutResult(key=key.key, stored=stored, tier=int(tier)) for key, stored, tier in done]
        )

    def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        self._store.abort(request.slot_ids, owner_of(context))
        return pb.AbortResponse()

    def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        lease_s = _lease_s(request.lease_ms)
        mapped = self._mapped(request.arena, request.arena_token)
        found = mapped.lookup(request.namespace, list(request.keys), lease_s, _deadline(context), owner_of(context))
        if mapped.head.name == TierName.GPU:  # leased in device memory: found, read through the stream
            mapped.release([loc.lease_id for loc in found if loc is not None and loc.lease_id], owner_of(context))
            found = [None if loc is None else replace(loc, offset=0, lease_id=0) for loc in found]
        out = []
        for key_bytes, loc in zip(request.keys, found):
            if loc is None:
                out.append(pb.Located(found=False, block=pb.BlockHeader(key=key_bytes)))
            else:
                out.append(
                    pb.Located(
                        found=True, block=_header(key_bytes, loc.meta), offset=loc.offset, lease_id=loc.lease_id,
                        tier=int(loc.tier),
                    )
                )
        lease_deadline = time.monotonic() + (lease_s or self._store.limits.lease_s)
        return pb.LookupResponse(blocks=out, lease_deadline_unix_ms=_to_ms(lease_deadline))

    def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(valid=self._store.release(request.lease_ids, owner_of(context)))

    # ---- control ------------------------------------------------------------

    def Exists(self, request: pb.ExistsRequest, context) -> pb.ExistsResponse:
        tiers = self._store.exists(request.namespace, list(request.keys))
        return pb.ExistsResponse(prefix_blocks=len(tiers), tiers=[int(t) for t in tiers])

    def Delete(self, request: pb.DeleteRequest, context) -> pb.DeleteResponse:
        keys = list(request.keys)
        deleted = self._store.delete(request.namespace, keys)
        if deleted and self._removed is not None:
            self._removed(self._store.arena_of(request.namespace).name, request.namespace, keys)
        return pb.DeleteResponse(deleted=deleted)

    def Pin(self, request: pb.PinRequest, context) -> pb.PinResponse:
        replicated = request.replicas > 1
        if replicated:
            if self._pin_copies is None:
                raise InvalidArgument(
                    f"a pin asks for {request.replicas} replicas, and this daemon keeps no copies of pins "
                    "([replication] max_pin_replicas is 1): ask for 0 or 1, or raise the setting"
                )
            self._pin_copies.check(request.replicas)  # refused before anything is pinned
        owner = owner_of(context)
        lease, missing = self._store.pin(request.namespace, list(request.keys), _lease_s(request.lease_ms), owner)
        if replicated and lease.keys:
            try:
                self._pin_copies.add(lease.id, request.namespace, [k.key for k in lease.keys], request.replicas,
                                     lease.deadline)
            except StrataError:
                self._store.unpin(lease.id, owner)  # the table filled meanwhile: the pin is refused whole
                raise
        return pb.PinResponse(
            lease_id=lease.id, pinned=len(lease.keys), missing=missing, lease_deadline_unix_ms=_to_ms(lease.deadline)
        )

    def Place(self, request: pb.PlaceRequest, context) -> pb.PlaceResponse:
        if request.where not in (pb.PlaceRequest.WARM, pb.PlaceRequest.DEMOTE):
            raise InvalidArgument("a Place names where the blocks go: WARM (into host RAM) or DEMOTE (below it)")
        placed = self._store.place(request.namespace, list(request.keys), request.where == pb.PlaceRequest.WARM)
        return pb.PlaceResponse(placed=placed.placed, missing=placed.missing, pinned=placed.pinned)

    def Unpin(self, request: pb.UnpinRequest, context) -> pb.UnpinResponse:
        try:
            released = self._store.unpin(request.lease_id, owner_of(context))
        except LeaseOwnedElsewhere:
            return pb.UnpinResponse(released=False)  # as for an id never issued: a stranger learns nothing of it
        if self._pin_copies is not None:
            self._pin_copies.end(request.lease_id)  # released or already expired: its copies become cache
        return pb.UnpinResponse(released=released)

    def List(self, request: pb.ListRequest, context) -> pb.ListResponse:
        page, token = self._store.list_keys(request.namespace, request.prefix, request.page_size, request.page_token)
        return pb.ListResponse(
            blocks=[pb.Listed(block=_header(b.key, b.meta), tier=int(b.tier)) for b in page], next_page_token=token
        )

    def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        identity = current_identity()
        s = visible_stats(identity, self._store.stats(request.namespace))
        handoffs = self._handoffs()
        response = pb.StatsResponse(
            tiers=[
                pb.TierStats(
                    tier=int(t.tier), used_bytes=t.used_bytes, capacity_bytes=t.capacity_bytes, blocks=t.blocks,
                    degraded=t.degraded,
                )
                for t in s.tiers
            ],
            blocks=s.blocks,
            pinned_blocks=s.pinned_blocks,
            active_leases=s.active_leases,
            open_slots=s.open_slots,
            demotion_queue_depth=s.demotion_queue_depth,
            namespaces=s.namespaces,
            node_id=self._node.node_id,
            epoch=self._node.epoch,
            # Node-wide only for the admin: a tenant sees its namespace's, never the others' activity.
            open_handoffs=handoffs.open if identity.grant.admin else self._open_handoffs(request.namespace),
        )
        if identity.grant.admin:  # node-wide figures (kvstore.auth.stats)
            response.handoffs.CopyFrom(handoff_stats(handoffs))
            response.replication.CopyFrom(replication_stats(self._replication() if self._replication else None))
        return response


def handoff_stats(c: HandoffCounts) -> pb.HandoffStats:
    return pb.HandoffStats(
        open=c.open, opened=c.opened, completed=c.completed, expired=c.expired, pulls_ok=c.pulls_ok,
        pulls_failed=c.pulls_failed, pulled_bytes=c.pulled_bytes, pull_fallbacks=c.fallbacks,
    )


def replication_stats(r: ReplicationReport | None) -> pb.ReplicationStats:
    if r is None:
        return pb.ReplicationStats(enabled=False)
    both = [*r.namespaces, *r.pins]  # namespace rules and pins with replicas alike
    return pb.ReplicationStats(
        enabled=r.namespaces_enabled or r.max_pin_replicas >= 2, under_replicated=sum(n.under_replicated for n in both),
        copies_made=sum(n.copies_made for n in both), copies_failed=sum(n.copies_failed for n in both),
        rounds=r.rounds, last_round_unix_seconds=r.last_round_at, last_error=r.last_error,
    )

