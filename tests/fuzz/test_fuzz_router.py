"""A bounded fuzz run of the router's HTTP surface (strata route), in front of a real stand-in engine.

Two routers on real ports, round-robin and cache-aware (which also
tokenizes: a completion's prompt, a chat's messages through the model's
template, against a real daemon's index), before one stand-in engine
(tests/support/router_stand_in.py). Requests are drawn as a hostile client would
send them: JSON bodies of any shape (``st.recursive``), and bodies shaped
like a completion or a chat with each field (model, prompt, messages and
their roles and content, max_tokens, stream, the tokenizer's options) of
the right type or of any other; bodies that are not JSON, not UTF-8, nested
deep, with integers of thousands of digits, gzip or deflate or a coding
that lies; on a bare socket, Content-Length short or long or not a number,
bad Content-Encoding and Transfer-Encoding, and random methods and paths.

After every example: no 5xx the input caused (a 502, 503 or 504 only with
the engine at fault, which a healthy stand-in never is); an answer the
router gives itself is its JSON error body with a 4xx that matches it; an
answer from the engine reaches the client byte for byte as the engine
gives it to the same request sent straight to it; the router holds no
in-flight slot or body read afterwards, answers /health, and routes a
normal completion.

What the fuzz found is kept at the end of this module as regression tests
(a lone surrogate in a prompt was a 500; a connection that never ended its
headers was held for ever); the fuzz draws those inputs too.

Bounded for CI: a fixed number of examples per test, derandomized, no
example database. ``STRATA_FUZZ_EXAMPLES=2000`` runs longer locally (and
``HYPOTHESIS_PROFILE=explore`` draws fresh examples).
"""

from __future__ import annotations

import gzip
import http.client as http_client
import json
import os
import select
import socket
import time
import urllib.parse
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("aiohttp", reason="the router needs aiohttp (pip install 'strata[router]')")

from kvstore.config import load_settings
from kvstore.config.router import load_router_settings
from kvstore.server.daemon import Daemon
from tests.support.raw_frames import weighted
from tests.support.router_stand_in import BLOCK, HASH_SEED, NS, RouterThread, StandIn, build_tokenizer, http, wait_for

pytestmark = pytest.mark.system

EXAMPLES = int(os.environ.get("STRATA_FUZZ_EXAMPLES", "25"))
RAW_EXAMPLES = max(5, EXAMPLES // 3)
# Derandomized under the default (CI) profile; HYPOTHESIS_PROFILE=explore draws fresh examples.
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=settings.default.derandomize,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
RAW = settings(FUZZ, max_examples=RAW_EXAMPLES)

MAX_BODY = 256 << 10  # --max-body-bytes: a body past it is 413
ROUTER_KINDS = {"invalid_request_error", "rate_limit_error", "upstream_error", "server_error"}
APIS = ["/v1/completions", "/v1/chat/completions"]
NORMAL = b'{"model": "m", "prompt": "w1 w2 w3 w4 w5", "max_tokens": 4}'


# ---- the router and its engine -----------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    e = StandIn("a", tmp_path_factory.mktemp("fuzz-router-engine")).start()
    yield e
    e.kill()


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz-router-index")
    daemon = Daemon(load_settings(listen="127.0.0.1:0", disk_dir=str(tmp / "disk"), shm_dir=str(tmp),
                                  metrics_listen="", ram_bytes="16MiB", disk_bytes="0")).start()
    yield f"127.0.0.1:{daemon.port}"
    daemon.stop(0)


@pytest.fixture(scope="module", params=["round-robin", "cache-aware"])
def router(request, engine, tmp_path_factory):
    # Short body and header deadlines: a Content-Length that promises more than comes is answered 408
    # soon, and a connection whose headers never end is closed soon.
    common = {"listen": "127.0.0.1:0", "max_body_bytes": str(MAX_BODY), "body_timeout_seconds": 0.5,
              "header_timeout_seconds": 0.5, "health_interval_seconds": 60}
    if request.param == "cache-aware":
        pytest.importorskip("transformers")
        model_dir = build_tokenizer(tmp_path_factory.mktemp("fuzz-router-model"))
        settings_ = load_router_settings(
            environ={}, endpoint=[f"{engine.url}=engine-a"], policy="cache-aware", model_dir=str(model_dir),
            index=request.getfixturevalue("index"), namespace=NS, hash_seed=HASH_SEED, block_size=BLOCK,
            index_timeout_seconds=5, lora_adapter=["sql-lora"], **common)
    else:
        settings_ = load_router_settings(environ={}, endpoint=[engine.url], policy="round-robin", **common)
    r = RouterThread(settings_)
    yield r
    r.stop()


def _idle(router) -> bool:
    return (router.metric("strata_router_in_flight_requests") == 0
            and router.metric("strata_router_reading_body_requests") == 0)


def _alive(router) -> None:
    """No slot or body read left held; /health answers; a normal completion is routed to the engine."""
    wait_for(lambda: _idle(router), "the router to hold no in-flight request or body read", timeout=30)
    status, _, raw = http("GET", router.url + "/health", timeout=10)
    assert status == 200, raw
    status, _, raw = router.post("/v1/completions", NORMAL, timeout=30)
    assert status == 200 and json.loads(raw)["served_by"] == "a", raw


# ---- strategies ---------------------------------------------------------------------------------

_HUGE_INTS = st.sampled_from([-(1 << 63), (1 << 64) - 1, 10**30, -(10**30)])
# Any code point, lone surrogates too (JSON "\ud800": json.loads accepts it, no tokenizer can encode it).
_CHARACTERS = weighted((9, st.characters()), (1, st.characters(categories=["Cs"])))
_TEXT = st.text(_CHARACTERS, max_size=30)
JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 31), 1 << 31), _HUGE_INTS,
                         st.floats(allow_nan=False, allow_infinity=False), _TEXT,
                         st.sampled_from(["", "w1 w2 w3 w4 w5", "\x00", "é✓", "\ud800", "w1 \udfff w2", "{{ 1/0 }}",
                                          "{% for %}"]))
#: Any JSON value: arrays and objects nested a few deep.
JSON = st.recursive(JSON_SCALARS, lambda c: st.one_of(st.lists(c, max_size=4),
                                                      st.dictionaries(st.text(max_size=8), c, max_size=4)),
                    max_leaves=16)

WORDS = st.lists(st.sampled_from(["w1", "w2", "w3", "w17", "user", ":", "zz", "é", "\ud800"]),
                 max_size=12).map(" ".join)
TOKEN_IDS = st.lists(st.one_of(st.integers(0, 600), st.sampled_from([-1, 1 << 31, (1 << 64) - 1])), max_size=12)


def _odd(good: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly ``good``; now and then any JSON value in its place."""
    return weighted((4, good), (1, JSON))


PARTS = st.lists(st.fixed_dictionaries({"type": _odd(st.just("text")), "text": _odd(WORDS)}), max_size=3)
MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": _odd(st.sampled_from(["user", "assistant", "system", "tool", ""]))},
    optional={"content": weighted((4, WORDS), (1, PARTS), (1, JSON)), "name": JSON, "tool_calls": JSON},
), max_size=4)
_FIELDS = {
    "model": _odd(st.sampled_from(["m", "sql-lora", ""])),
    "max_tokens": _odd(st.sampled_from([1, 4, 16])),
    "stream": _odd(st.booleans()),
    "stream_options": JSON,
    "temperature": JSON,
    "add_special_tokens": JSON,
    "cache_salt": _odd(st.text(_CHARACTERS, max_size=10)),
    "x_fuzz": JSON,
}
COMPLETIONS = st.fixed_dictionaries({"prompt": weighted(
    (3, WORDS), (2, TOKEN_IDS), (1, st.lists(WORDS, max_size=3)), (1, st.lists(TOKEN_IDS, max_size=3)), (1, JSON),
)}, optional=_FIELDS)
CHATS = st.fixed_dictionaries({"messages": _odd(MESSAGES)}, optional={
    **_FIELDS, "add_generation_prompt": JSON, "continue_final_message": JSON,
    "chat_template_kwargs": _odd(st.dictionaries(st.sampled_from(["enable_thinking", "tokenize", "chat_template",
                                                                  "add_generation_prompt", "messages", "tools"]),
                                                 JSON, max_size=3)),
    "chat_template": JSON, "tools": JSON, "documents": JSON,
})

# Keys the stand-in engine obeys as test controls (it would wait on them for ever), never sent.
_CONTROLS = ("x_hold", "x_hold_mid_stream")


def _no_controls(body):
    return not (isinstance(body, dict) and any(k in body for k in _CONTROLS))


def bodies(path: str) -> st.SearchStrategy[bytes]:
    """A request body: shaped like ``path``'s request with fields of any type, any JSON at all,
    or bytes that are not (all) JSON."""
    shaped = COMPLETIONS if path == "/v1/completions" else CHATS
    as_json = weighted((6, shaped), (2, JSON)).filter(_no_controls).map(lambda b: json.dumps(b).encode())
    broken = st.one_of(
        st.binary(max_size=200),
        st.sampled_from([b"", b"{", b"null", b"[]", b'"prompt"', b"\xef\xbb\xbf{}", b'{"prompt": NaN}',
                         b'{"prompt": "w1", "max_tokens": Infinity}', b'{"prompt": "\xff\xfe"}',
                         b'{"prompt": "w1 \\ud800 w2"}', b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
                         b'{"prompt": "w1", "prompt": 7}',
                         b'{"messages": [{"role": "user", "content": "w1"}], "stream": true}',
                         b"[" * 5000 + b"]" * 5000, b'{"prompt": [' + b"9" * 5000 + b"]}",
                         b'{"prompt": "' + b"w1 " * 100_000 + b'"}']),
        as_json.map(lambda b: b[: len(b) // 2]),
    )
    return weighted((8, as_json), (2, broken))


CODINGS = weighted(
    (6, st.just(None)),
    (1, st.sampled_from(["gzip", "deflate", "identity", "br", "zstd", "x-unknown", "gzip, gzip", "GZIP", ""])),
)


def _encode(body: bytes, coding: str | None, honest: bool) -> bytes:
    if not honest or coding is None:
        return body
    if coding.strip().lower() == "gzip":
        return gzip.compress(body)
    if coding.strip().lower() == "deflate":
        return zlib.compress(body)
    return body


# ---- judging ------------------------------------------------------------------------------------


def _routers_own(raw: bytes) -> dict | None:
    """The router's own error body ({"error": {message, type, code}}), or None (an engine's answer)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("type") in ROUTER_KINDS and "served_by" not in body:
        return error
    return None


def _judge(router, engine, method: str, path: str, data: bytes | None, headers: dict, routed) -> None:
    status, _, raw = routed
    own = _routers_own(raw)
    if own is not None:
        assert own["code"] == status and isinstance(own["message"], str) and own["message"], own
        # A healthy stand-in never makes the router answer 502, 503 or 504; nothing may make it 500.
        assert status < 500, f"{method} {path}: the router answered {status} for {data!r:.300}: {own['message']}"
        return
    direct = http(method, engine.url + path, data, headers=headers, timeout=30)
    assert (status, raw) == (direct[0], direct[2]), (
        f"{method} {path}: routed {status} {raw[:200]!r}, straight to the engine {direct[0]} {direct[2][:200]!r}")


# ---- the fuzz -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", APIS)
def test_bodies_of_any_shape_get_a_4xx_or_the_engines_own_answer(router, engine, path):
    @FUZZ
    @given(body=bodies(path), coding=CODINGS, honest=st.booleans())
    def run(body, coding, honest):
        headers = {} if coding is None else {"Content-Encoding": coding}
        data = _encode(body, coding, honest)
        routed = router.post(path, data, headers=headers, timeout=30)
        _judge(router, engine, "POST", path, data, headers, routed)
        _alive(router)

    run()


METHODS = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "FOO"])
PATHS = st.one_of(
    st.sampled_from(["/", "/v1", "/v1/", "/v1/completions/", "//v1/completions", "/v1/completions?stream=true",
                     "/v1/chat/completions#x", "/V1/COMPLETIONS", "/v1/models", "/health", "/metrics", "/admin/health",
                     "/v1/embeddings", "/%2e%2e/etc/passwd", "/v1/chat%2Fcompletions", "/v1/completions%00",
                     "/" + "a" * 5000, "/health?" + "q=1&" * 500]),
    st.lists(st.text(alphabet="abcv1/._-%~é", max_size=8), max_size=5).map(lambda p: "/" + "/".join(p)),
)


def test_any_method_on_any_path_gets_an_answer_that_is_not_a_5xx(router):
    @FUZZ
    @given(method=METHODS, path=PATHS, body=st.one_of(st.none(), st.just(NORMAL), st.binary(max_size=40)))
    def run(method, path, body):
        if method in ("GET", "HEAD", "OPTIONS", "TRACE") and body is not None:
            body = None
        quoted = urllib.parse.quote(path, safe="/%?#&=~.-_:")
        status, _, raw = http(method, router.url + quoted, body, timeout=30)
        assert status < 500 or status == 503 and path.startswith("/health"), f"{method} {path}: {status} {raw[:200]!r}"
        own = _routers_own(raw)
        if status in (404, 405) and method != "HEAD":  # a HEAD answer has no body
            assert own is not None and own["code"] == status, raw[:200]
        _alive(router)

    run()


# ---- bare sockets: headers that lie -------------------------------------------------------------


def _raw_exchange(url: str, request: bytes, wait_s: float = 30.0) -> int | None:
    """Send ``request`` on a bare socket; the status of the first answer (None: the router closed
    without one). Not half-closed: the router, like aiohttp, drops the answer to a client that
    shut its side. A router that neither answers nor closes within ``wait_s`` has hung."""
    host, _, port = url.removeprefix("http://").rpartition(":")
    with socket.create_connection((host, int(port)), timeout=wait_s) as sock:
        try:
            sock.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it answered (or closed) before it read everything
        response = http_client.HTTPResponse(sock)
        try:
            response.begin()
            response.read()
        except (http_client.RemoteDisconnected, http_client.IncompleteRead, ConnectionResetError):
            return None
        except TimeoutError:
            pytest.fail(f"the router neither answered nor closed within {wait_s:g} s: {request[:300]!r}")
        return response.status


@st.composite
def lying_requests(draw) -> bytes:
    path = draw(st.sampled_from([*APIS, "/health", "/v1/models", "/nowhere"]))
    body = draw(bodies("/v1/completions" if path != "/v1/chat/completions" else path))
    length = draw(weighted((2, st.just(len(body))), (1, st.integers(0, max(0, len(body) - 1))),
                           (1, st.integers(len(body) + 1, len(body) + 10_000)),
                           (1, st.sampled_from(["-1", "abc", "1e3", " 5", "99999999999999999999", "0x10", ""]))))
    lines = [f"{draw(st.sampled_from(['POST', 'POST', 'GET']))} {path} HTTP/1.1", "Host: 127.0.0.1",
             "Content-Type: application/json", f"Content-Length: {length}", "Connection: close"]
    coding = draw(CODINGS)
    if coding is not None:
        lines.append(f"Content-Encoding: {coding}")
    if draw(st.integers(0, 5)) == 0:
        lines.append(draw(st.sampled_from(["Transfer-Encoding: chunked", "Transfer-Encoding: gzip, chunked",
                                           "Transfer-Encoding: x", "Expect: 100-continue", "Content-Length: 3"])))
    if draw(st.integers(0, 5)) == 0:
        lines.append(draw(st.sampled_from(["X-Fuzz: " + "v" * 9000, "X-Bad\x01Name: 1", "X-Empty:", ": no-name"])))
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def test_headers_that_lie_about_the_body_get_an_answer_that_is_not_a_5xx(router, engine):
    @RAW
    @given(request=lying_requests())
    def run(request):
        status = _raw_exchange(router.url, request)
        assert status is None or status < 500, f"{status} for {request[:300]!r}"
        _alive(router)

    run()


def test_garbage_on_the_socket_gets_a_4xx_or_a_close(router):
    """Random bytes, alone or after a request line and a header, then a blank line: what may never
    begin a request (nothing, only blank lines) is closed at the header deadline."""
    @RAW
    @given(data=st.one_of(st.binary(max_size=300),
                          st.binary(max_size=100).map(lambda b: b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + b)))
    def run(data):
        status = _raw_exchange(router.url, data + b"\r\n\r\n")
        assert status is None or status < 500, f"{status} for {data!r:.300}"
        _alive(router)

    run()


# ---- what the fuzz found, as explicit cases ------------------------------------------------------


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", b'{"prompt": "w1 \\ud800 w2"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "w1 \\udfff"}]}'),
    ("/v1/completions", b'{"prompt": "w1 w2 w3 w4 w5 w6 w7 w8", "cache_salt": "s\\ud800"}'),
], ids=["completion", "chat", "cache-salt"])
def test_a_lone_surrogate_in_a_prompt_is_not_a_500(router, engine, path, body):
    """No tokenizer (TypeError) nor the block hash's UTF-8 (UnicodeEncodeError, for a cache salt) can
    encode a lone surrogate, and either was aiohttp's own 500: the router scores the request with U+FFFD
    in its place and forwards it as it came, so the engine's answer is the client's."""
    if router.router.settings.policy != "cache-aware":
        pytest.skip("only the cache-aware router tokenizes the prompt")
    routed = router.post(path, body, timeout=30)
    _judge(router, engine, "POST", path, body, {}, routed)


HEADER_WAIT_S = 2.0  # four times the routers' header deadline: how long a test waits for the router to act


def test_a_request_that_never_begins_or_never_ends_its_headers_is_closed(router):
    """Three clients at once: one sends nothing, one blank lines, one half its headers. All three were
    held for ever (still after 300 s); --header-timeout-seconds closes each."""
    if router.router.settings.policy != "round-robin":
        pytest.skip("the policy plays no part before a request's headers are whole")
    host, _, port = router.url.removeprefix("http://").rpartition(":")
    sent = [b"", b"\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"]
    socks = [socket.create_connection((host, int(port)), timeout=HEADER_WAIT_S) for _ in sent]
    try:
        for sock, data in zip(socks, sent):
            sock.sendall(data)
        end = time.monotonic() + HEADER_WAIT_S
        held = list(socks)
        while held and time.monotonic() < end:  # each is closed at its own deadline: wait for the last
            readable, _, _ = select.select(held, [], [], max(0.0, end - time.monotonic()))
            held = [sock for sock in held if sock not in readable]
        late = [data for sock, data in zip(socks, sent) if sock in held]
        assert not late, f"the router neither answered nor closed within {HEADER_WAIT_S:g} s after {late}"
    finally:
        for sock in socks:
            sock.close()


def test_a_kept_alive_connection_idles_past_the_header_deadline_until_the_keepalive_timeout(engine):
    """The header deadline is the first request's: a connection idle after a response is closed by
    --keepalive-timeout-seconds, not by it, and serves its next request until then. (The module's
    routers keep aiohttp's 75 s, so that there only the header deadline can close a connection.)"""
    r = RouterThread(load_router_settings(environ={}, endpoint=[engine.url], policy="round-robin",
                                          listen="127.0.0.1:0", header_timeout_seconds=0.3,
                                          keepalive_timeout_seconds=1.2, health_interval_seconds=60))
    host, _, port = r.url.removeprefix("http://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=HEADER_WAIT_S) as sock:
            for _ in range(2):
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                response = http_client.HTTPResponse(sock)
                response.begin()
                response.read()
                assert response.status == 200 and not response.will_close
                time.sleep(0.6)  # past the header deadline (0.3 s, swept each 0.075 s), short of the keep-alive's
            readable, _, _ = select.select([sock], [], [], 1.2 + HEADER_WAIT_S)
            assert readable and sock.recv(1) == b"", "the router kept an idle connection past its keep-alive timeout"
    finally:
        r.stop()
