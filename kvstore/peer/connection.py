"""One connection to a peer's listener: the Hello, request and reply frames, the deadline kept in the kernel.

:class:`PeerConnection` is what :class:`~kvstore.peer.tcp.TcpPeerClient`
pools: one stream to a peer, one request at a time. It turns every way a
socket operation fails into :class:`Broken`, which carries the error for
the keys not yet answered, and marks itself broken so that the pool never
reuses it (the stream may be out of step). A subclass carries the same
frames over another link (:mod:`kvstore.peer.ucx`) by overriding
``_open``, ``_set_timeout`` and ``stale``.

The deadline is kept in the kernel (``SO_RCVTIMEO``, set to what is left at
the start of a call and again between a block's chunks once the last
setting is :data:`REBOUND_S` old: a wait may end that much later than with
a fresh limit) and checked between chunks; a cancellation shuts the socket
down (the client does), which wakes a ``recv`` at once.
"""

from __future__ import annotations

import itertools
import select
import socket
import time
from collections.abc import Sequence

from kvstore.block import Checksummer
from kvstore.errors import Cancelled, DeadlineExceeded, StrataError, TierUnavailable
from kvstore.peer import wire
from kvstore.peer.base import PeerAddress
from kvstore.transport.base import Deadline
from kvstore.wire.unix import set_kernel_timeouts, set_receive_timeout

__all__ = ["CONNECT_TIMEOUT_S", "REBOUND_S", "Broken", "PeerConnection"]

CONNECT_TIMEOUT_S = 5.0
# How stale the kernel's wait limit may get before it is set again (each
# setsockopt between 256 KiB chunks cost a third as much as hashing them).
REBOUND_S = 0.005


class Broken(Exception):
    """The connection failed mid-call (the peer died, closed or stalled); carries the error for the keys left."""

    def __init__(self, err: StrataError) -> None:
        self.err = err


class PeerConnection:
    """One socket to a peer, Hello done; one request at a time."""

    def __init__(self, address: PeerAddress, token: str, deadline: Deadline) -> None:
        self.address = address
        timeout = min(CONNECT_TIMEOUT_S, deadline.remaining() or CONNECT_TIMEOUT_S)
        self.sock, self.wire = self._open(address, max(timeout, 0.001))
        self.broken = False
        self._deadline = deadline
        self._ids = itertools.count(1)
        # The Hello is bounded as the connect is (a peer that accepts and never answers, stopped or
        # hostile, costs CONNECT_TIMEOUT_S, not the whole call's deadline), and a cancellation wakes it.
        handshake = Deadline(min(deadline.at, time.monotonic() + CONNECT_TIMEOUT_S) if deadline.at is not None
                             else time.monotonic() + CONNECT_TIMEOUT_S)
        forget = deadline.on_cancel(handshake.cancel) if deadline.cancellable else (lambda: None)
        forget_handshake = handshake.on_cancel(self.shutdown)
        try:
            self.bound(handshake)
            rid = self.send(wire.HELLO, [wire.PROTOCOL_VERSION, token])
            status, result = self.reply(rid)
            if status != wire.OK:
                raise StrataError(f"peer {address} answered Hello with status {status}")
            self.max_meta, self.max_block, self.max_batch, self.request_bytes = result
        except Broken as broken:
            self.close()
            err = broken.err
            if isinstance(err, DeadlineExceeded) and (deadline.at is None or time.monotonic() < deadline.at):
                err = TierUnavailable(f"peer {address} accepted the connection but did not answer Hello within "
                                      f"{CONNECT_TIMEOUT_S:g} s: it may be stopped or overloaded; try another holder")
            raise err from None
        except BaseException:
            self.close()
            raise
        finally:
            forget_handshake()
            forget()
        self._deadline = deadline

    @staticmethod
    def _open(address: PeerAddress, timeout: float):
        """The connected stream and its frame reader (a subclass carries the protocol over another link)."""
        try:
            sock = socket.create_connection((address.host, address.port), timeout=timeout)
        except OSError as err:
            raise TierUnavailable(f"cannot reach peer {address} ({err}): it may be down; try another holder") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)  # blocking; waits are bounded in the kernel (bound)
        return sock, wire.Wire(sock)

    def close(self) -> None:
        self.broken = True
        self.sock.close()

    def stale(self) -> bool:
        """Whether the idle socket became readable: the peer closed it (or broke the protocol)."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    def bound(self, deadline: Deadline) -> None:
        """Keep the next waits within what is left of ``deadline`` (raises when nothing is left)."""
        self._deadline = deadline
        deadline.check()
        self._bound_at = time.monotonic()
        self._set_timeout(deadline.remaining())

    def _set_timeout(self, seconds: float | None, *, send: bool = True) -> None:
        """The kernel's wait limits; ``send=False`` only the receive one (one system call, not two)."""
        if send:
            set_kernel_timeouts(self.sock, seconds)
        else:
            set_receive_timeout(self.sock, seconds)

    def _io_error(self, err: BaseException) -> Broken:
        """What a failed socket operation means for the call: cancelled, past its deadline, or a lost peer."""
        self.close()
        if self._deadline.cancelled:
            return Broken(Cancelled("the call was cancelled; what it held on the peer is given back"))
        if isinstance(err, BlockingIOError) or (self._deadline.at is not None and time.monotonic() >= self._deadline.at):
            return Broken(DeadlineExceeded(f"peer {self.address} did not answer before the deadline: retry or try another holder"))
        return Broken(TierUnavailable(f"the connection to peer {self.address} broke ({err or type(err).__name__}): "
                                       "the peer may have died; try another holder"))

    def shutdown(self) -> None:
        """Wake a call waiting on this connection (a cancellation, the client closing): it fails at once."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed

    def send(self, op: int, args, payload: Sequence = (), *, rid: int | None = None) -> int:
        """One request frame (``rid``: a follow-up frame of a request already sent, e.g. PUT's DATA)."""
        if rid is None:
            rid = next(self._ids)
        try:
            wire.send(self.sock, wire.encode([op, rid, args], sum(len(p) for p in payload)), payload)
        except OSError as err:
            raise self._io_error(err) from None
        return rid

    def reply(self, rid: int) -> tuple[int, object]:
        """The next reply frame to ``rid``: (status, result); ERROR raises the peer's error class."""
        try:
            meta, _ = self.wire.read_meta()
        except (OSError, EOFError) as err:
            raise self._io_error(err) from None
        except wire.FrameError as err:
            self.close()
            raise Broken(TierUnavailable(f"peer {self.address} sent a malformed frame ({err})")) from None
        try:
            got, status, result = meta
        except (TypeError, ValueError):
            self.close()
            raise Broken(TierUnavailable(f"peer {self.address} sent a malformed reply: {meta!r:.80}")) from None
        if got != rid:
            self.close()  # a refusal of the connection (id 0) or a reply out of order: the stream is unusable
            if status == wire.ERROR:
                wire.raise_error(result)
            raise Broken(TierUnavailable(f"peer {self.address} answered request {got} where {rid} was expected"))
        if status == wire.ERROR:
            if self.wire.pending:
                self.close()
            wire.raise_error(result)
        return status, result

    def read_into(self, view: memoryview, hasher: Checksummer | None) -> None:
        """A block's bytes into ``view``; what is left of the deadline is set again before each chunk."""
        try:
            self.wire.read_into(view, hasher, before=self._rebound)
        except (OSError, EOFError) as err:
            raise self._io_error(err) from None
        except StrataError as err:  # the deadline passed or the call was cancelled between chunks
            self.close()
            raise Broken(err) from None

    def _rebound(self) -> None:
        """Between a block's chunks: the deadline checked, and the receive limit set again to what
        is left once the last one is :data:`REBOUND_S` old (only receives follow)."""
        deadline = self._deadline
        if deadline.at is not None or deadline.cancelled:
            deadline.check()
            now = time.monotonic()
            if now - self._bound_at >= REBOUND_S:
                self._bound_at = now
                self._set_timeout(deadline.remaining(), send=False)

    def skip(self) -> None:
        try:
            self.wire.skip()
        except (OSError, EOFError) as err:
            raise self._io_error(err) from None
