"""The peer data plane's contract: moving blocks between two daemons.

A :class:`PeerTransport` reads blocks a peer daemon holds straight into
buffers this daemon chose (an arena slot its store reserved), and writes
blocks into a peer's store (prefill/decode handoff pushes, replication).
The peer tier (a :class:`~kvstore.remote.base.RemoteSource` that asks the
index for holders) calls it; the holder's address comes from the index's
node record, as the peer advertised it (``Daemon.peer_addresses()``).

It is the remote-source contract (:mod:`kvstore.remote.base`) with an
address in front, so the peer tier passes its own ``place``, ``deadline``
and results through unchanged:

- **Coroutines on one event loop**, an absolute ``deadline`` on
  :func:`time.monotonic`. Blocking socket I/O runs in a worker thread, never
  on the loop; ``place`` still runs on the loop thread, as the remote-source
  contract says.
- ``read(address, namespace, keys, place, deadline) -> list[ReadResult]``:
  one round trip. For each found block ``place(i, meta)`` is called before
  its bytes move and returns a writable view of at least ``meta.size``
  bytes, or None to skip it (SKIPPED: its bytes are not delivered). A HIT's
  bytes were verified against ``meta.checksum`` after they landed in that
  view. Per key: HIT, MISS, SKIPPED, or FAILED with the error
  (``CorruptBlock``: the bytes that arrived fail their checksum, in transit
  or at the holder; ``TierUnavailable``: the peer died or the connection
  broke before this key was done; ``DeadlineExceeded``: the deadline passed
  first; ``InvalidArgument``: ``place`` returned a view too small). A view
  placed but not a HIT may be partly written; give it back.
- ``lookup(address, namespace, keys, deadline) -> list[BlockMeta | None]``:
  the metadata only, no bytes move (the peer tier's ``lookup``).
- ``write(address, namespace, blocks, deadline) -> list[WriteResult]``:
  ``(key, bytes, meta)`` triples; the peer checks each block against
  ``meta`` and stores it whole or not at all; a key it holds already is
  PRESENT. A transport without writes raises ``InvalidArgument`` naming the
  transport (:attr:`PeerTransport.writes` says which).
- ``hold(address, namespace, keys, lease_s, deadline) -> Held``: pin blocks
  the peer holds under one lease of ``lease_s`` (the peer may grant less: at
  most its longest lease) on behalf of this node's pin; ``Held.held`` says
  per key whether it was there and is now pinned. ``release(address,
  lease_ids, deadline) -> list[bool]`` ends such holds early (False: it had
  ended, or was another caller's). A hold is bound to the caller's
  principal, so any connection of the same node may end it; one never
  released ends at its deadline. A transport whose ``writes`` is True also
  holds; the others raise ``InvalidArgument`` as for ``write``.
- Whole-call errors, raised when nothing was tried or the peer refused the
  batch as a whole: ``DeadlineExceeded`` (deadline already passed),
  ``TierUnavailable`` (the peer cannot be reached: try the next holder),
  ``InvalidArgument`` (a bad address or batch), the peer's refusals as the
  daemon's own classes (``Unauthenticated``, ``PermissionDenied`` — a
  namespace this node may not read reads the same whether or not it exists
  there — ``UnknownNamespace``, and ``Overloaded`` with ``retry_after_s``:
  the peer is at a limit, come back after the delay or try another holder).
  A transport does not retry.
- **Cancelling** the awaiting task stops the transfer promptly: the socket
  is shut, the connection is dropped from the pool, what the peer leased for
  it is released or expires.
- ``close()`` ends calls in flight (their keys fail ``TierUnavailable``) and
  closes pooled connections. Idempotent.

Addresses are URLs whose scheme names the transport: ``tcp://host:port``
(:mod:`kvstore.peer.tcp`), ``ucx://host:port`` (:mod:`kvstore.peer.ucx`),
``ucx-shm://<host id>:port`` (:mod:`kvstore.peer.ucx_shm`: UCX shared memory,
meaningful on its own host only). A daemon advertises one address per
transport it serves; :data:`kvstore.peer.registry.PEER_TRANSPORTS` maps a
scheme to the implementation, so a caller picks the first scheme both sides have, a
same-host-only one first where it :meth:`~PeerTransport.reaches` the holder.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvstore.block import BlockMeta
from kvstore.errors import InvalidArgument
from kvstore.remote.base import MetaPlace, ReadResult, WriteResult

__all__ = ["Held", "PeerAddress", "PeerStats", "PeerTransport", "MetaPlace", "ReadResult", "WriteResult"]


@dataclass(frozen=True, slots=True)
class PeerAddress:
    """``scheme://host:port`` split; ``str()`` gives it back."""

    scheme: str
    host: str
    port: int

    @classmethod
    def parse(cls, address: str) -> PeerAddress:
        try:
            parts = urlsplit(address)
            port = parts.port
        except ValueError as err:
            raise InvalidArgument(f"peer address {address!r} is malformed ({err}): write scheme://host:port") from None
        if not parts.scheme or not parts.hostname or port is None:
            raise InvalidArgument(f"peer address {address!r} is not scheme://host:port (e.g. tcp://10.0.0.7:50061)")
        return cls(parts.scheme, parts.hostname, port)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Held:
    """A peer's answer to a hold: its lease (0: none of the keys was there), for how long, and per key."""

    lease_id: int
    lease_s: float
    held: list[bool]


@dataclass(frozen=True, slots=True)
class PeerStats:
    """Traffic of one transport object, over every peer it talked to."""

    scheme: str
    reads: int  # read calls answered
    hits: int
    misses: int
    read_bytes: int  # verified bytes delivered
    writes: int
    written_bytes: int
    corrupt: int  # blocks that failed their checksum on arrival
    errors: int  # whole calls that raised, and keys that failed
    open_connections: int


class PeerTransport(abc.ABC):
    """Reads (and writes) blocks of a peer daemon; the contract is the module docstring."""

    #: The address scheme this transport serves (``tcp``, ``ucx``).
    scheme: str = ""
    #: Whether :meth:`write` (and :meth:`hold`, :meth:`release`) is supported.
    writes: bool = False
    #: Whether it reaches daemons on this host only (shared memory). A reader takes such a
    #: transport first for a holder it :meth:`reaches`, and never for one elsewhere.
    same_host_only: bool = False

    def reaches(self, address: str) -> bool:
        """Whether a daemon at ``address`` can be reached from here at all (False: use another scheme)."""
        return True

    @abc.abstractmethod
    async def read(
        self, address: str, namespace: str, keys: Sequence[bytes], place: MetaPlace, deadline: float
    ) -> list[ReadResult]:
        """Per key a ReadResult; hits are verified and in the views ``place`` gave."""

    @abc.abstractmethod
    async def lookup(self, address: str, namespace: str, keys: Sequence[bytes], deadline: float) -> list[BlockMeta | None]:
        """Per key the peer's metadata, or None on a miss; no bytes move."""

    async def write(
        self, address: str, namespace: str,
        blocks: Sequence[tuple[bytes, bytes | bytearray | memoryview, BlockMeta]], deadline: float,
    ) -> list[WriteResult]:
        """Per block STORED, PRESENT, or FAILED with nothing stored at the peer."""
        raise InvalidArgument(f"the {self.scheme} peer transport cannot write blocks: use one whose writes is True")

    async def hold(self, address: str, namespace: str, keys: Sequence[bytes], lease_s: float, deadline: float) -> Held:
        """Pin the keys the peer holds for ``lease_s`` on behalf of this node's pin."""
        raise InvalidArgument(f"the {self.scheme} peer transport cannot hold blocks: use one whose writes is True")

    async def release(self, address: str, lease_ids: Sequence[int], deadline: float) -> list[bool]:
        """End holds early; per id whether it was still held."""
        raise InvalidArgument(f"the {self.scheme} peer transport cannot hold blocks: use one whose writes is True")

    @abc.abstractmethod
    async def close(self) -> None:
        """End calls in flight, close connections. Idempotent."""

    @abc.abstractmethod
    def stats(self) -> PeerStats: ...
