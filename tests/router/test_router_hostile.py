"""strata route against hostile clients: slow bodies, JSON its parser cannot hold, bodies that do not
decode, clients that vanish, paths it does not serve, and an engine whose queue gauge is not a count.

A real router on a real port in front of stand-in engines (tests/support/router_stand_in.py); the slow
clients are bare sockets (:class:`RawClient`) that send headers and part of a body, then stop.
Nothing here waits on the clock: the deadlines are small settings and the tests wait on the
router's gauges and on the answers.
"""

from __future__ import annotations

import gzip
import json
import time
import zlib

import pytest

pytest.importorskip("aiohttp", reason="the router needs aiohttp (pip install 'strata-kvcache[router]')")

from kvstore.config.load import SettingsError
from kvstore.config.router import load_router_settings
from tests.support.router_stand_in import (
    BLOCK, HASH_SEED, NS, RECURSIVE_TEMPLATE, RawClient, build_tokenizer, http, served_by, wait_for,
)

COMPLETION = b'{"model": "m", "prompt": "w1 w2 w3", "max_tokens": 4}'


def waiting_bodies(r) -> float:
    """Requests the router has accepted whose body has not arrived whole (counted in flight or apart)."""
    return r.metric("strata_router_reading_body_requests") + r.metric("strata_router_in_flight_requests")


def stall(r, n: int, *, sent: bytes = b'{"pro', content_length: int = 100) -> list[RawClient]:
    """``n`` clients that send their headers and the first bytes of a body, then nothing."""
    clients = []
    for _ in range(n):
        c = RawClient(r.url, "/v1/completions", content_length=content_length)
        c.send(sent)
        clients.append(c)
    wait_for(lambda: waiting_bodies(r) == n, f"{n} bodies arriving at the router")
    return clients


def error_message(raw: bytes) -> str:
    error = json.loads(raw)["error"]
    assert error["type"] == "invalid_request_error", error
    return error["message"]


# ---- slow bodies -------------------------------------------------------------------------------


def test_clients_stalled_mid_body_hold_no_in_flight_slot(engines, routers):
    """The finding: 16 clients with their headers and 5 body bytes sent held all 16 slots; others got 429."""
    a = engines("a")
    r = routers(endpoint=[a.url], policy="round-robin", max_in_flight=16)
    stalled = stall(r, 16)
    try:
        status, _, raw = r.post("/v1/completions", COMPLETION)
        assert status == 200, raw
        assert served_by(raw) == "a"
        assert r.metric("strata_router_reading_body_requests") == 16
    finally:
        for c in stalled:
            c.close()
    wait_for(lambda: waiting_bodies(r) == 0, "the stalled clients' reads to end")


def test_a_body_not_whole_within_the_body_timeout_is_408_and_frees_its_share(engines, routers):
    a = engines("a")
    r = routers(endpoint=[a.url], policy="round-robin", max_in_flight=16, body_timeout_seconds=0.2)
    stalled = stall(r, 16)
    try:
        for c in stalled:
            status, headers, raw = c.response()
            assert status == 408, raw
            assert "--body-timeout-seconds" in error_message(raw)
            assert headers["Connection"] == "close"  # the rest of that body is never read
    finally:
        for c in stalled:
            c.close()
    assert waiting_bodies(r) == 0
    assert r.metric("strata_router_refused_total", code="408") == 16
    assert r.post("/v1/completions", COMPLETION)[0] == 200
    assert a.admin("queue", n=0)["served"] == 1  # none of the partial bodies reached the engine


def test_the_body_deadline_is_for_the_whole_body_not_the_gap_between_bytes(engines, routers):
    """A client that trickles a byte at a time never lets a gap timeout fire; a deadline still does."""
    a = engines("a")
    r = routers(endpoint=[a.url], policy="round-robin", body_timeout_seconds=0.5)
    c = RawClient(r.url, "/v1/completions", content_length=1 << 20)
    try:
        c.send(b'{"prompt": "')
        for _ in range(1000):  # a byte every 20 ms: each gap far below the 0.5 s deadline
            if c.answered():
                break
            try:
                c.send(b"w")
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.02)
        else:
            pytest.fail("the router kept reading a body trickled over 1,000 gaps")
        status, _, raw = c.response()
    finally:
        c.close()
    assert status == 408 and "--body-timeout-seconds" in error_message(raw)


def test_bodies_arriving_beyond_their_own_bound_are_429(engines, routers):
    a = engines("a")
    r = routers(endpoint=[a.url], policy="round-robin", max_body_reads=2, retry_after_seconds=7)
    stalled = stall(r, 2)
    third = RawClient(r.url, "/v1/completions", content_length=100)
    try:
        third.send(b'{"pro')
        status, headers, raw = third.response()
        assert status == 429 and headers["Retry-After"] == "7"
        assert "--max-body-reads" in json.loads(raw)["error"]["message"]
        assert r.metric("strata_router_in_flight_requests") == 0
    finally:
        for c in [*stalled, third]:
            c.close()
    wait_for(lambda: waiting_bodies(r) == 0, "the stalled clients' reads to end")
    assert r.post("/v1/completions", COMPLETION)[0] == 200


def test_a_client_gone_mid_body_is_not_counted_as_a_server_error(engines, routers):
    a = engines("a")
    r = routers(endpoint=[a.url], policy="round-robin")
    (c,) = stall(r, 1)
    c.close()
    wait_for(lambda: r.metric("strata_router_refused_total", code="499") == 1, "the vanished client to be counted",
             timeout=10)
    assert r.metric("strata_router_request_duration_seconds_count", api="completions", policy="round-robin",
                    code="5xx") == 0
    assert waiting_bodies(r) == 0


def test_the_body_settings_are_validated():
    for name, value in (("BODY_TIMEOUT_SECONDS", "0"), ("BODY_TIMEOUT_SECONDS", "1e9"), ("MAX_BODY_READS", "0")):
        with pytest.raises(SettingsError, match=f"STRATA_ROUTER_{name}"):
            load_router_settings(environ={f"STRATA_ROUTER_{name}": value}, endpoint=["http://a:1"],
                                 policy="round-robin")


# ---- bodies the parser cannot hold -----------------------------------------------------------------


DEEP = 100_000


@pytest.mark.parametrize("path, raw, message", [
    ("/v1/completions", b"[" * DEEP + b"]" * DEEP, "nests arrays or objects too deeply"),
    ("/v1/completions", b'{"a": ' * DEEP + b"1" + b"}" * DEEP, "nests arrays or objects too deeply"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": ' + b"[" * DEEP + b"]" * DEEP + b"}]}",
     "nests arrays or objects too deeply"),
    ("/v1/completions", b'{"prompt": "w1", "max_tokens": ' + b"9" * 5000 + b"}", "integer too long"),
    ("/v1/completions", b'{"prompt": [-' + b"7" * 5000 + b"]}", "integer too long"),
], ids=["array", "object", "chat-content", "max-tokens-digits", "token-id-digits"])
def test_json_the_parser_cannot_hold_is_400_saying_why(engines, routers, path, raw, message):
    a = engines("a")
    r = routers(endpoint=[a.url], policy="round-robin")
    status, _, body = r.post(path, raw)
    assert status == 400, body[:200]
    assert message in error_message(body)
    assert a.admin("queue", n=0)["served"] == 0


NOT_STRING_MODELS = [
    ("/v1/completions", {"prompt": "w1 w2 w3 w4 w5", "model": ["m"]}),
    ("/v1/completions", {"prompt": "w1 w2 w3 w4 w5", "model": {"name": "m"}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1 w2 w3 w4 w5"}], "model": 7}),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A model directory whose chat template renders a message's content parts by recursion."""
    pytest.importorskip("transformers")
    return build_tokenizer(tmp_path_factory.mktemp("model"), chat_template=RECURSIVE_TEMPLATE)


def cache_aware(request, a, **extra) -> dict:
    return dict(endpoint=[f"{a.url}=engine-a"], policy="cache-aware", model_dir=str(request.getfixturevalue("model_dir")),
                index=request.getfixturevalue("daemon").target, namespace=NS, hash_seed=HASH_SEED, block_size=BLOCK,
                index_timeout_seconds=5, **extra)


@pytest.mark.parametrize("policy", ["round-robin", "cache-aware"])
def test_a_model_that_is_not_a_string_is_400(request, engines, routers, policy):
    a = engines("a")
    if policy == "cache-aware":  # where the model's name is looked up among the LoRA adapters
        r = routers(**cache_aware(request, a, lora_adapter=["sql-lora"]))
    else:
        r = routers(endpoint=[a.url], policy=policy)
    for path, body in NOT_STRING_MODELS:
        status, _, raw = r.post(path, body)
        assert status == 400, (body, raw)
        assert "'model' must be a string" in error_message(raw)
    assert a.admin("queue", n=0)["served"] == 0
    for path, body in NOT_STRING_MODELS:
        assert r.post(path, {**body, "model": "sql-lora"})[0] == 200


def test_a_bad_max_tokens_is_the_engines_own_answer_passed_through(engines, routers):
    """The router does not read max_tokens; the engine's 400 comes back as the engine wrote it."""
    a = engines("a")
    r = routers(endpoint=[a.url], policy="round-robin")
    for max_tokens in ("lots", -1, 0, 2.5, None, [4]):
        body = {"model": "m", "prompt": "w1", "max_tokens": max_tokens}
        direct, routed = http("POST", a.url + "/v1/completions", body), r.post("/v1/completions", body)
        assert routed[0] == direct[0] == (200 if max_tokens is None else 400), max_tokens
        assert routed[2] == direct[2]


def test_a_clients_chat_template_is_never_rendered_by_the_router(request, engines, routers):
    """Jinja from the client ran on the router: {{ 1/0 }} was a 500. Now it goes to the engine untouched."""
    a = engines("a")
    r = routers(**cache_aware(request, a))
    messages = [{"role": "user", "content": "w1 w2 w3 w4 w5"}]
    for body in ({"messages": messages, "chat_template_kwargs": {"chat_template": "{{ 1/0 }}"}},
                 {"messages": messages, "chat_template_kwargs": {"chat_template": "{{ x }}", "tokenize": True}},
                 {"messages": messages, "chat_template": "{{ 1/0 }}"}):
        direct, routed = http("POST", a.url + "/v1/chat/completions", body), r.post("/v1/chat/completions", body)
        assert routed[0] == direct[0] == 200, routed[2]
        assert routed[2] == direct[2]


def test_content_nested_deeper_than_the_template_can_recurse_is_400(request, engines, routers):
    a = engines("a")
    r = routers(**cache_aware(request, a))
    nested = lambda depth: json.loads("[" * depth + '"w1 w2 w3 w4"' + "]" * depth)  # noqa: E731
    chat = lambda depth: {"messages": [{"role": "user", "content": nested(depth)}]}  # noqa: E731
    assert r.post("/v1/chat/completions", chat(3))[0] == 200  # the template does render nested parts
    status, _, raw = r.post("/v1/chat/completions", chat(600))  # parses (under ~1,000 levels), cannot render
    assert status == 400, raw
    assert "nest too deeply" in error_message(raw)
    assert a.admin("queue", n=0)["served"] == 1


# ---- request codings ---------------------------------------------------------------------------------


@pytest.mark.parametrize("coding, compress", [("gzip", gzip.compress), ("deflate", zlib.compress)])
def test_a_compressed_body_reaches_the_engine_decoded(engines, routers, coding, compress):
    a = engines("a")
    r = routers(endpoint=[a.url], policy="round-robin")
    headers = {"Content-Encoding": coding}
    direct = http("POST", a.url + "/v1/completions", compress(COMPLETION), headers=headers)
    routed = r.post("/v1/completions", compress(COMPLETION), headers=headers)
    assert routed[0] == direct[0] == 200, routed[2]
    assert routed[2] == direct[2]


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_a_body_that_does_not_decode_is_400(engines, routers, coding):
    a = engines("a")
    r = routers(endpoint=[a.url], policy="round-robin")
    status, _, raw = r.post("/v1/completions", b"\x1f\x8b not compressed at all", headers={"Content-Encoding": coding})
    assert status == 400, raw
    message = error_message(raw)
    assert "cannot be read" in message and coding in message
    assert a.admin("queue", n=0)["served"] == 0


# ---- paths and methods --------------------------------------------------------------------------------


@pytest.mark.parametrize("method, path, status, allow", [
    ("POST", "/v1/nope", 404, None),
    ("GET", "/v1/embeddings", 404, None),
    ("GET", "/v1/completions", 405, "POST"),
    ("POST", "/health", 405, "GET, HEAD"),
])
def test_unknown_paths_and_methods_are_json_errors(engines, routers, method, path, status, allow):
    a = engines("a")
    r = routers(endpoint=[a.url], policy="round-robin")
    got, headers, raw = http(method, r.url + path, b"{}" if method == "POST" else None)
    assert got == status
    message = error_message(raw)
    assert path in message
    if allow is None:
        assert "POST /v1/chat/completions" in message  # what it does serve
    else:
        assert headers["Allow"] == allow and allow in message
    assert r.metric("strata_router_refused_total", code=str(status)) == 1


# ---- what an engine reports ---------------------------------------------------------------------------


@pytest.mark.parametrize("queue", ["NaN", "-5", "+Inf"])
def test_an_engine_queue_gauge_that_is_not_a_count_counts_as_no_queue(engines, routers, queue):
    a, b = engines("a"), engines("b")
    r = routers(endpoint=[a.url, b.url], policy="least-loaded", health_interval_seconds=0.05)
    a.admin("queue", n=queue)
    rounds = r.metric("strata_router_health_rounds_total")
    wait_for(lambda: r.metric("strata_router_health_rounds_total") >= rounds + 2, "a scrape of a's new queue")
    assert r.metric("strata_router_endpoint_queue_depth_requests", endpoint="0") == 0
    got = [served_by(r.post("/v1/completions", {"prompt": f"w{i}"})[2]) for i in range(4)]
    assert got == ["a", "b", "a", "b"]  # both idle: they take turns
