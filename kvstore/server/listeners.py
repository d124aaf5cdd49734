"""What every threaded socket server of the daemon does at stop (the same-host socket, the peer data plane)."""

from __future__ import annotations

import socket
import threading


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
