"""strata route's disaggregated serving (--prefill-endpoint): prefill there, decode with the handoff's params.

Stand-in engines (tests/support/router_stand_in.py) show what each side was sent; the benchmark's
reference engines on real daemons show the KV crossing Strata's handoff (tests/e2e/test_e2e_bench.py).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("aiohttp", reason="the router needs aiohttp (pip install 'strata-kvcache[router]')")

from kvstore.config.router import load_router_settings
from tests.support.router_stand_in import served_by


def _last(engine) -> dict:
    return engine.admin("last")


def test_a_request_is_prefilled_on_the_prefill_engine_then_decoded_with_its_kv_transfer_params(engines, routers):
    prefill, decode = engines("p"), engines("d")
    r = routers(endpoint=[decode.url], prefill_endpoint=[prefill.url], policy="round-robin")
    body = {"model": "m", "prompt": "w1 w2 w3", "max_tokens": 7, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0}
    status, _, raw = r.post("/v1/completions", body)
    assert status == 200 and served_by(raw) == "d"
    asked = _last(prefill)
    assert asked == {"model": "m", "prompt": "w1 w2 w3", "max_tokens": 1, "stream": False, "temperature": 0,
                     "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    assert _last(decode) == {**body, "kv_transfer_params": {"handoff_id": "p-1", "node_id": "p"}}
    assert r.metric("strata_router_disaggregated_requests_total", outcome="handoff") == 1
    assert r.metric("strata_router_prefill_duration_seconds_count") == 1
    # The decode side's policy picks among the --endpoint engines only: the prefill engine decodes nothing.
    for _ in range(3):
        assert served_by(r.post("/v1/completions", {**body, "stream": False})[2]) == "d"
    assert prefill.admin("health", status=200)["served"] == 4


def test_without_a_prefill_engine_the_decode_engine_serves_the_request_whole(engines, routers):
    prefill, decode = engines("p"), engines("d")
    r = routers(endpoint=[decode.url], prefill_endpoint=[prefill.url], policy="round-robin",
                health_interval_seconds=60)
    prefill.kill()  # refused: taken out of rotation at once, and this request still answered
    body = {"model": "m", "prompt": "w1 w2", "max_tokens": 3}
    status, _, raw = r.post("/v1/completions", body)
    assert status == 200 and served_by(raw) == "d"
    assert _last(decode) == body  # no kv_transfer_params: it computes the prompt itself
    assert r.metric("strata_router_disaggregated_requests_total", outcome="prefill_failed") == 1
    status, _, _ = r.post("/v1/completions", body)
    assert status == 200
    assert r.metric("strata_router_disaggregated_requests_total", outcome="no_prefill_endpoint") == 1
    assert r.metric("strata_router_endpoint_healthy", endpoint="1") == 0  # the prefill engine's label follows decode's


def test_a_prefill_answer_without_kv_transfer_params_is_decoded_whole(engines, routers):
    """An engine that is not a disaggregated prefill (it ignores kv_transfer_params): counted, not an error."""
    plain, decode = engines("plain"), engines("d")
    r = routers(endpoint=[decode.url], prefill_endpoint=[plain.url], policy="round-robin")
    body = {"model": "m", "prompt": "w1", "max_tokens": 2, "x_no_kv_transfer": True}
    assert r.post("/v1/completions", body)[0] == 200
    assert _last(decode) == body
    assert r.metric("strata_router_disaggregated_requests_total", outcome="no_kv_transfer_params") == 1


def test_an_engine_given_as_both_prefill_and_decode_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="both a prefill and a decode endpoint"):
        load_router_settings(environ={}, endpoint=["http://127.0.0.1:9001"], prefill_endpoint=["http://127.0.0.1:9001"],
                             policy="round-robin")
    s = load_router_settings(environ={"STRATA_ROUTER_PREFILL_ENDPOINT": "http://127.0.0.1:9002 http://127.0.0.1:9003"},
                             endpoint=["http://127.0.0.1:9001"], policy="round-robin")
    assert s.prefill_endpoints == ["http://127.0.0.1:9002", "http://127.0.0.1:9003"]
    json.dumps(s.prefill_specs())
