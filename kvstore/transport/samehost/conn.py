"""One connection of the same-host transport: a socket to the daemon, Hello done, requests in order.

Split from :mod:`kvstore.transport.samehost.client` (the transport pools these).
The Hello says protocol 2 with the client's capabilities and reads back
what the daemon's head is and, for a client with the gpu capability, the
gpu tier's region handles (:class:`kvstore.transport.samehost.protocol.Hello`,
:mod:`kvstore.transport.samehost.regions`).
Waits are bounded in the kernel and by the call's deadline; a reply that
comes late or out of order closes the connection, whose stream is then
unusable.
"""

from __future__ import annotations

import itertools
import socket
from collections.abc import Sequence

from kvstore.errors import Cancelled, DaemonUnavailable, DeadlineExceeded, StrataError
from kvstore.transport.base import Deadline
from kvstore.transport.samehost import frames
from kvstore.transport.samehost.protocol import Hello, timeout_ms
from kvstore.wire.unix import connect_unix, set_kernel_timeouts

CONNECT_TIMEOUT_S = 5.0


def _nothing() -> None:
    pass


def _timeout_ms(deadline: Deadline) -> int:
    """The daemon's share of the deadline: a little less, so its answer (a refusal, say) arrives in time."""
    return timeout_ms(deadline.remaining())


class _Connection:
    """One socket to the daemon, Hello done; requests answered in order."""

    def __init__(self, path: str, token: bytes, caps: Sequence[str] = ()) -> None:
        try:
            self.sock = connect_unix(path, CONNECT_TIMEOUT_S)
        except OSError as err:
            raise DaemonUnavailable(f"cannot connect to the daemon's same-host socket {path}: {err}") from None
        self.sock.settimeout(None)  # blocking; waits are bounded in the kernel (_bound)
        self._timeout: float | None = None
        self.reader = frames.FrameReader(self.sock)
        self.broken = False
        self._ids = itertools.count(1)
        answer = self.call(frames.HELLO, [frames.PROTOCOL_VERSION, bytes(token), list(caps)],
                           deadline=Deadline.after(CONNECT_TIMEOUT_S))
        try:
            self.hello = Hello.parse(answer)
        except StrataError:
            self.close()
            raise
        self.max_meta, self.max_payload, self.max_batch = self.hello.max_meta, self.hello.max_payload, self.hello.max_batch
        self.removal_page, self.head, self.regions = self.hello.removal_page, self.hello.head, self.hello.regions
        # Slots and leases this connection can use in place: in the arena, or in regions it was handed.
        self.in_place = self.hello.in_place

    def close(self) -> None:
        self.broken = True
        self.sock.close()

    def send(self, op: int, args, payload: Sequence = (), *, reply: bool = True, deadline: Deadline) -> int:
        rid = next(self._ids) if reply else 0
        head = frames.encode([op, rid, args], sum(len(p) for p in payload))
        self._io(deadline, frames.send, self.sock, head, payload)
        return rid

    def reply(self, rid: int, deadline: Deadline):
        meta, _ = self._io(deadline, self.reader.read)
        try:
            got, status, result = meta
        except (TypeError, ValueError):
            self.close()
            raise StrataError(f"the daemon sent a malformed reply: {meta!r}") from None
        if got != rid:
            self.close()  # a refusal (rid 0) or a reply out of order: the stream is unusable
            if status == frames.ERROR:
                frames.raise_error(result)
            raise StrataError(f"the daemon answered request {got} where {rid} was expected")
        if status == frames.ERROR:
            frames.raise_error(result)
        return result

    def call(self, op: int, args, payload: Sequence = (), *, deadline: Deadline):
        return self.reply(self.send(op, args, payload, deadline=deadline), deadline)

    def notify(self, op: int, args) -> None:
        """Send a request that gets no reply; best effort (what it gives back expires anyway)."""
        if self.broken:
            return
        try:
            frames.send(self.sock, frames.encode([op, 0, args]))
        except OSError:
            self.close()

    def _io(self, deadline: Deadline, fn, *args):
        if self.broken:
            raise DaemonUnavailable("the same-host connection was closed")
        deadline.check()
        self._bound(deadline.remaining())
        forget = deadline.on_cancel(self._wake) if deadline.cancellable else _nothing
        try:
            while True:
                try:
                    return fn(*args)
                except BlockingIOError:
                    remaining = deadline.remaining()
                    if fn is not self.reader.read or (remaining is not None and remaining <= 0):
                        raise  # a send cut short cannot be resumed; a read past its deadline is over
                    set_kernel_timeouts(self.sock, remaining)  # the bound was an earlier call's: wait out this one's
                    self._timeout = remaining
        except (TimeoutError, BlockingIOError):
            self.close()  # a late reply would arrive where the next one is expected
            raise DeadlineExceeded("the daemon did not answer on the same-host socket before the deadline") from None
        except (EOFError, OSError) as err:
            self.close()
            if deadline.cancelled:
                raise Cancelled("the call was cancelled; its leases and slots are given back or expire") from None
            raise DaemonUnavailable(f"the daemon's same-host socket closed: {err}") from None
        finally:
            forget()

    def _bound(self, remaining: float | None) -> None:
        """Keep the kernel's wait bound between half the call's remaining time and all of it.

        Deadlines of a client's calls are mostly its fixed timeout, so the
        bound rarely needs a system call; a bound that fires before the
        deadline only makes a read wait again (see :meth:`_io`).
        """
        current = self._timeout
        if remaining is not None and current is not None and remaining * 0.5 <= current <= remaining:
            return
        set_kernel_timeouts(self.sock, remaining)
        self._timeout = remaining

    def _wake(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed
