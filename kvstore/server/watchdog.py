"""Ends streams whose client makes no progress: a Put that sends nothing, a Get that reads nothing.

Why a watchdog thread: the sync gRPC server hands a client-streaming
handler a request iterator whose ``next`` blocks with no timeout, and drives
a server-streaming handler's generator from a thread that blocks in the send
while the client's flow-control window is full. Neither wait can time out
by itself, and either holds a worker thread, an admission slot and whatever
the handler took (a Put's byte budget and its block's extent in the arena).
One thread watches every stream's wait on its client and, past ``idle_s``,
cancels the call from outside: the blocked ``next`` raises, the blocked send
returns, and the handler gives back what it held in its own ``finally``.

Only time spent waiting on the client counts: a Put waiting for its next
message, a Get waiting for the client to take the last one. The daemon's own
work between messages (a write waiting for room) is bounded by the RPC's
deadline, not by this.

The call ends with DEADLINE_EXCEEDED and a message naming the setting. The
sync server's public ``ServicerContext.cancel`` can only end a call as
CANCELLED with no message, so the watchdog uses the core call's
cancel-with-status under it, and falls back to ``cancel`` where a grpc
release does not offer that.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from kvstore.errors import DeadlineExceeded
from kvstore.metrics import StoreMetrics

log = logging.getLogger(__name__)

_GUARDED_PREFIX = "/strata."
SETTING = "[server] stream_idle_seconds (--stream-idle-seconds)"


def _cancel(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """End the call now with ``code`` and ``details``; plain CANCELLED where grpc cannot say more."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    try:
        call.cancel(code.value[0], details)
    except (AttributeError, TypeError):
        context.cancel()


class _Watch:
    """One stream's wait on its client; ``since`` is None while the daemon, not the client, is busy."""

    __slots__ = ("_context", "_lock", "_since", "fired", "op")

    def __init__(self, context: grpc.ServicerContext, op: str) -> None:
        self._context = context
        self.op = op
        self._lock = threading.Lock()
        self._since: float | None = None
        self.fired = False

    def waiting(self) -> None:
        """The stream now waits on its client (for its next message, or to take the last one)."""
        with self._lock:
            self._since = time.monotonic()

    def progressed(self, idle_s: float) -> None:
        """The client moved; raises DeadlineExceeded when the watchdog ended the stream first."""
        with self._lock:
            self._since = None
            if self.fired:
                raise self.error(idle_s)

    def error(self, idle_s: float) -> DeadlineExceeded:
        return DeadlineExceeded(
            f"{self.op}: the client made no progress for {idle_s:g}s ({SETTING}); the stream was ended and "
            "nothing of its unfinished block was stored: send it again"
        )

    def expiry(self, idle_s: float) -> float | None:
        since = self._since
        return None if since is None else since + idle_s

    def fire(self, idle_s: float, now: float) -> bool:
        """End the stream if it still waits and has waited ``idle_s``; True when it did."""
        with self._lock:
            if self.fired or self._since is None or now - self._since < idle_s:
                return False
            self.fired = True
            _cancel(self._context, grpc.StatusCode.DEADLINE_EXCEEDED, str(self.error(idle_s)))
            return True


class StreamWatchdog(grpc.ServerInterceptor):
    """Watches every streaming RPC of the Strata services; :meth:`start`, then :meth:`stop`.

    Install it inside the admission interceptor (after it in the server's
    list): a refused call never gets a watch.
    """

    def __init__(self, idle_s: float, metrics: StoreMetrics | None = None) -> None:
        if idle_s <= 0:
            raise ValueError(f"stream_idle_seconds is {idle_s}; it must be positive")
        self.idle_s = idle_s
        self._ended = (metrics or StoreMetrics()).idle_streams
        self._lock = threading.Lock()
        self._watches: set[_Watch] = set()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="strata-stream-watchdog", daemon=True)

    def start(self) -> StreamWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    @property
    def watched(self) -> int:
        with self._lock:
            return len(self._watches)

    # ---- the watching thread -------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopped.is_set():
            now = time.monotonic()
            wake = now + self.idle_s  # a watch added or re-armed from now on expires no earlier
            with self._lock:
                watches = list(self._watches)
            for watch in watches:
                expiry = watch.expiry(self.idle_s)
                if expiry is None:
                    continue
                if expiry <= now:
                    if watch.fire(self.idle_s, now):
                        self._ended.labels(watch.op).inc()
                        log.info("ended a %s stream idle for %.1fs", watch.op, self.idle_s)
                else:
                    wake = min(wake, expiry)
            self._stopped.wait(max(wake - time.monotonic(), 0.005))

    def _watch(self, context: grpc.ServicerContext, op: str) -> _Watch:
        watch = _Watch(context, op)
        with self._lock:
            self._watches.add(watch)
        return watch

    def _unwatch(self, watch: _Watch) -> None:
        with self._lock:
            self._watches.discard(watch)

    # ---- the interceptor ---------------------------------------------------------------

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(_GUARDED_PREFIX):
            return handler
        op = method.rsplit("/", 1)[-1]
        if handler.stream_unary:
            return handler._replace(stream_unary=self._stream_in(handler.stream_unary, op))
        if handler.unary_stream:
            return handler._replace(unary_stream=self._stream_out(handler.unary_stream, op))
        return handler  # unary calls wait on no client; the services have no bidirectional streams

    def _stream_in(self, behavior, op: str):
        def watched(requests, context):
            watch = self._watch(context, op)
            try:
                return behavior(self._requests(requests, watch), context)
            finally:
                self._unwatch(watch)

        return watched

    def _requests(self, requests, watch: _Watch):
        while True:
            watch.waiting()
            try:
                request = next(requests)
            except StopIteration:
                watch.progressed(self.idle_s)
                return
            except grpc.RpcError:
                watch.progressed(self.idle_s)  # raises when the watchdog ended the stream
                raise
            watch.progressed(self.idle_s)
            yield request

    def _stream_out(self, behavior, op: str):
        def watched(request, context):
            watch = self._watch(context, op)
            responses = behavior(request, context)
            try:
                for response in responses:
                    watch.waiting()
                    yield response  # returns once the message is sent: the client took the last one
                    watch.progressed(self.idle_s)
            finally:
                self._unwatch(watch)
                responses.close()

        return watched
