"""How the daemon's threaded servers take, count and end connections.

The same-host socket, the TCP peer data plane and both UCX peer listeners
serve each connection on a thread of its own, at most a fixed number at once.
They share the bookkeeping here rather than each keeping a lock, a table and a
stopping flag of its own:

- :class:`ConnectionTable` decides, under one lock, whether a new connection is
  served (its thread starts), refused (the table is full: the caller answers
  Overloaded with a retry delay, never queues it) or dropped (the server is
  stopping), and hands :meth:`ConnectionTable.close` every live connection so
  stop can end them. A connection leaves the table when its serving thread
  ends, whatever way it ends.
- :func:`accept_loop` is the loop of a server that listens on a socket.
- :func:`stop_listening` wakes and closes such a listener and its connections.
"""

from __future__ import annotations

import enum
import socket
import threading
from collections.abc import Callable
from typing import Any


class Admission(enum.Enum):
    SERVED = "served"      # its thread is started
    FULL = "full"          # refuse it: the table holds its limit
    STOPPING = "stopping"  # close it: the server is stopping


class ConnectionTable:
    """The connections a threaded server serves, each with its thread; at most ``limit`` at once.

    A connection is any object the server can shut (a socket, a UCX link);
    :meth:`swap` lets a server replace the object it accepted with the one it
    serves (a handshake socket by the link it set up) without a second slot.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._threads: dict[Any, threading.Thread] = {}
        self._stopping = False

    def __len__(self) -> int:
        with self._lock:
            return len(self._threads)

    @property
    def stopping(self) -> bool:
        return self._stopping

    def admit(self, conn: Any, serve: Callable[..., None], args: tuple, name: str) -> Admission:
        """Serve ``conn`` on a new thread running ``serve(*args)`` if there is room.

        The thread leaves the table when ``serve`` returns or raises; ``serve``
        still owns closing the connection."""
        with self._lock:
            if self._stopping:
                return Admission.STOPPING
            if len(self._threads) >= self.limit:
                return Admission.FULL
            thread = threading.Thread(target=self._run, args=(conn, serve, args), name=name, daemon=True)
            self._threads[conn] = thread
        thread.start()
        return Admission.SERVED

    def swap(self, old: Any, new: Any) -> bool:
        """Track ``new`` in place of ``old`` on the calling thread; False (nothing tracked) once stopping."""
        with self._lock:
            self._threads.pop(old, None)
            if self._stopping:
                return False
            self._threads[new] = threading.current_thread()
            return True

    def close(self) -> list[tuple[Any, threading.Thread]]:
        """Admit nothing more; every connection still served, with its thread."""
        with self._lock:
            self._stopping = True
            return list(self._threads.items())

    def _run(self, conn: Any, serve: Callable[..., None], args: tuple) -> None:
        me = threading.current_thread()
        try:
            serve(*args)
        finally:
            with self._lock:  # the accepted object, or what swap put in its place
                for tracked in [c for c, t in self._threads.items() if t is me]:
                    del self._threads[tracked]


def accept_loop(listener: socket.socket, table: ConnectionTable, *, name: str,
                serve: Callable[[socket.socket, Any], None], refuse: Callable[[socket.socket], None],
                refuse_on_thread: bool = False, configure: Callable[[socket.socket], None] | None = None) -> None:
    """Accept until the listener is closed: serve each connection on its own thread, refuse the
    ones beyond the table's limit (on a short-lived thread of its own if ``refuse_on_thread``:
    refusing that must read the caller's first message first), close them once stopping."""
    while True:
        try:
            conn, peer = listener.accept()
        except OSError:
            return  # the listener was closed: stopping
        if configure is not None:
            configure(conn)
        verdict = table.admit(conn, serve, (conn, peer), name)
        if verdict is Admission.STOPPING:
            conn.close()
            return
        if verdict is Admission.FULL:
            if refuse_on_thread:
                threading.Thread(target=refuse, args=(conn,), name=name + "-refuse", daemon=True).start()
            else:
                refuse(conn)


def stop_listening(listener: socket.socket | None, acceptor: threading.Thread | None,
                   connections: list[tuple[socket.socket, threading.Thread]], timeout: float) -> None:
    """Wake and close the listener, wait for its accept loop, then shut every connection and
    wait for the thread serving it (each wait at most ``timeout``)."""
    if listener is not None:
        try:
            listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # never connected: nothing to wake
        listener.close()
    if acceptor is not None:
        acceptor.join(timeout)
    for conn, _ in connections:
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already gone
    for _, thread in connections:
        thread.join(timeout)
