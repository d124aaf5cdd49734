"""The gRPC peer transport: a peer's blocks through its ordinary KVService Get.

Every daemon serves gRPC, so this transport needs nothing a peer would have
to turn on: it is the one the peer tier can always fall back to, and the
default until a faster data plane (``tcp://``) is advertised by both sides.
It drives :class:`~kvstore.client.aio.AsyncClient` (one per peer address,
kept in a bounded pool) with ``local_only`` Gets: the holder answers from its
own tiers and never reads through to its peers, so a fetch is never passed
on to a third node or back here.

Costs it does not hide: the bytes are streamed in gRPC messages (one copy
into the placed buffer), and :meth:`GrpcPeerTransport.lookup` moves the
bytes too (KVService has no metadata-only read that does not lease in the
holder's arena), which is why the peer tier reads rather than looks up.

A stream that carries a block failing its checksum ends there, so a batch
reports every key it had not delivered as ``CorruptBlock``; the peer tier
reads one key per call, where that is exact.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence

from kvstore.auth.credentials import ChannelSecurity
from kvstore.block import BlockMeta, checksum
from kvstore.client.aio import AsyncClient
from kvstore.errors import (
    CorruptBlock, DaemonUnavailable, DeadlineExceeded, InvalidArgument, StrataError, TierUnavailable,
)
from kvstore.peer.base import PeerAddress, PeerStats, PeerTransport
from kvstore.remote.base import MISS, Place, ReadResult, check_batch, time_left
from kvstore.transport.base import BlockInfo

MAX_CLIENTS = 64  # peer connections kept open; the least recently used is closed beyond it
CALL_TIMEOUT_S = 60.0  # gRPC's own deadline on each call; the caller's deadline is shorter and wins


class GrpcPeerTransport(PeerTransport):
    scheme = "grpc"
    writes = False

    def __init__(
        self, *, token: str | None = None, tls_ca: str | None = None, security: ChannelSecurity | None = None,
        max_clients: int = MAX_CLIENTS,
    ) -> None:
        """``token``: the bearer token this daemon presents to its peers (their policy must let it
        read the namespaces); ``tls_ca``: the CA that signed the peers' certificates, when they
        serve TLS. ``security`` instead of both: a ready :class:`ChannelSecurity`."""
        if max_clients < 1:
            raise InvalidArgument(f"max_clients is {max_clients}; keep at least one peer connection")
        self._security = security or ChannelSecurity.build(token=token, tls_ca=tls_ca)
        self._max_clients = max_clients
        self._clients: OrderedDict[str, AsyncClient] = OrderedDict()
        self._closing: set[asyncio.Task] = set()
        self._closed = False
        self._reads = self._hits = self._misses = self._read_bytes = self._corrupt = self._errors = 0

    name = "grpc peer transport"  # in messages (time_left, check_batch)

    def _client(self, address: str) -> AsyncClient:
        if self._closed:
            raise TierUnavailable("the gRPC peer transport is closed")
        client = self._clients.get(address)
        if client is not None:
            self._clients.move_to_end(address)
            return client
        peer = PeerAddress.parse(address)
        if peer.scheme != self.scheme:
            raise InvalidArgument(f"peer address {address!r} is not a grpc:// address")
        host = f"[{peer.host}]" if ":" in peer.host else peer.host
        client = AsyncClient(
            f"{host}:{peer.port}", timeout=CALL_TIMEOUT_S, retries=0, use_shm=False, security=self._security
        )
        self._clients[address] = client
        while len(self._clients) > self._max_clients:
            _, old = self._clients.popitem(last=False)
            self._close_later(old)
        return client

    def _close_later(self, client: AsyncClient) -> None:
        task = asyncio.ensure_future(client.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _drop(self, address: str) -> None:
        """Forget a connection that broke: the next call dials again."""
        client = self._clients.pop(address, None)
        if client is not None:
            self._close_later(client)

    async def read(
        self, address: str, namespace: str, keys: Sequence[bytes], place: Place, deadline: float
    ) -> list[ReadResult]:
        check_batch(self, "read", len(keys))
        left = time_left(self, "read", deadline)
        if not keys:
            return []
        client = self._client(address)
        declined: dict[int, BlockMeta] = {}

        def placement(i: int, info: BlockInfo):
            meta = BlockMeta(info.size, 0, info.parent, info.layout)  # the checksum is checked on arrival
            view = place(i, meta)
            if view is None:
                declined[i] = meta
            return view

        self._reads += 1
        try:
            async with asyncio.timeout(left):
                blocks = await client.get_into(namespace, list(keys), placement, local_only=True)
        except TimeoutError:
            self._errors += len(keys)
            return [ReadResult.failed(DeadlineExceeded(f"{address}: the deadline passed during the read"))] * len(keys)
        except CorruptBlock as err:
            self._corrupt += 1
            self._errors += len(keys)
            return [ReadResult.failed(CorruptBlock(f"{address}: {err}"))] * len(keys)
        except DaemonUnavailable as err:
            self._errors += 1
            self._drop(address)
            raise TierUnavailable(f"peer {address} cannot be reached or broke off: {err}") from None
        except StrataError:
            self._errors += 1
            raise
        results: list[ReadResult] = []
        for i, block in enumerate(blocks):
            if block is not None:
                data = memoryview(block.data)
                meta = BlockMeta(len(data), checksum(data), block.parent, block.layout)
                self._hits += 1
                self._read_bytes += meta.size
                results.append(ReadResult.hit(meta))
            elif i in declined:
                results.append(ReadResult.skipped(declined[i]))
            else:
                self._misses += 1
                results.append(MISS)
        return results

    async def lookup(self, address: str, namespace: str, keys: Sequence[bytes], deadline: float) -> list[BlockMeta | None]:
        """Metadata by reading each block into a scratch buffer (see the module docstring)."""
        scratch: list[bytearray] = []

        def place(_i: int, meta: BlockMeta) -> memoryview:
            scratch.append(bytearray(meta.size))
            return memoryview(scratch[-1])

        out: list[BlockMeta | None] = []
        for result in await self.read(address, namespace, keys, place, deadline):
            if result.error is not None:
                raise result.error
            out.append(result.meta)
        return out

    async def close(self) -> None:
        self._closed = True
        clients, self._clients = list(self._clients.values()), OrderedDict()
        for client in clients:
            self._close_later(client)
        if self._closing:
            await asyncio.wait(list(self._closing), timeout=5.0)

    def stats(self) -> PeerStats:
        return PeerStats(
            self.scheme, self._reads, self._hits, self._misses, self._read_bytes, 0, 0, self._corrupt, self._errors,
            len(self._clients),
        )
