"""Peers: chunks read from other weight nodes' caches, and a swarm that asks the origin once per chunk.

:class:`PeerChunkSource` is a :class:`~weightcache.sources.ChunkSource` over one
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

Every ``ReadChunk`` a :class:`PeerChunkSource` sends has a short deadline of its
own: the peer waits at most :data:`POLL_S` per call, and the call may take
``read_timeout_s`` (plus the chunk's transfer at :data:`MIN_PEER_BYTES_PER_S`)
beyond that. A longer wait for the owner is many such calls, for as long as
the peer answers "not yet" (trailing metadata :data:`PENDING_KEY`); each
says how long it has waited so far (:data:`WAITED_KEY`), so the peer's join
window is counted once, not per call. One deadline ("one long wait") could
not tell a peer that is fetching the chunk from one that is hung (a stopped
process, a wedged host): both are silent until it ends. With short calls a
hung peer costs one call's deadline: the read fails UNAVAILABLE, the chunk
goes to the next holder or the origin in the same round, and the peer is
passed over (UNAVAILABLE at once) for ``suspect_s``, so the chunks behind it
do not each wait out a deadline too. A peer that never sends the pending
metadata (an older node) is asked once: its first answer is final.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from kvstore.auth.credentials import NONE, ChannelSecurity
from kvstore.errors import ResourceExhausted
from kvstore.rpc.status import from_rpc_error
from weightcache.api.v1 import weights_pb2 as pb
from weightcache.api.v1 import weights_pb2_grpc as pb_grpc
from weightcache.errors import OriginThrottled, OriginUnavailable
from weightcache.manifest import MAX_CHUNK_BYTES
from weightcache.sources import AdaptiveLimit, ChunkRef, ChunkSource

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + (1 << 20)  # the largest chunk a manifest allows, and framing
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
POLL_S = 2.0  # the longest one ReadChunk waits at the peer
MIN_PEER_BYTES_PER_S = 64 << 20  # the slowest transfer a call's deadline allows for (16 MiB: 0.25 s)
DEFAULT_READ_TIMEOUT_S = 10.0
DEFAULT_SUSPECT_S = 30.0
PENDING_KEY = "strata-chunk-pending"  # trailing metadata "1": not here yet, a fetch here may bring it
WAITED_KEY = "strata-waited-ms"  # request metadata: how long the caller has waited on this chunk


class PeerChunkSource(ChunkSource):
    kind = "peer"

    def __init__(self, address: str, digest: str, *, concurrency: int = 4, wait_s: float = 0.0,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S, suspect_s: float = DEFAULT_SUSPECT_S,
                 security: ChannelSecurity = NONE) -> None:
        if not (0 <= wait_s and 0 < read_timeout_s and 0 <= suspect_s):
            raise ValueError("a peer's wait and suspect time must be >= 0 s, its read timeout > 0 s")
        self.name = f"peer {address}"
        self.address = address
        self.digest = digest
        self.wait_s = wait_s
        self.read_timeout_s = read_timeout_s
        self.suspect_s = suspect_s
        self.limit = AdaptiveLimit(concurrency)
        self.security = security  # the token or certificate this node presents (weightcache.access)
        self._channel: grpc.aio.Channel | None = None  # made on the planner's loop, where it is used
        self._quiet_until = 0.0  # monotonic: until then the peer is passed over (it did not answer in time)

    async def read(self, ref: ChunkRef, into: memoryview) -> memoryview | None:
        if time.monotonic() < self._quiet_until:
            raise OriginUnavailable(f"{self.name} did not answer a read in time lately: passed over for now")
        if self._channel is None:
            self._channel = self.security.aio_channel(self.address, options=CHANNEL_OPTIONS)
        stub = pb_grpc.WeightServiceStub(self._channel)
        start = time.monotonic()
        end = start + self.wait_s
        asked = False  # the peer said "not yet" at least once
        while True:
            now = time.monotonic()
            poll = min(POLL_S, max(0.0, end - now))
            deadline = poll + self.read_timeout_s + ref.length / MIN_PEER_BYTES_PER_S
            request = pb.ReadChunkRequest(digest=self.digest, file=ref.file, chunk=ref.chunk, wait_ms=int(poll * 1000))
            call = stub.ReadChunk(request, timeout=deadline, metadata=((WAITED_KEY, str(int((now - start) * 1000))),))
            try:
                reply = await call
                trailing = await call.trailing_metadata()
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    self._quiet_until = time.monotonic() + self.suspect_s
                    log.warning("%s did not answer a chunk read in %.1f s: passed over for %.0f s",
                                self.name, deadline, self.suspect_s)
                    raise OriginUnavailable(
                        f"{self.name}: {ref.path} chunk {ref.chunk}: no answer in {deadline:.1f} s (a hung node?); "
                        "read from another source"
                    ) from None
                cause = from_rpc_error(err)
                if isinstance(cause, ResourceExhausted):
                    if asked and time.monotonic() + cause.retry_after_s < end:  # the chunk is coming: ask again
                        await asyncio.sleep(cause.retry_after_s)
                        continue
                    raise OriginThrottled(f"{self.name} is at its upload bound") from None
                raise OriginUnavailable(f"{self.name}: {ref.path} chunk {ref.chunk}: {cause}") from None
            if reply.found:
                break
            pending = any(key == PENDING_KEY and value == "1" for key, value in trailing or ())
            if not pending or time.monotonic() >= end:
                return None
            asked = True
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
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S, security: ChannelSecurity = NONE) -> None:
        if me not in members:
            raise ValueError(f"this node's address {me!r} must be one of the swarm's members {members}")
        if len(set(members)) != len(members):
            raise ValueError("a swarm member is listed twice")
        if not (0 <= wait_s and 0 < read_timeout_s):
            raise ValueError("the swarm's peer wait must be >= 0 s and its peer read timeout > 0 s")
        self.members = sorted(members)
        self.me = me
        self.wait_s = wait_s
        self.concurrency = concurrency
        self.read_timeout_s = read_timeout_s
        self.security = security

    def owner(self, digest: bytes) -> str:
        return self.members[int.from_bytes(digest[:8], "little") % len(self.members)]

    def second(self, digest: bytes) -> str | None:
        """The member asked first for a chunk this node owns (none in a swarm of one)."""
        others = [m for m in self.members if m != self.me]
        return others[int.from_bytes(digest[:8], "little") % len(others)] if others else None

    def route(self, manifest):
        """(sources for a chunk, a plan sort key putting this node's chunks first) for one model:
        what :func:`open_model`'s ``route`` asks for."""
        peers = {
            m: PeerChunkSource(m, manifest.digest, concurrency=self.concurrency, wait_s=self.wait_s,
                          read_timeout_s=self.read_timeout_s, security=self.security)
            for m in self.members if m != self.me
        }
        # Asked without a wait: a member that holds one of this node's own chunks already serves it.
        present = {
            m: PeerChunkSource(m, manifest.digest, concurrency=self.concurrency, wait_s=0.0,
                          read_timeout_s=self.read_timeout_s, security=self.security)
            for m in peers
        }

        def sources(ref: ChunkRef):
            owner = self.owner(ref.digest)
            if owner != self.me:
                return [peers[owner]]
            # This node's own chunk. In a swarm that starts together nobody else has it (one quick miss,
            # then the origin); a node that joins a swarm which already holds the model (a scale-up)
            # takes it from a member instead of fetching the origin's copy again.
            other = self.second(ref.digest)
            return [present[other]] if other is not None else []

        def order(item: tuple[int, int]) -> int:
            return 0 if self.owner(manifest.files[item[0]].chunks[item[1]]) == self.me else 1

        return sources, order
