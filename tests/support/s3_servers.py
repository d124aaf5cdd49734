"""A private S3-compatible server for tests, and a proxy in front of it that fails on purpose.

:class:`MotoServer` is moto's ``moto_server`` on a free loopback port, as a
child process that dies with this one (like ``tests/support/redis_servers.py`` does
for Redis). :class:`FaultProxy` forwards HTTP from a port of its own to it,
and on request answers the way a real S3 does when it is unwell:

- ``slowdown``: the next N requests are answered ``503 SlowDown`` (with
  ``Retry-After: retry_after`` when set) and never reach the server;
- ``down``: every request's connection is closed before an answer, as a
  dead endpoint or a dropped load balancer does; set it back to come back;
- ``delay_s``: each request waits this long before it is forwarded (a slow
  endpoint), so deadlines and cancellation are met for real.

It counts what it saw (``seen``: method and path of each request that
reached it) so a test can tell an upload that happened from one that did
not, and when (``attempts``: the monotonic time, method, path and whether
it was refused, of every request, refused ones included), so a test can
check the spacing the server saw between a refusal and the next try. It buffers each request and answer whole: keep objects small in tests
(moto also re-reads a whole object for every ranged GET).
"""

from __future__ import annotations

import ctypes
import http.client
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from benchmarks.harness import free_port

MOTO_SERVER = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
START_TIMEOUT_S = 60.0
ACCESS_KEY = "strata-test-key"  # moto takes any credentials; these only prove they are passed
SECRET_KEY = "strata-test-secret"
REGION = "us-east-1"

_SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>fault-proxy</RequestId></Error>"
)
# moto answers anonymous reads 403 and verifies no signature: a well-formed header is enough.
_AUTH = {"Authorization": f"AWS4-HMAC-SHA256 Credential={ACCESS_KEY}/20260101/{REGION}/s3/aws4_request, "
                          "SignedHeaders=host, Signature=0"}
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


def available() -> bool:
    return Path(MOTO_SERVER).exists()


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _answers(port: int, host: str = "127.0.0.1") -> bool:
    try:
        conn = http.client.HTTPConnection(host, port, timeout=2)
        conn.request("GET", "/moto-api/")
        conn.getresponse().read()
        conn.close()
        return True
    except OSError:
        return False


class MotoServer:
    """``port``: a given one (a server started again where the last one was), else a free one;
    ``host``: the address it listens on (a virtual network's gateway, for daemons in namespaces)."""

    def __init__(self, home: Path, port: int | None = None, host: str = "127.0.0.1") -> None:
        home.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.port = port or free_port()
        self.log = home / "moto.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [MOTO_SERVER, "-H", host, "-p", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
            )

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def wait_ready(self) -> MotoServer:
        end = time.monotonic() + START_TIMEOUT_S
        while not _answers(self.port, self.host):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"moto_server on port {self.port} did not start:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        return self

    def create_bucket(self, bucket: str) -> None:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        conn.request("PUT", f"/{bucket}", headers={"Content-Length": "0"})
        answer = conn.getresponse()
        body = answer.read()
        conn.close()
        if answer.status not in (200, 409):
            raise RuntimeError(f"moto refused bucket {bucket}: {answer.status} {body[:300]!r}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def start_moto(home: Path) -> MotoServer:
    return MotoServer(home).wait_ready()


class FaultProxy:
    """An HTTP proxy on its own loopback port in front of ``upstream_port``; see the module docstring."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.slowdown = 0
        self.retry_after: str | None = None
        self.down = False
        self.delay_s = 0.0
        self.seen: list[tuple[str, str]] = []
        self.attempts: list[tuple[float, str, str, bool]] = []  # (monotonic time, method, path, refused)
        self.refused = 0  # requests answered SlowDown or cut off
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-fault-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(self) -> None:
        with self._lock:
            self.slowdown, self.retry_after, self.down, self.delay_s = 0, None, False, 0.0
            self.seen.clear()
            self.attempts.clear()
            self.refused = 0

    def count(self, method: str, contains: str = "") -> int:
        with self._lock:
            return sum(1 for m, p in self.seen if m == method and contains in p)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _body(self, handler: BaseHTTPRequestHandler) -> bytes:
        if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(handler.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while handler.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                parts.append(handler.rfile.read(size))
                handler.rfile.readline()
        return handler.rfile.read(int(handler.headers.get("Content-Length") or 0))

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        body = self._body(handler)
        with self._lock:
            down, delay = self.down, self.delay_s
            slow = not down and self.slowdown > 0
            if slow:
                self.slowdown -= 1
            if down or slow:
                self.refused += 1
            else:
                self.seen.append((handler.command, handler.path))
            self.attempts.append((time.monotonic(), handler.command, handler.path, down or slow))
        if down:
            handler.close_connection = True
            try:
                handler.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        if slow:
            handler.send_response(503, "Slow Down")
            handler.send_header("Content-Type", "application/xml")
            handler.send_header("Content-Length", str(len(_SLOWDOWN_BODY)))
            if self.retry_after is not None:
                handler.send_header("Retry-After", self.retry_after)
            handler.end_headers()
            handler.wfile.write(_SLOWDOWN_BODY)
            return
        if delay > 0:
            time.sleep(delay)
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP_BY_HOP}
        headers["Content-Length"] = str(len(body))
        upstream = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=60)
        try:
            upstream.request(handler.command, handler.path, body=body, headers=headers)
            answer = upstream.getresponse()
            data = answer.read()
        except OSError:
            handler.close_connection = True
            return
        finally:
            upstream.close()
        handler.send_response(answer.status, answer.reason)
        head = handler.command == "HEAD"  # a HEAD answer's length is the object's, with no body
        for k, v in answer.getheaders():
            if k.lower() not in _HOP_BY_HOP and (head or k.lower() != "content-length"):
                handler.send_header(k, v)
        if not head:
            handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if not head:
            handler.wfile.write(data)


class S3Env:
    """One moto server for a test session, one bucket on it, and fault proxies in front of it.

    Tests isolate themselves by prefix (one per test), as the Redis tests do by key prefix."""

    bucket = "strata-test"

    def __init__(self, server: MotoServer) -> None:
        self.server = server
        server.create_bucket(self.bucket)
        self._delayed: dict[float, FaultProxy] = {}
        self._proxies: list[FaultProxy] = []

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def proxy(self) -> FaultProxy:
        """A fresh fault proxy in front of the server (closed at the end of the session)."""
        p = FaultProxy(self.server.port)
        self._proxies.append(p)
        return p

    def delayed(self, seconds: float) -> FaultProxy:
        """A proxy that delays every request by ``seconds``, shared by every test asking for that delay."""
        if seconds not in self._delayed:
            self._delayed[seconds] = self.proxy()
            self._delayed[seconds].delay_s = seconds
        return self._delayed[seconds]

    def raw_get(self, path: str) -> bytes | None:
        """An object's bytes straight from the server (white box), None when absent."""
        conn = http.client.HTTPConnection(self.server.host, self.server.port, timeout=30)
        try:
            conn.request("GET", f"/{self.bucket}/{path}", headers=_AUTH)
            answer = conn.getresponse()
            body = answer.read()
        finally:
            conn.close()
        return body if answer.status == 200 else None

    def raw_put(self, path: str, data: bytes) -> None:
        conn = http.client.HTTPConnection(self.server.host, self.server.port, timeout=30)
        try:
            conn.request("PUT", f"/{self.bucket}/{path}", body=data, headers={**_AUTH, "Content-Length": str(len(data))})
            answer = conn.getresponse()
            answer.read()
        finally:
            conn.close()
        if answer.status != 200:
            raise RuntimeError(f"moto refused PUT {path}: {answer.status}")

    def keys(self, prefix: str) -> list[str]:
        """Every object name under ``prefix`` (one listing page: tests keep prefixes small)."""
        import re

        conn = http.client.HTTPConnection(self.server.host, self.server.port, timeout=30)
        try:
            conn.request("GET", f"/{self.bucket}?list-type=2&prefix={prefix}", headers=_AUTH)
            body = conn.getresponse().read().decode()
        finally:
            conn.close()
        return re.findall(r"<Key>([^<]*)</Key>", body)

    def all_keys(self, prefix: str) -> list[str]:
        """Every object name under ``prefix``, page after page (``keys`` reads one page)."""
        import re
        import urllib.parse

        names: list[str] = []
        token = ""
        while True:
            query = f"list-type=2&prefix={urllib.parse.quote(prefix)}"
            if token:
                query += f"&continuation-token={urllib.parse.quote(token)}"
            conn = http.client.HTTPConnection(self.server.host, self.server.port, timeout=30)
            try:
                conn.request("GET", f"/{self.bucket}?{query}", headers=_AUTH)
                body = conn.getresponse().read().decode()
            finally:
                conn.close()
            names += re.findall(r"<Key>([^<]*)</Key>", body)
            more = re.search(r"<NextContinuationToken>([^<]*)</NextContinuationToken>", body)
            if more is None:
                return names
            token = more.group(1)

    def close(self) -> None:
        for p in self._proxies:
            p.close()
        self.server.stop()
