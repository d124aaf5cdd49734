"""Mooncake Store over TCP on this machine: the cluster KV pool's competitor, as ``benchmarks.kv_pool`` runs it.

Three processes, as Mooncake Store serves a remote read: ``mooncake_master``
(on free loopback ports, with its built-in HTTP metadata server), a *holder*
process whose store mounts the global segment (the blocks live there), and
this process's client, which mounts no segment of its own, so every put is
written into the holder's segment and every get read out of it over
Mooncake's TCP transport (``MC_TCP_BIND_ADDRESS=127.0.0.1``). That mirrors
Strata's case in ``kv_pool``: a daemon process holds the blocks and this
process reads and writes them over the TCP peer transport.

Mooncake's fastest calls for bytes already in this process's memory, each
measured against the same Strata operation: ``get_into`` /
``batch_get_into`` into buffers registered with ``register_buffer``, and
``put_from`` / ``batch_put_from`` from registered buffers (its zero-copy
API; ``get``/``put`` and their batches copy through Python bytes or the
client's local buffer, and measured slower here). Mooncake's transfer-engine
settings are left at their defaults. It verifies no checksum; Strata does,
on both sides.

A put round writes fresh keys (a put of a key Mooncake already holds returns
success without moving a byte) and removes them afterwards, untimed, so the
segment holds the same blocks every round. When Mooncake cannot run here
(not installed, its master or holder does not start), :func:`optional_cluster`
says why and how to enable it, and ``kv_pool`` runs the rest.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.harness import Case, RoundFn, ServerUnavailable, free_port, skipped

TARGET = 2.0  # Strata's throughput over Mooncake's, per operation
LOCAL_BUFFER_BYTES = 64 << 20  # the client's staging buffer; the zero-copy calls do not use it
HOW_TO_ENABLE = ("pip install mooncake-transfer-engine-non-cuda (its store.so needs libibverbs.so.1: "
                 "apt-get install -y libibverbs1); --no-mooncake leaves these cases out")
# This process's Mooncake client reads these at setup: loopback only, and its log at ERROR (its INFO lines
# would interleave with the table).
CLIENT_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "ERROR"}


def available() -> tuple[bool, str]:
    """Whether Mooncake Store can be tried here; if not, why, and how to enable it.

    Sets :data:`CLIENT_ENV` (where unset) first: the library reads it when it loads.
    """
    for key, value in CLIENT_ENV.items():
        os.environ.setdefault(key, value)
    try:
        import mooncake
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as err:
        return False, f"mooncake.store cannot be imported ({err}); to enable: {HOW_TO_ENABLE}"
    if master_executable(Path(mooncake.__file__).parent) is None:
        return False, f"no mooncake_master binary in the mooncake package or on PATH; to enable: {HOW_TO_ENABLE}"
    return True, ""


def master_executable(package_dir: Path) -> str | None:
    """The master binary the wheel ships beside its modules (the ``mooncake_master`` script only execs it)."""
    shipped = package_dir / "mooncake_master"
    if shipped.is_file():
        return str(shipped)
    return shutil.which("mooncake_master")


def left_out(reason: str, case: str = "vs mooncake", baseline: str = "mooncake store (tcp)") -> Case:
    """A row in the results that says a Mooncake case did not run, and why: never a silent gap."""
    return skipped(case, baseline, reason, TARGET)


def name(op: str, label: str, batch: int) -> str:
    """The round's name: the Mooncake call it times."""
    call = {"get": "get_into", "put": "put_from"}[op]
    return f"mooncake {call} {label}" if batch == 1 else f"mooncake batch_{call} {label} x{batch}"


def note(op: str, batch: int) -> str:
    what = {"get": "read from the holder's segment into a registered buffer",
            "put": "written from a registered buffer into the holder's segment"}[op]
    per = "one block per call" if batch == 1 else f"{batch} blocks per call"
    return (f"Mooncake Store over TCP, {per}, {what}: master, holder and this client in three processes, "
            f"no checksum; Strata's side is the TCP peer transport to a daemon process, verified")


# ---- the processes -------------------------------------------------------------------------------

_HOLDER_MAIN = r"""
import json, sys
from mooncake.store import MooncakeDistributedStore

a = json.loads(sys.argv[1])
store = MooncakeDistributedStore()
rc = store.setup(a["host"], a["metadata"], a["segment"], a["buffer"], "tcp", "", a["master"])
print(f"setup {rc}", flush=True)
sys.stdin.read()  # the benchmark closes our stdin, or dies: either way, stop
if rc == 0:
    store.close()
"""


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _tail(log) -> str:
    log.seek(0)
    return log.read().decode(errors="replace").strip()[-1500:]


def _stop(proc: subprocess.Popen, timeout_s: float) -> None:
    if proc.stdin is not None and not proc.stdin.closed:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    try:
        proc.wait(timeout_s)
        return
    except subprocess.TimeoutExpired:
        proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def master(exe: str, start_timeout_s: float = 20.0) -> Iterator[tuple[int, int]]:
    """A private ``mooncake_master`` with its HTTP metadata server; yields (rpc port, metadata port).

    Never a shared master: a holder left registered with it by another run
    would be handed this run's blocks.
    """
    reason = ""
    for _attempt in range(3):  # a free port can be taken between the probe and the bind
        rpc, http, metrics = free_port(), free_port(), free_port()
        log = tempfile.TemporaryFile()
        proc = subprocess.Popen(
            [exe, "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={http}", "--metrics_host=127.0.0.1", f"--metrics_port={metrics}"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + start_timeout_s
        while time.monotonic() < deadline and proc.poll() is None and not (_listening(rpc) and _listening(http)):
            time.sleep(0.05)
        if proc.poll() is None and _listening(rpc) and _listening(http):
            try:
                yield rpc, http
            finally:
                _stop(proc, 5.0)
                log.close()
            return
        _stop(proc, 2.0)
        reason = _tail(log) or f"exit status {proc.returncode}"
        log.close()
    raise ServerUnavailable(f"mooncake_master did not start: {reason}")


@contextlib.contextmanager
def holder(rpc: int, http: int, segment_bytes: int, start_timeout_s: float = 30.0) -> Iterator[None]:
    """The process whose store mounts the global segment: the blocks live in its memory."""
    args = dict(host="127.0.0.1", metadata=f"http://127.0.0.1:{http}/metadata", master=f"127.0.0.1:{rpc}",
                segment=segment_bytes, buffer=16 << 20)
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER_MAIN, json.dumps(args)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                            env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"})
    try:
        line = ""
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if sel.select(start_timeout_s):
                line = proc.stdout.readline().decode(errors="replace").strip()
        if line != "setup 0":
            raise ServerUnavailable(f"the Mooncake holder did not start ({line or 'no answer'}): {_tail(log)}")
        yield
    finally:
        _stop(proc, 15.0)
        log.close()


@contextlib.contextmanager
def cluster(segment_bytes: int) -> Iterator[MooncakeClient]:
    """Master, holder (``segment_bytes`` of segment) and this process's client; raises ServerUnavailable."""
    ok, why = available()
    if not ok:
        raise ServerUnavailable(why)
    import mooncake
    from mooncake.store import MooncakeDistributedStore

    exe = master_executable(Path(mooncake.__file__).parent)
    with master(exe) as (rpc, http), holder(rpc, http, segment_bytes):
        store = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", f"http://127.0.0.1:{http}/metadata", 0, LOCAL_BUFFER_BYTES, "tcp", "",
                         f"127.0.0.1:{rpc}")
        if rc != 0:
            raise ServerUnavailable(f"the Mooncake client's setup returned {rc}")
        client = MooncakeClient(store)
        try:
            yield client
        finally:
            client.close()


@contextlib.contextmanager
def optional_cluster(mode: str, segment_bytes: int) -> Iterator[tuple[MooncakeClient | None, str]]:
    """``mode`` "auto": the cluster where it can run, else (None, why); "on": it must run; "off": (None, why)."""
    if mode == "off":
        yield None, "left out by --no-mooncake"
        return
    stack = contextlib.ExitStack()
    try:
        client = stack.enter_context(cluster(segment_bytes))
    except ServerUnavailable as err:
        stack.close()
        if mode == "on":
            raise SystemExit(f"--mooncake: Mooncake Store cannot run here: {err}") from None
        yield None, str(err)
        return
    with stack:
        yield client, ""


# ---- the rounds ---------------------------------------------------------------------------------


class _Registered:
    """A preallocated, touched buffer registered with the client for the zero-copy calls."""

    def __init__(self, store, nbytes: int, fill: bytes | None = None) -> None:
        self.buf = bytearray(fill) if fill is not None else bytearray(nbytes)
        if fill is None:
            self.buf[:] = b"\0" * nbytes  # touched: no page faults in the timed part
        self._anchor = ctypes.c_char.from_buffer(self.buf)
        self.addr = ctypes.addressof(self._anchor)
        self._store = store
        rc = store.register_buffer(self.addr, len(self.buf))
        if rc != 0:
            raise SystemExit(f"Mooncake register_buffer returned {rc}")

    def close(self) -> None:
        self._store.unregister_buffer(self.addr)
        del self._anchor


class MooncakeClient:
    """This process's Mooncake Store client (no segment of its own) and the rounds :func:`interleave` times."""

    def __init__(self, store) -> None:
        self._store = store
        self._buffers: list[_Registered] = []
        self._held: list[str] = []

    def rounds(self, label: str, size: int, batch: int, single_calls: int, batch_calls: int) -> dict[str, RoundFn]:
        """Put ``batch`` blocks of ``size`` for the gets, then the four rounds (get/put, single/batched).

        The previous size's blocks and buffers are dropped first.
        """
        self._drop()
        source = _Registered(self._store, batch * size, os.urandom(batch * size))
        target = _Registered(self._store, batch * size)
        self._buffers += [source, target]
        keys = [f"{label}-{i}" for i in range(batch)]
        ptrs = [source.addr + i * size for i in range(batch)]
        self._expect(self._store.batch_put_from(keys, ptrs, [size] * batch), 0, "batch_put_from")
        self._held = keys
        into = [target.addr + i * size for i in range(batch)]
        return {
            name("get", label, 1): self._get_round(keys[:1], into[:1], size, single_calls),
            name("get", label, batch): self._get_round(keys, into, size, batch_calls),
            name("put", label, 1): self._put_round(f"{label}-put", ptrs, size, 1, single_calls),
            name("put", label, batch): self._put_round(f"{label}-putx", ptrs, size, batch, batch_calls),
        }

    @staticmethod
    def _expect(results, want: int, call: str) -> None:
        if any(r != want for r in results):
            raise SystemExit(f"a benchmark Mooncake {call} answered {results}, not {want} for every key")

    def _get_round(self, keys: list[str], into: list[int], size: int, calls: int) -> RoundFn:
        store, sizes = self._store, [size] * len(keys)

        def run() -> tuple[int, float]:
            t0 = time.perf_counter()
            for _ in range(calls):
                if len(keys) == 1:
                    got = [store.get_into(keys[0], into[0], size)]
                else:
                    got = store.batch_get_into(keys, into, sizes)
                self._expect(got, size, "get")
            return calls * len(keys) * size, time.perf_counter() - t0

        return run

    def _put_round(self, prefix: str, ptrs: list[int], size: int, per_call: int, calls: int) -> RoundFn:
        store, sizes = self._store, [size] * per_call
        keys = [f"{prefix}-{i}" for i in range(calls * per_call)]
        srcs = [ptrs[i % len(ptrs)] for i in range(calls * per_call)]

        def run() -> tuple[int, float]:
            # A key Mooncake holds already would be "put" without moving a byte.
            self._expect(store.batch_is_exist(keys), 0, "batch_is_exist")
            t0 = time.perf_counter()
            for c in range(calls):
                lo, hi = c * per_call, (c + 1) * per_call
                if per_call == 1:
                    done = [store.put_from(keys[lo], srcs[lo], size)]
                else:
                    done = store.batch_put_from(keys[lo:hi], srcs[lo:hi], sizes)
                self._expect(done, 0, "put")
            elapsed = time.perf_counter() - t0
            # Untimed: the next round's puts must move their bytes again, not find the keys present.
            self._expect(store.batch_remove(keys, True), 0, "batch_remove")
            return calls * per_call * size, elapsed

        return run

    def _drop(self) -> None:
        if self._held:
            self._store.batch_remove(self._held, True)
            self._held = []
        for buf in self._buffers:
            buf.close()
        self._buffers = []

    def close(self) -> None:
        try:
            self._drop()
        finally:
            self._store.close()
