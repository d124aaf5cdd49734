"""strata route: each policy's choice, the index going down and coming back, endpoint health.

Real processes throughout: stand-in engines (tests/support/router_stand_in.py) on
their own ports publishing vLLM KV events to a real daemon (``strata serve``
with ``--kv-events``), which the router asks through its Score RPC; the
daemon and the engines are SIGKILLed where the test says so.
"""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("aiohttp", reason="the router needs aiohttp (pip install 'strata-kvcache[router]')")
pytest.importorskip("transformers", reason="the cache-aware router needs transformers (pip install 'strata-kvcache[router]')")

from kvstore.client.sync import Client
from kvstore.index.keys import BlockHasher, event_key_bytes
from tests.support.router_stand_in import BLOCK, HASH_SEED, NS, completion, seed, wait_for, words

pytestmark = pytest.mark.system


P_A = words(1, 16)  # 4 blocks of 4 tokens
P_B = words(100, 16)


def cache_aware(fleet, model_dir, **extra) -> dict:
    daemon, a, b = fleet
    return dict(dict(endpoint=[f"{a.url}=engine-a", f"{b.url}=engine-b"], policy="cache-aware",
                     model_dir=str(model_dir), index=daemon.target, namespace=NS, hash_seed=HASH_SEED, block_size=BLOCK,
                     index_timeout_seconds=5.0, index_retry_seconds=0.2), **extra)


# ---- policies --------------------------------------------------------------------------


def test_round_robin_takes_turns(engines, routers):
    a, b = engines("a"), engines("b")
    r = routers(endpoint=[a.url, b.url], policy="round-robin")
    assert [completion(r, f"w{i}") for i in range(4)] == ["a", "b", "a", "b"]
    assert r.decisions("round_robin") == 4


def test_least_loaded_avoids_outstanding_requests_and_the_scraped_queue(engines, routers):
    a, b = engines("a"), engines("b")
    r = routers(endpoint=[a.url, b.url], policy="least-loaded", health_interval_seconds=0.2)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(completion, r, "w1", x_hold="one")
        wait_for(lambda: r.metric("strata_router_endpoint_in_flight_requests", endpoint="0") == 1, "a held request at a")
        assert [completion(r, "w2"), completion(r, "w3")] == ["b", "b"]
        a.admin("release", tag="one")
        assert held.result(timeout=30) == "a"
    b.admin("queue", n=5)  # b's engine reports 5 waiting: its load is 5, a's is 0
    wait_for(lambda: r.metric("strata_router_endpoint_queue_depth_requests", endpoint="1") == 5, "b's queue scraped")
    assert [completion(r, "w4"), completion(r, "w5")] == ["a", "a"]
    assert r.decisions("load") == 5


def test_weighted_score_follows_the_cached_prefix_and_weighs_load(fleet, model_dir, routers):
    daemon, a, b = fleet
    seed(daemon, a, P_A, model_dir)
    seed(daemon, b, P_B, model_dir)
    r = routers(**cache_aware(fleet, model_dir, cache_aware_score="weighted"))
    # The whole cached prefix and more: the holder wins.
    assert completion(r, P_A + " w400 w401") == "a"
    assert completion(r, P_B + " w402") == "b"
    chat = {"model": "m", "messages": [{"role": "user", "content": "w7 w8"}]}
    assert r.post("/v1/chat/completions", chat)[0] == 200
    assert r.decisions("cache_hit") == 2
    # Nothing cached anywhere: least load, taking turns.
    assert r.decisions("load") == 1
    # Two requests held at a: its load is 2, the most (penalty 1). A quarter of the prefix
    # (2 x 0.25 - 1 = -0.5) loses to idle b (0); all of it (2 x 1 - 1 = 1) still wins.
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(completion, r, P_A, x_hold=f"h{i}") for i in range(2)]
        wait_for(lambda: r.metric("strata_router_endpoint_in_flight_requests", endpoint="0") == 2, "two held at a")
        assert completion(r, words(1, 4) + " " + words(300, 12)) == "b"
        assert completion(r, P_A + " w403") == "a"
        a.admin("release", tag="h0")
        a.admin("release", tag="h1")
        assert [h.result(timeout=30) for h in held] == ["a", "a"]


def test_cache_aware_sends_a_request_where_its_estimated_ttft_is_smallest(fleet, model_dir, routers):
    """The estimate's priors fixed (no sample ever replaces them): 0.1 s per uncached token, 0.05 s per
    request ahead, 0.02 s overhead. Picks the weighted score gets the other way round, both ways."""
    daemon, a, b = fleet
    seed(daemon, a, P_A, model_dir)
    r = routers(**cache_aware(fleet, model_dir, ttft_prefill_seconds_per_token=0.1, ttft_seconds_per_request_ahead=0.05,
                              ttft_overhead_seconds=0.02, ttft_min_samples=1 << 20, health_interval_seconds=0.2))
    assert r.metric("strata_router_ttft_model_prefill_seconds_per_token") == 0.1
    assert r.metric("strata_router_ttft_model_seconds_per_request_ahead") == 0.05
    in_flight_at_a = lambda n: lambda: r.metric("strata_router_endpoint_in_flight_requests", endpoint="0") == n
    with ThreadPoolExecutor(2) as pool:
        # P_A whole at a: nothing to prefill there (0.02 s) against 16 tokens at b (1.62 s).
        held = [pool.submit(completion, r, P_A, x_hold="h0")]
        wait_for(in_flight_at_a(1), "one request held at a")
        # A quarter cached at busy a: 0.02 + 0.1 x 12 + 0.05 x 1 = 1.27 s against 1.62 s at idle b.
        # (Weighted: 2 x 0.25 - 1 = -0.5 against 0 at b.)
        assert completion(r, words(1, 4) + " " + words(300, 12)) == "a"
        assert r.decisions("cache_hit") == 2
        # 24 tokens past P_A: 0.02 + 0.1 x 24 + 0.05 = 2.47 s at a against 4.02 s at b.
        held.append(pool.submit(completion, r, P_A + " " + words(400, 24), x_hold="h1"))
        wait_for(in_flight_at_a(2), "two requests held at a")
        assert r.metric("strata_router_endpoint_backlog_prefill_tokens", endpoint="0") == 24
        # All of P_A cached at a, behind 24 tokens of prefill and two requests:
        # 0.02 + 0.1 x (1 + 24) + 0.05 x 2 = 2.62 s against 0.02 + 0.1 x 17 = 1.72 s at idle b.
        # (Weighted: 2 x 1 - 1 = 1 against 0 at b: a.)
        assert completion(r, P_A + " w403") == "b"
        assert r.decisions("cache_bypassed") == 1
        a.admin("release", tag="h0")
        a.admin("release", tag="h1")
        assert [h.result(timeout=30) for h in held] == ["a", "a"]
    wait_for(in_flight_at_a(0), "a's requests answered")
    assert r.metric("strata_router_endpoint_backlog_prefill_tokens", endpoint="0") == 0
    assert completion(r, P_A + " w403", stream=True) == "a"  # a idle again: its cache decides
    samples = sum(r.metric("strata_router_ttft_model_samples_total", kind=k) for k in ("fit", "outlier"))
    assert samples == 1  # the stream's TTFT; the others were not streamed
    a.admin("health", status=503)  # out of rotation: never picked, whatever it holds
    wait_for(lambda: r.metric("strata_router_endpoint_healthy", endpoint="0") == 0, "a out of rotation")
    assert [completion(r, P_A + " w403") for _ in range(2)] == ["b", "b"]


def test_index_down_falls_back_to_least_loaded_and_recovers(fleet, model_dir, routers):
    daemon, a, b = fleet
    seed(daemon, b, P_B, model_dir)
    r = routers(**cache_aware(fleet, model_dir))
    assert completion(r, P_B) == "b"
    assert r.metric("strata_router_index_available") == 1

    daemon.kill()  # SIGKILL
    results = [completion(r, P_B) for _ in range(4)]
    assert sorted(set(results)) == ["a", "b"]  # least-loaded takes turns: the cache no longer decides
    assert r.metric("strata_router_index_available") == 0
    assert r.decisions("fallback_index_down") == 4
    assert r.metric("strata_router_index_query_duration_seconds_count", outcome="error") >= 1

    daemon.start()  # the same address, an empty index
    wait_for(lambda: completion(r, words(200, 8)) and r.metric("strata_router_index_available") == 1,
             "the router to find the index again")
    seed(daemon, a, P_A, model_dir)
    before = r.decisions("cache_hit")
    assert [completion(r, P_A + " w9") for _ in range(3)] == ["a", "a", "a"]
    assert r.decisions("cache_hit") == before + 3


def test_an_index_slower_than_its_deadline_counts_as_down(fleet, model_dir, routers):
    daemon, a, b = fleet
    seed(daemon, b, P_B, model_dir)
    r = routers(**cache_aware(fleet, model_dir, index_timeout_seconds=0.3))
    wait_for(lambda: completion(r, P_B) == "b" and r.decisions("cache_hit") >= 1, "a cache hit at b")
    daemon.proc.send_signal(signal.SIGSTOP)  # connections stay open, nothing answers
    try:
        assert {completion(r, P_B) for _ in range(4)} == {"a", "b"}
        assert r.metric("strata_router_index_available") == 0
        assert r.decisions("fallback_index_down") == 4
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: completion(r, P_B) == "b" and r.metric("strata_router_index_available") == 1,
             "cache-aware routing again")


# ---- health ---------------------------------------------------------------------------


def test_a_killed_endpoint_leaves_rotation_within_one_interval_and_comes_back(engines, routers):
    a, b = engines("a"), engines("b")
    r = routers(endpoint=[a.url, b.url], policy="round-robin", health_interval_seconds=0.3)
    assert sorted(completion(r, f"w{i}") for i in range(2)) == ["a", "b"]
    b.kill()  # returns once the process is gone
    rounds = r.metric("strata_router_health_rounds_total")
    wait_for(lambda: r.metric("strata_router_endpoint_healthy", endpoint="1") == 0, "b out of rotation")
    # Rounds run one after another: the one running now may have checked b before it died,
    # the next one starts after the kill and finds it.
    assert r.metric("strata_router_health_rounds_total") <= rounds + 2
    assert [completion(r, f"w{i}") for i in range(6)] == ["a"] * 6
    b.start()  # the same port again
    wait_for(lambda: r.metric("strata_router_endpoint_healthy", endpoint="1") == 1, "b back in rotation")
    assert sorted(completion(r, f"w{i}") for i in range(2)) == ["a", "b"]


def test_a_failing_health_check_takes_an_endpoint_out(engines, routers):
    a, b = engines("a"), engines("b")
    r = routers(endpoint=[a.url, b.url], policy="round-robin", health_interval_seconds=0.2)
    a.admin("health", status=503)
    wait_for(lambda: r.metric("strata_router_endpoint_healthy", endpoint="0") == 0, "a out of rotation")
    assert [completion(r, f"w{i}") for i in range(3)] == ["b"] * 3
    b.admin("health", status=503)
    wait_for(lambda: r.metric("strata_router_endpoint_healthy", endpoint="1") == 0, "b out of rotation")
    status, headers, raw = r.post("/v1/completions", {"prompt": "w1"})
    assert status == 503 and headers["Retry-After"] == "1"
    assert "no endpoint is in rotation" in json.loads(raw)["error"]["message"]
    from tests.support.router_stand_in import http

    assert http("GET", r.url + "/health")[0] == 503


def test_a_refused_connection_marks_the_endpoint_down_at_once_and_retries_elsewhere(engines, routers):
    a, b = engines("a"), engines("b")
    # Health checks too rare to notice: only the proxied request can find b dead.
    r = routers(endpoint=[a.url, b.url], policy="round-robin", health_interval_seconds=3600)
    b.kill()
    assert [completion(r, f"w{i}") for i in range(4)] == ["a"] * 4
    assert r.metric("strata_router_endpoint_healthy", endpoint="1") == 0
    assert r.metric("strata_router_upstream_errors_total", endpoint="1", kind="connect") == 1
    assert r.decisions("retry") == 1


def test_no_retry_beyond_the_bound(engines, routers):
    a, b = engines("a"), engines("b")
    r = routers(endpoint=[a.url, b.url], policy="round-robin", health_interval_seconds=3600, retries=0)
    b.kill()
    assert completion(r, "w1") == "a"
    status, _, raw = r.post("/v1/completions", {"prompt": "w2"})
    assert status == 502 and "no endpoint accepted the connection" in json.loads(raw)["error"]["message"]
    assert [completion(r, f"w{i}") for i in range(2)] == ["a", "a"]  # b is out now


def test_cache_aware_hashes_a_lora_adapters_requests_and_a_cache_salt_as_vllm_does(fleet, model_dir, routers):
    """A request for a LoRA adapter (named in --lora-adapter) or with a cache_salt has keys of its own
    (vLLM's extra keys): credit goes to the holder of those keys, not of the base model's."""
    from transformers import AutoTokenizer

    daemon, a, b = fleet
    ids = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)(P_A)["input_ids"]
    full = len(ids) // BLOCK * BLOCK
    keys = [event_key_bytes(h) for h in BlockHasher(BLOCK, HASH_SEED, "sql-lora").chain(ids[:full], cache_salt="tenant-1")]
    with Client(daemon.target) as c:  # the daemon's own node holds the adapter's salted blocks
        parent = b""
        for k in keys:
            c.put(NS, k, b"kv" * 64, parent=parent or None)
            parent = k
        wait_for(lambda: (s := c.score(NS, keys=keys, candidates=["router-test-node"])) and s[0].blocks == len(keys),
                 "the daemon's blocks in the index")
    r = routers(**cache_aware(fleet, model_dir, endpoint=[f"{a.url}=engine-a", f"{b.url}=router-test-node"],
                              lora_adapter=["sql-lora"]))
    salted = {"model": "sql-lora", "cache_salt": "tenant-1"}
    assert completion(r, P_A, **salted) == "b"
    assert r.decisions("cache_hit") == 1
    completion(r, P_A, model="sql-lora")  # no salt: other keys, nothing cached
    completion(r, P_A, cache_salt="tenant-1")  # the base model: other keys again
    assert r.decisions("cache_hit") == 1 and r.decisions("load") == 2
