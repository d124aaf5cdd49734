"""The peer path the run can damage: the tests' :class:`FlipProxy`, in a process of its own.

A daemon advertises this proxy's address to its peers, so every block they
fetch from it crosses the proxy; with flipping on, the byte after each
marker in what the daemon sends is flipped (gRPC framing intact, the
payload damaged). In the benchmark's own process the proxy would share one
GIL with the traffic's client threads, and on two cores a peer fetch
through it would then miss its deadline for reasons that are the
harness's, not the fleet's; so it runs as a child, driven over its stdin:
``on``, ``off``, ``count`` (it answers the bytes flipped so far).

Run as ``python -m benchmarks.chaos.path UPSTREAM_HOST UPSTREAM_PORT LISTEN_HOST [EVERY [LIMIT]]``; it
prints its ``host:port`` first. With ``EVERY``, it flips one byte every ``EVERY`` bytes of the replies
instead of after a marker (traffic without one: blocks of KV), and with ``LIMIT`` mends itself after
that many flips.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MARKER = b"STRATA-CHAOS-FLIP"  # every block starts with it: the damaged path flips the byte after it


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class PeerPath:
    """The parent's handle on one proxy process."""

    def __init__(self, upstream: tuple[str, int], listen_host: str, *, every: int = 0, limit: int = 0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.chaos.path", upstream[0], str(upstream[1]), listen_host, str(every),
             str(limit)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, preexec_fn=_die_with_parent,
        )
        self.address = self._answer()

    def _answer(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the peer-path proxy exited with {self.proc.wait()}")
        return line.strip()

    def _say(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def flip(self, on: bool) -> None:
        self._say("on" if on else "off")

    @property
    def flipped(self) -> int:
        return int(self._say("count"))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def main() -> None:
    from tests.support.peer_cluster import FlipProxy

    upstream_host, upstream_port, listen_host = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    every, limit = (int(sys.argv[4]) if len(sys.argv) > 4 else 0), (int(sys.argv[5]) if len(sys.argv) > 5 else 0)
    proxy = FlipProxy((upstream_host, upstream_port), MARKER, host=listen_host, every=every, limit=limit)
    proxy.enabled = False  # whole until told otherwise
    print(proxy.address, flush=True)
    for line in sys.stdin:  # the parent closed our stdin, or died: either way, stop
        command = line.strip()
        if command in ("on", "off"):
            proxy.enabled = command == "on"
            print("ok", flush=True)
        elif command == "count":
            print(proxy.flipped, flush=True)
    proxy.close()


if __name__ == "__main__":
    main()
