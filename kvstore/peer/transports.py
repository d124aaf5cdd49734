"""A daemon's peer listeners as client-side :class:`~kvstore.transport.base.Transport`\\ s.

What another daemon's peer tier does through the peer protocol clients
(:class:`~kvstore.peer.tcp.TcpPeerClient` over TCP, and its UCX and UCX
shared-memory kinds), offered under the client-side transport contract, so
the same contract suite runs over them (``tests/transport/test_transport_contract.py``)
and a client on another host can read a daemon's blocks without gRPC. They
are registered in :data:`kvstore.transport.TRANSPORTS` as ``peer-tcp``,
``peer-ucx`` and ``peer-ucx-shm``, imported only when one is opened.

``target`` is the daemon's advertised peer address (``tcp://host:port``,
``ucx://host:port``, ``ucx-shm://<host id>:<port>``; for the first two
``host:port`` also works). The UCX kinds need ucxx (the ``ucx`` extra);
without it opening one raises ``UcxUnavailable`` with the fix.

Per-key failures of the peer protocol (a corrupt block, a key the peer
refused) raise here, the first one in key order, as the contract says: a
Transport either delivers every verified block it reports or raises.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.block import BlockMeta, checksum
from kvstore.errors import InvalidArgument
from kvstore.peer.tcp import TcpPeerClient
from kvstore.remote.base import ReadStatus
from kvstore.transport.base import Block, BlockInfo, BlockPut, Deadline, Place, Transport


class PeerProtocolTransport(Transport):
    """The peer protocol over one kind of connection (``client_class``), as a Transport named ``name``."""

    shared_memory = False

    def __init__(self, target: str, *, name: str = "peer-tcp", scheme: str = "tcp",
                 client_class: type[TcpPeerClient] = TcpPeerClient, token: str = "", max_connections: int = 16) -> None:
        self.name, self.scheme = name, scheme
        self.address = target if "://" in target else f"{scheme}://{target}"
        self._client = client_class(token=token, max_connections=max_connections)

    def put(self, namespace: str, blocks: Sequence[BlockPut], deadline: Deadline) -> list[bool]:
        deadline.check()
        triples = []
        for b in blocks:
            view = memoryview(b.value).cast("B")
            triples.append((b.key, view, BlockMeta(len(view), checksum(view), b.parent, b.layout)))
        out = []
        for result, _ in self._client.write(self.address, namespace, triples, deadline):
            if result.error is not None:
                raise result.error
            out.append(result.status.value == "stored")
        return out

    def get_into(self, namespace: str, keys: Sequence[bytes], place: Place | None,
                 deadline: Deadline) -> list[Block | None]:
        keys = list(keys)
        deadline.check()
        views: dict[int, memoryview] = {}

        def placed(i: int, meta: BlockMeta) -> memoryview | None:
            info = BlockInfo(keys[i], meta.size, meta.layout, meta.parent)
            view = memoryview(bytearray(meta.size)) if place is None else place(i, info)
            if view is not None:
                views[i] = view
            return view

        got = self._client.read(self.address, namespace, keys, placed, deadline)
        out: list[Block | None] = []
        for i, g in enumerate(got):
            r = g.result
            if r.status is ReadStatus.FAILED:
                raise r.error
            if r.status is not ReadStatus.HIT:
                out.append(None)
                continue
            m = r.meta
            out.append(Block(keys[i], views[i][: m.size], m.layout, m.parent, g.tier))
        return out

    def close(self) -> None:
        self._client.close()


def connect_tcp(target: str, **options) -> PeerProtocolTransport:
    if not isinstance(target, str) or not target:
        raise InvalidArgument("the peer-tcp transport needs target='tcp://host:port' (the daemon's --peer-listen)")
    return PeerProtocolTransport(target, **options)


def connect_ucx(target: str, **options) -> PeerProtocolTransport:
    if not isinstance(target, str) or not target:
        raise InvalidArgument("the peer-ucx transport needs target='ucx://host:port' (the daemon's --peer-ucx-listen)")
    from kvstore.peer.ucx import UcxPeerClient
    from kvstore.peer.ucx_link import UcxRuntime

    UcxRuntime.get()
    return PeerProtocolTransport(target, name="peer-ucx", scheme="ucx", client_class=UcxPeerClient, **options)


def connect_ucx_shm(target: str, **options) -> PeerProtocolTransport:
    if not isinstance(target, str) or "://" not in target:
        raise InvalidArgument(
            "the peer-ucx-shm transport needs target='ucx-shm://<host id>:<port>' (the address a daemon with "
            "--peer-ucx-shm advertises)"
        )
    from kvstore.peer.ucx_shm import UcxShmPeerClient
    from kvstore.peer.ucx_shm_link import UcxShmRuntime

    UcxShmRuntime.get()
    return PeerProtocolTransport(target, name="peer-ucx-shm", scheme="ucx-shm", client_class=UcxShmPeerClient,
                                 **options)
