"""UCX under the peer protocol: one process-wide ucxx worker, and a link that carries the protocol's frames.

The peer protocol (:mod:`kvstore.peer.wire`) is written for a byte stream;
UCX tag messages are not one, so a :class:`UcxLink` keeps the protocol and
changes only how a frame travels: a frame's head (the ``u32 meta_len, u32
payload_len`` header and its msgpack meta) is one tag message, received
into a buffer of the largest allowed head; each payload part (one block)
is one tag message of exactly that block's size, sent straight from the
arena view and received straight into the view the reader placed (UCX's
rendezvous moves large blocks with no copy in between). Messages on one
endpoint and tag arrive in the order they were sent (UCX's tag matching
never lets a message overtake another with the same tag). A zero-byte part
is never sent, so both sides skip it alike.

A link is used from one worker thread at a time, as the TCP code uses a
blocking socket: each operation is a coroutine run on the UCX thread (the
one event loop the ucxx worker progresses on), awaited from the calling
thread with a timeout. It answers to the socket calls the TCP client and
server make (``sendall``, ``sendmsg``, ``settimeout``, ``shutdown``,
``close``) and to the :class:`~kvstore.peer.wire.Wire` calls
(``read_meta``, ``read_into``, ``skip``, ``pending``), so their request
handling runs over it unchanged. A wait past the timeout raises
``BlockingIOError`` as a socket with kernel timeouts does; a broken
endpoint (the peer died, closed) raises ``ConnectionError``. Either aborts
the endpoint and waits for the request to end, so no receive writes into a
caller's buffer after the call returned.

Why the environment is set here: ucxx reads UCX's settings from the
environment when it is imported and sets ``UCX_MAX_RNDV_RAILS=1`` unless
told otherwise, which cuts TCP bandwidth about three times; two rails is
set first (an operator's own value wins). The progress mode is
``blocking`` (the worker's event fd on the loop): ucxx's default progress
thread is 3–5× slower on a small machine. Requests are made through ucxx's
low-level endpoint (``tag_send``/``tag_recv`` with the link's tags) and
waited on through :class:`~kvstore.peer.ucx_progress.UcxProgress`, not
ucxx's own wait, which spins a core for as long as any request is pending
(a served connection always has one: the receive for its next request).
Each runtime has a ucxx context of its own (:attr:`UcxRuntime.options`
over the environment), so the shared-memory one
(:mod:`kvstore.peer.ucx_shm_link`) can fix its transports.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
import threading
import time
from collections.abc import Sequence

from kvstore.block import Checksummer
from kvstore.errors import TierUnavailable
from kvstore.peer.ucx_progress import UcxProgress
from kvstore.wire.frames import HEADER, MAX_META_BYTES, FrameError, check_lengths, decode_meta

__all__ = ["UcxLink", "UcxRuntime", "UcxUnavailable", "ucx_available"]

PROGRESS_MODE = "blocking"
_LOCAL_TRANSPORT_PREFIXES = ("self", "cuda", "gdr", "rocm", "ze_")  # host or device memory, never a link
_ABORT_WAIT_S = 5.0


class UcxUnavailable(TierUnavailable):
    """ucxx cannot be imported here: install the ``ucx`` extra (``pip install "strata-kvcache[ucx]"``)."""


_import_error: str | None = None


def _import_ucxx():
    os.environ.setdefault("UCX_MAX_RNDV_RAILS", "2")
    try:
        import ucxx
        import ucxx._lib.arr
        import ucxx.types
    except Exception as err:  # noqa: BLE001 - an ImportError, or a native library that failed to load
        raise UcxUnavailable(
            f"the UCX peer transport needs ucxx, which cannot be imported ({type(err).__name__}: {err}): "
            'install it with pip install -e ".[ucx]", or use the tcp peer transport'
        ) from None
    return ucxx


def ucx_available() -> tuple[bool, str]:
    """Whether ucxx imports here, and why not."""
    try:
        _import_ucxx()
    except UcxUnavailable as err:
        return False, str(err)
    return True, ""


class UcxRuntime:
    """A ucxx context and worker, and the event loop thread it progresses on (:class:`UcxProgress`).
    One per process and kind (:meth:`get` starts it): ucxx progresses one worker per event loop."""

    _instance: UcxRuntime | None = None
    _lock = threading.Lock()
    thread_name = "strata-ucx"
    #: UCX settings of this context, over the environment's (none: UCX's own choice of transports).
    options: dict[str, str] = {}

    def __init__(self) -> None:
        self.ucxx = _import_ucxx()
        self.loop = asyncio.new_event_loop()
        ready = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=self.thread_name, daemon=True)
        self._thread.start()
        ready.result(30)

    def _run(self, ready: concurrent.futures.Future) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self._start_worker()
        except BaseException as err:  # noqa: BLE001 - handed to the starting thread
            ready.set_exception(UcxUnavailable(f"ucxx failed to start a worker ({err})"))
            return
        ready.set_result(None)
        self.loop.run_forever()

    def _start_worker(self) -> None:
        """On the UCX thread, before its loop runs: a context of this runtime's own (not ucxx's
        global one), made on the running loop, which is where ucxx progresses it."""
        from ucxx._lib_async import ApplicationContext

        async def make():
            return ApplicationContext(dict(self.options), progress_mode=PROGRESS_MODE)

        self.context = self.loop.run_until_complete(make())
        self.progress = UcxProgress(self.context.worker, self.loop)
        self._tag, self._tag_mask, self._array = self.ucxx.types.Tag, self.ucxx.types.TagMaskFull, self.ucxx._lib.arr.Array

    def tag(self, value: int):
        return self._tag(value)

    def resources(self) -> list[tuple[str, str]]:
        """(transport, device) of every resource this worker's context may use, as UCX lists them
        (``tcp``/``eth0``, ``rc_mlx5``/``mlx5_0:1``, ``posix``/``memory``)."""
        return re.findall(r"^#\s+resource\s+\d+\s*:.*\s(\w+)/(\S+)\s*$", self.context.ucp_context_info, re.M)

    def transports(self) -> set[str]:
        """The UCX transports this worker may use (``tcp``, ``rc_mlx5``, ``posix``, ``self``...)."""
        return {transport for transport, _ in self.resources()}

    def network_transports(self) -> set[str]:
        """The transports that reach another host: those on a network device (``tcp`` on ``eth0``,
        ``rc_mlx5`` on ``mlx5_0:1``), not host memory or a GPU's."""
        return {transport for transport, device in self.resources()
                if device != "memory" and not transport.startswith(_LOCAL_TRANSPORT_PREFIXES)}

    async def tag_send(self, endpoint, buffer, tag) -> None:
        """Send ``buffer`` as one tag message on the ucxx ``endpoint``, awaited without spinning."""
        await self.progress.wait(endpoint._ep.tag_send(self._array(buffer), tag))

    async def tag_recv(self, endpoint, buffer, tag) -> None:
        """Receive one tag message into ``buffer`` (tracked by ``endpoint``: its abort cancels it)."""
        await self.progress.wait(endpoint._ep.tag_recv(self._array(buffer), tag, self._tag_mask))

    @classmethod
    def get(cls) -> UcxRuntime:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro, timeout: float | None):
        """Run ``coro`` on the UCX thread and wait for it (TimeoutError past ``timeout``; the
        coroutine goes on: the caller decides what to abort)."""
        return self.submit(coro).result(timeout)

    def on_loop(self) -> bool:
        """Whether this is the UCX thread."""
        return threading.get_ident() == self._thread.ident

    def is_ucx_error(self, err: BaseException) -> bool:
        return isinstance(err, self.ucxx.exceptions.UCXError)


class UcxLink:
    """One ucxx endpoint carrying peer-protocol frames, used by one thread at a time (see the module)."""

    def __init__(self, runtime: UcxRuntime, endpoint, *, max_meta: int = MAX_META_BYTES,
                 send_tag: int | None = None, recv_tag: int | None = None) -> None:
        """``send_tag``/``recv_tag``: the tags of this link's messages, for an endpoint made from a
        worker address (which has no tags of its own); None: the endpoint's own pair, agreed by
        ucxx when a listener connected it."""
        self._rt = runtime
        self.ep = endpoint
        self._head = bytearray(0)  # sized to the limit at the first read (a listener limits it first)
        self.limit(max_meta=max_meta)
        self._timeout: float | None = None
        self._send_tag = runtime.tag(endpoint._tags["msg_send"] if send_tag is None else send_tag)
        self._recv_tag = runtime.tag(endpoint._tags["msg_recv"] if recv_tag is None else recv_tag)
        self._sends: set[asyncio.Task] = set()  # on the UCX thread
        self.pending = 0
        self.closed = False

    # ---- the socket face ---------------------------------------------------------

    def settimeout(self, seconds: float | None) -> None:
        self._timeout = None if seconds is None else max(seconds, 0.001)

    def _wait(self, coro):
        if self.closed:
            coro.close()
            raise ConnectionError(self._closed_why())
        future = self._rt.submit(coro)
        try:
            return future.result(self._timeout)
        except concurrent.futures.TimeoutError:
            self._abort(future)
            raise BlockingIOError("the UCX peer did not answer in time") from None
        except Exception as err:
            # A UCX error, or the endpoint aborted under the call (a shutdown, the peer gone):
            # the request was cancelled, or found the endpoint already closed.
            if self._rt.is_ucx_error(err) or self.closed or isinstance(err, concurrent.futures.CancelledError):
                why = self._closed_why() if self.closed else f"the UCX endpoint failed ({type(err).__name__}: {err})"
                self._abort(future)
                raise ConnectionError(why) from None
            raise

    def _closed_why(self) -> str:
        return "the UCX endpoint is closed"

    def _abort(self, future: concurrent.futures.Future | None = None) -> None:
        """Abort the endpoint (its requests are cancelled) and wait until ``future`` ended. From
        any thread, the UCX thread included."""
        if not self.closed:
            self.closed = True
            if self._rt.on_loop():
                self._abort_endpoint()
            else:
                done = concurrent.futures.Future()

                def abort() -> None:
                    try:
                        self._abort_endpoint()
                    finally:
                        done.set_result(None)

                self._rt.loop.call_soon_threadsafe(abort)
                try:
                    done.result(_ABORT_WAIT_S)
                except concurrent.futures.TimeoutError:
                    pass  # the loop is stuck; the endpoint goes with the process
        if future is not None and not self._rt.on_loop():
            try:
                future.result(_ABORT_WAIT_S)
            except BaseException:  # noqa: BLE001 - cancelled or failed: either way it has ended
                pass

    def _abort_endpoint(self) -> None:
        """On the UCX thread: close the endpoint at once. Its receives end cancelled; a send UCX
        cannot cancel (one without endpoint error handling waits for its receiver for ever) has
        its task cancelled instead, so the thread waiting on it goes on. Its bytes are only ever
        read after that, by a receiver that is itself aborting, and checked against their
        checksum where they land."""
        self.ep.abort()
        for task in list(self._sends):
            task.cancel()

    async def _send(self, parts: Sequence) -> None:
        if self.closed:  # aborted since the call was submitted (the abort runs on this thread too)
            raise ConnectionError(self._closed_why())
        task = asyncio.current_task()
        self._sends.add(task)
        try:
            for p in parts:
                await self._rt.tag_send(self.ep, p, self._send_tag)
        finally:
            self._sends.discard(task)

    async def _recv(self, buffer) -> None:
        if self.closed:
            raise ConnectionError(self._closed_why())
        await self._rt.tag_recv(self.ep, buffer, self._recv_tag)

    def sendall(self, data) -> None:
        if len(data):
            self._wait(self._send([data]))

    def sendmsg(self, parts: Sequence) -> int:
        """Each part as its own message (a frame's head, then one message per block); returns the
        bytes sent, as a socket's sendmsg does."""
        parts = [p for p in parts if len(p)]
        if parts:
            self._wait(self._send(parts))
        return sum(len(p) for p in parts)

    def shutdown(self, how=None) -> None:
        """Abort the endpoint from any thread: a wait on it fails at once."""
        self._abort()

    def close(self) -> None:
        self._abort()

    # ---- the Wire face -------------------------------------------------------------

    def limit(self, *, max_meta: int, max_payload: int | None = None) -> None:
        """As :meth:`kvstore.peer.wire.Wire.limit`; the head buffer (one head message) is sized to it."""
        self._max_meta = max_meta
        self._max_payload = max_payload

    @property
    def buffer_bytes(self) -> int:
        return len(self._head)

    def read_meta(self, deadline: float | None = None) -> tuple[object, int]:
        """The next frame's head, one message; ``deadline`` (``time.monotonic()``): it must be in by then."""
        if self.pending:
            raise FrameError(f"{self.pending} payload bytes of the last frame were not taken")
        if len(self._head) != HEADER.size + self._max_meta:
            self._head = bytearray(HEADER.size + self._max_meta)
        if deadline is not None:
            self.settimeout(deadline - time.monotonic())
        self._wait(self._recv(self._head))
        meta_len, payload_len = HEADER.unpack_from(self._head)
        check_lengths(meta_len, payload_len, self._max_meta, self._max_payload)
        meta = decode_meta(memoryview(self._head)[HEADER.size : HEADER.size + meta_len])
        self.pending = payload_len
        return meta, payload_len

    def read_into(self, dst: memoryview, hasher: Checksummer | None = None, before=None) -> None:
        """One payload message of exactly ``len(dst)`` bytes, straight into ``dst``."""
        n = len(dst)
        if n > self.pending:
            raise FrameError(f"{n} payload bytes asked of a frame that has {self.pending} left")
        if n:
            if before is not None:
                before()
            self._wait(self._recv(dst))
            if hasher is not None:
                hasher.update(dst)
        self.pending -= n

    def skip(self, n: int | None = None) -> None:
        """Throw away the next payload message (one block of ``n`` bytes, or what the frame has left)."""
        n = self.pending if n is None else n
        if n:
            self.read_into(memoryview(bytearray(n)))
