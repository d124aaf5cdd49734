"""The TCP peer transport as a :class:`~kvstore.transport.base.Transport`: a daemon's blocks over its peer listener.

What another daemon's peer tier does through :class:`kvstore.peer.tcp.TcpPeerTransport`,
offered under the client-side transport contract so the same suite runs
over it (``tests/test_transport_contract.py``) and a client on another host
can read a daemon's blocks without gRPC. ``target`` is the daemon's
advertised peer address, ``tcp://host:port`` (``host:port`` also works).

Per-key failures of the peer protocol (a corrupt block, a key the peer
refused) raise here, the first one in key order, as the contract says:
a Transport either delivers every verified block it reports or raises.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.block import BlockMeta, checksum
from kvstore.errors import InvalidArgument
from kvstore.peer.tcp import TcpPeerClient
from kvstore.remote.base import ReadStatus
from kvstore.transport.base import Block, BlockInfo, BlockPut, Deadline, Place, Transport


class PeerTcpTransport(Transport):
    name = "peer-tcp"
    shared_memory = False
    scheme = "tcp"
    client_class = TcpPeerClient

    def __init__(self, target: str, *, token: str = "", max_connections: int = 16) -> None:
        self.address = target if "://" in target else f"{self.scheme}://{target}"
        self._client = self.client_class(token=token, max_connections=max_connections)

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


def connect(target: str, **options) -> PeerTcpTransport:
    if not isinstance(target, str) or not target:
        raise InvalidArgument("the peer-tcp transport needs target='tcp://host:port' (the daemon's --peer-listen)")
    return PeerTcpTransport(target, **options)
