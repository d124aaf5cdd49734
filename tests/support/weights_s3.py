"""A real S3 server for the weight pipeline's tests: moto's server on loopback, and a gate in front.

The ``weights_moto`` fixture (session; tests/weightcache/conftest.py) starts
moto's ``ThreadedMotoServer`` on a free port. An :class:`S3Gate` (``s3_gate``,
per test) is a plain HTTP proxy between obstore and moto that the tests steer,
so faults happen on the wire, to a real client:

- it counts every GET of a model file (not of the ``.strata/`` catalog), by
  key and byte range: "verified chunks are not fetched again" is checked as
  requests that reached the server;
- ``throttle(n)`` answers the next ``n`` such GETs ``503 SlowDown`` as S3 does;
- ``corrupt(n)`` flips a byte in the next ``n`` responses (a chunk damaged in
  transit; the object itself is intact);
- ``hold_after(n)`` lets ``n`` more GETs through and parks the rest until
  ``release()``, so a test can kill or fill something at a known point
  instead of racing a download;
- ``max_in_flight`` is the most GETs it ever had open at once.

moto reads the whole object for each ranged GET, so keep objects small
(a few MB) and chunks small. Buckets are per test (:class:`Bucket`, ``make_bucket``). This
file is separate from the KV object tier's S3 fixture on purpose; the two
can be merged later.
"""

from __future__ import annotations

import http.client
import http.server
import threading
import uuid
from collections import Counter
from pathlib import Path

ACCESS = dict(access_key_id="testing", secret_access_key="testing", region="us-east-1")
ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}
SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class S3Gate:
    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.gets: Counter = Counter()  # (key, range) -> count
        self.max_in_flight = 0
        self._in_flight = 0
        self._throttle = 0
        self._corrupt = 0
        self._pass = None  # GETs still let through before holding; None: no hold
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self.held = 0
        gate = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _forward(self):
                gate._handle(self)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    # ---- steering ------------------------------------------------------------

    def throttle(self, n: int) -> None:
        with self._lock:
            self._throttle = n

    def corrupt(self, n: int) -> None:
        with self._lock:
            self._corrupt = n

    def hold_after(self, n: int) -> None:
        with self._lock:
            self._pass = n
            if n == 0:
                self._open.clear()

    def release(self) -> None:
        with self._lock:
            self._pass = None
        self._open.set()

    def data_gets(self) -> int:
        return sum(self.gets.values())

    def reset_counts(self) -> None:
        with self._lock:
            self.gets.clear()
            self.max_in_flight = 0

    def close(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()

    # ---- the proxy -------------------------------------------------------------

    def _handle(self, h: http.server.BaseHTTPRequestHandler) -> None:
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        key = h.path.split("?")[0]
        is_data = h.command == "GET" and "/.strata/" not in key and key.count("/") >= 2
        wait = throttled = corrupt = False
        if is_data:
            with self._lock:
                self.gets[(key, h.headers.get("Range"))] += 1  # counted on arrival, held or not
                if self._pass is not None and self._pass > 0:
                    self._pass -= 1
                    if self._pass == 0:
                        self._open.clear()
                elif self._pass is not None:
                    wait = True
                    self.held += 1
            if wait:
                self._open.wait()
                with self._lock:
                    self.held -= 1
            with self._lock:
                if self._throttle > 0:
                    self._throttle -= 1
                    throttled = True
                elif self._corrupt > 0:
                    self._corrupt -= 1
                    corrupt = True
                self._in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self._in_flight)
        try:
            if throttled:
                return self._reply(h, 503, {"Content-Type": "application/xml"}, SLOW_DOWN)
            conn = http.client.HTTPConnection("127.0.0.1", self.upstream, timeout=60)
            headers = {k: v for k, v in h.headers.items() if k.lower() not in ("connection", "keep-alive")}
            conn.request(h.command, h.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            head = h.command == "HEAD"
            skip = ("transfer-encoding", "connection") if head else ("transfer-encoding", "connection", "content-length")
            out = {k: v for k, v in resp.getheaders() if k.lower() not in skip}
            conn.close()
            if corrupt and data:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            self._reply(h, resp.status, out, data, head=head)
        finally:
            if is_data:
                with self._lock:
                    self._in_flight -= 1

    @staticmethod
    def _reply(h, status: int, headers: dict, data: bytes, head: bool = False) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        if not head:
            h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if not head:
            try:
                h.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client was killed (a test's SIGKILL): nothing to answer


def _request(port: int, method: str, path: str, body: bytes = b"") -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request(method, path, body=body, headers={"Content-Length": str(len(body))})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status


class Bucket:
    """A bucket of its own on the moto server, with plain-HTTP uploads (moto checks no signature)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.name = f"weights-{uuid.uuid4().hex[:12]}"
        assert _request(port, "PUT", f"/{self.name}") == 200

    def put(self, key: str, data: bytes) -> None:
        assert _request(self.port, "PUT", f"/{self.name}/{key}", data) == 200

    def upload(self, folder: Path, prefix: str) -> str:
        """Every file under ``folder`` (not its .strata/ catalog) at ``prefix``; returns the s3:// URL."""
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(folder).as_posix()
            if path.is_file() and not rel.startswith(".strata/"):
                self.put(f"{prefix}/{rel}", path.read_bytes())
        return f"s3://{self.name}/{prefix}"


def s3_options(endpoint: str):
    from weightcache.origin import S3OriginOptions

    return S3OriginOptions(endpoint=endpoint, allow_http=True, request_timeout_s=30, **ACCESS)
