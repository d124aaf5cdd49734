"""strata route as a proxy: bytes through unchanged, its limits, bad input, its CLI, the reference engine.

The engines are real processes: the deterministic stand-in (tests/support/router_stand_in.py)
where the same request must give the same bytes, and the benchmark's reference engine
(a tiny real model; skipped without torch) for the cache-aware path end to end.
"""

from __future__ import annotations

import http.client as http_client
import json
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("aiohttp", reason="the router needs aiohttp (pip install 'strata-kvcache[router]')")

from kvstore.config.router import ROUTER_SETTINGS, load_router_settings, router_env
from tests.support.router_stand_in import (
    BLOCK, HASH_SEED, NS, ReferenceEngine, build_tokenizer, free_port, http, served_by, wait_for,
)


# ---- bytes through ------------------------------------------------------------------------


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "m", "prompt": "w1 w2 w3", "max_tokens": 5, "stream": True}),
    ("/v1/completions", {"model": "m", "prompt": [5, 6, 7, 8, 9], "max_tokens": 5}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "w1"}], "stream": True}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "w1"}]}),
])
def test_responses_pass_through_byte_for_byte(engines, routers, path, body):
    a = engines("a")
    r = routers(endpoint=[a.url], policy="round-robin")
    direct = http("POST", a.url + path, body)
    routed = r.post(path, body)
    assert routed[0] == direct[0] == 200
    assert routed[2] == direct[2]
    assert routed[1]["Content-Type"] == direct[1]["Content-Type"]
    stream = "true" if body.get("stream") else "false"
    assert r.metric("strata_router_time_to_first_byte_seconds_count", endpoint="0", policy="round-robin",
                    stream=stream) == 1
    api = "chat" if "chat" in path else "completions"
    # Observed when the handler returns, which may be just after the client has read the end.
    wait_for(lambda: r.metric("strata_router_request_duration_seconds_count", api=api, policy="round-robin",
                              code="2xx") == 1, "the request's duration to be observed")


def test_models_and_health_and_metrics(engines, routers):
    a = engines("a")
    r = routers(endpoint=[a.url], policy="least-loaded")
    assert http("GET", r.url + "/v1/models")[2] == http("GET", a.url + "/v1/models")[2]
    status, _, raw = http("GET", r.url + "/health")
    assert status == 200 and json.loads(raw)["endpoints_healthy"] == 1
    text = http("GET", r.url + "/metrics")[2].decode()
    assert 'strata_router_endpoint_healthy{endpoint="0"} 1.0' in text
    assert f'strata_router_endpoint_info{{endpoint="0",ids="",url="{a.url}"}} 1.0' in text


def test_a_stream_broken_midway_is_cut_and_never_retried(engines, routers):
    a, b = engines("a"), engines("b")
    r = routers(endpoint=[a.url, b.url], policy="round-robin", health_interval_seconds=3600)
    body = {"prompt": "w1", "stream": True, "x_hold_mid_stream": "cut"}
    with ThreadPoolExecutor(1) as pool:
        routed = pool.submit(r.post, "/v1/completions", body)
        wait_for(lambda: r.metric("strata_router_time_to_first_byte_seconds_count", endpoint="0",
                                  policy="round-robin", stream="true") == 1, "the stream's first event")
        a.kill()
        with pytest.raises(http_client.IncompleteRead):  # a broken chunked body, not one that looks whole
            routed.result(timeout=30)
    assert b.admin("queue", n=0)["served"] == 0  # not sent again
    assert r.metric("strata_router_upstream_errors_total", endpoint="0", kind="disconnect") == 1
    assert r.metric("strata_router_endpoint_healthy", endpoint="0") == 0


def test_an_engine_silent_past_the_upstream_timeout_is_504_and_stays_in_rotation(engines, routers):
    a = engines("a")
    r = routers(endpoint=[a.url], policy="round-robin", upstream_timeout_seconds=0.5, health_interval_seconds=3600)
    status, _, raw = r.post("/v1/completions", {"prompt": "w1", "x_hold": "never"})
    assert status == 504 and "upstream timeout" in json.loads(raw)["error"]["message"]
    assert r.metric("strata_router_endpoint_healthy", endpoint="0") == 1
    a.admin("release", tag="never")
    assert r.post("/v1/completions", {"prompt": "w2"})[0] == 200


# ---- limits and bad input ----------------------------------------------------------------


def test_beyond_max_in_flight_is_429_with_retry_after(engines, routers):
    a = engines("a")
    r = routers(endpoint=[a.url], policy="round-robin", max_in_flight=2, retry_after_seconds=3)
    body = lambda tag: {"prompt": "w1", "x_hold": tag}  # noqa: E731
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(r.post, "/v1/completions", body(f"t{i}")) for i in range(2)]
        wait_for(lambda: r.metric("strata_router_in_flight_requests") == 2, "two requests in flight")
        status, headers, raw = r.post("/v1/completions", {"prompt": "w2"})
        assert status == 429 and headers["Retry-After"] == "3"
        assert "--max-in-flight" in json.loads(raw)["error"]["message"]
        for i in range(2):
            a.admin("release", tag=f"t{i}")
        assert [h.result(timeout=30)[0] for h in held] == [200, 200]
    assert r.post("/v1/completions", {"prompt": "w3"})[0] == 200
    assert r.metric("strata_router_refused_total", code="429") == 1


@pytest.mark.parametrize("path, raw, status, message", [
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", b"\xff\xfe", 400, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, "must be a JSON object"),
    ("/v1/completions", b'{"model": "m"}', 400, "'prompt' must be"),
    ("/v1/completions", b'{"prompt": [true, 2]}', 400, "'prompt' must be"),
    ("/v1/completions", b'{"prompt": [3, -1]}', 400, "'prompt' must be"),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400, "'messages' must be"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "'messages' must be"),
    ("/v1/completions", b'{"prompt": "' + b"w1 " * 400 + b'"}', 413, "--max-body-bytes"),
])
def test_bad_input_is_refused_with_a_clear_message(engines, routers, path, raw, status, message):
    a = engines("a")
    r = routers(endpoint=[a.url], policy="round-robin", max_body_bytes="1KiB")
    got, _, body = r.post(path, raw)
    assert got == status
    assert message in json.loads(body)["error"]["message"]
    assert a.admin("queue", n=0)["served"] == 0  # nothing reached the engine


def test_a_chunked_body_over_the_limit_is_413(engines, routers):
    a = engines("a")
    r = routers(endpoint=[a.url], policy="round-robin", max_body_bytes="1KiB")

    def chunks():
        yield b'{"prompt": "'
        for _ in range(200):  # 1,800 bytes, no Content-Length
            yield b"w1 w2 w3 "
        yield b'"}'

    status, _, body = http("POST", r.url + "/v1/completions", chunks(), headers={"Transfer-Encoding": "chunked"})
    assert status == 413 and "--max-body-bytes" in json.loads(body)["error"]["message"]
    assert a.admin("queue", n=0)["served"] == 0


def test_a_malformed_chat_template_input_is_400(tmp_path, engines, routers, daemon):
    pytest.importorskip("transformers")
    model = build_tokenizer(tmp_path / "model")
    a = engines("a")
    r = routers(endpoint=[f"{a.url}=engine-a"], policy="cache-aware", model_dir=str(model), index=daemon.target,
                namespace=NS, hash_seed=HASH_SEED, block_size=BLOCK, index_timeout_seconds=5)
    status, _, raw = r.post("/v1/chat/completions", {"messages": [{"content": "no role"}]})
    message = json.loads(raw)["error"]["message"]
    assert status == 400 and "chat template" in message and "every message needs a role" in message
    assert r.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1 w2 w3 w4 w5"}]})[0] == 200


# ---- settings and the CLI ------------------------------------------------------------------


def test_settings_name_what_to_change():
    from kvstore.config.load import SettingsError

    with pytest.raises(SettingsError, match="--endpoint"):
        load_router_settings(environ={})
    with pytest.raises(SettingsError, match="cache-aware needs --model-dir, --index, --namespace, --hash-seed"):
        load_router_settings(environ={}, endpoint=["http://127.0.0.1:1"])
    with pytest.raises(SettingsError, match=r"endpoint 'http:/x' must look like"):
        load_router_settings(environ={}, endpoint=["http:/x"], policy="round-robin")
    with pytest.raises(SettingsError, match="STRATA_ROUTER_MAX_IN_FLIGHT"):
        load_router_settings(environ={"STRATA_ROUTER_MAX_IN_FLIGHT": "0"}, endpoint=["http://a:1"], policy="round-robin")
    s = load_router_settings(environ={"STRATA_ROUTER_ENDPOINT": "http://a:1=x,y http://b:2", "STRATA_ROUTER_POLICY":
                                      "least-loaded"})
    assert s.endpoint_specs() == [("http://a:1", ("x", "y")), ("http://b:2", ())]


@pytest.mark.system
def test_help_explains_every_flag():
    out = subprocess.run([sys.executable, "-m", "kvstore.cli.main", "route", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for s in ROUTER_SETTINGS:
        assert s.option in out and router_env(s) in out, s.option
    assert "score = prefix_weight * hit - load_weight * load / max_load" in out
    assert "ttft     = overhead + per_token * (uncached + backlog) + per_request * ahead" in out
    assert "--cache-aware-score {estimated-ttft,weighted}" in out


def test_strata_route_serves_and_stops_on_sigterm(tmp_path, engines):
    a = engines("a")
    port = free_port()
    log = tmp_path / "router.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli.main", "route", "--listen", f"127.0.0.1:{port}",
                                 "--endpoint", a.url, "--policy", "round-robin", "--log-format", "text"],
                                stdout=f, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return http("GET", url + "/health", timeout=2)[0] == 200
            except OSError:
                return False

        wait_for(up, "strata route to serve")
        status, _, raw = http("POST", url + "/v1/completions", {"prompt": "w1"})
        assert status == 200 and served_by(raw) == "a"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    bad = subprocess.run([sys.executable, "-m", "kvstore.cli.main", "route", "--endpoint", "nope"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "must look like http://HOST:PORT" in bad.stderr


# ---- the reference engine ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_model(tmp_path_factory):
    pytest.importorskip("torch", reason="the reference engine needs torch")
    pytest.importorskip("transformers", reason="the reference engine needs transformers")
    from benchmarks.e2e.model import build

    return build(tmp_path_factory.mktemp("ref-model"), size="tiny")


VOLATILE = re.compile(rb'"(id|created)": ?("[^"]*"|\d+)')


def test_reference_engine_stream_passes_through(tmp_path, reference_model, routers):
    engine = ReferenceEngine("a", tmp_path, str(reference_model), "--prefix-cache", "none").start()
    try:
        r = routers(endpoint=[engine.url], policy="round-robin")
        body = {"prompt": "the quick brown fox", "max_tokens": 6, "temperature": 0, "stream": True}
        direct = http("POST", engine.url + "/v1/completions", body)[2]
        routed = r.post("/v1/completions", body)[2]
        # Each response has its own id and time; every other byte, event boundaries included, is the engine's.
        assert VOLATILE.sub(b"", routed) == VOLATILE.sub(b"", direct)
        assert routed.endswith(b"data: [DONE]\n\n") and routed.count(b"\n\n") == direct.count(b"\n\n")
    finally:
        engine.kill()


def test_reference_engines_cache_aware_lands_on_the_cached_prefix(tmp_path, reference_model, routers, daemon_process):
    ports = {n: free_port() for n in "ab"}
    sources = ",".join(f"tcp://127.0.0.1:{ports[n]}?engine=engine-{n}&namespace={NS}" for n in "ab")
    daemon = daemon_process("--kv-events", sources)
    engines = [ReferenceEngine(n, tmp_path, str(reference_model), "--prefix-cache", "blocks",
                               kv_events_port=ports[n]).start() for n in "ab"]
    try:
        r = routers(endpoint=[f"{e.url}=engine-{e.name}" for e in engines], policy="cache-aware",
                    model_dir=str(reference_model), index=daemon.target, namespace=NS, hash_seed=HASH_SEED,
                    block_size=BLOCK, index_timeout_seconds=5)
        prompt = "a long shared system prompt about foxes and dogs, " * 3

        def ask(tail: str) -> dict:
            status, _, raw = r.post("/v1/completions", {"prompt": prompt + tail, "max_tokens": 2, "temperature": 0})
            assert status == 200, raw
            return json.loads(raw)

        first = ask("one")["strata"]["engine_id"]
        # The engine's KV events reach the index asynchronously (and a first one may be sent before
        # the daemon's subscription joined): ask until a request is routed for its cached prefix.
        wait_for(lambda: ask("two")["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, "a routed cache hit",
                 timeout=60)
        hits = [ask(f"three {i}") for i in range(3)]
        assert {h["strata"]["engine_id"] for h in hits} == {first}
        assert all(h["usage"]["prompt_tokens_details"]["cached_tokens"] >= BLOCK for h in hits)
        assert r.decisions("cache_hit") >= 3
    finally:
        for e in engines:
            e.kill()
