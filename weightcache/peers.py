"""Peers: chunks read from other weight nodes' caches, and a swarm that asks the origin once per chunk.

:class:`PeerSource` is a :class:`~weightcache.sources.ChunkSource` over one
other node's ``WeightService.ReadChunk``. It never verifies (the planner
does, as for every source): a peer that hands back damaged bytes costs a
try and, after ``corrupt_retries``, is passed over for the origin; a peer
that is gone or dies mid-read is UNAVAILABLE, and the planner moves on to
the next source in the same round. A full peer (its upload bound reached)
answers RESOURCE_EXHAUSTED, which the planner treats as throttling.

:class:`Swarm` is how many nodes fetching one model share the origin: each
chunk has one *owner* among the members, chosen by its digest (a hash
partition, so every node computes the same owner with no coordination and
identical chunks share one owner). A node fetches the chunks it owns
first, from the origin, and asks each other chunk's owner for it, waiting
(bounded) while the owner is still fetching it; the origin is the fallback
when the owner is gone, slow past the wait, or gives bad bytes. So the
origin serves each chunk about once however many nodes start together.
Members are listed explicitly (``--peer``): a static swarm, the same list on
every node. :mod:`weightcache.index_swarm` finds them, and each chunk's
holders, in the prefix index instead.
"""

from __future__ import annotations

import grpc

from kvstore.auth.credentials import NONE, ChannelSecurity
from kvstore.errors import ResourceExhausted
from kvstore.rpc.status import from_rpc_error
from weightcache.api.v1 import weights_pb2 as pb
from weightcache.api.v1 import weights_pb2_grpc as pb_grpc
from weightcache.errors import OriginThrottled, OriginUnavailable
from weightcache.manifest import MAX_CHUNK_BYTES
from weightcache.sources import AdaptiveLimit, ChunkRef, ChunkSource

MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + (1 << 20)  # the largest chunk a manifest allows, and framing
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


class PeerSource(ChunkSource):
    kind = "peer"

    def __init__(self, address: str, digest: str, *, concurrency: int = 4, wait_s: float = 0.0,
                 security: ChannelSecurity = NONE) -> None:
        self.name = f"peer {address}"
        self.address = address
        self.digest = digest
        self.wait_ms = int(wait_s * 1000)
        self.limit = AdaptiveLimit(concurrency)
        self.security = security  # the token or certificate this node presents (weightcache.access)
        self._channel: grpc.aio.Channel | None = None  # made on the planner's loop, where it is used

    async def read(self, ref: ChunkRef, into: memoryview) -> memoryview | None:
        if self._channel is None:
            self._channel = self.security.aio_channel(self.address, options=CHANNEL_OPTIONS)
        stub = pb_grpc.WeightServiceStub(self._channel)
        request = pb.ReadChunkRequest(digest=self.digest, file=ref.file, chunk=ref.chunk, wait_ms=self.wait_ms)
        try:
            reply = await stub.ReadChunk(request, timeout=self.wait_ms / 1000 + 60)
        except grpc.RpcError as err:
            cause = from_rpc_error(err)
            if isinstance(cause, ResourceExhausted):
                raise OriginThrottled(f"{self.name} is at its upload bound") from None
            raise OriginUnavailable(f"{self.name}: {ref.path} chunk {ref.chunk}: {cause}") from None
        if not reply.found:
            return None
        if len(reply.data) != ref.length:
            return memoryview(reply.data)  # wrong length fails the digest: counted as a corrupt copy
        into[: ref.length] = reply.data
        return into[: ref.length]

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


class Swarm:
    """The members fetching one model together (this node's address among them) and who owns what."""

    def __init__(self, members: list[str], me: str, *, wait_s: float = 120.0, concurrency: int = 4,
                 security: ChannelSecurity = NONE) -> None:
        if me not in members:
            raise ValueError(f"this node's address {me!r} must be one of the swarm's members {members}")
        if len(set(members)) != len(members):
            raise ValueError("a swarm member is listed twice")
        self.members = sorted(members)
        self.me = me
        self.wait_s = wait_s
        self.concurrency = concurrency
        self.security = security

    def owner(self, digest: bytes) -> str:
        return self.members[int.from_bytes(digest[:8], "little") % len(self.members)]

    def route(self, manifest):
        """(sources for a chunk, a plan sort key putting this node's chunks first) for one model:
        what :func:`open_model`'s ``route`` asks for."""
        peers = {
            m: PeerSource(m, manifest.digest, concurrency=self.concurrency, wait_s=self.wait_s, security=self.security)
            for m in self.members if m != self.me
        }

        def sources(ref: ChunkRef):
            owner = self.owner(ref.digest)
            return [] if owner == self.me else [peers[owner]]

        def order(item: tuple[int, int]) -> int:
            return 0 if self.owner(manifest.files[item[0]].chunks[item[1]]) == self.me else 1

        return sources, order
