"""The gRPC peer transport: a peer's blocks through its ordinary KVService Get.

Every daemon serves gRPC, so this transport needs nothing a peer would have
to turn on: it is the one the peer tier can always fall back to, and the
default until a faster data plane (``tcp://``) is advertised by both sides.
It keeps one asyncio gRPC channel per peer address (a bounded pool) and
reads with ``local_only`` Gets, assembled by the same
:class:`~kvstore.transport.grpc.blocks.GetAssembler` the clients use: the
holder answers from its own tiers and never reads through to its peers, so
a fetch is never passed on to a third node or back here.

Costs it does not hide: the bytes are streamed in gRPC messages (one copy
into the placed buffer), and :meth:`GrpcPeerTransport.lookup` moves the
bytes too (KVService has no metadata-only read that does not lease in the
holder's arena), which is why the peer tier reads rather than looks up.

A stream that carries a block failing its checksum ends there, so a batch
reports every key it had not delivered as ``CorruptBlock``; the peer tier
reads one key per call, where that is exact.

:class:`GrpcPeerClient` is the blocking twin, with the TCP client's
(:class:`~kvstore.peer.tcp.TcpPeerClient`) ``read``: what a decode daemon
pulls a handoff with when the prefill node offers no faster data plane,
or that one cannot be reached (:mod:`kvstore.handoff.pull`). It reads the
stream itself rather than through the Get assembler: each header carries
the block's checksum, so ``place`` sees the holder's full metadata before
any byte moves (a block not the one expected is refused there), and each
chunk is copied straight into the placed view and hashed there, as the TCP
client hashes what ``recv_into`` landed: one copy, one pass, and only a
block whose bytes match is a hit.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Sequence

import grpc

from kvstore.api.v1 import kv_pb2 as pb
from kvstore.api.v1 import kv_pb2_grpc
from kvstore.auth.credentials import ChannelSecurity
from kvstore.block import BlockMeta, Checksummer, TierName, checksum, validate_namespace
from kvstore.errors import (
    Cancelled, CorruptBlock, DaemonUnavailable, DeadlineExceeded, InvalidArgument, StrataError, TierUnavailable,
)
from kvstore.peer.base import PeerAddress, PeerStats, PeerTransport
from kvstore.peer.tcp import Got
from kvstore.remote.base import MISS, MetaPlace, ReadResult, ReadStatus, check_batch, time_left
from kvstore.rpc.status import from_rpc_error
from kvstore.transport.base import BlockInfo, Deadline
from kvstore.transport.grpc.blocks import CHANNEL_OPTIONS, GetAssembler

MAX_CLIENTS = 64  # peer connections kept open; the least recently used is closed beyond it
CALL_TIMEOUT_S = 60.0  # gRPC's own deadline on each call; the caller's deadline is shorter and wins
OFF_LOOP_BYTES = 1 << 20  # a block larger than this is checksummed in a worker thread, not on the loop


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
        self._clients: OrderedDict[str, tuple[grpc.aio.Channel, kv_pb2_grpc.KVServiceStub]] = OrderedDict()
        self._closing: set[asyncio.Task] = set()
        self._closed = False
        self._reads = self._hits = self._misses = self._read_bytes = self._corrupt = self._errors = 0

    name = "grpc peer transport"  # in messages (time_left, check_batch)

    def _stub(self, address: str) -> kv_pb2_grpc.KVServiceStub:
        if self._closed:
            raise TierUnavailable("the gRPC peer transport is closed")
        found = self._clients.get(address)
        if found is not None:
            self._clients.move_to_end(address)
            return found[1]
        peer = PeerAddress.parse(address)
        if peer.scheme != self.scheme:
            raise InvalidArgument(f"peer address {address!r} is not a grpc:// address")
        host = f"[{peer.host}]" if ":" in peer.host else peer.host
        channel = self._security.aio_channel(f"{host}:{peer.port}", CHANNEL_OPTIONS)
        self._clients[address] = (channel, kv_pb2_grpc.KVServiceStub(channel))
        while len(self._clients) > self._max_clients:
            _, (old, _) = self._clients.popitem(last=False)
            self._close_later(old)
        return self._clients[address][1]

    def _close_later(self, channel: grpc.aio.Channel) -> None:
        task = asyncio.ensure_future(channel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _drop(self, address: str) -> None:
        """Forget a connection that broke: the next call dials again."""
        found = self._clients.pop(address, None)
        if found is not None:
            self._close_later(found[0])

    async def read(
        self, address: str, namespace: str, keys: Sequence[bytes], place: MetaPlace, deadline: float
    ) -> list[ReadResult]:
        check_batch(self, "read", len(keys))
        left = time_left(self, "read", deadline)
        if not keys:
            return []
        stub = self._stub(address)
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
                blocks = await _get(stub, namespace, list(keys), placement)
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
        channels, self._clients = [c for c, _ in self._clients.values()], OrderedDict()
        for channel in channels:
            self._close_later(channel)
        if self._closing:
            await asyncio.wait(list(self._closing), timeout=5.0)

    def stats(self) -> PeerStats:
        return PeerStats(
            self.scheme, self._reads, self._hits, self._misses, self._read_bytes, 0, 0, self._corrupt, self._errors,
            len(self._clients),
        )


async def _get(stub: kv_pb2_grpc.KVServiceStub, namespace: str, keys: list[bytes], place) -> list:
    """One ``local_only`` Get, each block assembled into what ``place`` gives and checked against
    its header's checksum; a failed call raises the Strata error it stands for."""
    validate_namespace(namespace)
    assembler = GetAssembler(place)
    large = False
    try:
        async for msg in stub.Get(pb.GetRequest(namespace=namespace, keys=keys, local_only=True),
                                  timeout=CALL_TIMEOUT_S):
            if msg.WhichOneof("part") == "header":  # on the loop: it calls the placement
                large = msg.header.block.size > OFF_LOOP_BYTES
                assembler.feed(msg)
            elif large:  # the block's last chunk checksums all of it
                await asyncio.to_thread(assembler.feed, msg)
            else:
                assembler.feed(msg)
    except grpc.RpcError as err:
        raise from_rpc_error(err) from None
    return assembler.finish()


class GrpcPeerClient:
    """Blocking reads of peer blocks through their KVService Get (``local_only``). Thread-safe.

    One channel per peer address, at most ``max_channels`` (the least recently used is closed
    beyond it); gRPC reconnects a channel by itself, so a peer that restarts needs nothing here."""

    scheme = "grpc"

    def __init__(self, *, token: str = "", tls_ca: str = "", security: ChannelSecurity | None = None,
                 max_channels: int = MAX_CLIENTS) -> None:
        if max_channels < 1:
            raise InvalidArgument(f"max_channels is {max_channels}; keep at least one peer channel")
        self._security = security or ChannelSecurity.build(token=token or None, tls_ca=tls_ca or None)
        self._max = max_channels
        self._lock = threading.Lock()
        self._channels: OrderedDict[str, tuple[grpc.Channel, kv_pb2_grpc.KVServiceStub]] = OrderedDict()
        self._closed = False
        self.counts = dict(reads=0, hits=0, misses=0, read_bytes=0, corrupt=0, errors=0)

    def _stub(self, address: str) -> kv_pb2_grpc.KVServiceStub:
        peer = PeerAddress.parse(address)
        if peer.scheme != self.scheme:
            raise InvalidArgument(f"peer address {address!r} is not grpc://host:port")
        with self._lock:
            if self._closed:
                raise TierUnavailable("the gRPC peer client is closed")
            found = self._channels.get(address)
            if found is not None:
                self._channels.move_to_end(address)
                return found[1]
            host = f"[{peer.host}]" if ":" in peer.host else peer.host
            channel = self._security.channel(f"{host}:{peer.port}", CHANNEL_OPTIONS)
            stub = kv_pb2_grpc.KVServiceStub(channel)
            self._channels[address] = (channel, stub)
            old = self._channels.popitem(last=False)[1][0] if len(self._channels) > self._max else None
        if old is not None:
            old.close()  # its calls in flight fail UNAVAILABLE: a peer read fails, the caller tries again
        return stub

    def close(self) -> None:
        """Close every channel; calls in flight fail ``TierUnavailable``."""
        with self._lock:
            self._closed = True
            channels, self._channels = [c for c, _ in self._channels.values()], OrderedDict()
        for channel in channels:
            channel.close()

    def read(self, address: str, namespace: str, keys: Sequence[bytes], place: MetaPlace, deadline: Deadline) -> list[Got]:
        """Per key a Got, as :meth:`kvstore.peer.tcp.TcpPeerClient.read` answers (``place`` required)."""
        validate_namespace(namespace)
        keys = list(keys)
        if not keys:
            return []
        deadline.check()
        stream = self._stub(address).Get(pb.GetRequest(namespace=namespace, keys=keys, local_only=True),
                                         timeout=deadline.remaining())
        forget = deadline.on_cancel(stream.cancel)
        reading = _Reading(address, place, len(keys))
        try:
            for msg in stream:
                reading.feed(msg)
            reading.finish()
        except _PlaceFailed as failed:
            stream.cancel()  # ``place`` refused a block: its error ends the call as it is
            self._count_error()
            raise failed.err from None
        except (grpc.RpcError, StrataError) as err:  # the stream broke, or the peer broke the protocol
            stream.cancel()
            self._count_error()
            if deadline.cancelled:
                raise Cancelled("the call was cancelled; what it held on the peer is given back") from None
            error = self._error(address, err) if isinstance(err, grpc.RpcError) else err
            if reading.answered == 0:
                raise error from None  # nothing answered: the whole call failed
            reading.fail_rest(error)
        finally:
            forget()
        if reading.answered < len(keys):
            reading.fail_rest(TierUnavailable(f"peer {address} ended a read without answering every key"))
        self._count(reading.out)
        return reading.out

    @staticmethod
    def _error(address: str, err: grpc.RpcError) -> StrataError:
        error = from_rpc_error(err)
        if isinstance(error, DaemonUnavailable):  # the peer is down or away: the next holder, or transport
            return TierUnavailable(f"peer {address} cannot be reached or broke off: {error}")
        return error

    def _count_error(self) -> None:
        with self._lock:
            self.counts["errors"] += 1

    def _count(self, out: list[Got]) -> None:
        with self._lock:
            c = self.counts
            c["reads"] += 1
            for g in out:
                r = g.result
                c["hits"] += r.is_hit
                c["misses"] += r.status is ReadStatus.MISS
                c["read_bytes"] += r.meta.size if r.is_hit else 0
                c["corrupt"] += isinstance(r.error, CorruptBlock)
                c["errors"] += r.error is not None


class _PlaceFailed(Exception):
    """The caller's ``place`` raised: its error ends the call as it is."""

    def __init__(self, err: BaseException) -> None:
        self.err = err


class _Reading:
    """One Get stream read into placed views: each block hashed as its chunks land."""

    def __init__(self, address: str, place: MetaPlace, n: int) -> None:
        self._address = address
        self._place = place
        self.out: list[Got] = []
        self._n = n
        self._meta: BlockMeta | None = None
        self._tier: TierName | None = None
        self._view: memoryview | None = None
        self._refused: StrataError | None = None  # the placed view cannot take the block
        self._hasher = Checksummer()
        self._filled = 0

    @property
    def answered(self) -> int:
        return len(self.out)

    def feed(self, msg: pb.GetResponse) -> None:
        if msg.WhichOneof("part") == "header":
            self._end_block()
            if len(self.out) >= self._n:
                raise TierUnavailable(f"peer {self._address} answered more keys than were asked")
            if not msg.header.found:
                self.out.append(Got(MISS))
                return
            self._start_block(msg.header)
            return
        if self._meta is None:
            raise TierUnavailable(f"peer {self._address} sent block bytes before their header")
        end = self._filled + len(msg.chunk)
        if end > self._meta.size:
            raise TierUnavailable(f"peer {self._address} sent more bytes than the block's header declared")
        if self._view is not None:
            dst = self._view[self._filled : end]
            dst[:] = msg.chunk
            self._hasher.update(dst)  # the bytes as they now are in the placed view, read back from cache
        self._filled = end
        if end == self._meta.size:
            self._end_block()

    def _start_block(self, header: pb.GetHeader) -> None:
        b = header.block
        i = len(self.out)
        self._meta = BlockMeta(b.size, b.checksum, b.parent_key or None, b.layout)
        try:
            self._tier = TierName(header.tier)
        except ValueError:
            self._tier = None
        try:
            view = self._place(i, self._meta)
        except BaseException as err:
            raise _PlaceFailed(err) from None
        self._view = None if view is None else memoryview(view).cast("B")
        self._refused = None
        if self._view is not None and (len(self._view) < b.size or self._view.readonly):
            why = "read-only" if self._view.readonly else f"{len(self._view)} bytes; the block has {b.size}"
            self._refused = InvalidArgument(f"the buffer for block {i} is {why}: pass a larger, writable one")
            self._view = None
        self._hasher, self._filled = Checksummer(), 0
        if b.size == 0:
            self._end_block()

    def _end_block(self) -> None:
        meta, self._meta = self._meta, None
        if meta is None:
            return
        view, self._view = self._view, None
        i = len(self.out)
        if self._refused is not None:
            self.out.append(Got(ReadResult.failed(self._refused)))
        elif view is None:
            self.out.append(Got(ReadResult.skipped(meta), self._tier))
        elif self._hasher.value() != meta.checksum:
            self.out.append(Got(ReadResult.failed(CorruptBlock(
                f"block {i} from peer {self._address} failed its checksum on arrival (in transit or at the holder); "
                "its bytes were not delivered"
            ))))
        else:
            self.out.append(Got(ReadResult.hit(meta), self._tier))

    def finish(self) -> None:
        if self._meta is not None:
            raise TierUnavailable(f"peer {self._address} ended the stream inside block {len(self.out)}")

    def fail_rest(self, error: StrataError) -> None:
        self._meta = self._view = None
        self.out += [Got(ReadResult.failed(error))] * (self._n - len(self.out))
