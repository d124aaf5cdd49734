"""The transport contract: moving block bytes between a client and a daemon.

A :class:`Transport` moves whole blocks, in batches, into memory the caller
owns. It knows nothing of namespaces' policy, eviction or the index: those
stay in the store and the daemon. The same contract will carry blocks
between daemons (TCP, UCX), so nothing in it names gRPC or shared memory.

Contract (``tests/transport/test_transport_contract.py`` runs it over every transport):

- ``put(namespace, blocks, deadline)`` stores each block and returns, per
  block, whether it was newly stored (False: the key was already there; a
  repeated put is a no-op, so a put may be retried). The bytes are copied
  before ``put`` returns: the caller may reuse its buffers at once.
- ``get_into(namespace, keys, place, deadline)`` returns one
  :class:`Block` or None (a miss) per key, in order. ``place(i, info)`` is
  called with each found block's :class:`BlockInfo` before its bytes move;
  it returns a writable view of at least ``info.size`` bytes, or None to
  skip the block (it then reads as a miss). Without ``place`` each block
  gets a new buffer. A block placed but then not delivered leaves its
  buffer untouched or partly written, never reported as delivered; a block
  whose read is retried may be placed again (same index).
- Every delivered block was verified against its checksum after it landed
  in the caller's buffer; a block that fails is read again or raised as
  CorruptBlock, never returned.
- ``deadline`` bounds the whole call: past it the call raises
  DeadlineExceeded; :meth:`Deadline.cancel` (from any thread) makes it raise
  Cancelled. Either way what the call held on the daemon (read leases,
  write slots) is given back or expires by itself, and the transport stays
  usable for the next call.
- Errors are :mod:`kvstore.errors` classes, the same ones the daemon
  raised; RESOURCE_EXHAUSTED ones carry ``retry_after_s``. A transport does
  not retry; the client decides (``kvstore.client.base.retry_delay``).
- ``close()`` gives back what the transport holds; calling it twice is fine.

:class:`AsyncTransport` is the same contract for asyncio: the same methods
and attributes, each call a coroutine of the loop the transport was opened
on, and the same ``deadline`` (its remaining time bounds each wait). An
asyncio call is cancelled as any coroutine is, by cancelling its task: what
it held is given back as for Cancelled. :meth:`Deadline.cancel` is seen at
the call's next check (its start, and between its steps).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.block import TierName
from kvstore.errors import Cancelled, DeadlineExceeded, InvalidArgument


@dataclass(frozen=True, slots=True)
class BlockPut:
    key: bytes
    value: bytes | bytearray | memoryview
    parent: bytes | None = None
    layout: str = ""


@dataclass(frozen=True, slots=True)
class Block:
    key: bytes
    data: bytes | bytearray | memoryview  # a view of the caller's buffer after get_into
    layout: str
    parent: bytes | None
    tier: TierName


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What the daemon says of a found block before its bytes are read: enough to
    choose where they go (see ``get_into`` with a placement function)."""

    key: bytes
    size: int
    layout: str
    parent: bytes | None


# get_into's placement: for the i-th key's found block, the writable buffer to
# read it into (at least info.size bytes), or None to skip it (a miss).
Placement = Callable[[int, BlockInfo], object | None]
# The same after the client has checked the buffer: a view of it, fitted.
Place = Callable[[int, BlockInfo], memoryview | None]


def writable(key: bytes, buffer) -> memoryview:
    view = memoryview(buffer).cast("B")
    if view.readonly:
        raise InvalidArgument(f"the buffer for key {key.hex()[:16]} is read-only: pass a bytearray, array or tensor")
    return view


def fit(key: bytes, size: int, view: memoryview) -> memoryview:
    if size > len(view):
        raise InvalidArgument(
            f"the buffer for key {key.hex()[:16]} holds {len(view)} bytes; the block has {size}: pass a larger buffer"
        )
    return view


def placement(keys: Sequence[bytes], buffers: Sequence | Placement) -> Place:
    """``get_into``'s buffers as one function: index and block info to a writable view, or None to skip."""
    if callable(buffers):
        def place(i: int, info: BlockInfo) -> memoryview | None:
            buffer = buffers(i, info)
            return None if buffer is None else fit(info.key, info.size, writable(info.key, buffer))

        return place
    if len(buffers) != len(keys):
        raise InvalidArgument(f"{len(keys)} keys but {len(buffers)} buffers: pass one buffer per key")
    views = [writable(key, buf) for key, buf in zip(keys, buffers)]
    return lambda i, info: fit(info.key, info.size, views[i])


class Deadline:
    """When a call must end, and a way to end it sooner from another thread.

    ``at`` is a :func:`time.monotonic` instant (None: no deadline).
    :meth:`cancel` runs the callbacks a transport registered with
    :meth:`on_cancel` (e.g. shutting down the socket it waits on), so a call
    blocked in the kernel wakes at once instead of polling.
    """

    __slots__ = ("at", "cancellable", "_cancelled", "_callbacks", "_lock")

    def __init__(self, at: float | None = None, *, cancellable: bool = True) -> None:
        self.at = at
        # False: nobody else holds this deadline (a client's own call), so a
        # transport may take a faster path that cannot be woken early.
        self.cancellable = cancellable
        self._cancelled = False
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    @classmethod
    def after(cls, seconds: float | None, *, cancellable: bool = True) -> Deadline:
        return cls(None if seconds is None else time.monotonic() + seconds, cancellable=cancellable)

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def remaining(self) -> float | None:
        """Seconds left (never negative), or None without a deadline."""
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def check(self) -> None:
        """Raise Cancelled or DeadlineExceeded when the call must stop."""
        if self._cancelled:
            raise Cancelled("the call was cancelled; what it held on the daemon was given back")
        if self.at is not None and time.monotonic() >= self.at:
            raise DeadlineExceeded("the call's deadline passed: retry with a longer timeout")

    def cancel(self) -> None:
        if not self.cancellable:
            raise InvalidArgument("this deadline was made not cancellable: create it with cancellable=True")
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()

    def on_cancel(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call ``fn`` on cancellation (now, if already cancelled); returns a function that unregisters it."""
        with self._lock:
            if not self._cancelled:
                self._callbacks.append(fn)
                return lambda: self._forget(fn)
        fn()
        return lambda: None

    def _forget(self, fn: Callable[[], None]) -> None:
        with self._lock:
            try:
                self._callbacks.remove(fn)
            except ValueError:
                pass


class Transport(ABC):
    """Moves blocks between a client and a daemon; the contract is the module docstring."""

    #: Registry name of the implementation (see :data:`kvstore.transport.TRANSPORTS`).
    name: str = ""
    #: Whether bytes move through memory the daemon maps (no copy over a socket).
    shared_memory: bool = False
    #: Whether ``put`` takes CUDA tensors as they are (copied device to device into a gpu tier) rather
    #: than staged through host memory by the client first.
    device_tensors: bool = False

    @abstractmethod
    def put(self, namespace: str, blocks: Sequence[BlockPut], deadline: Deadline) -> list[bool]:
        """Store blocks; per block, whether it was newly stored."""

    @abstractmethod
    def get_into(
        self, namespace: str, keys: Sequence[bytes], place: Place | None, deadline: Deadline
    ) -> list[Block | None]:
        """Read blocks into the buffers ``place`` chooses (new ones when None); None per miss."""

    def touch(self, namespace: str, keys: Sequence[bytes]) -> None:
        """Best effort: tell the daemon these blocks were used without reading them (an engine
        served them from its own memory), so its eviction keeps them. Transports without a
        cheap way to say it do nothing."""

    def exists(self, namespace: str, keys: Sequence[bytes], deadline: Deadline) -> list[TierName] | None:
        """For a prefix chain (head first): the tier of each leading present block, asked over this
        transport; None when it has no cheaper way than the daemon's control plane (the client asks that)."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Give back what the transport holds. Idempotent."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncTransport(ABC):
    """The asyncio twin of :class:`Transport`: the same contract (the module docstring), as coroutines."""

    name: str = ""
    shared_memory: bool = False
    device_tensors: bool = False

    @abstractmethod
    async def put(self, namespace: str, blocks: Sequence[BlockPut], deadline: Deadline) -> list[bool]:
        """Store blocks; per block, whether it was newly stored."""

    @abstractmethod
    async def get_into(
        self, namespace: str, keys: Sequence[bytes], place: Place | None, deadline: Deadline
    ) -> list[Block | None]:
        """Read blocks into the buffers ``place`` chooses (new ones when None); None per miss.
        ``place`` is called on the event loop, never in a worker thread."""

    async def touch(self, namespace: str, keys: Sequence[bytes]) -> None:
        """As :meth:`Transport.touch`: best effort, nothing by default."""

    async def exists(self, namespace: str, keys: Sequence[bytes], deadline: Deadline) -> list[TierName] | None:
        """As :meth:`Transport.exists`: None by default."""
        return None

    @abstractmethod
    async def close(self) -> None:
        """Give back what the transport holds. Idempotent."""

    async def __aenter__(self) -> AsyncTransport:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
