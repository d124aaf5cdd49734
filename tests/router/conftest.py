"""Fixtures of the router tests: stand-in engines as processes, routers in a thread, a tokenizer
folder, and a fleet of two engines publishing KV events to a daemon (tests/support/router_stand_in.py)."""

from __future__ import annotations

import pytest

from benchmarks.harness import free_port
from tests.support.router_stand_in import NS, RouterThread, StandIn, build_tokenizer


@pytest.fixture
def engines(tmp_path):
    """``engines(name, **kw)`` starts a stand-in engine; every one started is killed after the test."""
    started: list[StandIn] = []

    def start(name: str, **kw) -> StandIn:
        e = StandIn(name, tmp_path, **kw).start()
        started.append(e)
        return e

    yield start
    for e in started:
        e.kill()



@pytest.fixture
def routers():
    """``routers(**settings)`` starts a router with those settings; every one started is stopped after the test."""
    from kvstore.config.router import load_router_settings

    started: list[RouterThread] = []

    def start(**settings) -> RouterThread:
        r = RouterThread(load_router_settings(environ={}, listen="127.0.0.1:0", **settings))
        started.append(r)
        return r

    yield start
    for r in started:
        r.stop()



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("model"))



@pytest.fixture
def fleet(tmp_path, model_dir, engines, daemon_process):
    """Engines a and b publishing KV events to a daemon that indexes them as engine-a and engine-b."""
    ports = {n: free_port() for n in "ab"}
    sources = ",".join(f"tcp://127.0.0.1:{ports[n]}?engine=engine-{n}&namespace={NS}" for n in "ab")
    daemon = daemon_process("--kv-events", sources, "--node-id", "router-test-node")
    a = engines("a", kv_events_port=ports["a"], model_dir=str(model_dir))
    b = engines("b", kv_events_port=ports["b"], model_dir=str(model_dir))
    return daemon, a, b
